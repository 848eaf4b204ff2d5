"""``python -m fxrec bench [SECTION ...] [--quick] [--peers] [--device cpu|cuda] [--out DIR]``.

Sections are modules of :mod:`fxrec.bench` exposing ``run(quick, device) -> dict``; the CLI
runs them in order, writes each result to ``<out>/<section>.json`` and ends with the goals
every section checked. A default section whose module is not part of this build is skipped
with a warning (a section asked for by name is an error), so the benchmark runs on any
subset of fxrec. A section that fails is reported and the others still run (exit status 1),
except an equivalence failure, which aborts at once: the optimized model computed
something else, and no figure after that means anything.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("fxrec.bench")

__all__ = ["SECTIONS", "DEFAULT_SECTIONS", "build_parser", "run_cli", "run_sections"]


@dataclass(frozen=True)
class Section:
    module: str
    about: str


SECTIONS: dict[str, Section] = {
    "graph": Section("fxrec.bench.graph", "eager vs fxrec.optimize on reference models"),
    "search": Section("fxrec.bench.search_scaling", "optimize pass time vs graph size"),
    "sparse": Section("fxrec.bench.sparse", "TensorDict -> KJT, combined host-to-device input"),
    "embedding": Section("fxrec.bench.embedding", "grouped vs per-table embedding lookups"),
    "peers": Section("fxrec.bench.peers", "fxrec vs torch.compile and Inductor's batch fusions"),
    "pipeline": Section("fxrec.bench.pipeline", "train pipelines, KJT vs TensorDict input"),
}
DEFAULT_SECTIONS = ("graph", "search", "sparse", "embedding")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxrec", description="fxrec: faster recommendation models by graph rewriting"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = "\n".join(f"  {name:<10} {s.about}" for name, s in SECTIONS.items())
    bench = sub.add_parser(
        "bench",
        help="run the benchmark (eager vs fxrec, side by side)",
        description="Run benchmark sections; print tables; write JSON and PNG.",
        epilog=f"sections:\n{listing}\ndefault: {' '.join(DEFAULT_SECTIONS)} (+ peers with --peers)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("sections", nargs="*", metavar="SECTION", help="sections to run")
    bench.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    bench.add_argument("--peers", action="store_true", help="add the peers section")
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    bench.add_argument("--out", metavar="DIR", help="results folder (default bench_results)")
    bench.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="graph section: only cases whose name contains NAME (repeat for several)",
    )
    bench.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug")
    bench.set_defaults(command_parser=bench)  # errors in its options print its usage
    return parser


def _chosen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    chosen = list(dict.fromkeys(args.sections or DEFAULT_SECTIONS))
    if args.peers and "peers" not in chosen:
        chosen.append("peers")
    return chosen


def _check_device(device: str, parser: argparse.ArgumentParser) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}). Run on a machine with a GPU and a CUDA build of "
            "PyTorch, or use --device cpu."
        )


def _check_out(out: str, parser: argparse.ArgumentParser) -> None:
    """The results folder exists or can be made, before any section runs."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {out}: cannot use it as the results folder ({exc.strerror}).")


def _load(name: str) -> tuple[Any, str | None]:
    """The section's module, or None and why it is not available."""
    mod = SECTIONS[name].module
    if importlib.util.find_spec(mod) is None:
        return None, f"{mod} is not part of this build"
    try:
        return importlib.import_module(mod), None
    except ImportError as exc:  # an optional dependency of that section is missing
        return None, f"{mod} cannot be imported: {exc}"


def _call(run: Any, **options: Any) -> Any:
    """Call a section's ``run`` with the options its signature accepts."""
    params = inspect.signature(run).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items() if v is not None and (takes_all or k in params)}
    return run(**kwargs)


def run_sections(
    names: list[str],
    *,
    quick: bool = False,
    device: str = "cpu",
    only: list[str] | None = None,
    required: bool = False,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run ``names`` in order; returns (results by section, problems by section).

    Sections that are missing are skipped (an error in ``problems`` when ``required``).
    """
    from tqdm import tqdm

    from fxrec.bench.common import write_json
    from fxrec.bench.graph import EquivalenceError

    results: dict[str, Any] = {}
    problems: dict[str, str] = {}
    bar = tqdm(names, desc="fxrec bench", unit="section", disable=None)
    for name in bar:
        bar.set_postfix_str(name)
        module, why = _load(name)
        if module is None:
            if required:
                problems[name] = why or "not available"
            logger.warning("section %s skipped: %s", name, why)
            continue
        t0 = time.perf_counter()
        try:
            result = _call(
                module.run, quick=quick, device=device, only=only if name == "graph" else None
            )
        except EquivalenceError:
            raise
        except Exception as exc:
            logger.exception("section %s failed", name)
            problems[name] = f"{type(exc).__name__}: {exc}"
            continue
        seconds = time.perf_counter() - t0
        payload = result if isinstance(result, dict) else {"result": result}
        payload = {"section": name, "seconds": seconds, **payload}
        results[name] = payload
        try:
            path = write_json(name, payload)
        except OSError as exc:
            problems[name] = f"results not written: {exc}"
            continue
        tqdm.write(f"[{name}] done in {seconds:.0f} s -> {path}")
    bar.close()
    return results, problems


def _summary(results: dict[str, Any], problems: dict[str, str]) -> None:
    from fxrec.bench.common import print_table

    rows = []
    for name, res in results.items():
        for g in res.get("goals", []) if isinstance(res, dict) else []:
            if isinstance(g, dict) and "goal" in g:
                rows.append([name, g["goal"], "yes" if g.get("met") else "NO", g.get("detail", "")])
    if rows:
        print_table("fxrec bench: goals", ["section", "goal", "met", "measured"], rows)
    for name, why in problems.items():
        print(f"section {name}: {why}", file=sys.stderr)


def run_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Carry out a parsed ``fxrec`` command line; returns the exit status."""
    if args.command != "bench":  # pragma: no cover - argparse only knows bench
        parser.error(f"unknown command {args.command!r}")
    parser = getattr(args, "command_parser", parser)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    names = _chosen(args, parser)
    _check_device(args.device, parser)
    from fxrec.bench.common import keep_freed_memory

    keep_freed_memory()
    if args.only and "graph" not in names:
        parser.error("--only selects cases of the graph section; add 'graph' to the sections")
    if args.out:
        _check_out(args.out, parser)
        os.environ["FXREC_BENCH_DIR"] = args.out
    results, problems = run_sections(
        names,
        quick=args.quick,
        device=args.device,
        only=args.only,
        required=bool(args.sections),
    )
    _summary(results, problems)
    return 1 if problems else 0
