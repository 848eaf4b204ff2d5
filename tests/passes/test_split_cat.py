"""split/cat family: each rule alone, positive and negative, outputs and gradients unchanged."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.graph.pieces import piece_of

FAMILY = [
    "slices_to_split",
    "drop_single_split",
    "merge_splits",
    "cat_of_split",
    "cat_run_of_pieces",
    "split_of_cat",
]


class Fn(nn.Module):
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Fn2(Fn):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.fn(a, b)


def _run(fn, *shapes: tuple[int, ...], rules=FAMILY):  # type: ignore[no-untyped-def]
    """Optimize ``fn`` with the split/cat rules; check outputs and gradients on fresh inputs."""
    model = (Fn if len(shapes) == 1 else Fn2)(fn)
    opt = fxrec.optimize(model, tuple(torch.randn(s) for s in shapes), rules=rules)
    assert opt.fxrec_report.capture == "symbolic_trace"
    opt.report = copy.deepcopy(opt.fxrec_report)  # this capture only (new batch sizes add more)
    (opt.graph,) = [getattr(r, "gm", r).graph for r in opt._runners.values()]  # gm: unfused
    for batch in (shapes[0][0], shapes[0][0] + 2):
        xs = [torch.randn((batch, *s[1:]), requires_grad=True) for s in shapes]
        ys = [x.detach().clone().requires_grad_() for x in xs]
        got, want = opt(*xs), fn(*ys)
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        got.backward(g)
        want.backward(g)
        for x, y in zip(xs, ys):
            # An input the rewrite no longer reads gets no gradient instead of zeros.
            gx = torch.zeros_like(x) if x.grad is None else x.grad
            torch.testing.assert_close(gx, y.grad)
    return opt


def _graph(opt) -> fx.Graph:  # type: ignore[no-untyped-def]
    return opt.graph


def _targets(opt) -> list:  # type: ignore[no-untyped-def]
    return [n.target for n in _graph(opt).nodes if n.op in ("call_function", "call_method")]


# -- cat_of_split --------------------------------------------------------------------------
def test_cat_of_all_pieces_is_the_input() -> None:
    opt = _run(lambda x: torch.cat(torch.split(x, 3, 1), 1) * 2, (4, 9))
    assert opt.report.count("cat_of_split") == 1
    assert torch.cat not in _targets(opt)
    x = torch.randn(4, 9, requires_grad=True)
    assert fxrec.count_kernels(opt, x).forward == 1  # the mul only


def test_cat_of_subrange_is_a_narrow_view() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = torch.split(x, [2, 3, 1, 4], 1)
        return torch.cat([b, c], 1) + d.sum(1, keepdim=True) + a.sum(1, keepdim=True)

    opt = _run(fn, (3, 10))
    assert opt.report.count("cat_of_split") == 1
    assert "narrow" in _targets(opt) and torch.cat not in _targets(opt)


def test_stack_of_unbind_and_cat_of_unbind() -> None:
    opt = _run(lambda x: torch.stack(torch.unbind(x, 1), 1).tanh(), (2, 3, 4))
    assert opt.report.count("cat_of_split") == 1
    opt = _run(lambda x: torch.cat(x.unbind(0), 0).tanh(), (3, 2, 4))
    assert opt.report.count("cat_of_split") == 1
    assert "flatten" in _targets(opt)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.cat(torch.split(x, 3, 1)[::-1], 1),  # out of order
        lambda x: torch.cat(torch.split(x, 3, 1), 0),  # another dim
        lambda x: torch.cat(
            [torch.split(x, 3, 1)[0], torch.split(x, 3, 1)[1], x], 1
        ),  # not only pieces
        lambda x: torch.cat(torch.split(x, 3, 1)[:2], 1).add_(1),  # result written in place
        lambda x: torch.cat(torch.unbind(x, 1), 0),  # unbind pieces joined along another dim
    ],
)
def test_cat_of_split_negative(fn) -> None:  # type: ignore[no-untyped-def]
    opt = _run(fn, (4, 9))
    assert opt.report.count("cat_of_split") == 0
    assert torch.cat in _targets(opt)


# -- cat_run_of_pieces ---------------------------------------------------------------------
def _cat_inputs(opt) -> list[list]:  # type: ignore[no-untyped-def]
    return [list(n.args[0]) for n in _graph(opt).nodes if n.target is torch.cat]


def test_run_of_split_pieces_inside_a_cat_is_one_view() -> None:
    def fn(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        p = torch.split(x, 2, 1)
        return torch.cat([d, p[0], p[1], p[2], p[3], p[4], d * 2], 1)

    opt = _run(fn, (3, 10), (3, 4))
    assert opt.report.count("cat_run_of_pieces") == 1
    (inputs,) = _cat_inputs(opt)
    assert len(inputs) == 3 and inputs[1].op == "placeholder"  # the whole of x


def test_run_of_unbind_pieces_inside_a_cat_is_one_flatten() -> None:
    def fn(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        u = torch.unbind(t.tanh(), 1)
        return torch.cat([d, u[0], u[1], u[2], u[3], u[4]], 1)

    opt = _run(fn, (3, 5, 4), (3, 2))
    assert opt.report.count("cat_run_of_pieces") == 1
    (inputs,) = _cat_inputs(opt)
    assert len(inputs) == 2 and inputs[1].target == "flatten"
    assert fxrec.count_kernels(opt, torch.randn(3, 5, 4), torch.randn(3, 2)).forward == 2


@pytest.mark.parametrize(
    "fn",
    [
        lambda t, d: torch.cat([d, t.unbind(1)[3], t.unbind(1)[2], t.unbind(1)[1]], 1),  # order
        lambda t, d: torch.cat([d, t.unbind(1)[0], t.unbind(1)[2]], 1),  # a gap
        lambda t, d: torch.cat([d, t.unbind(1)[0], t.unbind(1)[1]], 1),  # part of t only
        lambda t, d: torch.cat([d, t.unbind(2)[0], t.unbind(2)[1]], 1),  # unbind on another dim
        lambda t, d: torch.cat([d, *[t.unbind(1)[i] for i in range(4)]], 1).add_(1),  # in place
    ],
)
def test_cat_run_of_pieces_negative(fn) -> None:  # type: ignore[no-untyped-def]
    opt = _run(fn, (3, 4, 4), (3, 4))
    assert opt.report.count("cat_run_of_pieces") == 0


def test_split_with_other_users_stays() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, 2, 1)
        return torch.cat(parts, 1) * parts[1].sum()

    opt = _run(fn, (3, 6))
    assert opt.report.count("cat_of_split") == 1
    assert torch.split in _targets(opt)


# -- split_of_cat ----------------------------------------------------------------------------
def test_split_of_cat_vanishes() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p, q = torch.split(torch.cat([a, b], 1), [3, 5], 1)
        return p.sum(1) + q.sum(1)

    opt = _run(fn, (4, 3), (4, 5), rules=["split_of_cat"])
    assert opt.report.count("split_of_cat") == 1
    assert torch.cat not in _targets(opt)
    opt = _run(lambda a, b: torch.stack([a, b], 1).unbind(1)[1] * 2, (4, 3), (4, 3))
    assert opt.report.count("split_of_cat") == 1


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.split(torch.cat([a, b], 1), 4, 1)[1] * 2,  # sizes differ
        lambda a, b: torch.split(torch.cat([a, b], 1), 2, 0)[0] * 1,  # another dim
    ],
)
def test_split_of_cat_negative(fn) -> None:  # type: ignore[no-untyped-def]
    opt = _run(fn, (4, 3), (4, 5), rules=["split_of_cat"])
    assert opt.report.count("split_of_cat") == 0


def test_split_of_cat_piece_written_in_place_is_kept() -> None:
    # Autograd forbids writing into split views, so this runs without gradients.
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p, _ = torch.split(torch.cat([a, b], 1), [3, 5], 1)
        p.mul_(2)
        return p.sum(1) + a.sum(1)

    opt = fxrec.optimize(Fn2(fn), (torch.randn(4, 3), torch.randn(4, 5)), rules=FAMILY)
    assert opt.fxrec_report.count("split_of_cat") == 0
    a, b = torch.randn(4, 3), torch.randn(4, 5)
    torch.testing.assert_close(opt(a, b), fn(a, b))


# -- drop_single_split / merge_splits / slices_to_split ----------------------------------------
def test_single_piece_split_is_its_input() -> None:
    opt = _run(lambda x: torch.split(x, 5, 1)[0] * 2 + x.chunk(1, 1)[0], (3, 5))
    assert opt.report.count("drop_single_split") == 2
    assert not any(t in (torch.split, "chunk") for t in _targets(opt))
    opt = _run(lambda x: torch.split(x, 2, 1)[0] * 2, (3, 5), rules=["drop_single_split"])
    assert opt.report.count("drop_single_split") == 0


def test_split_of_a_split_piece_merges() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [4, 6], 1)
        c, d, e = torch.split(b, 2, 1)
        return a.sum(1) + c.sum(1) * 2 + d.sum(1) * 3 + e.sum(1) * 4

    opt = _run(fn, (3, 10), rules=["merge_splits"])
    assert opt.report.count("merge_splits") == 1
    splits = [n for n in _graph(opt).nodes if n.target is torch.split]
    assert len(splits) == 1 and splits[0].args[1] == [4, 2, 2, 2]

    # A cat of pieces of both splits, in order, is a view of x once the splits are one.
    def joined(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [4, 6], 1)
        c, _ = torch.split(b, 3, 1)
        return torch.cat([a, c], 1) * 2

    opt = _run(joined, (2, 10))
    assert opt.report.count("merge_splits") == 1
    assert opt.report.count("cat_of_split") == 1
    assert torch.cat not in _targets(opt)


def test_merge_keeps_piece_with_other_users() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [4, 6], 1)
        c, d = torch.split(b, 3, 1)
        return a.sum(1) + c.sum(1) + d.sum(1) * b.sum(1)

    opt = _run(fn, (3, 10), rules=["merge_splits"])
    assert opt.report.count("merge_splits") == 1


def test_split_along_another_dim_not_merged() -> None:
    fn = lambda x: torch.split(torch.split(x, 2, 1)[0], 1, 2)[0] * 2  # noqa: E731
    opt = _run(fn, (3, 4, 2), rules=["merge_splits"])
    assert opt.report.count("merge_splits") == 0


def test_slices_become_one_split() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, 0:3], x[:, 3:6], x.narrow(1, 6, 2)], 1) + x[:, 8:].sum(1, True)

    opt = _run(fn, (4, 10))
    assert opt.report.count("slices_to_split") == 1
    nodes = list(_graph(opt).nodes)
    assert not any(n.target is operator.getitem and piece_of(n) is None for n in nodes)
    assert opt.report.count("cat_of_split") == 1


def test_slices_with_gap_and_negative() -> None:
    opt = _run(lambda x: x[:, 1:3] * x[:, 5:7], (3, 9), rules=["slices_to_split"])
    assert opt.report.count("slices_to_split") == 1
    # overlapping slices, batch-dim slices, strided slices: left alone
    for fn in (
        lambda x: x[:, 0:4] * x[:, 2:6],
        lambda x: x[0:1] * x[1:2],
        lambda x: x[:, 0:4:2] * x[:, 4:8:2],
    ):
        opt = _run(fn, (3, 9), rules=["slices_to_split"])
        assert opt.report.count("slices_to_split") == 0


# -- property --------------------------------------------------------------------------------
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    order=st.randoms(use_true_random=False),
    resplit=st.booleans(),
    act=st.booleans(),
)
def test_property_split_cat_graphs(sizes: list[int], order, resplit: bool, act: bool) -> None:  # type: ignore[no-untyped-def]
    total = sum(sizes)
    perm = list(range(len(sizes)))
    if order.random() < 0.5:
        order.shuffle(perm)
    lo = order.randrange(len(sizes))
    hi = order.randrange(lo, len(sizes)) + 1

    def fn(x: torch.Tensor) -> torch.Tensor:
        sp = torch.split(x, sizes, 1)
        parts = [sp[i] for i in range(len(sizes))]
        if resplit and sizes[0] > 1:
            inner = torch.split(parts[0], 1, 1)
            parts = [inner[i] for i in range(sizes[0])] + parts[1:]
        if act:
            parts = [p.tanh() for p in parts]
        whole = torch.cat([parts[i] for i in perm if i < len(parts)], 1)
        sub = torch.cat(parts[lo:hi], 1)
        return whole.sum(1) + sub.sum(1) * 2

    _run(fn, (3, total))
