"""DistributedDataParallel next to sharded embeddings: each rank keeps its own tables.

DDP broadcasts rank 0's parameters at construction and averages every gradient; a sharded
collection's tables are rank-local (rank 1's ``t1`` is not rank 0's ``t0``, even when the
shapes agree), so DDP must leave them alone. It reads the names to leave from the root
module's ``_ddp_params_and_buffers_to_ignore``; :func:`ignore_sharded_in_ddp` sets them
(``fxrec.optimize``'s module adds them by itself).
"""

from __future__ import annotations

import itertools

from torch import nn

__all__ = ["ignore_sharded_in_ddp", "rank_local_names"]


def rank_local_names(model: nn.Module) -> list[str]:
    """Names, under ``model``, of the parameters and buffers of its sharded collections."""
    from fxrec.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    out = []
    for prefix, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, ShardedEmbeddingBagCollection):
            tensors = itertools.chain(
                m.named_parameters(remove_duplicate=False), m.named_buffers(remove_duplicate=False)
            )
            out += [f"{prefix}.{n}" if prefix else n for n, _ in tensors]
    return list(dict.fromkeys(out))


def ignore_sharded_in_ddp(model: nn.Module) -> nn.Module:
    """Make ``DistributedDataParallel(model)`` sync the dense part only (call it before DDP
    wraps ``model``); returns ``model``. Names already set to be ignored are kept."""
    own = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = list(  # type: ignore[assignment]
        dict.fromkeys([*own, *rank_local_names(model)])
    )
    return model
