"""Direct calls of one-graph dynamo captures: same results as dynamo, and only when safe.

Each model here needs dynamo (symbolic tracing fails on ``x.dim()``). A direct call must give
the outputs and gradients of the eager model on fresh inputs; anything dynamo's code does
besides calling the graph (graph breaks, attribute writes, returning an input) keeps dynamo
in charge, and the behaviour of that code is kept.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import fxrec
from fxrec.bench.models import RankingModel
from fxrec.compile.direct import input_paths, plain_graph_call
from fxrec.graph.module import _DynamoRunner


def _runner(opt: fxrec.OptimizedModule) -> _DynamoRunner:
    (runner,) = [r for r in opt._runners.values() if isinstance(r, _DynamoRunner)]
    return runner


def _ranking() -> RankingModel:
    return RankingModel(num_sparse=6, dim=8, rows=40, tasks=("a", "b"), tower_hidden=(16,))


def _outputs_and_grads(run: nn.Module, model: nn.Module, args: tuple) -> tuple[list, list]:
    """Outputs of ``run(*args)`` and ``model``'s gradients by name (through flat layouts)."""
    run.zero_grad(set_to_none=True)
    out = run(*args)
    flat = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
    sum((o * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum() for o in flat).backward()
    fused = getattr(run, "fxrec_fused", None)
    grads = (
        fused.grads(model)
        if fused is not None
        else dict((n, p.grad) for n, p in model.named_parameters())
    )
    return [o.detach() for o in flat], [grads[n] for n, _ in model.named_parameters()]


def test_one_graph_model_is_called_directly_with_eager_outputs_and_grads() -> None:
    model = _ranking()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, model.example(4))
    runner = _runner(opt)
    assert runner.direct is not None
    assert "skip dynamo's guards" in str(opt.fxrec_report)
    for _ in range(3):
        args = model.example(4)
        got = _outputs_and_grads(opt, model, args)
        want = _outputs_and_grads(ref, ref, args)
        assert isinstance(opt(*args), dict) and list(opt(*args)) == ["a", "b"]
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_direct_call_skips_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ranking()
    opt = fxrec.optimize(model, model.example(4))
    runner = _runner(opt)

    def fail(*args: Any) -> Any:
        raise AssertionError("went through dynamo")

    monkeypatch.setattr(runner, "compiled", fail)
    opt(*model.example(4))  # grad mode as on the first call: direct
    with torch.no_grad():
        opt(*model.example(4))  # another grad mode: a capture of its own, not this one
    assert len({id(r) for r in opt._runners.values()}) == 2


def test_other_grad_mode_goes_through_dynamo_and_matches() -> None:
    model = _ranking()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, model.example(4))
    args = model.example(4)
    with torch.no_grad():
        got, want = opt(*args), ref(*args)
    for a, b in zip(tree_leaves(got), tree_leaves(want)):
        assert not a.requires_grad
        torch.testing.assert_close(a, b)


def test_guards_option_keeps_dynamo_in_charge() -> None:
    model = _ranking()
    opt = fxrec.optimize(model, model.example(4), guards=True)
    assert _runner(opt).direct is None
    assert "skip dynamo's guards" not in str(opt.fxrec_report)


class Counting(nn.Module):
    """Writes an attribute in ``forward``: dynamo replays the write after its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:
            self.calls += 1
        return torch.cat([n(p) for n, p in zip(self.norms, torch.split(x, 4, 1))], 1)


class Breaking(nn.Module):
    """A graph break between two fusable halves."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:
            x = x * 1.0
        a = torch.cat([n(p) for n, p in zip(self.norms[:2], torch.split(x[:, :8], 4, 1))], 1)
        torch._dynamo.graph_break()
        b = torch.cat([n(p) for n, p in zip(self.norms[2:], torch.split(x[:, 8:], 4, 1))], 1)
        return torch.cat([a, b], 1)


class PassThrough(nn.Module):
    """Returns one of its inputs as is: that output is not the graph's."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(2))

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() > 1:
            x = x * 1.0
        return torch.cat([n(p) for n, p in zip(self.norms, torch.split(x, 4, 1))], 1), extra


def test_attribute_write_keeps_dynamo_and_the_write_happens() -> None:
    model = Counting()
    opt = fxrec.optimize(model, (torch.randn(2, 12),))
    assert _runner(opt).direct is None
    before = model.calls
    for _ in range(3):
        opt(torch.randn(2, 12))
    assert model.calls == before + 3


def test_graph_break_keeps_dynamo_with_eager_results() -> None:
    model = Breaking()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(3, 16),))
    assert _runner(opt).direct is None
    assert "graph breaks" in str(opt.fxrec_report)
    x = torch.randn(3, 16)
    torch.testing.assert_close(opt(x), ref(x))


def test_input_returned_as_is_keeps_dynamo() -> None:
    model = PassThrough()
    opt = fxrec.optimize(model, (torch.randn(2, 8), torch.randn(2)))
    assert _runner(opt).direct is None
    extra = torch.randn(2)
    assert opt(torch.randn(2, 8), extra)[1] is extra


def test_same_tensor_twice_on_the_first_call_keeps_dynamo() -> None:
    model = _ranking()
    dense, sparse = model.example(4)
    name = model.feature_names[0]
    sparse[model.feature_names[1]] = sparse[name]  # same bag size: both (4, 1)
    opt = fxrec.optimize(model, (dense, sparse))
    assert _runner(opt).direct is None


def test_plain_graph_call_rejects_writes_and_other_calls() -> None:
    def store(obj: Any, f: Any) -> Any:
        obj.x = 1
        return f(obj)

    def two_calls(f: Any, g: Any) -> Any:
        return f(g())

    for fn in (store, two_calls):
        assert not plain_graph_call(fn.__code__)


def test_input_paths_read_items_and_attributes() -> None:
    from torch._dynamo.source import AttrSource, DictGetItemSource, GetItemSource, LocalSource

    dense = LocalSource("dense", is_input=True)
    sparse = LocalSource("sparse", is_input=True)
    srcs = [dense, DictGetItemSource(sparse, "f1"), AttrSource(GetItemSource(sparse, "f2"), "t")]
    read = input_paths(srcs, ["dense", "sparse"])
    assert read is not None

    class Box:
        t = torch.ones(1)

    d, box = torch.zeros(1), Box()
    out = read(d, {"f1": torch.ones(2), "f2": box})
    assert out[0] is d and out[2] is Box.t and out[1].shape == (2,)
    assert input_paths([LocalSource("self", is_input=True)], ["dense"]) is None
    assert (
        input_paths([GetItemSource(sparse, slice(0, 1), index_is_slice=True)], ["sparse"]) is None
    )
