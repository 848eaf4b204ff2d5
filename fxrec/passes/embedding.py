"""Parallel embedding lookups become one grouped lookup over one laid-out weight.

Spellings matched (both IRs):

==================  ================================================================
``nn.Embedding``    ``call_module``; dynamo's inlined ``F.embedding(ids, weight, ...)``
``nn.EmbeddingBag`` ``call_module`` (``input, offsets, per_sample_weights``); dynamo's
                    inlined ``F.embedding_bag(ids, weight, offsets, ...)``
pooled by hand      ``embedding(ids).sum(1)`` / ``.mean(1)`` on 2-D ids: a 2-D bag
==================  ================================================================

Members must agree on kind, embedding dim, pooling mode, ``sparse``, ``include_last_offset``,
weight dtype and device, ids shape and dtype, offsets shape and whether per-sample weights
exist; ``padding_idx``, ``max_norm`` and ``scale_grad_by_freq`` must be unset (each changes
what a row lookup means per table). The tables' rows are laid out once in one weight
(``ctx.params.combined(..., "cat")``; a table looked up by several members appears once), and
each member's ids are shifted by its table's first row. The fused forward is:

* ids of equal shape, no offsets (``nn.Embedding`` on any shape, ``nn.EmbeddingBag`` on 2-D
  bags): the ids side by side as ``X`` (a view when they are consecutive pieces of one
  tensor, e.g. the output of fused ``.long()`` casts, or evenly spaced columns ``ids[:, i]``
  of one; else one ``torch.stack``), ONE ``add``
  of a constant per-table offset broadcast over ``X``, ONE lookup, ``unbind`` into members.
  Short fixed-size bags (sum/mean, dense gradients) are pooled as ONE ``index_select`` of
  rows plus one reduction, whose backward is cheaper on CPU (:func:`_gather_pays`);
* 2-D bags on CPU when the graph runs eagerly and fbgemm is installed (sum/mean, dense
  gradients, float32 tables): ONE fbgemm table-batched lookup, whose members may differ in
  bag size (one id, multi-hot). Its output is ``[B, members * dim]``, member-major, so the
  pooled rows come out side by side with no stack, and its CPU backward is ~3x cheaper than
  torch's (:func:`_tbe_usable`). The ids are the members' ids flattened member after member,
  read from before fused ``.long()`` casts when there were any (:func:`_uncast_ids`): one
  copy when they are columns of one tensor, else one ``cat`` (:func:`_member_major`); bags of
  one length start at one ``arange`` (:func:`_bag_offsets`);
* 1-D ids with per-member offsets (``EmbeddingBag``): one ``cat`` of ids, one
  ``repeat_interleave`` of each member's table offset and valid id range by its id count
  (read at run time, never baked), one ``add``, bag offsets shifted by each member's start
  (one ``stack`` + one ``add``), ONE ``embedding_bag``, split per member.

Every id is checked against its own table before the shift (:func:`_checked_ids`): in the
laid-out weight, an id past its table would otherwise read the next table's row where the
separate lookup raised. Eagerly on CPU that is two kernels (a ``clamp`` into each table's
range, an ``equal`` with the ids) and one host read, raising an ``IndexError`` naming the
member; compiled graphs and other devices assert on the device
(:func:`fxrec.nn.functional.check_member_ids`). fbgemm's CPU table-batched lookup checks
each table's ids itself, except where members share a table (a table looked up twice): the
lookup then checks them first (``pooled_lookup``'s ``rows``).

On CPU, a set of fewer than :data:`MIN_POOLED_MEMBERS` lookups pooled by hand is left as
written (with the reason in the report): each costs 2 kernels, and the fused form's fixed work
costs about what 3 do (``FuseParallelLookups._pooled_cost_reason``).

No size taken from the input (batch, number of ids) is baked into the rewritten graph.
Tables that cannot be laid out once (``keep_params``, graph inputs) would be concatenated
in-graph every step: the cost model of :mod:`fxrec.passes.linear` refuses that when the
tables outweigh the looked-up activations (they almost always do).
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxrec.graph import meta
from fxrec.graph.effects import member_refusal
from fxrec.graph.pieces import FULL, Column, columns_of, piece_of, split_sizes
from fxrec.graph.refs import combined, gather_cost_reason, param_info
from fxrec.graph.rule import HorizontalRule, RewriteContext, register
from fxrec.nn.functional import check_jagged_ids, check_member_ids
from fxrec.nn.layout import DEFAULT_MAX_GROUP_BYTES
from fxrec.passes.pointwise import unary_op

logger = logging.getLogger(__name__)

__all__ = ["Lookup", "lookup_call", "FuseParallelLookups", "eager_only_lookups"]

EMBEDDING_FUNCTIONS = {F.embedding}
EMBEDDING_BAG_FUNCTIONS = {F.embedding_bag}
Ref = Any
# On CPU, the tables of one fused lookup hold at most this many bytes (the cap of
# ``fxrec.nn.EmbeddingBagCollection``'s groups, see :mod:`fxrec.nn.layout`). A CPU optimizer
# steps parameter by parameter (``foreach=False``) with scratch as large as each parameter,
# and a dense gradient past glibc's 32 MiB mmap threshold is a fresh mapping whose pages fault
# in every step. Measured here (Adagrad training step, 1 thread, batch 512, 2 ids per bag;
# model as written / cap 16 / 64 / 256 MiB / none): 64 tables of 100,000 x 32 took 1576 /
# 1236 / 2368 / 2469 / 2638 ms with step peaks of 0.76 / 0.03 / 0.88 / 1.24 / 1.53 GiB;
# 104 tables of 20,000 x 16 took 343 / 212 / 267 / 261 / 260 ms (peaks 0.13 / 0.05 / 0.25
# GiB from 64 MiB on). The benchmark's ranking model (104 x 1,000 x 16, 6.5 MiB) is one set.
CPU_MAX_TABLE_BYTES = DEFAULT_MAX_GROUP_BYTES
# Lookups pooled by hand cost 2 kernels each as written (the lookup, the reduction). On CPU
# their fused form (an ids copy, bag offsets, one grouped lookup, its split) costs about what 3
# of them do: measured side by side (tables of 50 x 8 and 1,000 x 16, batch 32-512, 1-20 ids per
# bag, 1 thread), sets of 2 ran 0.7-0.95x the model as written without gradients and 0.8-1.0x
# in training at batch 32; from 4 members, 1.0-1.5x either way. fbgemm's backward pays for
# itself in training from about a thousand ids per member (2 tables of batch 256 x 5 ids:
# 1.2-1.3x; x 20 ids: 1.75x).
MIN_POOLED_MEMBERS = 4
MIN_POOLED_TRAINING_IDS = 1024
# Jagged ids need 9 fixed kernels (forward, the id check's 2 included) against one per
# member; backward saves N-1: fewer kernels in all from 6 members.
MIN_JAGGED_MEMBERS = 6


@dataclass(frozen=True)
class Lookup:
    """One embedding lookup in canonical form (``bag``: EmbeddingBag semantics)."""

    bag: bool
    ids: fx.Node
    weight: Ref
    offsets: fx.Node | None
    per_sample_weights: fx.Node | None
    mode: str
    sparse: bool
    include_last_offset: bool
    plain: bool  # padding_idx, max_norm and scale_grad_by_freq all unset


def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


# Fixed-size bags of at most this many ids are pooled as a row gather + a reduction.
MAX_GATHERED_BAG = 8


def _gather_pays(lk: Lookup, weighted: bool, bag_len: Any) -> bool:
    """Cost rule: pool fixed-size bags as ``index_select`` + ``sum``/``mean``?

    On CPU the backward of ``embedding_bag`` sorts the ids before accumulating rows; the
    backward of ``index_select`` is one ``index_add_``. Measured on the benchmark's tables
    (63 tables x batch 256, one id per bag), a training step of the lookup is ~1.9x faster
    gathered, and still faster at 4 ids per bag. The gathered rows are materialised
    (``bag_len`` x the pooled output), so long bags keep ``embedding_bag``, as do sparse
    gradients, per-sample weights and max pooling.
    """
    return (
        lk.mode in ("sum", "mean")
        and not lk.sparse
        and not weighted
        and isinstance(bag_len, int)
        and 1 <= bag_len <= MAX_GATHERED_BAG
    )


def _gathered_bags(
    ctx: RewriteContext, ids: fx.Node, w: fx.Node, mode: str, bag_len: int
) -> fx.Node:
    """``embedding_bag(ids, w, mode)`` for 2-D ``ids`` of ``bag_len`` ids per bag."""
    rows = ctx.call(torch.index_select, (w, 0, ctx.call_method("flatten", (ids,))))
    if bag_len == 1:
        return rows  # (bags, dim): a bag of one id pools to its row, for sum and mean alike
    rows = ctx.call_method("unflatten", (rows, 0, (-1, bag_len)))
    return ctx.call(torch.sum if mode == "sum" else torch.mean, (rows, 1))


def _tbe_usable(ctx: RewriteContext, lk: Lookup, wi: meta.TensorInfo, ii: meta.TensorInfo) -> bool:
    """Cost rule: run 2-D bags through fbgemm's table-batched lookup?

    Measured on the benchmark's ranking model (104 tables of 1,000 x 16 rows, bags of 1-4
    ids, batch 256): the lookups' forward and backward take 3.6 ms with fbgemm against
    10.9 ms with the gathered ``index_select`` form plus the ``stack`` that puts the pooled
    rows side by side. Only where the op exists, for eager graphs (it has no fake kernel for
    tracing), and for what it computes like ``embedding_bag``: sum/mean pooling, dense
    gradients, float32 tables.
    """
    if not (ctx.runs_eagerly and lk.bag and lk.offsets is None and ii.ndim == 2):
        return False
    if lk.mode not in ("sum", "mean") or lk.sparse or lk.include_last_offset:
        return False
    if wi.dtype != torch.float32 or not ii.static:
        return False
    from fxrec.nn import _fbgemm

    return _fbgemm.has_kernel(wi.device.type)


def eager_only_lookups(gm: fx.GraphModule) -> list[fx.Node]:
    """The fbgemm table-batched lookups in ``gm``: :func:`_tbe_usable` puts them only in
    graphs run as they are, since they have no fake kernel. A graph traced further (by
    ``torch.export``) must be rewritten with ``runs_eagerly=False``, which does them with
    torch ops."""
    from fxrec.nn._fbgemm import pooled_lookup

    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is pooled_lookup]


def _int64_cast_of(node: fx.Node, ctx: RewriteContext) -> fx.Node | None:
    """The input of ``node`` if ``node`` casts integer ids to int64 (exact), else None."""
    op = unary_op(node, ctx)
    if op is None or op.name != "to" or dict(op.extra).get("dtype") != torch.int64:
        return None
    xi = ctx.info(op.input)
    return op.input if xi is not None and xi.dtype in (torch.int32, torch.int64) else None


def _uncast_ids(ids: fx.Node, ctx: RewriteContext) -> fx.Node:
    """``ids`` as read before an int64 cast: the cast is done by fbgemm's int32 path for free.

    Sees through ``x.long()`` and through its fused form, piece ``i`` of
    ``split(cat(xs, d).to(int64), sizes, d)`` with the sizes of ``xs`` (``xs[i]``).
    """
    direct = _int64_cast_of(ids, ctx)
    if direct is not None:
        return direct
    p = piece_of(ids)
    if p is None or p.squeezed:
        return ids
    src = _int64_cast_of(p.base, ctx)
    if src is None or src.op != "call_function" or src.target is not torch.cat:
        return ids
    xs = _arg(src, 0, "tensors")
    si = ctx.info(src)
    d = _arg(src, 1, "dim", 0)
    if not isinstance(xs, (list, tuple)) or si is None or not isinstance(d, int):
        return ids
    d = d % si.ndim
    infos = [ctx.info(x) if isinstance(x, fx.Node) else None for x in xs]
    if d != p.dim or any(i is None for i in infos):
        return ids
    sizes = split_sizes(p.source)
    if sizes is None or sizes[2] != [i.shape[d] for i in infos]:  # type: ignore[union-attr]
        return ids
    x = xs[p.index]
    return x if infos[p.index].dtype in (torch.int32, torch.int64) else ids  # type: ignore[union-attr]


def lookup_call(node: fx.Node, ctx: RewriteContext) -> Lookup | None:
    """Recognise any spelling of an embedding (bag) lookup, and a lookup pooled by hand."""
    pooled = _pooled_lookup(node, ctx)
    return pooled if pooled is not None else _lookup_call(node, ctx)


POOLING_METHODS = {"sum": "sum", "mean": "mean"}
POOLING_FUNCTIONS = {torch.sum: "sum", torch.mean: "mean"}


def _pooled_lookup(node: fx.Node, ctx: RewriteContext) -> Lookup | None:
    """``embedding(ids).sum(1)`` (or ``.mean(1)``) of 2-D ``ids`` in a float32/64 table: a
    lookup of 2-D bags, as ``embedding_bag`` computes it (same sums, up to rounding).

    Fused as bags, the lookups never materialise the members' ``[B, L, D]`` rows: fused as
    plain lookups, the backward stacked those rows' gradients for one dense backward, and a
    training step of 8 tables x batch 2048 x 20 ids x dim 64 was ~1.5x slower than the model
    as written on CPU.
    """
    if node.op == "call_method" and node.target in POOLING_METHODS:
        mode, x, rest = POOLING_METHODS[node.target], node.args[0], node.args[1:]
    elif node.op == "call_function" and node.target in POOLING_FUNCTIONS:
        mode, x, rest = POOLING_FUNCTIONS[node.target], _arg(node, 0, "input"), node.args[1:]
    else:
        return None
    kw = dict(node.kwargs)
    dim = rest[0] if rest else kw.pop("dim", None)
    if len(rest) > 1 or kw.pop("keepdim", False) or kw.pop("dtype", None) is not None or kw:
        return None
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if dim not in (1, -2) or not isinstance(x, fx.Node) or len(x.users) != 1:
        return None
    inner = _lookup_call(x, ctx)
    if inner is None or inner.bag:
        return None
    ii, wi = ctx.info(inner.ids), param_info(ctx, inner.weight)
    if ii is None or ii.ndim != 2 or wi is None or wi.dtype not in (torch.float32, torch.float64):
        return None
    if ii.shape[1] == 0:  # no ids per row: embedding_bag's 2-D form refuses it
        return None
    return Lookup(True, inner.ids, inner.weight, None, None, mode, inner.sparse, False, inner.plain)


def _is_pooling(node: fx.Node) -> bool:
    """``node`` is a ``sum``/``mean`` (a member the rule matched is then a lookup pooled by hand)."""
    if node.op == "call_method":
        return node.target in POOLING_METHODS
    return node.op == "call_function" and node.target in POOLING_FUNCTIONS


def _pooled_by_hand(node: fx.Node, ctx: RewriteContext) -> bool:
    """``node`` is a plain lookup whose one user pools it (that user is the member)."""
    return len(node.users) == 1 and _pooled_lookup(next(iter(node.users)), ctx) is not None


def _lookup_call(node: fx.Node, ctx: RewriteContext) -> Lookup | None:
    if node.op == "call_module":
        mod = ctx.module(node)
        if type(mod) is nn.Embedding:
            if len(node.args) != 1 or node.kwargs:
                return None
            plain = mod.padding_idx is None and mod.max_norm is None and not mod.scale_grad_by_freq
            return Lookup(
                False,
                node.args[0],
                f"{node.target}.weight",
                None,
                None,
                "",
                mod.sparse,
                False,
                plain,
            )
        if type(mod) is nn.EmbeddingBag:
            ids = _arg(node, 0, "input")
            off, psw = _arg(node, 1, "offsets"), _arg(node, 2, "per_sample_weights")
            plain = mod.padding_idx is None and mod.max_norm is None and not mod.scale_grad_by_freq
            return Lookup(
                True,
                ids,
                f"{node.target}.weight",
                off,
                psw,
                mod.mode,
                mod.sparse,
                mod.include_last_offset,
                plain,
            )
        return None
    if node.op != "call_function":
        return None
    if node.target in EMBEDDING_FUNCTIONS:
        ids, w = _arg(node, 0, "input"), _arg(node, 1, "weight")
        plain = (
            _arg(node, 2, "padding_idx") is None
            and _arg(node, 3, "max_norm") is None
            and not _arg(node, 5, "scale_grad_by_freq", False)
        )
        sparse = _arg(node, 6, "sparse", False)
        return Lookup(False, ids, w, None, None, "", bool(sparse), False, plain)
    if node.target in EMBEDDING_BAG_FUNCTIONS:
        ids, w, off = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "offsets")
        plain = (
            _arg(node, 3, "max_norm") is None
            and not _arg(node, 5, "scale_grad_by_freq", False)
            and _arg(node, 10, "padding_idx") is None
        )
        return Lookup(
            True,
            ids,
            w,
            off,
            _arg(node, 8, "per_sample_weights"),
            _arg(node, 6, "mode", "mean"),
            bool(_arg(node, 7, "sparse", False)),
            bool(_arg(node, 9, "include_last_offset", False)),
            plain,
        )
    return None


def _valid(lk: Lookup) -> bool:
    nodes_ok = isinstance(lk.ids, fx.Node) and (
        isinstance(lk.weight, (str, fx.Node))
        and (lk.offsets is None or isinstance(lk.offsets, fx.Node))
        and (lk.per_sample_weights is None or isinstance(lk.per_sample_weights, fx.Node))
    )
    return nodes_ok and lk.plain and isinstance(lk.mode, str)


def _unique(refs: Sequence[Ref]) -> tuple[list[Ref], list[int]]:
    """Distinct tables in first-seen order, and each member's table position."""
    keys: dict[Any, int] = {}
    out: list[Ref] = []
    pos: list[int] = []
    for r in refs:
        k = r if isinstance(r, str) else ("node", r)
        if k not in keys:
            keys[k] = len(out)
            out.append(r)
        pos.append(keys[k])
    return out, pos


@dataclass
class _Side:
    """The members' equally shaped tensors side by side: ``node`` has the members at ``dim``."""

    node: fx.Node
    dim: int
    order: list[int]


def _step(indices: Sequence[int]) -> int | None:
    """``k`` when ``indices`` are ``i, i + k, i + 2k, ...`` with ``k >= 1``, else None."""
    if len(indices) < 2:
        return 1
    k = indices[1] - indices[0]
    ok = k >= 1 and all(b - a == k for a, b in itertools.pairwise(indices))
    return k if ok else None


def _strided_columns(ctx: RewriteContext, cols: Sequence[Column]) -> fx.Node | None:
    """A view of the columns' base holding them in order at their dim (a strided slice), or
    None when their indices are not evenly spaced upwards."""
    indices = [c.index for c in cols]
    step = _step(indices)
    if step is None:
        return None
    base, d = cols[0].base, cols[0].dim
    size = meta.info(base).shape[d]  # type: ignore[union-attr]
    stop = indices[-1] + 1
    if indices[0] == 0 and step == 1 and stop == size:
        return base
    return ctx.call(operator.getitem, (base, (FULL,) * d + (slice(indices[0], stop, step),)))


def _member_major(ctx: RewriteContext, xs: Sequence[fx.Node]) -> fx.Node:
    """``cat([x.flatten() for x in xs])`` as one copy when ``xs`` are columns of one tensor:
    each column of a row-major tensor is strided, so flattening it alone is a copy per member.

    Columns evenly spaced upwards in the members' order are one strided view, moved
    member-first and reshaped; other columns (out of order, repeated) one ``index_select``.
    """
    cols = columns_of(xs)
    if cols is None:
        return ctx.call(torch.cat, ([ctx.call_method("flatten", (x,)) for x in xs], 0))
    d = cols[0].dim
    view = _strided_columns(ctx, cols)
    if view is not None:
        if d:
            view = ctx.call_method("movedim", (view, d, 0))
        return ctx.call_method("reshape", (view, -1))
    base = cols[0].base
    if d:
        base = ctx.call_method("movedim", (base, d, 0))
    bi = ctx.info(base)
    assert bi is not None
    i64 = meta.TensorInfo.of(torch.empty(0, dtype=torch.int64, device=bi.device))
    picked = ctx.call(
        torch.index_select, (base, 0, _offsets_buffer(ctx, [c.index for c in cols], i64))
    )
    return ctx.call_method("flatten", (picked,))


def _side_by_side(ctx: RewriteContext, xs: Sequence[fx.Node], order: list[int] | None) -> _Side:
    """A view when ``xs`` are consecutive equal pieces of one tensor, or evenly spaced
    columns of one, else a ``stack``."""
    n = len(xs)
    pieces = [piece_of(x) for x in xs]
    first = pieces[0]
    if first is not None and all(
        p is not None
        and p.base is first.base
        and p.dim == first.dim
        and p.squeezed == first.squeezed
        and p.length == first.length
        for p in pieces
    ):
        perm = sorted(range(n), key=lambda i: pieces[i].start)  # type: ignore[union-attr]
        starts = [pieces[i].start for i in perm]  # type: ignore[union-attr]
        consecutive = all(b - a == first.length for a, b in itertools.pairwise(starts))
        bi = meta.info(first.base)
        if consecutive and (order is None or perm == order) and isinstance(bi, meta.TensorInfo):
            x, d = first.base, first.dim
            total = first.length * n
            if starts[0] != 0 or total != bi.shape[d]:
                x = ctx.call_method("narrow", (x, d, starts[0], total))
            if not first.squeezed:
                x = ctx.call_method("unflatten", (x, d, (n, -1)))
            return _Side(x, d, perm)
    cols = columns_of(xs)
    if cols is not None:
        perm = sorted(range(n), key=lambda i: cols[i].index)
        view = _strided_columns(ctx, [cols[i] for i in perm])
        if view is not None and (order is None or perm == order):
            return _Side(view, cols[0].dim, perm)
    order = list(range(n)) if order is None else order
    return _Side(ctx.call(torch.stack, ([xs[i] for i in order], 0)), 0, order)


def _offsets_buffer(
    ctx: RewriteContext,
    values: list[int] | list[list[int]],
    like: meta.TensorInfo,
    dtype: torch.dtype | None = None,
) -> fx.Node:
    """A constant tensor of table offsets (or sizes), held by the graph module, not the model."""
    i = 0
    while hasattr(ctx.gm, f"fxrec_table_offsets{i}"):
        i += 1
    name = f"fxrec_table_offsets{i}"
    ctx.gm.register_buffer(
        name,
        torch.tensor(values, dtype=dtype or like.dtype, device=like.device),
        persistent=False,
    )
    node = ctx.graph.get_attr(name)
    meta.set_info(node, getattr(ctx.gm, name))
    return node


def _bag_offsets(
    ctx: RewriteContext, ids: fx.Node, first: fx.Node, bag_lens: list[int], batch: int
) -> fx.Node:
    """Offsets of the bags of member-major ``ids`` (``batch`` bags of ``bag_lens[m]`` ids per
    member ``m``), computed at run time: the batch (``first``'s dim 0) is never baked in.

    Bags of one length ``L`` start every ``L`` ids: one ``arange``. Mixed lengths are each
    member's lengths repeated over the batch, then a ``cumsum``.
    """
    ii = ctx.info(ids)
    assert ii is not None
    n = len(bag_lens)
    if len(set(bag_lens)) == 1 and bag_lens[0] > 0:
        total = ctx.graph.call_function(torch.Tensor.size, (ids, 0))
        end = ctx.graph.call_function(operator.add, (total, 1))
        kw = {"dtype": ii.dtype, "device": ii.device}
        node = ctx.call(torch.arange, (0, end, bag_lens[0]), kw, infer=False)
        meta.set_info(node, torch.empty(n * batch + 1, **kw))  # type: ignore[arg-type]
        return node
    b = ctx.graph.call_function(torch.Tensor.size, (first, 0))
    lens = ctx.call_method("view", (_offsets_buffer(ctx, bag_lens, ii), n, 1))
    lens = ctx.call_method("expand", (lens, n, b), infer=False)
    meta.set_info(lens, torch.empty(n, batch, dtype=ii.dtype, device=ii.device))
    lens = ctx.call_method("reshape", (lens, -1))
    ends = ctx.call(torch.cumsum, (lens, 0), {"dtype": ii.dtype})
    return ctx.call(F.pad, (ends, (1, 0)))


def _member_name(node: fx.Node, lk: Lookup) -> str:
    """How an error names a member: its module path, else its weight's, else the node's name."""
    if node.op == "call_module":
        return str(node.target)
    w = lk.weight
    target = w if isinstance(w, str) else w.target if w.op == "get_attr" else None
    if isinstance(target, str):
        return target.removesuffix(".weight")
    stack = node.meta.get("nn_module_stack")
    if stack:  # dynamo's path of the module that made the call: ``L['self'].embs.0``
        path = str(list(stack.values())[-1][0])
        return re.sub(r"^L\['[^']*'\]\.?", "", path) or node.name
    return node.name


def _names(group: Sequence[fx.Node], lks: Sequence[Lookup]) -> tuple[str, ...]:
    return tuple(_member_name(n, lk) for n, lk in zip(group, lks))


def _checked_ids(
    ctx: RewriteContext,
    ids: fx.Node,
    dim: int,
    group: Sequence[fx.Node],
    lks: Sequence[Lookup],
) -> fx.Node:
    """``ids`` (member ``i`` at index ``i`` of ``dim``) after each is checked against its table."""
    info = ctx.info(ids)
    assert info is not None
    sizes = tuple(_rows(ctx, lks))
    bounds = _offsets_buffer(ctx, [[0] * len(sizes), [r - 1 for r in sizes]], info)
    node = ctx.call(
        check_member_ids,
        (ids, bounds, dim, _names(group, lks), sizes),
        {"compiled": not ctx.runs_eagerly},
        infer=False,
    )
    meta.set_info(node, info)
    return node


def _rows(ctx: RewriteContext, lks: Sequence[Lookup]) -> list[int]:
    """Each member's table size."""
    return [param_info(ctx, lk.weight).shape[0] for lk in lks]  # type: ignore[union-attr]


def _table_bytes(ctx: RewriteContext, table: Ref) -> int:
    ti = param_info(ctx, table)
    return ti.numel() * ti.dtype.itemsize if ti is not None else 0


def _capped_subsets(
    ctx: RewriteContext, group: Sequence[fx.Node], lks: Sequence[Lookup], cap: int
) -> list[list[fx.Node]]:
    """``group`` cut so that each subset's distinct tables fit in ``cap`` bytes.

    Each table, in the order the program first reads them, goes into the first subset with
    room for it (first fit): small tables read around a large one share a subset instead of
    being left alone by a cut at the large one. A table of ``cap`` bytes or more makes a
    subset of its own; members in a subset keep program order.
    """
    order = sorted(range(len(group)), key=lambda i: meta.program_order(group[i]))
    tables, pos = _unique([lks[i].weight for i in order])
    used: list[int] = []  # each subset's bytes
    subset_of: list[int] = []  # each table's subset
    for t in tables:
        size = _table_bytes(ctx, t)
        room = [k for k, u in enumerate(used) if u + size <= cap]
        if not room:
            used.append(0)
            room = [len(used) - 1]
        subset_of.append(room[0])
        used[room[0]] += size
    parts: list[list[fx.Node]] = [[] for _ in used]
    for i, p in zip(order, pos):
        parts[subset_of[p]].append(group[i])
    return parts


def _alone_reason(ctx: RewriteContext, lk: Lookup | None, cap_mib: int) -> str:
    """Why a member of a set cut under the CPU cap keeps its own lookup."""
    size = _table_bytes(ctx, lk.weight) if lk is not None else 0
    if size >= CPU_MAX_TABLE_BYTES:
        return (
            f"CPU cost model: its table alone fills the {cap_mib} MiB cap of a fused lookup's "
            "tables"
        )
    return (
        f"CPU cost model: left alone when the set was cut into subsets of at most {cap_mib} MiB "
        f"of tables (the cap of a fused lookup's tables): no subset had room for its "
        f"{size / (1 << 20):.2f} MiB table"
    )


@register
class FuseParallelLookups(HorizontalRule):
    """N independent lookups of equal dim and mode -> one lookup over one laid-out weight."""

    name = "parallel_embedding"
    family = "embedding"
    candidates = {
        "call_module": None,
        "call_function": EMBEDDING_FUNCTIONS | EMBEDDING_BAG_FUNCTIONS | set(POOLING_FUNCTIONS),
        "call_method": set(POOLING_METHODS),
    }

    def __init__(self, fbgemm: bool = True) -> None:
        """``fbgemm=False``: never use fbgemm's table-batched lookup (torch ops only)."""
        self.fbgemm = fbgemm

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        lk = lookup_call(node, ctx)
        if lk is None or not _valid(lk) or (not lk.bag and _pooled_by_hand(node, ctx)):
            return None
        ii, wi = ctx.info(lk.ids), param_info(ctx, lk.weight)
        if ii is None or wi is None or not ii.static or wi.ndim != 2 or ii.dtype.is_floating_point:
            return None
        if ii.ndim == 0 or ii.dtype not in (torch.int64, torch.int32) or wi.shape[0] == 0:
            return None  # (a table of no rows has no id to check against)
        oi = None
        if lk.offsets is not None:
            oinfo = ctx.info(lk.offsets)
            if oinfo is None or not oinfo.static or ii.ndim != 1 or lk.include_last_offset:
                return None
            oi = (oinfo.shape, oinfo.dtype)
        elif lk.bag and ii.ndim != 2:
            return None
        pi = None
        if lk.per_sample_weights is not None:
            p = ctx.info(lk.per_sample_weights)
            if p is None or p.shape != ii.shape:
                return None
            pi = p.dtype
        if self._tbe(ctx, lk, wi, ii):  # bag sizes may differ, batch may not
            return ("tbe", lk.mode, wi.shape[1], wi.device, ii.shape[0], pi)
        return (
            "embedding_bag" if lk.bag else "embedding",
            lk.mode,
            lk.sparse,
            wi.shape[1],
            wi.dtype,
            wi.device,
            ii.shape if lk.offsets is None else ii.ndim,  # 1-D ids with offsets vary in length
            ii.dtype,
            oi,
            pi,
        )

    def partition(self, group: Sequence[fx.Node], ctx: RewriteContext) -> list[list[fx.Node]]:
        """On CPU, subsets whose tables stay under :data:`CPU_MAX_TABLE_BYTES`.

        Tables are packed first fit in the order the model first reads them
        (:func:`_capped_subsets`); a table read by several members keeps them together (it is
        laid out once). A member left alone (its table alone reaches the cap, or no subset
        had room for it) keeps its own lookup, with the reason in the report.
        Other devices and sparse gradients keep one lookup for the whole set: their
        optimizers do not allocate per parameter, and no dense gradient is allocated.
        """
        lks: list[Lookup] = [lookup_call(n, ctx) for n in group]  # type: ignore[misc]
        wi = param_info(ctx, lks[0].weight)
        if wi is None or wi.device.type != "cpu" or lks[0].sparse:
            return [list(group)]
        parts = _capped_subsets(ctx, group, lks, CPU_MAX_TABLE_BYTES)
        if len(parts) > 1:
            cap = CPU_MAX_TABLE_BYTES >> 20
            for part in parts:
                if len(part) == 1:
                    self.refuse(ctx, part, _alone_reason(ctx, lookup_call(part[0], ctx), cap))
            ctx.report.note(
                f"parallel_embedding: {len(group)} lookups of dim {wi.shape[1]} on CPU are cut "
                f"into {len(parts)} sets of at most {cap} MiB of tables each (a CPU optimizer "
                "allocates scratch per parameter, as large as one fused weight)"
            )
        return parts

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if (why := member_refusal(group)) is not None:
            return why
        lks: list[Lookup] = [lookup_call(n, ctx) for n in group]  # type: ignore[misc]
        if lks[0].offsets is not None and len(group) < MIN_JAGGED_MEMBERS:
            return (
                f"{len(group)} lookups on jagged ids: the fused form costs 9 kernels (cat, "
                f"repeat_interleave, index_select, id check x2, add, stack, add, lookup), worth "
                f"it from {MIN_JAGGED_MEMBERS}"
            )
        if (why := self._pooled_cost_reason(group, lks, ctx)) is not None:
            return why
        tables, _ = _unique([lk.weight for lk in lks])
        total_rows = sum(param_info(ctx, t).shape[0] for t in tables)  # type: ignore[union-attr]
        ii = ctx.info(lks[0].ids)
        assert ii is not None
        if ii.dtype == torch.int32 and total_rows >= 2**31:
            return "int32 ids cannot address the combined table: cast the ids to int64"
        dim = param_info(ctx, tables[0]).shape[1]  # type: ignore[union-attr]
        outs = 0
        for n in group:
            oi = ctx.info(n)
            outs += oi.numel() if oi is not None else dim
        return gather_cost_reason(ctx, [tables], "cat", outs)

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        lks: list[Lookup] = [lookup_call(n, ctx) for n in group]  # type: ignore[misc]
        if lks[0].offsets is not None:
            self._fuse_jagged(group, lks, ctx)
        elif self._tbe(ctx, lks[0], param_info(ctx, lks[0].weight), ctx.info(lks[0].ids)):  # type: ignore[arg-type]
            self._fuse_tbe(group, lks, ctx)
        else:
            self._fuse_dense(group, lks, ctx)

    # -- helpers -----------------------------------------------------------------------------
    def _pooled_cost_reason(
        self, group: Sequence[fx.Node], lks: Sequence[Lookup], ctx: RewriteContext
    ) -> str | None:
        """Cost rule (CPU): why a small set of lookups pooled by hand runs faster as written.

        Below :data:`MIN_POOLED_MEMBERS` members, only a graph that computes gradients
        through fbgemm's lookup, with at least :data:`MIN_POOLED_TRAINING_IDS` ids per member,
        is fused. Other devices always fuse (one kernel launch saved per member), as do sets
        holding an ``EmbeddingBag``, whose own call costs more than a lookup pooled by hand.
        """
        n = len(group)
        wi = param_info(ctx, lks[0].weight)
        if n >= MIN_POOLED_MEMBERS or wi is None or wi.device.type != "cpu":
            return None
        if not all(_is_pooling(node) for node in group):
            return None
        infos = [ctx.info(lk.ids) for lk in lks]
        ids = min(i.numel() if i is not None else 0 for i in infos)
        trains = wi.requires_grad and torch.is_grad_enabled()  # graphs are built per grad mode
        if trains and ids >= MIN_POOLED_TRAINING_IDS and self._tbe(ctx, lks[0], wi, infos[0]):  # type: ignore[arg-type]
            return None
        return (
            f"CPU cost model: {n} lookups pooled by hand cost 2 kernels each as written; fused, "
            "the ids copy, bag offsets, grouped lookup and split cost about as much as 3, so "
            f"such sets fuse from {MIN_POOLED_MEMBERS} members (or, computing gradients "
            f"through fbgemm, from {MIN_POOLED_TRAINING_IDS} ids per member; these have {ids})"
        )

    def _tbe(
        self, ctx: RewriteContext, lk: Lookup, wi: meta.TensorInfo, ii: meta.TensorInfo
    ) -> bool:
        """Does this member's group go through fbgemm (the key puts such members together)?"""
        return self.fbgemm and _tbe_usable(ctx, lk, wi, ii)

    @staticmethod
    def _table(ctx: RewriteContext, lks: Sequence[Lookup]) -> tuple[fx.Node, list[int]]:
        """The combined weight and each member's first row in it."""
        tables, pos = _unique([lk.weight for lk in lks])
        starts, acc = [], 0
        for t in tables:
            starts.append(acc)
            acc += param_info(ctx, t).shape[0]  # type: ignore[union-attr]
        w = combined(ctx, tables, "cat")
        return w, [starts[p] for p in pos]

    def _lookup(
        self, ctx: RewriteContext, lk: Lookup, ids: fx.Node, w: fx.Node, **kw: Any
    ) -> fx.Node:
        if not lk.bag:
            return ctx.call(F.embedding, (ids, w), {"sparse": lk.sparse})
        return ctx.call(
            F.embedding_bag,
            (ids, w),
            {"mode": lk.mode, "sparse": lk.sparse, **kw},
        )

    def _fuse_dense(self, group: Sequence[fx.Node], lks: list[Lookup], ctx: RewriteContext) -> None:
        n = len(group)
        ids = _side_by_side(ctx, [lk.ids for lk in lks], None)
        if lks[0].bag and ids.dim > 1:  # 2-D bags' members after their rows: move them before
            ids = _Side(ctx.call_method("movedim", (ids.node, ids.dim, 1)), 1, ids.order)
        group = [group[i] for i in ids.order]
        lks = [lks[i] for i in ids.order]
        psw = None
        if lks[0].per_sample_weights is not None:
            psw = _side_by_side(ctx, [lk.per_sample_weights for lk in lks], list(range(n)))
            if psw.dim != ids.dim:  # lay both out the same way
                psw = _Side(ctx.call_method("movedim", (psw.node, psw.dim, ids.dim)), ids.dim, [])
        w, starts = self._table(ctx, lks)
        xi = ctx.info(ids.node)
        assert xi is not None
        offs = _offsets_buffer(ctx, starts, xi)
        shape = [1] * xi.ndim
        shape[ids.dim] = n
        checked = _checked_ids(ctx, ids.node, ids.dim, group, lks)
        x = ctx.call(torch.add, (checked, ctx.call_method("view", (offs, *shape))))
        if not lks[0].bag:
            y = self._lookup(ctx, lks[0], x, w)
            parts = ctx.call(torch.unbind, (y, ids.dim))
            detail = f"embedding x{n}"
        else:  # 2-D bags per member: X is 3-D with the members at dim 0 or 1
            flat = ctx.call_method("flatten", (x, 0, 1))
            bag_len = xi.shape[-1]
            if _gather_pays(lks[0], psw is not None, bag_len):
                y = _gathered_bags(ctx, flat, w, lks[0].mode, bag_len)
                how = "index_select"
            else:
                kw = {}
                if psw is not None:
                    kw["per_sample_weights"] = ctx.call_method("flatten", (psw.node, 0, 1))
                y = self._lookup(ctx, lks[0], flat, w, **kw)
                how = "embedding_bag"
            split = (n, -1) if ids.dim == 0 else (-1, n)
            y = ctx.call_method("unflatten", (y, 0, split))
            parts = ctx.call(torch.unbind, (y, ids.dim))
            detail = f"{how}({lks[0].mode}) x{n}"
        self._scatter(ctx, group, parts)
        self.fired(ctx, group, detail + ("" if ids.node.target is not torch.stack else " (stack)"))

    def _fuse_tbe(self, group: Sequence[fx.Node], lks: list[Lookup], ctx: RewriteContext) -> None:
        """One fbgemm table-batched lookup; bags ``(member, row)``-major, one after another."""
        from fxrec.nn._fbgemm import _distinct_tables, pooled_lookup

        n = len(group)
        srcs = [_uncast_ids(lk.ids, ctx) for lk in lks]
        w, starts = self._table(ctx, lks)
        wi = ctx.info(w)
        assert wi is not None
        rows, dim = wi.shape
        ids = _member_major(ctx, srcs)
        ii = ctx.info(ids)
        assert ii is not None
        bag_lens = [ctx.info(lk.ids).shape[1] for lk in lks]  # type: ignore[union-attr]
        batch = ctx.info(lks[0].ids).shape[0]  # type: ignore[union-attr]
        offsets = _bag_offsets(ctx, ids, srcs[0], bag_lens, batch)
        i64 = meta.TensorInfo.of(torch.empty(0, dtype=torch.int64, device=ii.device))
        member_rows = _rows(ctx, lks)
        shared = None  # a table looked up twice: the op's own id check cannot see its rows
        if not _distinct_tables(starts, rows, member_rows):
            shared = _offsets_buffer(ctx, member_rows, i64)
        psw = None
        if lks[0].per_sample_weights is not None:
            psw = _member_major(ctx, [lk.per_sample_weights for lk in lks])  # type: ignore[misc]
        y = ctx.call(
            pooled_lookup,
            (
                w,
                _offsets_buffer(ctx, [s * dim for s in starts], i64),
                _offsets_buffer(ctx, list(range(0, (n + 1) * dim, dim)), i64, torch.int32),
                _offsets_buffer(ctx, [*starts, rows], i64),
                ids,
                offsets,
                n * dim,
                dim,
                int(math.log2(float(rows)) + 1),
                lks[0].mode,
                psw,
                _names(group, lks),
                True,
                shared,
            ),
            infer=False,
        )
        meta.set_info(y, torch.empty(batch, n * dim, dtype=wi.dtype, device=wi.device))
        y = ctx.call_method("unflatten", (y, 1, (n, dim)))
        self._scatter(ctx, group, ctx.call(torch.unbind, (y, 1)))
        self.fired(ctx, group, f"fbgemm table-batched({lks[0].mode}) x{n}")

    def _fuse_jagged(
        self, group: Sequence[fx.Node], lks: list[Lookup], ctx: RewriteContext
    ) -> None:
        n = len(group)
        w, starts = self._table(ctx, lks)
        ids = ctx.call(torch.cat, ([lk.ids for lk in lks], 0))
        ii = ctx.info(ids)
        assert ii is not None
        sizes = [ctx.graph.call_function(torch.Tensor.size, (lk.ids, 0)) for lk in lks]
        counts = ctx.call(torch.tensor, (sizes,), {"device": ii.device}, infer=False)
        rows = _rows(ctx, lks)
        # Each id's table offset and valid range (0, rows - 1) in one repeat.
        table = _offsets_buffer(ctx, [starts, [0] * n, [r - 1 for r in rows]], ii)
        total = ctx.graph.call_function(torch.Tensor.size, (ids, 0))
        per_id = ctx.call(
            torch.repeat_interleave, (table, counts, 1), {"output_size": total}, infer=False
        )
        meta.set_info(per_id, torch.empty(3, *ii.shape, dtype=ii.dtype, device=ii.device))
        bounds = ctx.call(operator.getitem, (per_id, slice(1, None)))
        checked = ctx.call(
            check_jagged_ids,
            (ids, bounds, counts, _names(group, lks), tuple(rows)),
            {"compiled": not ctx.runs_eagerly},
            infer=False,
        )
        meta.set_info(checked, ii)
        x = ctx.call(torch.add, (checked, ctx.call(operator.getitem, (per_id, 0))))
        # Bag offsets: member i's bags start after the ids of members 0..i-1.
        firsts = [0]
        for s in sizes[:-1]:
            firsts.append(ctx.graph.call_function(operator.add, (firsts[-1], s)))
        oi = ctx.info(lks[0].offsets)
        assert oi is not None
        shift = ctx.call(
            torch.tensor, (firsts,), {"dtype": oi.dtype, "device": oi.device}, infer=False
        )
        meta.set_info(shift, torch.empty(n, dtype=oi.dtype, device=oi.device))
        stacked = ctx.call(torch.stack, ([lk.offsets for lk in lks], 0))
        bag_offsets = ctx.call_method(
            "flatten", (ctx.call(torch.add, (stacked, ctx.call_method("unsqueeze", (shift, 1)))),)
        )
        kw: dict[str, Any] = {"offsets": bag_offsets}
        if lks[0].per_sample_weights is not None:
            kw["per_sample_weights"] = ctx.call(
                torch.cat, ([lk.per_sample_weights for lk in lks], 0)
            )
        y = self._lookup(ctx, lks[0], x, w, **kw)
        parts = ctx.call(torch.unbind, (ctx.call_method("unflatten", (y, 0, (n, -1))), 0))
        self._scatter(ctx, group, parts)
        self.fired(ctx, group, f"embedding_bag({lks[0].mode}) x{n} over jagged ids")

    @staticmethod
    def _scatter(ctx: RewriteContext, group: Sequence[fx.Node], parts: fx.Node) -> None:
        infos = meta.info(parts)
        for i, member in enumerate(group):
            item = ctx.graph.call_function(operator.getitem, (parts, i))
            if isinstance(infos, (list, tuple)) and i < len(infos):
                meta.set_info(item, infos[i])
            ctx.replace(member, item)
        ctx.erase_if_dead(group)
