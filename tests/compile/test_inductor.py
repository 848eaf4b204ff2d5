"""fxrec inside Inductor: the pre-grad custom pass, its cache key, and the Inductor backend.

Inductor's C++ build is slow on 2 shared cores, so compiles here are few and tiny.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import fxrec
from fxrec.bench.models import SeedPattern
from tests.compile.helpers import (
    assert_same,
    compiled_matches_eager,
    dynamo_graph,
    op_count,
    outputs_and_grads,
)


def four_tanh(x: torch.Tensor) -> torch.Tensor:
    a, b, c, d = torch.split(x, 4, 1)
    return torch.cat([a.tanh(), torch.tanh(b), F.tanh(c), d.tanh()], 1) * 2


def test_uuid_is_stable_and_follows_the_rule_set() -> None:
    a, b = fxrec.inductor_pass(), fxrec.inductor_pass()
    assert isinstance(a, CustomGraphPass)
    assert a.uuid() == b.uuid() and isinstance(a.uuid(), str)
    others = {
        fxrec.inductor_pass(exclude=["parallel_unary"]).uuid(),
        fxrec.inductor_pass(rules=["parallel_unary"]).uuid(),
        fxrec.inductor_pass(rules=["parallel_unary", "cat_of_split"]).uuid(),
    }
    assert len(others) == 3 and a.uuid() not in others
    from torch._inductor.codecache import resolve_pre_grad_pass_timing

    with inductor_config.patch(pre_grad_custom_pass=a):
        assert resolve_pre_grad_pass_timing() == "late"  # runs after the cache lookup: cacheable


def test_unknown_rule_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown rule"):
        fxrec.inductor_pass(rules=["no_such_rule"])


def test_pass_on_a_dynamo_graph() -> None:
    x = torch.randn(3, 16)
    gm, _ = dynamo_graph(four_tanh, x)
    graph = gm.graph
    before = op_count(gm)
    p = fxrec.inductor_pass()
    p(graph)
    assert gm.graph is graph  # edited in place: Inductor keeps holding this object
    assert p.report.count("parallel_unary") == 1 and op_count(gm) < before
    torch.testing.assert_close(gm(x)[0], four_tanh(x))
    for node in graph.nodes:
        if node.op == "call_function":
            assert "example_value" in node.meta, node.name


def four_towers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Separate inputs (x @ w_i): fusing their LayerNorms and tanhs needs a stack per step.
    hs = [F.layer_norm(x @ w[i], (8,)) for i in range(4)]
    return torch.cat([h.tanh() for h in hs], 1)


def test_on_cpu_sets_that_copy_separate_inputs_are_left_to_inductor() -> None:
    x, w = torch.randn(3, 8), torch.randn(4, 8, 8)
    gm, inputs = dynamo_graph(four_towers, x, w)
    p = fxrec.inductor_pass()
    p(gm.graph)
    assert p.report.count() == 0  # Inductor fuses each tower's chain itself: no stack pays
    left = {r.rule: r.reason for r in p.report.refusals}
    assert "Inductor on CPU" in left["parallel_layer_norm"]
    torch.testing.assert_close(gm(*inputs)[0], four_towers(x, w))
    # Outside Inductor the stack pays; inside, pieces of one tensor (four_tanh above) copy
    # nothing and still fuse.
    from fxrec.graph.optimize_graph import optimize_graph, resolve_rules

    eager = optimize_graph(dynamo_graph(four_towers, x, w)[0], resolve_rules(), runs_eagerly=True)
    assert eager.count("parallel_layer_norm") == 1


def test_device_type_comes_from_the_graph_inputs() -> None:
    from fxrec.compile.inductor import _device_type

    g = fx.Graph()
    g.placeholder("x").meta["example_value"] = torch.empty(2, 3, device="meta")
    assert _device_type(g) == "meta"
    assert _device_type(fx.Graph()) == "cpu"


def test_nodes_without_metadata_are_skipped_with_a_reason() -> None:
    gm = fx.symbolic_trace(four_tanh)  # no example_value / val anywhere
    code = gm.code
    p = fxrec.inductor_pass()
    p(gm.graph)
    assert p.report.count() == 0 and gm.code == code
    assert any("without example_value/val" in n for n in p.report.notes)


@pytest.mark.slow
def test_pre_grad_pass_training_matches_eager() -> None:
    seed = SeedPattern(4, d=8)
    x = torch.randn(5, 32, requires_grad=True)
    want = outputs_and_grads(seed, (x,))
    p = fxrec.inductor_pass()
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), inductor_config.patch(pre_grad_custom_pass=p):  # the pass must run
        twin = copy.deepcopy(seed)
        compiled = torch.compile(twin)
        assert_same(outputs_and_grads(twin, (x,), compiled), want)
        assert p.report.count() > 0
        y = compiled(x)
        y0 = y.detach().clone()
        y.sum().backward()
        assert torch.equal(y, y0)  # the backward never writes into a returned output


def _compile_once(p: CustomGraphPass, x: torch.Tensor) -> torch.Tensor:
    counters.clear()
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(pre_grad_custom_pass=p, fx_graph_cache=True):
        return torch.compile(four_tanh)(x)


@pytest.mark.slow
def test_graph_cache_keyed_by_rule_set() -> None:
    from torch._inductor.utils import fresh_cache

    x = torch.randn(3, 16)
    with fresh_cache():
        first = fxrec.inductor_pass()
        torch.testing.assert_close(_compile_once(first, x), four_tanh(x))
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert first.report.count("parallel_unary") == 1
        # Same graph, another rule set: another cache key, so a miss and a fresh compile.
        other = fxrec.inductor_pass(exclude=["parallel_unary"])
        torch.testing.assert_close(_compile_once(other, x), four_tanh(x))
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert counters["inductor"]["fxgraph_cache_hit"] == 0
        # A fresh pass object with the first rule set: served from the cache.
        torch.testing.assert_close(_compile_once(fxrec.inductor_pass(), x), four_tanh(x))
        assert counters["inductor"]["fxgraph_cache_hit"] == 1


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin(torch.relu(p)) for lin, p in zip(self.a, torch.split(x, 8, 1))], 1)


@pytest.mark.slow
def test_compile_backend_with_inductor_training() -> None:
    # fxrec rewrites before Inductor sees the graph, so Inductor's cache keys the result.
    be = fxrec.compile_backend("inductor")
    compiled_matches_eager(Towers(), (torch.randn(4, 24, requires_grad=True),), be)
    assert be.report.count("parallel_unary") == 1  # relu over pieces of x: no copy
    # On CPU, Inductor's three GEMMs beat one bmm over the stacked members.
    left = {r.rule: r.reason for r in be.report.refusals}
    assert "Inductor on CPU" in left["parallel_linear_batched"]
