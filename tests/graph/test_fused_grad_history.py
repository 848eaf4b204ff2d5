"""Fused members keep the autograd history each one has in the model.

A fused op's result records history if any member's inputs do, and every member becomes a
slice of it: a member plain PyTorch returns without history (a ``.detach()``-ed branch, a
value computed under ``no_grad``, a constant, a buffer, a frozen parameter's output on such
inputs) came back with a ``grad_fn``, and ``out.sum().backward()`` ran where PyTorch raises.
The driver splits every horizontal set by the history its members can carry
(:class:`fxrec.graph.grad_history.GradHistory`) before a rule sees it; each kind still fuses on
its own. Parameters frozen now are kept apart from members that never have history: they
may be unfrozen later.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxrec
from fxrec.graph.grad_history import GradHistory, History


def _outputs(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]  # type: ignore[list-item]


def check_same_history(
    model: nn.Module, inputs: Sequence[torch.Tensor], **kwargs: object
) -> fxrec.OptimizedModule:
    """Optimize a copy of ``model``; assert outputs, their history and gradients match."""
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, tuple(inputs), **kwargs)
    xa = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    xb = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    got, want = _outputs(opt(*xa)), _outputs(ref(*xb))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
        assert g.requires_grad == w.requires_grad
        assert (g.grad_fn is None) == (w.grad_fn is None)
    tracked = [i for i, w in enumerate(want) if w.requires_grad]
    if tracked:
        sum(got[i].sum() for i in tracked).backward()
        sum(want[i].sum() for i in tracked).backward()
        for a, b in zip(xa, xb):
            if b.requires_grad:
                torch.testing.assert_close(a.grad, b.grad)
        grads = dict(opt.fxrec_fused.grads(opt.model))
        for name, p in ref.named_parameters():
            if p.grad is None:
                assert grads.get(name) is None or not grads[name].any(), name
            else:
                torch.testing.assert_close(grads[name], p.grad, msg=name)
    for i, w in enumerate(want):
        if not w.requires_grad:
            with pytest.raises(RuntimeError, match="does not require grad"):
                got[i].sum().backward()
    return opt


def fired(opt: fxrec.OptimizedModule, rule: str) -> int:
    return sum(1 for f in opt.fxrec_report.firings if f.rule == rule)


class DetachedBranch(nn.Module):
    """The tester's case: tanh of three Linear outputs and of a detached piece."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        hs = [lin(p) for lin, p in zip(self.lins, ps)]
        hs.append(ps[3].detach())
        return tuple(torch.tanh(h) for h in hs)


@pytest.mark.parametrize("input_grad", [False, True])
def test_detached_member_keeps_no_history(input_grad: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=input_grad)
    opt = check_same_history(DetachedBranch(), [x])
    assert fired(opt, "parallel_unary") == 1  # the three with history still fuse
    (unary,) = [f for f in opt.fxrec_report.firings if f.rule == "parallel_unary"]
    assert len(unary.nodes) == 3


class FrozenLinears(nn.Module):
    """Linears batched per input piece: some trainable, some frozen on detached pieces."""

    def __init__(self, frozen: int = 2, trainable: int = 3) -> None:
        super().__init__()
        self.frozen = nn.ModuleList(nn.Linear(4, 4) for _ in range(frozen))
        self.frozen.requires_grad_(False)
        self.trainable = nn.ModuleList(nn.Linear(4, 4) for _ in range(trainable))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        outs = [lin(p.detach()) for lin, p in zip(self.frozen, ps)]
        outs += [lin(p) for lin, p in zip(self.trainable, ps[len(self.frozen) :])]
        return tuple(outs)


@pytest.mark.parametrize("frozen", [1, 2])
def test_frozen_linears_on_detached_inputs_batched_apart(frozen: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 20, requires_grad=True)
    opt = check_same_history(FrozenLinears(frozen, 5 - frozen), [x])
    # one set per kind: three trainable, and the frozen ones where there are two
    assert fired(opt, "parallel_linear_batched") == (2 if frozen == 2 else 1)


class FrozenAndDetached(nn.Module):
    """tanh of three frozen Linears' outputs and of three detached values: no history now,
    but unfreezing the Linears gives theirs history and not the detached values'."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.lins.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x.detach(), 4, dim=1)
        hs = [lin(p) for lin, p in zip(self.lins, ps)] + [p * 2 for p in ps[3:]]
        return tuple(torch.tanh(h) for h in hs)


def test_frozen_parameters_kept_apart_from_members_without_history() -> None:
    torch.manual_seed(0)
    model = FrozenAndDetached()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 24)
    opt = fxrec.optimize(model, (x,))
    sizes = [len(f.nodes) for f in opt.fxrec_report.firings if f.rule == "parallel_unary"]
    assert sizes == [3, 3]
    for m in (ref, opt.model):
        m.lins.requires_grad_(True)
    got, want = opt(x), ref(x)
    assert [t.requires_grad for t in want] == [True] * 3 + [False] * 3
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


class NoGradValues(nn.Module):
    """Values computed in a ``no_grad`` block, activated after it next to ones with history."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        hs = [lin(p) for lin, p in zip(self.lins, ps)]
        with torch.no_grad():
            cut = [hs[2] * 2, hs[3] * 3]
        return tuple(torch.tanh(h) for h in [*hs[:2], *cut, ps[0] + 1])


def test_values_computed_without_grad_mode() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    opt = check_same_history(NoGradValues(), [x], check=False)
    assert opt.fxrec_report.capture == "dynamo"


class ConstantsAndBuffers(nn.Module):
    """tanh of a buffer, a constant and integer ids cast to float, beside Linears' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.register_buffer("table", torch.randn(8, 4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        hs = [lin(p) for lin, p in zip(self.lins, ps)]
        plain = [self.table * 2, torch.ones(8, 4) * 3, ids.float() * 4]
        return tuple(torch.tanh(h) for h in hs + plain)


def test_constants_buffers_and_integers_have_no_history() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 12, requires_grad=True)
    ids = torch.randint(0, 5, (8, 4))
    opt = check_same_history(ConstantsAndBuffers(), [x, ids])
    sizes = sorted(len(f.nodes) for f in opt.fxrec_report.firings if f.rule == "parallel_unary")
    assert sizes == [3, 3]


class WrittenBuffer(nn.Module):
    """A zeros tensor filled in place with a Linear's output has that output's history."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        buf = torch.zeros(x.shape[0], 4)
        buf[:, :] = self.lins[0](ps[0])
        hs = [buf, self.lins[1](ps[1]), self.lins[2](ps[2])]
        cut = [p.detach() * 2 for p in ps[3:]]
        return tuple(torch.tanh(h) for h in [*hs, *cut])


def test_tensor_written_in_place_takes_the_history_written() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 20, requires_grad=True)
    opt = check_same_history(WrittenBuffer(), [x])
    sizes = [len(f.nodes) for f in opt.fxrec_report.firings if f.rule == "parallel_unary"]
    assert sizes == [3]


def test_grad_history_kinds() -> None:
    """The kinds as judged on a traced graph, node by node."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.register_buffer("buf", torch.ones(4))

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            a = torch.tanh(self.lin(x))
            b = torch.tanh(self.frozen(x.detach()))
            c = torch.tanh(x.detach().view(x.size(0), -1))
            d = torch.tanh(self.buf * x.detach())
            e = torch.tanh(self.frozen(x))
            return a + b + c + d + e + ids

    gm = fx.symbolic_trace(M())
    history = GradHistory(gm.graph)
    tanh = [n for n in gm.graph.nodes if n.target is torch.tanh]
    kinds = [history(n) for n in tanh]
    assert kinds == [History.RECORDED, History.FROZEN, History.NONE, History.NONE, History.RECORDED]
    assert history(next(n for n in gm.graph.nodes if n.name == "ids")) is History.RECORDED


def test_deep_chain_is_judged_without_recursion() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_method("detach", (x,))
    for _ in range(5000):
        node = graph.call_function(torch.tanh, (node,))
    graph.output(node)
    gm = fx.GraphModule(nn.Module(), graph)
    assert GradHistory(gm.graph)(node) is History.NONE


class ChainedWrites(nn.Module):
    """A tensor filled in place from another one filled with a Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = torch.split(x, 4, dim=1)
        first = x.new_zeros(x.shape[0], 4)
        second = x.new_zeros(x.shape[0], 4)
        first[:, :] = self.lins[0](ps[0])
        second[:, :] = first * 2
        hs = [second, self.lins[1](ps[1]), self.lins[2](ps[2])]
        cut = [p.detach() * 2 for p in ps[3:]]
        return tuple(torch.tanh(h) for h in [*hs, *cut])


def test_tensor_written_from_a_written_tensor() -> None:
    """``second`` takes the history ``first`` was written with: the writes are judged again
    once the first look at them found some."""
    torch.manual_seed(0)
    x = torch.randn(8, 20, requires_grad=True)
    opt = check_same_history(ChainedWrites(), [x])
    sizes = [len(f.nodes) for f in opt.fxrec_report.firings if f.rule == "parallel_unary"]
    assert sizes == [3]
