"""Submodules replaced or added after ``fxrec.optimize`` are followed.

Graphs call the submodules they were built with, and an optimized module keys its graphs by
its submodules' train/eval flags and hooks. Replacing a parameter-free module
(``tower[2] = nn.GELU()``), appending one, or swapping a Dropout for an Identity must rebuild
them, as the same change to the plain model changes what it computes; a replaced module whose
parameters are laid out in flat tensors cannot be followed and must raise.

Every test makes the same change to an untouched copy of the model, then trains both and
compares outputs, gradients (by the original parameter names) and parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import fxrec

D = 16
TOL = 1e-5


class Towers(nn.Module):
    """Parallel towers (fused Linears and LayerNorms), each with an activation and a
    Dropout to swap."""

    def __init__(self, n: int = 4, dropout: float = 0.0, untraceable: bool = False) -> None:
        super().__init__()
        self.untraceable = untraceable
        self.towers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(D, D), nn.LayerNorm(D), nn.ReLU(), nn.Dropout(dropout), nn.Linear(D, 8)
            )
            for _ in range(n)
        )
        self.head = nn.Linear(8 * n, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.untraceable and x.dim() > 1:  # a branch on a shape: dynamo captures it
            x = x + 0
        return self.head(torch.cat([t(x) for t in self.towers], 1))


class Scale(nn.Module):
    """Parameter-free and traced through: its train/eval flag is baked into a trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if self.training else x * 0.5


def _optimized(model: nn.Module) -> fxrec.OptimizedModule:
    """``model`` optimized, its graphs built and run (with and without autograd) before any
    change."""
    x = torch.randn(8, D)
    opt = fxrec.optimize(model, (x,))
    assert opt.fxrec_fused.member_ids(), "the towers' Linears and LayerNorms are laid out"
    opt(x).sum().backward()
    with torch.no_grad():
        opt(x)
    for p in opt.parameters():
        p.grad = None
    return opt


def _same_training(ref: nn.Module, opt: fxrec.OptimizedModule, steps: int = 3) -> None:
    """Per step on fresh inputs: same output, same gradient per original parameter name,
    same parameters after an SGD step."""
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(8, D)
        ref_sgd.zero_grad()
        opt_sgd.zero_grad()
        out, expected = opt(x), ref(x)
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
        w = torch.randn_like(expected)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        got = opt.fxrec_fused.grads(opt.model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)
        ref_sgd.step()
        opt_sgd.step()
        want = ref.state_dict()
        for name, value in opt.state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=TOL, atol=TOL, msg=name)


def _set(index: int, module: Callable[[], nn.Module]) -> Callable[[Towers], None]:
    def change(m: Towers) -> None:
        m.towers[0][index] = module()

    return change


def _append(m: Towers) -> None:
    m.towers[1].append(nn.Sigmoid())


def _no_dropout(m: Towers) -> None:
    for tower in m.towers:
        tower[3] = nn.Identity()


CHANGES = {
    "activation": _set(2, nn.GELU),
    "appended": _append,
    "dropout_to_identity": _no_dropout,
}


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_replaced_or_added_submodule_is_followed(change: str, untraceable: bool) -> None:
    dropout = 0.5 if change == "dropout_to_identity" else 0.0
    torch.manual_seed(0)
    model = Towers(dropout=dropout, untraceable=untraceable)
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    CHANGES[change](model)
    CHANGES[change](ref)
    _same_training(ref, opt)


def test_new_submodule_in_eval_mode_follows_its_flag() -> None:
    """A module added in eval mode to a training model, later put in training mode alone:
    each flag gets the graphs built for it."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    for m in (model, ref):
        m.towers[2].append(Scale().eval())
    _same_training(ref, opt)
    for m in (model, ref):
        m.towers[2][-1].train()
    _same_training(ref, opt)


def test_hooks_of_a_new_submodule_run() -> None:
    """A hook on a module that symbolic tracing would trace through (and so drop): the new
    module's hooks must be seen for graphs to keep its call."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    calls = []

    def double(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        calls.append(module)
        return out * 2

    for m in (model, ref):
        m.towers[1][2] = Scale()
        m.towers[1][2].register_forward_hook(double)
    _same_training(ref, opt)
    assert calls.count(model.towers[1][2]) == calls.count(ref.towers[1][2]) == 3


def test_module_with_global_hooks_follows_a_swap() -> None:
    """With a global module hook, calls run the model eagerly through the flat parameters
    laid out before it; a swapped module is followed there too."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        for m in (model, ref):
            m.towers[3][2] = nn.SiLU()
        _same_training(ref, opt)
    finally:
        handle.remove()


def test_moved_towers_keep_their_laid_out_parameters() -> None:
    """Two towers swapped: their parameters, laid out, stay in the model under other names;
    graphs are rebuilt on the same flat parameters the optimizer holds."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    flat = [id(p) for p in opt.parameters()]
    for m in (model, ref):
        m.towers[0], m.towers[1] = m.towers[1], m.towers[0]
    _same_training(ref, opt)
    assert [id(p) for p in opt.parameters()] == flat


@pytest.mark.parametrize(
    ("change", "module"),
    [
        (_set(1, lambda: nn.LayerNorm(D)), "towers.0.1"),
        (_set(0, lambda: nn.Linear(D, D)), "towers.0.0"),
        (lambda m: m.towers.__setitem__(0, nn.Sequential(nn.Linear(D, 8))), "towers.0"),
    ],
    ids=["layer_norm", "linear", "whole_tower"],
)
def test_replaced_module_with_laid_out_parameters_raises(
    change: Callable[[Towers], None], module: str
) -> None:
    """Its parameters' values live in flat parameters the optimizer holds: new weights would
    never be trained, so the next call says what to do instead of using either silently."""
    torch.manual_seed(0)
    opt = _optimized(Towers())
    change(opt.model)
    with pytest.raises(
        RuntimeError, match=f"module '{module}', .* replaced or removed .* in place"
    ):
        opt(torch.randn(8, D))


def test_rebuilt_graphs_fuse_as_a_fresh_optimize_does() -> None:
    """The rebuilt graphs keep the layouts and fuse what an optimize of the changed model
    fuses (the swapped activation breaks one group of four ReLUs)."""
    from fxrec.measure import count_kernels

    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    for m in (model, ref):
        m.towers[0][2] = nn.GELU()
    x = torch.randn(8, D)
    fresh = fxrec.optimize(copy.deepcopy(ref), (x,))
    opt(x)  # rebuilt here: counted below as a step, not a build
    assert count_kernels(opt, x) == count_kernels(fresh, x)
    assert count_kernels(opt, x).forward < count_kernels(ref, x).forward


class _Sliced(nn.Module):
    """Slices its ModuleList in forward: a new container, registered into on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x


def test_containers_made_in_forward_are_not_followed() -> None:
    """Only registrations on an optimized model's modules count: a ModuleList sliced in a
    forward (any model's, run eagerly) sends no optimized module to look
    for replaced submodules, and a dynamo trace of it changes no Python state (inside a
    checkpointed region, dynamo refuses such a change: see test_checkpoint_rng)."""
    import fxrec.graph.module as module

    x = torch.randn(4, D)
    sliced = _Sliced()
    opt = fxrec.optimize(copy.deepcopy(sliced), (x,))
    seen = module._registered[0]
    sliced(x)
    torch.compile(sliced, backend="eager")(x)
    assert module._registered[0] == seen
    torch.testing.assert_close(opt(x), sliced(x))


class _Reassigning(Towers):
    """Assigns a fresh module to itself on every call (a module cached or rebuilt in
    forward): the model's own behaviour, not an edit to follow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.out = nn.Identity()
        return self.out(super().forward(x))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_modules_a_forward_assigns_do_not_rebuild(
    untraceable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registrations made while an optimized module runs (its calls, the traces and checks
    of a build, ``optimize``'s own) are not counted: no call rebuilds. A swap the user makes
    afterwards still is."""
    torch.manual_seed(0)
    model = _Reassigning(untraceable=untraceable)
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    builds = []
    build = fxrec.OptimizedModule._build_locked
    monkeypatch.setattr(
        fxrec.OptimizedModule,
        "_build_locked",
        lambda self, *args: builds.append(args[0]) or build(self, *args),
    )
    _same_training(ref, opt)
    assert builds == []
    for m in (model, ref):
        m.towers[0][2] = nn.GELU()
    _same_training(ref, opt)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(opt(torch.ones(8, D)), ref(torch.ones(8, D)))
    assert len(builds) == 2  # after the swap: once with autograd, once without


def test_other_threads_registrations_count_during_a_call() -> None:
    """Only the calling thread's registrations are the model's own: a swap made by another
    thread while one runs a call is counted."""
    import threading

    import fxrec.graph.module as module

    torch.manual_seed(0)
    model = Towers()
    _optimized(model)
    seen = module._registered[0]
    with module._own_call():
        swap = threading.Thread(target=model.towers[0].__setitem__, args=(2, nn.GELU()))
        swap.start()
        swap.join()
        model.towers[1][2] = nn.GELU()  # this thread's, inside the call: the model's own
    assert module._registered[0] == seen + 1


_LOADED = """
import sys, torch
from torch import nn
from tests.graph.test_module_swaps import D, _same_training
torch.manual_seed(0)  # as the tests' own set-up (tests/conftest.py): the same inputs each run
saved = torch.load(sys.argv[1], weights_only=False)
opt, ref = saved["opt"], saved["ref"]
opt(torch.randn(8, D))  # graphs built before the changes
for m in (opt.model, ref):
    m.towers[0][2] = nn.Sigmoid()
_same_training(ref, opt)
weight = torch.randn_like(ref.head.weight)
for m in (opt.model, ref):
    m.head.weight = nn.Parameter(weight.clone())
_same_training(ref, opt)
"""


def test_loaded_in_a_fresh_process_follows_swaps(tmp_path: Path) -> None:
    """``torch.load`` of a whole optimized module in a process that never called
    ``optimize``: an activation swapped and a (not laid-out) parameter replaced after loading
    are followed, as in the process that optimized it."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    torch.save({"opt": opt, "ref": ref}, tmp_path / "opt.pt")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _LOADED, str(tmp_path / "opt.pt")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_module_set_on_the_optimized_module_is_the_models(untraceable: bool) -> None:
    """``opt.head`` reads the model's head, so ``opt.head = new`` replaces it (fine-tuning a
    new head): forward calls it, and the optimizer trains it as the plain model's."""
    torch.manual_seed(0)
    model = Towers(untraceable=untraceable)
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    head = nn.Linear(8 * 4, 3)
    ref.head = copy.deepcopy(head)
    opt.head = head
    assert model.head is head and opt.head is head and "head" not in opt._modules
    _same_training(ref, opt)
    assert opt(torch.randn(8, D)).shape == (8, 3)


class _Scaled(Towers):
    """Reads a plain attribute (a default when it is absent), which graphs bake in."""

    def __init__(self, untraceable: bool) -> None:
        super().__init__(untraceable=untraceable)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * getattr(self, "scale", 3.0)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_value_set_on_the_optimized_module_rebuilds(untraceable: bool) -> None:
    """A plain value set (or deleted) through the optimized module is the model's, and its
    graphs, which baked in the old value, are rebuilt; its own state stays its own."""
    torch.manual_seed(0)
    model = _Scaled(untraceable)
    ref = copy.deepcopy(model)
    opt = _optimized(model)
    opt.scale = ref.scale = 2.0
    assert model.scale == 2.0 and "scale" not in opt.__dict__
    _same_training(ref, opt)
    del opt.scale, ref.scale
    assert not hasattr(model, "scale")
    _same_training(ref, opt)
    opt.eval()
    assert opt.__dict__["training"] is False and model.training is False
    opt.fxrec_report = report = copy.copy(opt.fxrec_report)
    assert opt.__dict__["fxrec_report"] is report
