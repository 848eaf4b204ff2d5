"""Parameters laid out twice: per task, experts and a gate read the same input, so their
Linears become one Linear over concatenated weights (a flat parameter); the tasks run in
parallel on separate inputs, so those flat weights are then stacked across the tasks (a flat
parameter holding flat parameters). Only the outermost one is trained: every gradient that
reaches a model parameter by name (``grads``, a penalty on ``model.named_parameters()``) must
land in it, and everything that walks the layouts (state dicts, copies, conversions, flags,
parameter groups, the optimizer checks) must see through both levels.

Each test trains the optimized module and a copy of the plain model made before
``fxrec.optimize`` the same way on fresh random inputs and compares losses, gradients and
parameters (through ``state_dict``, which reads the members).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import fxrec
from tests.graph.test_drop_in import TOL
from tests.graph.test_member_grads import copied

TASKS, D, B = 3, 16, 32


class TaskExperts(nn.Module):
    """PLE-like: per task a Linear, then two expert Linears and a gate on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ModuleList(nn.Linear(D, D) for _ in range(TASKS))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Linear(D, D) for _ in range(2)) for _ in range(TASKS)
        )
        self.gates = nn.ModuleList(nn.Linear(D, 2) for _ in range(TASKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for pre, experts, gate in zip(self.pre, self.experts, self.gates):
            h = torch.relu(pre(x))
            e = torch.stack([torch.relu(m(h)) for m in experts], 1)
            g = torch.softmax(gate(h), -1).unsqueeze(-1)
            outs.append((g * e).sum(1))
        return torch.stack(outs, 1)


def _pair() -> tuple[TaskExperts, fxrec.OptimizedModule, TaskExperts]:
    """(model, its optimized module, a plain copy made before optimize); the optimized
    module holds flat parameters laid out in others."""
    torch.manual_seed(0)
    model = TaskExperts()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(B, D),))
    fused = opt.fxrec_fused
    nested = [n for n, t in fused.named_parameters() if id(t) in fused.member_ids()]
    assert nested, "no flat parameter was laid out in another"
    return model, opt, ref


def _penalty(model: nn.Module) -> torch.Tensor:
    """An L2 penalty on the experts' and gates' parameters, selected by name."""
    return sum(
        p.square().sum() for n, p in model.named_parameters() if n.startswith(("experts", "gates"))
    )


def _loss(module: nn.Module, named: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).square().mean() + 1e-1 * _penalty(named)


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=TOL, atol=TOL, msg=k)


def _trains_like(
    opt: nn.Module, named: nn.Module, ref: nn.Module, optim: str = "sgd", steps: int = 3
) -> None:
    """``steps`` penalized steps match ``ref``'s: losses, then every parameter."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    }[optim]
    o_opt, o_ref = make(list(opt.parameters())), make(list(ref.parameters()))
    for _ in range(steps):
        x = torch.randn(B, D)
        losses = []
        for module, names, o in ((opt, named, o_opt), (ref, ref, o_ref)):
            o.zero_grad()
            loss = _loss(module, names, x)
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=TOL, abs=TOL)
        _same_state(opt, ref)


def test_grads_by_name_are_the_plain_models() -> None:
    """``grads`` reads each parameter's gradient in the outermost flat parameter."""
    model, opt, ref = _pair()
    x = torch.randn(B, D)
    _loss(opt, model, x).backward()
    _loss(ref, ref, x).backward()
    got = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_a_penalty_on_the_models_parameters_trains_like_eager(optim: str) -> None:
    """The penalty's gradient reaches the members: it must reach the trained flat parameter."""
    model, opt, ref = _pair()
    _trains_like(opt, model, ref, optim)
    members = opt.fxrec_fused.member_ids()
    assert all(p.grad is None for p in model.parameters() if id(p) in members)


def test_parameters_are_the_outermost_flat_parameters() -> None:
    """``opt.parameters()`` holds every trained value once: no member, no flat parameter
    laid out in another."""
    model, opt, _ = _pair()
    members = opt.fxrec_fused.member_ids()
    params = list(opt.parameters())
    assert not any(id(p) in members for p in params)
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in params) == total


def test_state_dict_round_trip() -> None:
    """Values loaded into the optimized module reach the trained flat parameter."""
    model, opt, ref = _pair()
    _trains_like(opt, model, ref, steps=1)
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    opt.load_state_dict(new)
    ref.load_state_dict(new)
    _same_state(opt, ref)
    x = torch.randn(B, D)
    torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    _trains_like(opt, model, ref)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_trains_like_eager(how: str) -> None:
    _, opt, ref = _pair()
    copy_ = copied(opt, how)
    _trains_like(copy_, copy_.model, copy.deepcopy(ref))
    _trains_like(opt, opt.model, ref)  # the original is independent of its copy


def test_converted_to_double_trains_like_eager() -> None:
    model, opt, ref = _pair()
    opt.double()
    ref.double()
    torch.set_default_dtype(torch.float64)
    try:
        _trains_like(opt, model, ref)
    finally:
        torch.set_default_dtype(torch.float32)


def test_new_data_given_to_the_flat_parameters_reaches_the_members() -> None:
    """``vector_to_parameters`` on ``opt.parameters()``: ``state_dict`` shows it."""
    model, opt, ref = _pair()
    for module in (opt, ref):
        params = list(module.parameters())
        vector_to_parameters(parameters_to_vector(params) * 1.5 + 0.25, params)
    _same_state(opt, ref)
    _trains_like(opt, model, ref)


def test_requires_grad_reaches_both_levels() -> None:
    model, opt, ref = _pair()
    model.requires_grad_(False)  # the model's own flags: the flat parameters follow
    opt(torch.randn(B, D))
    assert not any(p.requires_grad for p in opt.parameters())
    for p in opt.parameters():  # a flag set on the flat parameters: every member follows
        p.requires_grad_(True)
    opt(torch.randn(B, D))
    assert all(p.requires_grad for p in model.parameters())
    _trains_like(opt, model, ref)


def test_freezing_one_tasks_parameters_raises() -> None:
    """One task's parameters share the stacked flat parameter with the other tasks'."""
    model, opt, _ = _pair()
    model.experts[0].requires_grad_(False)
    model.gates[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad=False and others True"):
        opt(torch.randn(B, D))


def test_param_groups_give_the_outermost_flat_parameters() -> None:
    model, opt, ref = _pair()

    def groups(m: nn.Module) -> list[dict]:
        decay = [p for n, p in m.named_parameters() if not n.endswith("bias")]
        no_decay = [p for n, p in m.named_parameters() if n.endswith("bias")]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    o_opt = torch.optim.AdamW(fxrec.param_groups(opt, groups(model)), lr=0.01)
    o_ref = torch.optim.AdamW(groups(ref), lr=0.01)
    held = {id(p) for g in o_opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in opt.parameters()}
    for _ in range(3):
        x = torch.randn(B, D)
        for module, names, o in ((opt, model, o_opt), (ref, ref, o_ref)):
            o.zero_grad()
            _loss(module, names, x).backward()
            o.step()
        _same_state(opt, ref)


def test_an_optimizer_on_the_models_parameters_raises() -> None:
    model, opt, _ = _pair()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    opt(torch.randn(B, D)).square().mean().backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after optimize"):
        stale.step()


def test_a_graph_fusing_only_the_inner_layer_reads_the_outermost_flat() -> None:
    """At a batch where the CPU cost model refuses the batched Linear across tasks but not
    the Linear over each task's input, the graph reads each task's concatenated weight:
    through the stacked flat parameter, which gets the gradient."""
    model, opt, ref = _pair()
    x = torch.randn(1500, D)
    _loss(opt, model, x).backward()
    _loss(ref, ref, x).backward()
    fused = opt.fxrec_fused
    nested = {n for n, t in fused.named_parameters() if id(t) in fused.member_ids()}
    runner = opt._runners[next(k for k in opt._runners if str([1500, D]) in str(k))]
    read = {n.target.split(".", 1)[1] for n in runner.graph.nodes if n.op == "get_attr"}
    assert read and not read & nested
    got = fused.grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


def test_views_run_the_model_through_the_outermost_flat() -> None:
    """The eager path (``views``): the model run on views of the flat parameters."""
    model, opt, ref = _pair()
    views = opt.fxrec_fused.views(model)
    assert views.keys() == dict(model.named_parameters()).keys()
    x = torch.randn(B, D)
    out = torch.func.functional_call(model, views, (x,))
    (out.square().mean() + 1e-1 * _penalty(model)).backward()
    _loss(ref, ref, x).backward()
    got = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)
