"""The pipeline benchmark's model and data (see :mod:`fxrec.bench.pipeline`).

A ranking model with many tables, synthetic batches whose ids per bag follow a Poisson law
around a per-feature mean drawn from a Zipf-like profile and whose ids are Zipf-distributed
over each table's rows, and the loader that gives them as KJTs or TensorDicts (collated per
step, or built before the timed steps). ``Variant`` holds one measured configuration.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxrec.sparse import KeyedJaggedTensor, tensordict_from_jagged
from fxrec.train import Batch

__all__ = [
    "FULL",
    "QUICK",
    "BenchConfig",
    "Loader",
    "PairInput",
    "PipelineRankingModel",
    "Variant",
    "collate_ms",
    "fresh_kjt",
    "make_collections",
    "make_dataset",
    "per_feature",
]


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
    (:func:`per_feature`): the post-lookup chain of seed 000 that fxrec fuses horizontally.
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
        e = per_feature(self.ebc(features).values(), self.dims, self.norms)
        w = self.webc(weighted_features).values()
        return self.over_arch(torch.cat([d, e, w], dim=1))


def per_feature(pooled: torch.Tensor, dims: list[int], norms: nn.ModuleList) -> torch.Tensor:
    """``tanh(norm_k(pooled_k))`` for each feature k, joined again.

    The loop indexes the split (not ``zip``) so that symbolic tracing, which
    :func:`~fxrec.passes.combine_inputs.combine_inputs` needs, can follow it.
    """
    parts = torch.split(pooled, dims, dim=1)
    return torch.cat([torch.tanh(norm(parts[i])) for i, norm in enumerate(norms)], dim=1)


class PairInput(nn.Module):
    """``model(dense, (features, weighted))``: the pipeline's ``model(dense, sparse)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        return self.model(dense, sparse[0], sparse[1])


def make_collections(cfg: BenchConfig) -> tuple[nn.Module, nn.Module]:
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


class Loader:
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

    def _pregenerated(self, count: int) -> list[Any]:
        if self.kind == "td":
            return [self._collate_next() for _ in range(count)]
        first = [self._collate_next() for _ in range(min(count, len(self.raws)))]
        self.i = count  # the raw batch the next collation takes, as if all were collated
        return [self._refresh(first[j % len(first)]) for j in range(count)]

    def _refresh(self, batch: Any) -> Any:
        """The same batch with new KJT objects over the same buffers."""
        return Batch(batch.dense, tuple(fresh_kjt(k) for k in batch.sparse), batch.labels)


def fresh_kjt(kjt: Any) -> Any:
    """A new KJT object (no cached offsets) over ``kjt``'s tensors; fxrec's or TorchRec's."""
    return type(kjt)(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        stride=kjt.stride(),
    )


def collate_ms(data: Any, kind: str, reps: int = 7) -> float:
    """Median time the loader takes to collate one batch into ``kind`` (measured apart)."""
    keys, wkeys, raws = data
    loader = Loader(keys, wkeys, raws, kind)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        next(loader)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


@dataclass
class Variant:
    """One measured configuration: how to take a step, and what the steps recorded."""

    name: str
    pipeline: str
    input: str
    fxrec: str
    step: Callable[[], Any]
    loader: Loader
    stats: Any  # PipelineStats or None
    close: Callable[[], None]
    batch: int
    copies: float = 0.0
    times: list[float] | None = None
    mem: list[float] | None = None
