"""Overlap communication with computation (seed 000, §3.3): reorder requests and waits.

Every collective in the graph is a *request* node (starts it, returns at once) and a *wait*
node (blocks until the data is there). The rule reorders the graph so that

* each request is issued as early as its inputs allow: the request and its whole input cone
  (the ids' preprocessing, the lookups feeding an output all-to-all) are scheduled before
  any node that does not feed a request. Models written in the wrong order (the dense tower
  before the sparse lookup, as TorchRec's DLRM does: its arches are traced through, so a
  collection sharded inside its ``SparseArch`` is in the graph) get fixed by the same move;
* each wait comes as late as it can, with independent compute (the dense arch, another
  collection's lookup) before it. Collectives often form a chain, request -> wait ->
  request -> wait (the id counts give the split sizes of the ids all-to-all, whose ids feed
  the lookup feeding the pooled all-to-all): a wait on the cone of a later request is only
  deferred, not sunk, and independent compute is shared among the chain's windows so that
  each exchange is hidden, not only the last. Each window of the chain gets an equal share
  of the compute runnable when it opens (by a rough per-row cost, :func:`compute_cost`); a
  wait that feeds no request (the end of a chain) is sunk to just before its first use and
  its window takes the rest.

Guarantees. Only the order of nodes changes: no node is added, removed or rewritten, so
outputs and gradients are those of the original graph, bit for bit. Data dependencies are
kept, and so is the relative order of side-effecting nodes (collectives among themselves,
mutations, RNG draws, stateful modules), except that a collective may pass a random op (they
share no state). Requests are never reordered among themselves, so collectives are issued
in the same order on every rank whatever else moves. The schedule is deterministic and
depends only on the graph and per-row costs, so ranks that trace the same graph and differ
only in batch size (uneven local batches) run the same schedule.

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
from fxrec.graph.effects import (
    comm_kind,
    has_side_effects,
    mutates_input,
    view_bases,
    written_targets,
)
from fxrec.graph.rule import LocalRule, RewriteContext, register

logger = logging.getLogger(__name__)

__all__ = ["OverlapComm", "comm_kind", "compute_cost", "schedule"]


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
    _order_writes(nodes, deps)
    # The output and placeholders stay where they are.
    out = [n for n in nodes if n.op == "output"]
    for o in out:
        deps[o] |= {n for n in nodes if n is not o}
    return deps


def _order_writes(nodes: Sequence[fx.Node], deps: dict[fx.Node, set[fx.Node]]) -> None:
    """An in-place write stays after every node that reads the memory it writes before it
    (``cat([h, ...])`` then ``h.relu_()``), and every later reader stays after it, whichever
    node (the tensor, a view, its base) they read it through."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    writer: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        mem = {view_bases(a)[-1] for a in n.all_input_nodes}
        for m in mem:
            if m in writer:
                deps[n].add(writer[m])
        for target in written_targets(n) if mutates_input(n) else ():
            if isinstance(target, fx.Node):
                m = view_bases(target)[-1]
                deps[n].update(r for r in readers.get(m, ()) if r is not n)
                writer[m] = n
        for m in mem:
            readers.setdefault(m, []).append(n)


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


_MATMUL_FUNCTIONS = {
    torch.nn.functional.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch._C._nn.linear,
}
_MATMUL_ATEN = ("mm", "addmm", "bmm", "matmul", "linear")


def _row_numel(x: Any) -> int:
    """Elements per row of the leading dimension (1 for scalars and vectors)."""
    if isinstance(x, meta.TensorInfo):
        n = 1
        for s in x.shape[1:]:
            n *= s if isinstance(s, int) else 1
        return n
    if isinstance(x, (list, tuple)):
        return sum(_row_numel(y) for y in x)
    return 1


def _reduction(node: fx.Node) -> int:
    """The inner dimension of a matmul-like node (1 otherwise)."""
    if node.op == "call_module":
        try:
            mod = node.graph.owning_module.get_submodule(node.target)
        except AttributeError:
            return 1
        return int(mod.in_features) if isinstance(mod, torch.nn.Linear) else 1
    if node.op == "call_method" and node.target in _MATMUL_ATEN:
        return _inner_dim(node.args[0])
    if node.op != "call_function":
        return 1
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    is_mm = target in _MATMUL_FUNCTIONS or (
        packet is not None and getattr(packet, "__name__", "") in _MATMUL_ATEN
    )
    if not is_mm:
        return 1
    lhs = node.args[1] if getattr(target, "__name__", "").startswith("addmm") else node.args[0]
    return _inner_dim(lhs)


def _inner_dim(lhs: Any) -> int:
    ti = meta.info(lhs)
    if isinstance(ti, meta.TensorInfo) and ti.ndim and isinstance(ti.shape[-1], int):
        return ti.shape[-1]
    return 1


def compute_cost(node: fx.Node) -> int:
    """Rough work of a node, per row of the leading (batch) dimension.

    Per row so that ranks whose inputs differ only in batch size (uneven local batches)
    get the same costs, hence the same schedule. Output elements, times the inner dimension
    for matmul-like nodes; 1 without metadata; 0 for nodes that compute nothing.
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return 0
    return max(1, _row_numel(meta.info(node)) * _reduction(node))


def _wait_masks(nodes: Sequence[fx.Node], deps: dict[fx.Node, set[fx.Node]]) -> dict:
    """For each node, the waits it depends on (itself included), as a bit mask.

    ``nodes`` in graph order, which is topological for ``deps`` too (effect edges and the
    output's edges only point forward).
    """
    waits = [n for n in nodes if comm_kind(n) == "wait"]
    bit = {n: 1 << i for i, n in enumerate(waits)}
    mask: dict[fx.Node, int] = {}
    for n in nodes:
        m = bit.get(n, 0)
        for d in deps[n]:
            m |= mask[d]
        mask[n] = m
    return mask


class _Ready:
    """Ready nodes of one priority class, lowest current position first."""

    def __init__(self, pos: dict[fx.Node, int]) -> None:
        self.pos = pos
        self.heap: list[tuple[int, str, fx.Node]] = []

    def push(self, n: fx.Node) -> None:
        heapq.heappush(self.heap, (self.pos[n], n.name, n))

    def peek(self) -> fx.Node | None:
        return self.heap[0][2] if self.heap else None

    def pop(self) -> fx.Node:
        return heapq.heappop(self.heap)[2]


class _Scheduler:
    """List scheduling with windows; see :func:`schedule`."""

    def __init__(self, nodes: list[fx.Node], requests: list[fx.Node]) -> None:
        pos = {n: i for i, n in enumerate(nodes)}
        self.deps = _dependencies(nodes)
        urgent = _ancestors_of(requests, self.deps)
        self.cost = {n: compute_cost(n) for n in nodes}
        self.wait_mask = _wait_masks(nodes, self.deps)
        self.done_waits = 0
        self.klass: dict[fx.Node, str] = {}
        for n in nodes:
            wait = comm_kind(n) == "wait"
            if n.op == "placeholder" or (n in urgent and not wait):
                self.klass[n] = "urgent"
            elif wait:
                self.klass[n] = "chain_wait" if n in urgent else "tail_wait"
            else:
                self.klass[n] = "free"
        self.ready = {k: _Ready(pos) for k in ("urgent", "chain_wait", "free", "tail_wait")}
        self.unscheduled = set(nodes)
        self.users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
        self.indeg = {n: len(d) for n, d in self.deps.items()}
        for n, d in self.deps.items():
            for m in d:
                self.users[m].append(n)
        for n in nodes:
            if self.indeg[n] == 0:
                self.ready[self.klass[n]].push(n)
        self.order: list[fx.Node] = []
        self.budget: float | None = None  # None: no window open
        self.spent = 0.0

    def emit(self, n: fx.Node) -> None:
        self.order.append(n)
        self.unscheduled.discard(n)
        if self.klass[n] in ("chain_wait", "tail_wait"):
            self.done_waits |= self.wait_mask[n]
        for u in self.users[n]:
            self.indeg[u] -= 1
            if self.indeg[u] == 0:
                self.ready[self.klass[u]].push(u)

    def open_window(self) -> float:
        """Share of the compute runnable now that this window gets (an equal split)."""
        pending = ~self.done_waits
        available = sum(
            self.cost[n]
            for n in self.unscheduled
            if self.klass[n] == "free" and not self.wait_mask[n] & pending
        )
        tail = any(self.klass[n] == "tail_wait" for n in self.unscheduled)
        windows = sum(self.klass[n] == "chain_wait" for n in self.unscheduled) + int(tail)
        return available / max(1, windows)

    def step(self) -> fx.Node:
        """The next node: urgent, else fill the open window, else free, else a tail wait."""
        r = self.ready
        if r["urgent"].peek() is not None:
            return r["urgent"].pop()
        if r["chain_wait"].peek() is not None:
            if self.budget is None:
                self.budget, self.spent = self.open_window(), 0.0
            cand = r["free"].peek()
            if cand is not None and self.spent + self.cost[cand] / 2 <= self.budget:
                self.spent += self.cost[cand]
                return r["free"].pop()
            self.budget = None
            return r["chain_wait"].pop()
        if r["free"].peek() is not None:
            return r["free"].pop()
        return r["tail_wait"].pop()

    def run(self) -> list[fx.Node]:
        while any(q.peek() is not None for q in self.ready.values()):
            self.emit(self.step())
        return self.order


def schedule(graph: fx.Graph) -> list[fx.Node] | None:
    """The overlapped order of ``graph``'s nodes, or None if it has no collective.

    List scheduling; among ready nodes of a class, the earliest in the current order goes
    first. Classes: *urgent* (placeholders, requests and their input cones, except waits)
    runs as soon as ready. A *chain wait* (a wait on some request's cone) opens a window:
    ready *free* compute (feeding no request) runs first, up to an equal share of the
    compute runnable at that point among the windows left (by :func:`compute_cost`; a node
    goes in if at least half of it fits), then the wait. Free compute left after the chain runs before *tail waits* (feeding no
    request), which go as late as their users allow. Applying it to its own result gives
    the same order (the rule reaches a fixed point at once).
    """
    nodes = list(graph.nodes)
    requests = [n for n in nodes if comm_kind(n) == "request"]
    if not requests:
        return None
    order = _Scheduler(nodes, requests).run()
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
