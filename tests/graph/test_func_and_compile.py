"""An optimized module under ``torch.func`` transforms and next to ``torch.compile``.

Per-sample gradients (``vmap(grad(functional_call(opt, ...)))``) run the model eagerly on
the tensors given; ``fxrec.optimize(torch.compile(m))`` optimizes the model the compile
wraps (and says so); ``torch.compile(fxrec.optimize(m))`` calls the optimized module as one
opaque call instead of tracing its per-call bookkeeping.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import fxrec
from tests.graph.test_drop_in import TOL, D
from tests.graph.test_hook_calls import Slices
from tests.records import recorded


def _per_sample_grads(module: nn.Module, params: dict, x: torch.Tensor) -> dict:
    def loss(p: dict, xi: torch.Tensor) -> torch.Tensor:
        return functional_call(module, p, (xi[None],)).sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, x)


def _batch_grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(module(x).sum(), list(params.values()))
    return dict(zip(params, grads))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_per_sample_gradients(untraceable: bool) -> None:
    torch.manual_seed(0)
    model = Slices(untraceable=untraceable, out=1)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    assert len(list(opt.parameters())) < len(list(ref.parameters()))  # laid out
    x = torch.randn(6, 4 * D)
    expected = _per_sample_grads(ref, {k: v.detach() for k, v in ref.named_parameters()}, x)
    for _ in range(2):  # the first call and a later one
        # by the model's names: the members, each given its own tensor
        given = {f"model.{k}": v.detach() for k, v in model.named_parameters()}
        got = _per_sample_grads(opt, given, x)
        for name, g in expected.items():
            torch.testing.assert_close(got[f"model.{name}"], g, rtol=TOL, atol=TOL, msg=name)
        # by the optimized module's names: the flat parameters; samples sum to the batch's
        got = _per_sample_grads(opt, {k: v.detach() for k, v in opt.named_parameters()}, x)
        for name, g in _batch_grads(opt, x).items():
            torch.testing.assert_close(got[name].sum(0), g, rtol=TOL, atol=TOL, msg=name)
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)  # graphs still serve calls


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_optimize_of_a_compiled_model_optimizes_the_model(untraceable: bool) -> None:
    torch.manual_seed(0)
    model = Slices(untraceable=untraceable, out=1)
    twin, ref = copy.deepcopy(model), copy.deepcopy(model)
    example = (torch.randn(16, 4 * D),)
    with recorded("fxrec.graph.module") as records:
        opt = fxrec.optimize(torch.compile(model, backend="eager"), example)
    assert any("torch.compile" in m and 'backend="inductor"' in m for m in records.messages)
    assert opt.model is model
    plain = fxrec.optimize(twin, example)
    assert opt.fxrec_report.kernels_after == plain.fxrec_report.kernels_after
    assert opt.fxrec_report.kernels_after[0] < opt.fxrec_report.kernels_before[0]
    assert len(list(opt.parameters())) == len(list(plain.parameters()))
    x = torch.randn(16, 4 * D)
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    expected = _batch_grads(plain, x)  # the same layouts: the same names
    for name, g in _batch_grads(opt, x).items():
        torch.testing.assert_close(g, expected[name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_torch_compile_of_an_optimized_module_breaks_its_graph_once(untraceable: bool) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Slices(untraceable=untraceable, out=1)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(opt, backend="eager")
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(16, 4 * D)
        for sgd, module in ((sgd_opt, compiled), (sgd_ref, ref)):
            sgd.zero_grad()
            out = module(x)
            out.sum().backward()
            sgd.step()
            if module is compiled:
                got = out
        torch.testing.assert_close(got, out, rtol=TOL, atol=TOL)
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[name], value, rtol=TOL, atol=TOL, msg=name)
