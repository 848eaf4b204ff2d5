"""Grad-mode and autocast regions inside forward: a trace made where a region changes
nothing (optimize under ``no_grad``, a ``no_grad`` block) must not serve calls where it does."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxrec

D = 8


class Towers(nn.Module):
    """Four Linear -> tanh towers on slices of the input (fused), then a head run in a
    region: ``no_grad`` (a stop-gradient target), autocast off (a head kept in fp32), or a
    branch on the grad mode."""

    def __init__(self, region: str) -> None:
        super().__init__()
        self.region = region
        self.towers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(4 * D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = torch.split(x, D, 1)  # unpacked: symbolic tracing follows it
        h = torch.cat([t(p).tanh() for t, p in zip(self.towers, (a, b, c, d))], 1)
        if self.region == "no_grad":
            with torch.no_grad():
                target = self.head(h)
            return self.head(h) - target.sigmoid()
        if self.region == "fp32":
            with torch.autocast("cpu", enabled=False):
                return self.head(h.float())
        return self.head(h) * (2.0 if torch.is_grad_enabled() else 3.0)


def _pair(region: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Towers(region)
    return model, copy.deepcopy(model)


def test_a_no_grad_block_stops_gradients_when_optimized_under_no_grad() -> None:
    model, ref = _pair("no_grad")
    with torch.no_grad():  # set-up code: the block changes nothing while this traces
        opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    assert opt.fxrec_report.capture == "symbolic_trace"
    x = torch.randn(16, 4 * D)
    out = opt(x)
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    grads = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_an_autocast_off_block_stays_fp32_under_autocast() -> None:
    model, ref = _pair("fp32")
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    x = torch.randn(16, 4 * D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = opt(x), ref(x)
    assert out.dtype == want.dtype == torch.float32
    torch.testing.assert_close(out, want)


def test_a_branch_on_the_grad_mode_follows_each_call() -> None:
    model, ref = _pair("grad_branch")
    x = torch.randn(16, 4 * D)
    opt = fxrec.optimize(model, (x,))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert opt.fxrec_report.count("parallel_linear_batched") == 1
    for region in (torch.no_grad, torch.inference_mode, torch.enable_grad, torch.no_grad):
        with region():
            torch.testing.assert_close(opt(x), ref(x), msg=region.__name__)


class FrozenTeacher(nn.Module):
    """A trained branch beside a frozen one computed under ``inference_mode`` (a teacher)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(D, D)
        self.teacher = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.student(x)
        with torch.inference_mode():
            t = self.teacher(x)
        return y + t.clone()


def test_an_inference_mode_block_gets_no_gradient() -> None:
    torch.manual_seed(0)
    model = FrozenTeacher()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, D),))
    x = torch.randn(8, D)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).sum().backward()
    opt(xb).sum().backward()
    grads = opt.fxrec_fused.grads(model)
    assert ref.teacher.weight.grad is None
    assert grads["teacher.weight"] is None, "the inference-mode block was trained"
    torch.testing.assert_close(xb.grad, xa.grad)
    torch.testing.assert_close(grads["student.weight"], ref.student.weight.grad)
