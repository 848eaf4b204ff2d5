"""Modules that update their own parameters in backward are not stepped by ``optimize``.

fbgemm's table-batched lookups built with an optimizer, and TorchRec's fused or sharded
collections, apply the optimizer inside the backward kernel. ``optimize`` counts kernels for
its report by running a training step of the model; for such a model that step would train
it before the user's first step, so the report counts nothing there and the parameters are
exactly those given.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import fxrec


class _SGDInBackward(torch.autograd.Function):
    """Rows looked up; backward applies ``weight -= lr * grad`` itself (as a fused kernel)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, lr: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight, ids)
        ctx.lr = lr
        return weight[ids]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        weight, ids = ctx.saved_tensors
        with torch.no_grad():
            weight.index_add_(0, ids, grad, alpha=-ctx.lr)
        return None, None, None


class FusedSGDTable(nn.Module):
    """A table trained in its own backward, exposing its optimizer as TorchRec's do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(20, 8))

    @property
    def fused_optimizer(self) -> str:
        return "sgd in backward"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _SGDInBackward.apply(self.weight, ids, 0.5)


class Ranker(nn.Module):
    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))
        self.top = nn.Linear(32, 1)

    def forward(self, *lookup: torch.Tensor) -> torch.Tensor:
        rows = self.table(*lookup).view(4, -1, 8)
        return self.top(torch.cat([n(r) for n, r in zip(self.norms, rows)], 1))


def _unchanged_by_optimize(model: nn.Module, args: tuple) -> fxrec.graph.module.OptimizedModule:
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = fxrec.optimize(model, args)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by fxrec.optimize"
    assert opt.fxrec_report.kernels_before is None
    return opt


def test_a_table_updated_in_backward_is_not_trained_by_optimize() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (4 * 3,))
    opt = _unchanged_by_optimize(Ranker(FusedSGDTable()), (ids,))
    assert opt.fxrec_report.count("parallel_layer_norm") == 1  # still optimized


@pytest.mark.skipif(importlib.util.find_spec("fbgemm_gpu") is None, reason="needs fbgemm_gpu")
def test_fbgemm_lookup_with_a_fused_optimizer_is_not_trained_by_optimize() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    class Tables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            spec = (20, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)
            self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [spec] * 4, optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5
            )

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.tbe(ids, offsets).view(-1, 4, 8).transpose(0, 1).reshape(-1)

    torch.manual_seed(0)
    ids = torch.randint(0, 20, (4 * 3 * 2,))
    offsets = torch.arange(0, ids.numel() + 1, 2)
    _unchanged_by_optimize(Ranker(Tables()), (ids, offsets))
