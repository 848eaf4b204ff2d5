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
