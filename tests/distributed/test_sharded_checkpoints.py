"""Sharded checkpoints: a row-wise block loads only on the rank that owns its rows, and a
strict load reports missing and unknown tables as the unsharded collection does."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import shard
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from tests.distributed.launch import run_ranks


def _ebc(seed: int) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="user", feature_names=["u"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="item", feature_names=["i"]),
    ]
    return EmbeddingBagCollection(tables=tables)


def _from_rank0(state: dict) -> dict:
    """Rank 0's state_dict as every rank reads it back from rank 0's file."""
    buf = [None]
    if dist.get_rank() == 0:
        out = io.BytesIO()
        torch.save(state, out)
        buf = [out.getvalue()]
    dist.broadcast_object_list(buf, src=0)
    return torch.load(io.BytesIO(buf[0]))


def _rank0_block(rank: int, world: int) -> None:
    trained = shard(_ebc(1), row_wise=["user"])
    saved = _from_rank0(trained.state_dict())
    fresh = shard(_ebc(2), row_wise=["user"])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    if rank == 0:
        fresh.load_state_dict(saved)
        assert torch.equal(
            fresh.state_dict()["embedding_bags.user.weight"],
            trained.state_dict()["embedding_bags.user.weight"],
        )
    else:
        for strict in (True, False):
            with pytest.raises(RuntimeError) as info:
                fresh.load_state_dict(saved, strict=strict)
            message = str(info.value)
            assert (
                "row-wise block for embedding_bags.user.weight: the checkpoint holds rows 0..3 "
                "of table 'user', this rank (1) owns rows 4..7" in message
            )
            assert "load each rank's own state_dict" in message
            assert "Missing key" not in message
            after = fresh.state_dict()
            assert torch.equal(
                after["embedding_bags.user.weight"], before["embedding_bags.user.weight"]
            )
    # a block with no record of its rows (the metadata dropped) is refused on every rank
    bare = {k: v.clone() for k, v in trained.state_dict().items()}
    with pytest.raises(RuntimeError, match="a block of rows with no record of which"):
        fresh.load_state_dict(bare)
    fresh.load_state_dict(trained.state_dict())  # each rank's own state_dict loads
    for k, v in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


@pytest.mark.distributed
def test_row_wise_block_loads_only_on_its_own_rank() -> None:
    run_ranks(2, _rank0_block, timeout=10.0, deadline=60.0)


def _load_reports(rank: int, world: int) -> None:
    full = _ebc(1).state_dict()
    lacking = {k: v for k, v in full.items() if "user" not in k}
    unknown = dict(full, **{"embedding_bags.old.weight": torch.zeros(3, 4)})
    for ckpt in (lacking, unknown):
        plain, sharded = _ebc(2), shard(_ebc(2), row_wise=["user"])
        model = torch.nn.ModuleDict({"sparse": sharded})
        with pytest.raises(RuntimeError) as want:
            torch.nn.ModuleDict({"sparse": plain}).load_state_dict(
                {f"sparse.{k}": v for k, v in ckpt.items()}
            )
        with pytest.raises(RuntimeError) as got:
            model.load_state_dict({f"sparse.{k}": v for k, v in ckpt.items()})
        assert str(got.value).split(":", 1)[1] == str(want.value).split(":", 1)[1]
        result = model.load_state_dict({f"sparse.{k}": v for k, v in ckpt.items()}, strict=False)
        assert result.missing_keys == (
            ["sparse.embedding_bags.user.weight"] if ckpt is lacking else []
        )


@pytest.mark.distributed
def test_strict_load_reports_tables_under_the_unsharded_keys() -> None:
    run_ranks(2, _load_reports, timeout=10.0, deadline=60.0)
