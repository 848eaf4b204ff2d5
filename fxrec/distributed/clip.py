"""Gradient clipping by the global norm of a model whose embedding tables are sharded.

``torch.nn.utils.clip_grad_norm_`` sees one rank's parameters: a sharded collection's tables
differ from rank to rank, so each rank would compute another norm and scale the dense
gradients, which DDP made equal, by another factor; the ranks' dense weights then drift
apart without an error. :func:`clip_grad_norm_` computes the norm of the whole model: the
rank-local tables' gradients summed over their process group (one all-reduce), the
replicated gradients counted once, so every rank applies the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    model: nn.Module | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by the norm of the whole sharded model; returns that total norm.

    Like ``torch.nn.utils.clip_grad_norm_``, with the tables of every
    :class:`~fxrec.distributed.ShardedEmbeddingBagCollection` counted on all ranks. Pass the
    model (the optimized module, its DDP wrapper, or the model itself), or an iterable of
    parameters with ``model=`` the module that holds them. Every rank of the collections'
    group calls it at the same step (it runs one all-reduce per group).
    """
    holder = model_or_params if isinstance(model_or_params, nn.Module) else model
    if holder is None:
        raise TypeError(
            "fxrec.distributed.clip_grad_norm_ needs the model to tell sharded tables from "
            "replicated parameters: pass the model itself, or model=... with the parameters."
        )
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    params = model_or_params.parameters() if model_or_params is holder else model_or_params
    grads = _grads(params)  # type: ignore[arg-type]
    groups = _sharded_groups(holder)
    sharded = {id(t) for ts in groups.values() for t in ts}
    norms = [_local_norm([g for g in grads if id(g) not in sharded], p)]
    for group, tables in groups.items():
        ids = {id(t) for t in tables}
        mine = [g for g in grads if id(g) in ids]
        norms.append(_group_norm(_local_norm(mine, p), p, group))
    total = _combine(norms, p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is {float(total)}: they cannot be "
            "clipped; pass error_if_nonfinite=False to scale them by it anyway."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's factor
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each distinct parameter's gradient (a module containing an optimized one lists fused
    weights twice, as members without gradients and inside their flat parameters)."""
    seen: dict[int, torch.Tensor] = {}
    for t in params:
        if t.grad is not None:
            seen.setdefault(id(t.grad), t.grad)
    return list(seen.values())


def _sharded_groups(model: nn.Module) -> dict[dist.ProcessGroup, list[torch.Tensor]]:
    """The gradients of every sharded collection's parameters, by process group (empty
    lists too: a rank holding no table still joins its group's all-reduce)."""
    from fxrec.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    groups: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, ShardedEmbeddingBagCollection):
            tables = groups.setdefault(m.process_group, [])
            tables += [t.grad for t in m.parameters() if t.grad is not None]
    return groups


def _local_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm([_dense_part(g) for g in grads], p).float().cpu()


def _dense_part(grad: torch.Tensor) -> torch.Tensor:
    """What a gradient's norm is taken over: a sparse gradient's (``sparse=True`` tables)
    values once summed per row (an id repeated in the batch gives repeated rows), as norms
    have no sparse kernels."""
    return grad.coalesce()._values() if grad.is_sparse else grad


def _group_norm(local: torch.Tensor, p: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over every rank's part: a sum of p-th powers (a max for inf)."""
    cuda = dist.get_backend(group) == "nccl"
    part = local.to(torch.float64) if math.isinf(p) else local.to(torch.float64) ** p
    part = part.cuda() if cuda else part
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(part, op=op, group=group)
    part = part.cpu()
    return (part if math.isinf(p) else part ** (1.0 / p)).float()


def _combine(norms: list[torch.Tensor], p: float) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(norms), p)
