"""The two-step search: buckets, independent sets, reachability, stable topological order."""

from __future__ import annotations

import random

import torch
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st

from fxrec.graph.search import Reachability, bucket, independent_sets, stable_toposort


def _chain_graph(n_chains: int, depth: int) -> tuple[fx.Graph, list[list[fx.Node]]]:
    g = fx.Graph()
    x = g.placeholder("x")
    chains = []
    for _ in range(n_chains):
        cur, chain = x, []
        for _ in range(depth):
            cur = g.call_function(torch.tanh, (cur,))
            chain.append(cur)
        chains.append(chain)
    g.output(tuple(c[-1] for c in chains))
    return g, chains


def _reachable(a: fx.Node, b: fx.Node) -> bool:
    """Plain DFS reference: is there a path a -> ... -> b?"""
    stack, seen = [a], set()
    while stack:
        n = stack.pop()
        if n is b:
            return True
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return False


def test_parallel_chains_fall_into_one_set_per_level() -> None:
    g, chains = _chain_graph(5, 4)
    reach = Reachability(g)
    level = [c[2] for c in chains]
    assert independent_sets(level, reach) == [level]
    # A whole chain is one dependency path: every member needs its own set.
    assert [len(s) for s in independent_sets(chains[0], reach)] == [1, 1, 1, 1]


def test_no_depth_limit() -> None:
    """Members far apart (depth 200) are still found independent."""
    g, chains = _chain_graph(2, 200)
    reach = Reachability(g)
    assert independent_sets([chains[0][0], chains[1][199]], reach) == [
        [chains[0][0], chains[1][199]]
    ]


def test_bucket_skips_non_candidates() -> None:
    g, _chains = _chain_graph(3, 2)
    buckets = bucket(g.nodes, lambda n: "t" if n.op == "call_function" else None)
    assert len(buckets["t"]) == 6


def test_merge_keeps_the_search_sound() -> None:
    """After fusing {a1, b1}, a set {a0, b2} with a0 -> a1 and b1 -> b2 would form a cycle."""
    g, (a, b) = _chain_graph(2, 3)
    reach = Reachability(g)
    assert reach.still_independent([a[0], b[2]])
    reach.merge([a[1], b[1]])
    assert not reach.still_independent([a[0], b[2]])
    assert reach.still_independent([a[2], b[2]])


@given(st.integers(min_value=5, max_value=40), st.integers(min_value=0, max_value=10_000))
def test_independent_sets_have_no_paths(n: int, seed: int) -> None:
    rng = random.Random(seed)
    g = fx.Graph()
    nodes = [g.placeholder("x")]
    for _ in range(n):
        ins = rng.sample(nodes, k=min(len(nodes), rng.randint(1, 2)))
        nodes.append(g.call_function(torch.add, tuple(ins) if len(ins) == 2 else (ins[0], ins[0])))
    g.output(nodes[-1])
    reach = Reachability(g)
    for s in independent_sets(nodes[1:], reach):
        for i, p in enumerate(s):
            for q in s[i + 1 :]:
                assert not _reachable(p, q) and not _reachable(q, p)
                assert not reach.depends(p, q)
    for p in nodes[1:8]:
        for q in nodes[1:8]:
            if p is not q:
                assert reach.depends(p, q) == (_reachable(p, q) or _reachable(q, p))


def test_merge_tracks_each_fused_set_on_its_own() -> None:
    """Two fused levels of two chains, {a1, b1} and {a3, b3}: {a2, b2} between them stays
    independent (each level is a node of its own), as do {a0, b0} above both. Treating every
    fused set as one node would have put {a2, b2} both upstream and downstream of it."""
    g, (a, b) = _chain_graph(2, 5)
    reach = Reachability(g)
    reach.merge([a[1], b[1]])
    reach.merge([a[3], b[3]])
    assert reach.still_independent([a[2], b[2]])
    assert reach.still_independent([a[0], b[0]])
    assert reach.still_independent([a[4], b[4]])
    assert not reach.still_independent([a[0], b[2]])  # a0 -> a1 = b1 -> b2
    assert not reach.still_independent([a[0], b[4]])  # through both fused nodes
    assert not reach.still_independent([a[1], b[2]])  # a member already fused


def test_merge_joins_paths_through_sets_fused_later() -> None:
    """{a1, c1} fused, then {c2, d1}: a0 reaches d2 only through both fused nodes, the second
    fused after the first (so the first's reach must grow when the second is added)."""
    g, (a, c, d) = _chain_graph(3, 3)
    reach = Reachability(g)
    assert reach.still_independent([a[0], d[2]])
    reach.merge([a[1], c[1]])
    assert reach.still_independent([a[0], d[2]])
    reach.merge([c[2], d[1]])
    assert not reach.still_independent([a[0], d[2]])
    assert reach.still_independent([a[2], d[2]])


def _contracted_path(g: fx.Graph, fused: list[list[fx.Node]], p: fx.Node, q: fx.Node) -> bool:
    """Reference: a path p -> ... -> q once each fused set is one node (union of its members)."""
    rep = {n: n for n in g.nodes}
    for members in fused:
        for n in members:
            rep[n] = members[0]
    succ: dict[fx.Node, set[fx.Node]] = {}
    for n in g.nodes:
        for u in n.users:
            if rep[u] is not rep[n]:
                succ.setdefault(rep[n], set()).add(rep[u])
    stack, seen = [rep[p]], {rep[p]}
    while stack:
        n = stack.pop()
        if n is rep[q]:
            return True
        for u in succ.get(n, ()):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return False


@given(st.integers(min_value=6, max_value=30), st.integers(min_value=0, max_value=10_000))
def test_still_independent_is_exact_after_fusions(n: int, seed: int) -> None:
    """On random DAGs, after a random sequence of fusions of sets it accepted,
    ``still_independent`` answers exactly whether the contracted graph has a path between two
    members of a set independent in the indexed graph."""
    rng = random.Random(seed)
    g = fx.Graph()
    roots = [g.placeholder(f"x{i}") for i in range(4)]  # sparse: parallel chains, some joins
    nodes = list(roots)
    for _ in range(n):
        ins = rng.sample(nodes, k=1 if rng.random() < 0.8 else 2)
        nodes.append(g.call_function(torch.add, tuple(ins) if len(ins) == 2 else (ins[0], ins[0])))
    g.output(tuple(nodes[len(roots) :]))
    reach = Reachability(g)
    fused: list[list[fx.Node]] = []
    free = nodes[len(roots) :]
    for _ in range(40):
        if len(free) < 2:
            break
        cand = rng.sample(free, k=min(len(free), rng.randint(2, 3)))
        if any(reach.depends(p, q) for i, p in enumerate(cand) for q in cand[i + 1 :]):
            continue
        want = not any(_contracted_path(g, fused, p, q) for p in cand for q in cand if p is not q)
        assert reach.still_independent(cand) == want, (cand, fused)
        if want and rng.random() < 0.7:
            reach.merge(cand)
            fused.append(cand)
            free = [x for x in free if x not in cand]


def test_stable_toposort_moves_only_what_it_must() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.tanh, (x,))
    b = g.call_function(torch.sigmoid, (x,))
    c = g.call_function(torch.relu, (x,))
    g.output((a, b, c))
    # Make `a` read `c`, which comes later: a topological order must move `a` after `c`.
    a.args = (c,)
    stable_toposort(g)
    order = [n.name for n in g.nodes]
    assert order.index("relu") < order.index("tanh")
    assert order.index("sigmoid") < order.index("relu")  # untouched nodes keep their order
    g.lint()
