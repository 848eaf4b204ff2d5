"""Graphs that read laid-out parameters one by one: the captured graph kept after a failed
check, and the model run eagerly through the flat parameters (dynamo captures).

Their backward must cost what the plain model's does plus one ``stack`` / ``cat`` per flat
parameter (the gradient of one split of it), not a zero-filled gradient of the whole flat
parameter and its accumulation per member, which made such steps about 1.7x slower than the
plain model on 64 towers.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxrec
import fxrec.graph.module
from fxrec.measure import count_kernels
from tests.graph.test_flat_params import OPTIMS, D, N, Towers, _same_state, _step


def _fail_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-call check runs the optimized graphs (dynamo compiles then) and fails."""
    same = fxrec.graph.module._same_outputs

    def fail(*args: object, **kwargs: object) -> bool:
        same(*args, **kwargs)
        return False

    monkeypatch.setattr(fxrec.graph.module, "_same_outputs", fail)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_members_read_one_by_one_cost_one_kernel_per_flat_parameter(
    monkeypatch: pytest.MonkeyPatch, untraceable: bool
) -> None:
    _fail_the_check(monkeypatch)
    torch.manual_seed(0)
    model = Towers(untraceable)
    ref = copy.deepcopy(model)
    x = torch.randn(8, N * D)
    opt = fxrec.optimize(model, (x,))
    opt(x)  # dynamo captures on the first call
    assert any("check failed" in n for n in opt.fxrec_report.notes)
    flats = [p for p in opt.fxrec_fused.parameters() if p.requires_grad]
    assert len(flats) >= 4  # norms' weights and biases, towers' weights and biases
    plain, got = count_kernels(ref, x), count_kernels(opt, x)
    assert got.forward == plain.forward
    assert got.backward == plain.backward + len(flats)
    assert "aten::select_backward" not in got.backward_ops
    torch._dynamo.reset()


@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_members_read_one_by_one_train_like_the_model(
    monkeypatch: pytest.MonkeyPatch, optim: str, untraceable: bool
) -> None:
    _fail_the_check(monkeypatch)
    torch.manual_seed(0)
    model = Towers(untraceable)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    o_opt, o_ref = OPTIMS[optim](list(opt.parameters())), OPTIMS[optim](list(ref.parameters()))
    for _ in range(3):
        x = torch.randn(8, N * D)
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=1e-5)
    assert any("check failed" in n for n in opt.fxrec_report.notes)
    _same_state(opt.model, ref)
    torch._dynamo.reset()
