"""``EmbeddingBagCollection``: many tables, one grouped lookup per (dim, pooling) group.

Same contract as ``torchrec.modules.embedding_modules.EmbeddingBagCollection`` (same
configs, same ``state_dict`` keys, same ``KeyedTensor`` output: ``[B, sum(dims)]``, tables in
order, then each table's features), but the tables of a group live in ONE weight and are
looked up with ONE call instead of one call per table.

Parameters: ``parameters()`` / ``named_parameters()`` yield one weight per group
(``groups.<i>.weight``, ``[rows of its tables, dim]``): build the optimizer on them.
``embedding_bags.<table>.weight`` is a view of the table's rows in its group's weight (not a
parameter, not a leaf); ``state_dict()`` holds exactly those views, so checkpoints are
per table and load both ways, including from and into TorchRec's collection.

Input checks (on by default, off with ``fxrec.sparse.set_validation(False)`` or inside
``fxrec.sparse.validation_disabled()``): ids outside their table, missing features,
features with different batch sizes, non-integer ids and non-float weights raise a
``ValueError`` naming the feature, before any lookup. Under ``torch.compile`` (dynamo) the
groups that fbgemm looks up are each one node of the graph, after one node checking the ids
(:mod:`fxrec.nn._fbgemm`): a graph run eagerly looks them up with fbgemm after the same
check as above. Where the graph is traced further (``"aot_eager"``, Inductor, export) or no
group goes through fbgemm, lookups are torch ops and the id range check is a device assert,
which is always on (a ``RuntimeError`` listing each feature's range). Features of the input
that no table reads are ignored (a batch often feeds several collections), as in TorchRec.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from fxrec.compiling import is_compiling, is_exporting
from fxrec.nn import _fbgemm
from fxrec.nn.checks import assert_id_ranges, check_dtypes, check_id_ranges
from fxrec.nn.config import EmbeddingBagConfig
from fxrec.nn.functional import embedding_bag_grouped, ids_dtype, shift_ids
from fxrec.nn.inputs import Plan, as_kjt, batch_size, gather, make_plan
from fxrec.nn.layout import DEFAULT_MAX_GROUP_BYTES, Group, Layout, plan_layout
from fxrec.nn.tables import TableGroup, TableView
from fxrec.nn.tracing import is_symbolic_tracing, leaf_call
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor
from fxrec.sparse.validation import validation_enabled

logger = logging.getLogger(__name__)

__all__ = ["EmbeddingBagCollection"]

Backend = Literal["auto", "torch", "fbgemm"]
_PLAN_CACHE_SIZE = 16


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of many sparse features; tables grouped into few lookups.

    Args:
        tables: one :class:`EmbeddingBagConfig` per table (names unique).
        device: where the weights live (``"meta"`` skips initialisation).
        is_weighted: pool with the input's per-id weights (TorchRec's meaning: when False,
            weights in the input are ignored; when True, the input must carry them).
            Weighted mean pooling is ``sum(w * e) / bag_size`` (see
            :mod:`fxrec.nn.functional`); max pooling cannot be weighted.
        sparse: sparse gradients for the weights (use ``torch.optim.SparseAdam``, or ``SGD``
            without momentum/weight decay). Pays off when a step touches few rows of large
            tables (measured, training step against TorchRec: 26 tables x 100,000 rows x 1 id,
            6-9x) and costs when the ids of a step approach the rows (100 tables x 10,000
            rows x ~10,000 ids each: 0.5x): the sparse gradient is as large as the ids.
            Not available with max pooling.
        backend: ``"auto"`` uses fbgemm's table-batched op where installed and the group
            qualifies (dense gradients, sum/mean pooling, float32 weights; not in exported
            programs), else torch;
            ``"torch"`` never uses fbgemm; ``"fbgemm"`` requires it. Results agree within
            float rounding.
        max_group_bytes: cap on one group's weight size. ``"auto"``: 16 MiB for dense
            gradients on CPU (see :mod:`fxrec.nn.layout`), unlimited otherwise. ``None``: no cap.
    """

    _fxrec_leaf = True  # fxrec's tracer keeps the collection as one call_module node

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        device: torch.device | str | None = None,
        *,
        is_weighted: bool = False,
        sparse: bool = False,
        backend: Backend = "auto",
        max_group_bytes: int | Literal["auto"] | None = "auto",
    ) -> None:
        super().__init__()
        tables = [t if isinstance(t, EmbeddingBagConfig) else _bad_config(t) for t in tables]
        if not tables:
            raise ValueError("EmbeddingBagCollection needs at least one table.")
        if backend not in ("auto", "torch", "fbgemm"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'fbgemm', got {backend!r}.")
        if backend == "fbgemm" and not _fbgemm.load_fbgemm():
            raise ValueError(
                "backend='fbgemm' needs fbgemm_gpu (pip install fbgemm-gpu-cpu, or fbgemm-gpu "
                "on CUDA); use backend='auto' to fall back to torch."
            )
        for t in tables:
            if is_weighted and t.pooling == "max":
                raise ValueError(
                    f"table {t.name!r}: max pooling cannot use per-sample weights; use sum or "
                    f"mean pooling, or is_weighted=False."
                )
            if sparse and t.pooling == "max":
                raise ValueError(
                    f"table {t.name!r}: sparse gradients are not available for max pooling; "
                    f"use sparse=False or sum/mean pooling."
                )
        dev = torch.device(device) if device is not None else torch.empty(0).device
        if max_group_bytes == "auto":
            max_group_bytes = (
                DEFAULT_MAX_GROUP_BYTES if (dev.type == "cpu" and not sparse) else None
            )
        self._tables = [dataclasses.replace(t) for t in tables]  # own copies, re-validated
        self._is_weighted = bool(is_weighted)
        self._sparse = bool(sparse)
        self._backend = backend
        self._device = dev
        self._layout: Layout = plan_layout(self._tables, max_group_bytes)
        self._use_fbgemm = (
            backend != "torch"
            and _fbgemm.fbgemm_installed()
            and (backend == "fbgemm" or _fbgemm.load_fbgemm())
        )
        self._keys = self._layout.keys()
        self._length_per_key = self._layout.dims()
        self._runs = _runs(self._layout)
        self._members_group_major = [self._layout.members[i] for i in self._layout.group_major()]
        self._lookup_order = [m.feature for m in self._members_group_major]
        self._plans: dict[tuple[str, ...], Plan] = {}
        self._device_consts: dict[tuple[int, torch.device, str], Any] = {}

        self.embedding_bags = nn.ModuleDict()
        self.groups = nn.ModuleList()
        for g in self._layout.groups:
            names = [self._tables[ti].name for ti in g.tables]
            self.groups.append(TableGroup(g.num_rows, g.dim, g.pooling, names, device=dev))
        for ti, t in enumerate(self._tables):
            gi = self._group_of_table(ti)
            g = self._layout.groups[gi]
            offset = g.table_row_offsets[g.tables.index(ti)]
            self.embedding_bags[t.name] = TableView(
                self.groups[gi], offset, t.num_embeddings, t.pooling
            )
        self.reset_parameters()
        logger.debug(
            "EmbeddingBagCollection: %d tables in %d groups (fbgemm: %s)",
            len(self._tables),
            len(self._layout.groups),
            self._use_fbgemm,
        )

    def _group_of_table(self, ti: int) -> int:
        return next(gi for gi, g in enumerate(self._layout.groups) if ti in g.tables)

    # ---- TorchRec-compatible accessors ------------------------------------------------------
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def sparse(self) -> bool:
        return self._sparse

    @property
    def backend(self) -> Backend:
        """The lookup backend asked for (``"auto"``, ``"torch"`` or ``"fbgemm"``)."""
        return self._backend

    def output_keys(self) -> list[str]:
        """Keys of the output ``KeyedTensor`` (``feature@table`` for shared features)."""
        return list(self._keys)

    def output_dims(self) -> list[int]:
        return list(self._length_per_key)

    def feature_names(self) -> list[str]:
        """The input features the collection reads."""
        return list(self._layout.features)

    def layout(self) -> Layout:
        """The grouping (which tables share a weight and a lookup call)."""
        return self._layout

    def table_grads(self) -> dict[str, torch.Tensor | None]:
        """Each table's rows of its group's gradient (dense; None before any backward).

        The per-table counterpart of ``embedding_bags[t].weight.grad`` in TorchRec, whose
        tables are separate parameters. A sparse gradient is densified (a copy).
        """
        out: dict[str, torch.Tensor | None] = {}
        for name, view in self.embedding_bags.items():
            grad = view._group.weight.grad
            if grad is not None and grad.is_sparse:
                grad = grad.to_dense()
            out[name] = (
                None if grad is None else grad.narrow(0, view.row_offset, view.num_embeddings)
            )
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every table as its config says (uniform ``+-sqrt(1/rows)`` by default)."""
        for t in self._tables:
            t.init_weight(self.embedding_bags[t.name].weight)

    def extra_repr(self) -> str:
        return (
            f"tables={len(self._tables)}, groups={len(self._layout.groups)}, "
            f"is_weighted={self._is_weighted}, sparse={self._sparse}, "
            f"fbgemm={self._use_fbgemm}"
        )

    # ---- tracing: a leaf under any torch.fx tracer ---------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_symbolic_tracing():
            proxy = leaf_call(self, args, kwargs)
            if proxy is not None:
                return proxy
        return super().__call__(*args, **kwargs)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, features: Any) -> KeyedTensor:
        """Pool every (table, feature) of ``features`` (KJT, TensorDict or dict of JTs)."""
        kjt = as_kjt(features, self._layout.features, self._is_weighted, self._lookup_order)
        plan = self._plan(kjt)
        batch = batch_size(kjt, plan)
        weights = kjt.weights_or_none() if self._is_weighted else None
        if self._is_weighted and weights is None:
            raise ValueError(
                "this collection is weighted (is_weighted=True) but the input has no weights; "
                "pass per-id weights (KeyedJaggedTensor(..., weights=...))."
            )
        check_dtypes(kjt.values(), weights, kjt.keys())
        if kjt.values().is_meta:  # shape inference: no ids to read or look up
            return KeyedTensor(self._keys, self._length_per_key, self._meta_output(batch))
        if plan.order is not None:
            kjt = gather(kjt, plan.order, weights)
            weights = kjt.weights_or_none()
        values, lengths, offsets = kjt.values(), kjt.lengths(), kjt.offsets()
        groups = self._layout.groups
        fb = [self._fbgemm_ok(g, self.groups[gi].weight, batch) for gi, g in enumerate(groups)]
        checked, counts = self._check_ids(kjt, any(fb))
        if len(groups) > 1 and counts is None:
            counts = kjt.length_per_key()  # slicing the ids per group needs host offsets
        id_starts = [0]
        for ms, me in plan.member_ranges:
            id_starts.append(
                id_starts[-1] + (values.numel() if counts is None else sum(counts[ms:me]))
            )
        outs: list[Any] = [None] * len(groups)
        if any(fb):  # cast once for every fbgemm group (the op takes int32 or int64)
            fb_values = values if values.dtype in (torch.int32, torch.int64) else values.long()
            fb_offsets = _as_dtype(offsets, fb_values.dtype)
            for gi in range(len(groups)):
                if fb[gi]:
                    outs[gi] = self._lookup_fbgemm(
                        gi, fb_values, fb_offsets, weights, batch, plan, id_starts, checked
                    )
        if not all(fb):
            torch_outs = self._lookup_torch(
                [gi for gi in range(len(groups)) if not fb[gi]],
                values,
                lengths,
                offsets,
                weights,
                counts,
                batch,
                plan,
                id_starts,
            )
            for gi, out in torch_outs.items():
                outs[gi] = out
        return KeyedTensor(self._keys, self._length_per_key, self._assemble(outs, batch))

    def _check_ids(
        self, kjt: KeyedJaggedTensor, fbgemm: bool
    ) -> tuple[torch.Tensor | None, list[int] | None]:
        """Every id against its own table, in one pass before any lookup.

        Returns the check's token, which fbgemm's lookup nodes read under dynamo (``fbgemm``:
        some group goes through fbgemm), and the per-key id counts where known.
        """
        values, lengths, members = kjt.values(), kjt.lengths(), self._members_group_major
        counts = kjt.length_per_key_or_none()
        if is_compiling() and fbgemm:  # one node: the host check, run eagerly
            return _fbgemm.check_ids(values, lengths, kjt.stride_per_key(), counts, members), counts
        if is_compiling():  # a device assert (a host check breaks the graph)
            assert_id_ranges(values, lengths, kjt.stride_per_key(), members)
        elif validation_enabled():
            counts = kjt.length_per_key()
            check_id_ranges(values, members, counts)
        return None, counts

    def _meta_output(self, batch: int) -> torch.Tensor:
        """``[B, sum(dims)]`` on the meta device, assembled as the lookups' results are (same
        dtype), each group's rows taken from its weight (gradients reach the weights)."""
        outs = []
        for gi, g in enumerate(self._layout.groups):
            w = self.groups[gi].weight.to("meta")
            rows = w.sum(0, keepdim=True)  # (a table may have no rows)
            outs.append((rows.expand(len(g.members) * batch, g.dim), False))
        return self._assemble(outs, batch)

    def _lookup_fbgemm(
        self,
        gi: int,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch: int,
        plan: Plan,
        id_starts: list[int],
        checked: torch.Tensor | None,
    ) -> tuple[torch.Tensor, bool]:
        """fbgemm's ``[B, members * dim]`` for group ``gi`` (a "wide" result).

        The op takes the group's own slice of the ids and offsets rebased to it; ``checked``
        is the id check's token under dynamo.
        """
        g = self._layout.groups[gi]
        weight = self.groups[gi].weight
        meta = self._const(gi, weight.device, "fbgemm")
        ms, me = plan.member_ranges[gi]
        a, b = id_starts[gi], id_starts[gi + 1]
        bags = offsets.narrow(0, ms * batch, (me - ms) * batch + 1)
        out = _fbgemm.lookup(
            weight,
            meta,
            values[a:b],
            bags - a if a else bags,
            g.pooling,
            None if weights is None else weights[a:b],
            checked,
        )
        return out, True

    def _lookup_torch(
        self,
        group_ids: list[int],
        values: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        counts: Sequence[int] | None,
        batch: int,
        plan: Plan,
        id_starts: list[int],
    ) -> dict[int, tuple[torch.Tensor, bool]]:
        """``F.embedding_bag`` per group, ``[members * B, dim]`` each.

        The id shift (by each table's first row in its group) and the per-group bag starts
        are computed once for all groups, so a group costs one kernel whatever the count.
        """
        groups = self._layout.groups
        num_rows = max(groups[gi].num_rows for gi in group_ids)
        dtype = ids_dtype(values, num_rows)
        ids = _as_dtype(values, dtype)
        if any(len(groups[gi].tables) > 1 for gi in group_ids):
            if counts is not None:
                count_t = torch.tensor(list(counts), dtype=torch.long).to(values.device)
            else:  # per-member id counts without a host read (one group, one batch size)
                m = len(self._members_group_major)
                count_t = lengths.view(m, lengths.numel() // m).sum(1)
            ids = shift_ids(ids, self._const(-1, values.device, "row_offsets"), count_t)
        offsets = _as_dtype(offsets, dtype)
        single = len(groups) == 1
        if not single:  # bag starts relative to each group's first id
            ranges = plan.member_ranges
            shift = torch.repeat_interleave(
                torch.tensor(id_starts[:-1], dtype=dtype).to(values.device),
                torch.tensor([(me - ms) * batch for ms, me in ranges]).to(values.device),
                output_size=offsets.numel() - 1,
            )
            starts = offsets[:-1] - shift
        out: dict[int, tuple[torch.Tensor, bool]] = {}
        for gi in group_ids:
            g = groups[gi]
            a, b = id_starts[gi], id_starts[gi + 1]
            ms, me = plan.member_ranges[gi]
            bags = offsets if single else starts.narrow(0, ms * batch, (me - ms) * batch)
            pooled = embedding_bag_grouped(
                self.groups[gi].weight,
                ids.narrow(0, a, b - a),  # narrow, not [a:b]: compiled, both have size b - a
                bags,
                g.pooling,
                None if weights is None else weights.narrow(0, a, b - a),
                sparse=self._sparse,
                include_last_offset=single,
            )
            out[gi] = (pooled, False)
        return out

    def _fbgemm_ok(self, g: Group, weight: torch.Tensor, batch: int) -> bool:
        """Does group ``g`` go through fbgemm? Not in exported programs (they keep torch's
        ops) nor under symbolic tracing (the collection is a leaf there)."""
        if not self._use_fbgemm or self._sparse or batch == 0:
            return False
        if g.pooling == "max" or weight.dtype != torch.float32:
            return False
        if is_exporting() or is_symbolic_tracing():
            return False
        return _fbgemm_kernel(weight.device.type)

    def _assemble(self, outs: list[Any], batch: int) -> torch.Tensor:
        """``[B, sum(dims)]`` in output order from each group's lookup result.

        A torch lookup gives ``[members * B, dim]`` (member-major rows), fbgemm's a "wide"
        ``[B, members * dim]``. One ``cat`` at most, over runs of consecutive members.
        """
        groups = self._layout.groups
        if len(groups) == 1:
            out, wide = outs[0]
            m = len(groups[0].members)
            if wide or m == 1:
                return out
            # One transposing copy: faster than a cat of m slices, forward and backward.
            d = groups[0].dim
            return out.view(m, batch, d).transpose(0, 1).reshape(batch, m * d)
        rows: dict[int, tuple[torch.Tensor, ...]] = {}
        pieces: list[torch.Tensor] = []
        for gi, pos, n in self._runs:
            out, wide = outs[gi]
            d = groups[gi].dim
            if wide:
                # Always through narrow, even when the run is the whole output: its backward
                # hands fbgemm a contiguous gradient; the strided slice of cat's gradient
                # makes fbgemm's backward slower (wide shape: 105-112 ms against 139-152).
                pieces.append(out.narrow(1, pos * d, n * d))
                continue
            if gi not in rows:
                rows[gi] = out.view(len(groups[gi].members), batch, d).unbind(0)
            pieces.extend(rows[gi][pos : pos + n])
        return torch.cat(pieces, dim=1)

    def _plan(self, kjt: KeyedJaggedTensor) -> Plan:
        keys = tuple(kjt.keys())
        plan = self._plans.get(keys)
        if plan is None:
            plan = make_plan(keys, self._layout)
            if is_exporting():  # an exported program holds no module state
                return plan
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.pop(next(iter(self._plans)))
            self._plans[keys] = plan
        return plan

    def _const(self, gi: int, device: torch.device, what: str) -> Any:
        """Small per-group constant tensors, built once per device (outside inference mode:
        a first call under ``torch.inference_mode`` must not make them unusable in training)."""
        key = (gi, device, what)
        c = self._device_consts.get(key)
        if c is None:
            with torch.inference_mode(False):
                c = self._build_const(gi, device, what)
            if not is_exporting():  # (export traces with fake tensors)
                self._device_consts[key] = c
        return c

    def _build_const(self, gi: int, device: torch.device, what: str) -> Any:
        if what == "row_offsets":  # every member's first row in its group, group-major
            offs = [m.row_offset for m in self._members_group_major]
            return torch.tensor(offs, dtype=torch.long, device=device)
        g = self._layout.groups[gi]
        members = [self._layout.members[mi] for mi in g.members]
        return _fbgemm.FbgemmGroupMeta(
            [m.row_offset for m in members],
            g.dim,
            g.num_rows,
            [m.num_embeddings for m in members],
            [f"{m.feature} (table {m.table_name})" for m in members],
        )


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the no-op cast a traced graph would record (and rules fuse)."""
    return t if t.dtype == dtype else t.to(dtype)


@torch.compiler.assume_constant_result
def _fbgemm_kernel(device_type: str) -> bool:
    """:func:`_fbgemm.has_kernel`, a constant to dynamo (it reads the dispatcher's table)."""
    return _fbgemm.has_kernel(device_type)


def _runs(layout: Layout) -> list[tuple[int, int, int]]:
    """Runs of consecutive output members in one group: (group, first position in it, count)."""
    pos = {mi: j for g in layout.groups for j, mi in enumerate(g.members)}
    runs: list[tuple[int, int, int]] = []
    for mi, m in enumerate(layout.members):
        if runs and runs[-1][0] == m.group and pos[mi] == runs[-1][1] + runs[-1][2]:
            gi, p, n = runs[-1]
            runs[-1] = (gi, p, n + 1)
        else:
            runs.append((m.group, pos[mi], 1))
    return runs


def _bad_config(t: Any) -> EmbeddingBagConfig:
    if type(t).__name__ == "EmbeddingBagConfig" and hasattr(t, "num_embeddings"):
        return EmbeddingBagConfig.from_torchrec(t)
    raise ValueError(f"tables must be fxrec.nn.EmbeddingBagConfig objects, got {type(t).__name__}.")
