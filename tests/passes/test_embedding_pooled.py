"""Lookups pooled by hand (``embedding(ids[:, i]).sum(1)``) fused as bags, where that pays.

Each costs 2 kernels as written (the lookup, the reduction). Fused, columns ``ids[:, i]`` of
one tensor are read with one copy (or none), bags of one length start at one ``arange``, and
on CPU a set too small to pay for the fused form's fixed work is left as written, with the
reason in the report.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.passes.embedding import MIN_POOLED_MEMBERS, MIN_POOLED_TRAINING_IDS
from tests.passes.test_embedding import RULES, WITH_FBGEMM, needs_fbgemm
from tests.passes.test_linear import check_equivalent, fired, forward_ops, refusals

LOOKUP = "fbgemm::dense_embedding_codegen_lookup_function"
ID_CHECK = {"aten::clamp": 1, "aten::equal": 1}


def _pool(rows: torch.Tensor, mode: str) -> torch.Tensor:
    return rows.sum(1) if mode == "sum" else rows.mean(1)


class Columns(nn.Module):
    """Member ``m`` looks up column ``cols[m]`` of ``ids`` (B, C, L) and pools it by ``modes[m]``."""

    def __init__(self, modes: list[str], cols: list[int], rows: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.modes, self.cols = modes, cols
        self.t = nn.ModuleList(nn.Embedding(rows, dim) for _ in modes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outs = [_pool(t(ids[:, c]), m) for t, c, m in zip(self.t, self.cols, self.modes)]
        return torch.cat(outs, 1)


class Separate(nn.Module):
    """Member ``m`` looks up its own ids tensor (B, L_m) and pools it by ``modes[m]``."""

    def __init__(self, modes: list[str], rows: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.modes = modes
        self.t = nn.ModuleList(nn.Embedding(rows, dim) for _ in modes)

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_pool(t(x), m) for t, x, m in zip(self.t, ids, self.modes)], 1)


def small_model(n: int = 4, mode: str | None = None) -> Columns:
    """A small model: tables of 50 x 8, mean and sum alternately (or all ``mode``)."""
    modes = [mode or ("sum" if i % 2 else "mean") for i in range(n)]
    return Columns(modes, list(range(n)))


def _column_ids(columns: int, bag_len: int) -> Any:
    return lambda b: (torch.randint(0, 50, (b, columns, bag_len)),)


def _counts(module: nn.Module, *xs: Any) -> tuple[int, int]:
    k = fxrec.count_kernels(module, *xs)
    return k.forward, k.backward


# -- kernels ---------------------------------------------------------------------------------


def test_small_sets_at_a_small_batch_are_left_as_written_with_the_reason() -> None:
    """The small model at batch 32: two sets of 2 (mean, sum) each cost more fused than as
    written (fused, 15 forward kernels against 9, and a training step ran ~0.8x)."""
    opt = check_equivalent(small_model, _column_ids(4, 5), batches=(32, 7))
    assert fired(opt, "parallel_embedding") == 0
    reasons = refusals(opt, "parallel_embedding")
    assert len(reasons) == 2
    for why in reasons:
        assert why.startswith("CPU cost model: 2 lookups pooled by hand")
        assert f"from {MIN_POOLED_MEMBERS} members" in why
    (ids,) = _column_ids(4, 5)(32)
    assert _counts(opt, ids) == _counts(small_model(), ids) == (9, 7)


@needs_fbgemm
def test_the_small_model_trains_fused_where_fbgemm_pays_and_runs_as_written_without_gradients() -> (
    None
):
    """Batch 256 x 5 ids per member (past :data:`MIN_POOLED_TRAINING_IDS`): training graphs
    fuse each set of 2 into one table-batched lookup, graphs without gradients do not."""
    assert MIN_POOLED_TRAINING_IDS <= 256 * 5
    opt = check_equivalent(small_model, _column_ids(4, 5), batches=(256, 300))
    assert fired(opt, "parallel_embedding") == 2
    (ids,) = _column_ids(4, 5)(256)
    # per set: one copy of its two columns (ids[:, 0::2], ids[:, 1::2]), one arange of bag
    # offsets, one lookup; then the model's cat. Backward: one per set, the cat's, the seed.
    assert _counts(opt, ids) == (7, 5)
    assert _counts(small_model(), ids) == (9, 7)
    ops = fxrec.count_kernels(opt, ids).forward_ops
    assert ops == {"aten::clone": 2, "aten::arange": 2, LOOKUP: 2, "aten::cat": 1}

    ref = small_model()
    model = fxrec.optimize(copy.deepcopy(ref), (ids,))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids))
    no_grad = [r for r in model.fxrec_report.refusals if r.rule == "parallel_embedding"]
    assert len(no_grad) == 2 and all("these have 1280" in r.reason for r in no_grad)


@needs_fbgemm
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_four_columns_are_one_copy_one_arange_and_one_lookup(mode: str) -> None:
    opt = check_equivalent(lambda: small_model(4, mode), _column_ids(4, 5), batches=(32, 7))
    assert fired(opt, "parallel_embedding") == 1
    (ids,) = _column_ids(4, 5)(32)
    # The four columns are the whole ids tensor, moved member-first (one copy); the model's
    # cat of the pooled rows is a view of the lookup's member-major output.
    assert forward_ops(opt, ids) == {"aten::clone": 1, "aten::arange": 1, LOOKUP: 1}
    assert _counts(opt, ids) == (3, 2)
    assert _counts(small_model(4, mode), ids) == (9, 5 if mode == "sum" else 9)  # mean: a div each


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_four_columns_with_torch_ops_are_read_in_place(mode: str) -> None:
    opt = check_equivalent(lambda: small_model(4, mode), _column_ids(4, 5), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    (ids,) = _column_ids(4, 5)(4)
    # no stack: the columns are a view of the ids; the add of table offsets is their one copy
    want = {**ID_CHECK, "aten::add": 1, "aten::index_select": 1, f"aten::{mode}": 1}
    assert forward_ops(opt, ids) == want


@needs_fbgemm
def test_columns_out_of_order_or_repeated_are_one_index_select() -> None:
    cols = [2, 0, 3, 3]
    opt = check_equivalent(lambda: Columns(["sum"] * 4, cols), _column_ids(4, 3))
    assert fired(opt, "parallel_embedding") == 1
    (ids,) = _column_ids(4, 3)(4)
    assert forward_ops(opt, ids) == {"aten::index_select": 1, "aten::arange": 1, LOOKUP: 1}


@needs_fbgemm
def test_separate_ids_of_mixed_lengths_keep_their_cumsum_offsets() -> None:
    lens = [1, 2, 3, 2]

    def inputs(b: int) -> tuple:
        return ([torch.randint(0, 50, (b, n)) for n in lens],)

    opt = check_equivalent(lambda: Separate(["sum"] * 4), inputs)
    assert fired(opt, "parallel_embedding") == 1
    ops = forward_ops(opt, *inputs(4))
    assert ops == {
        "aten::cat": 1,  # the members' ids
        "aten::clone": 1,  # each member's length repeated over the batch
        "aten::cumsum": 1,
        "aten::constant_pad_nd": 1,
        LOOKUP: 1,
    }


@pytest.mark.parametrize("rules", [RULES, pytest.param(WITH_FBGEMM, marks=needs_fbgemm)])
@pytest.mark.parametrize("spelling", ["unbind", "getitem"])
def test_bags_of_columns_of_the_last_dim(rules: list, spelling: str) -> None:
    """Columns ``ids[:, :, i]`` of (B, L, F) ids: each member's bags are rows of its column,
    so the members go before the rows they pool."""

    class LastDim(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum") for _ in range(5))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            cols = ids.unbind(2) if spelling == "unbind" else [ids[:, :, i] for i in range(5)]
            return torch.cat([t(c) for t, c in zip(self.t, cols)], 1)

    opt = check_equivalent(LastDim, lambda b: (torch.randint(0, 10, (b, 3, 5)),), rules=rules)
    assert fired(opt, "parallel_embedding") == 1


# -- outputs and gradients ---------------------------------------------------------------------
MODES = st.sampled_from(["sum", "mean"])


@st.composite
def column_models(draw: st.DrawFn) -> tuple[list[str], list[int], int, int]:
    """Members' pooling modes and columns (in any order, repeats allowed), columns, bag length."""
    n = draw(st.integers(2, 9))
    columns = draw(st.integers(1, n))
    if draw(st.booleans()):
        modes = [draw(MODES)] * n  # one set of all members
    else:
        modes = draw(st.lists(MODES, min_size=n, max_size=n))
    cols = draw(st.lists(st.integers(0, columns - 1), min_size=n, max_size=n))
    if draw(st.booleans()):  # the common spelling: member i reads column i
        columns, cols = n, list(range(n))
    return modes, cols, columns, draw(st.integers(1, 6))


RULE_SETS = [
    pytest.param(RULES, id="torch"),
    pytest.param(WITH_FBGEMM, marks=needs_fbgemm, id="fbgemm"),
]


def _sets_of(keys: list[Any]) -> int:
    """Sets of lookups that pay for fusing: :data:`MIN_POOLED_MEMBERS` or more sharing a key."""
    return sum(1 for c in Counter(keys).values() if c >= MIN_POOLED_MEMBERS)


@pytest.mark.parametrize("rules", RULE_SETS)
@settings(deadline=None, max_examples=20)
@given(model=column_models(), batch=st.integers(1, 40), other=st.integers(1, 40))
def test_columns_match_the_model_as_written(
    rules: list, model: tuple[list[str], list[int], int, int], batch: int, other: int
) -> None:
    modes, cols, columns, bag_len = model
    opt = check_equivalent(
        lambda: Columns(modes, cols),
        _column_ids(columns, bag_len),
        rules=rules,
        batches=(batch, other),
        steps=2,
    )
    assert fired(opt, "parallel_embedding") == _sets_of(modes)


@pytest.mark.parametrize("rules", RULE_SETS)
@settings(deadline=None, max_examples=12)
@given(
    modes=st.lists(MODES, min_size=2, max_size=9),
    lens=st.lists(st.integers(1, 4), min_size=9, max_size=9),
    equal=st.booleans(),
    batch=st.integers(1, 40),
    other=st.integers(1, 40),
)
def test_separate_ids_match_the_model_as_written(
    rules: list, modes: list[str], lens: list[int], equal: bool, batch: int, other: int
) -> None:
    lens = [lens[0]] * len(modes) if equal else lens[: len(modes)]

    def inputs(b: int) -> tuple:
        return ([torch.randint(0, 50, (b, n)) for n in lens],)

    opt = check_equivalent(
        lambda: Separate(modes), inputs, rules=rules, batches=(batch, other), steps=2
    )
    # fbgemm's lookup takes bags of any length; torch's lookups one length per set
    keys = list(modes) if rules is WITH_FBGEMM else list(zip(modes, lens))
    assert fired(opt, "parallel_embedding") == _sets_of(keys)
