"""Dtypes and weights on the wire: every rank must send the same dtypes and the same number of
exchanges whatever its own input or tables, and the sharded collection must give what the
unsharded one gives (outputs and gradients) in the collection's dtype."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import shard
from fxrec.sparse import KeyedJaggedTensor
from fxrec.sparse.validation import validation_disabled
from tests.distributed.launch import run_ranks
from tests.distributed.test_sharded_ebc import make_batch as sharded_batch

pytestmark = pytest.mark.distributed


def make_ebc(weighted: bool = False, n_tables: int = 4):
    """Sum and mean tables; built identically on every rank."""
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(4321)
    specs = [(11, 4, ["f0", "f1"], "sum"), (7, 8, ["f2"], "sum"), (19, 2, ["f3"], "mean")]
    specs.append((6, 6, ["f4"], "sum"))
    tables = [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=fs, pooling=p
        )
        for i, (n, d, fs, p) in enumerate(specs[:n_tables])
    ]
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


def make_batch(ebc, rank: int, weighted: bool, seed: int = 0) -> KeyedJaggedTensor:
    """A fresh random local batch (its size depends on the rank: uneven splits)."""
    return sharded_batch(ebc, rank + 10 * seed, 2 + rank, weighted, extra_key=False)


def check_against_unsharded(ebc, sharded, kjt, rank: int, atol: float, ref_kjt=None) -> None:
    """Same output (values and dtype) as ``ebc``; each owner's table gradients equal the
    unsharded ones summed over ranks (row-wise: its rows of them). ``ref_kjt``: the input
    ``ebc`` reads (default ``kjt``), e.g. a copy whose weights have a graph of their own."""
    ref = ebc(kjt if ref_kjt is None else ref_kjt).values()
    got = sharded(kjt).values()
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=atol, atol=atol)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(rank)).to(ref.dtype)
    (ref * grad).sum().backward()
    (got * grad).sum().backward()
    local = sharded.embedding_bags_local
    mine = local.table_grads() if local is not None else {}
    for table, g in ebc.table_grads().items():
        total = g.to(torch.float64)  # gloo sums float64 whatever the collection's dtype
        dist.all_reduce(total)
        for name, block in mine.items():
            if name == table or name.split("#rw")[0] == table:
                assert block.dtype == g.dtype
                lo, hi = sharded.row_range(table) or (0, total.shape[0])
                torch.testing.assert_close(
                    block.to(torch.float64), total[lo:hi], rtol=atol, atol=atol
                )


def _table_less_rank(rank: int, world: int, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    ebc = make_ebc(n_tables=3)
    sharded = shard(copy.deepcopy(ebc)).to(dtype)  # 4 ranks, 3 tables: rank 3 holds none
    assert (sharded.embedding_bags_local is None) == (rank == 3)
    ebc = ebc.to(dtype)
    atol = 5e-2 if dtype == torch.bfloat16 else 1e-12  # bf16: sums in another order
    for step in range(2):
        ebc.zero_grad()
        sharded.zero_grad()
        check_against_unsharded(ebc, sharded, make_batch(ebc, rank, False, step), rank, atol)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_to_dtype_after_sharding_reaches_a_rank_without_tables(dtype: str) -> None:
    run_ranks(4, _table_less_rank, dtype, timeout=20, deadline=150)


def _double_collection(rank: int, world: int, row_wise: tuple[str, ...]) -> None:
    ebc = make_ebc().double()
    sharded = shard(copy.deepcopy(ebc), row_wise=row_wise)
    assert {p.dtype for p in sharded.parameters()} == {torch.float64}
    check_against_unsharded(ebc, sharded, make_batch(ebc, rank, False, 3), rank, 1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_wise", [(), ("t0",)])
def test_shard_keeps_the_collection_dtype(row_wise: tuple[str, ...]) -> None:
    run_ranks(2, _double_collection, row_wise, deadline=90)


def _mixed_id_dtypes(rank: int, world: int, what: str, row_wise: tuple[str, ...]) -> None:
    ebc = make_ebc()
    sharded = shard(copy.deepcopy(ebc), row_wise=row_wise)
    kjt = make_batch(ebc, rank, False, 5)
    if rank == 0:  # rank 1 keeps int64: the wire must not care
        values = kjt.values().int() if what in ("ids", "both") else kjt.values()
        lengths = kjt.lengths().int() if what in ("lengths", "both") else kjt.lengths()
        kjt = KeyedJaggedTensor(kjt.keys(), values, lengths=lengths)
    check_against_unsharded(ebc, sharded, kjt, rank, 1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,row_wise", [("ids", ()), ("lengths", ()), ("both", ("t0",))])
def test_ranks_may_send_int32_and_int64_ids(what: str, row_wise: tuple[str, ...]) -> None:
    run_ranks(2, _mixed_id_dtypes, what, row_wise, deadline=90)


def _weights_on_one_rank(rank: int, world: int) -> None:
    ebc = make_ebc()  # unweighted: input weights are ignored, as the unsharded one does
    sharded = shard(copy.deepcopy(ebc), row_wise=["t2"])
    kjt = make_batch(ebc, rank, rank == 0, 7)
    check_against_unsharded(ebc, sharded, kjt, rank, 1e-6)


@pytest.mark.timeout(120)
def test_unweighted_collection_ignores_weights_given_on_one_rank() -> None:
    run_ranks(2, _weights_on_one_rank, deadline=90)


def _weighted_without_weights(rank: int, world: int) -> None:
    ebc = make_ebc(weighted=True)
    sharded = shard(ebc)
    kjt = make_batch(ebc, rank, False)
    with pytest.raises(ValueError, match=r"weighted .* but the input has no weights"):
        ebc(kjt)
    with pytest.raises(ValueError, match=r"weighted .* but the input has no weights"):
        sharded(kjt)  # before any exchange, as the unsharded collection
    with validation_disabled():  # the KJT no longer checks: the wire's int64 must not truncate
        floats = KeyedJaggedTensor(kjt.keys(), kjt.values() + 0.5, lengths=kjt.lengths())
    with pytest.raises(ValueError, match="integer ids"):
        sharded(floats)


@pytest.mark.timeout(120)
def test_weighted_collection_without_weights_is_a_value_error() -> None:
    run_ranks(2, _weighted_without_weights, deadline=90)


def _mixed_weight_dtypes(rank: int, world: int, row_wise: tuple[str, ...]) -> None:
    ebc = make_ebc(weighted=True)
    sharded = shard(copy.deepcopy(ebc), row_wise=row_wise)
    # bfloat16: the unsharded collection divides a mean bag's weights in bfloat16, the owner
    # in float64 (the wire's dtype)
    exact = {torch.float64: 1e-6, torch.bfloat16: 5e-3}
    for step, (dtype, atol) in enumerate(exact.items()):
        kjt = make_batch(ebc, rank, True, 7 + step)
        if rank == 1:  # rank 0 keeps float32 weights: one wire dtype all the same
            weights = kjt.weights().to(dtype)
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths())
        ebc.zero_grad()
        sharded.zero_grad()
        check_against_unsharded(ebc, sharded, kjt, rank, atol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_wise", [(), ("t2",)])
def test_ranks_may_send_weights_of_different_float_dtypes(row_wise: tuple[str, ...]) -> None:
    run_ranks(2, _mixed_weight_dtypes, row_wise, timeout=10, deadline=90)


def _input_exchanges(rank: int, world: int, weighted: bool) -> None:
    ebc = make_ebc(weighted=weighted)
    sharded = shard(copy.deepcopy(ebc))
    calls: list[int] = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        kjt = make_batch(ebc, rank, weighted, 9)
        ref = ebc(kjt).values()
        got = sharded(kjt).values()
    finally:
        dist.all_to_all_single = real
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the counts, then lengths, ids and weights side by side in one exchange
    assert len(calls) == 2, f"{len(calls)} input exchanges"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighted", [False, True])
def test_ids_lengths_and_weights_travel_in_one_exchange(weighted: bool) -> None:
    run_ranks(2, _input_exchanges, weighted, deadline=90)
