"""Ranks that build their sharded collections with different plans or tables are refused
at construction, on every rank, with the difference named (they would otherwise send ids
to ranks that do not hold those tables)."""

from __future__ import annotations

import pytest
import torch

from fxrec.distributed import ShardingPlan, shard
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from tests.distributed.launch import run_ranks


def _ebc(rows_t1: int = 10) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0"]),
            EmbeddingBagConfig(
                num_embeddings=rows_t1, embedding_dim=4, name="t1", feature_names=["f1"]
            ),
        ]
    )


def _disagree(rank: int, world: int) -> None:
    swapped = ShardingPlan({"t0": rank, "t1": 1 - rank}, world)
    with pytest.raises(ValueError) as info:
        shard(_ebc(), swapped)
    message = str(info.value)
    assert "ranks disagree on the sharding plan or the tables" in message
    assert (
        "table 't0': rank 0 says (10x4, features ['f0'], pooling sum, owner rank 0), "
        "rank 1 says (10x4, features ['f0'], pooling sum, owner rank 1)" in message
    )
    with pytest.raises(ValueError, match=r"table 't1': rank 0 says \(10x4.*rank 1 says \(12x4"):
        shard(_ebc(10 + 2 * rank))  # same plan, different tables
    with pytest.raises(ValueError, match=r"owner rank 1\), rank 1 says \(.*row-wise\)"):
        shard(_ebc(), row_wise=["t1"] if rank else [])
    same = shard(_ebc(), ShardingPlan({"t0": 0, "t1": 1}, world))  # agreeing ranks build
    assert same.plan.owners == {"t0": 0, "t1": 1}


@pytest.mark.distributed
def test_ranks_with_different_plans_are_refused() -> None:
    run_ranks(2, _disagree, timeout=10.0, deadline=60.0)
