"""Gradients that reach the model's own parameters after ``fxrec.optimize`` laid them out: a
loss term computed on them (an L2 penalty selected by name), optimizers built before optimize
or on a module restored by ``torch.load``, optimizers whose update depends on the whole
tensor, and an optimize run under ``torch.inference_mode()``.

Each test trains the optimized module and a copy of the plain model made before
``fxrec.optimize`` the same way on fresh random inputs and compares losses, gradients and
parameters (through ``state_dict``, which reads the members).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxrec
from fxrec.graph.params import has_grad_hooks
from tests.graph.test_drop_in import TOL, D
from tests.graph.test_flat_params import OPTIMS, N, Towers, _pair, _same_state


def _penalty(model: nn.Module) -> torch.Tensor:
    """An L2 penalty on the weights, selected by the model's parameter names."""
    return sum(p.square().sum() for n, p in model.named_parameters() if n.endswith("weight"))


def _penalized_step(
    module: nn.Module, named: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, **zero: bool
) -> float:
    """One step on ``module``'s loss plus a penalty on ``named``'s parameters."""
    optim.zero_grad(**zero)
    loss = module(x).pow(2).mean() + 1e-2 * _penalty(named)
    loss.backward()
    optim.step()
    return loss.item()


def _x() -> torch.Tensor:
    return torch.randn(16, N * D)


def _trains_like(
    opt: nn.Module, named: nn.Module, ref: nn.Module, optim: str, **zero: bool
) -> None:
    """Three penalized steps (the penalty on ``named``'s parameters) match ``ref``'s: losses,
    then every parameter."""
    o_opt, o_ref = OPTIMS[optim](list(opt.parameters())), OPTIMS[optim](list(ref.parameters()))
    for _ in range(3):
        x = _x()
        got = _penalized_step(opt, named, o_opt, x, **zero)
        want = _penalized_step(ref, ref, o_ref, x, **zero)
        assert got == pytest.approx(want, rel=TOL, abs=TOL)
        _same_state(opt, ref)


@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_penalty_on_the_models_parameters_trains_like_eager(
    optim: str, untraceable: bool, set_to_none: bool
) -> None:
    """The penalty's gradient reaches the members: it must reach the optimizer too."""
    model, opt, ref = _pair(untraceable)
    _trains_like(opt, model, ref, optim, set_to_none=set_to_none)
    assert all(p.grad is None for p in model.parameters() if id(p) in opt.fxrec_fused.member_ids())


def test_grads_include_the_penalty() -> None:
    model, opt, ref = _pair()
    x = _x()
    (opt(x).pow(2).mean() + _penalty(model)).backward()
    (ref(x).pow(2).mean() + _penalty(ref)).backward()
    got = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


def test_fxrecs_own_hooks_are_not_the_users() -> None:
    model, opt, _ = _pair()
    assert not any(has_grad_hooks(p) for p in model.parameters())
    assert not any(has_grad_hooks(p) for p in opt.parameters())
    opt(_x()).sum().backward()  # no hook of the user's: the call does not raise


def test_a_penalty_alone_reaches_the_flat_gradient() -> None:
    """No forward through the optimized module: the flat gradient is created for it."""
    model, opt, ref = _pair()
    _penalty(model).backward()
    _penalty(ref).backward()
    got = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert got[name] is None or not got[name].any(), name
        else:
            torch.testing.assert_close(got[name], p.grad, msg=name)


def test_parameters_unfrozen_after_optimize_take_the_penalty() -> None:
    """Laid out frozen (no gradient, so no hook then), trained after unfreezing."""
    torch.manual_seed(0)
    model = Towers()
    model.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    opt.requires_grad_(True)
    ref.requires_grad_(True)
    _trains_like(opt, model, ref, "adam")


def copied(module: nn.Module, how: str) -> nn.Module:
    """``module`` copied by ``copy.deepcopy`` or a ``torch.save`` / ``torch.load`` round trip."""
    if how == "deepcopy":
        return copy.deepcopy(module)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.load"])
def test_copies_take_the_penalty(how: str) -> None:
    """Copies come without gradient hooks: the layouts install them again."""
    _, opt, ref = _pair()
    copy_ = copied(opt, how)
    _trains_like(copy_, copy_.model, ref, "sgd")


def test_the_plain_model_trained_directly_takes_the_penalty() -> None:
    """An optimizer on the model's own parameters, the model called directly: eager."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    optims = [OPTIMS["adam"](list(m.parameters())) for m in (model, ref)]
    fxrec.optimize(model, (torch.randn(8, N * D),))
    for _ in range(3):
        x = _x()
        got, want = (_penalized_step(m, m, o, x) for m, o in zip((model, ref), optims))
        assert got == pytest.approx(want, rel=TOL, abs=TOL)
        _same_state(model, ref)


# -- optimizers built before optimize ----------------------------------------------------------
def test_an_optimizer_built_before_optimize_raises_with_a_penalty() -> None:
    """Every member gets a gradient from the penalty, the forward's goes to the flat ones."""
    torch.manual_seed(0)
    model = Towers()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    before = copy.deepcopy(opt.state_dict())
    loss = opt(_x()).square().mean() + sum(p.square().sum() for p in model.parameters())
    loss.backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after optimize"):
        early.step()
    assert all(torch.equal(v, opt.state_dict()[k]) for k, v in before.items())


def test_an_optimizer_on_a_loaded_modules_members_raises() -> None:
    """``torch.load`` of the optimized module keeps the check on its members."""
    _, opt, _ = _pair()
    loaded = copied(opt, "torch.load")
    early = torch.optim.SGD(loaded.model.parameters(), lr=0.1)
    loaded(_x()).square().mean().backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after optimize"):
        early.step()


# -- optimizers whose update depends on the whole tensor --------------------------------------
def _whole_tensor_optims() -> list[str]:
    return [name for name in ("Adafactor", "Muon") if hasattr(torch.optim, name)]


def _make(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "Muon":  # matrices only
        return torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.01)
    return getattr(torch.optim, name)(params, lr=0.01)


@pytest.mark.parametrize("name", _whole_tensor_optims())
def test_whole_tensor_optimizers_on_flat_parameters_raise(name: str) -> None:
    _, opt, _ = _pair()
    optim = _make(name, list(opt.parameters()))
    before = copy.deepcopy(opt.state_dict())
    opt(_x()).square().mean().backward()
    with pytest.raises(RuntimeError, match="keep_params=True"):
        optim.step()
    assert all(torch.equal(v, opt.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("name", _whole_tensor_optims())
def test_whole_tensor_optimizers_with_keep_params_train_like_eager(name: str) -> None:
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),), keep_params=True)
    o_opt, o_ref = _make(name, list(opt.parameters())), _make(name, list(ref.parameters()))
    for _ in range(3):
        x = _x()
        for module, optim in ((opt, o_opt), (ref, o_ref)):
            optim.zero_grad()
            module(x).square().mean().backward()
            optim.step()
        _same_state(opt, ref)


# -- optimize under inference mode -------------------------------------------------------------
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_optimize_under_inference_mode_then_train(untraceable: bool) -> None:
    torch.manual_seed(0)
    model = Towers(untraceable)
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        opt = fxrec.optimize(model, (torch.randn(8, N * D),))
        x = _x()
        torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    assert not any(p.is_inference() for p in [*opt.parameters(), *model.parameters()])
    _trains_like(opt, model, ref, "adam")


def test_counting_the_plain_models_kernels_leaves_the_flat_gradients() -> None:
    """``count_kernels`` on the model counts eager's step and leaves every gradient as found."""
    torch.manual_seed(0)
    model = Towers()
    x = torch.randn(8, N * D)
    before = fxrec.count_kernels(model, x)
    opt = fxrec.optimize(model, (x,))
    after = fxrec.count_kernels(model, x)
    assert (after.forward, after.backward) == (before.forward, before.backward)
    assert all(p.grad is None for p in [*opt.parameters(), *model.parameters()])
