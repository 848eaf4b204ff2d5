"""Benchmark section: grouped embedding lookups vs TorchRec's one-lookup-per-table collection.

Training step (forward + backward + SGD step) of the same tables on the same batch, measured
interleaved in one process, at two shapes:

* ``launch``: 26 tables x batch 256 x 1 id x dim 16 (Criteo-like; few ids per call), with
  10,000 rows per table, with 1,000 (``launch_1k_rows``: launch-bound, the dense gradient is
  small) and with 100,000 (``launch_100k_rows``: filling and applying the dense gradient is
  nearly all of the step, for every dense variant alike; sparse gradients skip it);
* ``wide``: 100 tables x batch 512 x Poisson(20) ids x dim 64, 10,000 rows per table (the
  dense gradient and the backward dominate).

Variants: TorchRec's ``EmbeddingBagCollection`` (when installed); fxrec's collection with
dense gradients (default backend: fbgemm's table-batched op where installed), the same on
pure torch, and fxrec with ``sparse=True`` (SGD takes sparse gradients). Input validation
stays on for fxrec, as by default. Kernels are counted with :func:`fxrec.measure.count_kernels`
(forward and backward separately; deterministic). Figures are ratios against TorchRec
(``> 1`` means fxrec is faster).

On CPU the step runs on one intra-op thread: on a shared 2-core host a 2-thread OpenMP team
waits for descheduled workers and ratios stop being repeatable (see FIELD_NOTES).

Run alone: ``python -m fxrec.bench.embedding [--quick] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxrec.bench.common import interleaved_samples, print_table, write_json
from fxrec.measure import count_kernels
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import KeyedJaggedTensor

__all__ = ["SHAPES", "Shape", "run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    name: str
    tables: int
    batch: int
    ids: float  # ids per bag: exactly this many when ``poisson`` is False, else the mean
    dim: int
    rows: int
    poisson: bool

    def describe(self) -> str:
        ids = f"~{self.ids:g} ids" if self.poisson else f"{self.ids:g} id{'s' * (self.ids != 1)}"
        return (
            f"{self.tables} tables x {self.rows} rows x batch {self.batch} x {ids} x dim {self.dim}"
        )


SHAPES = (
    Shape("launch", 26, 256, 1, 16, 10_000, False),
    Shape("launch_1k_rows", 26, 256, 1, 16, 1_000, False),
    Shape("launch_100k_rows", 26, 256, 1, 16, 100_000, False),
    Shape("wide", 100, 512, 20, 64, 10_000, True),
)


def _batch(shape: Shape, device: str, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    n_bags = shape.tables * shape.batch
    if shape.poisson:
        lengths = torch.poisson(torch.full((n_bags,), float(shape.ids)), generator=g).long()
    else:
        lengths = torch.full((n_bags,), int(shape.ids), dtype=torch.long)
    values = torch.randint(0, shape.rows, (int(lengths.sum()),), generator=g)
    keys = [f"f{i}" for i in range(shape.tables)]
    return KeyedJaggedTensor(keys, values, lengths=lengths).to(device).sync()


def _configs(shape: Shape) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(f"t{i}", shape.rows, shape.dim, [f"f{i}"]) for i in range(shape.tables)
    ]


def _step_fn(
    model: torch.nn.Module, features: Any, opt: torch.optim.Optimizer
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(features).values().sum().backward()
        opt.step()

    return step


def _variants(shape: Shape, device: str, kjt: KeyedJaggedTensor) -> dict[str, Any]:
    """name -> (module, its input)."""
    configs = _configs(shape)
    out: dict[str, Any] = {}
    ref = EmbeddingBagCollection(configs, device=device)
    try:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

        from fxrec.sparse import to_torchrec

        trec = TorchRecEBC(tables=[c.to_torchrec() for c in configs], device=torch.device(device))
        trec.load_state_dict(ref.state_dict())
        out["torchrec"] = (trec, to_torchrec(kjt))
    except ImportError:
        logger.info("torchrec is not installed: no TorchRec column")
    out["fxrec"] = (ref, kjt)
    torch_only = EmbeddingBagCollection(configs, device=device, backend="torch")
    torch_only.load_state_dict(ref.state_dict())
    out["fxrec_torch"] = (torch_only, kjt)
    sparse = EmbeddingBagCollection(configs, device=device, sparse=True)
    sparse.load_state_dict(ref.state_dict())
    out["fxrec_sparse"] = (sparse, kjt)
    return out


def _measure(shape: Shape, device: str, quick: bool) -> dict[str, Any]:
    kjt = _batch(shape, device)
    variants = _variants(shape, device, kjt)
    kernels = {}
    for name, (model, features) in variants.items():
        c = count_kernels(lambda m=model, f=features: m(f).values())
        kernels[name] = {"forward": c.forward, "backward": c.backward}
        model.zero_grad(set_to_none=True)
    fns = {
        name: _step_fn(model, features, torch.optim.SGD(model.parameters(), lr=0.01))
        for name, (model, features) in variants.items()
    }
    big = shape.poisson
    steps = (4 if quick else 15) if big else (30 if quick else 150)
    # Two interleaved rounds; the figure is the median over both, per-round ratios show spread.
    rounds = [interleaved_samples(fns, steps=steps, warmup=2, device=device) for _ in range(2)]
    med = {k: statistics.median(rounds[0][k] + rounds[1][k]) for k in fns}
    per_round = [{k: statistics.median(v) for k, v in r.items()} for r in rounds]
    base = med.get("torchrec")
    groups = len(variants["fxrec"][0].layout().groups)
    result = {
        "shape": shape.describe(),
        "rows_per_table": shape.rows,
        "ids": int(kjt.values().numel()),
        "groups": groups,
        "groups_sparse": len(variants["fxrec_sparse"][0].layout().groups),
        "fbgemm": bool(variants["fxrec"][0]._use_fbgemm),
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "rounds_ms": [{k: v * 1e3 for k, v in r.items()} for r in per_round],
        "round_speedups_vs_torchrec": (
            [{k: r["torchrec"] / v for k, v in r.items()} for r in per_round] if base else None
        ),
        "kernels": kernels,
        "speedup_vs_torchrec": {k: base / v for k, v in med.items()} if base else None,
    }
    del variants, fns
    gc.collect()
    return result


def _goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    for name, r in results.items():
        ratios = r["speedup_vs_torchrec"]
        if not ratios:
            continue
        rounds = ", ".join(f"{x['fxrec']:.2f}x" for x in r["round_speedups_vs_torchrec"])
        goals.append(
            {
                "goal": f"{name}: fxrec (default) step not slower than TorchRec's",
                "met": ratios["fxrec"] >= 1.0,
                "detail": f"{ratios['fxrec']:.2f}x (rounds {rounds}; {r['shape']})",
            }
        )
        best = max((k for k in ratios if k != "torchrec"), key=lambda k: ratios[k])
        goals.append(
            {
                "goal": f"{name}: best fxrec variant vs TorchRec",
                "met": ratios[best] >= 1.0,
                "detail": f"{best} {ratios[best]:.2f}x",
            }
        )
    return goals


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Measure both shapes; print a table; return JSON-able results."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        results = {s.name: _measure(s, device, quick) for s in SHAPES}
    finally:
        torch.set_num_threads(threads)
    rows = []
    for r in results.values():
        ratios = r["speedup_vs_torchrec"] or {}
        for name, ms in r["median_ms"].items():
            k = r["kernels"][name]
            rows.append(
                [
                    r["shape"],
                    name,
                    ms,
                    f"{ratios[name]:.2f}x" if name in ratios else "-",
                    k["forward"],
                    k["backward"],
                ]
            )
    print_table(
        f"embedding: training step (fwd+bwd+SGD), {device}, interleaved medians",
        ["shape", "variant", "step ms", "vs torchrec", "fwd kernels", "bwd kernels"],
        rows,
    )
    return {
        "device": device,
        "threads": 1 if device == "cpu" else threads,
        "quick": quick,
        "shapes": results,
        "goals": _goals(results),
    }


def main() -> None:  # pragma: no cover - CLI
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    write_json("embedding", run(args.quick, args.device))


if __name__ == "__main__":  # pragma: no cover
    main()
