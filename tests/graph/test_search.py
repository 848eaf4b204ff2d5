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
