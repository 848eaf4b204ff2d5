"""``ShardedEmbeddingBagCollection``: an embedding collection's tables spread over ranks.

Table-wise sharding: each table lives on one rank (:mod:`fxrec.distributed.plan`); tables
the plan marks row-wise have one block of rows on every rank, each block handled below as a
table of its own (:mod:`fxrec.distributed.row_wise`: ids are routed to their row's block
before step 1, partial sums added after step 4). A step:

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
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxrec.distributed import dist_ops
from fxrec.distributed import row_wise as rowwise
from fxrec.distributed.comm import group_name, translated
from fxrec.distributed.plan import ShardingPlan, TableSpec, greedy_plan
from fxrec.nn.inputs import as_kjt as read_input
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor, prepare_kjt

logger = logging.getLogger(__name__)

__all__ = ["ROW_RANGES", "ShardedEmbeddingBagCollection", "shard", "table_specs"]

#: The key, in a sharded collection's state-dict metadata, of its row-wise blocks' rows:
#: ``{table: (first row, end row)}``.
ROW_RANGES = "fxrec_row_ranges"


def _configs(ebc: nn.Module) -> list[Any]:
    getter = getattr(ebc, "embedding_bag_configs", None)
    if callable(getter):
        return list(getter())
    for attr in ("tables", "configs", "_embedding_bag_configs"):
        if hasattr(ebc, attr):
            return list(getattr(ebc, attr))
    raise ValueError(
        f"{type(ebc).__name__} does not describe its tables (no embedding_bag_configs()); "
        "shard an fxrec.nn.EmbeddingBagCollection (or TorchRec's)."
    )


def _as_fxrec_collection(ebc: nn.Module) -> nn.Module:
    """TorchRec's ``EmbeddingBagCollection`` as fxrec's: same tables, weights and state-dict
    keys, and the owners' lookups take the KJTs the exchange delivers."""
    if not type(ebc).__module__.startswith("torchrec"):
        return ebc
    from fxrec.nn import EmbeddingBagCollection

    params = list(ebc.parameters())
    device = params[0].device if params else torch.device("cpu")
    out = EmbeddingBagCollection(
        tables=list(_configs(ebc)), is_weighted=bool(ebc.is_weighted()), device=device
    )
    like = _float_tensor(ebc)
    if like is not None:  # keep its dtype (built in float32)
        out = out.to(dtype=like.dtype)
    out.load_state_dict(ebc.state_dict())
    return out


def table_specs(ebc: nn.Module) -> list[TableSpec]:
    """The planner's view of ``ebc``'s tables, in the collection's order."""
    return [
        TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim), tuple(c.feature_names))
        for c in _configs(ebc)
    ]


def _local_collection(
    ebc: nn.Module, names: list[str], row_blocks: dict[str, tuple[str, int, int, int]]
) -> nn.Module:
    """A collection of the same type holding only the tables ``names`` (in that order, which
    is the order of its output), with ``ebc``'s weights.

    ``row_blocks``: row shards among ``names`` -> (table, rank, first row, end row); each is
    a sum-pooled table of those rows, read by the shard's features.
    """
    by_name = {c.name: c for c in _configs(ebc)}
    configs = []
    for name in names:
        if name not in row_blocks:
            configs.append(copy.copy(by_name[name]))
            continue
        table, rank, lo, hi = row_blocks[name]
        c = by_name[table]
        pooling = "sum" if isinstance(c.pooling, str) else type(c.pooling)["SUM"]
        configs.append(
            dataclasses.replace(
                c,
                name=name,
                num_embeddings=hi - lo,
                feature_names=rowwise.shard_features(c.feature_names, rank),
                pooling=pooling,
            )
        )
    kwargs: dict[str, Any] = {}
    if _is_weighted(ebc):
        kwargs["is_weighted"] = True
    for option in ("device", "sparse", "backend"):  # fxrec's collection: keep its choices
        if isinstance(getattr(type(ebc), option, None), property):
            kwargs[option] = getattr(ebc, option)
    try:
        local = type(ebc)(tables=configs, **kwargs)
    except TypeError:
        local = type(ebc)(configs, **kwargs)
    full = ebc.state_dict()
    like = _float_tensor(ebc)
    if like is not None:  # built in float32: take ``ebc``'s dtype before its values
        local = local.to(dtype=like.dtype)
    state = {}
    for key in local.state_dict():
        src = _source_key(key, row_blocks)
        if src not in full:
            raise ValueError(f"cannot find {src!r} in the collection's state_dict")
        state[key] = _rows_of(full[src], key, row_blocks)
    local.load_state_dict(state)
    return local.to(next(iter(full.values())).device) if full else local


def _is_weighted(ebc: nn.Module) -> bool:
    is_weighted = getattr(ebc, "is_weighted", None)
    return bool(callable(is_weighted) and is_weighted())


def _float_tensor(ebc: nn.Module) -> torch.Tensor | None:
    """``ebc``'s first floating-point parameter or buffer (its tables' dtype and device)."""
    tensors = [*ebc.parameters(), *ebc.buffers()]
    return next((t for t in tensors if t.is_floating_point()), None)


def _shard_of(key: str, row_blocks: dict[str, tuple[str, int, int, int]]) -> str | None:
    """The row shard a local state key belongs to (``embedding_bags.<shard>.weight``)."""
    parts = key.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in row_blocks else None


def _source_key(key: str, row_blocks: dict[str, tuple[str, int, int, int]]) -> str:
    """The unsharded collection's key for a local state key."""
    shard = _shard_of(key, row_blocks)
    if shard is None:
        return key
    parts = key.split(".")
    parts[1] = row_blocks[shard][0]
    return ".".join(parts)


def _rows_of(
    value: torch.Tensor, key: str, row_blocks: dict[str, tuple[str, int, int, int]]
) -> torch.Tensor:
    """A whole table's tensor cut to the local shard's rows (other keys: as they are)."""
    shard = _shard_of(key, row_blocks)
    if shard is None:
        return value
    _, _, lo, hi = row_blocks[shard]
    return value.narrow(0, lo, hi - lo)


def _size_mismatch(key: str, got: torch.Size, whole: torch.Size, block: torch.Size) -> str:
    """``load_state_dict``'s size-mismatch message, with this rank's block for a row-wise table."""
    msg = (
        f"size mismatch for {key}: copying a param with shape {tuple(got)} from checkpoint, the "
        f"shape in current model is {whole}"
    )
    if whole != block:
        msg += f" (row-wise: this rank holds {block}; load the whole table or this block)"
    return msg + "."


class ShardedEmbeddingBagCollection(nn.Module):
    """Sharded ``EmbeddingBagCollection`` over a process group: table-wise, and row-wise for
    the tables the plan names in ``row_wise``.

    Every rank constructs it from the same (identically initialised) collection; each keeps
    only its own tables and its block of each row-wise table. ``forward`` takes this rank's
    local batch (any input the unsharded collection takes, read as it reads it) and returns
    what the unsharded collection returns for that batch. ``state_dict`` holds this rank's
    tables under the original keys (for a row-wise table, this rank's rows:
    :meth:`row_range`), also inside a model's; ``load_state_dict`` takes a full state dict
    (whole row-wise tables are cut to this rank's rows, other ranks' tables are skipped) or
    this rank's.
    """

    # Its forward runs collectives: fxrec.optimize never runs a call of a model holding it a
    # second time on one rank (its peers would not join the repeated collectives).
    fxrec_collectives = True

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
        ebc = _as_fxrec_collection(ebc)
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
        pooling = {c.name: _pooling(c) for c in _configs(ebc)}
        _check_same_plan(_plan_description(specs, plan, pooling, _is_weighted(ebc)), pg)
        wire_specs, wire_plan, row_blocks, self._rows = _wire(
            specs, plan, pooling, tuple(keys), tuple(dims)
        )
        wire_keys, wire_dims = self._rows.wire_keys()
        local_keys = [
            [f for t in wire_plan.tables_of(r, wire_specs) for f in t.feature_names]
            for r in range(world)
        ]
        send_keys = [f for lk in local_keys for f in lk]
        self.plan = plan
        self.rank = rank
        self.world_size = world
        self.keys = tuple(keys)
        self.dims = tuple(dims)
        self._wire_keys = tuple(wire_keys)
        self._wire_dims = tuple(wire_dims)
        self._send_keys = tuple(send_keys)
        self._dims_per_rank = tuple(
            sum(t.embedding_dim * len(t.feature_names) for t in wire_plan.tables_of(r, wire_specs))
            for r in range(world)
        )
        self._columns = dist_ops.columns_of(wire_keys, wire_dims, local_keys)
        self._group_name = group_name(pg)
        self._local_keys = tuple(local_keys[rank])
        self._layout = dist_ops.IdsLayout(
            tuple(send_keys),
            tuple(len(lk) for lk in local_keys),
            tuple(local_keys[rank]),
            self._group_name,
            _is_weighted(ebc),  # not each rank's input: every rank must agree
            tuple((f, t.num_embeddings, t.name) for t in specs for f in t.feature_names),
        )
        self._row_blocks = {k: v for k, v in row_blocks.items() if v[1] == rank}
        self._whole_rows = {t.name: t.num_embeddings for t in specs if t.name in plan.row_wise}
        self._all_keys = frozenset(ebc.state_dict())  # every table's, whichever rank holds it
        mine = [t.name for t in wire_plan.tables_of(rank, wire_specs)]
        self.embedding_bags_local = _local_collection(ebc, mine, self._row_blocks) if mine else None
        # The dtype of the pooled rows a rank without tables sends (it must match its peers'):
        # a buffer, so that ``.to(dtype)`` converts it with the tables on every rank.
        like = _float_tensor(ebc)
        self.register_buffer(
            "_pooled_like",
            torch.empty(0, dtype=like.dtype if like is not None else torch.float32),
            persistent=False,
        )
        self.register_state_dict_post_hook(ShardedEmbeddingBagCollection._rename_saved)
        self.register_load_state_dict_pre_hook(ShardedEmbeddingBagCollection._route_loaded)
        self.register_load_state_dict_post_hook(ShardedEmbeddingBagCollection._drop_reported)
        self._mismatched: list[str] = []  # local keys refused by the last load (see hooks)
        self._load_prefix = ""  # the collection's prefix in the last load (see hooks)
        logger.info(
            "rank %d holds tables %s (%d of %d rows*dim)",
            rank,
            sorted(mine),
            plan.load(specs)[rank],
            sum(plan.load(specs)),
        )

    # -- state: original keys ---------------------------------------------------------------
    # Hooks, not overrides: a model holding this collection saves and loads it through
    # ``Module``'s recursion, which calls no override of ``load_state_dict``.
    def _rename_saved(self, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        """``<prefix>embedding_bags_local.<key>`` -> ``<prefix><the unsharded key>``.

        A row-wise table's block is saved with its rows in the module's metadata
        (:data:`ROW_RANGES`): blocks of equal size are otherwise indistinguishable, and a load
        must not take another rank's rows for its own.
        """
        inner = prefix + "embedding_bags_local."
        for key in [k for k in state_dict if k.startswith(inner)]:
            source = _source_key(key[len(inner) :], self._row_blocks)
            state_dict[prefix + source] = state_dict.pop(key)
        local_metadata[ROW_RANGES] = {
            table: (lo, hi) for table, _, lo, hi in self._row_blocks.values()
        }

    def _route_loaded(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """The unsharded keys -> this rank's tables; other ranks' tables are dropped.

        A tensor that is neither this rank's shape nor a whole row-wise table is reported as
        the unsharded collection reports it (a size mismatch under its own key), not cut.
        """
        inner = prefix + "embedding_bags_local."
        mine = self._loadable()
        self._mismatched.clear()
        self._load_prefix = prefix
        saved_ranges = local_metadata.get(ROW_RANGES)
        for key in [k for k in state_dict if k.startswith(prefix + "embedding_bags.")]:
            target = mine.get(key[len(prefix) :])
            if target is None:
                if key[len(prefix) :] in self._all_keys:
                    del state_dict[key]  # a table another rank holds
                continue  # no table of the collection: left for "Unexpected key(s)"
            value = state_dict.pop(key)
            local_key, shape = target
            whole = self._whole_shape(local_key, shape)
            if value.shape == whole and value.shape != shape:  # this rank's rows of the table
                value = _rows_of(value, local_key, self._row_blocks)
            elif value.shape != shape:
                error_msgs.append(_size_mismatch(key, value.shape, whole, shape))
                self._mismatched.append(inner + local_key)  # reported: not also "missing"
                continue
            elif whole != shape:  # a block of a row-wise table: only this rank's rows
                refused = self._foreign_block(key, local_key, saved_ranges)
                if refused:
                    error_msgs.append(refused)
                    self._mismatched.append(inner + local_key)
                    continue
            state_dict[inner + local_key] = value

    def _foreign_block(self, key: str, local_key: str, saved_ranges: Any) -> str | None:
        """Why a row-wise block saved under ``key`` is not this rank's rows (None if it is)."""
        table, _, lo, hi = self._row_blocks[_shard_of(local_key, self._row_blocks) or ""]
        saved = None if saved_ranges is None else saved_ranges.get(table)
        if saved is not None and tuple(saved) == (lo, hi):
            return None
        holds = (
            f"rows {saved[0]}..{saved[1] - 1}"
            if saved is not None
            else "a block of rows with no record of which"
        )
        return (
            f"row-wise block for {key}: the checkpoint holds {holds} of table {table!r}, this "
            f"rank ({self.rank}) owns rows {lo}..{hi - 1}; load each rank's own state_dict "
            f"(as it saved it, with its metadata), or a full checkpoint with whole tables."
        )

    def _loadable(self) -> dict[str, tuple[str, torch.Size]]:
        """This rank's state: unsharded key -> (local key, shape)."""
        local = self.embedding_bags_local
        if local is None:
            return {}
        return {
            _source_key(key, self._row_blocks): (key, value.shape)
            for key, value in local.state_dict().items()
        }

    def _whole_shape(self, local_key: str, shape: torch.Size) -> torch.Size:
        """The unsharded table's shape for a local key (``shape`` unless row-wise)."""
        shard = _shard_of(local_key, self._row_blocks)
        if shard is None:
            return shape
        rows = self._whole_rows[self._row_blocks[shard][0]]
        return torch.Size((rows, *shape[1:]))

    def _drop_reported(self, incompatible: Any) -> None:
        """Refused tensors already have their error: not also listed as missing. A missing
        table is reported under the unsharded key, as the unsharded collection reports it."""
        for key in self._mismatched:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        self._mismatched.clear()
        inner = self._load_prefix + "embedding_bags_local."
        missing = incompatible.missing_keys
        for i, key in enumerate(missing):
            if key.startswith(inner):
                missing[i] = self._load_prefix + _source_key(key[len(inner) :], self._row_blocks)

    def row_range(self, table: str) -> tuple[int, int] | None:
        """The rows ``[first, end)`` of row-wise ``table`` this rank holds (None otherwise)."""
        for name, lo, hi in ((v[0], v[2], v[3]) for v in self._row_blocks.values()):
            if name == table:
                return lo, hi
        return None

    # -- forward ----------------------------------------------------------------------------
    def forward(self, features: Any) -> KeyedTensor:
        kjt = as_kjt(features, self._layout)
        counts = dist_ops.request_counts(kjt, self._layout, self._routing)
        splits = dist_ops.wait_counts(counts)
        handle = dist_ops.send_ids(splits)
        return self.finish(dist_ops.wait_ids(handle), handle, kjt)

    @property
    def _routing(self) -> rowwise.RowShards | None:
        """What sends row-wise tables' ids to their row blocks (None without any)."""
        return self._rows if self._rows.features else None

    def request_counts(self, features: Any) -> tuple[Any, dist_ops.CountsHandle]:
        """Start the id-count exchange for ``features`` (returns at once): their KJT and the
        handle for ``wait_counts`` -> ``send_ids`` -> ``wait_ids`` -> :meth:`finish`.

        Input refused (here, or by ``request_counts``) is announced to the other ranks, as
        the forward announces it."""
        kjt = _announcing(kept_kjt, features, self._layout)
        return kjt, dist_ops.request_counts(kjt, self._layout, self._routing)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save``, ``copy.deepcopy``) without the forward a train pipeline
        installs on this instance while it runs: a copy runs its own forward."""
        state = dict(self.__dict__)
        state.pop("forward", None)
        state.pop("_fxrec_pipeline_forward", None)
        return state

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group the tables are sharded over."""
        return dist.distributed_c10d._resolve_process_group(self._group_name)

    def request_absent(self, ended: bool = False) -> dist_ops.CountsHandle:
        """Meet the other ranks' id-count exchange with no batch (they learn to skip it)."""
        return dist_ops.request_absent(self._layout, ended)

    def finish(self, local: Any, handle: dist_ops.IdsHandle, kjt: Any) -> KeyedTensor:
        """Lookup of the received ids, pooled all-to-all back, this rank's ``KeyedTensor``."""
        pooled = _lookup(
            self.embedding_bags_local, local, self._dims_per_rank[self.rank], self._pooled_like
        )
        sent = dist_ops.request_pooled(pooled, handle, self._dims_per_rank)
        received = dist_ops.wait_pooled(sent)
        kt = dist_ops.assemble_pooled(
            received, handle, self._dims_per_rank, self._columns, self._wire_keys, self._wire_dims
        )
        if not self._rows.features:
            return kt
        return rowwise.merge_row_shards(kt, kjt, self._rows)


def _plan_description(
    specs: list[TableSpec], plan: ShardingPlan, pooling: dict[str, str], weighted: bool
) -> dict[str, str]:
    """What every rank must agree on: each table's shape, features, pooling and place."""
    rw = set(plan.row_wise)
    out = {"weighted": str(weighted), "tables": str([t.name for t in specs])}
    for t in specs:
        place = "row-wise" if t.name in rw else f"owner rank {plan.owners[t.name]}"
        out[f"table {t.name!r}"] = (
            f"({t.num_embeddings}x{t.embedding_dim}, features {list(t.feature_names)}, "
            f"pooling {pooling[t.name]}, {place})"
        )
    return out


def _check_same_plan(description: dict[str, str], pg: dist.ProcessGroup) -> None:
    """Raise on every rank if the ranks built their collections with different plans or
    tables: each would otherwise send ids to owners that do not hold those tables, silently.

    One all-gather of a hash; the descriptions themselves are gathered only to name the
    difference once the hashes disagree.
    """
    text = repr(sorted(description.items())).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(pg) == "nccl"
        else None
    )
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(pg.size())]
    with translated("sharding-plan check (all-gather at construction)"):
        dist.all_gather(gathered, mine, group=pg)
        if all(torch.equal(g, mine) for g in gathered):
            return
        every: list[Any] = [None] * pg.size()
        dist.all_gather_object(every, description, group=pg)
    first = every[0]
    for rank, other in enumerate(every):
        diff = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if diff:
            detail = "; ".join(
                f"{k}: rank 0 says {first.get(k)}, rank {rank} says {other.get(k)}" for k in diff
            )
            raise ValueError(
                f"ShardedEmbeddingBagCollection: ranks disagree on the sharding plan or the "
                f"tables ({detail}). Build every rank's collection from the same tables and "
                f"the same plan (e.g. greedy_plan, or a plan built in a fixed order, not from "
                f"a set)."
            )


def _wire(
    specs: list[TableSpec],
    plan: ShardingPlan,
    pooling: dict[str, str],
    keys: tuple[str, ...],
    dims: tuple[int, ...],
) -> tuple[list[TableSpec], ShardingPlan, dict[str, tuple[str, int, int, int]], rowwise.RowShards]:
    """What travels: each row-wise table becomes one table-wise row shard per rank.

    Returns the tables and plan of the wire, the row shards (name -> table, rank, first
    row, end row) and the :class:`~fxrec.distributed.row_wise.RowShards` of the features.
    """
    world = plan.world_size
    rw = set(plan.row_wise)
    wire_specs: list[TableSpec] = []
    owners: dict[str, int] = {}
    row_blocks: dict[str, tuple[str, int, int, int]] = {}
    features: list[str] = []
    bounds_of: list[tuple[int, ...]] = []
    mean: list[bool] = []
    for t in specs:
        if t.name not in rw:
            wire_specs.append(t)
            owners[t.name] = plan.owners[t.name]
            continue
        bounds = rowwise.check_row_wise(t.name, pooling[t.name], t.num_embeddings, world)
        for r in range(world):
            name = rowwise.shard_name(t.name, r)
            lo, hi = bounds[r], bounds[r + 1]
            shard_features = tuple(rowwise.shard_features(t.feature_names, r))
            wire_specs.append(TableSpec(name, hi - lo, t.embedding_dim, shard_features))
            owners[name] = r
            row_blocks[name] = (t.name, r, lo, hi)
        features += t.feature_names
        bounds_of += [bounds] * len(t.feature_names)
        mean += [pooling[t.name] == "mean"] * len(t.feature_names)
    shards = rowwise.RowShards(tuple(features), tuple(bounds_of), tuple(mean), keys, dims, world)
    return wire_specs, ShardingPlan(owners, world), row_blocks, shards


def _pooling(config: Any) -> str:
    raw = getattr(config, "pooling", "sum")
    raw = getattr(raw, "value", raw)
    return str(raw).lower()


def _is_tensordict(features: Any) -> bool:
    return hasattr(features, "batch_size") and hasattr(features, "keys")


@torch.fx.wrap
def as_kjt(features: Any, layout: dist_ops.IdsLayout) -> KeyedJaggedTensor:
    """:func:`read_kjt`; input it refuses is announced to the other ranks first
    (:func:`~fxrec.distributed.dist_ops.announce_refusal`), as ``request_counts`` announces
    the input it refuses: they are already in this batch's exchange."""
    return _announcing(read_kjt, features, layout)


def _announcing(
    read: Callable[[Any, dist_ops.IdsLayout], KeyedJaggedTensor],
    features: Any,
    layout: dist_ops.IdsLayout,
) -> KeyedJaggedTensor:
    try:
        return read(features, layout)
    except Exception as exc:
        dist_ops.announce_refusal(exc, layout)
        raise


def read_kjt(features: Any, layout: dist_ops.IdsLayout) -> KeyedJaggedTensor:
    """The collection's input as a KJT, read as the unsharded collection reads it
    (:func:`fxrec.nn.inputs.as_kjt`): a KJT as is; of a TensorDict or a dict of jagged
    nested tensors, only the features it reads (other entries, a ``label``, are left
    alone); a dict of JaggedTensors; TorchRec's KJT."""
    if isinstance(features, KeyedJaggedTensor):
        return features
    return read_input(features, layout.features(), layout.weighted)


def kept_kjt(features: Any, layout: dist_ops.IdsLayout) -> KeyedJaggedTensor:
    """:func:`read_kjt`, keeping a TensorDict's KJT with it (``prepare_kjt``): the forward's
    own conversion of that TensorDict then returns this very KJT, so the forward takes over
    an exchange started early for it."""
    if _is_tensordict(features):
        return prepare_kjt(features, layout.features())
    return read_kjt(features, layout)


def _lookup(local: nn.Module | None, kjt: Any, width: int, like: torch.Tensor) -> Any:
    if local is None:
        return _empty_pooled(kjt, width, like)
    return local(kjt).values()


@torch.fx.wrap
def _empty_pooled(kjt: KeyedJaggedTensor, width: int, like: torch.Tensor) -> torch.Tensor:
    """A table-less rank's (empty) pooled rows, in the collection's dtype (``like``'s): the
    all-to-all needs the same dtype on every rank."""
    return kjt.values().new_zeros(kjt.stride(), width, dtype=like.dtype)


def shard(
    ebc: nn.Module,
    plan: ShardingPlan | None = None,
    pg: dist.ProcessGroup | None = None,
    *,
    row_wise: Sequence[str] = (),
) -> ShardedEmbeddingBagCollection:
    """Shard ``ebc`` (fxrec's or TorchRec's ``EmbeddingBagCollection``) over ``pg`` (default
    group). Without a ``plan``: the greedy plan, with the tables named in ``row_wise`` split
    by rows over every rank."""
    if plan is None and row_wise:
        world = (pg if pg is not None else dist.group.WORLD).size() if dist.is_initialized() else 1
        plan = greedy_plan(table_specs(ebc), world, row_wise)
    elif plan is not None and row_wise:
        raise ValueError("pass row_wise to greedy_plan, or give a plan: not both")
    return ShardedEmbeddingBagCollection(ebc, plan, pg)
