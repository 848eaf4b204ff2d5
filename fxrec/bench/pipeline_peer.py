"""The pipeline benchmark's peer row: TorchRec's own pipelines on the same model and data.

The benchmark model rebuilt on TorchRec's collections (same weights), wrapped in a
``DistributedModelParallel`` over a single-rank gloo group, fed the same raw batches as
TorchRec KJTs in a ``Pipelineable``; used when torchrec is installed and the run is
single-process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fxrec.bench.pipeline_data import (
    Loader,
    PipelineRankingModel,
    Variant,
    fresh_kjt,
    per_feature,
)

__all__ = ["torchrec_variants"]


class _TorchRecLoader(Loader):
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

    def _refresh(self, batch: Any) -> Any:
        return _torchrec_batch_type()(
            batch.dense, fresh_kjt(batch.sparse), fresh_kjt(batch.wsparse), batch.labels
        )


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
        e = per_feature(self.ebc(batch.sparse).values(), self.dims, self.norms)
        w = self.webc(batch.wsparse).values()
        logits = self.over_arch(torch.cat([d, e, w], dim=1)).view(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def torchrec_variants(
    base: PipelineRankingModel, data: Any, lr: float, pregenerate: int
) -> list[Variant]:
    """TorchRec's pipelines on a DMP of the same model (single-rank gloo group), KJT input."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineBase as TRBase
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TRSparseDist
    from torchrec.distributed.types import ShardingEnv
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
        tables = [c.to_torchrec() for c in fx_ebc.embedding_bag_configs()]
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
        v = Variant(
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
