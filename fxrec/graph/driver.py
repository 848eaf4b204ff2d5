"""The driver: runs atomic rules over a graph until none of them changes anything.

One pass visits every rule once. Local rules see every node they can use (their
:attr:`~fxrec.graph.rule.Rule.candidates`); horizontal rules go through the two-step search
of :mod:`fxrec.graph.search` against one :class:`Reachability` index built at the start of
the pass. Nodes created during a pass are candidates from the next pass on, which is how
small rules chain into big fusions: LayerNorms fuse in pass 1, the tanhs that now read one
fused LayerNorm fuse in pass 2, the split/cat pair around them cancels in pass 3. A pass
whose local rules change nothing skips the horizontal rules when the last horizontal phase
found nothing on this same graph.

A pass costs time linear in the graph: per-node facts that survive a pass are cached for the
run (:meth:`RewriteContext.cached`), buckets too small for a set are dropped before any
dependency work, a fused set's wide readers are rebuilt once (not once per member), and the
topological sort after a pass moves only the nodes that must move.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Collection, Hashable, Sequence
from typing import Any

import torch.fx as fx

from fxrec.graph.effects import (
    _is_view,
    eliminate_dead_code,
    has_mode_switches,
    has_side_effects,
    hooked_paths,
    is_random,
    mode_regions,
    mutates_input,
    records_grad,
    written_targets,
)
from fxrec.graph.grad_history import GradHistory, History
from fxrec.graph.pieces import piece_of
from fxrec.graph.rule import HorizontalRule, LocalRule, RewriteContext, Rule
from fxrec.graph.search import Reachability, _is_ordered, independent_sets, stable_toposort

logger = logging.getLogger(__name__)

__all__ = ["run_rules"]

MAX_PASSES = 32
_NO_OP: Any = object()


def _candidates(
    rule: Rule, graph: fx.Graph, hooked: Collection[str] | None = None
) -> list[fx.Node]:
    """The nodes ``rule`` can use at all (:attr:`Rule.candidates`), in graph order; calls
    of modules with hooks are never candidates (:func:`~fxrec.graph.effects.has_hooks`).
    ``hooked``: the paths of those modules, when the caller has them
    (:meth:`RewriteContext.hooked_modules`)."""
    nodes = _spec_candidates(rule, graph)
    root = graph.owning_module
    if hooked is None:
        if root is None:
            return nodes
        hooked = hooked_paths(root)
    if not hooked:
        return nodes
    return [n for n in nodes if n.op != "call_module" or n.target not in hooked]


def _spec_candidates(rule: Rule, graph: fx.Graph) -> list[fx.Node]:
    """Candidates by :attr:`Rule.candidates`, in graph order.

    Read from FX's index of nodes by (op, target) where the spec names targets, so a rule
    about ``torch.cat`` does not visit every node of a 10,000-node graph each pass.
    """
    spec = rule.candidates
    if spec is None:
        return list(graph.nodes)
    indexed = _indexed(spec, graph)
    if indexed is not None:
        return indexed
    try:
        return [
            n
            for n in graph.nodes
            if (targets := spec.get(n.op, _NO_OP)) is not _NO_OP
            and (targets is None or n.target in targets)
        ]
    except TypeError:  # an unhashable target somewhere: let the rule look at those itself
        return [n for n in graph.nodes if n.op in spec and _may_be(spec[n.op], n.target)]


def _indexed(spec: Any, graph: fx.Graph) -> list[fx.Node] | None:
    """:func:`_candidates` through ``graph.find_nodes``; None where the index cannot answer."""
    find = getattr(graph, "find_nodes", None)
    if find is None or spec.get("call_function", _NO_OP) is None:
        return None  # any call_function: the index needs a target
    found: list[fx.Node] = []
    try:
        for op, targets in spec.items():
            if targets is None:
                found += find(op=op, sort=False)
            elif op == "call_function":
                for t in targets:
                    found += find(op=op, target=t, sort=False)
            else:
                found += [n for n in find(op=op, sort=False) if n.target in targets]
        return sorted(found)
    except TypeError:  # an unhashable target
        return None


def _may_be(targets: Collection[Any] | None, target: Any) -> bool:
    try:
        return targets is None or target in targets
    except TypeError:
        return True


def _run_local(rule: LocalRule, ctx: RewriteContext) -> bool:
    """One sweep of a local rule over the graph, in order; True if it rewrote anything."""
    changed = False
    rule.begin_sweep(ctx)
    for node in _candidates(rule, ctx.graph, ctx.hooked_modules()):
        if node.graph is not ctx.graph:  # erased by an earlier rewrite in this loop
            continue
        m = rule.match(node, ctx)
        if m:
            rule.rewrite(node, m, ctx)
            changed = True
    return changed


def _run_horizontal(
    rule: HorizontalRule, ctx: RewriteContext, reach: Reachability, history: GradHistory
) -> tuple[bool, bool]:
    """Returns (changed, deferred): deferred sets are retried on the next pass."""
    changed = deferred = False
    for members in _buckets(rule, ctx, reach).values():
        for group in independent_sets(members, reach, rule.max_size):
            if len(group) < rule.min_size:
                continue
            if any(n.graph is not ctx.graph for n in group):
                deferred = True
                continue
            if not reach.still_independent(group):
                deferred = True
                continue
            for same in _by_history(group, history, rule.min_size):
                for part in rule.partition(same, ctx):
                    if len(part) >= rule.min_size:
                        changed |= _refuse_or_fuse(rule, part, ctx, reach)
    return changed, deferred


def _by_history(group: list[fx.Node], history: GradHistory, min_size: int) -> list[list[fx.Node]]:
    """``group`` split by the autograd history its members' results can carry
    (:class:`~fxrec.graph.grad_history.GradHistory`), sets smaller than ``min_size`` dropped.

    A fused result records history if any member's does: a member without any (a
    ``.detach()``-ed branch) would come back with a ``grad_fn`` where PyTorch gives none.
    """
    kinds: dict[History, list[fx.Node]] = {}
    for n in group:
        kinds.setdefault(history(n), []).append(n)
    if len(kinds) == 1:
        return [group]
    return [same for same in kinds.values() if len(same) >= min_size]


def _refuse_or_fuse(
    rule: HorizontalRule, part: list[fx.Node], ctx: RewriteContext, reach: Reachability
) -> bool:
    """Fuse ``part`` unless the driver or the rule refuses it; True if it was fused."""
    reason = (
        _effect_between(part, reach, ctx)
        or _piece_cut_from_grad(part)
        or rule.cost_reason(part, ctx)
        or rule.refuse_reason(part, ctx)
    )
    if reason is not None:
        rule.refuse(ctx, part, reason)
        return False
    last = max(part, key=reach.index.__getitem__)
    with ctx.graph.inserting_before(last), ctx.batched_replacements():
        rule.fuse(part, ctx)
    reach.merge(part)
    return True


def _effect_between(
    part: Sequence[fx.Node], reach: Reachability, ctx: RewriteContext
) -> str | None:
    """Why the fused node may not go where the last member is.

    A random draw between the members that does not depend on them would then run before
    reads of the earlier members' results that now wait for the fused node (or after draws
    they make). An in-place write between them, whatever it depends on, may write what a
    later member reads (``t.add_(a)`` before ``tanh(t)``): the fused node would read it
    before the write, or a write that reads an earlier member would move after the reads of
    its target that follow it. Only a write to module state that nothing else between the
    members reads (BatchNorm's ``num_batches_tracked.add_(1)``) may stay between them.
    """
    effects = reach.effect_positions(ctx.cached(_reorders_badly))
    if not effects:
        return None
    idx = [reach.index[n] for n in part]
    lo, hi = min(idx), max(idx)
    members = reach.mask(part)
    for pos in effects[bisect.bisect_right(effects, lo) : bisect.bisect_left(effects, hi)]:
        node = reach.nodes[pos]
        if mutates_input(node):
            if reach.ancestors[pos] & members or _state_read_between(node, lo, hi, reach):
                return "a tensor written in place between the members"
        elif not reach.ancestors[pos] & members:
            return "a random draw lies between the members"
    return None


def _state_read_between(write: fx.Node, lo: int, hi: int, reach: Reachability) -> bool:
    """Unless ``write`` writes only module state (``get_attr``s): True. Else, does any node
    from the first member to the last (members too) but the write read that state, directly
    or through a view of it? Such a read may move past the write or read it too late. A
    region may write several (a BatchNorm's running mean and variance): each counts."""
    targets = written_targets(write)
    return not targets or any(_read_between(write, t, lo, hi, reach) for t in targets)


def _read_between(write: fx.Node, target: Any, lo: int, hi: int, reach: Reachability) -> bool:
    """:func:`_state_read_between` for one tensor ``write`` writes."""
    if not (isinstance(target, fx.Node) and target.op == "get_attr"):
        return True
    work = [n for n in write.graph.find_nodes(op="get_attr") if n.target == target.target]
    seen = set(work)
    while work:
        for u in work.pop().users:
            if u is write or u in seen:
                continue
            seen.add(u)
            if _is_view(u):
                work.append(u)
                continue
            i = reach.index.get(u)
            if i is None or lo <= i <= hi:
                return True
    return False


def _piece_cut_from_grad(part: Sequence[fx.Node]) -> str | None:
    """Why the members may not read their inputs' base: a member recorded by autograd reads a
    piece split off under ``no_grad``. Rules read consecutive pieces as (a view of) the split's
    input, which would pass the gradient the model cut there."""
    if not has_mode_switches(part[0].graph):
        return None
    for n in part:
        if not records_grad(n):
            continue
        for x in n.all_input_nodes:
            p = piece_of(x)
            if p is not None and not records_grad(p.source):
                return "a member reads a piece split off under no_grad"
    return None


def _reorders_badly(node: fx.Node) -> bool:
    """A random draw or an in-place write (see :func:`_effect_between`)."""
    return is_random(node) or mutates_input(node)


def _buckets(
    rule: HorizontalRule, ctx: RewriteContext, reach: Reachability
) -> dict[Hashable, list[fx.Node]]:
    """Step 1 of the search over the nodes indexed at the start of the pass.

    Buckets too small to hold a set are dropped here, before any dependency work.
    """
    key, index = rule.key, reach.index
    # No fusion across a grad-mode or autocast switch, even between stretches of one mode:
    # readers of earlier members move after the fused node, never across a switch.
    regions = mode_regions(ctx.graph, stretches=True)
    out: dict[Hashable, list[fx.Node]] = {}
    for n in _candidates(rule, ctx.graph, ctx.hooked_modules()):
        if n in index:
            k = key(n, ctx)
            if k is not None and regions is not None:
                k = (regions.get(n), k)
            if k is not None:
                members = out.get(k)
                if members is None:
                    out[k] = [n]
                else:
                    members.append(n)
    return {k: ms for k, ms in out.items() if len(ms) >= rule.min_size}


def _grad_history(ctx: RewriteContext, reach: Reachability) -> GradHistory:
    """The run's :class:`GradHistory`, given the in-place writes among the nodes
    :func:`_effect_between` looks at (random draws and writes: found once per pass)."""
    effects = reach.effect_positions(ctx.cached(_reorders_badly))
    writers = [n for n in (reach.nodes[i] for i in effects) if mutates_input(n)]
    return GradHistory(ctx.graph, writers, ctx.module)


def run_rules(ctx: RewriteContext, rules: Sequence[Rule]) -> int:
    """Apply ``rules`` to ``ctx.gm`` until a fixed point; returns the number of passes.

    The graph is left dead-code-free but not linted or recompiled: the caller does that.
    """
    t0 = time.perf_counter()
    graph = ctx.graph
    passes = 0
    horizontal = [r for r in rules if isinstance(r, HorizontalRule)]
    # True while the graph is the one the last horizontal phase left untouched (it fused and
    # deferred nothing): running the horizontal rules again would find nothing either.
    settled = False
    history: GradHistory | None = None
    for passes in range(1, MAX_PASSES + 1):  # noqa: B007
        changed = False
        for rule in rules:
            if isinstance(rule, LocalRule):
                changed |= _run_local(rule, ctx)
        if horizontal and not (settled and not changed):
            reach = Reachability(graph)
            if history is None:  # the writes rules add (BatchNorm counters) carry none
                history = _grad_history(ctx, reach)
            fused = deferred = False
            for rule in horizontal:
                c, d = _run_horizontal(rule, ctx, reach, history)
                fused |= c
                deferred |= d
            if fused:
                stable_toposort(graph, ctx.cached(_is_ordered))
            settled = not (fused or deferred)
            changed |= not settled
        if not changed:
            break
    else:
        ctx.report.notes.append(f"stopped after {MAX_PASSES} passes without reaching a fixed point")
    # has_side_effects: the nodes dead-code elimination must keep although nothing reads them.
    eliminate_dead_code(graph, ctx.cached(has_side_effects))
    # No lint/recompile here: the caller (optimize_graph) does both once, after the passes.
    ctx.report.passes = max(ctx.report.passes, passes)
    logger.debug(
        "rules reached a fixed point in %d passes, %.1f ms",
        passes,
        (time.perf_counter() - t0) * 1e3,
    )
    return passes
