"""``ShardedEmbeddingBagCollection``: an embedding collection's tables spread over ranks.

Table-wise sharding: each table lives on one rank (:mod:`fxrec.distributed.plan`). A step:

1. ``request_counts``/``wait_counts``, then ``send_ids``/``wait_ids``: every key's ids go
   to the owner of its table (an asynchronous exchange of counts, which gives the split
   sizes, then an asynchronous ``all_to_all_single`` of the ids);
2. the owner looks its tables up for the rows of *every* rank's batch (one local
   collection call);
3. ``request_pooled``/``wait_pooled``: each rank gets back its own rows (functional
   ``all_to_all_single``; backward is the reverse all-to-all);
4. ``assemble_pooled``: the same ``KeyedTensor`` the unsharded collection gives for the
   local batch (keys and columns in its order).

Written as a chain of request/wait pairs, the forward is one graph under symbolic tracing in
which the overlap pass can move independent compute between each request and its wait. Run eagerly,
each wait follows its request: that is the blocking baseline.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxrec.distributed import dist_ops
from fxrec.distributed.comm import group_name
from fxrec.distributed.plan import ShardingPlan, TableSpec, greedy_plan
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor, kjt_from_tensordict

logger = logging.getLogger(__name__)

__all__ = ["ShardedEmbeddingBagCollection", "shard", "table_specs"]


def _configs(ebc: nn.Module) -> list[Any]:
    getter = getattr(ebc, "embedding_bag_configs", None)
    if callable(getter):
        return list(getter())
    for attr in ("tables", "configs", "_embedding_bag_configs"):
        if hasattr(ebc, attr):
            return list(getattr(ebc, attr))
    raise ValueError(
        f"{type(ebc).__name__} does not describe its tables (no embedding_bag_configs()); "
        "shard an fxrec.nn.EmbeddingBagCollection."
    )


def table_specs(ebc: nn.Module) -> list[TableSpec]:
    """The planner's view of ``ebc``'s tables, in the collection's order."""
    return [
        TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim), tuple(c.feature_names))
        for c in _configs(ebc)
    ]


def _local_collection(ebc: nn.Module, names: set[str]) -> nn.Module:
    """A collection of the same type holding only ``names``, with ``ebc``'s weights."""
    configs = [c for c in _configs(ebc) if c.name in names]
    kwargs: dict[str, Any] = {}
    is_weighted = getattr(ebc, "is_weighted", None)
    if callable(is_weighted) and is_weighted():
        kwargs["is_weighted"] = True
    try:
        local = type(ebc)(tables=[copy.copy(c) for c in configs], **kwargs)
    except TypeError:
        local = type(ebc)([copy.copy(c) for c in configs], **kwargs)
    full = ebc.state_dict()
    state = {}
    for key in local.state_dict():
        if key not in full:
            raise ValueError(f"cannot find {key!r} in the collection's state_dict")
        state[key] = full[key]
    local.load_state_dict(state)
    return local.to(next(iter(full.values())).device) if full else local


class ShardedEmbeddingBagCollection(nn.Module):
    """Table-wise sharded ``EmbeddingBagCollection`` over a process group.

    Every rank constructs it from the same (identically initialised) collection; each keeps
    only its own tables. ``forward`` takes this rank's local batch (KJT, or TensorDict of
    jagged tensors) and returns what the unsharded collection returns for that batch.
    ``state_dict`` holds this rank's tables under the original keys.
    """

    def __init__(
        self,
        ebc: nn.Module,
        plan: ShardingPlan | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError(
                "ShardedEmbeddingBagCollection needs torch.distributed initialised; call "
                "fxrec.distributed.init_distributed() (torchrun) first."
            )
        pg = pg if pg is not None else dist.group.WORLD
        world, rank = pg.size(), pg.rank()
        specs = table_specs(ebc)
        plan = plan if plan is not None else greedy_plan(specs, world)
        if plan.world_size != world:
            raise ValueError(f"plan is for {plan.world_size} ranks, the group has {world}")
        plan.validate(specs)
        keys: list[str] = []
        dims: list[int] = []
        for t in specs:
            for f in t.feature_names:
                if f in keys:
                    raise ValueError(f"feature {f!r} feeds two tables; give each table its own")
                keys.append(f)
                dims.append(t.embedding_dim)
        local_keys = [
            [f for t in plan.tables_of(r, specs) for f in t.feature_names] for r in range(world)
        ]
        send_keys = [f for lk in local_keys for f in lk]
        self.plan = plan
        self.rank = rank
        self.world_size = world
        self.keys = tuple(keys)
        self.dims = tuple(dims)
        self._send_keys = tuple(send_keys)
        self._dims_per_rank = tuple(
            sum(t.embedding_dim * len(t.feature_names) for t in plan.tables_of(r, specs))
            for r in range(world)
        )
        self._columns = dist_ops.columns_of(keys, dims, local_keys)
        self._group_name = group_name(pg)
        self._local_keys = tuple(local_keys[rank])
        self._layout = dist_ops.IdsLayout(
            tuple(send_keys),
            tuple(len(lk) for lk in local_keys),
            tuple(local_keys[rank]),
            self._group_name,
        )
        mine = {t.name for t in plan.tables_of(rank, specs)}
        self.embedding_bags_local = _local_collection(ebc, mine) if mine else None
        logger.info(
            "rank %d owns tables %s (%d of %d rows*dim)",
            rank,
            sorted(mine),
            plan.load(specs)[rank],
            sum(plan.load(specs)),
        )

    # -- state: original keys ---------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's tables, under the unsharded collection's keys."""
        if self.embedding_bags_local is None:
            return {}
        return self.embedding_bags_local.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load this rank's tables from a full (or this rank's) state dict."""
        if self.embedding_bags_local is None:
            return None
        want = self.embedding_bags_local.state_dict().keys()
        return self.embedding_bags_local.load_state_dict(
            {k: v for k, v in state_dict.items() if k in want}, strict=strict, assign=assign
        )

    # -- forward ----------------------------------------------------------------------------
    def forward(self, features: Any) -> KeyedTensor:
        kjt = as_kjt(features)
        counts = dist_ops.request_counts(kjt, self._layout)
        splits = dist_ops.wait_counts(counts)
        handle = dist_ops.send_ids(splits)
        local = dist_ops.wait_ids(handle)
        pooled = _lookup(self.embedding_bags_local, local, self._dims_per_rank[self.rank])
        sent = dist_ops.request_pooled(pooled, handle, self._dims_per_rank)
        received = dist_ops.wait_pooled(sent)
        return dist_ops.assemble_pooled(
            received, handle, self._dims_per_rank, self._columns, self.keys, self.dims
        )


@torch.fx.wrap
def as_kjt(features: Any) -> KeyedJaggedTensor:
    """KJT as is; a TensorDict of jagged tensors converted (weights, variable batch kept)."""
    if isinstance(features, KeyedJaggedTensor):
        return features
    if hasattr(features, "batch_size") and hasattr(features, "keys"):
        return kjt_from_tensordict(features)
    try:
        from fxrec.sparse import from_torchrec

        return from_torchrec(features)
    except Exception as exc:
        raise ValueError(
            f"ShardedEmbeddingBagCollection takes a KeyedJaggedTensor or a TensorDict of "
            f"jagged tensors, got {type(features).__name__}"
        ) from exc


def _lookup(local: nn.Module | None, kjt: Any, width: int) -> Any:
    if local is None:
        return _empty_pooled(kjt, width)
    return local(kjt).values()


@torch.fx.wrap
def _empty_pooled(kjt: KeyedJaggedTensor, width: int) -> torch.Tensor:
    return kjt.values().new_zeros(kjt.stride(), width, dtype=torch.float32)


def shard(
    ebc: nn.Module, plan: ShardingPlan | None = None, pg: dist.ProcessGroup | None = None
) -> ShardedEmbeddingBagCollection:
    """Shard ``ebc`` table-wise over ``pg`` (default group); greedy plan if none is given."""
    return ShardedEmbeddingBagCollection(ebc, plan, pg)
