"""Rewrites that would change what a graph computes, though the example inputs hide it: an
in-place write between fused members, a copy turned into an alias of a tensor written later
through its base, and arguments that compare equal but compute differently (``-0.0``,
``1`` vs ``1.0``). Optimized with ``check=False`` and zero example inputs (the output check
cannot see these there), compared with the model on fresh inputs, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxrec


class WriteBetweenMembers(nn.Module):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor):
        t = x1 * 1.0
        a = torch.tanh(x0)
        t.add_(a)  # the second tanh reads t after this write
        return a, torch.tanh(t), torch.tanh(x2)


class CopyOfAViewThenWrite(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor):
        t = x * 1.0
        a, b = t[:, :8].split(4, 1)
        c = torch.cat([a, b], 1)  # a copy, taken before the write below
        t.add_(y)
        return c * z


class SplitOfACopyThenWrite(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor):
        t = x * 1.0
        p, q = torch.cat([t[:, :4], t[:, 4:8]], 1).split(4, 1)
        t.add_(y)
        return p * z[:, :4], q * z[:, 4:]


class SignedZeros(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor):
        return x / 0.0, y / -0.0, z / 0.0, (x + y) / -0.0


class IntAndFloatBounds(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        return a.clamp(min=1), b.clamp(min=1.0), c.clamp(min=1.0), (a + 1).clamp(min=1.0)


CASES = [WriteBetweenMembers, CopyOfAViewThenWrite, SplitOfACopyThenWrite, SignedZeros]


def _compare(got: tuple, want: tuple) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("cls", CASES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("entry", ["optimize", "compile_backend"])
def test_outputs_and_gradients_match_the_model(cls: type[nn.Module], entry: str) -> None:
    model = cls()
    zeros = tuple(torch.zeros(4, 8) for _ in range(3))
    if entry == "optimize":
        run = fxrec.optimize(model, zeros, check=False)
    else:
        torch._dynamo.reset()
        run = torch.compile(model, backend=fxrec.compile_backend())
    for _ in range(2):
        xs = [torch.randn(4, 8) for _ in range(3)]
        mine = [x.clone().requires_grad_() for x in xs]
        theirs = [x.clone().requires_grad_() for x in xs]
        got, want = run(*mine), model(*theirs)
        _compare(got, want)
        finite = [torch.nan_to_num(o, posinf=1.0, neginf=-1.0) for o in got]
        torch.autograd.backward([o.sum() for o in finite])
        finite = [torch.nan_to_num(o, posinf=1.0, neginf=-1.0) for o in want]
        torch.autograd.backward([o.sum() for o in finite])
        for m, t in zip(mine, theirs):
            torch.testing.assert_close(m.grad, t.grad, equal_nan=True)


def test_int_and_float_bounds_keep_their_result_dtypes() -> None:
    model = IntAndFloatBounds()
    ints = tuple(torch.zeros(4, 8, dtype=torch.long) for _ in range(3))
    opt = fxrec.optimize(model, ints, check=False)
    xs = tuple(torch.randint(-3, 3, (4, 8)) for _ in range(3))
    _compare(opt(*xs), model(*xs))


class NormsOneWithoutGrad(nn.Module):
    """Four parallel LayerNorms, one run under no_grad (dynamo keeps the region as nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.split(8, 1)
        with torch.no_grad():
            first = self.norms[0](parts[0])
        rest = [n(p) for n, p in zip(self.norms[1:], parts[1:])]
        return torch.cat([first, *rest], 1)


class TargetWithoutGrad(nn.Module):
    """The same Linear, once under no_grad (a target), once with grad (the prediction)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.lin(x)
        return (self.lin(x) - target).pow(2).sum() + self.lin(x).sum()


@pytest.mark.parametrize("cls", [NormsOneWithoutGrad, TargetWithoutGrad], ids=lambda c: c.__name__)
@pytest.mark.parametrize("entry", ["optimize", "compile_backend"])
def test_no_fusion_or_merging_across_grad_mode_regions(cls: type[nn.Module], entry: str) -> None:
    torch.manual_seed(0)
    model = cls()
    if entry == "optimize":
        run = fxrec.optimize(model, (torch.randn(4, 32),), check=False)
    else:
        torch._dynamo.reset()
        run = torch.compile(model, backend=fxrec.compile_backend())
    x = torch.randn(4, 32)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = run(xo), model(xr)
    assert got.requires_grad == want.requires_grad
    torch.testing.assert_close(got, want)
    grads = []
    for out, inp in ((got, xo), (want, xr)):
        model.zero_grad()
        out.sum().backward()
        grads.append([inp.grad, *(p.grad for p in model.parameters())])
    for g, w in zip(*grads):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w)
