"""Duplicate pure work computed once; pure work nobody reads removed.

Two local rules:

* ``dedup`` (common-subexpression elimination): a node with the same op, target, arguments
  and keyword arguments as an earlier node is replaced by it: the same table looked up twice
  with the same ids, the same ``nn.Linear`` applied twice to one input, a cast repeated per
  feature. Only pure nodes qualify (no side effects per :mod:`fxrec.graph.effects`: no
  in-place op, no randomness, no module updating buffers). A node that may read memory some
  in-place op writes (the written tensor, or anything it may alias: its ancestors) is never
  merged, since the two reads could see different values. ``empty``-like factories are never
  merged either: two callers would then share one buffer.
* ``merge_unused_pieces``: consecutive unread pieces of a split become one piece (autograd
  fills each unread output with zeros in backward: one kernel per piece, every step).
* ``dead_code``: a pure node whose result is never used is removed, together with the pure
  inputs it alone kept alive. Side effects (in-place ops, dropout and other random ops,
  collectives, running-statistics updates) always stay.

Replacing a node by an earlier twin only removes paths between existing nodes, as local
rules must.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxrec.graph.effects import (
    has_side_effects,
    is_random,
    mode_regions,
    mutates_input,
    written_targets,
)
from fxrec.graph.pieces import SPLIT_FUNCTIONS, split_sizes
from fxrec.graph.rule import LocalRule, RewriteContext, register

logger = logging.getLogger(__name__)

__all__ = ["Dedup", "DeadCode", "MergeUnusedPieces", "cse_key"]

# Allocations whose contents are unspecified: merging two would alias two buffers.
_UNMERGEABLE = {
    torch.empty,
    torch.empty_like,
    torch.empty_strided,
    torch.Tensor.new_empty,
}
_UNMERGEABLE_METHODS = {"new_empty", "new_empty_strided"}


_REMOVABLE_OPS = ("call_function", "call_method", "call_module", "get_attr")


def _erased(node: fx.Node) -> bool:
    return bool(getattr(node, "_erased", False))


class _Unhashable(Exception):
    pass


_ATOMS = (bool, int, float, str, complex, torch.dtype, torch.device, torch.layout)
_EXACT_ATOMS = frozenset(_ATOMS)
_EXACT_SEQUENCES = frozenset((list, tuple, fx.immutable_collections.immutable_list))


def _freeze(v: Any) -> Any:
    """A hashable, type-exact image of an argument (``1``, ``1.0`` and ``True`` differ)."""
    t = type(v)  # exact-type shortcuts first: they give what the checks below give
    if t is fx.Node:
        return ("node", v)
    if t is float:
        return (float, v.hex())  # 0.0 and -0.0 differ (x / -0.0)
    if t in _EXACT_ATOMS and t is not complex:
        return (t, v)
    if t in _EXACT_SEQUENCES:
        return (t.__name__, tuple([_freeze(x) for x in v]))
    if isinstance(v, fx.Node):
        return ("node", v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_freeze(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    if isinstance(v, slice):
        return ("slice", _freeze(v.start), _freeze(v.stop), _freeze(v.step))
    if v is None or v is Ellipsis:
        return v
    if isinstance(v, (float, complex)):  # a subclass (numpy.float64), a complex: by bits too
        c = complex(v)
        return (type(v), c.real.hex(), c.imag.hex())
    if isinstance(v, _ATOMS):
        return (type(v), v)
    if isinstance(v, torch.memory_format):
        return (type(v), str(v))
    raise _Unhashable(type(v).__name__)


def cse_key(node: fx.Node) -> Any:
    """The identity of a pure node's computation, or None if it must not be merged."""
    if node.op not in _REMOVABLE_OPS:
        return None
    if has_side_effects(node):
        return None
    return _computation_key(node)


def _computation_key(node: fx.Node) -> Any:
    """:func:`cse_key` without the purity test (callers test purity where it matters)."""
    if node.op == "call_function" and node.target in _UNMERGEABLE:
        return None
    if node.op == "call_method" and node.target in _UNMERGEABLE_METHODS:
        return None
    try:
        return (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))
    except _Unhashable:
        return None


def _reading_written_memory(
    graph: fx.Graph,
    mutates: Callable[[fx.Node], bool] = mutates_input,
    side_effects: Callable[[fx.Node], bool] = has_side_effects,
) -> set[fx.Node]:
    """Nodes that may read memory an in-place op writes somewhere in the graph.

    Written: the tensors each in-place op writes (a checkpointed region: the arguments its
    body writes), plus their ancestors (each may be a view of them); the inputs of other
    stateful ops (running statistics, collectives). A node reads written memory if it, or
    any ancestor, is written. One forward sweep. ``mutates`` and ``side_effects`` stand for
    :func:`mutates_input` and :func:`has_side_effects` (cached versions of them, for
    instance).
    """
    written: set[fx.Node] = set()
    work: list[fx.Node] = []
    for n in graph.nodes:
        if mutates(n):  # ``out=`` tensors, a region's written arguments: not its first input
            work.extend(t for t in written_targets(n) if isinstance(t, fx.Node))
        elif n.op in ("call_function", "call_method") and side_effects(n) and not is_random(n):
            work.extend(n.all_input_nodes)
    while work:
        n = work.pop()
        if n not in written:
            written.add(n)
            work.extend(n.all_input_nodes)
    if not written:
        return written
    tainted: set[fx.Node] = set()
    for n in graph.nodes:
        if n in written or any(i in tainted for i in n.all_input_nodes):
            tainted.add(n)
    return tainted


@register
class Dedup(LocalRule):
    """A pure node identical to an earlier one is replaced by the earlier one."""

    name = "dedup"
    family = "dedup"
    candidates = dict.fromkeys(_REMOVABLE_OPS)

    def __init__(self) -> None:
        self._graph: fx.Graph | None = None
        self._seen: dict[Any, fx.Node] = {}
        self._tainted: set[fx.Node] | None = None
        self._regions: dict[fx.Node, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the last sweep's graph (a module holding the rules is saved)."""
        return {"_graph": None, "_seen": {}, "_tainted": None, "_regions": None}

    def begin_sweep(self, ctx: RewriteContext) -> None:
        """Fresh table, fresh view of mutations."""
        self._graph = ctx.graph
        self._seen = {}
        self._tainted = None  # see _reads_written
        # no merging across grad-mode or autocast regions (dynamo graphs keep them as nodes)
        self._regions = mode_regions(ctx.graph)

    def _reads_written(self, node: fx.Node, ctx: RewriteContext) -> bool:
        """``node in _reading_written_memory(graph)`` as of the start of the sweep.

        Computed when first needed, which is before the sweep's first rewrite (a rewrite
        needs this answer), so the graph is still the one the sweep started with.
        """
        if self._tainted is None:
            self._tainted = _reading_written_memory(
                ctx.graph, ctx.cached(mutates_input), ctx.cached(has_side_effects)
            )
        return node in self._tainted

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        if self._graph is not ctx.graph:  # called outside the driver's sweeps
            self.begin_sweep(ctx)
        if node.op not in _REMOVABLE_OPS or _erased(node):
            return None
        # A twin reads the same inputs: if this node's first input feeds nothing else, there
        # is none (the cheap test that spares hashing the arguments of most nodes).
        first_input = next(iter(node._input_nodes), None)
        if first_input is not None and len(first_input.users) < 2:
            return None
        key = ctx.cached(_computation_key)(node)
        if key is None:
            return None
        if self._regions is not None:
            key = (self._regions.get(node), key)
        # Purity (cse_key's other half) is tested only when two nodes share a key, not for
        # every node. The table may then hold an impure node: it counts as no twin, as if it
        # had never been entered, and the next node with its key takes its place.
        impure = ctx.cached(has_side_effects)
        twin = self._seen.get(key)
        if twin is None or twin is node or _erased(twin) or impure(twin):
            self._seen[key] = node
            return None
        if impure(node):
            return None
        if self._reads_written(node, ctx) or self._reads_written(twin, ctx):
            return None  # an in-place op may change what one of the two reads
        return twin

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        twin: fx.Node = match
        ctx.replace(node, twin)
        ctx.graph.erase_node(node)
        self.fired(ctx, [node], f"same as {twin.name}")


@register
class DeadCode(LocalRule):
    """A pure node whose result is never read is removed (with inputs it alone kept alive)."""

    name = "dead_code"
    family = "dedup"
    candidates = dict.fromkeys(_REMOVABLE_OPS)

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        if node.users or node.op not in _REMOVABLE_OPS or _erased(node):
            return None
        return not ctx.cached(has_side_effects)(node)

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        removed = 0
        work = [node]
        while work:
            n = work.pop()
            if n.graph is not ctx.graph or n.users or n.op not in _REMOVABLE_OPS:
                continue
            if has_side_effects(n) or _erased(n):
                continue
            inputs = n.all_input_nodes
            ctx.graph.erase_node(n)
            removed += 1
            work.extend(inputs)
        self.fired(ctx, [node], f"removed {removed} unused node(s)")


@register
class MergeUnusedPieces(LocalRule):
    """Consecutive pieces of a split that nobody reads become one piece.

    Autograd fills every unread output of a split with zeros in backward (one kernel each),
    so a split whose N unread pieces stay separate costs N kernels per step for nothing.
    """

    name = "merge_unused_pieces"
    family = "dedup"
    candidates = {"call_function": SPLIT_FUNCTIONS, "call_method": {"split"}}

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        is_split = (node.op == "call_function" and node.target in SPLIT_FUNCTIONS) or (
            node.op == "call_method" and node.target == "split"
        )
        if _erased(node) or not is_split:
            return None
        s = split_sizes(node)
        if s is None or s[3]:
            return None
        used: dict[int, list[fx.Node]] = {}
        for u in node.users:
            if u.op != "call_function" or u.target is not operator.getitem:
                return None
            idx = u.args[1]
            if not isinstance(idx, int) or not -len(s[2]) <= idx < len(s[2]):
                return None
            used.setdefault(idx % len(s[2]), []).append(u)
        sizes = s[2]
        runs = [i for i in range(1, len(sizes)) if i not in used and i - 1 not in used]
        if not used or not runs:
            return None
        return s, used

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        (base, dim, sizes, _), used = match
        new_sizes: list[int] = []
        remap: dict[int, int] = {}
        for i, size in enumerate(sizes):
            if i in used or not new_sizes or (i - 1) in used:
                new_sizes.append(size)
            else:
                new_sizes[-1] += size
            if i in used:
                remap[i] = len(new_sizes) - 1
        with ctx.graph.inserting_before(node):
            new = ctx.call(torch.split, (base, new_sizes, dim))
        for i, items in used.items():
            for item in items:
                item.args = (new, remap[i])
        ctx.graph.erase_node(node)
        self.fired(ctx, [node], f"{len(sizes)} -> {len(new_sizes)} pieces")
