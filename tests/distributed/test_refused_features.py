"""A rank whose batch lacks a feature the sharded collection reads, or has a variable batch
per key, refuses it before any exchange and tells its peers: they skip that batch at once
(MissingBatch), as for an id outside its table, instead of waiting for its ids until the
process group's timeout, and every rank trains on."""

from __future__ import annotations

import pytest

from fxrec.sparse import KeyedJaggedTensor
from fxrec.train import Batch, TrainPipelineSparseDist
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _refused(batch: Batch, case: str) -> Batch:
    """``batch`` without its last feature, or with one row fewer in its first feature."""
    kjt = batch.sparse
    keys = kjt.keys()
    if case == "missing_feature":
        return batch.replace(sparse=kjt.permute(list(range(len(keys) - 1))))
    b = kjt.stride()
    lengths, first = kjt.lengths(), int(kjt.lengths()[0])
    weights = kjt.weights_or_none()
    sparse = KeyedJaggedTensor(
        keys,
        kjt.values()[first:],
        None if weights is None else weights[first:],
        lengths=lengths[1:],
        stride_per_key=[b - 1] + [b] * (len(keys) - 1),
    )
    return batch.replace(sparse=sparse)


def _one_rank_refuses(rank: int, world: int, case: str, bad: int, row_wise: tuple) -> None:
    from tests.train.helpers import make_batches
    from tests.train.test_pipelines_distributed import (
        KEYS,
        _assert_trains_like_base,
        _build,
        _drive,
        _events,
    )

    n = 4
    batches = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=60 + rank)
    fed = [(_refused(b, case) if rank == 1 and i == bad else b) for i, b in enumerate(batches)]
    model, opt = _build(row_wise)
    with TrainPipelineSparseDist(model, opt) as pipe:
        losses, errors = _drive(pipe, iter(fed))
    assert _events(errors) == [(bad, "ValueError" if rank == 1 else "MissingBatch")]
    if rank == 1:
        want = "missing features" if case == "missing_feature" else "variable batch per key"
        assert want in str(errors[0].__cause__)
    else:
        assert "rank(s) [1] have no batch" in str(errors[0].__cause__)
    ref_model, ref_opt = _build(row_wise)
    kept = [b for i, b in enumerate(batches) if i != bad]
    _assert_trains_like_base(model, losses, ref_model, ref_opt, ref_model, kept)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "bad", "row_wise"),
    [
        ("missing_feature", 0, ()),
        ("missing_feature", 0, ("t2",)),  # the row-wise feature is the one missing
        ("variable_batch", 0, ()),
        ("missing_feature", 2, ()),
    ],
    ids=["missing", "missing_row_wise", "variable_batch", "missing_sent_early"],
)
def test_peers_skip_a_batch_refused_for_its_features(case: str, bad: int, row_wise: tuple) -> None:
    """Batch 0's ids are exchanged inside the collection's forward (nothing ran before it to
    send them early); batch 2's are sent while batch 1 trains."""
    # a timeout far longer than the run may take: peers waiting for it fail the deadline
    run_ranks(2, _one_rank_refuses, case, bad, row_wise, timeout=60.0, deadline=40.0)
