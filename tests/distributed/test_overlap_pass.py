"""The overlap rule: requests issued early, waits late, independent compute in between.

Node order is checked on the fake process group (no data moves); values on a 1-rank gloo
group (all-to-all is a copy) and, with the sharded collection, on 2 gloo ranks.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.graph.capture import capture_symbolic
from fxrec.graph.effects import view_bases
from fxrec.graph.meta import set_info
from fxrec.passes.overlap import OverlapComm, _apply, comm_kind, moved_ahead, schedule
from tests.distributed.launch import run_ranks

A2A = torch.ops._c10d_functional.all_to_all_single
WAIT = torch.ops._c10d_functional.wait_tensor


@pytest.fixture
def fake_pg() -> Iterator[str]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gloo1() -> Iterator[str]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


class DenseFirst(nn.Module):
    """Dense tower written before the sparse exchange (TorchRec DLRM's order)."""

    def __init__(self, group: str, world: int = 2) -> None:
        super().__init__()
        self.group, self.world = group, world
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.emb = nn.EmbeddingBag(20, 4, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        d = self.mlp(dense)
        e = self.emb(ids)
        splits = [e.shape[0] // self.world] * self.world
        t = A2A(e, splits, splits, self.group)
        w = WAIT(t)
        return self.top(torch.cat([d, torch.tanh(w)], 1))


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _optimized_graph(opt: fxrec.OptimizedModule) -> fx.GraphModule:
    (gm,) = [r for r in opt._runners.values()]
    return gm


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.randint(0, 20, (4, 3))


def test_request_raised_wait_sunk_dense_between(fake_pg: str) -> None:
    model = DenseFirst(fake_pg)
    opt = fxrec.optimize(model, _inputs(), rules=["overlap_comm"], check=False)
    names = _names(_optimized_graph(opt))
    req, wait = names.index("all_to_all_single"), names.index("wait_tensor")
    dense = [names.index(n) for n in ("mlp_0", "mlp_1", "mlp_2")]
    assert names.index("emb") < req < min(dense) and max(dense) < wait
    # the wait sits right before its first use
    assert names[wait + 1] == "tanh"
    assert opt.fxrec_report.count("overlap_comm") == 1
    # written order before the pass: dense first, wait right after the request
    before = _names(capture_symbolic(model))
    assert before.index("mlp_2") < before.index("all_to_all_single")


def test_not_in_the_default_rules(fake_pg: str) -> None:
    from fxrec.graph.optimize_graph import resolve_rules

    opt = fxrec.optimize(DenseFirst(fake_pg), _inputs(), check=False)
    assert opt.fxrec_report.count("overlap_comm") == 0
    defaults = [r.name for r in resolve_rules()]
    assert "overlap_comm" not in defaults
    both = [r.name for r in resolve_rules(["default", "overlap_comm", "default"])]
    assert both == [*defaults, "overlap_comm"]  # "default" adds each rule once
    opt = fxrec.optimize(DenseFirst(fake_pg), _inputs(), check=False, rules=both)
    assert opt.fxrec_report.count("overlap_comm") == 1


def test_schedule_is_a_fixed_point(fake_pg: str) -> None:
    gm = capture_symbolic(DenseFirst(fake_pg))
    first = schedule(gm.graph)
    assert first is not None
    opt = fxrec.optimize(DenseFirst(fake_pg), _inputs(), rules=["overlap_comm"], check=False)
    gm2 = _optimized_graph(opt)
    assert schedule(gm2.graph) == list(gm2.graph.nodes)
    assert opt.fxrec_report.passes <= 2


def test_outputs_and_gradients_identical(gloo1: str) -> None:
    torch.manual_seed(0)
    model = DenseFirst(gloo1, world=1)
    opt = fxrec.optimize(model, _inputs(), rules=["overlap_comm"])
    assert opt.fxrec_report.count("overlap_comm") == 1
    for _ in range(3):
        dense, ids = _inputs()
        ref = model(dense, ids)
        ref.sum().backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = opt(dense, ids)
        got.sum().backward()
        assert torch.equal(got, ref)
        for g, p in zip(ref_grads, model.parameters()):
            assert torch.equal(p.grad, g)
        model.zero_grad()


def test_memory_bound_refuses(fake_pg: str) -> None:
    opt = fxrec.optimize(
        DenseFirst(fake_pg), _inputs(), rules=[OverlapComm(max_extra_bytes=0)], check=False
    )
    gm = _optimized_graph(opt)
    assert opt.fxrec_report.count("overlap_comm") == 0
    assert any("MiB" in r.reason for r in opt.fxrec_report.refusals)
    assert _names(gm) == _names(capture_symbolic(DenseFirst(fake_pg)))


class FusingDenseFirst(DenseFirst):
    """Parallel tanhs the default rules fuse, so that the driver runs several passes."""

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        d = self.mlp(dense)
        d = torch.cat([torch.tanh(d[:, :2] * 2), torch.tanh(d[:, 2:] * 3)], 1)
        e = self.emb(ids)
        splits = [e.shape[0] // self.world] * self.world
        w = WAIT(A2A(e, splits, splits, self.group))
        return self.top(torch.cat([d, torch.tanh(w)], 1))


def test_a_refusal_is_reported_once_over_passes(fake_pg: str) -> None:
    rules = ["default", OverlapComm(max_extra_bytes=0)]
    opt = fxrec.optimize(FusingDenseFirst(fake_pg), _inputs(), rules=rules, check=False)
    report = opt.fxrec_report
    assert report.passes > 1 and report.count() > 0
    assert [r.rule for r in report.refusals].count("overlap_comm") == 1


class TwoCollectives(nn.Module):
    """Two exchanges and an in-place op: their written order is kept."""

    def __init__(self, group: str) -> None:
        super().__init__()
        self.group = group
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y.add_(1.0)  # mutation: a collective may not move above it
        a = A2A(y * 2, [2, 2], [2, 2], self.group)
        b = A2A(x + 1, [2, 2], [2, 2], self.group)
        return h + WAIT(a) + WAIT(b)


def test_side_effect_order_kept(fake_pg: str) -> None:
    gm = capture_symbolic(TwoCollectives(fake_pg))
    order = schedule(gm.graph)
    names = [n.name for n in order]
    reqs = [n.name for n in order if comm_kind(n) == "request"]
    assert reqs == ["all_to_all_single", "all_to_all_single_1"]
    assert names.index("add_") < names.index("all_to_all_single")
    assert names.index("lin") < names.index("wait_tensor")


def test_dynamo_graph_through_compile_backend(fake_pg: str) -> None:
    seen: list[list[str]] = []

    def inner(gm: fx.GraphModule, example_inputs: list) -> object:
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    backend = fxrec.compile_backend(inner, rules=["overlap_comm"])
    torch._dynamo.reset()
    compiled = torch.compile(DenseFirst(fake_pg), backend=backend, fullgraph=True)
    compiled(*_inputs())
    (targets,) = seen
    req = next(i for i, t in enumerate(targets) if "all_to_all_single" in t)
    wait = next(i for i, t in enumerate(targets) if "wait_tensor" in t)
    linears = [i for i, t in enumerate(targets) if "linear" in t]
    assert req < linears[0] and linears[1] < wait  # the two MLP linears moved into the window
    assert backend.report.count("overlap_comm") == 1


# -- property: on random graphs the schedule is valid, keeps effects ordered, is a fixed point
@given(st.lists(st.integers(0, 6), min_size=2, max_size=14), st.randoms(use_true_random=False))
def test_random_graphs_schedule_valid(ops: list[int], rnd) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        _check_random_graph(ops, rnd, dist.group.WORLD.group_name)
    finally:
        dist.destroy_process_group()


def _check_random_graph(ops: list[int], rnd, group: str) -> None:
    g = fx.Graph()
    vals = [g.placeholder("x"), g.placeholder("y")]
    pending: list[fx.Node] = []
    for op in ops:
        a = rnd.choice(vals)
        if op == 0:
            vals.append(g.call_function(torch.tanh, (a,)))
        elif op == 1:
            vals.append(g.call_function(torch.add, (a, rnd.choice(vals))))
        elif op == 2:
            pending.append(g.call_function(A2A, (a, [2, 2], [2, 2], group)))
        elif op == 3 and pending:
            vals.append(g.call_function(WAIT, (pending.pop(rnd.randrange(len(pending))),)))
        elif op == 4:
            vals.append(g.call_method("mul_", (a, 2.0)))
        elif op == 5:
            vals.append(g.call_function(operator.getitem, (a, slice(None))))  # a view
        else:
            vals.append(g.call_function(torch.sigmoid, (a,)))
    vals += [g.call_function(WAIT, (p,)) for p in pending]
    g.output(tuple(vals[2:]) if len(vals) > 2 else vals[0])
    for n in g.nodes:  # uneven costs, so that windows split the compute unevenly
        if n.op == "call_function":
            set_info(n, torch.empty(2, rnd.randint(1, 64)))
    old = list(g.nodes)
    order = schedule(g)
    if order is None:
        return
    pos = {n: i for i, n in enumerate(order)}
    assert sorted(pos.values()) == list(range(len(old)))
    for n in order:
        assert all(pos[i] < pos[n] for i in n.all_input_nodes)
    effects = [n for n in old if comm_kind(n) == "request" or str(n.target).endswith("_")]
    assert sorted(effects, key=pos.__getitem__) == effects
    # an in-place write keeps its place among the nodes that read the memory it writes
    for w in (n for n in old if str(n.target).endswith("_")):
        mem = view_bases(w.args[0])[-1]
        for r in old:
            if r is not w and any(view_bases(a)[-1] is mem for a in r.all_input_nodes):
                assert (pos[r] < pos[w]) == (old.index(r) < old.index(w)), (r, w)
    # a wait that feeds no request comes after every node not depending on it ... or right
    # before a user; and the schedule is a fixed point.
    gm = fx.GraphModule(nn.Module(), g)
    _apply(gm.graph, order)
    assert schedule(gm.graph) == order
    assert moved_ahead(order, order) == []


# -- a chain of collectives: compute in every window --------------------------------------
def _windows(gm: fx.GraphModule) -> list[tuple[str, list[str]]]:
    """(request, nodes scheduled between it and its wait) for each request with a wait."""
    nodes = list(gm.graph.nodes)
    out = []
    for i, w in enumerate(nodes):
        if comm_kind(w) != "wait":
            continue
        for r in w.all_input_nodes:
            if comm_kind(r) == "request":
                out.append((r.name, [n.name for n in nodes[nodes.index(r) + 1 : i]]))
    return out


class Chain(nn.Module):
    """Three exchanges, each fed by the previous one's result, and a 6-layer dense tower."""

    def __init__(self, group: str) -> None:
        super().__init__()
        self.group = group
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.proj = nn.Linear(4, 4)

    def forward(self, dense: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d = self.mlp(dense)  # written first: nothing overlaps as written
        for _ in range(3):
            x = self.proj(WAIT(A2A(x, [2, 2], [2, 2], self.group)))
        return d.sum() + x.sum()


def test_chain_gets_compute_in_every_window(fake_pg: str) -> None:
    gm = capture_symbolic(Chain(fake_pg))
    order = schedule(gm.graph)
    _apply(gm.graph, order)
    windows = _windows(gm)
    assert len(windows) == 3
    placed = [[n for n in between if n.startswith("mlp_")] for _, between in windows]
    assert all(placed), windows
    # topological order kept inside the tower, and all of it placed in windows
    assert [n for p in placed for n in p] == [f"mlp_{i}" for i in range(6)]
    assert schedule(gm.graph) == list(gm.graph.nodes)


def test_chain_split_follows_costs(fake_pg: str) -> None:
    model = Chain(fake_pg)
    model.mlp[2] = nn.Linear(8, 512)  # one layer carries most of the work
    model.mlp[4] = nn.Linear(512, 8)
    example = (torch.randn(4, 8), torch.randn(4, 4))
    opt = fxrec.optimize(model, example, rules=["overlap_comm"], check=False)
    placed = [[n for n in b if n.startswith("mlp_")] for _, b in _windows(_optimized_graph(opt))]
    assert all(placed), placed
    # the heavy pair does not share a window: each gets its own exchange to hide
    assert not any({"mlp_2", "mlp_4"} <= set(p) for p in placed), placed
    gm = _optimized_graph(opt)
    assert schedule(gm.graph) == list(gm.graph.nodes)


def test_sharded_collection_chain_on_fake_group(fake_pg: str) -> None:
    from fxrec.bench.overlap import DenseFirstDLRM
    from fxrec.distributed import shard
    from tests.distributed.test_sharded_ebc import make_ebc

    model = DenseFirstDLRM(shard(make_ebc(n_tables=4)), 6, 16, 20)
    gm = capture_symbolic(model)
    requests = [n.name for n in gm.graph.nodes if comm_kind(n) == "request"]
    _apply(gm.graph, schedule(gm.graph))
    windows = _windows(gm)
    assert [r for r, _ in windows] == ["request_counts", "send_ids", "request_pooled"]
    for _, between in windows:
        assert any(n.startswith("dense_") for n in between), windows
    assert [n.name for n in gm.graph.nodes if comm_kind(n) == "request"] == requests
    assert schedule(gm.graph) == list(gm.graph.nodes)


class WrittenAfterRead(nn.Module):
    """The dense output is read next to the pooled embeddings, then activated in place: the
    write (free compute the rule likes to move into an exchange's window) must stay after
    that read."""

    def __init__(self, sparse: nn.Module, width: int) -> None:
        super().__init__()
        self.bottom = nn.Linear(6, 8)
        self.sparse = sparse
        self.act = nn.ReLU(inplace=True)
        self.over = nn.Linear(16 + width, 1)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        h = self.bottom(dense)
        wide = torch.cat([h, self.sparse(features).values()], 1)
        return self.over(torch.cat([wide, self.act(h)], 1))


def test_in_place_write_stays_after_earlier_readers(fake_pg: str) -> None:
    from fxrec.distributed import shard
    from tests.distributed.test_sharded_ebc import make_ebc

    ebc = make_ebc(n_tables=4)
    width = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
    gm = capture_symbolic(WrittenAfterRead(shard(ebc), width))
    order = schedule(gm.graph)
    assert order is not None
    names = [n.name for n in order]
    assert names.index("cat") < names.index("act")


# -- the real thing: sharded collection + dense arch on 2 gloo ranks ------------------------
class TinyDLRM(nn.Module):
    def __init__(self, sparse: nn.Module, width: int) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
        self.sparse = sparse
        self.over = nn.Linear(8 + width, 1)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        d = self.dense(dense)  # dense first, as TorchRec's DLRM
        kt = self.sparse(features)
        return self.over(torch.cat([d, kt.values()], 1))


def tiny_sharded_dlrm(row_wise: tuple[str, ...]) -> tuple[nn.Module, TinyDLRM]:
    """The 4-table test collection, sharded (``row_wise`` tables by rows), in a TinyDLRM."""
    from fxrec.distributed import shard
    from tests.distributed.test_sharded_ebc import make_ebc

    ebc = make_ebc(n_tables=4)
    torch.manual_seed(5)
    width = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
    return ebc, TinyDLRM(shard(ebc, row_wise=row_wise), width)


def check_steps(
    model: nn.Module, run, ebc: nn.Module, rank: int, check, sizes: Sequence[int] | None = None
) -> None:
    """Training steps of ``run`` against ``model`` on fresh batches (local batch sizes
    ``sizes``, by default two of 4 + rank): ``check(got, want)`` on the outputs and on every
    parameter's gradient, read by its original name."""
    from tests.distributed.test_sharded_ebc import make_batch

    def zero() -> None:
        model.zero_grad()
        if isinstance(run, nn.Module):
            run.zero_grad()

    def grads() -> dict:
        fused = getattr(run, "fxrec_fused", None)
        if fused is not None:
            return fused.grads(model)
        return {k: p.grad for k, p in model.named_parameters()}

    for step, batch in enumerate(sizes or (4 + rank, 4 + rank)):
        kjt = make_batch(ebc, rank + 10 * step, batch, False)
        dense = torch.randn(batch, 6, generator=torch.Generator().manual_seed(step))
        ref = model(dense, kjt)
        ref.sum().backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters()}
        zero()
        got = run(dense, kjt)
        got.sum().backward()
        check(got, ref)
        for k, g in grads().items():
            check(g, want[k])
        zero()


def _identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want)


def _dlrm_overlapped(rank: int, world: int, row_wise: tuple[str, ...]) -> None:
    from tests.distributed.test_sharded_ebc import make_batch

    ebc, model = tiny_sharded_dlrm(row_wise)
    batch = 4 + rank
    kjt = make_batch(ebc, rank, batch, False)
    dense = torch.randn(batch, 6, generator=torch.Generator().manual_seed(rank))
    opt = fxrec.optimize(model, (dense, kjt), rules=["overlap_comm"])
    assert opt.fxrec_report.count("overlap_comm") == 1, str(opt.fxrec_report)
    gm = _optimized_graph(opt)
    windows = _windows(gm)
    assert [r for r, _ in windows] == ["request_counts", "send_ids", "request_pooled"]
    for req, between in windows:
        assert any(n.startswith("dense_") for n in between), (req, between)
    check_steps(model, opt, ebc, rank, _identical)  # only the order changed: bit for bit


@pytest.mark.distributed
@pytest.mark.parametrize("row_wise", [(), ("t0", "t2")])
def test_overlap_on_two_gloo_ranks(row_wise: tuple[str, ...]) -> None:
    # with row-wise tables the ids are routed to their row blocks inside the first window's
    # cone, and the shards' partial sums merged after the last wait
    run_ranks(2, _dlrm_overlapped, row_wise)


def test_compute_nice_lowers_the_calling_thread_only() -> None:
    # The overlap benchmark's --compute-nice: the compute thread yields to threads started
    # before (gloo's), which keep their priority.
    import os
    import threading

    from fxrec.bench.overlap import _lower_this_thread

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        _lower_this_thread(2)
        seen.append((os.getpriority(os.PRIO_PROCESS, tid), min(19, before + 2)))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    (got, want) = seen[0]
    assert got == want  # nice values stop at 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
