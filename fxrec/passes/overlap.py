"""Overlap communication with computation (seed 000, §3.3): reorder requests and waits.

Every collective in the graph is a *request* node (starts it, returns at once) and a *wait*
node (blocks until the data is there). The rule reorders the graph so that

* each request is issued as early as its inputs allow: the request and its whole input cone
  (the ids' preprocessing, the lookups feeding an output all-to-all) are scheduled before
  any node that does not feed a request. Models written in the wrong order (the dense tower
  before the sparse lookup, as TorchRec's DLRM does) get fixed by the same move;
* each wait is sunk to just before its first use: compute that does not depend on it (the
  dense arch, another collection's lookup) runs in between. A wait whose result feeds a later
  request (the ids all-to-all feeding the lookup feeding the pooled all-to-all) is on that
  request's cone and is not sunk: independent compute then fills the window of the last
  collective of the chain.

Guarantees. Only the order of nodes changes: no node is added, removed or rewritten, so
outputs and gradients are those of the original graph, bit for bit. Data dependencies are
kept, and so is the relative order of side-effecting nodes (collectives among themselves,
mutations, RNG draws, stateful modules), except that a collective may pass a random op (they
share no state). Every rank runs the same deterministic schedule on the same graph, so
collectives are issued in the same order everywhere.

Memory bound. Moving a node earlier extends the lifetime of its output. The rule sums the
output bytes (from metadata) of every node it moves ahead of a node that used to precede
it; if that exceeds ``max_extra_bytes`` (default 256 MiB, per graph) it leaves the graph as
it was and says so in the report. Only the cones of requests are hoisted, never unrelated
producers, so the bound is usually the dense activations that now wait for the embeddings.

Recognised collectives: ``torch.ops._c10d_functional.*`` (+ ``wait_tensor``; symbolic
tracing, dynamo and Inductor keep them as separate nodes) and functions tagged
``_fxrec_comm = "request" | "wait"`` (fxrec's data-dependent ids all-to-all,
:mod:`fxrec.distributed.dist_ops`). The rule is opt-in: ``rules=[..., "overlap_comm"]``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.fx as fx

from fxrec.graph import meta
from fxrec.graph.effects import has_side_effects, mutates_input
from fxrec.graph.rule import LocalRule, RewriteContext, register

logger = logging.getLogger(__name__)

__all__ = ["OverlapComm", "comm_kind", "schedule"]

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


def _is_effect(node: fx.Node) -> bool:
    return node.op not in ("placeholder", "output", "get_attr") and (
        has_side_effects(node) or comm_kind(node) == "request"
    )


def _private_effect(node: fx.Node) -> bool:
    """An effect on state no collective touches: an RNG draw, a module's running statistics."""
    return not (node.is_impure() or mutates_input(node) or comm_kind(node) is not None)


def _commute(a: fx.Node, b: fx.Node) -> bool:
    """May two side-effecting nodes swap? Only a collective and a private effect."""
    ca, cb = comm_kind(a) is not None, comm_kind(b) is not None
    return (ca and _private_effect(b)) or (cb and _private_effect(a))


def _dependencies(nodes: Sequence[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    deps: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    effects = [n for n in nodes if _is_effect(n)]
    for i, b in enumerate(effects):
        for a in effects[:i]:
            if not _commute(a, b):
                deps[b].add(a)
    # The output and placeholders stay where they are.
    out = [n for n in nodes if n.op == "output"]
    for o in out:
        deps[o] |= {n for n in nodes if n is not o}
    return deps


def _ancestors_of(roots: Sequence[fx.Node], deps: dict[fx.Node, set[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(deps[n])
    return seen


def schedule(graph: fx.Graph) -> list[fx.Node] | None:
    """The overlapped order of ``graph``'s nodes, or None if it has no collective.

    List scheduling with three priority classes, ties broken by the current position:
    0 = placeholders and the cones of requests (issue them first), 1 = everything else,
    2 = waits that feed no request (as late as their users allow). Applying it to its own
    result gives the same order (the rule reaches a fixed point at once).
    """
    nodes = list(graph.nodes)
    requests = [n for n in nodes if comm_kind(n) == "request"]
    if not requests:
        return None
    pos = {n: i for i, n in enumerate(nodes)}
    deps = _dependencies(nodes)
    urgent = _ancestors_of(requests, deps)
    cls: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder" or n in urgent:
            cls[n] = 0
        elif comm_kind(n) == "wait":
            cls[n] = 2
        else:
            cls[n] = 1
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    indeg = {n: len(d) for n, d in deps.items()}
    for n, d in deps.items():
        for m in d:
            users[m].append(n)
    heap = [(cls[n], pos[n], n.name, n) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    order: list[fx.Node] = []
    while heap:
        *_, n = heapq.heappop(heap)
        order.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (cls[u], pos[u], u.name, u))
    if len(order) != len(nodes):
        raise RuntimeError("fxrec overlap: dependency cycle while scheduling (a bug)")
    return order


def _bytes(node: fx.Node) -> int:
    ti = meta.info(node)
    total = 0
    stack = [ti]
    while stack:
        x = stack.pop()
        if isinstance(x, meta.TensorInfo):
            total += x.numel() * (torch.empty((), dtype=x.dtype).element_size())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def moved_ahead(old: Sequence[fx.Node], new: Sequence[fx.Node]) -> list[fx.Node]:
    """Nodes placed before some node that used to precede them (their outputs live longer)."""
    new_pos = {n: i for i, n in enumerate(new)}
    out: list[fx.Node] = []
    latest = -1  # the largest new position among nodes seen so far in the old order
    for n in old:
        p = new_pos[n]
        if p < latest:
            out.append(n)
        latest = max(latest, p)
    return out


def _apply(graph: fx.Graph, order: Sequence[fx.Node]) -> None:
    nodes = list(graph.nodes)
    cursor = order[0]
    if cursor is not nodes[0]:
        nodes[0].prepend(cursor)
    for n in order[1:]:
        if cursor.next is not n:
            cursor.append(n)
        cursor = n


@register
class OverlapComm(LocalRule):
    """Issue collectives early, wait late, run independent compute in between."""

    name: ClassVar[str] = "overlap_comm"
    family: ClassVar[str] = "overlap"
    opt_in: ClassVar[bool] = True
    max_extra_bytes: int = 256 << 20

    def __init__(self, max_extra_bytes: int | None = None) -> None:
        if max_extra_bytes is not None:
            self.max_extra_bytes = int(max_extra_bytes)

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        # One decision per graph: made when the driver reaches the output node.
        if node.op != "output":
            return None
        old = list(ctx.graph.nodes)
        order = schedule(ctx.graph)
        if order is None or order == old:
            return None
        moved = moved_ahead(old, order)
        extra = sum(_bytes(n) for n in moved)
        requests = [n for n in old if comm_kind(n) == "request"]
        if extra > self.max_extra_bytes:
            key = "overlap_refused"
            if ctx.gm.meta.get(key) != len(old):  # report once per graph, not every pass
                ctx.gm.meta[key] = len(old)
                self.refuse(
                    ctx,
                    requests,
                    f"reordering would keep {extra / 2**20:.1f} MiB of outputs alive longer "
                    f"(limit {self.max_extra_bytes / 2**20:.1f} MiB: OverlapComm(max_extra_bytes=...))",
                )
            return None
        return order, old, moved, requests

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        order, old, moved, requests = match
        _apply(ctx.graph, order)
        waits = [n for n in old if comm_kind(n) == "wait"]
        new_pos = {n: i for i, n in enumerate(order)}
        window = sum(
            max(0, new_pos[w] - new_pos[r] - 1)
            for w in waits
            for r in w.all_input_nodes
            if comm_kind(r) == "request"
        )
        self.fired(
            ctx,
            requests + waits,
            f"{len(requests)} requests raised, {len(waits)} waits sunk, {len(moved)} nodes "
            f"moved ahead, {window} nodes between requests and their waits",
        )
