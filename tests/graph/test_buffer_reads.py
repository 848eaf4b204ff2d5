"""Buffers are read when the model is called, not when it was captured: a computation on
buffers alone follows a buffer changed in place or loaded from a checkpoint after
``optimize``; a write to a buffer in forward is a node of the graph; a buffer that steers
Python control flow sends the model to dynamo, which guards on it."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxrec
from fxrec.graph.capture import capture_symbolic


class ScaledByBuffer(nn.Module):
    """Three parallel towers gated by functions of one buffer (no input involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.tanh(self.scale) + torch.sigmoid(self.scale)
        return sum(torch.relu(t(x)) * gate for t in self.towers)


class RunningMean(nn.Module):
    """Accumulates the batch mean into a buffer in place, then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.mul_(0.5).add_(x.detach().mean(0))
        return torch.tanh(self.lin(x)) + torch.tanh(self.seen) * torch.sigmoid(self.seen)


class Switched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("on", torch.tensor(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) if self.on else self.lin(x)


def _check(opt: nn.Module, ref: nn.Module) -> None:
    x = torch.randn(5, 8)
    xr = x.clone().requires_grad_()
    x.requires_grad_()
    out, want = opt(x), ref(xr)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    grads = opt.fxrec_fused.grads(opt.model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    for (name, b), c in zip(ref.named_buffers(), opt.model.buffers()):
        torch.testing.assert_close(c, b, msg=name)
    opt.zero_grad()
    ref.zero_grad()


def _optimized(cls: type[nn.Module], capture: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(model, a copy made first, its optimized module), captured by ``capture``."""
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(5, 8),))
    assert opt.fxrec_report.capture == capture
    return model, ref, opt


def test_a_computation_on_buffers_alone_is_a_node_not_a_constant() -> None:
    gm = capture_symbolic(ScaledByBuffer())
    assert [n.target for n in gm.graph.nodes if n.op == "get_attr"] == ["scale"]
    assert not any("_tensor_constant" in str(n.target) for n in gm.graph.nodes)


def test_buffers_changed_or_loaded_after_optimize_are_read() -> None:
    model, ref, opt = _optimized(ScaledByBuffer, "symbolic_trace")
    _check(opt, ref)
    for m in (model, ref):
        m.scale.fill_(-2.0)
    _check(opt, ref)
    state = copy.deepcopy(ref.state_dict())
    state["scale"] = torch.randn(8)
    ref.load_state_dict(state)
    opt.load_state_dict(state)
    _check(opt, ref)


def test_a_buffer_written_in_forward_is_written_on_every_call() -> None:
    model, ref, opt = _optimized(RunningMean, "symbolic_trace")
    assert not model.seen.any()  # capturing did not write it
    for _ in range(3):
        _check(opt, ref)
    assert ref.seen.any()


def test_a_buffer_steering_control_flow_is_read_on_every_call() -> None:
    model, ref, opt = _optimized(Switched, "dynamo")
    _check(opt, ref)
    for m in (model, ref):
        m.on.fill_(False)
    _check(opt, ref)
    torch._dynamo.reset()
