"""Direct calls read a forward's arguments however it declares and reads them.

A ``forward(self, *xs)`` and a forward reading an argument inside a list comprehension (on
Python 3.11 the argument then lives in a cell) are one-graph dynamo captures like any other:
calls after the first skip dynamo's guards, and train exactly as the plain model. A forward
that rebinds such an argument keeps dynamo in charge, and stays right.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxrec
from fxrec.graph.module import _DynamoRunner

N, D = 6, 8
TOL = 1e-5


class VarArgs(nn.Module):
    """One input per LayerNorm, passed as separate arguments after a leading one."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))
        self.head = nn.Linear(N * D + D, 1)

    def forward(self, first: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        if first.dim() > 1:  # a branch on a shape: dynamo captures it
            first = first * 1.0
        outs = [torch.tanh(n(x)) for n, x in zip(self.norms, xs)]
        return self.head(torch.cat([first, *outs], 1))


class CellArg(nn.Module):
    """Reads ``sparse`` inside a comprehension: a cell on Python 3.11."""

    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleDict({f"f{i}": nn.Embedding(20, D) for i in range(N)})
        self.top = nn.Linear(N * D + D, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        e = [self.embs[f"f{i}"](sparse[:, i]) for i in range(sparse.shape[1])]
        return self.top(torch.cat([*e, dense], 1))


class RebindsCell(CellArg):
    """Rebinds the argument it reads in a comprehension."""

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        sparse = sparse.flip(0)
        e = [self.embs[f"f{i}"](sparse[:, i]) for i in range(sparse.shape[1])]
        return self.top(torch.cat([*e, dense], 1))


def _runner(opt: fxrec.OptimizedModule, args: tuple) -> _DynamoRunner:
    """The capture that runs ``args``."""
    runner = opt._runners[opt._key(args, {})]
    assert isinstance(runner, _DynamoRunner)
    return runner


def _trains_like_plain(model: nn.Module, batch: Callable[[], tuple]) -> fxrec.OptimizedModule:
    """Three SGD steps of ``optimize(model)`` and of a copy on fresh batches: the same
    outputs, input gradients and parameters."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, batch())
    assert opt.fxrec_report.capture == "dynamo"
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        args = batch()
        mine = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        theirs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        outs = []
        for optimizer, module, inputs in ((sgd, opt, mine), (sgd_ref, ref, theirs)):
            optimizer.zero_grad()
            out = module(*inputs)
            (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()
            optimizer.step()
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], rtol=TOL, atol=TOL)
        for a, b in zip(mine, theirs):
            if a.is_floating_point():
                torch.testing.assert_close(a.grad, b.grad, rtol=TOL, atol=TOL)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=TOL, atol=TOL, msg=name)
    return opt


def _no_dynamo(runner: _DynamoRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("went through dynamo")

    monkeypatch.setattr(runner, "compiled", fail)


def test_a_varargs_forward_is_called_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    def batch() -> tuple:
        return tuple(torch.randn(4, D) for _ in range(N + 1))

    opt = _trains_like_plain(VarArgs(), batch)
    args = batch()
    runner = _runner(opt, args)
    assert runner.direct is not None
    assert "skip dynamo's guards" in str(opt.fxrec_report)
    _no_dynamo(runner, monkeypatch)
    torch.testing.assert_close(opt(*args), opt.model(*args), rtol=TOL, atol=TOL)


def test_a_varargs_forward_given_fewer_arguments_runs_as_the_model() -> None:
    """Another number of arguments is another input signature, compiled for itself."""
    model = VarArgs()
    opt = fxrec.optimize(model, tuple(torch.randn(4, D) for _ in range(N + 1)))
    args = tuple(torch.randn(4, D) for _ in range(N))
    with pytest.raises(RuntimeError) as theirs:
        model(*args)  # the head expects N inputs after the first
    with pytest.raises(type(theirs.value)):
        opt(*args)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="comprehensions are inlined: no cell")
def test_an_argument_read_in_a_comprehension_is_called_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def batch() -> tuple:
        return torch.randn(4, D), torch.randint(0, 20, (4, N))

    opt = _trains_like_plain(CellArg(), batch)
    args = batch()
    runner = _runner(opt, args)
    assert runner.direct is not None, opt.fxrec_report.notes
    _no_dynamo(runner, monkeypatch)
    torch.testing.assert_close(opt(*args), opt.model(*args), rtol=TOL, atol=TOL)


def test_an_argument_rebound_in_its_cell_keeps_dynamos_guards() -> None:
    def batch() -> tuple:
        return torch.randn(4, D), torch.randint(0, 20, (4, N))

    opt = _trains_like_plain(RebindsCell(), batch)
    if sys.version_info < (3, 12):
        assert _runner(opt, batch()).direct is None
        assert "go through dynamo's guards" in str(opt.fxrec_report)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="comprehensions are inlined: no cell")
def test_unrebound_cells_are_the_arguments_no_code_rebinds() -> None:
    from fxrec.compile.direct import unrebound_cells

    def reads(x: Any, y: Any) -> Any:
        return [x[i] + y for i in range(2)]

    def rebinds(x: Any) -> Any:
        x = x + 1
        return [x[i] for i in range(2)]

    def rebinds_in_closure(x: Any) -> Any:
        def reset() -> None:
            nonlocal x
            x = None

        reset()
        return [x for _ in range(1)]

    assert unrebound_cells(reads.__code__, ["x", "y"]) == {"x", "y"}
    assert unrebound_cells(rebinds.__code__, ["x"]) == frozenset()
    assert unrebound_cells(rebinds_in_closure.__code__, ["x"]) == frozenset()
