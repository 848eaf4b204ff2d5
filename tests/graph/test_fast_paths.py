"""The shortcuts that keep the passes linear give exactly what the plain computations give."""

from __future__ import annotations

import contextlib
import heapq
import operator
import random
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from fxrec.graph import meta
from fxrec.graph.optimize_graph import _Snapshot
from fxrec.graph.params import ParamStore
from fxrec.graph.pieces import piece_of, split_sizes
from fxrec.graph.report import Report
from fxrec.graph.rule import WIDE_READER_INPUTS, NodeCache, RewriteContext
from fxrec.graph.search import _stable_order


# -- topological order ---------------------------------------------------------------------------
def _kahn(nodes: list[fx.Node], is_ordered) -> list[fx.Node]:
    """Reference: Kahn's algorithm over every node with the old position as priority."""
    pos = {n: i for i, n in enumerate(nodes)}
    deps = {n: set(n.all_input_nodes) for n in nodes}
    last = None
    for n in nodes:
        if is_ordered(n):
            if last is not None:
                deps[n].add(last)
            last = n
    indeg = {n: len(d) for n, d in deps.items()}
    users = defaultdict(list)
    for n, d in deps.items():
        for m in d:
            users[m].append(n)
    heap = [(pos[n], n.name, n) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, n = heapq.heappop(heap)
        order.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (pos[u], u.name, u))
    return order


@given(
    st.integers(min_value=3, max_value=40),
    st.integers(min_value=0, max_value=10_000),
    st.floats(min_value=0.0, max_value=0.5),
)
def test_stable_order_is_kahns_order(n: int, seed: int, p_ordered: float) -> None:
    rng = random.Random(seed)
    g = fx.Graph()
    nodes = [g.placeholder("x")]
    for _ in range(n):
        ins = rng.sample(nodes, k=min(len(nodes), rng.randint(1, 2)))
        nodes.append(g.call_function(torch.add, (ins[0], ins[-1])))
    g.output(nodes[-1])
    # Move some nodes earlier, as a fused node inserted before its last member leaves
    # users of earlier members in front of it.
    for _ in range(rng.randint(0, 6)):
        a, b = sorted(rng.sample(range(1, n + 1), 2))
        nodes[a].prepend(nodes[b])
    ordered = {x for x in g.nodes if rng.random() < p_ordered}
    current = list(g.nodes)
    assert _stable_order(current, ordered.__contains__) == _kahn(current, ordered.__contains__)


# -- metadata of glue ops --------------------------------------------------------------------------
def _fake_info(node: fx.Node) -> object:
    """Metadata the way :func:`meta.infer` computes it on fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = fx.node.map_aggregate(node.args, lambda x: meta._fake_arg(mode, x))
    with mode:
        out = node.target(*args)
    return fx.node.map_aggregate(
        out, lambda x: meta.TensorInfo.of(x) if isinstance(x, torch.Tensor) else x
    )


def _input(g: fx.Graph, name: str, shape: tuple[int, ...], dtype, rg: bool) -> fx.Node:
    node = g.placeholder(name)
    meta.set_info(node, meta.TensorInfo(shape, dtype, torch.device("cpu"), rg))
    return node


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize(
    "make",
    [
        lambda g, x, y: g.call_function(torch.split, (x, [1, 3, 0, 2], 1)),
        lambda g, x, y: g.call_function(torch.split, (x, [4, 2], -1)),
        lambda g, x, y: g.call_function(torch.unbind, (x, 0)),
        lambda g, x, y: g.call_function(torch.unbind, (x, -1)),
        lambda g, x, y: g.call_function(torch.cat, ([x, y, x], 0)),
        lambda g, x, y: g.call_function(torch.cat, ([x, y], -2)),
        lambda g, x, y: g.call_function(torch.stack, ([x, y], 0)),
        lambda g, x, y: g.call_function(torch.stack, ([x, y, y], 2)),
        lambda g, x, y: g.call_function(torch.stack, ((x, y), -1)),
    ],
)
def test_glue_metadata_matches_fake_tensors(make, dtype, grad: bool) -> None:
    g = fx.Graph()
    x = _input(g, "x", (3, 6), dtype, True)
    y = _input(g, "y", (3, 6), dtype, False)
    node = make(g, x, y)
    with torch.set_grad_enabled(grad):
        expected = _fake_info(node)
        assert meta.infer(None, node)  # type: ignore[arg-type]
    assert meta.info(node) == expected


def _fake_info_any(node: fx.Node) -> object:
    """:func:`_fake_info` for method calls too."""
    if node.op == "call_function":
        return _fake_info(node)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    self_, *rest = fx.node.map_aggregate(node.args, lambda x: meta._fake_arg(mode, x))
    with mode:
        out = getattr(self_, node.target)(*rest)
    return meta.TensorInfo.of(out)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
@pytest.mark.parametrize(
    "make",
    [
        lambda g, x, w: g.call_function(torch.tanh, (x,)),
        lambda g, x, w: g.call_function(torch.sigmoid, (x,)),
        lambda g, x, w: g.call_function(torch.relu, (x,)),
        lambda g, x, w: g.call_function(
            torch.nn.functional.layer_norm, (x, (4,), None, None, 1e-5)
        ),
        lambda g, x, w: g.call_function(
            torch.nn.functional.layer_norm, (x, [3, 4], None, None, 1e-3)
        ),
        lambda g, x, w: g.call_function(torch.addcmul, (w, x, w)),
        lambda g, x, w: g.call_function(torch.addcmul, (x, x, w)),
        lambda g, x, w: g.call_method("flatten", (x, 1, 2)),
        lambda g, x, w: g.call_method("flatten", (x, 0, -1)),
        lambda g, x, w: g.call_method("unflatten", (x, 1, (3, 1))),
        lambda g, x, w: g.call_method("unflatten", (x, -1, (2, -1))),
    ],
)
def test_shape_op_metadata_matches_fake_tensors(make, dtype, grad: bool) -> None:
    g = fx.Graph()
    x = _input(g, "x", (2, 3, 4), dtype, True)
    w = _input(g, "w", (3, 4), dtype, False)
    node = make(g, x, w)
    with torch.set_grad_enabled(grad):
        try:
            expected = _fake_info_any(node)
        except Exception:  # e.g. no integer tanh: then no metadata either way
            assert meta._glue_info(node) is None
            return
        if dtype.is_floating_point:  # the shape-arithmetic path answers these
            assert (meta._glue_info(node) is not None) == grad
        assert meta.infer(None, node)  # type: ignore[arg-type]
    assert meta.info(node) == expected


def test_shape_op_metadata_declines_what_it_does_not_check() -> None:
    g = fx.Graph()
    x = _input(g, "x", (2, 3, 4), torch.float32, False)
    w = _input(g, "w", (4,), torch.float32, False)
    h = _input(g, "h", (4,), torch.float16, False)
    ln = torch.nn.functional.layer_norm
    for node in [
        g.call_function(ln, (x, (4,), w, None, 1e-5)),  # affine parameters
        g.call_function(ln, (x, (3,), None, None, 1e-5)),  # shape mismatch
        g.call_function(torch.addcmul, (x, x, h)),  # mixed dtypes
        g.call_function(torch.tanh, (x,), {"out": x}),
        g.call_method("unflatten", (x, 1, (2, -1))),  # 3 does not split in 2
        g.call_method("flatten", (x, 2, 1)),
    ]:
        assert meta._glue_info(node) is None


def test_glue_metadata_leaves_unusual_forms_to_fake_tensors() -> None:
    g = fx.Graph()
    x = _input(g, "x", (3, 6), torch.float32, False)
    y = _input(g, "y", (3, 5), torch.float32, False)
    z = _input(g, "z", (3, 6), torch.float16, False)
    for args in [(x, [1, 2], 1), (x, 2, 1), (x, [6], 2)]:  # bad sizes, int size, bad dim
        assert meta._glue_info(g.call_function(torch.split, args)) is None
    assert meta._glue_info(g.call_function(torch.stack, ([x, y],))) is None
    assert meta._glue_info(g.call_function(torch.stack, ([x, y], 0))) is None  # shapes differ
    assert meta._glue_info(g.call_function(torch.cat, ([x, z], 1))) is None  # dtypes differ
    assert meta._glue_info(g.call_function(torch.cat, ([x, y], 0))) is None  # dim 1 differs
    # Where it declines, infer still answers through fake tensors.
    node = g.call_function(torch.cat, ([x, z], 1))
    assert meta.infer(None, node)  # type: ignore[arg-type]
    assert meta.info(node).dtype == torch.float32


# -- cached per-node facts -------------------------------------------------------------------------
def test_node_cache_follows_argument_changes() -> None:
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(torch.add, (x, 1))
    calls = []
    cache = NodeCache(lambda n: calls.append(n) or n.args)
    assert cache(a) == (x, 1) and cache(a) == (x, 1) and len(calls) == 1
    x.replace_all_uses_with(y)
    assert cache(a) == (y, 1) and len(calls) == 2
    a.kwargs = {"alpha": 2}
    cache(a)
    assert len(calls) == 3


def test_piece_layout_follows_its_split() -> None:
    g = fx.Graph()
    x = _input(g, "x", (2, 10), torch.float32, False)
    s = g.call_function(torch.split, (x, [4, 6], 1))
    item = g.call_function(operator.getitem, (s, 1))
    p = piece_of(item)
    assert p is not None and (p.start, p.length, p.index) == (4, 6, 1)
    s.args = (x, [3, 7], 1)
    p = piece_of(item)
    assert p is not None and (p.start, p.length) == (3, 7)
    meta.set_info(x, meta.TensorInfo((2, 12), torch.float32, torch.device("cpu")))
    assert piece_of(item) is None and split_sizes(s) is None  # sizes no longer tile x
    sizes = split_sizes(g.call_function(torch.split, (x, [5, 7], 1)))
    assert sizes is not None
    sizes[2].append(1)  # callers get their own list
    assert split_sizes(g.call_function(torch.split, (x, [5, 7], 1)))[2] == [5, 7]


# -- replacing many members read by one wide node -------------------------------------------------
def _wide_graph(n: int) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    root = torch.nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    members = [g.call_function(torch.tanh, (x,)) for _ in range(n)]
    outs = [g.call_function(torch.sigmoid, (x,)) for _ in range(n)]
    side = g.call_function(torch.relu, (x,))
    cat = g.call_function(torch.cat, ([*members, side],))
    g.output((cat, side))
    return fx.GraphModule(root, g), members, outs


def _users(gm: fx.GraphModule) -> list[tuple[str, list[str], str]]:
    return [(n.name, [u.name for u in n.users], repr(n.args)) for n in gm.graph.nodes]


@pytest.mark.parametrize("n", [3, WIDE_READER_INPUTS + 5])
def test_batched_replacements_end_like_one_by_one(n: int) -> None:
    expected, members, outs = _wide_graph(n)
    for m, o in zip(members, outs):
        m.replace_all_uses_with(o)
    for m in members:
        expected.graph.erase_node(m)

    gm, members, outs = _wide_graph(n)
    ctx = RewriteContext(gm, Report(), ParamStore(gm, None))
    with ctx.batched_replacements():
        for m, o in zip(members, outs):
            ctx.replace(m, o)
        ctx.erase_if_dead(members)
    assert _users(gm) == _users(expected)
    gm.graph.lint()


def _replay(seed: int, batched: bool) -> list[tuple[str, list[str], str]]:
    """Build a graph of wide and narrow readers, apply random replacements, describe it."""
    rng = random.Random(seed)
    g = fx.Graph()
    x = g.placeholder("x")
    srcs = [g.call_function(torch.tanh, (x,)) for _ in range(WIDE_READER_INPUTS + 8)]
    fresh = [g.call_function(torch.sigmoid, (x,)) for _ in range(len(srcs))]
    readers = []
    for _ in range(3):
        picked = rng.sample(srcs, rng.randint(1, len(srcs)))
        readers.append(g.call_function(torch.cat, ([*picked, x],)))
    readers.append(g.call_function(torch.add, (rng.choice(srcs), x)))
    g.output(tuple(readers))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ctx = RewriteContext(gm, Report(), ParamStore(gm, None))
    pool = srcs + fresh
    with ctx.batched_replacements() if batched else contextlib.nullcontext():
        for _ in range(rng.randint(1, 60)):
            old, new = rng.sample(pool, 2)
            if batched:
                ctx.replace(old, new)
            else:
                old.replace_all_uses_with(new)
    return [(n.name, [u.name for u in n.users], repr(n.args)) for n in g.nodes]


@given(st.integers(min_value=0, max_value=100_000))
def test_batched_replacements_match_eager_ones(seed: int) -> None:
    assert _replay(seed, batched=True) == _replay(seed, batched=False)


def test_snapshot_restores_what_a_copy_would() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    s = g.call_function(torch.split, (x, [1, 2], 1), {})
    a = g.call_function(operator.getitem, (s, 0))
    b = g.call_method("relu", (a,), {})
    g.output((a, {"b": b}))
    for n in g.nodes:
        n.meta["tag"] = n.name
    copied = fx.Graph()
    copied.output(copied.graph_copy(g, {}))
    snap = _Snapshot(g)
    b.args = (x,)
    b.meta["tag"] = "changed"
    g.erase_node(g.output_node())
    restored = snap.restore()
    assert restored.python_code("self").src == copied.python_code("self").src
    assert [n.meta.get("tag") for n in restored.nodes] == [n.meta.get("tag") for n in copied.nodes]


# -- rule candidates -----------------------------------------------------------------------------
class _Spellings(torch.nn.Module):
    """Many spellings of what the rules look for, and of what they must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.lin = torch.nn.Linear(4, 4)
        self.emb = torch.nn.Embedding(10, 4)
        self.bag = torch.nn.EmbeddingBag(10, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.act = torch.nn.ReLU()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, 4, 1)
        c, d = x.chunk(2, dim=1)
        e = torch.unbind(x.view(2, -1, 4), 1)[0]
        f = x.split([4, 4], 1)[1]
        g = torch.nn.functional.layer_norm(a, (4,)) + self.norm(b)
        h = torch.nn.functional.linear(c, self.w) * self.lin(d)
        i = torch.tanh(e).sigmoid() - torch.relu(f) / self.act(g)
        j = self.emb(ids[:, 0]) + self.bag(ids) + torch.nn.functional.embedding(ids[:, 1], self.w)
        k = torch.maximum(h, i).float() + self.bn(j)
        m = torch.cat([k, x[:, :4], x.narrow(1, 4, 4)], 1)
        n = torch.stack([a, b], 0).sum(0)
        return torch.concat([m, n, torch.clamp(k, 0, 1)], dim=1)


def _annotated_graphs() -> list[fx.GraphModule]:
    from fxrec.bench import models
    from fxrec.graph.capture import capture_symbolic

    out = []
    for model, inputs in [
        (_Spellings(), (torch.randn(2, 8), torch.randint(0, 4, (2, 3)))),
        (models.SyntheticGraph(4), None),
        (models.ParallelTowers(towers=3), None),
    ]:
        gm = capture_symbolic(model)
        meta.annotate(gm, *(inputs or models.make_inputs(model, 2)))
        out.append(gm)
    return out


def test_rules_accept_nothing_outside_their_candidates() -> None:
    """The driver skips nodes outside ``Rule.candidates``; match/key must reject them."""
    from fxrec.graph.driver import _candidates
    from fxrec.graph.optimize_graph import resolve_rules
    from fxrec.graph.rule import HorizontalRule

    rules = [r for r in resolve_rules() if r.candidates is not None]
    assert rules
    for gm in _annotated_graphs():
        ctx = RewriteContext(gm, Report(), ParamStore(gm, None))
        nodes = list(gm.graph.nodes)
        for rule in rules:
            found = _candidates(rule, gm.graph)
            spec = rule.candidates
            scanned = [
                n for n in nodes if n.op in spec and (spec[n.op] is None or n.target in spec[n.op])
            ]
            assert found == scanned, rule.name  # FX's (op, target) index, in graph order
            kept = set(found)
            for node in nodes:
                if node in kept:
                    continue
                if isinstance(rule, HorizontalRule):
                    assert rule.key(node, ctx) is None, (rule.name, node.format_node())
                else:
                    assert not rule.match(node, ctx), (rule.name, node.format_node())


# -- per-call checks of a call past the signature cache ------------------------------------------
class _Served(torch.nn.Module):
    """Parallel towers (laid out in flat parameters) before a Dropout, whose flag matters."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8)) for _ in range(3)
        )
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.cat([t(x) for t in self.towers], 1))


class _OwnFlag(torch.nn.Module):
    """A module keeping ``training`` outside its ``__dict__`` (a property)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.drop.training

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__.pop("training", None)  # (set by Module.__init__ before the property)


class _ServedWithOwnFlag(_Served):
    def __init__(self) -> None:
        super().__init__()
        self.own = _OwnFlag()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own.drop(super().forward(x))


@contextlib.contextmanager
def _past_the_cache(model: torch.nn.Module) -> Any:
    """(plain copy, optimized module) in eval mode and no_grad, the signature cache full: a
    new batch size is served by a shared runner, as a serving loop's calls are."""
    import copy

    import fxrec
    from fxrec.graph.module import MAX_CACHED_SIGNATURES

    torch.manual_seed(0)
    plain = copy.deepcopy(model).eval()
    opt = fxrec.optimize(model, (torch.randn(4, 6),)).eval()
    assert opt.fxrec_fused.member_ids()
    with torch.no_grad():
        for b in range(5, 6 + MAX_CACHED_SIGNATURES):
            opt(torch.randn(b, 6))
        yield plain, opt


def _same(plain: torch.nn.Module, opt: torch.nn.Module, x: torch.Tensor) -> None:
    """Equal outputs, the RNG stream the same for both (dropout in train mode)."""
    torch.manual_seed(1)
    want = plain(x)
    torch.manual_seed(1)
    torch.testing.assert_close(opt(x), want)


def test_served_calls_follow_flat_data_replaced() -> None:
    x = torch.randn(33, 6)
    with _past_the_cache(_Served()) as (plain, opt):
        _same(plain, opt, x)
        for ps in (opt.parameters(), plain.parameters()):
            for p in ps:
                p.data = p.data * 2.0 + 0.5  # new storage: the members must read it
        _same(plain, opt, x)


@pytest.mark.parametrize("model", [_Served, _ServedWithOwnFlag])
def test_served_calls_follow_a_submodule_put_in_train_mode_alone(model: type) -> None:
    x = torch.randn(33, 6)
    with _past_the_cache(model()) as (plain, opt):
        for mode in (True, False, True):
            for m in (plain, opt.model):
                m.drop.train(mode)
                if isinstance(m, _ServedWithOwnFlag):
                    m.own.drop.train(mode)
            _same(plain, opt, x)


@pytest.mark.parametrize("where", ["module", "global"])
def test_served_calls_follow_hooks_added_and_removed(where: str) -> None:
    def shift(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out + 1.0 if isinstance(module, torch.nn.LayerNorm) else out

    x = torch.randn(33, 6)
    with _past_the_cache(_Served()) as (plain, opt):
        for _ in range(2):  # registered, removed, then again
            if where == "module":
                handles = [m.towers[1].register_forward_hook(shift) for m in (plain, opt.model)]
                _same(plain, opt, x)
            else:
                handles = [torch.nn.modules.module.register_module_forward_hook(shift)]
                want = plain(x)
                torch.testing.assert_close(opt(x), want)
            for h in handles:
                h.remove()
            _same(plain, opt, x)


def test_served_calls_read_the_tensors_functional_call_gives() -> None:
    x = torch.randn(33, 6)
    with _past_the_cache(_Served()) as (plain, opt):
        given = {n: p * 3.0 for n, p in plain.named_parameters()}
        want = torch.func.functional_call(plain, given, (x,))
        got = torch.func.functional_call(opt, {f"model.{n}": t for n, t in given.items()}, (x,))
        torch.testing.assert_close(got, want)
        _same(plain, opt, x)  # and the model's own parameters after


def test_a_merged_report_keeps_each_note_once() -> None:
    """Graphs of many signatures (dynamo's frames, copies per size) report the same situation:
    the model's report says it once, as ``note`` does."""
    total = Report()
    total.note("a")
    for _ in range(3):
        part = Report()
        part.note("a")
        part.note("b")
        total.merge(part)
    assert total.notes == ["a", "b"]
