"""References to a member's parameters, shared by every rule that fuses layers.

A rule sees a parameter either as a node (``get_attr``, or a graph input when dynamo inlined
the module) or, for ``call_module`` members, as the qualified name of a module attribute
that becomes a ``get_attr`` node only if the set is fused. These helpers read through both,
and lay a set of them out once (:class:`fxrec.graph.params.ParamStore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxrec.graph import meta
from fxrec.graph.cost import inductor_on_cpu
from fxrec.graph.rule import RewriteContext

__all__ = [
    "Ref",
    "ref_key",
    "param_tensor",
    "param_info",
    "param_node",
    "combined",
    "laid_out_or_can_be",
    "gather_cost_reason",
]

# A parameter reference: an existing node, or the qualified name of a module attribute.
Ref = Any


def ref_key(ref: Ref) -> Any:
    """A hashable identity: two references with the same key name the same tensor."""
    return ref if isinstance(ref, str) else ("node", ref)


def param_tensor(ctx: RewriteContext, ref: Ref) -> torch.Tensor | None:
    """The model tensor a reference names (a module attribute or a ``get_attr``), else None."""
    if isinstance(ref, str):
        return ctx.params.target_tensor(ref)
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        return ctx.params.target_tensor(ref.target)
    return None


def param_info(ctx: RewriteContext, ref: Ref) -> meta.TensorInfo | None:
    """Shape, dtype and device of the referenced tensor (from metadata for graph inputs)."""
    if ref is None:
        return None
    t = param_tensor(ctx, ref)
    if t is not None:
        return meta.TensorInfo.of(t)
    return ctx.info(ref) if isinstance(ref, fx.Node) else None


def param_node(ctx: RewriteContext, ref: Ref) -> fx.Node:
    """The node for a reference (a new ``get_attr`` for module attributes)."""
    if isinstance(ref, fx.Node):
        return ref
    node = ctx.graph.get_attr(ref)
    t = param_tensor(ctx, ref)
    if t is not None:
        meta.set_info(node, t)
    return node


def combined(ctx: RewriteContext, refs: Sequence[Ref], how: str) -> fx.Node:
    """One node holding ``refs`` laid out together (``how``: "cat" or "stack").

    Laid out once, that is one ``get_attr`` of a flat tensor: no per-member node is made.
    """
    node = ctx.params.laid_out_node([param_tensor(ctx, r) for r in refs], how)
    if node is not None:
        return node
    return ctx.params.combined([param_node(ctx, r) for r in refs], how)


def laid_out_or_can_be(ctx: RewriteContext, refs: Sequence[Ref], how: str) -> bool:
    """True when ``combined(ctx, refs, how)`` reads one flat tensor (no per-step gather)."""
    ts = [param_tensor(ctx, r) for r in refs]
    return ctx.params.is_laid_out(ts, how) or ctx.params.can_lay_out(ts)


def gather_cost_reason(
    ctx: RewriteContext, refs: Sequence[Sequence[Ref]], how: str, activation_elems: int
) -> str | None:
    """Cost model: refuse when parameters would be gathered in-graph every step and are large.

    Laid out once, a fused layer reads its weights for free. Gathered in-graph (torch.cat /
    torch.stack each step, and the matching split of the gradient), it copies every weight
    twice per step; that pays only while the weights are small next to the activations the
    layer touches anyway (one fused launch saves N-1 launches, a weight copy costs memory
    bandwidth proportional to its size). When Inductor compiles the graph for a CPU a launch
    saves little, so any gather is refused there (:func:`fxrec.graph.cost.inductor_on_cpu`).
    """
    gathered = 0
    for group in refs:
        if not group or group[0] is None:
            continue
        if laid_out_or_can_be(ctx, group, how):
            continue
        for r in group:
            ti = param_info(ctx, r)
            gathered += ti.numel() if ti is not None else 0
    if gathered and inductor_on_cpu(ctx):
        return (
            f"Inductor on CPU: parameters would be gathered in-graph every step "
            f"({gathered} elements), and there is little launch cost to save"
        )
    if gathered > activation_elems:
        return (
            f"parameters would be gathered in-graph every step ({gathered} elements, more than "
            f"the {activation_elems} activation elements; keep_params, graph inputs or a shared "
            "parameter prevent laying them out once)"
        )
    return None
