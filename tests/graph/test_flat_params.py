"""Laid-out parameters under code that reaches past the module: new data given to the flat
parameters (``vector_to_parameters``), gradient hooks on the model's parameters,
``copy.deepcopy`` of a module together with its optimizer, and an optimizer built before
``fxrec.optimize``.

Each test runs the same workflow on the optimized module and on a copy of the plain model
made before ``fxrec.optimize``, and compares losses, parameters (through ``state_dict``, which
reads the members) and hook calls over several steps on fresh random inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import fxrec
from tests.graph.test_drop_in import TOL, D, Norms

N = 4


class Towers(Norms):
    """Per-slice LayerNorm -> Linear -> tanh (stacked layouts) and heads sharing one input
    (a concatenated layout where the rules fuse them)."""

    def __init__(self, untraceable: bool = False) -> None:
        super().__init__(N, untraceable)
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))
        self.heads = nn.ModuleList(nn.Linear(N * D, D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.untraceable and x.dim() > 1:  # a branch on a shape: dynamo captures it
            x = x + 0
        parts = [x[:, D * i : D * i + D] for i in range(N)]
        y = torch.cat([torch.tanh(lin(n(p))) for p, n, lin in zip(parts, self.norms, self.lins)], 1)
        return torch.cat([h(y) for h in self.heads], 1)


Optim = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMS: dict[str, Optim] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def _pair(untraceable: bool = False) -> tuple[Towers, fxrec.OptimizedModule, Towers]:
    """(model, its optimized module, a plain copy made before optimize)."""
    torch.manual_seed(0)
    model = Towers(untraceable)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    assert len(opt.fxrec_fused.member_ids()) > 0  # something was laid out
    return model, opt, ref


def _step(module: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    optim.zero_grad()
    loss = module(x).pow(2).mean()
    loss.backward()
    optim.step()
    return loss.item()


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=TOL, atol=TOL, msg=k)


# -- new data given to a flat parameter ----------------------------------------------------------
@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_perturbing_parameters_through_vector_to_parameters(optim: str, untraceable: bool) -> None:
    """A SAM-like step: parameters replaced by a perturbed vector, gradients taken there, the
    saved vector put back, then the optimizer steps. The members (``state_dict``) follow."""
    _, opt, ref = _pair(untraceable)
    pairs = [
        (ref, OPTIMS[optim](list(ref.parameters()))),
        (opt, OPTIMS[optim](list(opt.parameters()))),
    ]
    for i in range(4):
        x = torch.randn(16, N * D)
        losses = []
        for module, o in pairs:
            params = list(o.param_groups[0]["params"])
            saved = parameters_to_vector(params)
            vector_to_parameters(saved * 1.05 + 0.01 * (i + 1), params)  # new data
            o.zero_grad()
            loss = module(x).pow(2).mean()
            loss.backward()
            vector_to_parameters(saved, params)  # new data again: the saved vector
            o.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=TOL, abs=TOL)
        losses = [module(x).pow(2).mean().item() for module, _ in pairs]
        assert losses[0] == pytest.approx(losses[1], rel=TOL, abs=TOL)
        _same_state(opt, ref)


def test_data_assigned_to_a_flat_parameter_reaches_the_members() -> None:
    """``p.data = t`` on a parameter of ``opt.parameters()``, then training on it."""
    model, opt, ref = _pair()
    flat_name = next(iter(dict(opt.fxrec_fused.named_parameters())))
    flat = getattr(opt.fxrec_fused, flat_name)
    flat.data = flat.data + 1.0  # new storage
    where = opt.fxrec_fused.locate()
    laid_out = {n for n, p in model.named_parameters() if where.get(id(p), ("",))[0] == flat_name}
    with torch.no_grad():  # the same change to the plain model's parameters
        for name, p in ref.named_parameters():
            if name in laid_out:
                p.add_(1.0)
    o_ref, o_opt = OPTIMS["adam"](list(ref.parameters())), OPTIMS["adam"](list(opt.parameters()))
    for _ in range(3):
        x = torch.randn(16, N * D)
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=TOL, abs=TOL)
        opt(x)  # a call: members view the flat data (state_dict alone: see the test below)
        _same_state(opt, ref)


def test_sync_data_makes_state_dict_right_without_a_call() -> None:
    _, opt, ref = _pair()
    for m in (ref, opt):
        vector_to_parameters(parameters_to_vector(m.parameters()) * 2.0, m.parameters())
    opt.fxrec_fused.sync_data()
    _same_state(opt, ref)


def test_state_dict_right_after_new_flat_data() -> None:
    _, opt, ref = _pair()
    for m in (ref, opt):
        vector_to_parameters(parameters_to_vector(m.parameters()) * 2.0, m.parameters())
    _same_state(opt, ref)


def test_flat_data_of_another_shape_raises() -> None:
    _, opt, _ = _pair()
    flat = next(opt.fxrec_fused.parameters())
    flat.data = torch.zeros(flat.numel() + 1)
    with pytest.raises(RuntimeError, match="data of the same shape, dtype and device"):
        opt(torch.randn(8, N * D))


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_member_data_given_between_backward_and_step_is_stepped(optim: str) -> None:
    """A constraint written ``w.data = w.data.clamp(...)`` on the model's weights after
    backward and before the step: the step updates the clamped values, as in the plain model
    (the members' new data reaches the flat parameters before the optimizer reads them)."""
    model, opt, ref = _pair()
    o_ref, o_opt = OPTIMS[optim](list(ref.parameters())), OPTIMS[optim](list(opt.parameters()))
    for _ in range(3):
        x = torch.randn(16, N * D)
        for module, lins, o in ((ref, ref.lins, o_ref), (opt, model.lins, o_opt)):
            o.zero_grad()
            module(x).pow(2).mean().backward()
            for lin in lins:
                lin.weight.data = lin.weight.data.clamp(-0.2, 0.2)
            o.step()
        _same_state(opt, ref)
        torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)


def test_member_data_shows_in_the_parameters_at_once() -> None:
    """``opt.parameters()`` right after ``member.data = t`` (an EMA reading them before any
    call) holds the member's new values in its slice."""
    model, opt, ref = _pair()
    for lins in (model.lins, ref.lins):
        lins[1].weight.data = torch.zeros_like(lins[1].weight)
    torch.testing.assert_close(
        parameters_to_vector(opt.parameters()).sum(), parameters_to_vector(ref.parameters()).sum()
    )
    _same_state(opt, ref)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_after_new_flat_data_compute_with_it(how: str) -> None:
    """An EMA swapped in with ``p.data = ema`` over ``opt.parameters()``, then a snapshot of
    the module: the snapshot computes with the new data, not the members' old data."""
    import pickle

    _, opt, ref = _pair()
    for m in (ref, opt):
        for p in m.parameters():
            p.data = p.data * 0.5 + 0.1
    snap = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    x = torch.randn(8, N * D)
    torch.testing.assert_close(snap(x), ref(x), rtol=TOL, atol=TOL)
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)


def test_first_call_in_a_new_mode_after_new_flat_data_still_fuses() -> None:
    """New flat data, then the first call under ``no_grad`` (a graph built and checked there):
    the check compares like with like, so that mode's graph fuses too."""
    _, opt, ref = _pair()
    for m in (ref, opt):
        vector_to_parameters(parameters_to_vector(m.parameters()) * 1.5, m.parameters())
    x = torch.randn(8, N * D)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    assert not any("check failed" in n for n in opt.fxrec_report.notes)


# -- gradient hooks on the model's parameters -------------------------------------------------
def _hook_up(model: nn.Module, calls: dict[str, int]) -> list[torch.utils.hooks.RemovableHandle]:
    """A hook masking one weight's gradient and one counting accumulated gradients."""

    def mask(g: torch.Tensor) -> torch.Tensor:
        calls["mask"] += 1
        return torch.zeros_like(g)

    def count(p: torch.Tensor) -> None:
        calls["acc"] += 1

    return [
        model.norms[0].weight.register_hook(mask),
        model.lins[1].bias.register_post_accumulate_grad_hook(count),
    ]


@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_gradient_hooks_registered_before_optimize_run(optim: str, untraceable: bool) -> None:
    torch.manual_seed(0)
    model = Towers(untraceable)
    ref = copy.deepcopy(model)
    ref_calls, calls = {"mask": 0, "acc": 0}, {"mask": 0, "acc": 0}
    _hook_up(ref, ref_calls)
    _hook_up(model, calls)
    masked = model.norms[0].weight.detach().clone()
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    members = opt.fxrec_fused.member_ids()
    assert id(model.norms[0].weight) not in members  # hooked: not laid out
    assert id(model.lins[1].bias) not in members
    assert members  # the others still are
    assert calls == {"mask": 0, "acc": 0}  # fxrec.optimize ran no step through the hooks
    o_ref, o_opt = OPTIMS[optim](list(ref.parameters())), OPTIMS[optim](list(opt.parameters()))
    for _ in range(3):
        x = torch.randn(16, N * D)
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=TOL, abs=TOL)
        _same_state(opt, ref)
    assert calls == ref_calls == {"mask": 3, "acc": 3}
    torch.testing.assert_close(model.norms[0].weight.detach(), masked)  # its gradient was masked


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_gradient_hooks_registered_after_optimize_raise(untraceable: bool) -> None:
    model, opt, _ = _pair(untraceable)
    x = torch.randn(8, N * D)
    opt(x)
    handles = _hook_up(model, {"mask": 0, "acc": 0})
    with pytest.raises(RuntimeError, match=r"before fxrec.optimize .*keep_params=True"):
        opt(x)
    with pytest.raises(RuntimeError, match="gradient hook"):  # until it is removed
        opt(x)
    for h in handles:
        h.remove()
    opt(x).sum().backward()


def test_gradient_hooks_with_keep_params_run() -> None:
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),), keep_params=True)
    ref_calls, calls = {"mask": 0, "acc": 0}, {"mask": 0, "acc": 0}
    _hook_up(ref, ref_calls)
    _hook_up(model, calls)
    o_ref, o_opt = OPTIMS["sgd"](list(ref.parameters())), OPTIMS["sgd"](list(opt.parameters()))
    for _ in range(3):
        x = torch.randn(16, N * D)
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=TOL, abs=TOL)
    _same_state(opt, ref)
    assert calls == ref_calls == {"mask": 3, "acc": 3}


# -- copy.deepcopy of the module with its optimizer ---------------------------------------------
@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("order", ["module_first", "optimizer_first"])
def test_deepcopy_with_the_optimizer_keeps_them_linked(optim: str, order: str) -> None:
    _, opt, ref = _pair()
    o_ref, o_opt = OPTIMS[optim](list(ref.parameters())), OPTIMS[optim](list(opt.parameters()))
    for _ in range(2):  # optimizer state to copy
        x = torch.randn(16, N * D)
        _step(ref, o_ref, x)
        _step(opt, o_opt, x)
    copies = []
    for module, o in ((ref, o_ref), (opt, o_opt)):
        if order == "module_first":
            copies.append(copy.deepcopy((module, o)))
        else:
            o2, m2 = copy.deepcopy((o, module))
            copies.append((m2, o2))
    (ref2, o_ref2), (opt2, o_opt2) = copies
    held = {id(p) for g in o_opt2.param_groups for p in g["params"]}
    assert held == {id(p) for p in opt2.parameters()}
    assert set(map(id, o_opt2.state)) == held
    before = copy.deepcopy(opt.state_dict())
    for _ in range(3):
        x = torch.randn(16, N * D)
        assert _step(opt2, o_opt2, x) == pytest.approx(_step(ref2, o_ref2, x), rel=TOL, abs=TOL)
        _same_state(opt2, ref2)
    for k, v in opt.state_dict().items():  # the original did not move
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    _same_state(opt, ref)


# -- an optimizer built before optimize --------------------------------------------------------
@pytest.mark.parametrize("untraceable", [False, True])
def test_an_optimizer_built_before_optimize_raises_on_its_step(untraceable: bool) -> None:
    """It holds the members, whose gradients go to the flat parameters: it would skip them."""
    torch.manual_seed(0)
    model = Towers(untraceable)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    before = copy.deepcopy(opt.state_dict())
    opt(torch.randn(8, N * D)).square().mean().backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after optimize"):
        early.step()
    assert all(torch.equal(v, opt.state_dict()[k]) for k, v in before.items())  # no half step
    late = torch.optim.SGD(opt.parameters(), lr=0.1)
    late.step()  # built on opt.parameters(): steps
    assert not all(torch.equal(v, opt.state_dict()[k]) for k, v in before.items())


def test_the_plain_model_still_trains_with_its_own_optimizer() -> None:
    """Trained directly (not through optimize's module), members get gradients: no alarm."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    fxrec.optimize(model, (torch.randn(8, N * D),))
    for _ in range(3):
        x = torch.randn(8, N * D)
        for m, o in zip((model, ref), optims):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_members_swapping_their_data_keep_both_values(untraceable: bool) -> None:
    """``a.data, b.data = b.data, a.data`` (experts reordered): each member's new data is the
    other's slice of one flat parameter; writing one back must not overwrite the other's."""
    model, opt, ref = _pair(untraceable)
    x = torch.randn(8, N * D)
    opt(x)
    for m in (model, ref):
        a, b = m.lins[0].weight, m.lins[1].weight
        a.data, b.data = b.data, a.data
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    _same_state(opt.model, ref)
