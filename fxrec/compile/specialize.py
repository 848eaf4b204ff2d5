"""Graphs with symbolic sizes, optimized once per concrete input signature.

With ``torch.compile``'s default ``dynamic=None``, one call of another size (the smaller last
batch of an epoch) makes dynamo compile a graph with a symbolic batch size, and that graph
then serves every later call, full batches included. Rules decide on static sizes, so such a
graph would stay unfused for the rest of training (and every graph of ``dynamic=True``).

A graph's sizes are functions of the symbols its inputs bind (``s0`` for the batch of ``x``).
So the backend returns a :class:`Specialized` callable: each new set of those symbols' values
(one batch size, say) gets a copy of the graph whose metadata has the values substituted,
optimized with static sizes, and handed to the inner backend on that call's real inputs
(where that compiles, on the signature's second call: a size seen once compiles nothing).
Nothing runs to get the metadata (no extra forward, no side effects), and dynamo's guards
on the symbolic graph still hold for every copy. Past :data:`MAX_SIGNATURES` signatures the
graph with symbolic sizes (optimized as far as it goes) serves the others.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg

from fxrec.graph import meta
from fxrec.graph.optimize_graph import strict_mode
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_SIGNATURES",
    "SizeSymbols",
    "Specialized",
    "drop_example_values",
    "specialized_copy",
]

MAX_SIGNATURES = 8
_SEEN = 256  # signatures whose calls are counted (see :class:`Specialized`)

# Where a symbol's value is read from a call's inputs: (input position, what, dim).
_Binder = tuple[int, str, int]


def _expr(s: Any) -> Any:
    """The sympy expression of a symbolic int (None for a plain int)."""
    node = getattr(s, "node", None)
    return getattr(node, "expr", None)


def _unspecialized_float(ph: fx.Node, v: Any) -> bool:
    """A float dynamo passes as a 0-d tensor that the graph only reads with ``.item()``
    (``dynamic=True`` does so with float attributes, a LayerNorm's ``eps``)."""
    return (
        isinstance(v, torch.Tensor)
        and v.ndim == 0
        and v.dtype is torch.float64
        and v.device.type == "cpu"  # read every call: no device sync
        and bool(ph.users)
        and all(u.op == "call_method" and u.target == "item" for u in ph.users)
    )


class SizeSymbols:
    """The symbols a graph's inputs bind, and how to read their values from a call.

    ``scalars``: positions of unspecialized floats, whose values are part of a signature
    too: a copy reads them as constants (rules fuse only members with equal constants).
    """

    def __init__(
        self, binders: list[_Binder], symbols: list[sympy.Symbol], scalars: list[int]
    ) -> None:
        self.binders = binders
        self.symbols = symbols
        self.scalars = scalars

    @classmethod
    def of(cls, gm: fx.GraphModule) -> SizeSymbols | None:
        """The graph's input symbols; None when it has none, or when an input size is an
        expression no input binds (then the sizes of a call do not determine the graph's)."""
        binders: list[_Binder] = []
        symbols: list[sympy.Symbol] = []
        scalars: list[int] = []
        needed: set[sympy.Symbol] = set()

        def bind(expr: Any, where: _Binder) -> None:
            if expr is None:
                return
            if isinstance(expr, sympy.Symbol) and expr not in symbols:
                symbols.append(expr)
                binders.append(where)
            needed.update(expr.free_symbols)

        for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
            v = ph.meta.get("example_value", ph.meta.get("val"))
            if isinstance(v, torch.SymInt):
                bind(_expr(v), (i, "int", 0))
            elif _unspecialized_float(ph, v):
                scalars.append(i)
            elif isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    bind(_expr(s), (i, "size", d))
                for d, s in enumerate(v.stride()):
                    bind(_expr(s), (i, "stride", d))
            elif isinstance(v, (torch.SymFloat, torch.SymBool)):
                return None
        if not symbols or not needed <= set(symbols):
            return None
        return cls(binders, symbols, scalars)

    def values(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The symbols' values in a call, then the floats': the key of its signature."""
        out: list[Any] = []
        for i, what, d in self.binders:
            a = args[i]
            out.append(int(a) if what == "int" else a.size(d) if what == "size" else a.stride(d))
        out += [args[i].item() for i in self.scalars]
        return tuple(out)

    def bindings(self, values: tuple[Any, ...]) -> dict[sympy.Symbol, sympy.Integer]:
        return {s: sympy.Integer(v) for s, v in zip(self.symbols, values)}

    def constants(
        self, placeholders: list[fx.Node], values: tuple[Any, ...]
    ) -> list[tuple[fx.Node, Any]]:
        """The nodes a copy for ``values`` reads as constants, each with its value: the
        symbolic int inputs, and the ``.item()`` of each unspecialized float."""
        out = [
            (placeholders[i], v) for (i, what, _), v in zip(self.binders, values) if what == "int"
        ]
        for i, v in zip(self.scalars, values[len(self.binders) :]):
            out += [(u, v) for u in placeholders[i].users]
        return out


def _size(s: Any, bindings: dict[sympy.Symbol, sympy.Integer]) -> Any:
    """A size with the bound symbols' values substituted: an int, or a token as
    :class:`~fxrec.graph.meta.TensorInfo` keeps a symbolic size (an unbacked one stays)."""
    expr = _expr(s)
    if expr is None:
        return s
    v = expr.xreplace(bindings)
    return int(v) if getattr(v, "is_Integer", False) else str(v)


def _concrete(value: Any, bindings: dict[sympy.Symbol, sympy.Integer]) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            shape = tuple(_size(s, bindings) for s in x.shape)
            return meta.TensorInfo(shape, x.dtype, x.device, bool(x.requires_grad))
        if isinstance(x, torch.SymInt):
            return _size(x, bindings)
        return x

    return map_aggregate(value, one)


def specialized_copy(
    graph: fx.Graph,
    root: fx.GraphModule,
    symbols: SizeSymbols,
    values: tuple[Any, ...],
) -> fx.GraphModule:
    """A copy of the graph whose metadata has static sizes for the symbols' ``values``.

    Symbolic int inputs and unspecialized floats are replaced in their uses by their values
    (they stay inputs: the caller passes them). Dynamo's symbolic ``example_value`` stays on the nodes (rules read
    it for what is not a size); :func:`drop_example_values` removes it.
    """
    graph = copy.deepcopy(graph)
    bindings = symbols.bindings(values)
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node, value in symbols.constants(placeholders, values):
        for user in list(node.users):
            user.args = map_arg(user.args, lambda a, n=node, v=value: v if a is n else a)
            user.kwargs = map_arg(user.kwargs, lambda a, n=node, v=value: v if a is n else a)
        if node.op != "placeholder":
            graph.erase_node(node)
    for node in graph.nodes:
        v = node.meta.get("example_value", node.meta.get("val"))
        node.meta.pop("fxrec_info", None)
        if v is not None:
            node.meta["fxrec_info"] = _concrete(v, bindings)
    return fx.GraphModule(root, graph, root.__class__.__name__)


def drop_example_values(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without dynamo's symbolic values: an inner backend compiling a specialized copy
    on real inputs then sees a plain static graph, not values of another fake mode."""
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)
        node.meta.pop("val", None)
    return gm


class Specialized:
    """A graph with symbolic sizes, run as a copy built for each input signature.

    ``build(copy, args)`` optimizes a copy made by :func:`specialized_copy` and returns what
    runs it (the inner backend's result, which may compile on these real inputs). A copy is
    built on the ``build_on``-th call of its signature (earlier ones run ``fallback``, the
    graph with symbolic sizes): 2 where building compiles, so that sizes seen once (a
    jagged input's lengths) cost no compile. At most ``limit`` (default
    :data:`MAX_SIGNATURES`) copies are built; later signatures run ``fallback``. The counts
    of signatures seen are kept for the last :data:`_SEEN` only (a jagged input's number of
    ids makes most signatures one-offs).
    """

    def __init__(
        self,
        graph: fx.Graph,
        root: fx.GraphModule,
        symbols: SizeSymbols,
        build: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
        fallback: Callable[..., Any],
        report: Report,
        limit: int | None = None,
        build_on: int = 1,
    ) -> None:
        self.graph = graph
        self.root = root
        self.symbols = symbols
        self.build = build
        self.fallback = fallback
        self.report = report
        self.limit = MAX_SIGNATURES if limit is None else limit
        self.build_on = build_on
        self.runners: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.calls: dict[tuple[Any, ...], int] = {}  # signatures seen, and how often
        self.failed = False  # a copy failed to build: the graph runs with symbolic sizes

    def __call__(self, *args: Any) -> Any:
        key = self.symbols.values(args)
        runner = self.runners.get(key)
        if runner is None:
            runner = self._runner(key, list(args))
        return runner(*args)

    def _runner(self, key: tuple[Any, ...], args: list[Any]) -> Callable[..., Any]:
        if self.failed:
            return self.fallback
        if len(self.runners) >= self.limit:
            note = (
                f"dynamic shapes: a graph ran with more than {self.limit} sets of sizes; copies "
                "were built for the first sets seen again, the others run it with symbolic "
                "sizes, which rules leave unfused"
            )
            if note not in self.report.notes:
                logger.info("fxrec: %s", note)
                self.report.note(note)
            return self.fallback
        self.calls[key] = self.calls.pop(key, 0) + 1  # (re)inserted last: the most recent
        if len(self.calls) > _SEEN:
            del self.calls[next(iter(self.calls))]
        if self.calls[key] < self.build_on:
            return self.fallback
        sizes = ", ".join(f"{s}={v}" for s, v in zip(self.symbols.symbols, key))
        logger.debug("fxrec: optimizing a graph with symbolic sizes for %s", sizes)
        try:
            gm = specialized_copy(self.graph, self.root, self.symbols, key)
            runner = self.build(gm, args)
        except Exception as exc:  # the graph with symbolic sizes still runs these inputs
            if strict_mode():
                raise
            logger.warning(
                "fxrec: a graph specialized for %s failed to build (%s: %s); running it with "
                "symbolic sizes",
                sizes,
                type(exc).__name__,
                exc,
            )
            self.report.note(f"specializing a graph failed: {type(exc).__name__}: {exc}"[:200])
            self.failed = True  # the other signatures' copies would fail alike: not retried
            runner = self.fallback
        self.runners[key] = runner
        return runner
