"""Fused lookups check every id against its own table, never reading another table's row.

The tables of a fused lookup are laid out in one weight, so an id past its own table would
address a neighbour's row. Each member's ids must raise as the separate lookup does, on
every lowering: eager torch ops, fbgemm's table-batched lookup, and graphs compiled further
(``backend="inductor"``, :func:`fxrec.compile_backend`).
"""

from __future__ import annotations

import collections
import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.nn import _fbgemm
from fxrec.nn.functional import check_jagged_ids, check_member_ids
from fxrec.passes.embedding import FuseParallelLookups
from fxrec.sparse import validation_disabled
from tests.passes.test_embedding import Jagged, MixedBags, Tables, WeightedTables

RULES = [FuseParallelLookups(fbgemm=False), "dead_code"]
WITH_FBGEMM = ["parallel_embedding", "dead_code"]
BATCH = 64
needs_fbgemm = pytest.mark.skipif(
    not _fbgemm.has_kernel("cpu"), reason="fbgemm's CPU table-batched lookup is not installed"
)


class JaggedTables(nn.Module):
    """``nn.EmbeddingBag`` on 1-D ids with offsets (and per-sample weights), one per feature."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.t = nn.ModuleList(nn.EmbeddingBag(10 + i, 4, mode="sum") for i in range(n))

    def forward(self, feats: list[list[torch.Tensor]]) -> torch.Tensor:
        return torch.cat([t(*f) for t, f in zip(self.t, feats)], 1)


def _jagged_feats(n: int, b: int, weighted: bool) -> list[list[torch.Tensor]]:
    """Bags of 1-3 ids, so every member has ids to spoil."""
    feats = []
    for i in range(n):
        lengths = torch.randint(1, 4, (b,))
        f = [torch.randint(0, 10 + i, (int(lengths.sum()),)), torch.cumsum(lengths, 0) - lengths]
        feats.append([*f, torch.rand(f[0].numel())] if weighted else f)
    return feats


def _jagged_flat(n: int, b: int) -> list[torch.Tensor]:
    return [t for f in _jagged_feats(n, b, False) for t in f]


@dataclass(frozen=True)
class Case:
    """A model whose lookups fuse, its inputs, and where member ``m``'s ids are."""

    make: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]
    ids_of: Callable[[tuple, int], tuple[torch.Tensor, tuple]]  # (tensor, index of one id)
    members: int
    prefix: str = "t"  # member m is named f"{prefix}.{m}" and has 10 + m rows
    rules: Any = tuple(RULES)


def _column(xs: tuple, m: int) -> tuple[torch.Tensor, tuple]:
    return xs[0], (1, m)


def _last(xs: tuple, m: int) -> tuple[torch.Tensor, tuple]:
    return (xs[0], (1, m, 0)) if xs[0].dim() == 3 else (xs[0], (1, m))


CASES = {
    "embedding": Case(
        lambda: Tables(4, cast=False),
        lambda b: (torch.randint(0, 10, (b, 4)),),
        _column,
        4,
    ),
    "embedding_2d_ids_cast": Case(
        lambda: Tables(4), lambda b: (torch.randint(0, 10, (b, 4, 2), dtype=torch.int32),), _last, 4
    ),
    "bag_gathered_mean": Case(
        lambda: Tables(4, bag=True, mode="mean"),
        lambda b: (torch.randint(0, 10, (b, 4, 3)),),
        _last,
        4,
    ),
    "bag_max": Case(
        lambda: Tables(4, bag=True, mode="max"),
        lambda b: (torch.randint(0, 10, (b, 4, 3)),),
        _last,
        4,
    ),
    "bag_weighted": Case(
        lambda: WeightedTables(4, bag=True),
        lambda b: (torch.randint(0, 10, (b, 4, 3)), torch.rand(b, 4, 3)),
        _last,
        4,
    ),
    "bag_offsets": Case(
        lambda: JaggedTables(6),
        lambda b: (_jagged_feats(6, b, False),),
        lambda xs, m: (xs[0][m][0], (0,)),
        6,
    ),
    "bag_offsets_weighted": Case(
        lambda: JaggedTables(6),
        lambda b: (_jagged_feats(6, b, True),),
        lambda xs, m: (xs[0][m][0], (-1,)),
        6,
    ),
    "functional_bag_offsets": Case(
        lambda: Jagged(6),
        lambda b: (_jagged_flat(6, b),),
        lambda xs, m: (xs[0][2 * m], (0,)),
        6,
        "w",
    ),
}
FBGEMM_CASE = Case(
    lambda: MixedBags(4),
    MixedBags.inputs(4),
    lambda xs, m: (xs[0][m], (1, 0)),
    4,
    rules=tuple(WITH_FBGEMM),
)


def _spoiled(case: Case, xs: tuple, member: int, value: int) -> tuple:
    """``xs`` with one id of ``member`` set to ``value`` (the rest untouched)."""
    xs = copy.deepcopy(xs)
    t, index = case.ids_of(xs, member)
    t[index] = value
    return xs


def _bad_value(member: int, over: int, negative: bool) -> int:
    return -1 - over if negative else 10 + member + over


def _member(case: Case, m: int) -> str:
    return f"{case.prefix}.{m}"


def _raises(expected: type[Exception], pattern: str, fn: Callable[[], Any]) -> None:
    """``fn()`` raises ``expected`` matching ``pattern``, or an error caused by one.

    A model captured by dynamo re-raises its own error for inputs it rejects (the separate
    lookup's), with the fused lookup's as the cause; other captures raise the latter.
    """
    with pytest.raises(Exception) as info:
        fn()
    chain: list[BaseException] = []
    err: BaseException | None = info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__
    assert any(isinstance(e, expected) and re.search(pattern, str(e)) for e in chain), chain


@functools.cache
def _eager(name: str) -> tuple[Case, nn.Module, tuple]:
    case = FBGEMM_CASE if name == "fbgemm" else CASES[name]
    xs = case.inputs(BATCH)
    opt = fxrec.optimize(case.make(), xs, rules=list(case.rules))
    assert opt.fxrec_report.count("parallel_embedding") == 1
    if name == "fbgemm":
        assert any("fbgemm" in f.detail for f in opt.fxrec_report.firings)
    return case, opt, xs


EAGER = [*CASES, pytest.param("fbgemm", marks=needs_fbgemm)]


@pytest.mark.parametrize("name", EAGER)
@given(data=st.data(), over=st.integers(0, 10**6), negative=st.booleans())
def test_eager_out_of_range_id_raises_index_error_naming_its_lookup(
    name: str, data: st.DataObject, over: int, negative: bool
) -> None:
    case, opt, xs = _eager(name)
    member = data.draw(st.integers(0, case.members - 1))
    value = _bad_value(member, over, negative)
    rows = 10 + member
    expected = f"'{_member(case, member)}': id {value} is out of range for its table of {rows} rows"
    spoiled = _spoiled(case, xs, member, value)
    _raises(IndexError, re.escape(expected), functools.partial(opt, *spoiled))


@pytest.mark.parametrize("name", EAGER)
def test_eager_edge_ids_are_accepted(name: str) -> None:
    """Ids 0 and rows - 1 of every member are in range: same outputs as the separate lookups."""
    case, opt, xs = _eager(name)
    ref = case.make()
    ref.load_state_dict(opt.state_dict())
    for value in (0, 9):  # every member has at least 10 rows
        spoiled = xs
        for m in range(case.members):
            spoiled = _spoiled(case, spoiled, m, value + m * (value > 0))
        torch.testing.assert_close(opt(*spoiled), ref(*spoiled))


@functools.cache
def _fbgemm_shared() -> tuple[nn.Module, tuple]:
    xs = MixedBags.inputs(4)(BATCH)
    opt = fxrec.optimize(MixedBags(4, shared=True), xs, rules=list(WITH_FBGEMM))
    assert any("fbgemm" in f.detail for f in opt.fxrec_report.firings)
    return opt, xs


@needs_fbgemm
@given(member=st.integers(0, 3), over=st.integers(0, 10**6), negative=st.booleans())
def test_fbgemm_lookup_of_a_shared_table_checks_each_members_ids(
    member: int, over: int, negative: bool
) -> None:
    """The last member looks up the first member's table (10 rows) again: fbgemm's own check
    sees no rows for such members and let an id past a table read another table's row."""
    opt, xs = _fbgemm_shared()
    table = 0 if member == 3 else member
    value = _bad_value(table, over, negative)
    spoiled = copy.deepcopy(xs)
    spoiled[0][member][1, 0] = value
    expected = f"'t.{table}': id {value} is out of range for its table of {10 + table} rows"
    _raises(IndexError, re.escape(expected), functools.partial(opt, *spoiled))


@needs_fbgemm
def test_fbgemm_lookup_of_a_shared_table_accepts_edge_ids() -> None:
    opt, xs = _fbgemm_shared()
    ref = MixedBags(4, shared=True)
    ref.load_state_dict(opt.state_dict())
    for m, value in ((0, 9), (1, 10), (2, 11), (3, 9)):
        xs = copy.deepcopy(xs)
        xs[0][m][:, 0] = value
    torch.testing.assert_close(opt(*xs), ref(*xs))


# -- graphs compiled further -------------------------------------------------------------------
def _optimized(case: Case, backend: str, xs: tuple) -> fxrec.OptimizedModule:
    """``fxrec.optimize`` with its graphs compiled further by ``backend``."""
    return fxrec.optimize(case.make(), xs, rules=list(case.rules), backend=backend)


def _assert_same_outputs_and_grads(opt: Any, ref: nn.Module, xs: tuple) -> None:
    out, want = opt(*xs), ref(*xs)
    torch.testing.assert_close(out, want)
    weights = torch.randn(want.shape)
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    grads = opt.fxrec_fused.grads(opt.model)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=k)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_lookup_checks_every_member(name: str, backend: str) -> None:
    """Graphs compiled further: fused, exact, and every member checked.

    The check is a device assert there (no host read), so the error is the assert's
    ``RuntimeError``, listing each member's valid ids.
    """
    case = CASES[name]
    xs = case.inputs(BATCH)  # the example: other id counts would compile again
    opt = _optimized(case, backend, xs)
    ref = case.make()
    ref.load_state_dict(opt.state_dict())
    _assert_same_outputs_and_grads(opt, ref, xs)
    assert opt.fxrec_report.count("parallel_embedding") == 1
    for m in range(case.members):
        listed = re.escape(f"{_member(case, m)} 0..{9 + m}")
        for value in (10 + m, -1):
            spoiled = _spoiled(case, xs, m, value)
            _raises(
                RuntimeError,
                f"embedding id out of range.*{listed}",
                functools.partial(opt, *spoiled),
            )


@pytest.mark.parametrize("name", ["embedding", "bag_weighted", "bag_offsets"])
def test_compile_backend_raises_for_every_member(name: str) -> None:
    """``torch.compile(model, backend=fxrec.compile_backend())``: never another table's row.

    On a CPU the plug-in leaves these lookups separate (their tables are graph inputs that
    it would gather every step) and each raises on its own; fused, the check covers them.
    """
    case = CASES[name]
    xs = case.inputs(BATCH)
    model = case.make()
    compiled = torch.compile(model, backend=fxrec.compile_backend(rules=list(case.rules)))
    torch.testing.assert_close(compiled(*xs), copy.deepcopy(model)(*xs))
    for m in range(case.members):
        for value in (10 + m, -3):
            spoiled = _spoiled(case, xs, m, value)
            _raises(
                Exception,
                "out of (range|bounds)|valid range",
                functools.partial(compiled, *spoiled),
            )


# -- cost: two kernels forward, none backward, off with validation -----------------------------
@pytest.mark.parametrize("name", ["embedding", "bag_gathered_mean", "bag_offsets"])
def test_check_costs_two_forward_kernels_and_follows_the_validation_switch(name: str) -> None:
    _, opt, xs = _eager(name)
    checked = fxrec.count_kernels(opt, *xs)
    with validation_disabled():
        unchecked = fxrec.count_kernels(opt, *xs)
    added = collections.Counter(checked.forward_ops)
    added.subtract(unchecked.forward_ops)
    assert {k: v for k, v in added.items() if v} == {"aten::clamp": 1, "aten::equal": 1}
    assert checked.backward == unchecked.backward


# -- the checks themselves ---------------------------------------------------------------------
@st.composite
def _member_ids(draw: st.DrawFn) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """In-range ids with the members at a drawn dim, maybe one id spoiled; the table sizes."""
    sizes = tuple(draw(st.lists(st.integers(1, 20), min_size=1, max_size=5)))
    shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    dim = draw(st.integers(0, len(shape)))
    shape.insert(dim, len(sizes))
    bound = torch.tensor(sizes).view([-1 if d == dim else 1 for d in range(len(shape))])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(0, 2**20, shape, generator=g) % bound
    if draw(st.booleans()):
        ids.view(-1)[draw(st.integers(0, ids.numel() - 1))] = draw(st.integers(-3, 22))
    return ids, dim, sizes


def _bad_members(ids: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> set[int]:
    return {
        m
        for m, s in enumerate(sizes)
        if bool(((ids.select(dim, m) < 0) | (ids.select(dim, m) >= s)).any())
    }


@given(case=_member_ids(), compiled=st.booleans())
def test_member_ids_check_raises_exactly_for_ids_outside_their_table(
    case: tuple[torch.Tensor, int, tuple[int, ...]], compiled: bool
) -> None:
    ids, dim, sizes = case
    names = tuple(f"m{i}" for i in range(len(sizes)))
    bad = _bad_members(ids, dim, sizes)
    bounds = torch.tensor([[0] * len(sizes), [r - 1 for r in sizes]])
    args = (ids, bounds, dim, names, sizes)
    if not bad:
        assert check_member_ids(*args, compiled=compiled) is ids
        return
    with pytest.raises(IndexError if not compiled else RuntimeError) as err:
        check_member_ids(*args, compiled=compiled)
    if not compiled:  # the host check names one member holding a bad id
        named = re.match(r"embedding lookup 'm(\d+)'", str(err.value))
        assert named is not None and int(named.group(1)) in bad


@given(
    counts=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    spoil=st.one_of(st.none(), st.tuples(st.integers(0, 100), st.sampled_from([-1, 0]))),
    compiled=st.booleans(),
)
def test_jagged_ids_check_names_the_member_of_the_bad_id(
    counts: list[int], spoil: tuple[int, int] | None, compiled: bool
) -> None:
    sizes = tuple(3 + i for i in range(len(counts)))
    ids = torch.cat([torch.arange(c) % s for c, s in zip(counts, sizes)]).long()
    last = torch.repeat_interleave(torch.tensor(sizes), torch.tensor(counts)) - 1
    names = tuple(f"m{i}" for i in range(len(counts)))
    args = (ids, torch.stack([last * 0, last]), torch.tensor(counts), names, sizes)
    if spoil is None or ids.numel() == 0:
        assert check_jagged_ids(*args, compiled=compiled) is ids
        return
    pos = spoil[0] % ids.numel()
    member = int(torch.searchsorted(torch.tensor(counts).cumsum(0), pos, right=True))
    ids[pos] = spoil[1] or sizes[member]  # -1, or the first id past the table
    if compiled:
        with pytest.raises(RuntimeError, match=f"m{member} 0..{sizes[member] - 1}"):
            check_jagged_ids(*args, compiled=True)
    else:
        with pytest.raises(IndexError, match=f"'m{member}': id {int(ids[pos])} "):
            check_jagged_ids(*args)


def test_check_stays_one_node_under_symbolic_tracing() -> None:
    """A rewritten graph traced again keeps the check as the node the rewrite wrote."""

    def f(ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        return check_member_ids(ids, bounds, 1, ("a", "b"), (3, 4)) + 1

    gm = torch.fx.symbolic_trace(f)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(check_member_ids) == 1
    with pytest.raises(IndexError, match="'b': id 4 "):
        gm(torch.tensor([[0, 4]]), torch.tensor([[0, 0], [2, 3]]))


@needs_fbgemm
def test_fbgemm_device_check_and_error_name_the_member() -> None:
    """The check fbgemm's lookup runs off CPU, and the error naming a member, run on CPU."""
    rows = torch.tensor([10, 11])
    offsets = torch.tensor([0, 1, 3, 4, 6])  # 2 members x 2 bags
    good = torch.tensor([9, 0, 1, 10, 0, 3])
    _fbgemm.check_on_device(rows, good, offsets)
    assert _fbgemm.out_of_range(rows, good, offsets, ("a", "b")) is None
    for pos, value, name in ((2, 10, "a"), (4, 11, "b"), (0, -1, "a")):
        bad = good.clone()
        bad[pos] = value
        with pytest.raises(RuntimeError):
            _fbgemm.check_on_device(rows, bad, offsets)
        err = _fbgemm.out_of_range(rows, bad, offsets, ("a", "b"))
        assert isinstance(err, IndexError) and f"'{name}': id {value} " in str(err)
