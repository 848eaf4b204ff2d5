"""What autograd history each node's result can carry, judged from the graph alone.

Horizontal fusion makes every member a slice of one fused result, and that result records
autograd history if any member's inputs do. A member that plain PyTorch returns without
history (a ``.detach()``-ed branch, a value computed under ``no_grad``, a buffer, a constant,
an integer tensor) would then come back with a ``grad_fn``, and ``out.sum().backward()``
would run where PyTorch raises. The driver splits each horizontal set by
:class:`GradHistory` so that only members of one :class:`History` fuse.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxrec.graph import meta
from fxrec.graph.effects import (
    _DROPOUT_ARGS,
    _VIEW_FUNCTIONS,
    _VIEW_METHODS,
    _identity_dropout,
    _owner_module,
    has_mode_switches,
    mutates_input,
    records_grad,
    view_bases,
    written_targets,
)

__all__ = ["GradHistory", "History"]


class History(enum.IntEnum):
    """What autograd history a node's result can carry, ordered: a result carries the most
    of what it is computed from."""

    NONE = 0  # never: detached, computed without grad mode, integers, constants, buffers
    FROZEN = 1  # only through parameters frozen now, which may be unfrozen later
    RECORDED = 2  # may be recorded: graph inputs, trainable parameters


# Calls whose result holds no autograd history whatever they read: detaching, sizes and
# other properties of a tensor, new tensors of only a tensor's shape.
_CUT_METHODS = frozenset(
    {
        "detach", "detach_", "size", "dim", "ndimension", "numel", "nelement", "stride",
        "storage_offset", "element_size", "item", "tolist", "is_contiguous", "data_ptr",
        "get_device", "is_floating_point", "is_complex", "new_zeros", "new_ones", "new_empty",
        "new_full", "new_tensor",
    }
)  # fmt: skip
_CUT_FUNCTIONS = frozenset(
    {
        torch.detach, torch.Tensor.detach, torch.detach_, torch.zeros_like, torch.ones_like,
        torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
        torch.randint_like,
    }
)  # fmt: skip
# Attributes (``getattr(x, name)``) that are views of the tensor's values; others
# (``x.data``, ``x.shape``) hold no history.
_VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_NO_INPUTS: tuple[fx.Node, ...] = ()

# What :func:`_call_kind` answers: the result holds none of its inputs' history, that of
# its first argument only (a view), or what ``requires_grad_`` asks for.
_CUT, _VIEW, _ASKS = object(), object(), object()
_METHOD_KINDS: dict[str, object] = {
    **{m: _VIEW for m in _VIEW_METHODS},
    **{m: _CUT for m in _CUT_METHODS},  # after the views: ``detach`` is both
    "requires_grad_": _ASKS,
}
_FUNCTION_KINDS: dict[Any, object] = {
    **{f: _VIEW for f in _VIEW_FUNCTIONS},
    **{f: _CUT for f in _CUT_FUNCTIONS},
}


class GradHistory:
    """The :class:`History` of each node's result.

    A parameter frozen now is kept apart from both other kinds: unfreezing it later gives
    its members history, and must not give it to members that never have any.

    One per run of the rules: each node is judged once (again if its arguments change, as in
    :class:`fxrec.graph.rule.NodeCache`), walking its inputs without recursion (graphs run
    to thousands of nodes deep) and stopping at the first one that may record. In-place
    writes count: ``buf[:, 0] = lin(x)`` gives ``buf``, and what reads it, the history of
    what was written.
    """

    def __init__(
        self,
        graph: fx.Graph,
        writers: Sequence[fx.Node] | None = None,
        module_of: Callable[[fx.Node], nn.Module | None] = _owner_module,
    ) -> None:
        """``writers``: the graph's in-place writes where the caller has them (else found
        here); ``module_of``: the module a ``call_module`` node calls, where the caller
        caches them."""
        self._graph = graph
        self._writers = writers
        self._module_of = module_of
        self._memo: dict[fx.Node, tuple[Any, Any, Any, History]] = {}
        self._modules: dict[str, History] = {}  # by path: rules never replace a module
        self._written: dict[fx.Node, History] | None = None
        self._switches = has_mode_switches(graph)

    def __call__(self, node: fx.Node) -> History:
        known = self._known(node)
        if known is not None:
            return known
        if self._written is None:
            self._written = self._writes()
        floor, inputs = self._own(node)
        if inputs and floor is not History.RECORDED:
            floor = self._join(node, floor, inputs)
        return self._store(node, floor)

    # -- memo ----------------------------------------------------------------------------------
    def _known(self, node: fx.Node) -> History | None:
        e = self._memo.get(node)
        if e is not None and e[0] is node.args and e[1] is node.kwargs and e[2] is node.target:
            return e[3]
        return None

    def _store(self, node: fx.Node, value: History) -> History:
        written = self._written.get(node) if self._written else None
        if written is not None and written > value:
            value = written
        self._memo[node] = (node.args, node.kwargs, node.target, value)
        return value

    # -- the walk ------------------------------------------------------------------------------
    def _join(self, node: fx.Node, floor: History, inputs: Sequence[fx.Node]) -> History:
        """``floor`` joined with the inputs' histories: a post-order walk over the inputs
        not judged yet, one frame [node, so far, inputs, next] per node whose inputs are not
        all judged."""
        stack: list[list[Any]] = [[node, floor, inputs, 0]]
        while True:
            frame = stack[-1]
            acc, ins, i = frame[1], frame[2], frame[3]
            waiting = None
            while i < len(ins) and acc is not History.RECORDED:
                x = ins[i]
                v = self._known(x)
                if v is None:
                    own, more = self._own(x)
                    v = self._joined(own, more)
                    if v is None:
                        waiting = [x, own, more, 0]
                        break
                    v = self._store(x, v)
                if v > acc:
                    acc = v
                i += 1
            frame[1], frame[3] = acc, i
            if waiting is not None:
                stack.append(waiting)
                continue
            stack.pop()
            if not stack:
                return acc
            self._store(frame[0], acc)

    def _joined(self, own: History, inputs: Sequence[fx.Node]) -> History | None:
        """``own`` joined with ``inputs``' histories if all are judged, else None."""
        for x in inputs:
            if own is History.RECORDED:
                break
            v = self._known(x)
            if v is None:
                return None
            if v > own:
                own = v
        return own

    def _own(self, node: fx.Node) -> tuple[History, Sequence[fx.Node]]:
        """The history ``node`` gives its result itself, and the inputs whose it takes on."""
        op = node.op
        if op == "call_function" or op == "call_method":
            if self._switches and not records_grad(node):
                return History.NONE, _NO_INPUTS
            kwargs = node.kwargs
            if kwargs and kwargs.get("requires_grad") is True:
                return History.RECORDED, _NO_INPUTS
            kind = _call_kind(node)
            if kind is _CUT or _holds_no_floats(node):
                return History.NONE, _NO_INPUTS
            if kind is _VIEW:  # a view's other arguments are sizes, dims, dtypes
                first = node.args[0] if node.args else None
                return History.NONE, ((first,) if isinstance(first, fx.Node) else _NO_INPUTS)
            if kind is _ASKS:  # ``x.requires_grad_(flag)``
                flag = node.args[1] if len(node.args) > 1 else kwargs.get("requires_grad", True)
                return (History.NONE if flag is False else History.RECORDED), _NO_INPUTS
            return History.NONE, node.all_input_nodes
        if op == "call_module":
            if self._switches and not records_grad(node):
                return History.NONE, _NO_INPUTS
            floor = self._module_history(node)
            if floor is History.RECORDED:
                return floor, _NO_INPUTS
            if _holds_no_floats(node):
                return History.NONE, _NO_INPUTS
            return floor, node.all_input_nodes
        if op == "placeholder":
            return (History.NONE if _holds_no_floats(node) else History.RECORDED), _NO_INPUTS
        if op == "get_attr":
            return _attribute_history(node), _NO_INPUTS
        return History.NONE, node.all_input_nodes

    def _module_history(self, node: fx.Node) -> History:
        path = str(node.target)
        found = self._modules.get(path)
        if found is None:
            mod = self._module_of(node)
            # a module not known here may record
            found = self._modules[path] = History.RECORDED if mod is None else _module_history(mod)
        return found

    # -- in-place writes -----------------------------------------------------------------------
    def _writes(self) -> dict[fx.Node, History]:
        """For each tensor written in place (and what it is a view of): the history written.

        Repeated until it settles, judging afresh each time: a write may copy in a value
        read from a tensor another write filled.
        """
        writers = self._writers
        if writers is None:
            writers = [n for n in self._graph.nodes if mutates_input(n)]
        self._written = {}
        while True:
            written = self._written_by(writers)
            if written == self._written:
                return written
            self._memo.clear()
            self._written = written

    def _written_by(self, writers: Sequence[fx.Node]) -> dict[fx.Node, History]:
        written: dict[fx.Node, History] = {}
        for w in writers:
            targets = [t for t in written_targets(w) if isinstance(t, fx.Node)]
            values = [i for i in w.all_input_nodes if i not in targets]
            value = max((self(i) for i in values), default=History.NONE)
            if value is History.NONE:
                continue
            for t in targets:
                for b in view_bases(t):
                    written[b] = max(written.get(b, History.NONE), value)
        return written


def _call_kind(node: fx.Node) -> object:
    """How a call's result relates to its inputs' history: :data:`_CUT` (holds none of it:
    ``x.detach()``, ``x.data``, ``x.size()``, ``torch.zeros_like(x)``), :data:`_VIEW` (its
    first argument's), :data:`_ASKS` (``x.requires_grad_()``), or None (all its inputs')."""
    target = node.target
    if node.op == "call_method":
        return _METHOD_KINDS.get(target)  # type: ignore[arg-type]
    if target is getattr:
        if len(node.args) < 2:
            return None
        return _VIEW if node.args[1] in _VALUE_ATTRIBUTES else _CUT
    try:
        kind = _FUNCTION_KINDS.get(target)
    except TypeError:  # an unhashable target
        return None
    if kind is None and target in _DROPOUT_ARGS and _identity_dropout(node):
        return _VIEW
    return kind


def _holds_no_floats(node: fx.Node) -> bool:
    """Is ``node``'s result known to hold no floating-point (or complex) tensor? Integer and
    bool tensors, and numbers, never carry autograd history."""
    ti = meta.info(node)
    if type(ti) is meta.TensorInfo:  # the common case first
        return not (ti.dtype.is_floating_point or ti.dtype.is_complex)
    if ti is None:
        return False
    items = ti if isinstance(ti, (tuple, list)) else (ti,)
    for i in items:
        if isinstance(i, meta.TensorInfo):
            if i.dtype.is_floating_point or i.dtype.is_complex:
                return False
        elif not isinstance(i, (int, float, bool, torch.dtype, torch.device, torch.Size)):
            return False  # a value of a kind not known here
    return True


def _attribute_history(node: fx.Node) -> History:
    """A ``get_attr``: a parameter's by its flag (frozen ones apart), a buffer none, a
    module (a sub-graph a higher-order op calls) by its parameters."""
    try:
        obj = meta.resolve_attr(node.graph.owning_module, str(node.target))
    except AttributeError:
        return History.RECORDED  # not known here: assume it may record
    if isinstance(obj, nn.Module):
        return _module_history(obj)
    if isinstance(obj, torch.Tensor):
        return _tensor_history(obj)
    return History.NONE


def _tensor_history(t: torch.Tensor) -> History:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return History.NONE
    if t.requires_grad:
        return History.RECORDED
    return History.FROZEN if isinstance(t, nn.Parameter) else History.NONE


def _module_history(mod: nn.Module) -> History:
    """The most any of a module's parameters gives its results."""
    found = History.NONE
    for m in mod.modules() if mod._modules else (mod,):
        for p in m._parameters.values():
            if p is not None and (h := _tensor_history(p)) > found:
                found = h
                if found is History.RECORDED:
                    return found
    return found
