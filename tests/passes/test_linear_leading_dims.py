"""Parallel Linears on inputs with leading dims: ``(B, 1, D)`` field pieces, ``(B, L, D)``.

A Linear applies per row, so an input ``(*lead, in)`` is its rows: FiBiNET's field-each
bilinear (one ``Linear(D, D)`` per field on the ``(B, 1, D)`` pieces of ``split(x, 1, 1)``)
and per-tower Linears over ``(B, L, D)`` sequences batch into one ``bmm`` like 2-D inputs,
under the same CPU cost limits (a separate input's elements count all its rows), with the
reason in the report when a set is refused. The rewritten graph bakes in no batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxrec
from fxrec.graph import meta
from fxrec.graph.optimize_graph import optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters
from tests.passes.test_linear import (
    LINEAR_RULES,
    check_equivalent,
    fired,
    forward_ops,
    refusals,
)

BATCHED = ["parallel_linear_batched"]


class FieldBilinear(nn.Module):
    """FiBiNET's field-each bilinear: ``W_i(f_i) * f_j`` over the ``(B, 1, D)`` fields."""

    def __init__(self, fields: int = 6, d: int = 8, bias: bool = False) -> None:
        super().__init__()
        self.n = fields
        self.w = nn.ModuleList(nn.Linear(d, d, bias=bias) for _ in range(fields - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fs = torch.split(x, 1, dim=1)
        out = []
        for i, w in enumerate(self.w):
            v = w(fs[i])
            out += [v * fs[j] for j in range(i + 1, self.n)]
        return torch.cat(out, 1)


class SeqTowers(nn.Module):
    """Towers over ``(B, L, D)`` sequences: one each (computed apart), or one shared."""

    def __init__(self, n: int = 3, d: int = 8, hidden: int = 6, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, 4)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.towers)
        xs = [x] * n if self.shared else [torch.tanh(x) * (i + 1) for i in range(n)]
        return torch.cat([t(xi) for t, xi in zip(self.towers, xs)], -1)


def _fields(fields: int = 6, d: int = 8) -> Callable[[int], tuple]:
    return lambda b: (torch.randn(b, fields, d),)


def _seq(length: int = 5, d: int = 8) -> Callable[[int], tuple]:
    return lambda b: (torch.randn(b, length, d),)


def _graph(model: nn.Module, rules: Sequence[str], *example: torch.Tensor) -> fx.GraphModule:
    """The model's graph rewritten for ``example`` on a CPU, runnable."""
    gm = fx.symbolic_trace(model)
    meta.annotate(gm, *example)
    owner = FusedParameters()
    optimize_graph(gm, resolve_rules(rules), owner=owner, device_type="cpu")
    gm.add_submodule("fxrec_fused", owner)
    return gm


# -- pieces of one tensor ----------------------------------------------------------------------
def test_field_bilinear_linears_become_one_bmm() -> None:
    opt = check_equivalent(FieldBilinear, _fields(), rules=BATCHED)
    assert fired(opt, "parallel_linear_batched") == 1
    x = torch.randn(4, 6, 8)
    assert fxrec.count_kernels(FieldBilinear(), x).forward_ops.get("aten::mm") == 5
    ops = forward_ops(opt, x)
    assert ops.get("aten::bmm") == 1 and "aten::mm" not in ops and "aten::stack" not in ops


def test_field_bilinear_with_bias_and_every_rule() -> None:
    opt = check_equivalent(lambda: FieldBilinear(bias=True), _fields(), batches=(4, 7))
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, 6, 8))
    assert ops.get("aten::baddbmm") == 1 and "aten::addmm" not in ops


def test_field_bilinear_kernel_counts() -> None:
    """Forward and backward kernels of the bilinear alone, before and after."""
    torch.manual_seed(0)
    model = FieldBilinear(fields=20)
    x = torch.randn(16, 20, 8, requires_grad=True)
    plain = fxrec.count_kernels(model, x)
    opt = fxrec.optimize(model, (x,), rules=BATCHED)
    fused = fxrec.count_kernels(opt, x)
    assert (plain.forward, plain.backward) == (210, 780)
    assert (fused.forward, fused.backward) == (192, 733)
    assert plain.forward_ops == {  # (each mm's ``_unsafe_view`` of its rows: metadata only)
        "aten::mm": 19,
        "aten::mul": 190,
        "aten::cat": 1,
    }
    assert fused.forward_ops == {"aten::bmm": 1, "aten::mul": 190, "aten::cat": 1}


def test_unbind_pieces_of_4d_tensor() -> None:
    """Second layers of towers fused on one shared sequence read unbind pieces of
    ``(B, L, N, hidden)``: their rows are flattened (a copy) into one bmm."""
    opt = check_equivalent(lambda: SeqTowers(shared=True), _seq(), rules=LINEAR_RULES)
    assert fired(opt, "parallel_linear_same_input") == 1
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, 5, 8))
    assert ops.get("aten::addmm") == 1 and ops.get("aten::baddbmm") == 1


def test_split_of_features_of_3d_tensor() -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.ModuleList(nn.Linear(8, 3) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xs = torch.split(x, 8, -1)
            return torch.stack([lin(xs[i]) for i, lin in enumerate(self.lin)], 0).sum(0)

    opt = check_equivalent(Split, lambda b: (torch.randn(b, 5, 32),), rules=BATCHED)
    assert fired(opt, "parallel_linear_batched") == 1


# -- separate inputs ---------------------------------------------------------------------------
def test_sequence_towers_batch_separate_inputs() -> None:
    opt = check_equivalent(lambda: SeqTowers(n=3), _seq(), rules=BATCHED)
    assert fired(opt, "parallel_linear_batched") == 2  # both layers
    x = torch.randn(4, 5, 8)
    plain = fxrec.count_kernels(SeqTowers(n=3), x).forward_ops
    assert plain == {
        "aten::tanh": 3,
        "aten::mul": 3,
        "aten::addmm": 6,
        "aten::relu": 3,
        "aten::cat": 1,
    }
    assert forward_ops(opt, x) == {
        "aten::tanh": 3,
        "aten::mul": 3,
        "aten::stack": 2,  # each layer's separate inputs (the ReLUs are left to their rule)
        "aten::baddbmm": 2,
        "aten::relu": 3,
        "aten::cat": 1,
    }


def test_large_separate_sequences_are_refused_with_reason() -> None:
    """The CPU cap on stacked inputs counts every row: 64 x 32 x 16 = 32 Ki elements each."""
    opt = check_equivalent(
        lambda: SeqTowers(n=2, d=16, hidden=16),
        _seq(32, 16),
        rules=BATCHED,
        batches=(64, 3),
        steps=1,
    )
    assert any("input elements" in r for r in refusals(opt, "parallel_linear_batched"))
    ops = forward_ops(opt, torch.randn(64, 32, 16))
    assert "aten::baddbmm" not in ops


@pytest.mark.parametrize("shared", [False, True])
def test_no_batch_size_is_baked_in(shared: bool) -> None:
    """A graph rewritten for batch 4 runs batch 7 exactly (exported programs take any)."""
    model = SeqTowers(n=3, shared=shared)
    gm = _graph(model, LINEAR_RULES, *_seq()(4))
    assert "bmm" in gm.code
    x = torch.randn(7, 5, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_field_bilinear_graph_runs_other_batches() -> None:
    model = FieldBilinear()
    gm = _graph(model, BATCHED, torch.randn(4, 6, 8))
    assert "bmm" in gm.code
    x = torch.randn(9, 6, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_field_pieces_of_4d_tensor() -> None:
    """``split(x, 1, 2)`` of ``(B, L, F, D)``: rows over two leading dims, member dim kept."""

    class Fields4d(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ModuleList(nn.Linear(8, 5) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fs = torch.split(x, 1, 2)
            return torch.cat([w(fs[i]) for i, w in enumerate(self.w)], 2)

    opt = check_equivalent(Fields4d, lambda b: (torch.randn(b, 4, 3, 8),), rules=BATCHED)
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, 4, 3, 8))
    assert ops.get("aten::baddbmm") == 1 and "aten::addmm" not in ops


class TwoBilinears(nn.Module):
    """FiBiNET's two bilinears, on the fields and on the reweighted fields."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = FieldBilinear(fields=4), FieldBilinear(fields=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(torch.tanh(x))], 1)


def test_two_tensors_fields_stacked_while_small() -> None:
    opt = check_equivalent(TwoBilinears, _fields(4), rules=BATCHED)
    assert fired(opt, "parallel_linear_batched") == 1
    ops = forward_ops(opt, torch.randn(4, 4, 8))
    assert ops.get("aten::bmm") == 1 and ops.get("aten::stack") == 1


def test_two_tensors_fields_as_views_past_stacking_limit() -> None:
    """2100 x 8 elements per field: too large to stack on a CPU, each tensor's run of fields
    is still read as a view."""
    opt = check_equivalent(TwoBilinears, _fields(4), rules=BATCHED, batches=(2100, 3), steps=1)
    assert fired(opt, "parallel_linear_batched") == 2
    ops = forward_ops(opt, torch.randn(2100, 4, 8))
    assert ops.get("aten::bmm") == 2 and "aten::stack" not in ops and "aten::mm" not in ops


def test_rows_of_a_matrix_as_members() -> None:
    """``split(x, 1, 0)`` of ``(N, D)``: each member is one row, ``(1, D)``."""

    class Rows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ModuleList(nn.Linear(8, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = torch.split(x, 1, 0)
            return torch.cat([w(rows[i]) for i, w in enumerate(self.w)], 0)

    opt = check_equivalent(Rows, lambda b: (torch.randn(3, 8),), rules=BATCHED, batches=(3,))
    assert fired(opt, "parallel_linear_batched") == 1
