"""Pointwise sets whose members' layout the graph does not fix stay as written before a draw.

A pointwise op's result is laid out as its input: ``relu`` of a column-major input (a graph
input given as ``torch.randn(4, 4).t()``, or a transposed view) is column-major, while a
fused op's members are row-major slices. Values agree, but a Dropout after a member draws its
mask in memory order: fused, the mask landed on other elements (wrong outputs with
``check=False``; a failed check and an unoptimized graph by default). Such sets are refused
with a reason when a member's result reaches a random op; inputs laid out by the graph
(Linear -> ReLU -> Dropout towers, LayerNorm -> tanh -> dropout) still fuse.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import fxrec

REASON = "reaches a random op"


def _transposed(*shape: int) -> torch.Tensor:
    return torch.randn(*reversed(shape)).t()


def check_same_in_training(
    model: nn.Module, inputs: Sequence[torch.Tensor], seed: int = 1
) -> fxrec.OptimizedModule:
    """Optimize a copy (no output check); outputs and gradients match with the same seed."""
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, tuple(inputs), check=False)
    for step in range(2):
        xa = [x.detach().clone().requires_grad_() for x in inputs]
        xb = [x.detach().clone().requires_grad_() for x in inputs]
        torch.manual_seed(seed + step)
        got = opt(*xa)
        torch.manual_seed(seed + step)
        want = ref(*xb)
        torch.testing.assert_close(got, want)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for a, b in zip(xa, xb):
            torch.testing.assert_close(a.grad, b.grad)
    return opt


def _unary_firings(opt: fxrec.OptimizedModule) -> int:
    return sum(1 for f in opt.fxrec_report.firings if f.rule == "parallel_unary")


def _refusals(opt: fxrec.OptimizedModule, rule: str) -> list[str]:
    return [r.reason for r in opt.fxrec_report.refusals if r.rule == rule]


class ReluThenDropout(nn.Module):
    """The tester's case: relu of three inputs, a Dropout after one of them."""

    def __init__(self, drop: bool = True) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 3) for _ in range(3))
        self.drop = nn.Dropout(0.3) if drop else nn.Identity()

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        y = self.lins[0](torch.relu(a)) + self.lins[1](torch.relu(b))
        return y + self.lins[2](self.drop(torch.relu(c)))


def test_relu_of_transposed_inputs_before_dropout_is_refused() -> None:
    torch.manual_seed(0)
    xs = [_transposed(4, 4) for _ in range(3)]
    opt = check_same_in_training(ReluThenDropout(), xs)
    assert _unary_firings(opt) == 0
    assert any(REASON in r for r in _refusals(opt, "parallel_unary"))


def test_default_check_passes() -> None:
    """With the output check on (the default), the check no longer fails."""
    torch.manual_seed(0)
    xs = tuple(_transposed(4, 4) for _ in range(3))
    opt = fxrec.optimize(ReluThenDropout(), xs)
    assert not any("check failed" in n for n in opt.fxrec_report.notes)


def test_relu_of_transposed_inputs_without_a_draw_still_fuses() -> None:
    torch.manual_seed(0)
    xs = [_transposed(4, 4) for _ in range(3)]
    opt = check_same_in_training(ReluThenDropout(drop=False), xs)
    assert _unary_firings(opt) >= 1


class TransposedViews(nn.Module):
    """relu of transposed Linear outputs; ``then`` runs between relu and the dropout."""

    def __init__(self, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.drop = nn.Dropout(0.5)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = [torch.relu(lin(x).t()) for lin in self.lins]
        return hs[0] + hs[1] + self.drop(self.then(hs[2]))


@pytest.mark.parametrize(
    "then",
    [lambda h: h, torch.tanh, lambda h: h.unsqueeze(0).squeeze(0)],
    ids=["direct", "through tanh", "through views"],
)
def test_transposed_view_before_dropout_is_refused(
    then: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    torch.manual_seed(0)
    opt = check_same_in_training(TransposedViews(then), [torch.randn(6, 4)])
    assert _unary_firings(opt) == 0
    assert any(REASON in r for r in _refusals(opt, "parallel_unary"))


class ProductsThenDropout(nn.Module):
    """``a_i * b_i`` of graph inputs, a dropout after one product."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        prods = [xs[i] * xs[i + 4] for i in range(4)]
        return prods[0] + prods[1] + prods[2] + nn.functional.dropout(prods[3], 0.5)


def test_binary_of_transposed_inputs_before_dropout_is_refused() -> None:
    torch.manual_seed(0)
    xs = [_transposed(4, 4) for _ in range(8)]
    opt = check_same_in_training(ProductsThenDropout(), xs)
    assert not any(f.rule == "parallel_binary" for f in opt.fxrec_report.firings)
    assert any(REASON in r for r in _refusals(opt, "parallel_binary"))


class Towers(nn.Module):
    """Linear -> ReLU -> Dropout towers on one input each: contiguous by construction."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.3)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(p) for t, p in zip(self.towers, x.split(4, 1))], 1)


class NormsTanhDropout(nn.Module):
    """The seed pattern with a dropout: split -> LayerNorm -> tanh -> dropout -> cat."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = [torch.tanh(ln(p)) for ln, p in zip(self.norms, x.split(4, 1))]
        return torch.cat([nn.functional.dropout(h, 0.2) for h in hs], 1)


@pytest.mark.parametrize("model", [Towers, NormsTanhDropout])
@pytest.mark.parametrize("transposed", [False, True])
def test_towers_and_seed_pattern_with_dropout_still_fuse(
    model: Callable[[], nn.Module], transposed: bool
) -> None:
    torch.manual_seed(0)
    x = _transposed(8, 16) if transposed else torch.randn(8, 16)
    opt = check_same_in_training(model(), [x])
    assert _unary_firings(opt) >= 1
    assert not any(REASON in r for r in _refusals(opt, "parallel_unary"))
