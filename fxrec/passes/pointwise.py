"""Parallel pointwise ops become one: tanh, sigmoid, relu, gelu, silu, clamp, casts, and the
binary add, sub, mul, div, maximum, minimum.

Every common spelling matches (``torch.tanh``, ``Tensor.tanh``, ``F.tanh``, ``nn.Tanh``), which
Inductor's batch fusions miss. Members must agree on the op and its extra arguments, dtype
and device. In-place members (``relu(inplace=True)``, ``x.relu_()``) are refused: merging them
would lose the write to their input. Dropout in training mode is refused: one fused mask draws
different random numbers than N masks.
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

from fxrec.graph.cost import copy_reason, view_run_pays
from fxrec.graph.effects import member_refusal, mutates_input
from fxrec.graph.horizontal import Gathered, gather, scatter
from fxrec.graph.pieces import contiguous_range, piece_runs
from fxrec.graph.rule import HorizontalRule, RewriteContext, exact, register

logger = logging.getLogger(__name__)

__all__ = [
    "BinaryOp",
    "UnaryOp",
    "binary_op",
    "unary_op",
    "FuseParallelBinary",
    "FuseParallelUnary",
]

# Node meta flags: members of a run of pieces split off from a larger set (set by
# ``partition``), and the fused op over such a run, which is kept apart from the other runs'
# ops in later passes rather than copied together with them.
_VIEW_RUN = "fxrec_unary_view_run"
_KEPT_APART = "fxrec_unary_kept_apart"

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

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if (why := member_refusal(group)) is not None:
            return why
        ops = [binary_op(n) for n in group]
        copies = sum(
            isinstance(getattr(ops[0], side), fx.Node)
            and contiguous_range([getattr(o, side) for o in ops]) is None
            for side in ("lhs", "rhs")
        )
        if copies and (reason := copy_reason(ctx, len(group), f"{copies} operand(s)")):
            return reason
        if copies and len(group) < 2 + 2 * copies:
            return f"{copies} operand(s) need a cat: {len(group)} members do not pay for it"
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        ops: list[BinaryOp] = [binary_op(n) for n in group]  # type: ignore[misc]
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


def _gather_like(ctx: RewriteContext, inputs: Sequence[fx.Node], like: Gathered) -> fx.Node:
    """``inputs`` side by side exactly as ``like`` holds the other operand."""
    g = gather(ctx, inputs, like.dim if not like.squeezed else -1)
    if g is not None and g.dim == like.dim and g.squeezed == like.squeezed:
        return g.node
    if like.squeezed:
        return ctx.call(torch.stack, (list(inputs), like.dim))
    return ctx.call(torch.cat, (list(inputs), like.dim))
