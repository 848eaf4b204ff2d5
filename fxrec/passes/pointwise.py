"""Parallel pointwise ops become one: tanh, sigmoid, relu, gelu, silu, clamp, casts, and the
binary add, sub, mul, div, maximum, minimum.

Every common spelling matches (``torch.tanh``, ``Tensor.tanh``, ``F.tanh``, ``nn.Tanh``), which
Inductor's batch fusions miss. Members must agree on the op and its extra arguments, dtype
and device. In-place members (``relu(inplace=True)``, ``x.relu_()``) are refused: merging them
would lose the write to their input. Dropout in training mode is refused: one fused mask draws
different random numbers than N masks. So is a set where a member whose input may not be
row-major (a graph input, a transposed view) reaches a random op: a fused member is a
row-major slice, and a dropout after it would draw its mask for other elements.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxrec.graph import meta
from fxrec.graph.cost import copy_reason, copy_volume_reason, partial_view_pays, view_run_pays
from fxrec.graph.effects import (
    _is_view,
    _owner_module,
    is_random,
    member_refusal,
    mutates_input,
)
from fxrec.graph.horizontal import Gathered, gather, scatter
from fxrec.graph.pieces import Piece, contiguous_range, piece_of, piece_runs
from fxrec.graph.rule import HorizontalRule, RewriteContext, exact, register

logger = logging.getLogger(__name__)

__all__ = [
    "BinaryOp",
    "UnaryOp",
    "binary_op",
    "unary_op",
    "FuseParallelBinary",
    "FuseParallelUnary",
    "layout_draw_refusal",
]

# Node meta flags: members of a run of pieces split off from a larger set (set by
# ``partition``), and the fused op over such a run, which is kept apart from the other runs'
# ops in later passes rather than copied together with them.
_VIEW_RUN = "fxrec_unary_view_run"
_KEPT_APART = "fxrec_unary_kept_apart"
# The same for binary ops: the side ("lhs"/"rhs") whose pieces the run is a view of.
_BINARY_VIEW_RUN = "fxrec_binary_view_run"
_BINARY_KEPT_APART = "fxrec_binary_kept_apart"

# canonical name -> (functions, method names, module types)
_SPELLINGS: dict[str, tuple[set[Any], set[str], tuple[type, ...]]] = {
    "tanh": ({torch.tanh, F.tanh, torch.Tensor.tanh}, {"tanh"}, (nn.Tanh,)),
    "sigmoid": ({torch.sigmoid, F.sigmoid, torch.Tensor.sigmoid}, {"sigmoid"}, (nn.Sigmoid,)),
    "relu": ({torch.relu, F.relu, torch.Tensor.relu}, {"relu"}, (nn.ReLU,)),
    "gelu": ({F.gelu}, set(), (nn.GELU,)),
    "silu": ({F.silu}, set(), (nn.SiLU,)),
    "clamp": (
        {torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip},
        {"clamp", "clip"},
        (),
    ),
    "nan_to_num": ({torch.nan_to_num, torch.Tensor.nan_to_num}, {"nan_to_num"}, ()),
    "dropout": ({F.dropout}, set(), (nn.Dropout,)),
    "to": (set(), {"to", "float", "long", "int", "half", "bfloat16", "double"}, ()),
}
_FN_TO_NAME = {fn: name for name, (fns, _, _) in _SPELLINGS.items() for fn in fns}
_METHOD_TO_NAME = {m: name for name, (_, ms, _) in _SPELLINGS.items() for m in ms}
_CAST_METHODS = {
    "float": torch.float32,
    "long": torch.int64,
    "int": torch.int32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}


@dataclass(frozen=True)
class UnaryOp:
    """A node seen as ``op(input, **extra)`` in canonical form."""

    name: str
    input: fx.Node
    extra: tuple[tuple[str, Any], ...]  # hyper-parameters, hashable


def _extra_from_call(name: str, args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...] | None:
    """Normalise positional and keyword hyper-parameters (e.g. clamp's bounds)."""
    rest = list(args[1:])
    kw = dict(kwargs)
    kw.pop("inplace", None)
    if name == "clamp":
        names = ["min", "max"]
    elif name == "nan_to_num":
        names = ["nan", "posinf", "neginf"]
    elif name == "gelu":
        names = ["approximate"]
    elif name == "dropout":
        names = ["p", "training"]
        if len(rest) > 2:
            rest = rest[:2]
    else:
        names = []
    if len(rest) > len(names):
        return None
    for n, v in zip(names, rest):
        kw[n] = v
    if any(isinstance(v, fx.Node) for v in kw.values()):
        return None  # tensor-valued bounds: not a unary op
    return tuple(sorted(kw.items()))


def unary_op(node: fx.Node, ctx: RewriteContext) -> UnaryOp | None:
    """Recognise any spelling of a supported unary pointwise op."""
    if node.op == "call_function" and node.target in _FN_TO_NAME:
        name = _FN_TO_NAME[node.target]
        x = node.args[0] if node.args else node.kwargs.get("input")
        extra = _extra_from_call(
            name, node.args, {k: v for k, v in node.kwargs.items() if k != "input"}
        )
    elif node.op == "call_method" and node.target in _METHOD_TO_NAME:
        name = _METHOD_TO_NAME[node.target]
        x = node.args[0]
        if name == "to":
            return _cast(node, ctx)
        extra = _extra_from_call(name, node.args, dict(node.kwargs))
    elif node.op == "call_module":
        mod = ctx.module(node)
        name = next(
            (n for n, (_, _, types) in _SPELLINGS.items() if types and isinstance(mod, types)), None
        )
        if name is None or len(node.args) != 1 or node.kwargs:
            return None
        x = node.args[0]
        if name == "gelu":
            extra = (("approximate", mod.approximate),)  # type: ignore[union-attr]
        elif name == "dropout":
            extra = (("p", mod.p), ("training", mod.training))  # type: ignore[union-attr]
        else:
            extra = ()
    else:
        return None
    if not isinstance(x, fx.Node) or extra is None:
        return None
    return UnaryOp(name, x, extra)


def _cast(node: fx.Node, ctx: RewriteContext) -> UnaryOp | None:
    """``x.float()``, ``x.long()``, ``x.to(dtype)``: only dtype casts (no device moves)."""
    if node.target in _CAST_METHODS:
        if len(node.args) != 1 or node.kwargs:
            return None
        return UnaryOp("to", node.args[0], (("dtype", _CAST_METHODS[node.target]),))
    if len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return UnaryOp("to", node.args[0], (("dtype", node.args[1]),))
    if (
        len(node.args) == 1
        and set(node.kwargs) == {"dtype"}
        and isinstance(node.kwargs["dtype"], torch.dtype)
    ):
        return UnaryOp("to", node.args[0], (("dtype", node.kwargs["dtype"]),))
    return None


def _apply(ctx: RewriteContext, op: UnaryOp, x: fx.Node) -> fx.Node:
    extra = dict(op.extra)
    if op.name == "to":
        return ctx.call_method("to", (x, extra["dtype"]))
    fn = {
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "relu": torch.relu,
        "gelu": F.gelu,
        "silu": F.silu,
        "clamp": torch.clamp,
        "nan_to_num": torch.nan_to_num,
        "dropout": F.dropout,
    }[op.name]
    return ctx.call(fn, (x,), extra)


@register
class FuseParallelUnary(HorizontalRule):
    """N independent ``op(x_i)`` with the same op and arguments become ``op(gather(x))``."""

    name = "parallel_unary"
    family = "pointwise"
    memory_bound = True
    candidates = {"call_function": _FN_TO_NAME, "call_method": _METHOD_TO_NAME, "call_module": None}

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        op = unary_op(node, ctx)
        if op is None or node.meta.get(_KEPT_APART):
            return None
        ti = ctx.info(op.input)
        if ti is None or not ti.static or ti.ndim == 0:
            return None
        # Members must agree on everything but the size of the dim they are joined along.
        return (
            op.name, exact(op.extra), ti.dtype, ti.device, ti.ndim, ti.shape[:-1],
            mutates_input(node),
        )  # fmt: skip

    def partition(self, group: Sequence[fx.Node], ctx: RewriteContext) -> list[list[fx.Node]]:
        """One set per run of pieces of one tensor (a view each), the other members together.

        Copying pieces of a few tensors together with a ``cat`` (N LayerNorms fused per dim,
        their outputs interleaved by feature) costs more than one launch per tensor; see
        :func:`fxrec.graph.cost.view_run_pays`.
        """
        inputs = [unary_op(n, ctx).input for n in group]  # type: ignore[union-attr]
        runs = piece_runs(inputs)
        if len(runs) == 1:
            return super().partition(group, ctx)
        views: list[list[fx.Node]] = []
        copied: list[fx.Node] = []
        for run in runs:
            members = [group[i] for i in run]
            if len(run) > 1 and view_run_pays(_elems(members, ctx), ctx.device_type):
                views.append(members)
            else:
                copied.extend(members)
        if not views:
            return super().partition(group, ctx)
        for n in (n for members in views for n in members):
            n.meta[_VIEW_RUN] = True
        logger.debug(
            "%s: %d members as %d views of their tensors, %d copied",
            self.name, len(group), len(views), len(copied),
        )  # fmt: skip
        parts: list[list[fx.Node]] = []
        for members in views + ([copied] if copied else []):
            parts.extend(super().partition(members, ctx))
        return parts

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if mutates_input(group[0]):
            return "in-place op: fusing would lose the write to each input"
        if (why := member_refusal(group)) is not None:
            return why
        op = unary_op(group[0], ctx)
        assert op is not None
        if (
            op.name == "dropout"
            and dict(op.extra).get("training", True)
            and dict(op.extra).get("p", 0.5) > 0
        ):
            return "dropout in training mode: one fused mask draws different random numbers"
        inputs = [unary_op(n, ctx).input for n in group]  # type: ignore[union-attr]
        if (why := layout_draw_refusal(group, [[x] for x in inputs])) is not None:
            return why
        if contiguous_range(inputs) is not None:
            return None
        if reason := copy_reason(ctx, len(group), "separate inputs"):
            return reason
        if len(group) < 3:
            return "two separate inputs: a cat costs as much as the launch it saves"
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        ops = [unary_op(n, ctx) for n in group]
        g = gather(ctx, [o.input for o in ops], -1)  # type: ignore[union-attr]
        if g is None:
            self.refuse(ctx, group, "inputs have no static shape")
            return
        fused = _apply(ctx, ops[0], g.node)  # type: ignore[arg-type]
        if not g.copied and group[0].meta.get(_VIEW_RUN):
            fused.meta[_KEPT_APART] = True
        for member, out in zip(group, scatter(ctx, fused, g)):
            ctx.replace(member, out)
        ctx.erase_if_dead(group)
        self.fired(ctx, group, f"{ops[0].name} x{len(group)}" + (" (cat)" if g.copied else ""))  # type: ignore[union-attr]


# -- layouts and random draws ------------------------------------------------------------------
# Calls whose result is row-major (contiguous) whatever the strides of their inputs.
_ROW_MAJOR_MODULES = (
    nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.Embedding, nn.EmbeddingBag,
)  # fmt: skip
_ROW_MAJOR_FUNCTIONS = frozenset(
    {
        F.linear, torch._C._nn.linear, F.bilinear, torch.matmul, operator.matmul, torch.mm,
        torch.bmm, torch.addmm, torch.baddbmm, F.layer_norm, torch.layer_norm, F.group_norm,
        F.embedding, F.embedding_bag,
    }
)  # fmt: skip
_ROW_MAJOR_METHODS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm"})
# Row-major below 4 dims (4-D and 5-D inputs may keep a channels-last layout).
_JOINING_FUNCTIONS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack})
# Views that reorder dims: their result is not row-major whatever their input is.
_PERMUTING_METHODS = frozenset(
    {"t", "transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "adjoint",
     "as_strided"}
)  # fmt: skip
_PERMUTING_FUNCTIONS = frozenset(
    {torch.t, torch.transpose, torch.permute, torch.movedim, torch.moveaxis, torch.swapaxes,
     torch.swapdims, torch.adjoint, torch.as_strided}
)  # fmt: skip
_PERMUTING_ATTRIBUTES = frozenset({"T", "mT", "H", "mH"})


def layout_draw_refusal(
    group: Sequence[fx.Node], inputs: Sequence[Sequence[fx.Node]]
) -> str | None:
    """Why a pointwise set whose members read ``inputs`` must stay as written, or None.

    A pointwise op's result is laid out as its input: ``relu`` of a transposed tensor is
    column-major, while a member of a fused op is a row-major slice. Values do not care, but
    a random op after it (dropout) draws its mask in memory order, so the mask would land on
    other elements. Only inputs whose layout the graph does not fix (a graph input, a
    permuting view of anything) can be laid out otherwise.
    """
    fixed: set[fx.Node] = set()  # laid out row-major whatever the inputs: shared by members
    for member, xs in zip(group, inputs):
        if any(_layout_open(x, fixed) for x in xs) and _reaches_draw(member):
            return (
                "a member's input may not be row-major (a graph input or a transposed view) "
                "and its result reaches a random op: the fused result's row-major slices "
                "would draw a different mask"
            )
    return None


def _layout_open(x: fx.Node, fixed: set[fx.Node]) -> bool:
    """May ``x`` be laid out other than row-major, depending on the strides a graph input
    is given or on a permuting view? Walks up through views and ops whose result is laid out
    as their inputs, to the calls that lay their result out row-major. ``fixed``: nodes
    known row-major, the ones this walk finds so added."""
    seen: set[fx.Node] = set()
    work = [x]
    while work:
        n = work.pop()
        if n in seen or n in fixed:
            continue
        seen.add(n)
        if n.op == "placeholder" or _permutes(n):
            return True
        if n.op == "get_attr":
            try:
                t = meta.resolve_attr(n.graph.owning_module, str(n.target))
            except AttributeError:
                t = None
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                return True
            continue
        if _row_major(n):
            continue
        if _is_view(n):  # its other arguments are sizes and dims
            if n.args and isinstance(n.args[0], fx.Node):
                work.append(n.args[0])
            continue
        work.extend(i for i in n.all_input_nodes if _tensor_valued(i))
    fixed |= seen
    return False


def _reaches_draw(node: fx.Node) -> bool:
    """Does ``node``'s result reach a random op (:func:`~fxrec.graph.effects.is_random`)
    through views and ops whose result is laid out as their inputs?"""
    seen: set[fx.Node] = set()
    work = [node]
    while work:
        for u in work.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if is_random(u):
                return True
            if u.op != "output" and not _row_major(u):
                work.append(u)
    return False


def _row_major(node: fx.Node) -> bool:
    """Is ``node``'s result row-major whatever the strides of its inputs?"""
    op, target = node.op, node.target
    if op == "call_module":
        return type(_owner_module(node)) in _ROW_MAJOR_MODULES
    if op == "call_method":
        if target == "contiguous":  # row-major unless asked for another memory format
            fmt = node.args[1] if len(node.args) > 1 else node.kwargs.get("memory_format")
            return fmt is None or fmt is torch.contiguous_format
        return target in _ROW_MAJOR_METHODS
    if op != "call_function":
        return False
    try:
        if target in _ROW_MAJOR_FUNCTIONS:
            return True
        joins = target in _JOINING_FUNCTIONS
    except TypeError:  # an unhashable target
        return False
    ti = meta.info(node)
    return joins and isinstance(ti, meta.TensorInfo) and ti.ndim < 4


def _permutes(node: fx.Node) -> bool:
    """A view reordering dims: ``x.t()``, ``x.transpose(0, 1)``, ``x.mT``, ``x.permute(...)``."""
    if node.op == "call_method":
        return node.target in _PERMUTING_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return node.args[1:2] != () and node.args[1] in _PERMUTING_ATTRIBUTES
    try:
        return node.target in _PERMUTING_FUNCTIONS
    except TypeError:  # an unhashable target
        return False


def _tensor_valued(node: fx.Node) -> bool:
    """Is ``node`` a tensor (or of unknown kind), not a size or another number?"""
    ti = meta.info(node)
    if ti is None:
        return not (node.op == "call_method" and node.target in ("size", "dim", "numel"))
    return isinstance(ti, (meta.TensorInfo, tuple, list))


def _elems(nodes: Sequence[fx.Node], ctx: RewriteContext) -> int:
    """Elements of the members' results (their inputs' sizes) in all."""
    return sum(ti.numel() for ti in (ctx.info(n) for n in nodes) if ti is not None)


# -- binary ops --------------------------------------------------------------------------------
_BINARY: dict[str, tuple[set[Any], set[str]]] = {
    "add": ({torch.add, operator.add, torch.Tensor.add}, {"add"}),
    "sub": ({torch.sub, operator.sub, torch.Tensor.sub}, {"sub"}),
    "mul": ({torch.mul, operator.mul, torch.Tensor.mul}, {"mul"}),
    "div": ({torch.div, operator.truediv, torch.Tensor.div}, {"div"}),
    "maximum": ({torch.maximum}, {"maximum"}),
    "minimum": ({torch.minimum}, {"minimum"}),
}
_BINARY_FN = {fn: name for name, (fns, _) in _BINARY.items() for fn in fns}
_BINARY_METHOD = {m: name for name, (_, ms) in _BINARY.items() for m in ms}
_BINARY_APPLY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


@dataclass(frozen=True)
class BinaryOp:
    """``op(lhs, rhs, **extra)``: each side a node, or a number shared by every member."""

    name: str
    lhs: fx.Node | float | int
    rhs: fx.Node | float | int
    extra: tuple[tuple[str, Any], ...]  # alpha (add/sub), rounding_mode (div)


def binary_op(node: fx.Node) -> BinaryOp | None:
    """Recognise any out-of-place spelling of a supported binary pointwise op."""
    if node.op == "call_function" and node.target in _BINARY_FN:
        name = _BINARY_FN[node.target]
    elif node.op == "call_method" and node.target in _BINARY_METHOD:
        name = _BINARY_METHOD[node.target]
    else:
        return None
    if len(node.args) != 2 or set(node.kwargs) - {"alpha", "rounding_mode"}:
        return None
    lhs, rhs = node.args
    sides = [s for s in (lhs, rhs) if isinstance(s, fx.Node)]
    if not sides or any(
        not isinstance(s, (fx.Node, int, float)) or isinstance(s, bool) for s in (lhs, rhs)
    ):
        return None
    return BinaryOp(name, lhs, rhs, tuple(sorted(node.kwargs.items())))


def _side_key(side: Any, ctx: RewriteContext) -> Hashable | None:
    if not isinstance(side, fx.Node):
        return ("number", exact(side))
    ti = ctx.info(side)
    if ti is None or not ti.static or ti.ndim == 0:
        return None
    return ("tensor", ti.dtype, ti.shape)


@register
class FuseParallelBinary(HorizontalRule):
    """N independent ``op(a_i, b_i)`` -> ``op(gather(a), gather(b))``, split back.

    Tensor operands must have the member's full shape (no broadcasting: a broadcast operand
    would need repeating); a number operand must be the same for every member. Both sides are
    gathered the same way: a view where the operands are consecutive pieces of one tensor, a
    ``cat`` otherwise, which the rule weighs against the launches it saves.
    """

    name = "parallel_binary"
    family = "pointwise"
    memory_bound = True
    candidates = {"call_function": _BINARY_FN, "call_method": _BINARY_METHOD}

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        op = binary_op(node)
        oi = ctx.info(node)
        if op is None or oi is None or not oi.static or oi.ndim == 0:
            return None
        if node.meta.get(_BINARY_KEPT_APART):
            return None
        sides = [_side_key(s, ctx) for s in (op.lhs, op.rhs)]
        if any(s is None for s in sides):
            return None
        if any(s[0] == "tensor" and s[2] != oi.shape for s in sides):  # type: ignore[index]
            return None  # broadcasting
        kinds = tuple(s[:2] if s[0] == "tensor" else s for s in sides)  # type: ignore[index]
        return (
            "binary", op.name, exact(op.extra), kinds, oi.dtype, oi.device, oi.ndim,
            oi.shape[:-1],
        )  # fmt: skip

    def partition(self, group: Sequence[fx.Node], ctx: RewriteContext) -> list[list[fx.Node]]:
        """One set per run of members whose operand on one side is consecutive pieces of one
        tensor (a view of it), the other side a number, one tensor they all share (broadcast)
        or a run of pieces in step; the other members together, copied.

        FiBiNET's ``v_i * f_j`` over ``f = split(x, 1, 1)``: per ``i``, one
        ``v_i * x[:, i+1:]`` instead of copying 2 x 380 operands together.
        """
        ops: list[BinaryOp] = [binary_op(n) for n in group]  # type: ignore[misc]
        runs = _binary_view_runs(ops, group, ctx)
        if not runs:
            return super().partition(group, ctx)
        taken = {i for _, run in runs for i in run}
        copied = [n for i, n in enumerate(group) if i not in taken]
        for n in copied:
            n.meta.pop(_BINARY_VIEW_RUN, None)
        parts: list[list[fx.Node]] = []
        for side, run in runs:
            members = [group[i] for i in run]
            for n in members:
                n.meta[_BINARY_VIEW_RUN] = side
            parts.extend(super().partition(members, ctx))
        logger.debug(
            "%s: %d members as %d views of their tensors, %d copied",
            self.name, len(group), len(runs), len(copied),
        )  # fmt: skip
        return parts + (super().partition(copied, ctx) if copied else [])

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if (why := member_refusal(group)) is not None:
            return why
        ops: list[BinaryOp] = [binary_op(n) for n in group]  # type: ignore[misc]
        operands = [[s for s in (o.lhs, o.rhs) if isinstance(s, fx.Node)] for o in ops]
        if (why := layout_draw_refusal(group, operands)) is not None:
            return why
        if _view_run_side(group, ops) is not None:
            return None
        copies = sum(
            isinstance(getattr(ops[0], side), fx.Node)
            and contiguous_range([getattr(o, side) for o in ops]) is None
            for side in ("lhs", "rhs")
        )
        if copies and (reason := copy_reason(ctx, len(group), f"{copies} operand(s)")):
            return reason
        if copies and len(group) < 2 + 2 * copies:
            return f"{copies} operand(s) need a cat: {len(group)} members do not pay for it"
        per_member = copies * _elems(group, ctx) // len(group)  # tensor operands: the result's size
        if copies and (reason := copy_volume_reason(ctx.device_type, per_member)):
            return reason
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        ops: list[BinaryOp] = [binary_op(n) for n in group]  # type: ignore[misc]
        if (lead := _view_run_side(group, ops)) is not None:
            self._fuse_view_run(group, ops, lead, ctx)
            return
        first = ops[0]
        tensor_side = "lhs" if isinstance(first.lhs, fx.Node) else "rhs"
        g = gather(ctx, [getattr(o, tensor_side) for o in ops], -1)
        if g is None:
            self.refuse(ctx, group, "inputs have no static shape")
            return
        args = []
        for side in ("lhs", "rhs"):
            if not isinstance(getattr(first, side), fx.Node):
                args.append(getattr(first, side))
            elif side == tensor_side:
                args.append(g.node)
            else:
                args.append(_gather_like(ctx, [getattr(o, side) for o in ops], g))
        fused = ctx.call(_BINARY_APPLY[first.name], tuple(args), dict(first.extra))
        for member, out in zip(group, scatter(ctx, fused, g)):
            ctx.replace(member, out)
        ctx.erase_if_dead(group)
        self.fired(ctx, group, f"{first.name} x{len(group)}")

    def _fuse_view_run(
        self, group: Sequence[fx.Node], ops: list[BinaryOp], lead: str, ctx: RewriteContext
    ) -> None:
        """Fuse a run whose ``lead`` operands are consecutive pieces of one tensor (a view)."""
        order = sorted(range(len(group)), key=lambda i: piece_of(getattr(ops[i], lead)).start)  # type: ignore[union-attr]
        group, ops = [group[i] for i in order], [ops[i] for i in order]
        first = ops[0]
        g = gather(ctx, [getattr(o, lead) for o in ops], piece_of(getattr(first, lead)).dim)  # type: ignore[union-attr]
        assert g is not None and not g.copied
        args: list[Any] = []
        for side in ("lhs", "rhs"):
            value = getattr(first, side)
            if side == lead:
                args.append(g.node)
            elif not isinstance(value, fx.Node):
                args.append(value)
            elif all(getattr(o, side) is value for o in ops):
                # One tensor shared by the run: broadcast along the pieces' dim, no copy.
                args.append(ctx.call_method("unsqueeze", (value, g.dim)) if g.squeezed else value)
            else:
                args.append(_gather_like(ctx, [getattr(o, side) for o in ops], g))
        fused = ctx.call(_BINARY_APPLY[first.name], tuple(args), dict(first.extra))
        fused.meta[_BINARY_KEPT_APART] = True
        for member, out in zip(group, scatter(ctx, fused, g)):
            ctx.replace(member, out)
        ctx.erase_if_dead(group)
        self.fired(ctx, group, f"{first.name} x{len(group)} (view)")


def _view_run_side(group: Sequence[fx.Node], ops: Sequence[BinaryOp]) -> str | None:
    """The side whose operands are the consecutive pieces of one tensor in a run that
    :meth:`FuseParallelBinary.partition` set apart, or None (also when it no longer holds)."""
    side = group[0].meta.get(_BINARY_VIEW_RUN)
    if side is None or any(n.meta.get(_BINARY_VIEW_RUN) != side for n in group):
        return None
    leads = [getattr(o, side) for o in ops]
    pieces = [piece_of(x) if isinstance(x, fx.Node) else None for x in leads]
    if any(p is None for p in pieces):
        return None
    ordered = sorted(range(len(leads)), key=lambda i: pieces[i].start)  # type: ignore[union-attr]
    if contiguous_range([leads[i] for i in ordered]) is None:
        return None
    other = "rhs" if side == "lhs" else "lhs"
    others = [getattr(ops[i], other) for i in ordered]
    if not isinstance(others[0], fx.Node) or all(o is others[0] for o in others):
        return side if _broadcasts(pieces[0]) or not isinstance(others[0], fx.Node) else None  # type: ignore[arg-type]
    rng = contiguous_range(others)  # type: ignore[arg-type]
    p0 = pieces[0]
    assert p0 is not None
    if rng is None or rng[1] != p0.dim or rng[5] != p0.squeezed:
        return None
    return side


def _broadcasts(p: Piece) -> bool:
    """Whether a tensor of a member's shape broadcasts against a run of pieces like ``p``."""
    return p.squeezed or p.length == 1


# Candidate runs sort by size, then shared or number partners before pieces in step.
_SHARED, _IN_STEP = 0, 1


def _binary_view_runs(
    ops: Sequence[BinaryOp], group: Sequence[fx.Node], ctx: RewriteContext
) -> list[tuple[str, list[int]]]:
    """Disjoint runs of members (positions in ``ops``, lead side) that fuse as views.

    A member may join a run through either side; the largest runs are taken first, and a
    run that lost members to an earlier one keeps its consecutive stretches.
    """
    by_key: dict[Hashable, list[tuple[int, Piece, Piece | None]]] = {}
    for i, op in enumerate(ops):
        for key, lead, step in _run_keys(op):
            by_key.setdefault(key, []).append((i, lead, step))
    candidates: list[tuple[int, int, int, str, list[int]]] = []
    for key, entries in by_key.items():
        for run in _consecutive(entries):
            if len(run) > 1:
                candidates.append((-len(run), key[1], min(run), key[0], run))  # type: ignore[index]
    candidates.sort(key=lambda c: c[:3])
    taken: set[int] = set()
    runs: list[tuple[str, list[int]]] = []
    for *_, side, run in candidates:
        stretch: list[int] = []
        for i in [*run, None]:
            if i is not None and i not in taken:
                stretch.append(i)
                continue
            if len(stretch) > 1 and _run_pays([ops[j] for j in stretch], side, ctx):
                runs.append((side, stretch))
                taken.update(stretch)
            stretch = []
    return runs


def _run_pays(ops: Sequence[BinaryOp], side: str, ctx: RewriteContext) -> bool:
    """Whether a run pays as a view: large enough, and every part of a tensor it reads small
    enough against that tensor's backward (:func:`fxrec.graph.cost.partial_view_pays`)."""
    elems = sum(ti.numel() for ti in (ctx.info(getattr(o, side)) for o in ops) if ti is not None)
    if not view_run_pays(elems, ctx.device_type):
        return False
    for s in ("lhs", "rhs"):
        nodes = [getattr(o, s) for o in ops]
        if not isinstance(nodes[0], fx.Node) or all(n is nodes[0] for n in nodes):
            continue
        nodes.sort(key=lambda n: piece_of(n).start)  # type: ignore[union-attr]
        rng = contiguous_range(nodes)
        bi = ctx.info(rng[0]) if rng is not None else None
        if rng is None or bi is None:
            return False
        base, dim, start, total = rng[:4]
        whole = start == 0 and total == bi.shape[dim]
        if (
            not whole
            and _tracked(base, bi)
            and not partial_view_pays(len(ops), bi.numel(), ctx.device_type)
        ):
            return False
    return True


def _tracked(base: fx.Node, bi: Any) -> bool:
    """Whether autograd may track ``base`` when the graph runs: graphs are rewritten in the
    grad mode they run in; a graph input says whether it requires grad, a computed tensor's
    metadata may not (parameters captured without it)."""
    if not torch.is_grad_enabled() or not bi.dtype.is_floating_point:
        return False
    return bi.requires_grad or base.op != "placeholder"


def _run_keys(op: BinaryOp) -> list[tuple[Hashable, Piece, Piece | None]]:
    """The runs a member may join: (key, its lead piece, its other side's piece in step).

    Key: (lead side, kind, the lead pieces' tensor, the partner: a number, the one shared
    tensor, or the other side's pieces' tensor).
    """
    pieces = {
        side: piece_of(v) if isinstance(v, fx.Node) else None
        for side, v in (("lhs", op.lhs), ("rhs", op.rhs))
    }
    keys: list[tuple[Hashable, Piece, Piece | None]] = []
    for side, other in (("rhs", "lhs"), ("lhs", "rhs")):
        lead, partner = pieces[side], getattr(op, other)
        if lead is None:
            continue
        where = (lead.base, lead.dim, lead.squeezed)
        if not isinstance(partner, fx.Node):
            keys.append(((side, _SHARED, where, ("number", exact(partner))), lead, None))
        elif _broadcasts(lead):
            keys.append(((side, _SHARED, where, partner), lead, None))
    lhs, rhs = pieces["lhs"], pieces["rhs"]
    if lhs is not None and rhs is not None and (lhs.dim, lhs.squeezed) == (rhs.dim, rhs.squeezed):
        keys.append((("lhs", _IN_STEP, (lhs.base, lhs.dim, lhs.squeezed), rhs.base), lhs, rhs))
    return keys


def _consecutive(entries: list[tuple[int, Piece, Piece | None]]) -> list[list[int]]:
    """Maximal runs of entries whose lead pieces (and pieces in step) follow one another."""
    entries = sorted(entries, key=lambda e: (e[1].start, e[0]))
    runs: list[list[int]] = []
    end: tuple[int, int | None] | None = None
    for i, lead, step in entries:
        if end is None or lead.start != end[0] or (step is not None and step.start != end[1]):
            runs.append([])
        runs[-1].append(i)
        end = (lead.start + lead.length, None if step is None else step.start + step.length)
    return runs


def _gather_like(ctx: RewriteContext, inputs: Sequence[fx.Node], like: Gathered) -> fx.Node:
    """``inputs`` side by side exactly as ``like`` holds the other operand."""
    g = gather(ctx, inputs, like.dim if not like.squeezed else -1)
    if g is not None and g.dim == like.dim and g.squeezed == like.squeezed:
        return g.node
    if like.squeezed:
        return ctx.call(torch.stack, (list(inputs), like.dim))
    return ctx.call(torch.cat, (list(inputs), like.dim))
