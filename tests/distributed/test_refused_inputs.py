"""What a sharded collection reads of its input, on 2 gloo ranks.

* It reads what the unsharded collection reads, as it reads it: dicts of jagged nested
  tensors or of JaggedTensors, lazily stacked samples, and TensorDicts holding entries no
  table reads (a dense ``label``), with the same outputs and gradients.
* An input it refuses in its conversion (a malformed TensorDict) is announced to the peers,
  as a refusal of its ids is: every rank skips that batch at once, the first batch of a pass
  too, in both pipelines and in a plain loop, and training goes on in step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from fxrec.sparse import KeyedJaggedTensor, kjt_to_tensordict
from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _with_label(kjt: KeyedJaggedTensor) -> TensorDict:
    td = kjt_to_tensordict(kjt)
    td["label"] = torch.zeros(kjt.stride())  # a dense entry no table reads
    return td


def _forms() -> dict[str, Any]:
    from tests.sparse.test_td_forms import dict_of_njts, lazy_stack

    return {
        "dict of jagged nested tensors": dict_of_njts,
        "dict of sub-TensorDicts": lambda kjt: dict_of_njts(kjt, TensorDict),
        "dict of JaggedTensors": lambda kjt: kjt.to_dict(),
        "TensorDict with a label": _with_label,
        "lazily stacked samples": lazy_stack,
    }


def _reads_alike(rank: int, world: int, weighted: bool) -> None:
    from fxrec.distributed import shard
    from tests.distributed.test_sharded_ebc import make_batch, make_ebc

    ebc = make_ebc(weighted, n_tables=3)
    sharded = shard(ebc)
    kjt = make_batch(ebc, rank, 3 + rank, weighted)  # with a key no table reads
    for name, form in _forms().items():
        ebc.zero_grad()
        sharded.zero_grad()
        want = ebc(form(kjt))
        got = sharded(form(kjt))
        torch.testing.assert_close(want.values(), ebc(kjt).values(), msg=name)
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6, msg=name)
        grad = torch.randn(want.values().shape, generator=torch.Generator().manual_seed(rank))
        (want.values() * grad).sum().backward()
        (got.values() * grad).sum().backward()
        local = sharded.embedding_bags_local
        mine = local.table_grads() if local is not None else {}
        for table, g in ebc.table_grads().items():
            g = g.clone()
            dist.all_reduce(g)  # the owner's gradient sums every rank's rows
            if table in mine:
                torch.testing.assert_close(mine[table], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighted", [False, True])
def test_the_sharded_collection_reads_what_the_unsharded_one_reads(weighted: bool) -> None:
    run_ranks(2, _reads_alike, weighted, timeout=20.0, deadline=60.0)


def _malformed(batch: Batch) -> Batch:
    """``batch`` (a TensorDict's) with a dense tensor where feature ``f0``'s ids belong."""
    td = batch.sparse.clone()
    td["f0"] = torch.zeros(batch.dense.shape[0], dtype=torch.long)
    return batch.replace(sparse=td)


def _pipeline_skips_a_malformed_batch(
    rank: int, world: int, pipeline: type, bad: int, optimized: bool
) -> None:
    """Rank 1's batch ``bad`` is a malformed TensorDict: every rank raises a PipelineError
    for it (rank 1 its ValueError, rank 0 a MissingBatch) at once, and the batches every
    rank has train as the base pipeline trains them alone."""
    import fxrec
    from tests.train.helpers import make_batches
    from tests.train.test_pipelines_distributed import (
        KEYS,
        _assert_trains_like_base,
        _build,
        _drive,
        _events,
    )

    n = 4
    batches = make_batches(KEYS, n, input_type="td", weighted=True, seed=70 + rank)
    fed = [(_malformed(b) if rank == 1 and i == bad else b) for i, b in enumerate(batches)]
    example = batches[1]

    def build():  # type: ignore[no-untyped-def]
        model, opt = _build()
        if not optimized:
            return model, model, opt
        run = fxrec.optimize(model, (example.dense, example.sparse))
        return model, run, torch.optim.SGD(run.parameters(), lr=0.1)

    model, run, opt = build()
    with pipeline(run, opt) as pipe:
        losses, errors = _drive(pipe, iter(fed))
        if pipeline is TrainPipelineSparseDist:
            assert len(pipe._input_dist.enabled) == 1
        if pipeline is TrainPipelineSparseDist and bad == 0:
            # a failed first batch is probed again on the next: ids still go early
            assert pipe.stats.sent_early == n - 2
    assert _events(errors) == [(bad, "ValueError" if rank == 1 else "MissingBatch")]
    if rank == 1:
        assert "feature 'f0'" in str(errors[0].__cause__)
    else:
        assert "rank(s) [1] have no batch" in str(errors[0].__cause__)
    ref_model, ref_run, ref_opt = build()
    kept = [b for i, b in enumerate(batches) if i != bad]
    _assert_trains_like_base(model, losses, ref_run, ref_opt, ref_model, kept)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pipeline", "bad", "optimized"),
    [
        (TrainPipelineSparseDist, 0, False),
        (TrainPipelineSparseDist, 0, True),
        (TrainPipelineSparseDist, 2, False),
        (TrainPipelineBase, 0, True),
        (TrainPipelineBase, 2, False),
    ],
    ids=["sparse_first", "sparse_first_optimized", "sparse_sent_early", "base_first", "base"],
)
def test_a_malformed_batch_on_one_rank_is_skipped_on_every_rank(
    pipeline: type, bad: int, optimized: bool
) -> None:
    # a timeout far longer than the run may take: peers waiting for it fail the deadline
    run_ranks(2, _pipeline_skips_a_malformed_batch, pipeline, bad, optimized, timeout=60.0,
              deadline=45.0)  # fmt: skip


def _plain_loop_skips_a_malformed_batch(rank: int, world: int) -> None:
    """A loop calling the sharded collection itself, skipping a batch that raises (rank 1's
    ValueError, rank 0's MissingBatch), stays in step: each output is the unsharded
    collection's, and the tables' gradients sum every rank's kept batches."""
    from fxrec.distributed import MissingBatch, shard
    from tests.distributed.test_sharded_ebc import make_batch, make_ebc

    ebc = make_ebc(True, n_tables=3)
    sharded = shard(ebc)
    kjts = [make_batch(ebc, 10 * step + rank, 3, True, extra_key=False) for step in range(3)]
    skipped = []
    for step, kjt in enumerate(kjts):
        features: Any = kjt_to_tensordict(kjt)
        if rank == 1 and step == 1:
            features["f0"] = torch.zeros(3, dtype=torch.long)
        try:
            got = sharded(features)
        except (ValueError, MissingBatch) as exc:
            skipped.append((step, type(exc).__name__))
            continue
        want = ebc(kjt)
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)
        got.values().sum().backward()
        want.values().sum().backward()
    assert skipped == [(1, "ValueError" if rank == 1 else "MissingBatch")]
    mine = sharded.embedding_bags_local.table_grads()
    for table, g in ebc.table_grads().items():
        g = g.clone()
        dist.all_reduce(g)
        if table in mine:
            torch.testing.assert_close(mine[table], g, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_plain_loop_skipping_a_malformed_batch_stays_in_step() -> None:
    run_ranks(2, _plain_loop_skips_a_malformed_batch, timeout=60.0, deadline=30.0)
