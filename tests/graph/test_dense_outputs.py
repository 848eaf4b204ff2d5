"""A fused op's members are strided pieces of its result; the model returned tensors of
their own. What the optimized model returns is dense, as the model's outputs were, so a
caller can ``.view()`` it (``logits.view(-1)``), at one copy per fused result."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec


class Towers(nn.Module):
    """Parallel Linear -> LayerNorm -> tanh towers, each tower's output returned."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(16, w) for w in widths)
        self.norms = nn.ModuleList(nn.LayerNorm(w) for w in widths)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        pairs = zip(self.towers, self.norms)
        return {f"task{i}": torch.tanh(n(t(x))) for i, (t, n) in enumerate(pairs)}


@pytest.mark.parametrize("widths", [[4, 4, 4, 4], [3, 5, 2]], ids=["equal", "different"])
def test_returned_members_are_dense(widths: list[int]) -> None:
    torch.manual_seed(0)
    model = Towers(widths)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 16),))
    assert opt.fxrec_report.count("parallel_linear_same_input") == 1
    for batch in (8, 5):
        x = torch.randn(batch, 16)
        got, want = opt(x), ref(x)
        for k, w in want.items():
            assert got[k].is_contiguous() and got[k].stride() == w.stride()
            torch.testing.assert_close(got[k].view(-1), w.view(-1))
        for outs in (got, want):
            sum(
                (o.view(-1) * torch.linspace(0.5, 1.5, o.numel())).sum() for o in outs.values()
            ).backward()
        grads = opt.fxrec_fused.grads(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-4, msg=name)
        opt.zero_grad()
        ref.zero_grad()


def test_equal_pieces_take_one_copy() -> None:
    opt = fxrec.optimize(Towers([4] * 6), (torch.randn(8, 16),))
    # one GEMM, one LayerNorm + its affine, one tanh, and one copy for all six outputs
    assert fxrec.count_kernels(opt, torch.randn(8, 16)).forward == 5


def test_a_fused_result_used_inside_is_not_copied() -> None:
    class Summed(Towers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return sum(torch.tanh(n(t(x))) for t, n in zip(self.towers, self.norms))

    opt = fxrec.optimize(Summed([4] * 6), (torch.randn(8, 16),))
    (gm,) = opt._runners.values()
    assert not any(n.target == "contiguous" for n in gm.graph.nodes)
