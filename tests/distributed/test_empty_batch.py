"""A rank whose local batch is empty (the last, short batch of an epoch split unevenly) gets
the unsharded collection's empty ``[0, sum dims]`` output, and the other ranks' outputs and
every table's gradients are unchanged, for every layout of the pooled columns."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import shard
from fxrec.distributed.row_wise import shard_name
from tests.distributed.launch import run_ranks
from tests.distributed.test_sharded_ebc import make_batch

pytestmark = pytest.mark.distributed

# (rows, dim, features, pooling): a table read by two features, mixed dims and poolings and
# a one-row table, so that the owners' columns must be put back in key order.
TABLES = [
    (11, 4, ["f0", "f1"], "sum"),
    (7, 8, ["f2"], "sum"),
    (19, 2, ["f3"], "mean"),
    (1, 6, ["f4"], "max"),
]
LAYOUTS = [(TABLES[:2], ()), (TABLES, ()), (TABLES, ("t0", "t2"))]
BATCHES = [(0, 5), (4, 0), (0, 0)]  # local batch of rank 0, rank 1


def _ebc(tables):
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(2024)  # every rank builds the same collection
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=fs, pooling=p
            )
            for i, (n, d, fs, p) in enumerate(tables)
        ]
    )


def _check_grads(ebc, sharded, rank: int) -> None:
    """Each table's (or row block's) gradient on its holder: every rank's rows summed."""
    local = sharded.embedding_bags_local
    mine = local.table_grads() if local is not None else {}
    for table, g in ebc.table_grads().items():
        want = torch.zeros_like(ebc.embedding_bags[table].weight) if g is None else g.clone()
        dist.all_reduce(want)
        rows = sharded.row_range(table)
        key = table if rows is None else shard_name(table, rank)
        if key not in mine:
            continue  # another rank holds it
        got = mine[key]
        got = torch.zeros_like(local.embedding_bags[key].weight) if got is None else got
        want = want if rows is None else want[rows[0] : rows[1]]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _empty_rank(rank: int, world: int) -> None:
    for tables, row_wise in LAYOUTS:
        for batches in BATCHES:
            ebc = _ebc(tables)
            sharded = shard(ebc, row_wise=row_wise)
            kjt = make_batch(ebc, rank, batches[rank], False)
            ref, got = ebc(kjt), sharded(kjt)
            assert got.keys() == ref.keys() and got.length_per_key() == ref.length_per_key()
            assert (
                got.values().shape
                == ref.values().shape
                == (batches[rank], sum(ref.length_per_key()))
            )
            torch.testing.assert_close(got.values(), ref.values(), rtol=1e-5, atol=1e-6)
            grad = torch.randn(ref.values().shape, generator=torch.Generator().manual_seed(rank))
            (ref.values() * grad).sum().backward()
            (got.values() * grad).sum().backward()
            _check_grads(ebc, sharded, rank)


def test_rank_with_empty_batch_matches_unsharded() -> None:
    run_ranks(2, _empty_rank, deadline=120.0)
