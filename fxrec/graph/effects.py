"""Which nodes have effects beyond their result (mutation, randomness, communication).

Rules must never merge, reorder past each other, duplicate or drop such nodes unless they
handle the effect explicitly (e.g. the BatchNorm rule keeps running statistics exact).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "comm_kind",
    "has_hooks",
    "has_side_effects",
    "mutates_input",
    "needs_contiguous",
    "is_random",
    "member_refusal",
    "written_in_place",
    "written_target",
]

_STATEFUL_FUNCTIONS = {F.batch_norm, torch.batch_norm, F.instance_norm}
_RANDOM_FUNCTIONS = {
    F.dropout,
    torch.dropout,
    F.alpha_dropout,
    torch.rand_like,
    torch.randn_like,
    torch.bernoulli,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.feature_alpha_dropout,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.normal,
    torch.multinomial,
    torch.poisson,
    torch.rrelu,
    F.rrelu,
    F.gumbel_softmax,
}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "exponential_"}


def _owner_module(node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return node.graph.owning_module.get_submodule(node.target)
    except AttributeError:
        return None


def has_hooks(module: nn.Module) -> bool:
    """Does calling ``module`` run hooks (forward, forward-pre or backward)?

    A rule that replaces such a module's call would silently drop them: rules leave these
    calls as written.
    """
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def mutates_input(node: fx.Node) -> bool:
    """True for in-place ops: ``x.relu_()``, ``F.relu(x, inplace=True)``,
    ``nn.ReLU(inplace=True)``, item assignment (``x[:, :2] = 0``), and ops writing into
    ``out=`` (``torch.cumsum(x, 0, out=y)``, whose result is often unused: only the write
    keeps it alive)."""
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    if node.op == "call_method" and isinstance(node.target, str):
        if node.target == "__setitem__":
            return True
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    mod = _owner_module(node)
    return bool(mod is not None and getattr(mod, "inplace", False))


def is_random(node: fx.Node) -> bool:
    """True for nodes whose result depends on the RNG (dropout in training, rand_like...)."""
    if node.op == "call_function" and node.target in _RANDOM_FUNCTIONS:
        return True
    if node.op == "call_method" and node.target in _RANDOM_METHODS:
        return True
    mod = _owner_module(node)
    return isinstance(mod, (nn.modules.dropout._DropoutNd, nn.RReLU))


def has_side_effects(node: fx.Node) -> bool:
    """Conservative: anything that writes state, draws random numbers or talks to other ranks."""
    if node.is_impure() or mutates_input(node) or is_random(node):
        return True
    if node.op == "call_function" and node.target in _STATEFUL_FUNCTIONS:
        return True
    mod = _owner_module(node)
    return bool(mod is not None and any(True for _ in mod.buffers()) and mod.training)


def written_in_place(node: fx.Node) -> bool:
    """True if an in-place op may write ``node``'s result (directly or through a view of it).

    Fused members come back as views of one tensor produced by a multi-output split;
    autograd forbids writing such views in place, and the write would land in the shared
    result. Such members are refused. Users that may share its memory (views, and ops that
    can return their input as is, e.g. ``contiguous`` or ``to``) are followed to any depth.
    """
    seen: set[fx.Node] = set()
    work = [(u, node) for u in node.users]
    while work:
        u, via = work.pop()
        if mutates_input(u) and written_target(u) is via:
            return True
        if u in seen or not _is_view(u):
            continue
        seen.add(u)
        work.extend((v, u) for v in u.users)
    return False


def written_target(node: fx.Node) -> Any:
    """What an in-place op writes: its ``out=`` tensor, else its first argument."""
    out = node.kwargs.get("out")
    if out is not None:
        return out
    if node.op == "call_module":  # nn.ReLU(inplace=True) and the like
        return node.args[0] if node.args else None
    return node.args[0] if node.args else node.kwargs.get("input")


_VIEW_METHODS = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "narrow", "t", "transpose", "permute",
        "expand", "expand_as", "unsqueeze", "squeeze", "select", "split", "chunk", "unbind",
        "flatten", "unflatten", "__getitem__", "as_strided", "diagonal", "movedim",
        "swapaxes", "unfold", "detach", "contiguous", "split_with_sizes",
        # may return the tensor itself
        "to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int",
        "cpu", "cuda",
    }
)  # fmt: skip
_VIEW_FUNCTIONS = frozenset(
    {
        operator.getitem, torch.split, torch.chunk, torch.unbind, torch.narrow, torch.reshape,
        torch.flatten, torch.transpose, torch.t, torch.permute, torch.squeeze, torch.unsqueeze,
        torch.select, torch.movedim, torch.as_strided, torch.detach, torch.Tensor.view,
    }
)  # fmt: skip


def _is_view(node: fx.Node) -> bool:
    """May ``node``'s result share memory with its first input?"""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def _mode_switch(node: fx.Node) -> tuple[str, Any] | None:
    """A node of a dynamo graph that switches grad mode, inference mode or autocast."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if node.target is torch._C._set_grad_enabled:
        return ("grad", node.args[0] if node.args else None)
    if name in ("_enter_autocast", "_enter_inference_mode"):
        return ("enter", (name, *map(str, node.args)))
    if name in ("_exit_autocast", "_exit_inference_mode"):
        return ("exit", None)
    return None


def mode_regions(graph: fx.Graph) -> dict[fx.Node, Hashable] | None:
    """The grad mode and autocast state each node of ``graph`` runs in (None: one for all).

    Dynamo graphs keep ``with torch.no_grad():`` and autocast regions as mode-switching
    nodes; computations in two regions differ (one records no gradient, one runs in another
    dtype) even when their nodes look alike, so rules must not fuse or merge across them.
    """
    if not any(_mode_switch(n) for n in graph.nodes):
        return None
    grad: Any = True
    stack: list[Any] = []
    out: dict[fx.Node, Hashable] = {}
    for n in graph.nodes:
        switch = _mode_switch(n)
        if switch is not None:
            kind, arg = switch
            if kind == "grad":
                grad = arg
            elif kind == "enter":
                stack.append(arg)
            elif stack:
                stack.pop()
        out[n] = (grad, tuple(stack))
    return out


def member_refusal(group: Sequence[fx.Node]) -> str | None:
    """Why these nodes' results cannot become slices of one fused result, or None."""
    if any(written_in_place(n) for n in group):
        return "a member's result is written in place: it must stay its own tensor"
    if any(needs_contiguous(n) for n in group):
        return "a member's result is .view()-ed, which a strided slice of a fused result refuses"
    return None


def needs_contiguous(node: fx.Node) -> bool:
    """Is ``node``'s result ``.view()``-ed? Eager ops return contiguous tensors; a fused
    member is a strided slice of the fused result, which ``view`` cannot take."""
    return any(
        (u.op == "call_method" and u.target == "view")
        or (u.op == "call_function" and u.target is torch.Tensor.view)
        for u in node.users
    )


_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_WAIT_NAMES = ("wait_tensor",)


def comm_kind(node: fx.Node) -> str | None:
    """``"request"``, ``"wait"`` or None for a node that is no collective."""
    if node.op != "call_function":
        return None
    target = node.target
    tag = getattr(target, "_fxrec_comm", None)
    if tag in ("request", "wait"):
        return tag
    ns = getattr(target, "namespace", None)
    if ns is None and isinstance(target, torch._ops.OpOverloadPacket):
        ns = target._qualified_op_name.split("::")[0]
    if ns in _FUNCTIONAL_NAMESPACES:
        name = getattr(target, "__name__", "")
        base = name.split(".")[0]
        return "wait" if base in _WAIT_NAMES else "request"
    return None
