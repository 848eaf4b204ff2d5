"""What a symbolic trace would silently get wrong is traced right, or goes to dynamo:
grad-mode and autocast regions inside forward, random draws and tensors built from constant
arguments, augmented assignment (``h += 1``). Each model is optimized and compared with
itself, outputs and gradients, call after call."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import fxrec
from fxrec.graph.capture import CaptureError, capture_symbolic


class NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.a(x)
        return self.b(x) * target


class AutocastRegion(NoGradRegion):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.a(x)
        return low, self.b(x)


class Accumulates(nn.Module):
    """Builds a fresh buffer from constants every call and accumulates into it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(4, 8)
        acc.add_(x)
        return acc * 2


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(4, 8)


MODELS = [NoGradRegion, AutocastRegion, Accumulates, Noisy]


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_refused_by_symbolic_tracing(cls: type[nn.Module]) -> None:
    with pytest.raises(CaptureError, match="symbolic tracing skipped"):
        capture_symbolic(cls())


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_optimized_model_computes_what_the_model_computes(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(4, 8),), check=False)
    assert opt.fxrec_report.capture == "dynamo"
    for step in range(3):
        x = torch.randn(4, 8)
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(step)
        got = opt(xo)
        torch.manual_seed(step)
        want = ref(xr)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.requires_grad == w.requires_grad
            torch.testing.assert_close(g, w)
        sum(g.float().sum() for g in got).backward()
        sum(w.float().sum() for w in want).backward()
        torch.testing.assert_close(xo.grad, xr.grad)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
            p.grad = q.grad = None


class DrawsOnAnotherThread(nn.Module):
    """While it is traced, another thread (a pipeline's loader) draws random numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drawn: list[torch.Tensor] = []
        t = threading.Thread(target=lambda: drawn.append(torch.randn(3)))
        t.start()
        t.join()
        assert len(drawn) == 1
        return torch.tanh(x)


def test_other_threads_draw_while_a_model_is_traced() -> None:
    gm = capture_symbolic(DrawsOnAnotherThread())
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), torch.tanh(x))


class AugmentedAssignment(nn.Module):
    """``h += 1`` writes ``h`` in place: a view taken before sees it, and so does the caller's
    tensor (``x += 1``); a size augmented (``n += 1``) is a new number."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        first = h[:, :2]
        h += 1
        x += 1
        n = x.shape[0]
        n += 1
        return first * n, h


def test_augmented_assignment_writes_in_place() -> None:
    x = torch.randn(3, 4)
    mine, theirs = x.clone(), x.clone()
    opt = fxrec.optimize(AugmentedAssignment(), (x.clone(),), check=False)
    assert opt.fxrec_report.capture == "symbolic_trace"
    got, want = opt(mine), AugmentedAssignment()(theirs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(mine, theirs)  # the caller's tensor was written alike
