"""Optimize one captured graph: the part every entry point shares.

``fxrec.optimize`` (symbolic traces), ``fxrec.compile_backend`` (dynamo graphs) and the
Inductor pre-grad pass all end up here.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import operator
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from fxrec.graph import meta
from fxrec.graph.capture import opaque_modules_note
from fxrec.graph.driver import run_rules
from fxrec.graph.params import FusedParameters, ParamStore
from fxrec.graph.report import Report
from fxrec.graph.rule import RewriteContext, Rule, registered_rules

logger = logging.getLogger(__name__)

__all__ = ["resolve_rules", "optimize_graph", "strict_mode"]

RuleSpec = Iterable["str | Rule | type[Rule]"] | None


def strict_mode() -> bool:
    """In strict mode (``FXREC_STRICT=1``, used by the tests) a failing rule raises."""
    return os.environ.get("FXREC_STRICT", "0") not in ("", "0")


DEFAULT = "default"


def resolve_rules(rules: RuleSpec = None, exclude: Iterable[str] = ()) -> list[Rule]:
    """Rule instances from names, classes or instances (default: every registered rule that
    is not opt-in). The name ``"default"`` stands for those, so that opt-in rules can be
    added to them: ``["default", "overlap_comm"]``."""
    registry = registered_rules()
    defaults = [r for r in registry.values() if not getattr(r, "opt_in", False)]
    chosen: list[str | Rule | type[Rule]] = []
    for r in [DEFAULT] if rules is None else list(rules):
        if r == DEFAULT:
            chosen += [d for d in defaults if d not in chosen]
        elif r not in chosen:
            chosen.append(r)
    out: list[Rule] = []
    for r in chosen:
        if isinstance(r, str):
            if r not in registry:
                raise ValueError(
                    f"unknown rule {r!r}; known rules: {', '.join(sorted(registry))} "
                    f"({DEFAULT!r} for every rule that is not opt-in)"
                )
            r = registry[r]
        inst = r() if isinstance(r, type) else r
        if inst.name not in exclude:
            out.append(inst)
    return out


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection while a graph is optimized.

    Rewrites allocate many small, mostly long-lived objects (nodes, metadata) while a large
    graph and the model are alive; the automatic collections they trigger walk all of it
    (a full one takes tenths of a second at 10,000 nodes), so collection time grew with graph
    size times the number of passes. Collection resumes as usual afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _symbolic_inputs(gm: fx.GraphModule) -> bool:
    """Does a graph input have a symbolic size (dynamo's dynamic shapes)?"""
    for node in gm.graph.find_nodes(op="placeholder"):
        ti = meta.info(node)
        if isinstance(ti, meta.TensorInfo) and not ti.static:
            return True
    return False


def optimize_graph(
    gm: fx.GraphModule,
    rules: Sequence[Rule],
    *,
    owner: FusedParameters | None = None,
    report: Report | None = None,
    device_type: str = "cpu",
    runs_eagerly: bool = False,
    for_inductor: bool = False,
    specialized_later: bool = False,
) -> Report:
    """Run ``rules`` on ``gm`` in place to a fixed point; return the report.

    ``runs_eagerly``: the rewritten graph is run as is, never traced again (by AOTAutograd,
    Inductor or export), so rules may use ops that only have real kernels (fbgemm's CPU
    table-batched lookup has no fake one). ``for_inductor``: Inductor compiles the
    rewritten graph next (its pre-grad pass, or an Inductor inner backend); the cost model of
    :mod:`fxrec.graph.cost` weighs copies and batched GEMMs differently there.

    On an unexpected error the graph is left as it was captured (unless strict mode is on),
    and the report says what failed: optimizing never crashes a model it does not understand.
    ``report.seconds`` grows by the time of the rule passes (search and rewrites, to the
    fixed point); the snapshot, lint and recompile around them are not part of it.
    ``specialized_later``: a graph with symbolic sizes whose caller optimizes a copy per
    concrete signature too (no note that symbolic sizes stay unfused).
    """
    report = report if report is not None else Report()
    t0 = time.perf_counter()
    before = len(gm.graph.nodes)
    with _gc_paused():
        passes_s = _optimize_in_place(
            gm, rules, owner, report, device_type, runs_eagerly, for_inductor
        )
    report.nodes_before += before
    report.nodes_after += len(gm.graph.nodes)
    opaque = opaque_modules_note(gm)
    if opaque:
        report.note(opaque)
    if not specialized_later and _symbolic_inputs(gm):
        note = (
            "dynamic shapes: rules need static sizes, so graphs with symbolic ones are left "
            "as written (compile with dynamic=False to let fxrec fuse)"
        )
        report.note(note)
    report.seconds += passes_s
    logger.debug(
        "optimize_graph: %.1f ms, of which %.1f ms in the rule passes",
        (time.perf_counter() - t0) * 1e3,
        passes_s * 1e3,
    )
    return report


def _optimize_in_place(
    gm: fx.GraphModule,
    rules: Sequence[Rule],
    owner: FusedParameters | None,
    report: Report,
    device_type: str,
    runs_eagerly: bool,
    for_inductor: bool,
) -> float:
    """:func:`optimize_graph`'s work: rules, then lint and recompile; the backup on failure.

    Returns the seconds spent in the rule passes.
    """
    backup = _Snapshot(gm.graph)
    params = ParamStore(gm, owner)
    ctx = RewriteContext(gm, report, params, device_type, runs_eagerly, for_inductor)
    meta.stamp_program_order(gm.graph)
    mark = report.mark()
    t0 = time.perf_counter()
    try:
        try:
            run_rules(ctx, rules)
        finally:
            passes_s = time.perf_counter() - t0
        _dense_outputs(gm, backup.nodes())
        params.rebind()
        gm.graph.lint()
        gm.recompile()
    except Exception as exc:
        if strict_mode():
            raise
        logger.warning(
            "fxrec: a rule failed (%s: %s); keeping this graph unoptimized", type(exc).__name__, exc
        )
        undone = report.undo(mark)
        report.notes.append(
            f"graph left unoptimized: {type(exc).__name__}: {exc} ({undone} rewrites undone)"
        )
        gm.graph = backup.restore()
        params.rebind()
        gm.recompile()
    return passes_s


def _dense_outputs(gm: fx.GraphModule, before: set[fx.Node]) -> None:
    """Return dense tensors where the rules made the graph return pieces of a fused result.

    A fused op's members are strided views of its result (``out[:, 4:8]``); the model
    returned each as a tensor of its own, which a caller may ``.view()`` (the piece cannot).
    Returned pieces are made contiguous: ``contiguous()`` copies a piece only if it is not
    dense already, and two or more pieces unbound from one result take one copy between them
    (the result with the unbound dim moved first, unbound again).
    """
    graph = gm.graph
    out = graph.output_node()
    returned: dict[fx.Node, None] = {}
    map_arg(out.args, lambda a: returned.setdefault(a))
    new = [a for a in returned if a not in before and isinstance(meta.info(a), meta.TensorInfo)]
    by_unbind: dict[fx.Node, list[fx.Node]] = {}
    for a in new:
        src = a.args[0] if a.target is operator.getitem else None
        if isinstance(src, fx.Node) and src not in before and src.target is torch.unbind:
            by_unbind.setdefault(src, []).append(a)
    dense: dict[fx.Node, fx.Node] = {}

    def add(op: str, target: Any, args: tuple) -> fx.Node:
        with graph.inserting_before(out):
            node = graph.create_node(op, target, args)
        meta.infer(gm, node)
        return node

    for src, pieces in by_unbind.items():
        base, dim = src.args[0], src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
        if len(pieces) < 2 or dim == 0:
            continue
        moved = add("call_method", "contiguous", (add("call_method", "movedim", (base, dim, 0)),))
        again = add("call_function", torch.unbind, (moved, 0))
        for p in pieces:
            dense[p] = add("call_function", operator.getitem, (again, p.args[1]))
    for a in new:
        if a not in dense:
            dense[a] = add("call_method", "contiguous", (a,))
    out.args = map_arg(out.args, lambda a: dense.get(a, a))
    for src, pieces in by_unbind.items():
        for p in pieces:
            if not p.users:
                graph.erase_node(p)
        if not src.users:
            graph.erase_node(src)


class _Snapshot:
    """The graph as it was before the rules ran, to restore if one of them fails.

    Recording each node's fields is a small fraction of the cost of copying the graph (about
    a tenth of a second per 10,000 nodes), and the copy is only needed on failure. Rules
    never change a node's args tuple or kwargs dict in place (fx replaces them, and its lists
    are immutable), and the metadata dict is copied, so the record is the node as it was.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self._nodes = [
            (n, n.op, n.target, n.args, n.kwargs, n.name, n.type, copy.copy(n.meta))
            for n in graph.nodes
        ]

    def nodes(self) -> set[fx.Node]:
        """The nodes of the graph as it was."""
        return {n for n, *_ in self._nodes}

    def restore(self) -> fx.Graph:
        """A new graph equal to ``Graph.graph_copy`` of the recorded one, plus its output."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        out: Any = None
        for node, op, target, args, kwargs, name, type_expr, node_meta in self._nodes:
            if op == "output":
                out = map_arg(args[0], env.__getitem__)
                break
            new = graph.create_node(
                op,
                target,
                map_arg(args, env.__getitem__),
                map_arg(kwargs, env.__getitem__),
                name,
                type_expr,
            )
            new.meta = copy.copy(node_meta)
            env[node] = new
        graph.output(out)
        return graph
