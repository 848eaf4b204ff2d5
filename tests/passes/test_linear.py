"""Linear family: same-input fusion and batched matmul, positive and negative cases.

Every positive case checks outputs and gradients against the unoptimised model on fresh
inputs, at the example batch size and another one, state_dict keys/shapes, a load round
trip, three SGD steps with an optimizer built after ``optimize`` and ``keep_params=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

import fxrec
from fxrec.graph import meta
from fxrec.graph.module import optimize
from fxrec.graph.optimize_graph import optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters

LINEAR_RULES = ["parallel_linear_same_input", "parallel_linear_batched"]


# -- shared equivalence harness (also used by the embedding, dedup and tower tests) ------------
def _leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _loss(out: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(())
    for t in _leaves(out):
        if t.is_floating_point():
            total = total + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
    return total


def _clone_inputs(xs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    a, b = [], []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            a.append(x.detach().clone().requires_grad_())
            b.append(x.detach().clone().requires_grad_())
        else:
            a.append(x)
            b.append(x)
    return a, b


def check_equivalent(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[int], tuple],
    *,
    rules: Sequence[str] | None = None,
    batches: Sequence[int] = (4, 7),
    steps: int = 3,
    keep_params: bool = False,
    lr: float = 0.1,
) -> fxrec.OptimizedModule:
    """Optimize a copy of the model; assert it behaves exactly like the original."""
    ref = make_model()
    model = copy.deepcopy(ref)
    opt = optimize(model, make_inputs(batches[0]), rules=rules, keep_params=keep_params)
    opt.first_report = copy.deepcopy(opt.fxrec_report)  # later batch sizes capture again
    # state_dict: same keys and shapes, loads both ways
    sd_ref, sd_opt = ref.state_dict(), opt.state_dict()
    assert list(sd_ref) == list(sd_opt)
    assert all(sd_ref[k].shape == sd_opt[k].shape for k in sd_ref)
    for b in batches:
        xs = make_inputs(b)
        xa, xb = _clone_inputs(xs)
        got, want = opt(*xa), ref(*xb)
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            torch.testing.assert_close(g, w)
        if any(t.requires_grad for t in _leaves(want)):
            _loss(got, b).backward()
            _loss(want, b).backward()
            for a, c in zip(xa, xb):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    ga = torch.zeros_like(a) if a.grad is None else a.grad
                    gc = torch.zeros_like(c) if c.grad is None else c.grad
                    torch.testing.assert_close(ga, gc)
    # Parameter gradients, through training: optimizers built after optimize.
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    for p in opt.parameters():
        p.grad = None
    if not list(ref.parameters()):
        return opt
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=lr)
    for step in range(steps):
        xs = make_inputs(batches[step % len(batches)])
        xa, xb = _clone_inputs(xs)
        out_o, out_r = opt(*xa), ref(*xb)
        if not any(t.requires_grad for t in _leaves(out_r)):
            break
        sgd_opt.zero_grad()
        sgd_ref.zero_grad()
        _loss(out_o, 100 + step).backward()
        _loss(out_r, 100 + step).backward()
        sgd_opt.step()
        sgd_ref.step()
        sd_o, sd_r = opt.state_dict(), ref.state_dict()
        for k in sd_r:
            torch.testing.assert_close(sd_o[k], sd_r[k], msg=f"{k} after step {step}")
    # load_state_dict round trip writes through into laid-out parameters
    fresh = make_model()
    opt.load_state_dict(fresh.state_dict())
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[k], v)
    xs = make_inputs(batches[0])
    for g, w in zip(_leaves(opt(*xs)), _leaves(fresh(*xs)), strict=True):
        torch.testing.assert_close(g, w)
    ref.load_state_dict(opt.state_dict())
    return opt


def fired(opt: fxrec.OptimizedModule, rule: str | None = None) -> int:
    """Firings in the graph captured for the example inputs."""
    return opt.first_report.count(rule)


def refusals(opt: fxrec.OptimizedModule, rule: str) -> list[str]:
    return [r.reason for r in opt.first_report.refusals if r.rule == rule]


def forward_ops(opt: nn.Module, *xs: Any) -> dict[str, int]:
    """Forward kernels per op, counted after a first call (which may capture a new graph)."""
    with torch.no_grad():
        opt(*xs)
    return fxrec.count_kernels(opt, *xs).forward_ops


# -- models ------------------------------------------------------------------------------------
class Heads(nn.Module):
    """N Linears on one input (call_module), optionally biased and of different widths."""

    def __init__(self, outs: Sequence[int], d: int = 8, bias: Sequence[bool] | None = None) -> None:
        super().__init__()
        bias = bias or [True] * len(outs)
        self.heads = nn.ModuleList(nn.Linear(d, o, bias=b) for o, b in zip(outs, bias))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(h(x) for h in self.heads)


class FunctionalHeads(nn.Module):
    """``F.linear`` / ``torch._C._nn.linear`` with parameters read as attributes (get_attr)."""

    def __init__(self, n: int, d: int = 8, bias: bool = True, fn: Any = F.linear) -> None:
        super().__init__()
        self.fn = fn
        self.w = nn.ParameterList(nn.Parameter(torch.randn(5, d)) for _ in range(n))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(5)) for _ in range(n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [
            self.fn(x, w, self.b[i] if self.b is not None else None) for i, w in enumerate(self.w)
        ]
        return torch.cat(outs, 1)


def _x(d: int = 8) -> Callable[[int], tuple]:
    return lambda b: (torch.randn(b, d),)


# -- same input --------------------------------------------------------------------------------
def test_same_input_modules_become_one_linear() -> None:
    opt = check_equivalent(lambda: Heads([5, 5, 5]), _x(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 1
    # the heads are returned: one copy makes the pieces of equal width dense again
    assert forward_ops(opt, torch.randn(4, 8)) == {"aten::addmm": 1, "aten::clone": 1}


def test_same_input_different_widths_and_no_bias() -> None:
    opt = check_equivalent(lambda: Heads([3, 6, 2], bias=[False] * 3), _x(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 1
    assert forward_ops(opt, torch.randn(4, 8)) == {"aten::mm": 1, "aten::clone": 3}


@pytest.mark.parametrize("fn", [F.linear, torch._C._nn.linear])
@pytest.mark.parametrize("bias", [True, False])
def test_same_input_functional_spellings(fn: Any, bias: bool) -> None:
    opt = check_equivalent(lambda: FunctionalHeads(3, bias=bias, fn=fn), _x(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 1
    ops = forward_ops(opt, torch.randn(4, 8))
    assert ops.get("aten::addmm", 0) + ops.get("aten::mm", 0) == 1


def test_mixed_bias_members_are_not_fused_together() -> None:
    opt = check_equivalent(
        lambda: Heads([4, 4, 4, 4], bias=[True, True, False, False]), _x(), rules=LINEAR_RULES
    )
    assert fired(opt, "parallel_linear_same_input") == 2  # one per bias kind
    ops = forward_ops(opt, torch.randn(4, 8))
    assert ops == {"aten::addmm": 1, "aten::mm": 1, "aten::clone": 2}


def test_first_layers_of_deep_towers_fuse() -> None:
    """Inductor's BFS stops at the next Linear; the search has no depth limit."""

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.towers = nn.ModuleList(
                nn.Sequential(*[nn.Linear(8, 8) for _ in range(7)]) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([t(x) for t in self.towers], 0).sum(0)

    opt = check_equivalent(Deep, _x(), rules=["parallel_linear_same_input"])
    assert fired(opt, "parallel_linear_same_input") == 1


def test_dependent_linears_are_not_fused() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    opt = check_equivalent(Chain, _x(), rules=LINEAR_RULES)
    assert fired(opt) == 0


def test_mixed_dtypes_are_not_fused() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4).double()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x.double())

    opt = check_equivalent(Mixed, _x(), rules=LINEAR_RULES)
    assert fired(opt) == 0


def test_in_place_user_is_refused() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            y.relu_()
            return y + self.b(x)

    opt = check_equivalent(InPlace, _x(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 0
    assert any("in place" in r for r in refusals(opt, "parallel_linear_same_input"))


def test_member_with_several_users() -> None:
    class Users(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return y * y.sigmoid() + self.b(x) - y

    opt = check_equivalent(Users, _x(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 1


def test_shared_linear_on_one_input_is_not_duplicated_wrongly() -> None:
    """One Linear applied twice to one input (a shared parameter): still exact."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + 2 * self.a(x) + self.b(x)

    check_equivalent(Twice, _x(), rules=LINEAR_RULES)


def test_keep_params_small_weights_fuse_in_graph() -> None:
    opt = check_equivalent(
        lambda: Heads([4, 4, 4], d=4), _x(4), rules=LINEAR_RULES, keep_params=True, batches=(64, 70)
    )
    assert fired(opt, "parallel_linear_same_input") == 1
    assert list(opt.fxrec_fused.parameters()) == []  # nothing laid out: originals are the leaves


def test_cost_model_refuses_in_graph_gather_of_large_weights() -> None:
    opt = check_equivalent(
        lambda: Heads([64, 64], d=64), _x(64), rules=LINEAR_RULES, keep_params=True, batches=(2, 3)
    )
    assert fired(opt, "parallel_linear_same_input") == 0
    assert any("gathered in-graph" in r for r in refusals(opt, "parallel_linear_same_input"))


# -- same-shaped inputs: batched matmul --------------------------------------------------------
class PerInput(nn.Module):
    """N Linears, each on its own input (separate tensors or pieces of one)."""

    def __init__(
        self, n: int, d: int = 8, out: int = 6, bias: bool = True, pieces: str = ""
    ) -> None:
        super().__init__()
        self.n, self.d, self.pieces = n, d, pieces
        self.lin = nn.ModuleList(nn.Linear(d, out, bias=bias) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces == "split":
            xs = torch.split(x, self.d, 1)
        elif self.pieces == "unbind":
            xs = torch.unbind(x, 1)
        else:
            xs = [torch.tanh(x) * (i + 1) for i in range(self.n)]  # separate tensors
        return torch.cat([lin(xs[i]) for i, lin in enumerate(self.lin)], 1)


@pytest.mark.parametrize("bias", [True, False])
def test_batched_over_separate_inputs(bias: bool) -> None:
    opt = check_equivalent(lambda: PerInput(3, bias=bias), _x(), rules=["parallel_linear_batched"])
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, 8))
    assert ops.get("aten::baddbmm" if bias else "aten::bmm") == 1
    assert ops.get("aten::stack") == 1


def test_batched_two_members_fuse() -> None:
    """Multi-task models have 2 towers: groups of 2 fuse."""
    opt = check_equivalent(lambda: PerInput(2), _x(), rules=["parallel_linear_batched"])
    assert fired(opt, "parallel_linear_batched") == 1


@pytest.mark.parametrize("n", [2, 4])
def test_batched_wide_separate_inputs_are_left_on_cpu(n: int) -> None:
    """Separate inputs of 256 x 128 each: on a CPU, stacking them costs more than one bmm
    saves over N GEMMs (two-tower models' last Linears ran slower fused)."""
    d, batch = 128, 256
    opt = check_equivalent(
        lambda: PerInput(n, d=d), _x(d), rules=["parallel_linear_batched"], batches=(batch, 7)
    )
    assert fired(opt, "parallel_linear_batched") == 0
    assert any("input elements" in r for r in refusals(opt, "parallel_linear_batched"))
    ops = forward_ops(opt, torch.randn(batch, d))
    assert ops.get("aten::addmm") == n and "aten::baddbmm" not in ops


def test_batched_wide_pieces_of_one_tensor_fuse_on_cpu() -> None:
    """Pieces of one tensor are read through a view: nothing is stacked."""
    d, batch = 128, 256
    opt = check_equivalent(
        lambda: PerInput(2, d=d, pieces="split"),
        _x(2 * d),
        rules=["parallel_linear_batched"],
        batches=(batch, 7),
    )
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(batch, 2 * d))
    assert "aten::stack" not in ops and ops.get("aten::baddbmm") == 1


def test_batched_wide_separate_inputs_fuse_on_gpu() -> None:
    """On a GPU a launch costs more than the stack: the rule is told the graph is for one."""
    model = PerInput(2, d=128)
    gm = fx.symbolic_trace(model)
    meta.annotate(gm, torch.randn(256, 128))
    owner = FusedParameters()
    rules = resolve_rules(["parallel_linear_batched"])
    report = optimize_graph(gm, rules, owner=owner, device_type="cuda")
    assert report.count("parallel_linear_batched") == 1
    gm.add_submodule("fxrec_fused", owner)
    x = torch.randn(256, 128)
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("pieces, shape", [("split", (8 * 4,)), ("unbind", (4, 8))])
def test_batched_over_pieces_reads_a_view(pieces: str, shape: tuple[int, ...]) -> None:
    opt = check_equivalent(
        lambda: PerInput(4, pieces=pieces), lambda b: (torch.randn(b, *shape),), rules=LINEAR_RULES
    )
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, *shape))
    assert "aten::stack" not in ops and ops.get("aten::baddbmm") == 1


def test_batched_refuses_one_shared_input() -> None:
    opt = check_equivalent(lambda: Heads([4, 4]), _x(), rules=["parallel_linear_batched"])
    assert fired(opt, "parallel_linear_batched") == 0
    assert any("one input" in r for r in refusals(opt, "parallel_linear_batched"))


def test_batched_shared_linear_on_two_inputs() -> None:
    """One Linear used on two inputs: the weight is shared, gathered in-graph, still exact."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) * self.a(y)

    opt = check_equivalent(
        Shared,
        lambda b: (torch.randn(b, 4), torch.randn(b, 4)),
        rules=LINEAR_RULES,
        batches=(16, 9),
    )
    assert fired(opt, "parallel_linear_batched") == 1
    assert list(opt.fxrec_fused.parameters()) == []  # a shared weight is never laid out twice


def test_batched_different_shapes_not_fused() -> None:
    class Shapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(y)

    opt = check_equivalent(
        Shapes, lambda b: (torch.randn(b, 8), torch.randn(b, 6)), rules=LINEAR_RULES
    )
    assert fired(opt) == 0


def test_dynamo_capture_fuses_inlined_linears() -> None:
    """A model symbolic tracing cannot capture: dynamo inlines the Linears."""

    class Untraceable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(8, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() > 1:  # data-dependent control flow on a shape: tracing fails
                x = x * 1.0
            return torch.cat([h(x) for h in self.heads], 1)

    torch._dynamo.reset()
    opt = check_equivalent(Untraceable, _x(), rules=LINEAR_RULES, batches=(4,), steps=2)
    assert opt.fxrec_report.capture == "dynamo"
    assert fired(opt, "parallel_linear_same_input") >= 1
