"""Compute/communication overlap on 2 ranks: blocking vs overlapped training steps.

Run: ``torchrun --nproc-per-node 2 -m fxrec.bench.overlap [--quick]``.

Model: table-wise sharded embedding tables (ids and pooled embeddings travel by
all-to-all) and a dense MLP independent of the embeddings, written dense-first as TorchRec's
DLRM is. Variants, both the same captured graph:

* ``blocking``: the written order (each wait right after its request, dense arch first);
* ``overlapped``: after the ``overlap_comm`` rule (requests first; the dense arch's layers
  shared among the windows of the three exchanges: id counts, ids, pooled embeddings).

They run interleaved step by step on the same batches; each rank records its step time and
the time it spent blocked in communication (inside the waits of the forward pass; the
backward all-to-all is the same in both). Outputs are compared every step. Results go to
``overlap.json`` and ``overlap.png`` (per rank, the distribution over steps of both times).

Threads: each rank calls ``torch.set_num_threads(1)`` (1 intra-op thread; 2 ranks on 2
cores; torchrun also sets ``OMP_NUM_THREADS=1`` unless it is set already); gloo's own
transport threads (2 per process by default) share the same cores, so communication costs
CPU here rather than running on a NIC. Other processes on the machine take cores from both
variants alike (interleaved steps), but make the figures noisy.

``--compute-nice N`` lowers the compute thread's priority after the process group has started
gloo's threads: when data arrives, the kernel then runs gloo's threads at once instead of
after the compute's time slice, which is what a NIC or spare cores would give. With all
cores busy computing, the exchanges otherwise progress mostly inside the waits.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fxrec
from fxrec.bench.common import (
    keep_freed_memory,
    percentile,
    positive_int,
    print_table,
    results_dir,
    write_json,
)
from fxrec.distributed import comm, init_distributed, shard
from fxrec.sparse import KeyedJaggedTensor

logger = logging.getLogger("fxrec.bench.overlap")

THREADS_PER_RANK = 1  # intra-op; 2 ranks share 2 cores with gloo's transport threads


class DenseFirstDLRM(nn.Module):
    """Dense arch, then sparse arch, then an over arch reading both (TorchRec DLRM's order)."""

    def __init__(self, sparse: nn.Module, dense_in: int, hidden: int, emb_width: int) -> None:
        super().__init__()
        self.dense = nn.Sequential(
            nn.Linear(dense_in, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 64),
        )
        self.sparse = sparse
        self.over = nn.Linear(64 + emb_width, 1)

    def forward(self, dense: torch.Tensor, features: Any) -> torch.Tensor:
        d = self.dense(dense)
        kt = self.sparse(features)
        return self.over(torch.cat([d, kt.values()], 1))


def _lower_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread; threads started
    before, such as gloo's, keep theirs). Elsewhere: a warning, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError) as exc:
        logger.warning("--compute-nice: cannot change this thread's priority here: %s", exc)


def _batch(
    names: list[str], rows: int, batch: int, ids_per_bag: int, seed: int
) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * ids_per_bag, (len(names) * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(names, values, lengths=lengths)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few steps (smoke run)")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--batch", type=positive_int, default=1024)
    p.add_argument("--tables", type=positive_int, default=8)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--rows", type=positive_int, default=5000)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument(
        "--row-wise",
        type=int,
        default=0,
        metavar="K",
        help="split the first K tables by rows over every rank (the rest stay table-wise)",
    )
    p.add_argument(
        "--compute-nice",
        type=int,
        default=0,
        metavar="N",
        help="lower the compute thread's priority by N (1-19) after the process group has "
        "started gloo's threads, so that they preempt the compute when data arrives",
    )
    args = p.parse_args(argv)
    if not 0 <= args.compute_nice <= 19:
        p.error(f"--compute-nice takes 0..19, got {args.compute_nice}")
    steps = args.steps if args.steps is not None else (10 if args.quick else 60)

    torch.set_num_threads(THREADS_PER_RANK)
    keep_freed_memory()
    init_distributed("gloo", timeout=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.compute_nice:
        _lower_this_thread(args.compute_nice)
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    names = [f"f{i}" for i in range(args.tables)]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}", feature_names=[n]
            )
            for i, n in enumerate(names)
        ]
    )
    row_wise = [f"t{i}" for i in range(min(args.row_wise, args.tables))]
    model = DenseFirstDLRM(shard(ebc, row_wise=row_wise), 256, args.hidden, args.tables * args.dim)
    dense = torch.randn(args.batch, 256, generator=torch.Generator().manual_seed(rank))
    example = (dense, _batch(names, args.rows, args.batch, 4, 1000 + rank))
    variants = {
        "blocking": fxrec.optimize(model, example, rules=[]),
        "overlapped": fxrec.optimize(model, example, rules=["overlap_comm"]),
    }
    report = str(variants["overlapped"].fxrec_report)

    kinds: dict[str, dict[str, float]] = {k: {} for k in variants}

    def step(fn: Any, kjt: KeyedJaggedTensor) -> tuple[float, float, torch.Tensor]:
        comm.stats.reset()
        t0 = time.perf_counter()
        out = fn(dense, kjt)
        out.sum().backward()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt, comm.stats.total(), out.detach()

    warmup = 3
    times: dict[str, list[float]] = {k: [] for k in variants}
    blocked: dict[str, list[float]] = {k: [] for k in variants}
    identical = True
    order = list(variants)
    for i in range(warmup + steps):
        kjt = _batch(names, args.rows, args.batch, 4, 10_000 * (i + 1) + rank)
        outs = {}
        for name in order if i % 2 == 0 else order[::-1]:
            dt, bt, out = step(variants[name], kjt)
            outs[name] = out
            if i >= warmup:
                for kind, sec in comm.stats.seconds.items():
                    kinds[name][kind] = kinds[name].get(kind, 0.0) + sec / steps
                times[name].append(dt)
                blocked[name].append(bt)
        identical &= torch.equal(outs["blocking"], outs["overlapped"])

    mine = {"times": times, "blocked": blocked, "by_kind": kinds, "identical": identical}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        _summarize(gathered, args, steps, report)
    dist.barrier()
    dist.destroy_process_group()


def _stats(xs: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(xs) * 1e3,
        "p10_ms": percentile(xs, 10) * 1e3,
        "p90_ms": percentile(xs, 90) * 1e3,
    }


def _nice_note(args: argparse.Namespace) -> str:
    return f", compute thread at nice +{args.compute_nice}" if args.compute_nice else ""


def _summarize(per_rank: list[dict], args: argparse.Namespace, steps: int, report: str) -> None:
    rows = []
    payload: dict[str, Any] = {
        "config": vars(args)
        | {"steps": steps, "threads_per_rank": THREADS_PER_RANK, "ranks": len(per_rank)},
        "ranks": [],
        "report": report,
    }
    for r, d in enumerate(per_rank):
        t, b = d["times"], d["blocked"]
        diff = [x - y for x, y in zip(t["blocking"], t["overlapped"])]
        bdiff = [x - y for x, y in zip(b["blocking"], b["overlapped"])]
        st = {k: _stats(v) for k, v in t.items()}
        sb = {k: _stats(v) for k, v in b.items()}
        sd, sbd = _stats(diff), _stats(bdiff)
        blocked_cut = 1 - sb["overlapped"]["median_ms"] / max(sb["blocking"]["median_ms"], 1e-9)
        step_cut = sd["median_ms"] / st["blocking"]["median_ms"]
        rows.append(
            [
                r,
                st["blocking"]["median_ms"],
                st["overlapped"]["median_ms"],
                f"{sd['median_ms']:.2f} [{sd['p10_ms']:.2f}, {sd['p90_ms']:.2f}]",
                f"{step_cut:+.0%}",
                sb["blocking"]["median_ms"],
                sb["overlapped"]["median_ms"],
                f"{blocked_cut:.0%}",
                d["identical"],
            ]
        )
        payload["ranks"].append(
            {
                "rank": r,
                "step": st,
                "blocked": sb,
                "paired_step_diff": sd,
                "paired_blocked_diff": sbd,
                "blocked_reduction": blocked_cut,
                "step_reduction": step_cut,
                "outputs_identical": d["identical"],
                "blocked_mean_by_kind_ms": {
                    v: {k: s * 1e3 for k, s in kk.items()} for v, kk in d["by_kind"].items()
                },
                "raw": d,
            }
        )
    print_table(
        f"overlap: {len(per_rank)} ranks gloo loopback, {args.tables} tables x {args.rows} x "
        f"{args.dim}{f' ({args.row_wise} row-wise)' if args.row_wise else ''}, batch {args.batch}/rank, MLP 256-{args.hidden}-{args.hidden}-64, train "
        f"step, {steps} interleaved steps, torch.set_num_threads({THREADS_PER_RANK}) per rank "
        f"+ gloo's transport threads{_nice_note(args)} (ms; diff = blocking - overlapped, median [p10, p90] of "
        "paired steps)",
        [
            "rank",
            "step blocking",
            "step overlapped",
            "paired diff",
            "step cut",
            "blocked blocking",
            "blocked overlapped",
            "blocked cut",
            "identical",
        ],
        rows,
    )
    for r, d in enumerate(per_rank):
        parts = "; ".join(
            f"{v}: " + ", ".join(f"{k} {s * 1e3:.2f}" for k, s in sorted(kk.items()))
            for v, kk in d["by_kind"].items()
        )
        print(f"rank {r} mean blocked ms by kind: {parts}")
    print(report, flush=True)
    path = write_json("overlap", payload)
    plot = _plot(per_rank, results_dir() / "overlap.png")
    print(f"wrote {path} and {plot}", flush=True)


def _plot(per_rank: list[dict], path: Any) -> Any:
    """Per rank, the distribution over steps of blocked time and step time, both variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, title in (
        (axes[0], "blocked", "blocked in communication (forward waits)"),
        (axes[1], "times", "training step"),
    ):
        data, labels = [], []
        for r, d in enumerate(per_rank):
            for variant in ("blocking", "overlapped"):
                data.append([x * 1e3 for x in d[what][variant]])
                labels.append(f"rank {r}\n{variant}")
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
