"""Which nodes have effects beyond their result (mutation, randomness, communication).

Rules must never merge, reorder past each other, duplicate or drop such nodes unless they
handle the effect explicitly (e.g. the BatchNorm rule keeps running statistics exact).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "comm_kind",
    "has_mode_switches",
    "has_hooks",
    "hooked_paths",
    "records_grad",
    "has_side_effects",
    "mutates_input",
    "needs_contiguous",
    "is_random",
    "member_refusal",
    "subgraphs",
    "eliminate_dead_code",
    "mode_regions",
    "written_in_place",
    "written_inputs",
    "written_target",
    "written_targets",
    "view_bases",
]

_STATEFUL_FUNCTIONS = {F.batch_norm, torch.batch_norm, F.instance_norm}
# where normalizations take the running statistics they update (position, keyword)
_RUNNING_STATS = {
    F.batch_norm: ((1, "running_mean"), (2, "running_var")),
    F.instance_norm: ((1, "running_mean"), (2, "running_var")),
    torch.batch_norm: ((3, "running_mean"), (4, "running_var")),
}
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
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
    torch.dropout_,
    torch.alpha_dropout_,
    torch.feature_dropout_,
    torch.feature_alpha_dropout_,
    torch.native_dropout,
    torch.rrelu_,  # also ``F.rrelu_``
    torch.binomial,
    torch._standard_gamma,
    torch._sample_dirichlet,
}
# Where dropout-like functions take ``p`` and ``training`` ((position, keyword) or None), and
# the default of ``training`` (None: required). Calls that do not train, or drop nothing,
# return their input: no draw.
_P, _TRAINING, _TRAIN = (1, "p"), (2, "training"), (2, "train")
_DROPOUT_ARGS: dict[Any, tuple[tuple[int, str] | None, tuple[int, str], bool | None]] = {
    F.dropout: (_P, _TRAINING, True),
    F.dropout1d: (_P, _TRAINING, True),
    F.dropout2d: (_P, _TRAINING, True),
    F.dropout3d: (_P, _TRAINING, True),
    F.alpha_dropout: (_P, _TRAINING, False),
    F.feature_alpha_dropout: (_P, _TRAINING, False),
    torch.dropout: (_P, _TRAIN, None),
    torch.alpha_dropout: (_P, _TRAIN, None),
    torch.feature_dropout: (_P, _TRAIN, None),
    torch.feature_alpha_dropout: (_P, _TRAIN, None),
    torch.dropout_: (_P, _TRAIN, None),
    torch.alpha_dropout_: (_P, _TRAIN, None),
    torch.feature_dropout_: (_P, _TRAIN, None),
    torch.feature_alpha_dropout_: (_P, _TRAIN, None),
    torch.native_dropout: (_P, _TRAIN, None),
    F.rrelu: (None, (3, "training"), False),  # eval: a fixed slope
    torch.rrelu: (None, (3, "training"), False),
    torch.rrelu_: (None, (3, "training"), False),
}
# Ops that draw only with a dropout probability (position, keyword; default 0) above 0.
_OPTIONAL_DROPOUT = {F.scaled_dot_product_attention: (4, "dropout_p")}
# ``t += x`` in a dynamo graph: these write their tensor argument in place.
_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
        operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
        operator.ixor, operator.ilshift, operator.irshift,
    }
)  # fmt: skip
_NUMBERS = (int, float, torch.SymInt, torch.SymFloat)
# Tensor methods that draw (in-place samplers fill a tensor: ``empty_like(h).bernoulli_(p)``)
_RANDOM_METHODS = {
    "bernoulli", "bernoulli_", "multinomial", "random_", "uniform_", "normal_", "exponential_",
    "cauchy_", "log_normal_", "geometric_",
}  # fmt: skip


def _owner_module(node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return node.graph.owning_module.get_submodule(node.target)
    except AttributeError:
        return None


def hooked_paths(root: nn.Module) -> frozenset[str]:
    """Paths of ``root``'s submodules whose calls run hooks (:func:`has_hooks`)."""
    return frozenset(name for name, m in root.named_modules(remove_duplicate=False) if has_hooks(m))


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
    ``nn.ReLU(inplace=True)``, item assignment (``x[:, :2] = 0``), augmented assignment in
    dynamo graphs (``t += x`` is ``operator.iadd``), ops writing into ``out=``
    (``torch.cumsum(x, 0, out=y)``, whose result is often unused: only the write keeps it
    alive), and calls of sub-graphs whose body writes one of its inputs (an
    activation-checkpointed region running ``nn.ELU(inplace=True)`` on its argument).
    :func:`written_targets` says what they write."""
    return _writes_in_place(node) or (node.op == "call_function" and bool(_region_writes(node)))


def _writes_in_place(node: fx.Node) -> bool:
    """:func:`mutates_input` for a single op (no sub-graph looked into). Asked of every node
    by most rules: the common answers come first."""
    kwargs = node.kwargs
    if kwargs.get("inplace") is True or kwargs.get("out") is not None:
        return True
    op, target = node.op, node.target
    if op == "call_function":
        if target is operator.setitem:
            return True
        if target in _INPLACE_OPERATORS:
            first = node.args[0] if node.args else None
            value = first.meta.get("example_value", first.meta.get("val")) if first else None
            return isinstance(first, fx.Node) and not isinstance(value, _NUMBERS)  # sizes: no
        name = getattr(target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
        schema = getattr(target, "_schema", None)
        return bool(schema is not None and schema.is_mutable) or _inplace_by_position(node)
    if op == "call_method" and isinstance(target, str):
        if target == "__setitem__":
            return True
        return target.endswith("_") and not target.endswith("__")
    mod = _owner_module(node)
    return bool(mod is not None and getattr(mod, "inplace", False))


def _inplace_by_position(node: fx.Node) -> bool:
    """``inplace=True`` given by position: dynamo records ``nn.ELU``, ``nn.LeakyReLU``,
    ``nn.Hardtanh`` or ``nn.Dropout`` built with ``inplace=True`` as ``F.elu(x, 1.0, True)``,
    ``F.dropout(x, 0.5, True, True)``..."""
    for a in node.args:
        if a is True:
            break
    else:
        return False
    try:
        at = _inplace_position(node.target)
    except TypeError:  # an unhashable target
        at = _inplace_position.__wrapped__(node.target)
    return at is not None and len(node.args) > at and node.args[at] is True


@functools.lru_cache(maxsize=4096)
def _inplace_position(target: Any) -> int | None:
    """Where ``target`` takes ``inplace`` positionally, or None."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params):
        if p.kind not in positional:
            return None
        if p.name == "inplace":
            return i
    return None


def is_random(node: fx.Node) -> bool:
    """True for nodes whose result depends on the RNG (dropout in training, rand_like,
    in-place samplers such as ``bernoulli_``, any op PyTorch tags as seeded...), including
    calls of sub-graphs that draw (dynamo's activation-checkpointed regions).

    Dropout in eval mode or with ``p=0``, and RReLU in eval mode, draw nothing: they are
    the identity (a fixed slope), and rules may fuse across them."""
    if node.op == "call_function" and (node.target in _RANDOM_FUNCTIONS or _seeded(node.target)):
        return not _inactive_draw(node)
    if node.op == "call_method" and (node.target in _RANDOM_METHODS or _seeded_name(node.target)):
        return True
    if node.op == "call_function" and any(_body_draws(b) for b in subgraphs(node)):
        return True
    mod = _owner_module(node)
    if isinstance(mod, nn.modules.dropout._DropoutNd):
        return bool(mod.training and mod.p > 0)
    return isinstance(mod, nn.RReLU) and mod.training


def _seeded(target: Any) -> bool:
    """Is ``target`` an op PyTorch tags as drawing from the RNG (``nondeterministic_seeded``):
    an ATen op, or a ``torch`` / ``Tensor`` / ``F`` function of that name? Covers samplers no
    list names. Asked of every call in a graph, many times over: answered once per target."""
    try:
        return _seeded_target(target)
    except TypeError:  # an unhashable target
        return _seeded_target.__wrapped__(target)


@functools.lru_cache(maxsize=4096)
def _seeded_target(target: Any) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _seeded_name(target.__name__)
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return False
    owners = (torch, torch.Tensor, F)
    return any(getattr(o, name, None) is target for o in owners) and _seeded_name(name)


@functools.cache
def _seeded_name(name: Any) -> bool:
    """Does an ATen op of this name draw from the RNG (any of its overloads)?"""
    if not isinstance(name, str) or name.startswith("__"):
        return False
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    seeded = torch.Tag.nondeterministic_seeded
    return any(seeded in getattr(packet, o).tags for o in packet.overloads())


def subgraphs(node: fx.Node) -> list[fx.GraphModule]:
    """The graph modules ``node`` calls: the bodies a higher-order op (dynamo's
    ``tag_activation_checkpoint``, ``cond``...) takes as ``get_attr`` arguments."""
    found = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            body = _submodule(a)
            if isinstance(body, fx.GraphModule):
                found.append(body)
    return found


def _submodule(node: fx.Node) -> Any:
    """The module a ``get_attr`` names, if its graph's owner holds it directly (dynamo's
    bodies do). Read from ``_modules``: ``getattr`` of a parameter's dotted name
    (``norms.0.weight``) fails through ``nn.Module.__getattr__``, an exception per
    parameter read, and rules ask this of nearly every node."""
    owner = node.graph.owning_module
    return None if owner is None else owner._modules.get(str(node.target))


def _body_draws(body: fx.GraphModule) -> bool:
    return any(is_random(n) for n in body.graph.nodes)


def _identity_dropout(node: fx.Node) -> bool:
    """A dropout call (function or module) that returns its input as is (eval mode, or
    ``p=0``): its result shares the input's memory."""
    if node.op == "call_function":
        where = _DROPOUT_ARGS.get(node.target)
        return where is not None and where[0] is not None and _inactive_draw(node)  # no rrelu
    mod = _owner_module(node)
    return isinstance(mod, nn.modules.dropout._DropoutNd) and not (mod.training and mod.p > 0)


def _inactive_draw(node: fx.Node) -> bool:
    """Is this dropout (or rrelu, or attention) call told not to draw: ``training`` False,
    or ``p`` 0? Arguments that are not constants (graph values) count as drawing."""
    optional = _OPTIONAL_DROPOUT.get(node.target)
    if optional is not None:
        pos, name = optional
        p = node.args[pos] if len(node.args) > pos else node.kwargs.get(name, 0.0)
        return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0
    where = _DROPOUT_ARGS.get(node.target)
    if where is None:
        return False
    p_at, train_at, train_default = where

    def arg(at: tuple[int, str] | None, default: Any) -> Any:
        if at is None:
            return default
        pos, name = at
        return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)

    training = arg(train_at, train_default)
    p = arg(p_at, 0.5)
    if training is False:
        return True
    return training is True and isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def has_side_effects(node: fx.Node) -> bool:
    """Conservative: anything that writes state, draws random numbers or talks to other ranks."""
    if node.is_impure() or mutates_input(node) or is_random(node):
        return True
    if node.op == "call_function" and (
        node.target in _STATEFUL_FUNCTIONS or node.target in _SWITCHES
    ):
        # a mode switch's result is read by nothing but its exit, which nothing reads:
        # erasing them would run an ``inference_mode`` block with autograd on
        return True
    mod = _owner_module(node)
    return bool(mod is not None and any(True for _ in mod.buffers()) and mod.training)


def eliminate_dead_code(
    graph: fx.Graph, impure: Callable[[fx.Node], bool] = has_side_effects
) -> int:
    """Erase the nodes of ``graph`` nothing reads, except ``impure`` ones (default:
    :func:`has_side_effects`); returns how many.

    Not ``fx.Graph.eliminate_dead_code``: its default keeps only what fx knows to be impure,
    not in-place updates of buffers whose result nobody reads (``self.calls.add_(1)``), and
    it also cleans the sub-graphs its nodes call (dynamo's activation-checkpointed regions)
    without ``is_impure_node``, erasing such updates there.
    """
    erased = 0
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output") or node.users or impure(node):
            continue
        graph.erase_node(node)
        erased += 1
    return erased


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
        if mutates_input(u) and any(t is via for t in written_targets(u)):
            return True
        if u in seen or not _is_view(u):
            continue
        seen.add(u)
        work.extend((v, u) for v in u.users)
    return False


def written_target(node: fx.Node) -> Any:
    """What an in-place op writes: the first of :func:`written_targets` (None if nothing).
    Ops writing several tensors (``out=`` tuples, checkpointed regions) write the others
    too: ask :func:`written_targets` for them all."""
    targets = written_targets(node)
    return targets[0] if targets else None


def written_targets(node: fx.Node) -> list[Any]:
    """Every argument ``node`` writes in place (empty if :func:`mutates_input` is False): its
    ``out=`` tensors, else the first argument of an in-place op, and for a call of
    sub-graphs the arguments its bodies write (see :func:`written_inputs`). Rules that keep
    reads apart from writes must see them all: a region writing its argument ``x * 2``
    changes what every other read of that node sees."""
    out = node.kwargs.get("out")
    if out is not None:
        found: list[Any] = []
        fx.node.map_arg(out, found.append)
        return found or [out]
    if _writes_in_place(node):
        if node.op == "call_module":  # nn.ReLU(inplace=True) and the like
            return list(node.args[:1])
        return [node.args[0] if node.args else node.kwargs.get("input")]
    return _region_writes(node)


def written_inputs(body: fx.GraphModule) -> tuple[int, ...]:
    """Positions of the inputs ``body`` writes in place, directly or through views of them
    (``num_batches_tracked.add_(1)``, a BatchNorm's running statistics, an in-place
    activation on an argument), nested sub-graphs included.

    Running statistics count here though :func:`mutates_input` leaves a top-level
    normalization out (it is stateful: :func:`has_side_effects`): a region calling one
    writes those statistics as arguments, which the caller's graph must see written."""
    inputs = {n: i for i, n in enumerate(body.graph.find_nodes(op="placeholder"))}
    written: set[int] = set()
    for node in body.graph.nodes:
        for target in [*written_targets(node), *_running_stats(node)]:
            if isinstance(target, fx.Node):
                written.update(inputs[b] for b in view_bases(target) if b in inputs)
    return tuple(sorted(written))


def _running_stats(node: fx.Node) -> list[Any]:
    """The running statistics a normalization call updates (its arguments)."""
    if node.op != "call_function" or node.target not in _RUNNING_STATS:
        return []
    return [
        node.args[pos] if len(node.args) > pos else node.kwargs.get(name)
        for pos, name in _RUNNING_STATS[node.target]
    ]


def _region_writes(node: fx.Node) -> list[fx.Node]:
    """The arguments a call of sub-graphs writes through its bodies. Dynamo's checkpoint op
    (and ``checkpointed``) call ``body(*args[1:])``: those at the written positions. Other
    calls (``cond``...) pass their operands otherwise: every argument but the bodies."""
    if node.op != "call_function":
        return []
    for a in node.args:  # most calls take no ``get_attr``: spare them the look-up
        if isinstance(a, fx.Node) and a.op == "get_attr":
            break
    else:
        return []
    found: dict[fx.Node, None] = {}
    for body in subgraphs(node):
        written = written_inputs(body)
        if not written:
            continue
        operands = _operands(node, body)
        if operands is None:
            found.update((a, None) for a in node.all_input_nodes if not _is_body(a))
        else:
            found.update((operands[i], None) for i in written if isinstance(operands[i], fx.Node))
    return list(found)


def _operands(node: fx.Node, body: fx.GraphModule) -> Sequence[Any] | None:
    """The arguments ``body``'s placeholders take in order, where ``node`` calls it as
    ``(body, *operands)``; else None."""
    first = node.args[0] if node.args else None
    if not (_is_body(first) and _submodule(first) is body):
        return None
    operands = node.args[1:]
    placeholders = body.graph.find_nodes(op="placeholder")
    return operands if len(placeholders) == len(operands) else None


def _is_body(arg: Any) -> bool:
    """A ``get_attr`` of a graph module (a sub-graph a higher-order op calls)?"""
    return (
        isinstance(arg, fx.Node)
        and arg.op == "get_attr"
        and isinstance(_submodule(arg), fx.GraphModule)
    )


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
    if node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        return True
    if node.op == "call_function" and node.target is getattr and node.args[1:2] == ("data",):
        return True  # ``p.data``: the same memory, writes unseen by autograd
    return _identity_dropout(node)


def view_bases(node: fx.Node) -> list[fx.Node]:
    """``node`` and the tensors whose memory its result may share, nearest first
    (``t[:, :8]``: it, then ``t``); the last one owns the memory."""
    chain = [node]
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        chain.append(node)
    return chain


_SWITCHES = frozenset(
    f
    for f in (
        torch._C._set_grad_enabled,
        getattr(torch.amp.autocast_mode, "_enter_autocast", None),
        getattr(torch.amp.autocast_mode, "_exit_autocast", None),
        getattr(torch.autograd.grad_mode, "_enter_inference_mode", None),
        getattr(torch.autograd.grad_mode, "_exit_inference_mode", None),
    )
    if f is not None
)


def _mode_switch(node: fx.Node) -> tuple[str, Any] | None:
    """A node of a dynamo graph that switches grad mode, inference mode or autocast."""
    if node.op != "call_function" or node.target not in _SWITCHES:
        return None
    name = getattr(node.target, "__name__", "")
    if node.target is torch._C._set_grad_enabled:
        return ("grad", node.args[0] if node.args else None)
    if name.startswith("_enter"):
        return ("enter", (name, *map(str, node.args)))
    return ("exit", None)


def _switch_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The mode switches of ``graph``, in order (read from FX's node index: cheap)."""
    found = [n for f in _SWITCHES for n in graph.find_nodes(op="call_function", target=f)]
    return sorted(found) if len(found) > 1 else found


def has_mode_switches(graph: fx.Graph) -> bool:
    """Does ``graph`` switch grad mode, inference mode or autocast (a dynamo graph of a
    forward with ``torch.no_grad()``...)?"""
    return bool(_switch_nodes(graph))


_Mode = tuple[Any, tuple[Any, ...]]  # grad mode (None: unknown), autocast/inference entered


def _called_in(switches: Sequence[fx.Node]) -> _Mode:
    """The mode ``graph`` is called in. Dynamo emits only switches that change the grad mode
    (none for a ``no_grad`` block run under ``no_grad``), so the first one tells; None where
    the graph never switches it (one grad mode for all its nodes)."""
    for n in switches:
        if n.target is torch._C._set_grad_enabled and n.args and isinstance(n.args[0], bool):
            return (not n.args[0], ())
    return (None, ())


def _after(mode: _Mode, switch: fx.Node) -> _Mode:
    """The mode after ``switch``."""
    grad, stack = mode
    kind, arg = _mode_switch(switch)  # type: ignore[misc]
    if kind == "grad":
        return (arg, stack)
    if kind == "enter":
        return (grad, (*stack, arg))
    return (grad, stack[:-1])


def mode_regions(graph: fx.Graph, *, stretches: bool = False) -> dict[fx.Node, Hashable] | None:
    """The grad mode and autocast state each node of ``graph`` runs in (None: one for all).

    Dynamo graphs keep ``with torch.no_grad():`` and autocast regions as mode-switching
    nodes; computations in two regions differ (one records no gradient, one runs in another
    dtype) even when their nodes look alike, so rules must not fuse or merge across them.

    With ``stretches``, each stretch between two switches is a region of its own, even where
    the modes match: a fused node goes where its last member is and takes the readers of
    the other members after it, which must not carry them across a switch.
    """
    switches = _switch_nodes(graph)
    if not switches:
        return None
    mode = _called_in(switches)
    stretch = 0
    out: dict[fx.Node, Hashable] = {}
    for n in graph.nodes:
        if _mode_switch(n) is not None:
            mode = _after(mode, n)
            stretch += 1
        out[n] = stretch if stretches else mode
    return out


def records_grad(node: fx.Node) -> bool:
    """Does autograd record ``node``'s op (grad mode on, no inference mode)?

    A view taken under ``no_grad`` passes no gradient to its base: rules that take a chain
    of views and cats as its source itself (``cat(x.split(4, 1), 1) -> x``), or as a view of
    it made elsewhere, need every op they bypass to be recorded. True in graphs that never
    switch grad mode (one mode for all).
    """
    switches = _switch_nodes(node.graph)
    if not switches:
        return True
    mode = _called_in(switches)
    for s in switches:
        if not s < node:
            break
        mode = _after(mode, s)
    grad, stack = mode
    return grad is not False and not any(e[:2] == ("_enter_inference_mode", "True") for e in stack)


def member_refusal(group: Sequence[fx.Node]) -> str | None:
    """Why these nodes' results cannot become slices of one fused result, or None."""
    if any(written_in_place(n) for n in group):
        return "a member's result is written in place: it must stay its own tensor"
    if any(needs_contiguous(n) for n in group):
        return "a member's result is .view()-ed, which a strided slice of a fused result refuses"
    return None


def needs_contiguous(node: fx.Node) -> bool:
    """Is ``node``'s result ``.view()``-ed (or ``view_as``-ed), directly or through other views
    of it (``h.unsqueeze(0).view(-1)``, ``h.detach().view(-1)``)? Eager ops return contiguous
    tensors; a fused member is a strided slice of the fused result, which ``view`` cannot take,
    and views of a strided slice are strided too. ``contiguous()`` ends the search."""
    seen: set[fx.Node] = set()
    work = [(u, node) for u in node.users]
    while work:
        u, via = work.pop()
        viewed = u.args[0] if u.args else u.kwargs.get("input", u.kwargs.get("self"))
        if viewed is not via:  # ``u`` does not view ``via`` (``x.view_as(via)``)
            continue
        if (u.op == "call_method" and u.target in ("view", "view_as")) or (
            u.op == "call_function" and u.target in (torch.Tensor.view, torch.Tensor.view_as)
        ):
            return True
        if u in seen or not _is_view(u) or u.target in ("contiguous", torch.Tensor.contiguous):
            continue
        seen.add(u)
        work.extend((v, u) for v in u.users)
    return False


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
