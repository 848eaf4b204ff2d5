"""Atomic rules: *match* + *rewrite*, one operator kind, one step.

A rule never walks the graph itself; the driver (:mod:`fxrec.graph.driver`) owns the
worklist and the fixed point. Two shapes of rule exist:

* :class:`LocalRule` looks at one node and rewrites it in place (e.g. "a cat of a split's
  pieces, in order, is the split's input"). Local rewrites may remove paths between
  existing nodes but must never add one.
* :class:`HorizontalRule` gives each candidate a bucket key; the driver runs the two-step
  greedy search (bucket, then independent sets) and hands each set to :meth:`fuse`, after
  the rule's :meth:`refuse_reason` (safety and cost model) has had its say.

Rules register themselves with :func:`register`; ``fxrec.optimize`` runs every registered
rule unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import torch.fx as fx
from torch import nn

from fxrec.graph import meta
from fxrec.graph.cost import cache_reason, chunks
from fxrec.graph.effects import hooked_paths
from fxrec.graph.params import ParamStore
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = [
    "Rule",
    "LocalRule",
    "HorizontalRule",
    "RewriteContext",
    "NodeCache",
    "register",
    "registered_rules",
]

_REGISTRY: dict[str, type[Rule]] = {}

# A reader with this many inputs is rebuilt once per fused set (see batched_replacements).
WIDE_READER_INPUTS = 32

T = TypeVar("T")


class NodeCache(Generic[T]):
    """``fn(node)`` computed once per node for one run of the rules, not once per pass.

    For functions of a node's own op, target, args and kwargs (and of module state, which no
    rule changes during a run). An entry is recomputed when any of those is a different object:
    fx builds a new args tuple whenever an input is rerouted, and its lists are immutable.
    """

    def __init__(self, fn: Callable[[fx.Node], T]) -> None:
        self._fn = fn
        self._entries: dict[fx.Node, tuple[Any, Any, Any, Any, T]] = {}

    def __call__(self, node: fx.Node) -> T:
        args, kwargs = node.args, node.kwargs
        e = self._entries.get(node)
        if (
            e is not None
            and e[0] is args
            and e[1] is kwargs
            and e[2] is node.target
            and e[3] is node.op
        ):
            return e[4]
        value = self._fn(node)
        self._entries[node] = (args, kwargs, node.target, node.op, value)
        return value


class RewriteContext:
    """What a rule may touch: the graph module, metadata, parameter layout and the report."""

    def __init__(
        self,
        gm: fx.GraphModule,
        report: Report,
        params: ParamStore,
        device_type: str = "cpu",
        runs_eagerly: bool = False,
        for_inductor: bool = False,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.report = report
        self.params = params
        self.device_type = device_type
        self.runs_eagerly = runs_eagerly  # no later tracing: ops without fake kernels are fine
        self.for_inductor = for_inductor  # Inductor compiles the rewritten graph next
        self._modules: dict[str, nn.Module] = {}
        self._hooked: frozenset[str] | None = None
        self._caches: dict[Callable[[fx.Node], Any], NodeCache[Any]] = {}
        self._batching = False
        self._deferred: dict[fx.Node, dict[fx.Node, fx.Node]] = {}  # reader -> {old: new}
        self._deferred_nodes: set[fx.Node] = set()  # every old and new held back

    def cached(self, fn: Callable[[fx.Node], T]) -> NodeCache[T]:
        """A :class:`NodeCache` of ``fn`` that lives as long as this context (one run)."""
        cache = self._caches.get(fn)
        if cache is None:
            cache = self._caches[fn] = NodeCache(fn)
        return cache

    # -- lookups -----------------------------------------------------------------------------
    def module(self, node: fx.Node) -> nn.Module | None:
        """The module a ``call_module`` node calls, else None."""
        if node.op != "call_module":
            return None
        mod = self._modules.get(node.target)
        if mod is None:  # rules add submodules during a run but never replace one
            mod = self._modules[node.target] = self.gm.get_submodule(node.target)
        return mod

    def hooked_modules(self) -> frozenset[str]:
        """Paths of the submodules whose calls run hooks (rules leave those calls as written).

        Listed once per run: walking a few thousand modules for every rule and pass was a
        fifth of the search time on large graphs, and rules only add hook-free modules.
        """
        if self._hooked is None:
            self._hooked = hooked_paths(self.gm)
        return self._hooked

    def info(self, node: Any) -> meta.TensorInfo | None:
        ti = meta.info(node)
        return ti if isinstance(ti, meta.TensorInfo) else None

    # -- edits -------------------------------------------------------------------------------
    def call(
        self, target: Any, args: tuple = (), kwargs: dict | None = None, *, infer: bool = True
    ) -> fx.Node:
        """Create a ``call_function`` node at the current insert point, with metadata."""
        self.flush_replacements()
        node = self.graph.call_function(target, args, kwargs or {})
        if infer:
            meta.infer(self.gm, node)
        return node

    def call_method(
        self, name: str, args: tuple = (), kwargs: dict | None = None, *, infer: bool = True
    ) -> fx.Node:
        """Create a ``call_method`` node at the current insert point, with metadata."""
        self.flush_replacements()
        node = self.graph.call_method(name, args, kwargs or {})
        if infer:
            meta.infer(self.gm, node)
        return node

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """Route every use of ``old`` to ``new`` (metadata moves along if ``new`` has none).

        Inside :meth:`batched_replacements`, a replacement whose only reader is a node with
        many inputs may take effect later (see there).
        """
        if meta.info(new) is None and meta.info(old) is not None:
            meta.set_info(new, meta.info(old))
        if self._batching and self._defer(old, new):
            return
        self.flush_replacements()
        old.replace_all_uses_with(new)

    @contextlib.contextmanager
    def batched_replacements(self) -> Iterator[None]:
        """Rebuild each wide reader once for a whole fused set, not once per member.

        fx rebuilds a node's whole argument list for every input it reroutes, so replacing
        the N members read by one ``cat`` of N inputs one by one costs N^2. Within this
        block, a replacement whose ``old`` has exactly one reader, with at least
        :data:`WIDE_READER_INPUTS` inputs, and whose ``new`` has no reader yet (neither node
        being part of another held-back replacement) is recorded and applied when the block
        ends, or before anything else this context does: another replacement, a new node
        (:meth:`call`, :meth:`call_method`), :meth:`erase_if_dead`. Readers are rebuilt in
        the order they were last touched, so the graph (users' order included) ends up
        exactly as with one-by-one replacement. The driver wraps each
        :meth:`HorizontalRule.fuse` in it; rules replace the members one after the other and
        then call :meth:`erase_if_dead`, touching the graph in no other way in between.
        """
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            self.flush_replacements()

    def _defer(self, old: fx.Node, new: fx.Node) -> bool:
        """Record ``old -> new`` for :meth:`flush_replacements` if that is exact; see above."""
        if len(old.users) != 1 or new.users:
            return False
        if old in self._deferred_nodes or new in self._deferred_nodes:
            return False
        (reader,) = old.users
        pending = self._deferred.pop(reader, None)
        if pending is None:
            if len(reader.all_input_nodes) < WIDE_READER_INPUTS:
                return False
            pending = {}
        pending[old] = new
        self._deferred[reader] = pending  # (re)inserted last: readers flush in last-touch order
        self._deferred_nodes.update((old, new))
        return True

    def flush_replacements(self) -> None:
        """Apply the replacements :meth:`batched_replacements` has held back."""
        if not self._deferred:
            return
        deferred, self._deferred, self._deferred_nodes = self._deferred, {}, set()
        for reader, mapping in deferred.items():
            _reroute(reader, mapping)

    def erase_if_dead(self, nodes: Iterable[fx.Node]) -> None:
        """Erase nodes (and then their dead inputs) that no longer have users."""
        self.flush_replacements()
        work = list(nodes)
        while work:
            n = work.pop()
            if n.graph is not self.graph or n.users or n.op in ("placeholder", "output"):
                continue
            # An unread tuple element is never an effect (its producer stays); fx's
            # is_impure() costs a schema lookup per node, and most erased nodes are these.
            if n.op != "get_attr" and n.target is not operator.getitem and n.is_impure():
                continue
            inputs = n.all_input_nodes
            self.graph.erase_node(n)
            work.extend(inputs)


def _reroute(node: fx.Node, mapping: dict[fx.Node, fx.Node]) -> None:
    """Replace ``node``'s inputs per ``mapping`` with one rebuild of its arguments."""

    def swap(n: fx.Node) -> fx.Node:
        return mapping.get(n, n)

    node.args = fx.node.map_arg(node.args, swap)
    if node.kwargs:
        node.kwargs = fx.node.map_arg(node.kwargs, swap)


class Rule:
    """Base of every atomic rule; subclasses set ``name`` and ``family``."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    #: The nodes :meth:`LocalRule.match` / :meth:`HorizontalRule.key` can accept at all, as
    #: ``{op: targets}`` (a collection of targets, or None for any target of that op); None,
    #: the default, means every node. On a large graph most nodes are of no use to a given
    #: rule, and the driver calls match/key on these nodes only, so for every other node
    #: match/key must return None.
    candidates: ClassVar[Mapping[str, Collection[Any] | None] | None] = None

    def fired(self, ctx: RewriteContext, nodes: Sequence[fx.Node], detail: str = "") -> None:
        ctx.report.fired(self.name, self.family, list(nodes), detail)

    def refuse(self, ctx: RewriteContext, nodes: Sequence[fx.Node], reason: str) -> None:
        ctx.report.refused(self.name, list(nodes), reason)


class LocalRule(Rule):
    """Rewrites one node at a time."""

    def begin_sweep(self, ctx: RewriteContext) -> None:
        """Called by the driver before each sweep over the graph (for rules that keep state)."""

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        """Return a truthy match object if the rule applies to ``node``."""
        raise NotImplementedError

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        raise NotImplementedError


class HorizontalRule(Rule):
    """Fuses sets of parallel, independent nodes that share a key."""

    min_size: ClassVar[int] = 2
    max_size: ClassVar[int | None] = None
    # Memory-bound ops (norms, pointwise, the GEMMs feeding them): the cost model of
    # :mod:`fxrec.graph.cost` cuts their sets into chunks that stay in cache on a CPU.
    memory_bound: ClassVar[bool] = False

    def key(self, node: fx.Node, ctx: RewriteContext) -> Hashable | None:
        """The bucket key of a candidate, or None if ``node`` is not one."""
        raise NotImplementedError

    def refuse_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        """Why this set must not be fused (safety, cost model), or None to fuse it."""
        return None

    def partition(self, group: Sequence[fx.Node], ctx: RewriteContext) -> list[list[fx.Node]]:
        """The sets to fuse out of one independent set (each is refused or fused alone)."""
        if self.memory_bound:
            return chunks(group, ctx.device_type)
        return [list(group)]

    def cost_reason(self, group: Sequence[fx.Node], ctx: RewriteContext) -> str | None:
        """Why the device's cost model says fusing ``group`` would be slower, or None."""
        if self.memory_bound:
            return cache_reason(group, ctx.device_type)
        return None

    def fuse(self, group: Sequence[fx.Node], ctx: RewriteContext) -> None:
        """Replace the members by one fused computation (insert before ``group[-1]``)."""
        raise NotImplementedError


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator adding a rule to the default rule set."""
    if not cls.name:
        raise ValueError(f"rule {cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"two rules named {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def registered_rules() -> dict[str, type[Rule]]:
    """Every registered rule by name, in :data:`fxrec.passes.FAMILY_ORDER` (others last).

    Importing :mod:`fxrec.passes` registers the built-ins.
    """
    from fxrec.passes import FAMILY_ORDER

    rank = {f: i for i, f in enumerate(FAMILY_ORDER)}
    ordered = sorted(_REGISTRY.items(), key=lambda kv: rank.get(kv[1].family, len(rank)))
    return dict(ordered)


def exact(v: Any) -> Hashable:
    """``v`` as a key part that tells apart what compares equal but computes differently:
    ``1``, ``1.0`` and ``True`` (an int bound keeps an int result), ``0.0`` and ``-0.0``
    (``x / -0.0``)."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(exact(x) for x in v))
    return v


def same_device_and_dtype(infos: Sequence[meta.TensorInfo | None]) -> bool:
    """Horizontal fusion needs one dtype and one device across members."""
    if any(i is None for i in infos):
        return False
    return len({(i.dtype, i.device) for i in infos}) == 1  # type: ignore[union-attr]


def is_float(ti: meta.TensorInfo | None) -> bool:
    return ti is not None and ti.dtype.is_floating_point
