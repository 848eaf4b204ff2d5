"""A fused member is a strided slice of the fused result, which ``.view()`` refuses; eager
results are contiguous. A member ``.view()``-ed through other views of it (``unsqueeze``,
``detach``, slicing, ``reshape``, a split's piece) or ``view_as``-ed stays its own tensor:
fused, the model's own ``view`` raised inside ``fxrec.optimize`` and compiled graphs. Each
case is compared with the model on fresh inputs, outputs and gradients (input and
parameters), through ``fxrec.optimize``, ``compile_backend`` and the Inductor pass."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxrec
from tests.compile.helpers import assert_same, dynamo_graph, outputs_and_grads

VIEWS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "unsqueeze": lambda h, x: h.unsqueeze(0).view(-1),
    "detach": lambda h, x: h.detach().view(-1),
    "slice": lambda h, x: h[:, :].view(-1),
    "view_as": lambda h, x: h.view_as(x[0]),
    "reshape": lambda h, x: h.reshape(4, 2, 4).view(-1),
    "split_piece": lambda h, x: h.split(2, 0)[0].view(-1),
    "transpose_twice": lambda h, x: h.t().t().view(-1),
}
CONTIGUOUS = {"contiguous": lambda h, x: h.unsqueeze(0).contiguous().view(-1)}


class ViewedNorms(nn.Module):
    """Four LayerNorms over pieces of one input (they fuse), each result viewed by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hs = [ln(t) for ln, t in zip(self.lns, x.split(8, 1))]
        view = {**VIEWS, **CONTIGUOUS}[self.how]
        return (*(view(h, x) for h in hs), torch.stack(hs).sum(0))


def _model(how: str) -> ViewedNorms:
    model = ViewedNorms(how)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # not the default ones and zeros: gradients tell members apart
    return model


@pytest.mark.parametrize("how", sorted(VIEWS))
def test_optimize(how: str) -> None:
    model = _model(how)
    opt = fxrec.optimize(copy.deepcopy(model), (torch.randn(4, 32),), check=False)
    x = torch.randn(4, 32, requires_grad=True)
    want = outputs_and_grads(model, (x,))
    out, input_grads = outputs_and_grads(opt, (x,))
    params = opt.fxrec_fused.grads(model)
    got = out, [params[n] for n, _ in sorted(model.named_parameters())] + input_grads[-1:]
    assert_same(got, want)


@pytest.mark.parametrize("how", sorted(VIEWS))
def test_compile_backend(how: str) -> None:
    model = _model(how)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=fxrec.compile_backend())
    x = torch.randn(4, 32, requires_grad=True)
    assert_same(outputs_and_grads(twin, (x,), compiled), outputs_and_grads(model, (x,)))
    torch._dynamo.reset()


def _loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    w = [torch.linspace(0.5, 1.5, o.numel()).view(o.shape) for o in outs]
    return sum((o * wi).sum() for o, wi in zip(outs, w) if o.requires_grad)  # type: ignore[return-value]


@pytest.mark.parametrize("how", sorted(VIEWS))
def test_inductor_pass(how: str) -> None:
    """The pass on the graph dynamo hands Inductor, run as it is (Inductor's C++ build is
    slow on 2 cores); parameters are graph inputs there."""
    model = _model(how)
    x = torch.randn(4, 32, requires_grad=True)
    gm, inputs = dynamo_graph(copy.deepcopy(model), x)
    p = fxrec.inductor_pass()
    p(gm.graph)
    assert p.report.count("parallel_layer_norm") == 0  # the members must stay contiguous
    leaves = [a.detach().clone().requires_grad_() for a in inputs]
    got, want = tuple(gm(*leaves)), model(x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    _loss(got).backward()
    _loss(want).backward()
    # the graph takes x and the copy's parameters, in the model's order
    for leaf, ref in zip(leaves, [x, *model.parameters()], strict=True):
        torch.testing.assert_close(leaf.grad, ref.grad)


def test_contiguous_copy_ends_the_search() -> None:
    """``h.contiguous().view(-1)`` views a contiguous tensor: the norms still fuse."""
    model = ViewedNorms("contiguous")
    x = torch.randn(4, 32)
    gm, inputs = dynamo_graph(model, x)
    p = fxrec.inductor_pass()
    p(gm.graph)
    assert p.report.count("parallel_layer_norm") == 1
    for g, w in zip(gm(*inputs), model(x)):
        torch.testing.assert_close(g, w)
