"""Measurement helpers shared by every benchmark section.

Times on a shared 2-core machine drift by orders of magnitude between runs, so every figure
fxrec reports is a *ratio measured side by side*: variants run interleaved step by step
(A, B, A, B, ...) and each variant's median over the same rounds is compared.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("fxrec.bench")

__all__ = [
    "interleaved_medians",
    "interleaved_samples",
    "keep_freed_memory",
    "percentile",
    "print_table",
    "results_dir",
    "write_json",
    "sync",
]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger values on 64-bit


def keep_freed_memory() -> bool:
    """Keep memory freed by tensors in the process (glibc ``mallopt``); True if set.

    By default glibc maps each block above a moving threshold afresh and gives the top of
    the heap back to the kernel as soon as a step's peak has passed, so every training step
    faults its large buffers (gradients of whole tables, activations of fused layers) back in.
    On a virtual machine that reports freed pages to its host this costs tens of milliseconds
    per buffer, at random, and swamps the differences a benchmark compares. Production CPU
    training keeps freed memory (jemalloc, tcmalloc); this does the same with glibc's
    allocator: blocks up to 32 MiB come from the heap, and the heap is never trimmed. It
    changes nothing but where memory comes from, for every variant alike.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl): nothing to set
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and ok
    logger.debug("glibc mallopt: mmap threshold 32 MiB, no trim -> %s", ok)
    return ok


def positive_int(text: str) -> int:
    """An ``argparse`` type for counts and sizes (steps, batch, tables): 1 or more."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def sync(device: str | torch.device = "cpu") -> None:
    """Wait for queued device work so a wall-clock sample covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_samples(
    fns: dict[str, Callable[[], object]],
    steps: int,
    warmup: int = 3,
    device: str | torch.device = "cpu",
) -> dict[str, list[float]]:
    """Per-step wall times (seconds) of each variant, run round-robin in one process."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for step in range(steps):
        # Alternate the order so that no variant always runs right after the same neighbour.
        round_ = order if step % 2 == 0 else order[::-1]
        for name, fn in round_:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return samples


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    steps: int,
    warmup: int = 3,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Median step time (seconds) of each variant, measured interleaved."""
    samples = interleaved_samples(fns, steps, warmup, device)
    return {name: statistics.median(s) for name, s in samples.items()}


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x == 0.0:
            return "0"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3g}"
    return str(x)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print (and return) a plain-text table with aligned columns."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    line = "  ".join("-" * w for w in widths)
    out = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths)), line]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    text = "\n".join(out)
    print(text + "\n", flush=True)
    return text


def results_dir() -> Path:
    """Where benchmark JSON and plots go (``FXREC_BENCH_DIR``, default ``bench_results``)."""
    path = Path(os.environ.get("FXREC_BENCH_DIR", "bench_results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write one section's results, with the environment they were measured in."""
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    path = results_dir() / f"{name}.json"
    path.write_text(json.dumps({"env": env, **payload}, indent=2, default=str))
    logger.info("wrote %s", path)
    return path
