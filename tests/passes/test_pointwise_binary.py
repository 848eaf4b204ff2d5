"""parallel_binary: N independent add/sub/mul/div/maximum/minimum become one op."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxrec
from tests.passes.test_linear import check_equivalent, fired, forward_ops, refusals

RULES = ["parallel_binary", "cat_of_split", "dead_code"]


class Pairwise(nn.Module):
    """``cat([op(x_i, y_i)])`` over equal column pieces of x and y."""

    def __init__(self, op, n: int, d: int = 3) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.op, self.n, self.d = op, n, d

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xs, ys = torch.split(x, self.d, 1), torch.split(y, self.d, 1)
        return torch.cat([self.op(xs[i], ys[i]) for i in range(self.n)], 1)


def _xy(n: int, d: int = 3):  # type: ignore[no-untyped-def]
    return lambda b: (
        torch.randn(b, n * d, requires_grad=True),
        torch.rand(b, n * d).add(0.5).requires_grad_(),
    )


SPELLINGS = [
    operator.add,
    torch.add,
    torch.Tensor.sub,
    operator.mul,
    torch.div,
    operator.truediv,
    torch.maximum,
    torch.minimum,
    lambda a, b: torch.add(a, b, alpha=2.0),
]


@pytest.mark.parametrize("op", SPELLINGS)
def test_pieces_of_two_tensors_fuse_into_one_op(op) -> None:  # type: ignore[no-untyped-def]
    opt = check_equivalent(lambda: Pairwise(op, 5), _xy(5), rules=RULES)
    assert fired(opt, "parallel_binary") == 1
    assert sum(forward_ops(opt, *_xy(5)(4)).values()) == 1  # the op; split and cat are views


def test_number_operand_shared_by_members() -> None:
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 2, 1)
            return torch.cat([p[0] * 3.0, p[1] * 3.0, p[2] * 3.0], 1)

    opt = check_equivalent(Scaled, lambda b: (torch.randn(b, 6, requires_grad=True),), rules=RULES)
    assert fired(opt, "parallel_binary") == 1


class Separate(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.stack([xs[i] + xs[i + self.n] for i in range(self.n)]).sum(0)


def _separate(n: int):  # type: ignore[no-untyped-def]
    return lambda b: tuple(torch.randn(b, 4, requires_grad=True) for _ in range(2 * n))


def test_separate_operands_need_enough_members_to_pay_for_the_cats() -> None:
    class Two(Separate):
        def forward(self, a, b, c, d):  # type: ignore[no-untyped-def,override]
            return (a + c) * (b + d)

    opt = check_equivalent(lambda: Two(2), _separate(2), rules=RULES)
    assert fired(opt, "parallel_binary") == 0
    assert any("need a cat" in r for r in refusals(opt, "parallel_binary"))

    class Six(Separate):
        def forward(self, *xs):  # type: ignore[no-untyped-def,override]
            s = [xs[i] + xs[i + 6] for i in range(6)]
            return s[0] * s[1] * s[2] * s[3] * s[4] * s[5]

    opt = check_equivalent(lambda: Six(6), _separate(6), rules=RULES)
    assert fired(opt, "parallel_binary") >= 1


def test_broadcasting_and_mixed_dtypes_are_not_fused() -> None:
    class Broadcast(nn.Module):
        def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 2, 1)
            return torch.cat([p[0] * s, p[1] * s, p[2] * s], 1)

    opt = check_equivalent(
        Broadcast,
        lambda b: (torch.randn(b, 6, requires_grad=True), torch.randn(b, 1, requires_grad=True)),
        rules=RULES,
    )
    assert fired(opt, "parallel_binary") == 0

    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            p, q = torch.split(x, 2, 1), torch.split(y, 2, 1)
            return torch.cat([p[0] + q[0], (p[1].double() + q[1]).float()], 1)

    opt = check_equivalent(Mixed, lambda b: (torch.randn(b, 4), torch.randn(b, 4)), rules=RULES)
    assert fired(opt, "parallel_binary") == 0


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 6),
    d=st.integers(1, 4),
    op=st.sampled_from(SPELLINGS),
    batch=st.integers(1, 5),
)
def test_property_binary_fusion_keeps_outputs_and_gradients(n, d, op, batch) -> None:  # type: ignore[no-untyped-def]
    check_equivalent(lambda: Pairwise(op, n, d), _xy(n, d), rules=RULES, batches=(batch, batch + 2))


def test_results_written_in_place_are_not_fused() -> None:
    class Inplace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hs = [p * 2 for p in torch.split(x, 2, 1)]
            hs[0].relu_()
            return torch.cat(hs, 1)

    opt = check_equivalent(Inplace, lambda b: (torch.randn(b, 6),), rules=RULES)
    assert fired(opt, "parallel_binary") == 0
    assert any("written in place" in r for r in refusals(opt, "parallel_binary"))


# -- runs of pieces with a shared operand (FiBiNET's field-each bilinear) ----------------------
class Triangle(nn.Module):
    """``v_i * f_j`` for every pair ``i < j`` of ``f = split(x, 1, 1)``, ``v_i = W_i(f_i)``."""

    def __init__(self, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n - 1))
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fs = torch.split(x, 1, 1)
        out = []
        for i in range(self.n - 1):
            v = self.w[i](fs[i])
            out.extend(v * fs[j] for j in range(i + 1, self.n))
        return torch.cat(out, 1)


def _triangle_x(n: int = 6, d: int = 8):  # type: ignore[no-untyped-def]
    return lambda b: (torch.randn(b, n, d, requires_grad=True),)


def _details(report, rule: str = "parallel_binary") -> list[str]:  # type: ignore[no-untyped-def]
    return [f.detail for f in report.firings if f.rule == rule]


def test_runs_of_pieces_with_a_shared_operand_fuse_as_views() -> None:
    # Batch 128: runs i=0 (5 members) and i=1 (4) hold >= 4 Ki elements and read a part of
    # x (6 Ki elements) small enough for its gradient; the 6 other members are copied.
    opt = check_equivalent(Triangle, _triangle_x(), rules=RULES, batches=(128, 160))
    assert sorted(_details(opt.first_report)) == ["mul x4 (view)", "mul x5 (view)", "mul x6"]
    ops = forward_ops(opt, *_triangle_x()(128))
    assert ops["aten::mul"] == 3
    # The copied set's two operands and the output; the views' operands are not copied.
    assert ops["aten::cat"] == 3


def test_a_part_of_a_large_tracked_tensor_is_not_read_as_a_view_in_training() -> None:
    # Batch 2048: x holds 96 Ki elements, each run's narrow would zero-fill and add a
    # gradient of all of it in backward; each member's operands (2 x 8 Ki) are too large
    # to copy together. Under no_grad the same runs fuse as views.
    model = Triangle()
    x = _triangle_x()(2048)
    opt = fxrec.optimize(copy.deepcopy(model), x, rules=RULES)
    assert opt.fxrec_report.count("parallel_binary") == 0
    assert any("copied together" in r.reason for r in opt.fxrec_report.refusals)
    with torch.no_grad():
        frozen = fxrec.optimize(copy.deepcopy(model), x, rules=RULES)
        torch.testing.assert_close(frozen(*x), model(*x))
    views = sorted(_details(frozen.fxrec_report))
    assert views == ["mul x2 (view)", "mul x3 (view)", "mul x4 (view)", "mul x5 (view)"]


@pytest.mark.parametrize(("batch", "fused"), [(256, True), (2048, False)])
def test_copying_large_separate_operands_is_refused_on_cpu(batch: int, fused: bool) -> None:
    class Six(Separate):
        def forward(self, *xs):  # type: ignore[no-untyped-def,override]
            s = [xs[i] + xs[i + 6] for i in range(6)]
            return s[0] * s[1] * s[2] * s[3] * s[4] * s[5]

    opt = check_equivalent(lambda: Six(6), _separate(6), rules=RULES, batches=(batch,))
    assert (fired(opt, "parallel_binary") == 1) is fused
    assert any("copied together" in r for r in refusals(opt, "parallel_binary")) is not fused
