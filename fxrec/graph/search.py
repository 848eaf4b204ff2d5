"""The two-step greedy search of seed 001 (Fig. 5), with a cheap dependency test.

Step 1 buckets candidate nodes by a key (op, shapes, dtype, device, hyper-parameters).
Step 2 splits each bucket, greedily in topological (BFS) order, into sets whose members have
no path between them: only such a set can become one node without creating a cycle.

The dependency test is a bit test: each node carries the set of its ancestors as a Python
int bitset, built in one topological sweep (:class:`Reachability`). Visiting members in
topological order means a later node can never be an ancestor of an earlier one, so "is
``n`` independent of set ``S``" is ``ancestors[n] & mask(S) == 0``: no depth limit, no
per-pair BFS. A graph of 10,000 nodes is indexed in tens of milliseconds.

Fusing a set changes reachability (everything upstream of one member now reaches everything
downstream of any member). :class:`Reachability` stays exact within a pass by treating each
set fused so far as one node and keeping which fused nodes reach which
(:meth:`Reachability.merge`). Treating them all as one node would be sound too, but it
defers the set between two fused levels of a tower (the LayerNorms between two fused
Linears) to another pass over the whole graph.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch.fx as fx

__all__ = ["Reachability", "bucket", "independent_sets", "stable_toposort"]


class Reachability:
    """Ancestor bitsets over the nodes of a graph, frozen at construction time."""

    def __init__(self, graph: fx.Graph) -> None:
        self.index: dict[fx.Node, int] = {}
        self.nodes: list[fx.Node] = []  # by index
        self.ancestors: list[int] = []
        for i, node in enumerate(graph.nodes):
            self.index[node] = i
            self.nodes.append(node)
            acc = 0
            for inp in node._input_nodes:  # the dict all_input_nodes copies
                j = self.index.get(inp)
                if j is not None:
                    acc |= self.ancestors[j] | (1 << j)
            self.ancestors.append(acc)
        # The sets fused since construction, each contracted to one node: its members, their
        # ancestors, and the fused sets it reaches (a bitset over their order, itself too).
        self._fused_masks: list[int] = []
        self._fused_anc: list[int] = []
        self._fused_down: list[int] = []
        self._merged_mask = 0  # members of every set fused since construction
        self._effects: list[int] | None = None

    def effect_positions(self, is_effect: Callable[[fx.Node], bool]) -> list[int]:
        """Sorted indices of the nodes ``is_effect`` holds for (computed once)."""
        if self._effects is None:
            self._effects = [i for n, i in self.index.items() if is_effect(n)]
        return self._effects

    def knows(self, node: fx.Node) -> bool:
        """True for nodes that existed when the index was built."""
        return node in self.index

    def mask(self, nodes: Iterable[fx.Node]) -> int:
        m = 0
        for n in nodes:
            m |= 1 << self.index[n]
        return m

    def depends(self, a: fx.Node, b: fx.Node) -> bool:
        """True if there is a path between ``a`` and ``b`` (either direction)."""
        ia, ib = self.index[a], self.index[b]
        return bool((self.ancestors[ib] >> ia) & 1 or (self.ancestors[ia] >> ib) & 1)

    def merge(self, members: Sequence[fx.Node]) -> None:
        """Record that ``members`` were fused into one node.

        The fused node reads what every member read and feeds what every member fed, so it
        joins paths: a set with a member upstream of this one now reaches every set downstream
        of it. Kept as a closure over the fused sets (few per pass), not by re-indexing.
        """
        mask = anc = 0
        for n in members:
            i = self.index[n]
            mask |= 1 << i
            anc |= self.ancestors[i]
        k = len(self._fused_masks)
        into = 0  # fused sets with a member upstream of one of these
        down = 1 << k  # what the new node reaches: itself, and what its members feed
        for j, (mj, aj) in enumerate(zip(self._fused_masks, self._fused_anc)):
            if anc & mj:
                into |= 1 << j
            if aj & mask:
                down |= self._fused_down[j]
        if into:
            for j, dj in enumerate(self._fused_down):
                if dj & into:  # j reaches a set upstream of the new node: and all it reaches
                    self._fused_down[j] = dj | down
        self._fused_masks.append(mask)
        self._fused_anc.append(anc)
        self._fused_down.append(down)
        self._merged_mask |= mask

    def still_independent(self, members: Sequence[fx.Node]) -> bool:
        """False if fusions recorded by :meth:`merge` created a path between members.

        A path between two members of a set independent in the indexed graph must pass through
        fused nodes: from a member upstream of one fused set, through the sets that one
        reaches, to a member downstream of any of them.
        """
        if not self._merged_mask:
            return True
        m = self.mask(members)
        if m & self._merged_mask:
            return False  # a member was already fused away
        reached = 0
        for j, aj in enumerate(self._fused_anc):
            if aj & m:
                reached |= self._fused_down[j]
        if not reached:
            return True
        below = 0  # the members of every fused set some member reaches
        for j, mj in enumerate(self._fused_masks):
            if reached >> j & 1:
                below |= mj
        return not any(self.ancestors[self.index[n]] & below for n in members)


def bucket(
    nodes: Iterable[fx.Node], key: Callable[[fx.Node], Hashable | None]
) -> dict[Hashable, list[fx.Node]]:
    """Step 1: group candidate nodes by key; nodes whose key is None are not candidates."""
    out: dict[Hashable, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        k = key(n)
        if k is not None:
            out[k].append(n)
    return out


def independent_sets(
    members: Sequence[fx.Node], reach: Reachability, max_size: int | None = None
) -> list[list[fx.Node]]:
    """Step 2: greedily split one bucket into sets with no data dependency inside a set.

    Members are visited in topological order; each joins the first open set it is
    independent of (first fit), so parallel branches fall into one set however far apart
    they are in the graph.
    """
    ordered = sorted((n for n in members if reach.knows(n)), key=reach.index.__getitem__)
    sets: list[list[fx.Node]] = []
    masks: list[int] = []
    for n in ordered:
        anc = reach.ancestors[reach.index[n]]
        bit = 1 << reach.index[n]
        for k, m in enumerate(masks):
            if not (anc & m) and (max_size is None or len(sets[k]) < max_size):
                sets[k].append(n)
                masks[k] |= bit
                break
        else:
            sets.append([n])
            masks.append(bit)
    return sets


def _is_ordered(node: fx.Node) -> bool:
    """Nodes whose relative order must be kept (side effects, collectives, outputs)."""
    return node.op in ("placeholder", "output") or node.is_impure()


def stable_toposort(graph: fx.Graph, is_ordered: Callable[[fx.Node], bool] = _is_ordered) -> None:
    """Reorder nodes topologically, keeping the existing order wherever it is already valid.

    Rewrites insert a fused node at the position of its last member; users of earlier
    members may then precede it. Kahn's algorithm with the old position as priority moves
    just those users (and what depends on them) down. Side-effecting nodes (``is_ordered``;
    pass a cached version to save its cost on repeated sorts) keep their relative order.
    """
    nodes = list(graph.nodes)
    order = _stable_order(nodes, is_ordered)
    if len(order) != len(nodes):
        raise RuntimeError("fxrec: graph has a cycle after a rewrite (this is a bug in a rule)")
    if order == nodes:
        return
    cursor = order[0]
    if cursor is not nodes[0]:
        nodes[0].prepend(cursor)
    for n in order[1:]:
        if cursor.next is not n:
            cursor.append(n)
        cursor = n


def _stable_order(nodes: list[fx.Node], is_ordered: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """Kahn's order with the old position as priority, in one scan of ``nodes``.

    A node whose inputs are all placed when the scan reaches it is the lowest-position ready
    node, except for nodes released earlier (which all sit before it): those come first, from
    a heap. So only the nodes that must move pass through the heap, and the cost is linear in
    the graph plus a logarithmic term per moved node. A node missing inputs waits for the
    last of them; nodes on a cycle are never placed.

    A side-effecting node also waits for the previous one, but only while that one waits
    itself: ``is_ordered`` is asked only about nodes that wait or that the scan reaches while
    a side-effecting node waits (for the rest, the old order already is the answer).
    """
    pos = {n: i for i, n in enumerate(nodes)}
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []
    missing: dict[fx.Node, int] = {}
    waiting: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    released: list[tuple[int, fx.Node]] = []

    def place(n: fx.Node) -> None:
        order.append(n)
        placed.add(n)
        for w in waiting.pop(n, ()):
            missing[w] -= 1
            if missing[w] == 0:
                heapq.heappush(released, (pos[w], w))

    pending: fx.Node | None = None  # the last side-effecting node seen, while it waits
    for n in nodes:
        while released:
            place(heapq.heappop(released)[1])
        if pending is not None and pending in placed:
            pending = None
        deps = [d for d in n._input_nodes if d not in placed]
        if (deps or pending is not None) and is_ordered(n):
            if pending is not None and pending not in deps:
                deps.append(pending)
            pending = n
        if deps:
            missing[n] = len(deps)
            for d in deps:
                waiting[d].append(n)
        else:
            place(n)
    while released:
        place(heapq.heappop(released)[1])
    return order
