"""TorchScript and fx tracing of an optimized module raise an error saying what to use.

``torch.jit.trace`` would record the one graph fxrec cached for the example (building it
under the tracer), ``torch.jit.script`` fails on fxrec's bookkeeping, and
``torch.fx.symbolic_trace`` on its per-call checks, with messages that name PyTorch's
internals. The portable route is ``fxrec.export``; the plain model traces and scripts.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxrec
from tests.graph.test_drop_in import TOL, D, Norms

WHAT_TO_USE = r"fxrec\.export\(opt, args.*opt\.model"


def _optimized(untraceable: bool = False) -> tuple[Norms, fxrec.OptimizedModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Norms(untraceable=untraceable)
    x = torch.randn(8, 4 * D)
    return model, fxrec.optimize(model, (x,)), x


class Holder(nn.Module):
    """A model holding an optimized module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_jit_trace_raises_and_builds_nothing(untraceable: bool) -> None:
    model, opt, x = _optimized(untraceable)
    ref = copy.deepcopy(model)
    runners = dict(opt._runners)
    with pytest.raises(RuntimeError, match=r"fxrec: torch\.jit\.trace .*" + WHAT_TO_USE):
        torch.jit.trace(opt, (x,))
    assert opt._runners == runners, "a graph was built under the tracer"
    y = torch.randn(5, 4 * D)
    torch.testing.assert_close(opt(y), ref(y), rtol=TOL, atol=TOL)
    traced = torch.jit.trace(opt.model, (y,))  # the plain model, as the error says
    torch.testing.assert_close(traced(y), ref(y), rtol=TOL, atol=TOL)


def test_onnx_export_through_torchscript_raises() -> None:
    _, opt, x = _optimized()
    with pytest.raises(RuntimeError, match=r"fxrec: torch\.jit\.trace .*onnx"):
        torch.onnx.export(opt, (x,), io.BytesIO(), dynamo=False)


def test_jit_script_raises_for_the_module_and_a_model_holding_it() -> None:
    _, opt, _ = _optimized()
    for target in (opt, Holder(opt)):
        with pytest.raises(RuntimeError, match=r"fxrec: torch\.jit\.script .*" + WHAT_TO_USE):
            torch.jit.script(target)


def test_symbolic_trace_raises() -> None:
    _, opt, _ = _optimized()
    for target in (opt, Holder(opt)):
        with pytest.raises(
            RuntimeError, match=r"fxrec: torch\.fx\.symbolic_trace .*" + WHAT_TO_USE
        ):
            torch.fx.symbolic_trace(target)
    # a pipeline that traces its model (TorchRec's) learns which pipelines take it
    with pytest.raises(RuntimeError, match=r"fxrec\.train\.TrainPipelineSparseDist"):
        torch.fx.symbolic_trace(opt)


def test_calls_while_another_thread_traces_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """fx's tracing flag is process-wide: a call with real tensors meanwhile runs as usual."""
    model, opt, x = _optimized()
    ref = copy.deepcopy(model)
    monkeypatch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
