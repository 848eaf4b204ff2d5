"""Dropout draws random numbers only when it trains and drops something.

Rules never fuse across a random draw (it would move). Dropout in eval mode, or with
``p=0``, returns its input as is: treating it as a draw kept the experts of an MMoE from
fusing in an eval-mode graph. Such a dropout is the identity, whose result shares its
input's memory (a fused member passed through it is still a strided slice). Graphs are
kept per train/eval mode, so an eval graph fused across dropout never runs in training.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxrec
from fxrec.graph.effects import is_random, needs_contiguous
from tests.compile.helpers import dynamo_graph

TOL = 1e-5


class Call(nn.Module):
    """One call of ``fn`` on the input, traced as written."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _only_call(gm: fx.GraphModule) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.op.startswith("call")]
    return node


FUNCTIONS = {
    "F.dropout": (lambda x: F.dropout(x, 0.5), True),
    "F.dropout training=False": (lambda x: F.dropout(x, 0.5, training=False), False),
    "F.dropout positional False": (lambda x: F.dropout(x, 0.5, False), False),
    "F.dropout p=0": (lambda x: F.dropout(x, p=0.0), False),
    "F.dropout2d": (lambda x: F.dropout2d(x, 0.2, True), True),
    "torch.dropout train": (lambda x: torch.dropout(x, 0.5, True), True),
    "torch.dropout eval": (lambda x: torch.dropout(x, 0.5, False), False),
    "torch.dropout p=0": (lambda x: torch.dropout(x, 0, True), False),
    "F.alpha_dropout default": (lambda x: F.alpha_dropout(x, 0.5), False),
    "F.alpha_dropout training": (lambda x: F.alpha_dropout(x, 0.5, True), True),
    "F.rrelu default": (lambda x: F.rrelu(x), False),
    "F.rrelu training": (lambda x: F.rrelu(x, training=True), True),
    "torch.rand_like": (torch.rand_like, True),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_draw_only_when_training_with_p_above_zero(name: str) -> None:
    fn, draws = FUNCTIONS[name]
    assert is_random(_only_call(fx.symbolic_trace(Call(fn)))) is draws


MODULES = {
    "Dropout train": (nn.Dropout(0.3), True),
    "Dropout eval": (nn.Dropout(0.3).eval(), False),
    "Dropout p=0": (nn.Dropout(0.0), False),
    "AlphaDropout train": (nn.AlphaDropout(0.3), True),
    "Dropout2d eval": (nn.Dropout2d(0.3).eval(), False),
    "RReLU train": (nn.RReLU(), True),
    "RReLU eval": (nn.RReLU().eval(), False),
}


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
def test_modules_draw_only_when_training_with_p_above_zero(name: str, capture: str) -> None:
    """Symbolic traces keep the module call; dynamo inlines it into ``F.dropout(x, p,
    training, inplace)`` with constant arguments."""
    module, draws = MODULES[name]
    if capture == "symbolic":
        gm = fx.symbolic_trace(nn.Sequential(module))
    else:
        gm, _ = dynamo_graph(nn.Sequential(module), torch.randn(2, 3, 4, 4))
    assert is_random(_only_call(gm)) is draws


class Experts(nn.Module):
    """An MMoE's experts on one input: Linear -> ReLU -> Dropout -> Linear each."""

    def __init__(self, n: int = 4, p: float = 0.25) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 8))
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([e(x) for e in self.experts], 1)


def _forward_kernels(module: nn.Module, x: torch.Tensor) -> int:
    module(x)  # built on its first call: count a call after it
    return fxrec.count_kernels(module, x).forward


def _fired_on_second_linears(report: fxrec.Report) -> bool:
    return any(
        f.rule.startswith("parallel_linear") and f.nodes[0].endswith("_3") for f in report.firings
    )


def test_eval_mode_fuses_the_experts_across_dropout() -> None:
    """Eval: both layers, the ReLUs and the (identity) dropouts fuse: 13 kernels -> 4."""
    model = Experts().eval()
    opt = fxrec.optimize(copy.deepcopy(model), (torch.randn(8, 16),))
    x = torch.randn(8, 16)
    torch.testing.assert_close(opt(x), model(x), rtol=TOL, atol=TOL)
    assert _fired_on_second_linears(opt.fxrec_report)
    assert not any("random draw" in r.reason for r in opt.fxrec_report.refusals)
    assert _forward_kernels(model, x) == 13
    assert _forward_kernels(opt, x) == 4


def test_dropout_with_p_zero_does_not_stop_fusion_in_training() -> None:
    model = Experts(p=0.0)
    opt = fxrec.optimize(copy.deepcopy(model), (torch.randn(8, 16),))
    assert _fired_on_second_linears(opt.fxrec_report)
    assert _forward_kernels(opt, torch.randn(8, 16)) == 4


def test_the_dynamo_eval_graph_fuses_across_dropout() -> None:
    """Dynamo's graph spells the dropout ``F.dropout(x, 0.25, False, False)``: the second
    layers (``input_4``...) fuse into one batched GEMM, 13 kernels -> 10 (the first layers,
    whose weights are graph inputs here, stay apart)."""
    torch._dynamo.reset()
    model = Experts().eval()
    be = fxrec.compile_backend("eager")
    compiled = torch.compile(copy.deepcopy(model), backend=be, dynamic=False)
    x = torch.randn(8, 16)
    torch.testing.assert_close(compiled(x), model(x), rtol=TOL, atol=TOL)
    assert [f.nodes[0] for f in be.report.firings if f.rule.startswith("parallel_linear")] == [
        "input_4"
    ]
    assert _forward_kernels(compiled, x) == 10
    torch._dynamo.reset()


def _step(
    module: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, seed: int
) -> torch.Tensor:
    optim.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    out.pow(2).mean().backward()
    return out.detach()


def test_a_module_optimized_in_eval_trains_with_the_models_masks() -> None:
    """Optimized in eval mode, then trained: the training graph is built for training (its
    dropouts draw the plain model's masks); outputs, gradients and parameters after three
    SGD steps match, and eval calls after it still fuse."""
    model = Experts().eval()
    ref = copy.deepcopy(model).train()
    opt = fxrec.optimize(model, (torch.randn(8, 16),))
    opt.train()
    o_opt = torch.optim.SGD(opt.parameters(), lr=0.5)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    for seed in range(3):
        x = torch.randn(8, 16)
        got, want = _step(opt, o_opt, x, seed), _step(ref, o_ref, x, seed)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        assert not torch.equal(got, ref.eval()(x).detach())  # masks were drawn
        ref.train()
        grads = opt.fxrec_fused.grads(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=TOL, atol=TOL, msg=name)
        o_opt.step()
        o_ref.step()
        state = opt.state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=TOL, atol=TOL, msg=name)
    assert _forward_kernels(opt, x) == 19  # training: the dropouts keep the second layer apart
    opt.eval()
    ref.eval()
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    assert _forward_kernels(opt, x) == 4


class ViewAfterDropout(nn.Module):
    """Parallel Linears whose results pass through an eval-mode dropout, then ``.view()``."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(16, 8) for _ in range(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.drop(f(x)).view(-1) for f in self.fcs])


def test_an_identity_dropout_passes_its_input_through() -> None:
    """An eval-mode dropout returns the fused member's strided slice itself, which
    ``.view()`` refuses: the member must stay its own tensor."""
    model = ViewAfterDropout().eval()
    gm = fx.symbolic_trace(model)
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("fcs")]
    assert all(needs_contiguous(n) for n in linears)
    x = torch.randn(4, 16)
    opt = fxrec.optimize(copy.deepcopy(model), (x,))
    torch.testing.assert_close(opt(x), model(x))
