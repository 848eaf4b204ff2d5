"""``fxrec.compile_backend`` on dynamo's graphs: equivalence, graph breaks, dynamic shapes,
recompiles, sparse ops, and the safety cases Inductor's own batch fusions get wrong.

Inner backends here are ``eager``/``aot_eager`` (no C++ build): the rewrite is what is tested.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxrec
from fxrec.bench.models import ParallelTowers, SeedPattern
from fxrec.compile import run_inductor_fusions
from fxrec.graph.meta import TensorInfo
from fxrec.graph.optimize_graph import optimize_graph, resolve_rules
from tests.compile.helpers import (
    GraphRecorder,
    assert_same,
    compiled_matches_eager,
    dynamo_graph,
    op_count,
    outputs_and_grads,
)
from tests.records import recorded


class Spellings(nn.Module):
    """Eight slices, four spellings of tanh and of sigmoid: all one op each to fxrec."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.split(x, 4, 1)
        t = [p[0].tanh(), torch.tanh(p[1]), F.tanh(p[2]), p[3].tanh()]
        s = [F.sigmoid(p[4]), torch.sigmoid(p[5]), p[6].sigmoid(), F.sigmoid(p[7])]
        r = [torch.relu(p[0]), p[1].relu(), F.relu(p[2]), torch.relu(p[3])]
        return torch.cat(t + s + r, 1)


def _fired(report: fxrec.Report, rule: str) -> list[list[str]]:
    return [f.nodes for f in report.firings if f.rule == rule]


def test_spellings_fuse_and_match_eager() -> None:
    be = fxrec.compile_backend("aot_eager")
    x = torch.randn(5, 32, requires_grad=True)
    compiled_matches_eager(Spellings(), (x,), be)
    groups = _fired(be.report, "parallel_unary")
    assert sorted(len(g) for g in groups) == [4, 4, 4]  # tanh, sigmoid, relu: all spellings


def test_fxrec_removes_at_least_as_many_nodes_as_inductor_fusions() -> None:
    x = torch.randn(5, 32)
    gm, _ = dynamo_graph(Spellings(), x)
    ours = copy.deepcopy(gm)
    optimize_graph(ours, resolve_rules())
    theirs = copy.deepcopy(gm)
    run_inductor_fusions(theirs)
    assert op_count(ours) < op_count(gm)
    assert op_count(ours) <= op_count(theirs)
    torch.testing.assert_close(ours(x)[0], Spellings()(x))


def test_seed_pattern_and_towers_match_eager_in_training() -> None:
    be = fxrec.compile_backend("aot_eager")
    seed = SeedPattern(6, d=8)
    compiled_matches_eager(seed, seed.example(4), be)
    assert be.report.count() > 0
    towers = ParallelTowers(towers=3, d_in=8, hidden=(8, 4))
    compiled_matches_eager(towers, towers.example(4), be)


class Lookups(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(20, 4) for _ in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([e(ids[:, i]) for i, e in enumerate(self.embs)], 1)


def test_fused_lookups_compile_further() -> None:
    """The fused lookup's constant table offsets belong to the graph module, which
    AOTAutograd takes as it is (dynamo recorded no source for them)."""
    be = fxrec.compile_backend("aot_eager")
    compiled_matches_eager(Lookups(), (torch.randint(0, 20, (4096, 8)),), be)
    assert _fired(be.report, "parallel_embedding")


def test_inference_under_no_grad() -> None:
    seed = SeedPattern(4, d=8).eval()
    (x,) = seed.example(3)
    compiled = torch.compile(copy.deepcopy(seed), backend=fxrec.compile_backend("eager"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), seed(x))


class Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.tanh(p) for p in torch.split(x, 4, 1)], 1)
        torch._dynamo.graph_break()
        return torch.cat([torch.sigmoid(p) for p in torch.split(h * 2, 4, 1)], 1)


def test_graph_break_optimizes_each_graph() -> None:
    rec = GraphRecorder()
    be = fxrec.compile_backend(rec)
    compiled_matches_eager(Broken(), (torch.randn(3, 16, requires_grad=True),), be)
    assert len(rec.graphs) == 2
    fused_ops = {f.detail.split()[0] for f in be.report.firings if f.rule == "parallel_unary"}
    assert fused_ops == {"tanh", "sigmoid"}  # one group in each graph


def _graphs_compiled(backend_factory, calls) -> int:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    rec = GraphRecorder()
    model = SeedPattern(4, d=8)
    compiled = torch.compile(model, backend=backend_factory(rec))
    for train, batch in calls:
        model.train(train)
        compiled(torch.randn(batch, 32))
    return len(rec.graphs)


def test_no_recompiles_added() -> None:
    calls = [(True, 4), (True, 4), (True, 6), (True, 9), (False, 9), (False, 9)]
    plain = _graphs_compiled(lambda rec: rec, calls)
    ours = _graphs_compiled(lambda rec: fxrec.compile_backend(rec), calls)
    assert ours == plain


def test_dynamic_shapes_skip_symbolic_and_stay_correct() -> None:
    rec = GraphRecorder()
    be = fxrec.compile_backend(rec)
    seed = SeedPattern(4, d=8)
    twin = copy.deepcopy(seed)
    compiled = torch.compile(twin, backend=be, dynamic=True)
    for batch in (3, 5, 8):
        x = torch.randn(batch, 32, requires_grad=True)
        assert_same(outputs_and_grads(twin, (x,), compiled), outputs_and_grads(seed, (x,)))
    assert len(rec.graphs) == 1  # one graph serves every batch size: nothing was baked in
    x_node = next(
        n for n in rec.graphs[0].graph.nodes if n.op == "placeholder" and n.name == "l_x_"
    )
    ti = TensorInfo.of(x_node.meta["example_value"])
    assert not ti.static and ti.shape[1] == 32
    assert any(n.startswith("dynamic shapes") for n in be.report.notes), be.report.notes


def test_new_nodes_get_example_values() -> None:
    rec = GraphRecorder()
    be = fxrec.compile_backend(rec)
    torch.compile(Spellings(), backend=be)(torch.randn(2, 32))
    assert be.report.count("parallel_unary") == 3
    for node in rec.graphs[0].graph.nodes:
        if node.op.startswith("call"):
            assert isinstance(node.meta.get("example_value"), (torch.Tensor, tuple, list)), node


def test_permute_and_split_op_in_graph() -> None:
    import fxrec.sparse.ops

    def f(values: torch.Tensor, lengths: torch.Tensor, w: torch.Tensor):  # type: ignore[no-untyped-def]
        _, lens, wts = torch.ops.fxrec.permute_and_split(
            values, lengths, w, [2, 2, 2], [3, 4, 5], [2, 0, 1]
        )
        return torch.cat([torch.tanh(t) for t in wts]), torch.cat(lens)

    values = torch.randint(0, 9, (12,))
    lengths = torch.tensor([1, 2, 2, 2, 3, 2])
    w = torch.rand(12, requires_grad=True)
    be = fxrec.compile_backend("aot_eager")
    got = torch.compile(f, backend=be, fullgraph=True)(values, lengths, w)
    want = f(values, lengths, w)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    (g1,) = torch.autograd.grad(got[0].sum(), w)
    (g2,) = torch.autograd.grad(want[0].sum(), w)
    torch.testing.assert_close(g1, g2)
    assert be.report.count("parallel_unary") == 1


def test_keyed_jagged_tensor_input() -> None:
    from fxrec.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        ["a", "b", "c"], torch.arange(9), torch.rand(9), lengths=torch.tensor([2, 0, 1, 2, 1, 3])
    )

    def f(k: KeyedJaggedTensor) -> torch.Tensor:
        d = k.to_dict()
        return torch.cat([torch.sigmoid(d[key].weights()) for key in ("a", "b", "c")])

    got = torch.compile(f, backend=fxrec.compile_backend("aot_eager"), fullgraph=True)(kjt)
    assert torch.equal(got, f(kjt))


# -- the cases Inductor's batch fusions get wrong ------------------------------------------------


class MixedDtypes(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        xs, ys = torch.split(x, 4, 1), torch.split(y, 4, 1)
        return [torch.tanh(t) for t in (xs[0], ys[0], xs[1], ys[1], xs[2], ys[2])]


def test_mixed_fp32_bf16_never_batched_together() -> None:
    x = torch.randn(3, 12, requires_grad=True)
    y = torch.randn(3, 12, dtype=torch.bfloat16, requires_grad=True)
    be = fxrec.compile_backend("aot_eager")
    compiled_matches_eager(MixedDtypes(), (x, y), be)  # dtype of every output checked
    assert sorted(len(g) for g in _fired(be.report, "parallel_unary")) == [3, 3]


class InplaceRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        hs = [p * 2 for p in torch.split(x, 4, 1)]
        F.relu(hs[0], inplace=True)
        hs[1].relu_()
        self.act(hs[2])
        torch.relu_(hs[3])
        return hs  # the values written in place, read through the original tensors


def test_inplace_relu_effect_kept() -> None:
    x = torch.randn(3, 16, requires_grad=True)
    be = fxrec.compile_backend("aot_eager")
    compiled_matches_eager(InplaceRelu(), (x,), be)
    assert be.report.count("parallel_unary") == 0


class InplaceOnSlices(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        for i in range(4):
            F.relu(h[:, 4 * i : 4 * i + 4], inplace=True)
        return h


def test_inplace_relu_on_slices_effect_kept() -> None:
    compiled_matches_eager(
        InplaceOnSlices(), (torch.randn(3, 16),), fxrec.compile_backend("aot_eager")
    )


class Clamps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.split(x, 4, 1)
        return torch.cat(
            [
                torch.clamp(p[0], -0.5, 0.5),
                p[1].clamp(-0.5, 0.5),
                torch.clamp(p[2], min=-0.5, max=0.5),
                torch.clamp(p[3], -0.1, 0.2),  # other bounds: never in the same group
                torch.clip(p[4], -0.5),
            ],
            1,
        )


def test_clamp_positional_bounds_kept() -> None:
    be = fxrec.compile_backend("aot_eager")
    compiled_matches_eager(Clamps(), (torch.randn(3, 20, requires_grad=True) * 2,), be)
    assert sorted(len(g) for g in _fired(be.report, "parallel_unary")) == [3]


def test_bad_inner_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="inner backend"):
        fxrec.compile_backend("no_such_backend")


class _InductorConfigs:
    """Stands in for Inductor's ``compile_fx``: keeps the config each graph is compiled with
    and runs the graph eagerly (what reaches Inductor is tested, without its C++ build)."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: object) -> object:
        self.patches.append(dict(kwargs.get("config_patches") or {}))
        return gm.forward


@pytest.mark.parametrize(
    "how", [{"mode": "max-autotune-no-cudagraphs"}, {"options": {"epilogue_fusion": False}}]
)
def test_compile_mode_and_options_reach_inductor(how: dict, monkeypatch: pytest.MonkeyPatch):
    """``torch.compile(..., mode=/options=)`` hands them to its backend as keyword arguments:
    Inductor behind fxrec gets the config ``torch.compile(backend="inductor")`` gives it."""
    import torch._inductor.compile_fx as compile_fx_module

    seed = SeedPattern(6, d=8)
    args = seed.example(4)
    plain, ours = _InductorConfigs(), _InductorConfigs()
    monkeypatch.setattr(compile_fx_module, "compile_fx", plain)
    torch._dynamo.reset()
    torch.compile(copy.deepcopy(seed), **how)(*args)
    monkeypatch.setattr(compile_fx_module, "compile_fx", ours)
    torch._dynamo.reset()
    be = fxrec.compile_backend("inductor")
    twin = copy.deepcopy(seed)
    compiled = torch.compile(twin, backend=be, dynamic=False, **how)
    assert_same(outputs_and_grads(twin, args, compiled), outputs_and_grads(seed, args))
    assert be.report.count() > 0
    assert plain.patches and plain.patches[0]  # the mode or options made a config
    assert ours.patches and all(p == plain.patches[0] for p in ours.patches)


def test_compile_mode_with_eager_inner_is_ignored_with_a_warning() -> None:
    """As dynamo's own ``eager`` backend does; ``aot_eager`` gets them and decides itself."""
    seed = SeedPattern(6, d=8)
    args = seed.example(4)
    for inner in ("eager", "aot_eager"):
        torch._dynamo.reset()
        be = fxrec.compile_backend(inner)
        twin = copy.deepcopy(seed)
        with recorded("fxrec") as logs:
            compiled = torch.compile(twin, backend=be, mode="max-autotune-no-cudagraphs")
            got = outputs_and_grads(twin, args, compiled)
        assert_same(got, outputs_and_grads(seed, args))
        assert be.report.count() > 0
        warned = [m for m in logs.messages if "ignores" in m and "max-autotune" in m]
        assert bool(warned) == (inner == "eager")


def test_compile_mode_reaches_a_callable_inner_that_takes_it_and_no_other() -> None:
    """A callable inner backend gets them as dynamo's backends do; one without the keyword
    arguments gets an error saying what to do, not Python's unexpected keyword argument."""
    seen: list[dict] = []

    def takes_options(gm: fx.GraphModule, example_inputs: list, **kwargs: object) -> object:
        seen.append(kwargs)
        return gm.forward

    def takes_none(gm: fx.GraphModule, example_inputs: list) -> object:
        return gm.forward

    seed = SeedPattern(6, d=8)
    args = seed.example(4)
    torch._dynamo.reset()
    be = fxrec.compile_backend(takes_options)
    compiled = torch.compile(seed, backend=be, mode="reduce-overhead")
    torch.testing.assert_close(compiled(*args), seed(*args))
    assert seen == [{"mode": "reduce-overhead"}] and be.report.count() > 0
    torch._dynamo.reset()
    compiled = torch.compile(seed, backend=fxrec.compile_backend(takes_none), options={"a": 1})
    with pytest.raises(Exception, match="takes no such argument"):
        compiled(*args)
