"""The user's module hooks run on the user's calls only, once per call.

``optimize`` and a signature's first call run the model and its graphs to capture, check
and count them; a hook that logs features or gradients must not see those runs (it would
log batches never trained on), and a first call must not run the forward twice.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec
from tests.graph.test_drop_in import TOL, D, Norms


class Slices(Norms):
    """The seed pattern (the LayerNorms fuse), then a Linear head of ``out`` outputs."""

    def __init__(self, untraceable: bool = False, out: int = 3) -> None:
        super().__init__(4, untraceable)
        self.head = nn.Linear(4 * D, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


def _count_hooks(model: Slices, calls: dict[str, int]) -> None:
    """Counting hooks on one LayerNorm: forward pre, forward and full backward."""

    def bump(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    model.norms[1].register_forward_pre_hook(lambda *a: bump("pre"))
    model.norms[1].register_forward_hook(lambda *a: bump("fwd"))
    model.norms[1].register_full_backward_hook(lambda *a: bump("bwd"))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_run_once_per_training_step_and_never_in_optimize(
    untraceable: bool, when: str
) -> None:
    torch.manual_seed(0)
    model = Slices(untraceable=untraceable)
    ref = copy.deepcopy(model)
    ours: dict[str, int] = {}
    theirs: dict[str, int] = {}
    _count_hooks(ref, theirs)
    if when == "before":
        _count_hooks(model, ours)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    assert ours == {}, "optimize ran the user's hooks"
    if when == "after":
        _count_hooks(model, ours)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, w = torch.randn(16, 4 * D), torch.randn(16, 3)
        for sgd, module in ((sgd_opt, opt), (sgd_ref, ref)):
            sgd.zero_grad()
            out = module(x)
            (out * w).sum().backward()
            sgd.step()
            if module is opt:
                got = out
        torch.testing.assert_close(got, out, rtol=TOL, atol=TOL)
    assert ours == theirs == {"pre": 3, "fwd": 3, "bwd": 3}
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[name], value, rtol=TOL, atol=TOL, msg=name)


def test_kernels_are_still_counted_for_a_traced_model_with_hooks() -> None:
    """A traced graph keeps hooked calls as written: counted with the hooks silenced."""
    model = Slices()
    calls: dict[str, int] = {}
    _count_hooks(model, calls)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    report = opt.fxrec_report
    assert report.capture == "symbolic_trace"
    assert report.kernels_after is not None and report.kernels_before is not None
    assert report.kernels_after[0] < report.kernels_before[0]
    assert calls == {}


class _Hooked(nn.Module):
    """A hooked container (symbolic tracing would drop its hooks: dynamo captures the model)
    beside parallel LayerNorm -> Linear towers."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(D, D), nn.ReLU())
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(6))
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        towers = [
            lin(torch.tanh(n(x[:, i]))) for i, (n, lin) in enumerate(zip(self.norms, self.lins))
        ]
        return torch.cat([self.bottom(x[:, 0]), *towers], 1)


@pytest.mark.parametrize("check", [True, False])
def test_a_dynamo_capture_of_a_hooked_model_lays_out_its_parameters(check: bool) -> None:
    """Compiled by ``optimize`` with the hooks silenced (in a capture of its own), so that
    fused weights are laid out before the optimizer is built on them: a step launches the
    kernels of the same model without hooks, not in-graph weight gathers."""
    x = torch.randn(16, 6, D)
    steps = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = _Hooked()
        calls: dict[str, int] = {}
        if hooked:
            model.bottom.register_forward_hook(lambda *a, c=calls: c.update(n=c.get("n", 0) + 1))
        opt = fxrec.optimize(model, (x,), check=check)
        assert opt.fxrec_report.capture == ("dynamo" if hooked else "symbolic_trace")
        assert calls == {}
        assert len(list(opt.fxrec_fused.parameters())) == 4  # norms' and towers' weights, biases
        opt(x)  # the first call compiles the hooked model with its hooks
        steps[hooked] = fxrec.count_kernels(opt, x)
        assert calls == ({"n": 2} if hooked else {})
    assert (steps[True].forward, steps[True].backward) == (
        steps[False].forward,
        steps[False].backward,
    )


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_global_module_hooks_run_on_every_module_call(untraceable: bool, when: str) -> None:
    """A global forward hook (``register_module_forward_hook``) runs on every module call of
    the plain model, fused LayerNorms included: while one is registered, calls run the model
    as written (through the flat parameters); once removed, the fused graphs run again."""
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model = Slices(untraceable=untraceable)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 4 * D)
    calls: list[str] = []

    def scale(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        calls.append(type(module).__name__)
        return out * 1.5 if isinstance(module, nn.LayerNorm) else None

    handle = register_module_forward_hook(scale) if when == "before" else None
    try:
        opt = fxrec.optimize(model, (x,))
        fused = fxrec.count_kernels(opt, x) if handle is None else None
        handle = handle or register_module_forward_hook(scale)
        calls.clear()
        expected = ref(x)
        plain_calls = list(calls)
        calls.clear()
        torch.testing.assert_close(opt(x), expected, rtol=TOL, atol=TOL)
        assert sorted(c for c in calls if c != "OptimizedModule") == sorted(plain_calls)
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    if fused is not None:  # the fused graphs serve calls again
        assert fxrec.count_kernels(opt, x).forward == fused.forward
