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
TrainPipelineSparseDist's reading thread), where that cost lands in host input time.

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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from fxrec.sparse import KeyedJaggedTensor, kjt_from_tensordict, tensordict_from_jagged
from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "PipelineRankingModel", "make_dataset", "run"]


@dataclass(frozen=True)
class BenchConfig:
    tables: int  # unweighted features, one table each
    weighted_tables: int
    rows: int
    dim: int
    batch: int
    dense_in: int
    distinct_batches: int  # batches generated once and cycled through
    rounds: int
    steps_per_round: int
    warmup: int


QUICK = BenchConfig(32, 4, 2000, 16, 256, 13, 6, 4, 6, 2)
FULL = BenchConfig(100, 10, 10000, 32, 1024, 13, 8, 6, 10, 3)


# -- the model -------------------------------------------------------------------------------


class PipelineRankingModel(nn.Module):
    """Unweighted + weighted embedding collections, per-feature processing, two arches.

    Each unweighted feature's pooled embedding goes through its own LayerNorm and Tanh
    (:func:`_per_feature`): the post-lookup chain of seed 000 that fxrec fuses horizontally.
    """

    def __init__(self, cfg: BenchConfig, ebc: nn.Module, webc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.webc = webc
        self.dims = [cfg.dim] * cfg.tables
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.dim) for _ in range(cfg.tables))
        self.dense_arch = nn.Sequential(nn.Linear(cfg.dense_in, 64), nn.ReLU(), nn.Linear(64, 32))
        width = 32 + cfg.dim * (cfg.tables + cfg.weighted_tables)
        self.over_arch = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, features: Any, weighted_features: Any) -> torch.Tensor:
        d = self.dense_arch(dense)
        e = _per_feature(self.ebc(features).values(), self.dims, self.norms)
        w = self.webc(weighted_features).values()
        return self.over_arch(torch.cat([d, e, w], dim=1))


def _per_feature(pooled: torch.Tensor, dims: list[int], norms: nn.ModuleList) -> torch.Tensor:
    """``tanh(norm_k(pooled_k))`` for each feature k, joined again.

    The loop indexes the split (not ``zip``) so that symbolic tracing, which
    :func:`~fxrec.passes.combine_inputs.combine_inputs` needs, can follow it.
    """
    parts = torch.split(pooled, dims, dim=1)
    return torch.cat([torch.tanh(norm(parts[i])) for i, norm in enumerate(norms)], dim=1)


class _PairInput(nn.Module):
    """``model(dense, (features, weighted))``: the pipeline's ``model(dense, sparse)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        return self.model(dense, sparse[0], sparse[1])


def _collections(cfg: BenchConfig) -> tuple[nn.Module, nn.Module]:
    try:
        from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
    except ImportError as exc:
        raise RuntimeError(
            f"the pipeline benchmark needs fxrec.nn.EmbeddingBagCollection: {exc}"
        ) from exc

    def tables(prefix: str, n: int) -> list[Any]:
        return [
            EmbeddingBagConfig(
                num_embeddings=cfg.rows,
                embedding_dim=cfg.dim,
                name=f"{prefix}table_{i}",
                feature_names=[f"{prefix}feature_{i}"],
            )
            for i in range(n)
        ]

    return (
        EmbeddingBagCollection(tables=tables("", cfg.tables)),
        EmbeddingBagCollection(tables=tables("weighted_", cfg.weighted_tables), is_weighted=True),
    )


# -- the data ----------------------------------------------------------------------------------


@dataclass
class _RawBatch:
    """Per-feature arrays as a dataset row group holds them; collated every step."""

    dense: torch.Tensor
    labels: torch.Tensor
    ids: list[torch.Tensor]
    lengths: list[torch.Tensor]
    offsets: list[torch.Tensor]
    weights: list[torch.Tensor | None]


def make_dataset(cfg: BenchConfig, seed: int = 0) -> tuple[list[str], list[str], list[_RawBatch]]:
    """Keys and ``cfg.distinct_batches`` raw batches (Poisson bag sizes, Zipf ids)."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"feature_{i}" for i in range(cfg.tables)]
    wkeys = [f"weighted_feature_{i}" for i in range(cfg.weighted_tables)]
    n = cfg.tables + cfg.weighted_tables
    # Zipf-like profile of mean ids per bag: feature k has mean 40 / (1 + k) ** 0.7, at least 1.
    means = [max(1.0, 40.0 / (1 + k) ** 0.7) for k in torch.randperm(n, generator=g).tolist()]
    ranks = torch.arange(1, cfg.rows + 1, dtype=torch.float64)
    zipf = 1.0 / ranks**1.05
    out = []
    for _ in range(cfg.distinct_batches):
        ids, lens, offs, wts = [], [], [], []
        for f in range(n):
            ln = torch.poisson(torch.full((cfg.batch,), means[f]), generator=g).long()
            total = int(ln.sum())
            ids.append(torch.multinomial(zipf, total, replacement=True, generator=g))
            lens.append(ln)
            o = torch.zeros(cfg.batch + 1, dtype=torch.long)
            torch.cumsum(ln, 0, out=o[1:])
            offs.append(o)
            wts.append(torch.rand(total, generator=g) if f >= cfg.tables else None)
        out.append(
            _RawBatch(
                torch.randn(cfg.batch, cfg.dense_in, generator=g),
                torch.randint(0, 2, (cfg.batch,), generator=g).float(),
                ids,
                lens,
                offs,
                wts,
            )
        )
    return keys, wkeys, out


def _collate_kjt(keys: list[str], raw: _RawBatch, sl: slice, weighted: bool) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys,
        torch.cat(raw.ids[sl]),
        torch.cat(raw.weights[sl]) if weighted else None,  # type: ignore[arg-type]
        lengths=torch.cat(raw.lengths[sl]),
        stride=raw.dense.shape[0],
    )


def _collate_td(keys: list[str], raw: _RawBatch, sl: slice, weighted: bool) -> Any:
    """One NJT per feature over the raw arrays (ids and weights share their offsets)."""
    weights = raw.weights[sl] if weighted else None
    return tensordict_from_jagged(keys, raw.ids[sl], raw.offsets[sl], weights)  # type: ignore[arg-type]


class _Loader:
    """Cycles through the raw batches, giving each as the chosen input type.

    ``pregenerate=n``: the first ``n`` batches are built before the timed steps, each a fresh
    object (KJT: over one buffer per raw batch, collated once; TensorDict: NJTs over the raw
    arrays), as TorchRec's pipeline benchmark feeds pregenerated inputs; the steps then time
    the pipeline, not the loader. Later batches, and all with ``n=0``, are collated in
    ``__next__`` (time in ``host_s``).
    """

    def __init__(
        self,
        keys: list[str],
        wkeys: list[str],
        raws: list[_RawBatch],
        kind: str,
        pregenerate: int = 0,
    ) -> None:
        self.keys, self.wkeys, self.raws, self.kind = keys, wkeys, raws, kind
        self.i = 0
        self.host_s = 0.0
        self.collate = _collate_td if kind == "td" else _collate_kjt
        self._ready: deque[Batch] = deque()
        if pregenerate:
            self._ready.extend(self._pregenerated(pregenerate))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        t0 = time.perf_counter()
        batch = self._ready.popleft() if self._ready else self._collate_next()
        self.host_s += time.perf_counter() - t0
        return batch

    def _collate_next(self) -> Batch:
        raw = self.raws[self.i % len(self.raws)]
        self.i += 1
        n = len(self.keys)
        sparse = (
            self.collate(self.keys, raw, slice(0, n), False),
            self.collate(self.wkeys, raw, slice(n, None), True),
        )
        return Batch(raw.dense, sparse, raw.labels)

    def _pregenerated(self, count: int) -> list[Batch]:
        if self.kind == "td":
            return [self._collate_next() for _ in range(count)]
        first = [self._collate_next() for _ in range(min(count, len(self.raws)))]
        self.i = count  # the raw batch the next collation takes, as if all were collated
        return [  # fresh KJTs over the first collation's buffers
            Batch(b.dense, tuple(_fresh_kjt(k) for k in b.sparse), b.labels)
            for b in (first[j % len(first)] for j in range(count))
        ]


def _fresh_kjt(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A new KJT object (no cached offsets) over ``kjt``'s tensors."""
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        kjt.weights_or_none(),
        lengths=kjt.lengths(),
        stride=kjt.stride(),
    )


def _collate_ms(data: Any, kind: str, reps: int = 7) -> float:
    """Median time the loader takes to collate one batch into ``kind`` (measured apart)."""
    keys, wkeys, raws = data
    loader = _Loader(keys, wkeys, raws, kind)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        next(loader)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


# -- memory ------------------------------------------------------------------------------------


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # not Linux: peak RSS instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- variants ----------------------------------------------------------------------------------


@dataclass
class _Variant:
    name: str
    pipeline: str
    input: str
    fxrec: str
    step: Callable[[], Any]
    loader: _Loader
    stats: Any  # PipelineStats or None
    close: Callable[[], None]
    batch: int
    copies: float = 0.0
    times: list[float] | None = None
    mem: list[float] | None = None


def _fxrec_variant(
    base: nn.Module,
    pipeline_cls: type,
    kind: str,
    on: bool,
    data: Any,
    device: torch.device,
    lr: float,
    pregenerate: int,
) -> _Variant:
    keys, wkeys, raws = data
    loader = _Loader(keys, wkeys, raws, kind, pregenerate)
    model = copy.deepcopy(base).to(device)
    host_fn = None
    if on:
        import fxrec
        from fxrec.passes.combine_inputs import combine_inputs

        example = next(_Loader(keys, wkeys, raws, kind))
        combined, packer = combine_inputs(model, (example.dense, *example.sparse))

        def host_fn(b: Batch, packer: Any = packer) -> Batch:
            return Batch(b.dense, packer(b.dense, *b.sparse)[1], b.labels)

        packed = host_fn(example)
        run_model: nn.Module = fxrec.optimize(
            combined, (packed.dense.to(device), packed.sparse.to(device))
        )
    else:
        run_model = _PairInput(model)
    opt = torch.optim.SGD(run_model.parameters(), lr=lr)
    pipe = pipeline_cls(run_model, opt, device, host_fn=host_fn)
    it = iter(loader)
    pname = (
        "TrainPipelineSparseDist"
        if pipeline_cls is TrainPipelineSparseDist
        else "TrainPipelineBase"
    )
    return _Variant(
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


class _TorchRecLoader(_Loader):
    """The same raw batches collated into TorchRec KJTs, in a TorchRec ``Pipelineable``."""

    def _collate_next(self) -> Any:
        import torchrec

        raw = self.raws[self.i % len(self.raws)]
        self.i += 1
        n = len(self.keys)

        def kjt(keys: list[str], sl: slice, weighted: bool) -> Any:
            return torchrec.KeyedJaggedTensor(
                keys=keys,
                values=torch.cat(raw.ids[sl]),
                weights=torch.cat(raw.weights[sl]) if weighted else None,  # type: ignore[arg-type]
                lengths=torch.cat(raw.lengths[sl]),
                stride=raw.dense.shape[0],
            )

        return _torchrec_batch_type()(
            raw.dense,
            kjt(self.keys, slice(0, n), False),
            kjt(self.wkeys, slice(n, None), True),
            raw.labels,
        )

    def _pregenerated(self, count: int) -> list[Any]:
        import torchrec

        def fresh(k: Any) -> Any:
            return torchrec.KeyedJaggedTensor(
                keys=k.keys(),
                values=k.values(),
                weights=k.weights_or_none(),
                lengths=k.lengths(),
                stride=k.stride(),
            )

        first = [self._collate_next() for _ in range(min(count, len(self.raws)))]
        self.i = count
        batch_type = _torchrec_batch_type()
        return [
            batch_type(b.dense, fresh(b.sparse), fresh(b.wsparse), b.labels)
            for b in (first[j % len(first)] for j in range(count))
        ]


def _torchrec_batch_type() -> type:
    global _TR_BATCH
    if _TR_BATCH is None:
        from torchrec.streamable import Pipelineable

        class TorchRecBatch(Pipelineable):
            def __init__(self, dense: Any, sparse: Any, wsparse: Any, labels: Any) -> None:
                self.dense, self.sparse, self.wsparse, self.labels = dense, sparse, wsparse, labels

            def to(self, device: torch.device, non_blocking: bool = False) -> Any:
                return TorchRecBatch(
                    *(t.to(device=device, non_blocking=non_blocking) for t in self._parts())
                )

            def record_stream(self, stream: Any) -> None:
                for t in self._parts():
                    t.record_stream(stream)

            def pin_memory(self) -> Any:
                return TorchRecBatch(*(t.pin_memory() for t in self._parts()))

            def _parts(self) -> list[Any]:
                return [self.dense, self.sparse, self.wsparse, self.labels]

        _TR_BATCH = TorchRecBatch
    return _TR_BATCH


_TR_BATCH: type | None = None


class _TorchRecModel(nn.Module):
    """The benchmark model on TorchRec's collections; ``forward(batch) -> (loss, logits)``."""

    def __init__(self, base: PipelineRankingModel, ebc: nn.Module, webc: nn.Module) -> None:
        super().__init__()
        self.ebc, self.webc = ebc, webc
        self.dims = list(base.dims)
        self.norms = copy.deepcopy(base.norms)
        self.dense_arch = copy.deepcopy(base.dense_arch)
        self.over_arch = copy.deepcopy(base.over_arch)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dense_arch(batch.dense)
        e = _per_feature(self.ebc(batch.sparse).values(), self.dims, self.norms)
        w = self.webc(batch.wsparse).values()
        logits = self.over_arch(torch.cat([d, e, w], dim=1)).view(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def _torchrec_variants(
    base: PipelineRankingModel, data: Any, lr: float, pregenerate: int
) -> list[_Variant]:
    """TorchRec's pipelines on a DMP of the same model (single-rank gloo group), KJT input."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineBase as TRBase
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TRSparseDist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    keys, wkeys, raws = data
    state = {k: v for k, v in base.state_dict().items()}
    device = torch.device("cpu")

    def tr_ebc(fx_ebc: nn.Module, prefix: str, weighted: bool) -> nn.Module:
        tables = [
            EmbeddingBagConfig(
                num_embeddings=c.num_embeddings,
                embedding_dim=c.embedding_dim,
                name=c.name,
                feature_names=list(c.feature_names),
            )
            for c in fx_ebc.embedding_bag_configs()
        ]
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=device)
        with torch.no_grad():  # same initial weights as fxrec's collection, where keys agree
            for k, v in ebc.state_dict().items():
                src = state.get(f"{prefix}.{k}")
                if src is not None and src.shape == v.shape:
                    v.copy_(src)
        return ebc

    out = []
    for pipeline_cls, pname in (
        (TRBase, "TrainPipelineBase"),
        (TRSparseDist, "TrainPipelineSparseDist"),
    ):
        model = _TorchRecModel(
            base, tr_ebc(base.ebc, "ebc", False), tr_ebc(base.webc, "webc", True)
        )
        for coll in (model.ebc, model.webc):
            apply_optimizer_in_backward(torch.optim.SGD, coll.parameters(), {"lr": lr})
        dmp = DistributedModelParallel(
            module=model, device=device, env=ShardingEnv.from_process_group(dist.group.WORLD)
        )
        dense_opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=lr),
        )
        opt = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
        pipe = pipeline_cls(dmp, opt, device)
        loader = _TorchRecLoader(keys, wkeys, raws, "kjt", pregenerate)
        it = iter(loader)
        v = _Variant(
            f"TorchRec {pname} | KJT | DMP",
            f"torchrec.{pname}",
            "kjt",
            "torchrec",
            (lambda pipe=pipe, it=it: pipe.progress(it)),
            loader,
            None,
            lambda: None,
            raws[0].dense.shape[0],
            copies=float(2 + 2 + 3),  # dense, labels; KJT values, lengths; weighted KJT + weights
        )
        out.append(v)
    return out


def _measure(variants: list[_Variant], cfg: BenchConfig, device: torch.device) -> None:
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
            v.stats.prepared = 0
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
    loader = _Loader(keys, wkeys, raws, "td")
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


def run(quick: bool = False, device: str = "cpu", loader: str = "pregenerated") -> dict[str, Any]:
    """Run the section; print the table, write ``pipeline.json`` and ``pipeline.png``.

    ``loader``: ``"pregenerated"`` (batches built before the timed steps, as TorchRec's
    benchmark does; each input type's collate time is measured apart) or ``"collate"`` (the
    loader collates every batch inside the step loop, on the pipeline's reading thread).
    """
    import torch.distributed as dist

    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    cfg = QUICK if quick else FULL
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
    ebc, webc = _collections(cfg)
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
            variants += _torchrec_variants(base, data, lr, pregen)
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
    collate = {kind: _collate_ms(data, kind) for kind in ("kjt", "td")}
    rows = []
    for v in variants:
        steps = len(v.times or [])
        med = statistics.median(v.times)  # type: ignore[arg-type]
        host = v.loader.host_s / steps * 1e3
        if v.stats is not None:
            host += v.stats.host_s / steps * 1e3
            copies = v.stats.copies / max(v.stats.steps, 1)
        else:
            copies = v.copies
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
