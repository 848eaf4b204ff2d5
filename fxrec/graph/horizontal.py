"""Building blocks shared by horizontal rules: bring N inputs together, split N outputs apart.

``gather`` returns one tensor holding the members' inputs side by side along ``dim``. When the
inputs are consecutive pieces of one tensor (the common case after an embedding lookup or a
fused layer) that is the base tensor itself, or a narrow view of it: no copy. Otherwise it is
a ``torch.cat`` (one kernel), which the cost model weighs. ``scatter`` splits a fused result
back into per-member views.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxrec.graph import meta
from fxrec.graph.pieces import contiguous_range
from fxrec.graph.rule import RewriteContext

__all__ = ["Gathered", "gather", "scatter"]


@dataclass
class Gathered:
    node: fx.Node
    dim: int
    sizes: list[int]
    squeezed: bool  # members were unbind pieces (the dim was removed)
    copied: bool  # True when a cat was needed


def gather(ctx: RewriteContext, inputs: Sequence[fx.Node], dim: int) -> Gathered | None:
    """One node holding ``inputs`` side by side along ``dim`` (a view when possible)."""
    rng = contiguous_range(inputs)
    if rng is not None:
        base, bdim, start, total, sizes, squeezed = rng
        ti = meta.info(base)
        if isinstance(ti, meta.TensorInfo) and (squeezed or bdim == dim % ti.ndim):
            if start == 0 and total == ti.shape[bdim]:
                return Gathered(base, bdim, sizes, squeezed, False)
            node = ctx.call_method("narrow", (base, bdim, start, total))
            return Gathered(node, bdim, sizes, squeezed, False)
    infos = [ctx.info(n) for n in inputs]
    if any(i is None or not i.static for i in infos):
        return None
    ndim = infos[0].ndim  # type: ignore[union-attr]
    d = dim % ndim if ndim else 0
    if any(i.ndim != ndim for i in infos):  # type: ignore[union-attr]
        return None
    node = ctx.call(torch.cat, (list(inputs), d))
    return Gathered(node, d, [i.shape[d] for i in infos], False, True)  # type: ignore[union-attr]


def scatter(ctx: RewriteContext, fused: fx.Node, g: Gathered) -> list[fx.Node]:
    """Split ``fused`` (laid out like ``g``) into one view per member."""
    if g.squeezed:
        parts = ctx.call(torch.unbind, (fused, g.dim))
    else:
        parts = ctx.call(torch.split, (fused, list(g.sizes), g.dim))
    outs = []
    ti = meta.info(parts)
    infos = ti if isinstance(ti, (list, tuple)) else ()
    for i in range(len(g.sizes)):
        # The name fx derives from the target, given so it is not derived N times.
        item = ctx.graph.call_function(operator.getitem, (parts, i), name="getitem")
        if i < len(infos):
            meta.set_info(item, infos[i])
        outs.append(item)
    return outs
