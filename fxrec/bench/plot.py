"""PNG figures for the benchmark (matplotlib, headless Agg backend).

Kernels are the deterministic figure and speedups the noisy one, so the graph section's
figure shows both per case: forward+backward kernels eager vs fxrec (log scale), and the
training-step speedup with the "not slower" line at 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_graph", "plot_scaling"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_graph(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Kernels and speedup per case of the graph section; returns ``path``."""
    plt = _pyplot()
    labels = [f"{r['case']}\nbatch {r['batch']}" for r in rows]
    xs = range(len(rows))
    fig, (ax_k, ax_s) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows)), 8), sharex=True)
    w = 0.2
    series = [
        ("eager", "forward", -1.5, "#9e9e9e"),
        ("eager", "backward", -0.5, "#616161"),
        ("fxrec", "forward", 0.5, "#64b5f6"),
        ("fxrec", "backward", 1.5, "#1565c0"),
    ]
    for who, phase, off, color in series:
        ax_k.bar(
            [x + off * w for x in xs],
            [r["kernels"][who][phase] for r in rows],
            w,
            label=f"{who} {phase}",
            color=color,
        )
    ax_k.set_yscale("log")
    ax_k.set_ylabel("ATen kernels per step")
    ax_k.legend(ncol=4, fontsize=8)
    ax_k.set_title("eager vs fxrec.optimize: kernels and training-step speedup")
    speed = [r["speedup"] for r in rows]
    ax_s.bar(list(xs), speed, 0.6, color=["#2e7d32" if s >= 1 else "#c62828" for s in speed])
    ax_s.axhline(1.0, color="black", lw=0.8)
    for x, s in zip(xs, speed):
        ax_s.text(x, s, f"x{s:.2f}", ha="center", va="bottom", fontsize=7)
    ax_s.set_ylabel("speedup (eager / fxrec)")
    ax_s.set_xticks(list(xs))
    ax_s.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Optimize pass time against graph size; returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["nodes"] for r in rows]
    ax.plot(n, [r["pass_s"] for r in rows], "o-", label="rule passes (search + rewrites)")
    ax.plot(n, [r["optimize_s"] for r in rows], "s--", label="fxrec.optimize (with capture)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("seconds")
    ax.set_title("optimize time vs graph size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
