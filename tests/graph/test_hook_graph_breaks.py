"""A forward hook that dynamo cannot compile runs once per call, on the call's own tensors.

Such a hook (``out.retain_grad()``, as attribution tools write) breaks dynamo's graph, and
the code around the break reads the laid-out members. The first call in training finds that
out after running the hook; running the call again through the flat parameters would run
the hook a second time, on tensors of a result thrown away.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec
from tests.graph.test_drop_in import TOL, D
from tests.graph.test_hook_calls import Slices


def _keep_activations(module: nn.Module, acts: list[torch.Tensor]) -> None:
    """Keep the module's outputs and their gradients (a graph break for dynamo)."""

    def hook(_m: nn.Module, _inp: object, out: torch.Tensor) -> None:
        out.retain_grad()
        acts.append(out)

    module.register_forward_hook(hook)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_dynamo_cannot_compile_runs_once_and_training_matches(when: str) -> None:
    torch.manual_seed(0)
    model = Slices(untraceable=True)
    ref = copy.deepcopy(model)
    ours: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    _keep_activations(ref.norms[1], theirs)
    if when == "before":
        _keep_activations(model.norms[1], ours)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    assert opt.fxrec_report.capture == "dynamo"
    assert ours == []
    if when == "after":
        _keep_activations(model.norms[1], ours)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, w = torch.randn(16, 4 * D), torch.randn(16, 3)
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        outs = []
        for sgd, module, inp in ((sgd_opt, opt, xo), (sgd_ref, ref, xr)):
            sgd.zero_grad()
            out = module(inp)
            (out * w).sum().backward()
            sgd.step()
            outs.append(out)
        assert len(ours) == len(theirs) == step + 1, "the hook ran more than once per call"
        torch.testing.assert_close(outs[0], outs[1], rtol=TOL, atol=TOL)
        torch.testing.assert_close(xo.grad, xr.grad, rtol=TOL, atol=TOL)
        assert ours[-1].grad is not None, "the hook's tensor is not the call's"
        torch.testing.assert_close(ours[-1], theirs[-1], rtol=TOL, atol=TOL)
        torch.testing.assert_close(ours[-1].grad, theirs[-1].grad, rtol=TOL, atol=TOL)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[name], value, rtol=TOL, atol=TOL, msg=name)
    assert any("graph break" in n for n in opt.fxrec_report.notes), opt.fxrec_report.notes
