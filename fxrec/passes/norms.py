"""Parallel LayerNorms become one; parallel BatchNorms become one, running statistics exact.

Spellings matched (both IRs):

=============  ===================================================================
LayerNorm      ``nn.LayerNorm`` (call_module), ``F.layer_norm``, ``torch.layer_norm``
               with weight/bias as ``get_attr``, graph inputs, computed nodes or None
BatchNorm      ``nn.BatchNorm1d/2d/3d`` (call_module), ``F.batch_norm`` (dynamo inlines
               modules into it and keeps ``num_batches_tracked.add_(1)`` as its own node)
=============  ===================================================================

LayerNorm members must agree on normalized shape, eps, which affine parameters exist, input
shape, dtype and device. The fused form normalises all members at once *without* affine, then
applies the members' weights and biases (laid out once as an (N, *normalized_shape) tensor) in
one ``addcmul``. Its input is, by cost:

* consecutive equal pieces of one tensor (the seed pattern: ``split`` of a (B, N*D) tensor):
  a view, ``x.unflatten(dim, (N, -1))``; nothing is copied and no size from the input is
  baked in. For a 2-D input on a GPU at small sizes one ``group_norm`` with N groups is
  cheaper still (:func:`choose_lowering`; on CPU it loses, see FIELD_NOTES);
* separate tensors: one ``torch.stack``, applied only where the cost model says it pays.

BatchNorm members must agree on eps, momentum (a number), affine, track_running_stats, mode
and every input dim but the channel dim 1. Channels are concatenated; running means, running
variances, weights and biases are laid out once as flat tensors whose slices *are* the
members' buffers, so the single ``batch_norm`` updates every member's statistics exactly as N
separate calls would. ``num_batches_tracked`` counters are stacked and bumped by one ``add_``.
Members sharing running statistics, or statistics that cannot be laid out (``keep_params``,
statistics passed as graph inputs), are refused: the update would be lost or applied twice.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxrec.graph import meta
from fxrec.graph.cost import copy_reason
from fxrec.graph.effects import member_refusal
from fxrec.graph.horizontal import Gathered, gather, scatter
from fxrec.graph.pieces import contiguous_range, piece_of
from fxrec.graph.refs import Ref, combined, laid_out_or_can_be, param_info, param_node, ref_key
from fxrec.graph.rule import HorizontalRule, RewriteContext, register

logger = logging.getLogger(__name__)

__all__ = [
    "LayerNormCall",
    "BatchNormCall",
    "layer_norm_call",
    "batch_norm_call",
    "choose_lowering",
    "FuseParallelLayerNorm",
    "FuseParallelBatchNorm",
]

LAYER_NORM_FUNCTIONS = {F.layer_norm, torch.layer_norm}
BATCH_NORM_FUNCTIONS = {F.batch_norm}
BATCH_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


# Below this many elements a GPU launch costs more than group_norm's slower reduction.
GROUP_NORM_MAX_NUMEL_CUDA = 1 << 22
# Separate inputs need a stack (one copy); fuse only from this many members.
MIN_SEPARATE_MEMBERS = 4


# -- recognising the calls ---------------------------------------------------------------------
def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _attr_ref(node: fx.Node, mod: nn.Module, attr: str) -> Ref:
    return f"{node.target}.{attr}" if getattr(mod, attr, None) is not None else None


@dataclass(frozen=True)
class LayerNormCall:
    """``layer_norm(input, normalized_shape, weight, bias, eps)`` in canonical form."""

    input: fx.Node
    normalized_shape: tuple[int, ...]
    weight: Ref
    bias: Ref
    eps: float


def layer_norm_call(node: fx.Node, ctx: RewriteContext) -> LayerNormCall | None:
    """Recognise any spelling of a LayerNorm."""
    if node.op == "call_module":
        mod = ctx.module(node)
        if type(mod) is not nn.LayerNorm or len(node.args) != 1 or node.kwargs:
            return None
        w, b = _attr_ref(node, mod, "weight"), _attr_ref(node, mod, "bias")
        x, ns, eps = node.args[0], tuple(mod.normalized_shape), mod.eps
    elif node.op == "call_function" and node.target in LAYER_NORM_FUNCTIONS:
        x = _arg(node, 0, "input")
        ns = _arg(node, 1, "normalized_shape")
        w, b = _arg(node, 2, "weight"), _arg(node, 3, "bias")
        eps = _arg(node, 4, "eps", 1e-5)
        if isinstance(ns, int):
            ns = (ns,)
        if not isinstance(ns, (list, tuple)) or not all(isinstance(s, int) for s in ns):
            return None
        ns = tuple(ns)
        if any(r is not None and not isinstance(r, fx.Node) for r in (w, b)):
            return None
    else:
        return None
    if not isinstance(x, fx.Node) or not isinstance(eps, float) or not ns:
        return None
    return LayerNormCall(x, ns, w, b, eps)


@dataclass(frozen=True)
class BatchNormCall:
    """``batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)``."""

    input: fx.Node
    running_mean: Ref
    running_var: Ref
    weight: Ref
    bias: Ref
    training: bool
    momentum: float
    eps: float
    counter: Ref  # num_batches_tracked to bump (call_module in training only)


def batch_norm_call(node: fx.Node, ctx: RewriteContext) -> BatchNormCall | None:
    """Recognise any spelling of a BatchNorm whose momentum is a number."""
    if node.op == "call_module":
        mod = ctx.module(node)
        if type(mod) not in BATCH_NORM_MODULES or len(node.args) != 1 or node.kwargs:
            return None
        assert isinstance(mod, nn.modules.batchnorm._BatchNorm)
        if mod.momentum is None:
            return None  # cumulative average: the factor depends on the counter's value
        track = mod.track_running_stats
        bn_training = mod.training or (mod.running_mean is None and mod.running_var is None)
        stats = not mod.training or track
        counter = _attr_ref(node, mod, "num_batches_tracked") if mod.training and track else None
        return BatchNormCall(
            node.args[0],
            _attr_ref(node, mod, "running_mean") if stats else None,
            _attr_ref(node, mod, "running_var") if stats else None,
            _attr_ref(node, mod, "weight"),
            _attr_ref(node, mod, "bias"),
            bool(bn_training),
            float(mod.momentum),
            float(mod.eps),
            counter,
        )
    if node.op != "call_function" or node.target not in BATCH_NORM_FUNCTIONS:
        return None
    x = _arg(node, 0, "input")
    refs = [_arg(node, 1, "running_mean"), _arg(node, 2, "running_var")]
    refs += [_arg(node, 3, "weight"), _arg(node, 4, "bias")]
    training = _arg(node, 5, "training", False)
    momentum = _arg(node, 6, "momentum", 0.1)
    eps = _arg(node, 7, "eps", 1e-5)
    if not isinstance(x, fx.Node) or not isinstance(training, bool):
        return None
    if not isinstance(momentum, (int, float)) or not isinstance(eps, (int, float)):
        return None
    if any(r is not None and not isinstance(r, fx.Node) for r in refs):
        return None
    return BatchNormCall(x, *refs, training, float(momentum), float(eps), None)


# -- LayerNorm ---------------------------------------------------------------------------------
@dataclass
class _Layout:
    """How the members' inputs sit side by side: ``x`` has the member index at dim ``dim``."""

    order: list[int]  # member positions in layout order
    base: fx.Node | None  # pieces of one tensor: that tensor; None: separate tensors
    dim: int  # the dim of ``base`` the pieces are cut from
    start: int
    total: int
    sizes: list[int]
    squeezed: bool


def _layout(inputs: Sequence[fx.Node], k: int) -> _Layout | None:
    """Consecutive equal pieces of one base, cut along a dim that unflatten can expose."""
    pieces = [piece_of(x) for x in inputs]
    if any(p is None for p in pieces):
        return None
    first = pieces[0]
    assert first is not None
    if any(
        p.base is not first.base or p.dim != first.dim or p.squeezed != first.squeezed
        for p in pieces  # type: ignore[union-attr]
    ):
        return None
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].start)  # type: ignore[union-attr]
    ps = [pieces[i] for i in order]
    pos = ps[0].start  # type: ignore[union-attr]
    for p in ps:
        if p.start != pos or p.length != ps[0].length:  # type: ignore[union-attr]
            return None
        pos += p.length  # type: ignore[union-attr]
    bi = meta.info(first.base)
    if not isinstance(bi, meta.TensorInfo):
        return None
    nd, d = bi.ndim, first.dim
    if first.squeezed:
        ok = d < nd - k
    else:
        ok = d < nd - k or (d == nd - k and isinstance(bi.shape[d], int))
    if not ok:
        return None
    sizes = [p.length for p in ps]  # type: ignore[union-attr]
    return _Layout(order, first.base, d, ps[0].start, pos - ps[0].start, sizes, first.squeezed)  # type: ignore[union-attr]


def choose_lowering(device_type: str, numel: int, n: int) -> str:
    """``"group_norm"`` or ``"layer_norm"`` for N LayerNorms over columns of one 2-D tensor.

    ``group_norm`` is one kernel instead of two (layer_norm + addcmul), which wins where launches
    dominate (a GPU, small tensors). On CPU its reduction is slower than layer_norm's (batch
    2048: 16.3 ms vs 11.1 ms per step, FIELD_NOTES), and at batch 32 the two are within noise,
    so the CPU always takes layer_norm.
    """
    if device_type == "cuda" and numel <= GROUP_NORM_MAX_NUMEL_CUDA and n > 1:
        return "group_norm"
    return "layer_norm"


@register
class FuseParallelLayerNorm(HorizontalRule):
    """N independent LayerNorms of one configuration -> one normalisation + one affine."""

    name = "parallel_layer_norm"
    family = "norms"
    memory_bound = True
    candidates = {"call_module": None, "call_function": LAYER_NORM_FUNCTIONS}

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        ln = layer_norm_call(node, ctx)
        if ln is None:
            return None
        ti = ctx.info(ln.input)
        k = len(ln.normalized_shape)
        if ti is None or not ti.static or ti.ndim <= k or not ti.dtype.is_floating_point:
            return None
        if ti.shape[-k:] != ln.normalized_shape:
            return None
        if all(s == 1 for s in ln.normalized_shape):
            # Over one value the output is the bias and the exact input gradient 0; fused,
            # float rounding times 1/sqrt(eps) leaves ~1e-4 there. Nothing to gain: as written.
            return None
        w, b = _ref_info(ctx, ln.weight), _ref_info(ctx, ln.bias)
        if (ln.weight is not None and w is None) or (ln.bias is not None and b is None):
            return None
        return ("layer_norm", ln.normalized_shape, ln.eps, ti.shape, ti.dtype, ti.device, w, b)

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if (why := member_refusal(group)) is not None:
            return why
        lns = [layer_norm_call(n, ctx) for n in group]
        k = len(lns[0].normalized_shape)  # type: ignore[union-attr]
        separate = _layout([ln.input for ln in lns], k) is None  # type: ignore[union-attr]
        if separate and (reason := copy_reason(ctx, len(group), "separate inputs")):
            return reason
        if separate and len(group) < MIN_SEPARATE_MEMBERS:
            return (
                f"{len(group)} LayerNorms on separate tensors: the stack costs what fusing saves "
                f"(needs {MIN_SEPARATE_MEMBERS}+)"
            )
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        lns: list[LayerNormCall] = [layer_norm_call(n, ctx) for n in group]  # type: ignore[misc]
        ns, eps = lns[0].normalized_shape, lns[0].eps
        k = len(ns)
        lay = _layout([ln.input for ln in lns], k)
        if lay is not None:
            group = [group[i] for i in lay.order]
            lns = [lns[i] for i in lay.order]
        n = len(group)
        ws, bs = [ln.weight for ln in lns], [ln.bias for ln in lns]

        if lay is not None and not lay.squeezed:
            base = lay.base
            assert base is not None
            bi = meta.info(base)
            view = base
            if lay.start != 0 or lay.total != bi.shape[lay.dim]:
                view = ctx.call_method("narrow", (base, lay.dim, lay.start, lay.total))
            lowering = "layer_norm"
            if bi.ndim == 2 and lay.dim == 1 and k == 1 and _distinct(ws) and _distinct(bs):
                numel = bi.numel()
                lowering = choose_lowering(ctx.device_type, numel, n)
            if lowering == "group_norm":
                w = combined(ctx, ws, "cat") if ws[0] is not None else None
                b = combined(ctx, bs, "cat") if bs[0] is not None else None
                out = ctx.call(F.group_norm, (view, n, w, b, eps))
                fused_flat = out
            else:
                x = ctx.call_method("unflatten", (view, lay.dim, (n, -1)))
                y = self._normalise(ctx, x, lay.dim, ns, eps, ws, bs)
                fused_flat = ctx.call_method("flatten", (y, lay.dim, lay.dim + 1))
            g = Gathered(fused_flat, lay.dim, lay.sizes, False, False)
            detail = f"{lowering} over {n} pieces"
        elif lay is not None:  # unbind pieces: the member index is already a dim of the base
            base = lay.base
            assert base is not None
            bi = meta.info(base)
            x = base
            if lay.start != 0 or lay.total != bi.shape[lay.dim]:
                x = ctx.call_method("narrow", (base, lay.dim, lay.start, lay.total))
            y = self._normalise(ctx, x, lay.dim, ns, eps, ws, bs)
            g = Gathered(y, lay.dim, lay.sizes, True, False)
            detail = f"layer_norm over {n} unbind pieces"
        else:  # separate tensors, stacked in the order the model was written in
            order = sorted(range(n), key=lambda i: meta.program_order(group[i]))
            group, lns = [group[i] for i in order], [lns[i] for i in order]
            ws, bs = [ln.weight for ln in lns], [ln.bias for ln in lns]
            ti = ctx.info(lns[0].input)
            assert ti is not None
            d = ti.ndim - k
            x = ctx.call(torch.stack, ([ln.input for ln in lns], d))
            y = self._normalise(ctx, x, d, ns, eps, ws, bs)
            g = Gathered(y, d, [1] * n, True, True)
            detail = f"layer_norm over {n} stacked inputs"
        for member, out in zip(group, scatter(ctx, g.node, g)):
            ctx.replace(member, out)
        ctx.erase_if_dead(group)
        self.fired(ctx, group, detail)

    @staticmethod
    def _normalise(
        ctx: RewriteContext,
        x: fx.Node,
        dim: int,
        ns: tuple[int, ...],
        eps: float,
        ws: list[Ref],
        bs: list[Ref],
    ) -> fx.Node:
        """layer_norm over the trailing ``ns`` of ``x`` (members along ``dim``), then the affine.

        Weights of another dtype than ``x`` (float32 weights, bfloat16 input): computed in
        the weights' dtype and returned in ``x``'s, as ``F.layer_norm`` does.
        """
        xi = ctx.info(x)
        assert xi is not None
        n = xi.shape[dim]
        ones = xi.ndim - dim - 1 - len(ns)

        def laid_out(refs: list[Ref]) -> fx.Node | None:
            if refs[0] is None:
                return None
            if not _distinct(refs) and len({ref_key(r) for r in refs}) == 1:
                return param_node(ctx, refs[0])  # one shared parameter broadcasts as is
            flat = combined(ctx, refs, "stack")
            if ones:
                flat = ctx.call_method("view", (flat, n, *([1] * ones), *ns))
            return flat

        w, b = laid_out(ws), laid_out(bs)
        dtypes = {i.dtype for i in (ctx.info(t) for t in (w, b) if t is not None) if i is not None}
        mixed = next(iter(dtypes - {xi.dtype}), None)
        if mixed is not None:
            x = ctx.call_method("to", (x, mixed))
        y = ctx.call(F.layer_norm, (x, ns, None, None, eps))
        if w is not None and b is not None:
            y = ctx.call(torch.addcmul, (b, y, w))
        elif w is not None:
            y = ctx.call(torch.mul, (y, w))
        elif b is not None:
            y = ctx.call(torch.add, (y, b))
        return y if mixed is None else ctx.call_method("to", (y, xi.dtype))


def _distinct(refs: Sequence[Ref]) -> bool:
    keys = [ref_key(r) for r in refs if r is not None]
    return len(set(keys)) == len(keys)


# -- BatchNorm ---------------------------------------------------------------------------------
@register
class FuseParallelBatchNorm(HorizontalRule):
    """N independent BatchNorms of one configuration -> one over the concatenated channels."""

    name = "parallel_batch_norm"
    family = "norms"
    memory_bound = True
    candidates = {"call_module": None, "call_function": BATCH_NORM_FUNCTIONS}

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        bn = batch_norm_call(node, ctx)
        if bn is None:
            return None
        ti = ctx.info(bn.input)
        if ti is None or not ti.static or ti.ndim < 2 or not ti.dtype.is_floating_point:
            return None
        refs = (bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.counter)
        dtypes = tuple(None if r is None else (_ref_info(ctx, r) or (None,))[0] for r in refs)
        if any(r is not None and d is None for r, d in zip(refs, dtypes)):
            return None
        shape = ti.shape[:1] + ti.shape[2:]
        return ("batch_norm", bn.training, bn.momentum, bn.eps, dtypes, shape, ti.dtype, ti.device)

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        if (why := member_refusal(group)) is not None:
            return why
        bns: list[BatchNormCall] = [batch_norm_call(n, ctx) for n in group]  # type: ignore[misc]
        for field in ("running_mean", "running_var", "weight", "bias", "counter"):
            refs = [getattr(b, field) for b in bns]
            if refs[0] is None:
                continue
            if not _distinct(refs):
                return f"members share {field}: one fused update cannot repeat the sequential ones"
            stats = field in ("running_mean", "running_var") and bns[0].training
            if stats and not laid_out_or_can_be(ctx, refs, "cat"):
                return (
                    f"{field} cannot be laid out once (keep_params, graph inputs or already "
                    "fused): the fused update would not reach the members' buffers"
                )
        if contiguous_range([b.input for b in bns]) is None:
            return copy_reason(ctx, len(group), "separate inputs")
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        bns: list[BatchNormCall] = [batch_norm_call(n, ctx) for n in group]  # type: ignore[misc]
        inputs = [b.input for b in bns]
        g = gather(ctx, inputs, 1)
        if (
            g is not None and g.squeezed
        ):  # unbind pieces: their channels are not one dim of the base
            joined = ctx.call(torch.cat, (inputs, 1))
            infos = [ctx.info(x) for x in inputs]
            g = Gathered(joined, 1, [i.shape[1] for i in infos], False, True)  # type: ignore[union-attr]
        if g is None:
            self.refuse(ctx, group, "inputs have no static shape")
            return
        first = bns[0]

        def cat(field: str) -> fx.Node | None:
            refs = [getattr(b, field) for b in bns]
            return None if refs[0] is None else combined(ctx, refs, "cat")

        rm, rv, w, b = cat("running_mean"), cat("running_var"), cat("weight"), cat("bias")
        out = ctx.call(
            F.batch_norm, (g.node, rm, rv, w, b, first.training, first.momentum, first.eps)
        )
        if first.counter is not None:
            counters = [b.counter for b in bns]
            if laid_out_or_can_be(ctx, counters, "stack"):
                ctx.call_method("add_", (combined(ctx, counters, "stack"), 1))
            else:
                for c in counters:
                    ctx.call_method("add_", (param_node(ctx, c), 1))
        for member, piece in zip(group, scatter(ctx, out, g)):
            ctx.replace(member, piece)
        ctx.erase_if_dead(group)
        self.fired(ctx, group, f"batch_norm x{len(group)}" + (" (cat)" if g.copied else ""))


def _ref_info(ctx: RewriteContext, ref: Ref) -> Any:
    """(dtype, device, shape) of a referenced parameter, for bucket keys; None if unknown."""
    ti = param_info(ctx, ref)
    return None if ti is None else (ti.dtype, ti.device, ti.shape)
