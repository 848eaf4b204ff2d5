"""Benchmark section: train pipelines x input type x fxrec on/off (seed 002).

A ranking model with many tables (``fxrec.EmbeddingBagCollection`` for unweighted and for
weighted features, a LayerNorm and Tanh per unweighted feature, a dense arch, an over arch)
trains on synthetic batches whose ids per bag follow a Poisson law around a per-feature mean
drawn from a Zipf-like profile (a few heavy features, many light ones) and whose ids are
Zipf-distributed over each table's rows. The loader turns per-feature arrays into a
``KeyedJaggedTensor`` (one ``cat``) or a ``TensorDict`` of jagged tensors (one NJT per feature
over the raw arrays, :func:`fxrec.sparse.tensordict_from_jagged`). By default every batch is
built before the timed steps, one fresh object per step, as TorchRec's pipeline benchmark
feeds pregenerated inputs, so the steps compare how the pipelines handle each input type
(TD->KJT conversion or packing, copies); what one batch costs the loader is measured apart
and printed. ``--loader collate`` builds each batch inside the step loop instead (on
TrainPipelineSparseDist's reading thread), where that cost lands in host input time. The
model and data live in :mod:`fxrec.bench.pipeline_data`, the TorchRec peer in
:mod:`fxrec.bench.pipeline_peer`.

Variants, all on the same model weights and the same batches, run interleaved round by round:

* ``TrainPipelineBase`` / ``TrainPipelineSparseDist`` x KJT / TensorDict input x fxrec off
  (the eager model) / on (:func:`fxrec.passes.combine_inputs.combine_inputs`: one
  ``CombinedFeatures`` per batch packed on the host by the pipeline's ``host_fn``, then
  ``fxrec.optimize``);
* TorchRec's own ``TrainPipelineBase`` / ``TrainPipelineSparseDist`` on a
  ``DistributedModelParallel`` of the same model over a single-rank gloo group, KJT input
  (when torchrec is installed and the run is single-process).

Figures per variant: ``Runtime (P90)`` per step, ``Memory (P90)`` (CPU: the process's
resident set after each step; CUDA: ``max_memory_allocated`` per step), throughput (samples/s
at the median step), host time spent on inputs per step (loader + pipeline host step +
copy; wall time, so in TrainPipelineSparseDist's background thread it includes waiting
for the GIL), the TD->KJT conversion of TensorDict input without fxrec (measured apart: in the
model's step, or in the pipeline's host stage once the pipeline has seen the model convert,
where it is part of the host input time), and host-to-device copies per batch. The goals
compare two variants round by round (the median over rounds of their paired step-time
ratio, with its lowest and highest round), so that the machine's drift between rounds
cancels.

Run: ``python -m fxrec bench pipeline [--quick]``, alone ``python -m fxrec.bench.pipeline
[--quick] [--loader pregenerated|collate]``, or ``torchrun --nproc-per-node 2 -m
fxrec.bench.pipeline --quick`` (tables sharded with ``fxrec.distributed.shard``; rank 0
reports).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from fxrec.bench.common import (
    keep_freed_memory,
    percentile,
    print_table,
    results_dir,
    write_json,
)
from fxrec.bench.pipeline_data import (
    FULL,
    QUICK,
    BenchConfig,
    Loader,
    PairInput,
    PipelineRankingModel,
    Variant,
    collate_ms,
    make_collections,
    make_dataset,
)
from fxrec.sparse import kjt_from_tensordict
from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist

logger = logging.getLogger(__name__)

__all__ = ["FULL", "QUICK", "BenchConfig", "PipelineRankingModel", "make_dataset", "run"]

# -- memory ------------------------------------------------------------------------------------


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # not Linux: peak RSS instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- variants ----------------------------------------------------------------------------------


def _fxrec_variant(
    base: nn.Module,
    pipeline_cls: type,
    kind: str,
    on: bool,
    data: Any,
    device: torch.device,
    lr: float,
    pregenerate: int,
) -> Variant:
    keys, wkeys, raws = data
    loader = Loader(keys, wkeys, raws, kind, pregenerate)
    model = copy.deepcopy(base).to(device)
    host_fn = None
    if on:
        import fxrec
        from fxrec.passes.combine_inputs import combine_inputs

        example = next(Loader(keys, wkeys, raws, kind))
        combined, packer = combine_inputs(model, (example.dense, *example.sparse))

        def host_fn(b: Batch, packer: Any = packer) -> Batch:
            return Batch(b.dense, packer(b.dense, *b.sparse)[1], b.labels)

        packed = host_fn(example)
        run_model: nn.Module = fxrec.optimize(
            combined, (packed.dense.to(device), packed.sparse.to(device))
        )
    else:
        run_model = PairInput(model)
    opt = torch.optim.SGD(run_model.parameters(), lr=lr)
    pipe = pipeline_cls(run_model, opt, device, host_fn=host_fn)
    it = iter(loader)
    pname = (
        "TrainPipelineSparseDist"
        if pipeline_cls is TrainPipelineSparseDist
        else "TrainPipelineBase"
    )
    return Variant(
        f"{pname} | {kind.upper()} | fxrec {'on' if on else 'off'}",
        pname,
        kind,
        "on" if on else "off",
        lambda: pipe.progress(it),
        loader,
        pipe.stats,
        pipe.close,
        raws[0].dense.shape[0],
    )


def _measure(variants: list[Variant], cfg: BenchConfig, device: torch.device) -> None:
    from tqdm import tqdm

    on_gpu = device.type == "cuda"
    for v in variants:
        v.times, v.mem = [], []
    for v in variants:
        for _ in range(cfg.warmup):
            v.step()
    for v in variants:  # counters cover the measured steps only
        v.loader.host_s = 0.0
        if v.stats is not None:
            v.stats.host_s, v.stats.copies, v.stats.steps = 0.0, 0, 0
            v.stats.prepared = v.stats.sent_early = 0
    total = cfg.rounds * len(variants) * cfg.steps_per_round
    bar = tqdm(total=total, desc="pipeline", unit="step", disable=None, leave=False)
    for r in range(cfg.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            for _ in range(cfg.steps_per_round):
                if on_gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                v.step()
                if on_gpu:
                    torch.cuda.synchronize()
                v.times.append(time.perf_counter() - t0)  # type: ignore[union-attr]
                v.mem.append(  # type: ignore[union-attr]
                    torch.cuda.max_memory_allocated() / 2**20 if on_gpu else _rss_mb()
                )
                bar.update(1)
    bar.close()


def _td_conversion_ms(data: Any, reps: int = 5) -> float:
    """Median time of the TD->KJT conversions the eager model does inside each step."""
    keys, wkeys, raws = data
    loader = Loader(keys, wkeys, raws, "td")
    samples = []
    for _ in range(reps):
        b = next(loader)
        t0 = time.perf_counter()
        kjt_from_tensordict(b.sparse[0])
        kjt_from_tensordict(b.sparse[1])
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _plot(rows: list[dict[str, Any]], path: Any) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2))
    names = [r["variant"] for r in rows]
    ys = range(len(rows))
    colors = [
        "#1565c0" if r["fxrec"] == "on" else "#9e9e9e" if r["fxrec"] == "off" else "#ef6c00"
        for r in rows
    ]
    ax_t.barh(ys, [r["throughput"] for r in rows], color=colors)
    ax_t.set_yticks(list(ys), names, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("samples / s (median step)")
    ax_t.set_title("Throughput (blue: fxrec on, grey: off, orange: TorchRec)")
    ax_r.barh(ys, [r["runtime_p90_ms"] for r in rows], color=colors)
    ax_r.set_yticks(list(ys), [""] * len(rows))
    ax_r.invert_yaxis()
    ax_r.set_xlabel("ms per step (P90)")
    ax_r.set_title("Runtime (P90)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LOADERS = ("pregenerated", "collate")


def run(
    quick: bool = False,
    device: str = "cpu",
    loader: str = "pregenerated",
    config: BenchConfig | None = None,
) -> dict[str, Any]:
    """Run the section; print the table, write ``pipeline.json`` and ``pipeline.png``.

    ``loader``: ``"pregenerated"`` (batches built before the timed steps, as TorchRec's
    benchmark does; each input type's collate time is measured apart) or ``"collate"`` (the
    loader collates every batch inside the step loop, on the pipeline's reading thread).
    ``config`` replaces the quick/full sizes.
    """
    import torch.distributed as dist

    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    cfg = config if config is not None else QUICK if quick else FULL
    dev = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        from fxrec.distributed import init_distributed

        if not dist.is_initialized():
            init_distributed("nccl" if dev.type == "cuda" else "gloo")
        rank = dist.get_rank()
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.manual_seed(0)  # every rank builds the same model
    ebc, webc = make_collections(cfg)
    base = PipelineRankingModel(cfg, ebc, webc)
    if world > 1:
        from fxrec.distributed import shard

        base.ebc, base.webc = shard(base.ebc), shard(base.webc)
    data = make_dataset(cfg, seed=1 + rank)
    lr = 0.05
    # every batch a step can draw: warmup, measured steps, and the read-ahead of the queue
    pregen = cfg.warmup + cfg.rounds * cfg.steps_per_round + 4 if loader == "pregenerated" else 0
    variants = [
        _fxrec_variant(base, p, kind, on, data, dev, lr, pregen)
        for p in (TrainPipelineBase, TrainPipelineSparseDist)
        for kind in ("kjt", "td")
        for on in (False, True)
    ]
    peer_note = ""
    had_group = dist.is_available() and dist.is_initialized()
    if world == 1:
        try:
            from fxrec.bench.pipeline_peer import torchrec_variants

            variants += torchrec_variants(base, data, lr, pregen)
        except ImportError as exc:
            peer_note = f"TorchRec peer skipped: {exc}"
        except Exception as exc:  # the peer must never take the section down
            peer_note = f"TorchRec peer failed: {type(exc).__name__}: {exc}"
            logger.warning("%s", peer_note)
    else:
        peer_note = "TorchRec peer runs single-process only"
    try:
        _measure(variants, cfg, dev)
    finally:
        for v in variants:
            v.close()
        if world == 1 and not had_group and dist.is_initialized():
            dist.destroy_process_group()  # the peer's single-rank group: leave none behind
    td_conv = _td_conversion_ms(data)
    collate = {kind: collate_ms(data, kind) for kind in ("kjt", "td")}
    rows = []
    for v in variants:
        steps = len(v.times or [])
        med = statistics.median(v.times)  # type: ignore[arg-type]
        host = v.loader.host_s / steps * 1e3
        if v.stats is not None:
            host += v.stats.host_s / steps * 1e3
            copies = v.stats.copies / max(v.stats.steps, 1)
            early = v.stats.sent_early / max(v.stats.steps, 1)
        else:
            copies, early = v.copies, 0.0
        # Without fxrec the model converts TD input itself; the pipelines move that
        # conversion into their host stage once they have seen it (then it is host input).
        conv = td_conv if (v.input == "td" and v.fxrec == "off") else 0.0
        ahead = v.stats is not None and v.stats.prepared > 0
        rows.append(
            {
                "variant": v.name,
                "pipeline": v.pipeline,
                "input": v.input,
                "fxrec": v.fxrec,
                "runtime_p50_ms": med * 1e3,
                "runtime_p90_ms": percentile(v.times, 90) * 1e3,  # type: ignore[arg-type]
                "memory_p90_mb": percentile(v.mem, 90),  # type: ignore[arg-type]
                "throughput": v.batch / med,
                "host_input_ms": host,
                "td_to_kjt_in_step_ms": 0.0 if ahead else conv,
                "td_to_kjt_in_host_stage_ms": conv if ahead else 0.0,
                "h2d_copies_per_batch": copies,
                "ids_sent_early": early,  # share of steps whose ids went out a step ahead
                "round_p50_ms": [
                    statistics.median(v.times[r : r + cfg.steps_per_round]) * 1e3  # type: ignore[index]
                    for r in range(0, steps, cfg.steps_per_round)
                ],
            }
        )
    result: dict[str, Any] = {
        "config": cfg.__dict__,
        "device": str(dev),
        "world_size": world,
        "loader": loader,
        "loader_collate_ms": collate,
        "memory_kind": "cuda max_memory_allocated per step"
        if dev.type == "cuda"
        else "process RSS after each step",
        "rows": rows,
        "goals": _goals(rows),
        "note": peer_note,
    }
    if rank == 0:
        mem = "Memory (P90) MB" + (" CUDA" if dev.type == "cuda" else " RSS")
        print_table(
            f"Train pipelines, {cfg.tables}+{cfg.weighted_tables} tables, batch {cfg.batch}, "
            f"{world} rank(s), {dev} ({cfg.rounds}x{cfg.steps_per_round} steps per variant)",
            [
                "variant",
                "Runtime (P90) ms",
                "P50 ms",
                mem,
                "samples/s",
                "host input ms",
                "TD->KJT in step ms",
                "TD->KJT in host stage ms",
                "H2D copies",
                "ids sent early",
            ],
            [
                [
                    r["variant"],
                    r["runtime_p90_ms"],
                    r["runtime_p50_ms"],
                    r["memory_p90_mb"],
                    r["throughput"],
                    r["host_input_ms"],
                    r["td_to_kjt_in_step_ms"],
                    r["td_to_kjt_in_host_stage_ms"],
                    r["h2d_copies_per_batch"],
                    f"{r['ids_sent_early']:.0%}",
                ]
                for r in rows
            ],
        )
        where = (
            "before the timed steps (pregenerated)"
            if loader == "pregenerated"
            else "in the step loop (in host input ms)"
        )
        print(
            f"loader: batches collated {where}; one batch costs the loader "
            f"{collate['kjt']:.2f} ms as a KJT, {collate['td']:.2f} ms as a TensorDict"
        )
        for g in result["goals"]:
            print(f"goal {g['goal']}: {g['detail']} -> {'met' if g['met'] else 'NOT met'}")
        if peer_note:
            print(peer_note)
        write_json("pipeline", result)
        result["plot"] = str(_plot(rows, results_dir() / "pipeline.png"))
    return result


def _speedup(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """How much faster variant ``a`` ran than ``b``, and its spread.

    With per-round medians (the variants run interleaved, round by round): the median over
    rounds of ``b``'s step time over ``a``'s in the same round, which cancels the machine's
    drift between rounds; the detail gives the lowest and highest round. Otherwise the ratio
    of throughputs.
    """
    ra, rb = a.get("round_p50_ms"), b.get("round_p50_ms")
    if ra and rb and len(ra) == len(rb):
        ratios = sorted(y / x for x, y in zip(ra, rb))
        return statistics.median(ratios), f" (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})"
    return a["throughput"] / b["throughput"], ""


def _goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three goals, each as ``{"goal", "met", "detail", "value"}``; ratios are
    paired by round when the rows carry per-round medians (see :func:`_speedup`)."""
    by = {(r["pipeline"], r["input"], r["fxrec"]): r for r in rows}
    sd, bs = "TrainPipelineSparseDist", "TrainPipelineBase"
    goals: list[dict[str, Any]] = []

    def add(goal: str, met: bool, detail: str, value: float) -> None:
        goals.append({"goal": goal, "met": met, "detail": detail, "value": value})

    for f in ("on", "off"):
        kjt, td = by.get((sd, "kjt", f)), by.get((sd, "td", f))
        if kjt and td:
            ratio, spread = _speedup(td, kjt)
            gap = (1 - ratio) * 100
            add(
                f"TD within 2% of KJT throughput ({sd}, fxrec {f})",
                gap <= 2,
                f"gap {gap:+.1f}%{spread}",
                gap,
            )
    for i in ("kjt", "td"):
        for f in ("on", "off"):
            a, b = by.get((sd, i, f)), by.get((bs, i, f))
            if a and b:
                ratio, spread = _speedup(a, b)
                add(
                    f"{sd} faster than {bs} ({i}, fxrec {f})",
                    ratio > 1,
                    f"{ratio:.2f}x{spread}",
                    ratio,
                )
    for p in (bs, sd):
        for i in ("kjt", "td"):
            a, b = by.get((p, i, "on")), by.get((p, i, "off"))
            if a and b:
                ratio, spread = _speedup(a, b)
                add(
                    f"fxrec on faster than off ({p}, {i})",
                    ratio > 1,
                    f"{ratio:.2f}x{spread}",
                    ratio,
                )
    return goals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--loader",
        choices=LOADERS,
        default="pregenerated",
        help="build batches before the timed steps (as TorchRec's benchmark) or in the loop",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    keep_freed_memory()
    run(quick=args.quick, device=args.device, loader=args.loader)


if __name__ == "__main__":
    main()
