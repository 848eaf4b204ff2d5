"""A rank that refuses its batch (an id outside its table) has no batch for the exchange:
its peers' PipelineError names both causes, not only a failed data loader."""

from __future__ import annotations

import pytest

from fxrec.sparse import KeyedJaggedTensor
from fxrec.train import Batch, TrainPipelineSparseDist
from tests.distributed.launch import run_ranks


def _refused(rank: int, world: int, optimized: bool, bad: int) -> None:
    import fxrec
    from tests.train.helpers import NUM_EMB, make_batches
    from tests.train.test_pipelines_distributed import KEYS, _build, _drive, _events

    batches = make_batches(KEYS, 4, input_type="kjt", weighted=True, seed=30 + rank)
    if rank == 1:  # batch ``bad`` holds an id outside its table
        kjt = batches[bad].sparse
        values = kjt.values().clone()
        values[0] = NUM_EMB + 5
        sparse = KeyedJaggedTensor(kjt.keys(), values, kjt.weights(), lengths=kjt.lengths())
        batches[bad] = Batch(batches[bad].dense, sparse, batches[bad].labels)
    model, opt = _build()
    run = fxrec.optimize(model, (batches[1].dense, batches[1].sparse)) if optimized else model
    opt = type(opt)(run.parameters(), lr=0.1)
    with TrainPipelineSparseDist(run, opt) as pipe:
        losses, errors = _drive(pipe, iter(batches))
    assert len(losses) == 3
    if rank == 1:
        assert _events(errors) == [(bad, "ValueError")]
        assert "outside table" in str(errors[0].__cause__)
    else:
        assert _events(errors) == [(bad, "MissingBatch")]
        message = str(errors[0].__cause__)
        assert "rank(s) [1] have no batch" in message
        assert (
            "(their data loader failed, or their batch was refused before the exchange, e.g. "
            "for an id outside its table: see those ranks' errors)" in message
        )


@pytest.mark.distributed
@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.parametrize("bad", [0, 2], ids=["exchanged_in_forward", "sent_early"])
def test_peers_hear_a_refused_batch_is_missing(optimized: bool, bad: int) -> None:
    """Batch 0's ids are exchanged inside forward (nothing ran before it to send them early);
    later batches' ids are sent while the previous batch trains."""
    run_ranks(2, _refused, optimized, bad, timeout=15.0, deadline=60.0)
