"""A peer that dies mid-training leaves the process group unusable: the survivor's pipeline
raises PipelineError for the batch that failed, then stops. Every later call raises a
CommError that is not a PipelineError, so a loop that skips failed batches ends instead of
calling progress() forever on a group that can exchange nothing."""

from __future__ import annotations

import os

import pytest
import torch

from fxrec.distributed import CommError
from fxrec.train import PipelineError, TrainPipelineSparseDist
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _peer_dies(rank: int, world: int, optimized: bool) -> None:
    import fxrec
    from tests.train.helpers import make_batches
    from tests.train.test_pipelines_distributed import KEYS, _build

    batches = make_batches(KEYS, 8, input_type="kjt", weighted=True, seed=70 + rank)
    model, opt = _build()
    collection = model.ebc
    if optimized:  # the collection runs inside the graph; exchanges start early all the same
        b = batches[0]
        model = fxrec.optimize(model, (b.dense, b.sparse), rules=["default", "overlap_comm"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainPipelineSparseDist(model, opt) as pipe:
        it = iter(batches)
        pipe.progress(it)
        pipe.progress(it)  # batch 2's ids are on their way
        if rank == 1:
            os._exit(3)  # dies without a word
        with pytest.raises(PipelineError, match="likely unusable") as failed:
            pipe.progress(it)
        assert failed.value.batch_index == 2
        assert isinstance(failed.value.__cause__, CommError)
        for _ in range(3):  # not a batch of its own each time: the pipeline stopped
            with pytest.raises(CommError, match="stopped at batch 2") as stopped:
                pipe.progress(it)
            assert not isinstance(stopped.value, PipelineError)
            assert stopped.value.__cause__ is failed.value
        with pytest.raises(CommError, match="stopped at batch 2"):
            pipe.run(batches)
        assert pipe.stats.steps == 2
    # leaving the block drains what was in flight: quietly, and the collection is its own
    assert "forward" not in vars(collection)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimized", [False, True])
def test_pipeline_stops_once_a_peer_died(optimized: bool) -> None:
    # rank 1 exits with status 3; a failure of rank 0 would be reported as "rank 0 failed"
    with pytest.raises(AssertionError, match=r"exited abnormally: \[\(1, 3\)\]"):
        run_ranks(2, _peer_dies, optimized, timeout=5.0, deadline=60.0)
