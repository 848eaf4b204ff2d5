"""optimize and a signature's first call run the model and its graphs more than once (to
capture, build and check); what forward changes besides its outputs (an input changed in
place, a buffer it reassigns) must change once per call, as it does in the model."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxrec

D = 8


class AddsToInput(nn.Module):
    """Shifts its input in place, then four Linears on slices of it (fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        a, b, c, d = torch.split(x, D, 1)
        return torch.cat([lin(p) for lin, p in zip(self.lins, (a, b, c, d))], 1)


class CountsCalls(nn.Module):
    """Reassigns a buffer each call (dynamo captures it: tracing cannot assign a proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return sum(torch.tanh(lin(x)) for lin in self.lins) * self.calls


def test_an_input_changed_in_place_changes_once_per_call() -> None:
    torch.manual_seed(0)
    model = AddsToInput()
    ref = copy.deepcopy(model)
    example = torch.randn(16, 4 * D)
    before = example.clone()
    opt = fxrec.optimize(model, (example,))
    assert opt.fxrec_report.count("parallel_linear_batched") == 1
    torch.testing.assert_close(example, before)  # optimize's own runs leave it as it was
    for batch in (5, 5, 16):  # a new signature, then a built one, then the example's
        x = torch.randn(batch, 4 * D)
        x_ref = x.clone()
        torch.testing.assert_close(opt(x), ref(x_ref))
        torch.testing.assert_close(x, x_ref)


def test_a_buffer_forward_reassigns_counts_each_call_once() -> None:
    torch.manual_seed(0)
    model = CountsCalls()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(4, D),))
    assert model.calls.item() == 0
    for n, batch in enumerate((4, 3, 3, 5), start=1):
        x = torch.randn(batch, D)
        torch.testing.assert_close(opt(x), ref(x))
        assert model.calls.item() == ref.calls.item() == n
