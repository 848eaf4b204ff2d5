"""Embedding family: parallel lookups become one grouped lookup over one laid-out weight."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrec
from fxrec.nn import _fbgemm
from fxrec.passes.embedding import FuseParallelLookups
from tests.passes.test_linear import check_equivalent, fired, forward_ops, refusals

# Pointwise first: the per-feature casts are fused before the lookups, so the lookup rule
# must read ids through the fused cast. Torch's lowerings: fbgemm's has tests of its own below.
RULES = [
    "parallel_unary",
    "cat_of_split",
    FuseParallelLookups(fbgemm=False),
    "dedup",
    "dead_code",
]
WITH_FBGEMM = ["parallel_unary", "cat_of_split", "parallel_embedding", "dedup", "dead_code"]
needs_fbgemm = pytest.mark.skipif(
    not _fbgemm.has_kernel("cpu"), reason="fbgemm's CPU table-batched lookup is not installed"
)


class Tables(nn.Module):
    """One lookup per feature column: ``ids[:, i]`` (cast per feature if ``cast``)."""

    def __init__(
        self, n: int, bag: bool = False, mode: str = "sum", cast: bool = True, **kw: Any
    ) -> None:
        super().__init__()
        self.n, self.bag, self.cast = n, bag, cast
        if bag:
            self.t = nn.ModuleList(nn.EmbeddingBag(10 + i, 4, mode=mode, **kw) for i in range(n))
        else:
            self.t = nn.ModuleList(nn.Embedding(10 + i, 4, **kw) for i in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cols = torch.unbind(ids, 1)
        outs = []
        for i in range(self.n):
            x = cols[i]
            outs.append(self.t[i](x.long() if self.cast else x))
        return torch.cat(outs, 1)


class ColumnTables(Tables):
    """Columns read as ``ids[:, i]`` (selects): the casts need one cat to fuse."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.t[i](ids[:, i].long()) for i in range(self.n)], 1)


class WeightedTables(Tables):
    def forward(self, ids: torch.Tensor, psw: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.cat([self.t[i](ids[:, i], None, psw[:, i]) for i in range(self.n)], 1)


def _ids(n: int, *trailing: int) -> Any:
    return lambda b: (torch.randint(0, 10, (b, n, *trailing), dtype=torch.int32),)


# The per-table id check of a fused lookup, eagerly on CPU: a clamp into each table's range
# and an equal with the ids (one host read), whatever the number of tables.
ID_CHECK = {"aten::clamp": 1, "aten::equal": 1}


def test_embeddings_with_casts_are_three_kernels_and_an_id_check() -> None:
    opt = check_equivalent(lambda: Tables(6), _ids(6), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    ops = forward_ops(opt, *_ids(6)(4))
    # one cast, one offset add, one lookup; the model's cat of the pieces became a view
    assert ops == {"aten::_to_copy": 1, "aten::add": 1, "aten::embedding": 1, **ID_CHECK}


@pytest.mark.parametrize("model", [Tables, ColumnTables])
def test_kernel_count_does_not_grow_with_tables(model: type) -> None:
    counts = []
    for n in (4, 12):
        opt = check_equivalent(lambda n=n: model(n), _ids(n), rules=RULES, steps=1)
        counts.append(fxrec_count(opt, _ids(n)(4)))
    assert counts[0] == counts[1]


def fxrec_count(opt: Any, xs: tuple) -> tuple[int, int]:
    import fxrec

    k = fxrec.count_kernels(opt, *xs)
    return k.forward, k.backward


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("bag_len", [1, 3, 9])
def test_embedding_bags_2d(mode: str, bag_len: int) -> None:
    opt = check_equivalent(lambda: Tables(5, bag=True, mode=mode), _ids(5, bag_len), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    ops = forward_ops(opt, *_ids(5, bag_len)(4))
    assert {k: ops[k] for k in ID_CHECK} == ID_CHECK
    lookups = {k: v for k, v in ops.items() if k not in ("aten::_to_copy", "aten::add", *ID_CHECK)}
    if mode == "max" or bag_len > 8:  # max pooling and long bags keep embedding_bag
        assert lookups == {"aten::_embedding_bag": 1, "aten::arange": 1}  # 2-D bags: offsets
    elif bag_len == 1:  # a bag of one id is its row
        assert lookups == {"aten::index_select": 1}
    else:  # short bags: one gather of rows, one reduction
        assert lookups == {"aten::index_select": 1, f"aten::{mode}": 1}


def test_embedding_bags_with_per_sample_weights() -> None:
    def inputs(b: int) -> tuple:
        return torch.randint(0, 10, (b, 4, 3)), torch.rand(b, 4, 3)

    opt = check_equivalent(lambda: WeightedTables(4, bag=True), inputs, rules=RULES)
    assert fired(opt, "parallel_embedding") == 1


class Jagged(nn.Module):
    """1-D ids with offsets, one ``F.embedding_bag`` per feature (dynamo's inlined spelling)."""

    def __init__(self, n: int, mode: str = "sum") -> None:
        super().__init__()
        self.mode = mode
        self.w = nn.ParameterList(nn.Parameter(torch.randn(10 + i, 4)) for i in range(n))

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        outs = []
        for i, w in enumerate(self.w):
            outs.append(F.embedding_bag(feats[2 * i], w, feats[2 * i + 1], mode=self.mode))
        return torch.cat(outs, 1)


def _jagged(n: int) -> Any:
    def make(b: int) -> tuple:
        feats = []
        for _ in range(n):
            lengths = torch.randint(0, 4, (b,))
            feats.append(torch.randint(0, 10, (int(lengths.sum()),)))
            feats.append(torch.cumsum(lengths, 0) - lengths)
        return (feats,)

    return make


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_jagged_bags_fuse(mode: str) -> None:
    opt = check_equivalent(lambda: Jagged(6, mode), _jagged(6), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    ops = forward_ops(opt, *_jagged(6)(4))
    assert ops["aten::_embedding_bag"] == 1


def test_few_jagged_bags_are_refused_by_cost() -> None:
    opt = check_equivalent(lambda: Jagged(2), _jagged(2), rules=RULES)
    assert fired(opt, "parallel_embedding") == 0
    assert any("jagged" in r for r in refusals(opt, "parallel_embedding"))


def test_shared_table_appears_once_in_the_combined_weight() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Embedding(10, 4), nn.Embedding(12, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(ids[:, 0]), self.a(ids[:, 1]), self.b(ids[:, 2])], 1)

    opt = check_equivalent(Shared, _ids(3), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    (flat,) = list(opt.fxrec_fused.parameters())
    assert flat.shape == (22, 4)


@pytest.mark.parametrize("kw", [{"padding_idx": 0}, {"scale_grad_by_freq": True}])
def test_special_lookups_are_left_alone(kw: dict) -> None:
    opt = check_equivalent(lambda: Tables(3, **kw), _ids(3), rules=RULES)
    assert fired(opt, "parallel_embedding") == 0


def test_max_norm_lookups_are_left_alone() -> None:
    """max_norm renormalises the table in place during the lookup."""
    import fxrec

    opt = fxrec.optimize(Tables(3, max_norm=1.0), _ids(3)(4), rules=RULES)
    assert opt.fxrec_report.count("parallel_embedding") == 0


def test_different_dims_and_dependent_lookups_not_fused() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Embedding(10, 4), nn.Embedding(10, 6)
            self.c = nn.Embedding(10, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            a = self.a(ids[:, 0])
            c = self.c((a.sum(1) > 0).long())  # depends on a
            return torch.cat([a, self.b(ids[:, 1]), c], 1)

    opt = check_equivalent(Odd, lambda b: (torch.randint(0, 10, (b, 2)),), rules=RULES)
    assert fired(opt, "parallel_embedding") == 0


def test_in_place_user_is_refused() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Embedding(10, 4), nn.Embedding(10, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            a = self.a(ids[:, 0])
            a.mul_(2)
            return a + self.b(ids[:, 1])

    opt = check_equivalent(InPlace, lambda b: (torch.randint(0, 10, (b, 2)),), rules=RULES)
    assert fired(opt, "parallel_embedding") == 0


def test_keep_params_large_tables_refused() -> None:
    opt = check_equivalent(lambda: Tables(3), _ids(3), rules=RULES, keep_params=True)
    assert fired(opt, "parallel_embedding") == 0
    assert any("gathered in-graph" in r for r in refusals(opt, "parallel_embedding"))


def test_sparse_gradients() -> None:
    model = Tables(4, sparse=True)
    import copy

    import fxrec

    ref = copy.deepcopy(model)
    x = _ids(4)(6)[0]
    opt = fxrec.optimize(model, (x,), rules=RULES)
    assert opt.fxrec_report.count("parallel_embedding") == 1
    (opt(x) ** 2).sum().backward()
    (ref(x) ** 2).sum().backward()
    (flat,) = list(opt.fxrec_fused.parameters())
    assert flat.grad.is_sparse
    dense = flat.grad.to_dense()
    torch.testing.assert_close(dense, torch.cat([t.weight.grad.to_dense() for t in ref.t]))


class MixedBags(nn.Module):
    """Bags of different sizes per feature (one id, multi-hot), ids cast per feature."""

    SIZES = (1, 2, 3)

    def __init__(self, n: int, mode: str = "sum", shared: bool = False) -> None:
        super().__init__()
        self.n = n
        tables = [nn.EmbeddingBag(10 + i, 4, mode=mode) for i in range(n)]
        if shared:
            tables[-1] = tables[0]  # the last feature looks up the first feature's table
        self.t = nn.ModuleList(tables)

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t(x.long()) for t, x in zip(self.t, ids)], 1)

    @classmethod
    def inputs(cls, n: int) -> Any:
        sizes = [cls.SIZES[i % len(cls.SIZES)] for i in range(n)]
        return lambda b: ([torch.randint(0, 10, (b, s), dtype=torch.int32) for s in sizes],)


def _uses_fbgemm(opt: Any) -> bool:
    return any("fbgemm" in f.detail for f in opt.fxrec_report.firings)


@needs_fbgemm
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fbgemm_bags_of_any_size_are_one_lookup(mode: str) -> None:
    opt = check_equivalent(lambda: MixedBags(7, mode), MixedBags.inputs(7), rules=WITH_FBGEMM)
    assert fired(opt, "parallel_embedding") == 1
    assert _uses_fbgemm(opt)
    ops = forward_ops(opt, *MixedBags.inputs(7)(4))
    # ids: one cat, read before the casts (fbgemm takes the int32 ids as they are); bag
    # offsets of mixed lengths: one copy of the per-feature lengths, one cumsum, one pad;
    # one lookup. The model's cat of the pooled rows is a view of the lookup's output.
    assert ops == {
        "aten::cat": 1,
        "aten::clone": 1,  # reshape of the expanded lengths (its _unsafe_view is free)
        "aten::cumsum": 1,
        "aten::constant_pad_nd": 1,
        "fbgemm::dense_embedding_codegen_lookup_function": 1,
    }


@needs_fbgemm
def test_fbgemm_kernels_do_not_grow_with_tables() -> None:
    counts = []
    for n in (4, 13):
        opt = check_equivalent(
            lambda n=n: MixedBags(n), MixedBags.inputs(n), rules=WITH_FBGEMM, steps=1
        )
        counts.append(fxrec_count(opt, MixedBags.inputs(n)(4)))
    assert counts[0] == counts[1]


@needs_fbgemm
def test_fbgemm_shared_table_and_weighted_bags() -> None:
    opt = check_equivalent(
        lambda: MixedBags(5, shared=True), MixedBags.inputs(5), rules=WITH_FBGEMM
    )
    assert fired(opt, "parallel_embedding") == 1
    (flat,) = list(opt.fxrec_fused.parameters())
    assert flat.shape == (10 + 11 + 12 + 13, 4)  # the shared table appears once

    def inputs(b: int) -> tuple:
        return torch.randint(0, 10, (b, 4, 3)), torch.rand(b, 4, 3)

    opt = check_equivalent(lambda: WeightedTables(4, bag=True), inputs, rules=WITH_FBGEMM)
    assert _uses_fbgemm(opt)  # torch weighs sum bags only


@needs_fbgemm
def test_fbgemm_is_not_used_in_graphs_traced_again() -> None:
    """AOTAutograd and Inductor trace the graph with fake tensors: fbgemm's op has no fake kernel."""
    import fxrec

    model = MixedBags(6)
    (x,) = MixedBags.inputs(6)(4)
    opt = fxrec.optimize(model, (x,), rules=WITH_FBGEMM, backend="aot_eager")
    # torch's lowering: one lookup per bag size (1, 2, 3), none through fbgemm
    assert opt.fxrec_report.count("parallel_embedding") == 3
    assert not _uses_fbgemm(opt)
    want = model(x)
    torch.testing.assert_close(opt(x), want)


# -- CPU cap on a fused lookup's tables ------------------------------------------------------
# A CPU optimizer steps parameter by parameter with scratch as large as each one: tables past
# the cap are fused in subsets (first fit, in reading order), each laid out under the cap.
BIG_ROWS, BIG_DIM = 24_576, 64  # 6 MiB of float32 per table: two fit under 16 MiB, three do not


class BigTables(nn.Module):
    """Five per-feature bags of 6 MiB tables (30 MiB in all), two ids per bag."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.ModuleList(nn.EmbeddingBag(BIG_ROWS, BIG_DIM, mode="sum") for _ in range(5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(ids[:, i]) for i, t in enumerate(self.t)], 1)


def _big_ids(b: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, BIG_ROWS, (b, 5, 2)),)


def _adagrad_matches(opt: nn.Module, ref: nn.Module, steps: int = 3, ids: Any = None) -> None:
    """Outputs and parameters equal the model as written through ``steps`` Adagrad steps."""
    o_opt = torch.optim.Adagrad(opt.parameters(), lr=0.1)
    o_ref = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    for _ in range(steps):
        (x,) = (ids or _big_ids)(6)
        got, want = opt(x), ref(x)
        torch.testing.assert_close(got, want)
        (got**2).sum().backward()
        (want**2).sum().backward()
        o_opt.step()
        o_ref.step()
        o_opt.zero_grad(set_to_none=True)
        o_ref.zero_grad(set_to_none=True)
    sd_opt, sd_ref = opt.state_dict(), ref.state_dict()
    for k in sd_ref:
        torch.testing.assert_close(sd_opt[k], sd_ref[k])


@pytest.mark.parametrize(
    "rules", [RULES, pytest.param(WITH_FBGEMM, marks=needs_fbgemm)], ids=["torch", "fbgemm"]
)
def test_tables_past_the_cpu_cap_fuse_in_subsets_under_it(rules: list) -> None:
    import copy

    import fxrec
    from fxrec.nn.layout import DEFAULT_MAX_GROUP_BYTES

    opt = check_equivalent(BigTables, _big_ids, rules=rules)
    assert fired(opt, "parallel_embedding") == 2  # tables 0-1 and 2-3; table 4 as written
    assert any("cap" in r for r in refusals(opt, "parallel_embedding"))
    flats = list(opt.fxrec_fused.parameters())
    assert [tuple(f.shape) for f in flats] == [(2 * BIG_ROWS, BIG_DIM)] * 2
    assert all(f.numel() * f.element_size() <= DEFAULT_MAX_GROUP_BYTES for f in flats)
    assert any("cut into 3 sets" in n for n in opt.fxrec_report.notes)
    ops = forward_ops(opt, *_big_ids(4))
    # Two fused lookups, each over two neighbouring columns of the ids (one strided view).
    if rules is RULES:  # per subset: id check, add of offsets (a copy), gather + sum
        per_subset = {**ID_CHECK, "aten::add": 1, "aten::index_select": 1, "aten::sum": 1}
    else:  # per subset: one copy of the ids, member-major; bag offsets (one arange); lookup
        per_subset = {"aten::clone": 1, "aten::arange": 1}
        per_subset["fbgemm::dense_embedding_codegen_lookup_function"] = 1
    want = {k: 2 * v for k, v in per_subset.items()}
    # table 4 as written (its strided column reshaped, its 2-D bags' offsets), the model's cat
    for k in ("aten::_embedding_bag", "aten::clone", "aten::arange", "aten::cat"):
        want[k] = want.get(k, 0) + 1
    assert ops == want, ops

    ref = BigTables()
    model = copy.deepcopy(ref)
    _adagrad_matches(fxrec.optimize(model, _big_ids(4), rules=rules), ref)


MIB_ROWS = (1 << 20) // (BIG_DIM * 4)  # rows of a 1 MiB float32 table of dim BIG_DIM


class SizedTables(nn.Module):
    """Per-feature bags over tables of the given row counts, two ids per bag (ids < 100)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.t = nn.ModuleList(nn.EmbeddingBag(r, BIG_DIM, mode="sum") for r in rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(ids[:, i]) for i, t in enumerate(self.t)], 1)


def _sized_ids(n: int) -> Any:
    return lambda b: (torch.randint(0, 100, (b, n, 2)),)


def test_small_tables_read_around_a_full_one_share_one_lookup() -> None:
    """Small, 16 MiB, small, small: the small tables are packed first fit into one subset
    (the first one used to be cut off alone by the 16 MiB table, and kept its own lookup
    with the reason that its 25 KiB table filled the cap)."""
    import copy

    import fxrec

    rows = [100, 16 * MIB_ROWS, 100, 100]
    opt = check_equivalent(lambda: SizedTables(rows), _sized_ids(4), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    (why,) = refusals(opt, "parallel_embedding")  # the 16 MiB table's member alone
    assert "its table alone fills the 16 MiB cap" in why
    assert [tuple(f.shape) for f in opt.fxrec_fused.parameters()] == [(300, BIG_DIM)]
    ops = forward_ops(opt, *_sized_ids(4)(4))
    fused = {"aten::stack": 1, **ID_CHECK, "aten::add": 1, "aten::index_select": 1}
    assert {k: ops[k] for k in fused} == fused, ops
    assert ops["aten::sum"] == 1 and ops["aten::_embedding_bag"] == 1
    ref = SizedTables(rows)
    model = copy.deepcopy(ref)
    _adagrad_matches(fxrec.optimize(model, _sized_ids(4)(4), rules=RULES), ref, ids=_sized_ids(4))


def test_a_small_table_left_without_room_says_so() -> None:
    """Two 8 MiB tables fill one subset; the small table after them has nothing to fuse
    with, and the report says that, not that its table fills the cap."""
    opt = check_equivalent(lambda: SizedTables([8 * MIB_ROWS, 8 * MIB_ROWS, 100]), _sized_ids(3))
    assert fired(opt, "parallel_embedding") == 1
    (why,) = refusals(opt, "parallel_embedding")
    assert "alone fills" not in why
    assert "left alone when the set was cut into subsets of at most 16 MiB" in why
    assert "0.02 MiB table" in why


# -- lookups pooled by hand -----------------------------------------------------------------
# ``embedding(ids).sum(1)`` is a bag lookup: fused as plain lookups, the backward stacked the
# members' [B, L, D] row gradients (a training step of 8 tables x batch 2048 x 20 ids x dim 64
# was 1.5-2x slower than the model as written); fused as bags, those rows never exist.


class HandPooled(nn.Module):
    """``nn.Embedding`` lookups of 2-D ids, each pooled over its ids as written."""

    def __init__(self, n: int, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.t = nn.ModuleList(nn.Embedding(10 + i, 4) for i in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, t in enumerate(self.t):
            rows = t(ids[:, i])
            if self.pool == "sum":
                outs.append(rows.sum(1))
            elif self.pool == "mean":
                outs.append(rows.mean(dim=-2))
            else:
                outs.append(torch.sum(rows, dim=1))
        return torch.cat(outs, 1)


@pytest.mark.parametrize("pool", ["sum", "mean", "torch.sum"])
@pytest.mark.parametrize("bag_len", [3, 12])
def test_lookups_pooled_by_hand_fuse_as_bags(pool: str, bag_len: int) -> None:
    import fxrec

    opt = check_equivalent(lambda: HandPooled(5, pool), _ids(5, bag_len), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    ops = forward_ops(opt, *_ids(5, bag_len)(4))
    assert "aten::embedding" not in ops
    if bag_len <= 8:  # short bags: one gather of rows and one reduction
        lookup = {"aten::index_select": 1, f"aten::{pool.removeprefix('torch.')}": 1}
    else:  # one embedding_bag (its 2-D ids' bag offsets: an arange)
        lookup = {"aten::arange": 1, "aten::_embedding_bag": 1}
    # the column ids read in place (one view), checked, shifted (a copy); the model's cat of
    # the outputs is a view of the lookup's (batch, members, dim) result
    want = {**ID_CHECK, "aten::add": 1, **lookup}
    assert ops == want, ops
    kc = fxrec.count_kernels(opt, *_ids(5, bag_len)(4))
    assert kc.backward == (2 if bag_len > 8 else 4 if pool == "mean" else 3), kc


# One table-batched lookup for all members; its ids are the columns ``ids[:, 0:5]`` moved
# member-first and flattened (one copy), its bags of one length start every 12 ids (one
# arange), and the model's cat of the pooled rows is a view of its output.
HAND_POOLED_FBGEMM_OPS = {
    "aten::clone": 1,
    "aten::arange": 1,
    "fbgemm::dense_embedding_codegen_lookup_function": 1,
}


@needs_fbgemm
@pytest.mark.parametrize("pool", ["sum", "mean"])
def test_lookups_pooled_by_hand_take_the_fbgemm_lookup(pool: str) -> None:
    opt = check_equivalent(lambda: HandPooled(5, pool), _ids(5, 12), rules=WITH_FBGEMM)
    assert fired(opt, "parallel_embedding") == 1
    assert _uses_fbgemm(opt)
    ops = forward_ops(opt, *_ids(5, 12)(4))
    assert ops == HAND_POOLED_FBGEMM_OPS, ops


class SparseHandPooled(HandPooled):
    """The same lookups of tables with sparse gradients (``embedding_bag``'s 2-D ids when
    fused)."""

    def __init__(self, n: int, pool: str) -> None:
        super().__init__(n, pool)
        self.t = nn.ModuleList(nn.Embedding(10 + i, 4, sparse=True) for i in range(n))


def test_sparse_lookups_pooled_by_hand_over_no_ids_run_as_the_model() -> None:
    """Rows of no ids: ``embedding_bag`` refuses 2-D ids of length 0, so such lookups stay
    plain, and a graph built for longer rows rebuilds for them."""
    torch.manual_seed(0)
    ref = SparseHandPooled(4, "sum")
    opt = fxrec.optimize(copy.deepcopy(ref), _ids(4, 3)(4), rules=RULES)
    opt.first_report = copy.deepcopy(opt.fxrec_report)  # what fired() reads
    assert fired(opt, "parallel_embedding") == 1
    for bag_len in (0, 3):
        (ids,) = _ids(4, bag_len)(5)
        torch.testing.assert_close(opt(ids), ref(ids))
    empty = fxrec.optimize(copy.deepcopy(ref), _ids(4, 0)(4), rules=RULES)
    (ids,) = _ids(4, 0)(4)
    torch.testing.assert_close(empty(ids), ref(ids))
    for module in (opt, empty):  # the rewrites ran: no graph fell back after its check
        assert not [n for n in module.fxrec_report.notes if "check failed" in n]


def test_a_lookup_pooled_with_keepdim_stays_a_plain_lookup() -> None:
    class KeepDim(HandPooled):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.cat([t(ids[:, i]).sum(1, keepdim=True) for i, t in enumerate(self.t)], 1)

    opt = check_equivalent(lambda: KeepDim(5, "sum"), _ids(5, 3), rules=RULES)
    assert fired(opt, "parallel_embedding") == 1
    assert forward_ops(opt, *_ids(5, 3)(4))["aten::embedding"] == 1
