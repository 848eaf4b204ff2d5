"""Both pipelines on 2 gloo ranks with a sharded embedding collection: the same losses and
parameters, and the overlapping pipeline really sends batch i+1's ids early (also to a
collection inside a graph captured by fxrec.optimize)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist
from tests.train.helpers import DENSE, NUM_EMB, make_batches, params

pytestmark = pytest.mark.distributed

KEYS = ["f0", "f1", "f2"]


def _have_collection() -> bool:
    try:
        from fxrec.nn import EmbeddingBagCollection  # noqa: F401
    except ImportError:
        return False
    return True


class ShardedRanker(nn.Module):
    def __init__(self, ebc: nn.Module, reorder: bool = False) -> None:
        super().__init__()
        self.ebc = ebc
        self.reorder = reorder  # the collection gets a new KJT: its ids cannot be sent early
        self.dense_arch = nn.Linear(DENSE, 4)
        self.over = nn.Linear(4 + 4 * len(KEYS), 1)

    def forward(self, dense, sparse):
        if self.reorder:
            sparse = sparse.permute([2, 1, 0])
        return self.over(torch.cat([self.dense_arch(dense), self.ebc(sparse).values()], 1))


def _build(row_wise: tuple[str, ...] = (), reorder: bool = False):
    from fxrec.distributed import shard
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)  # every rank builds the same model
    tables = [
        EmbeddingBagConfig(num_embeddings=NUM_EMB, embedding_dim=4, name=f"t{i}", feature_names=[k])
        for i, k in enumerate(KEYS)
    ]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
    model = ShardedRanker(shard(ebc, row_wise=row_wise), reorder)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _pipelines_agree(
    rank: int, world: int, input_type: str, row_wise: tuple[str, ...], mode: str
) -> None:
    """``mode``: "eager", "optimized" (the collection runs inside fxrec.optimize's graph, its
    forward is never called) or "combined" (that graph takes combined inputs and rebuilds the
    collection's KJT from them)."""
    import fxrec
    from fxrec.distributed import dist_ops
    from fxrec.passes.combine_inputs import combine_inputs

    batches = make_batches(KEYS, 5, input_type=input_type, weighted=True, seed=10 + rank)
    optimized = mode != "eager"
    results = []
    for cls in (TrainPipelineBase, TrainPipelineSparseDist):
        model, opt = _build(row_wise)
        run: nn.Module = model
        host_fn = None
        example = (batches[0].dense, batches[0].sparse)
        if mode == "combined":
            run, packer = combine_inputs(model, example)

            def host_fn(b, packer=packer):  # type: ignore[no-untyped-def]
                return Batch(b.dense, packer(b.dense, b.sparse)[1], b.labels)

            example = (batches[0].dense, host_fn(batches[0]).sparse)
        if optimized:
            run = fxrec.optimize(run, example)
            opt = torch.optim.SGD(run.parameters(), lr=0.1)
        taken: list[object] = []  # exchanges started early that a forward took over
        take = dist_ops._take_early

        def spy_take(kjt, layout, take=take, taken=taken):  # type: ignore[no-untyped-def]
            handle = take(kjt, layout)
            if handle is not None:
                taken.append(handle)
            return handle

        dist_ops._take_early = spy_take
        with cls(run, opt, host_fn=host_fn) as pipe:
            it = iter(batches)
            losses = []
            before_advance: list[bool] = []
            if cls is TrainPipelineSparseDist:  # what is in flight when the backward ends
                advance = pipe._input_dist.advance

                def spy(advance=advance, dist=pipe._input_dist, seen=before_advance):
                    seen.extend(p[1][1].sent is not None for p in dist._pending.values())
                    advance()

                pipe._input_dist.advance = spy
            for step in range(len(batches)):
                losses.append(float(pipe.progress(it)))
                if cls is TrainPipelineSparseDist and 0 < step < len(batches) - 1:
                    assert len(pipe._input_dist.enabled) == 1, "ids were not sent early"
                    # after a step, the next batch's ids are in flight (not only its counts)
                    (pending,) = pipe._input_dist._pending.values()
                    assert pending[1][1].sent is not None
        dist_ops._take_early = take
        if cls is TrainPipelineSparseDist:
            # between forward and backward only the counts were started: nothing blocked
            assert before_advance and not any(before_advance)
            # inside the graph, every batch but the first took over its early exchange
            assert len(taken) == (len(batches) - 1 if optimized else 0)
            assert pipe.stats.sent_early == len(batches) - 1
        results.append((losses, params(model)))
    (l0, p0), (l1, p1) = results
    assert l1 == pytest.approx(l0, rel=1e-6, abs=1e-7)
    assert p0.keys() == p1.keys() and len(p0) > 0
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize(
    "input_type,row_wise,mode",
    [
        ("kjt", (), "eager"),
        ("td", (), "eager"),
        ("kjt", ("t1",), "eager"),
        ("kjt", (), "optimized"),
        ("td", ("t1",), "optimized"),
        ("kjt", ("t1",), "combined"),
        ("td", (), "combined"),
    ],
)
def test_two_ranks_same_losses_and_parameters(input_type, row_wise, mode):
    from tests.distributed.launch import run_ranks

    run_ranks(2, _pipelines_agree, input_type, row_wise, mode, timeout=30.0, deadline=100.0)


class _Loader:
    """``batches``, failing at index ``fail`` and ending after ``end`` batches."""

    def __init__(self, batches: list, fail: int | None, end: int) -> None:
        self.batches, self.fail, self.end, self.i = batches, fail, end, 0

    def __iter__(self) -> _Loader:
        return self

    def __next__(self):  # type: ignore[no-untyped-def]
        i = self.i
        self.i += 1
        if i >= self.end:
            raise StopIteration
        if i == self.fail:
            raise OSError(f"could not read batch {i}")
        return self.batches[i]


def _drive(pipe, it, steps: int | None = None):  # type: ignore[no-untyped-def]
    """Call ``pipe.progress(it)`` until the data ends (or ``steps`` calls): the losses, and
    the PipelineErrors raised on the way."""
    from fxrec.train import PipelineError

    losses: list[float] = []
    errors: list[PipelineError] = []
    calls = 0
    while steps is None or calls < steps:
        calls += 1
        try:
            losses.append(float(pipe.progress(it)))
        except StopIteration:
            break
        except PipelineError as exc:
            errors.append(exc)
    return losses, errors


def _events(errors) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
    return [(e.batch_index, type(e.__cause__).__name__) for e in errors]


def _assert_trains_like_base(model, losses, run, opt, ref_model, kept) -> None:  # type: ignore[no-untyped-def]
    """``losses`` and ``model``'s parameters are the base pipeline's on ``kept`` alone
    (``run``, ``opt``, ``ref_model``: a fresh copy of what was trained)."""
    with TrainPipelineBase(run, opt) as base:
        want = [float(base.progress(iter([b]))) for b in kept]
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    got, ref = params(model), params(ref_model)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def _one_rank_loses_a_batch(
    rank: int, world: int, fail: int, optimized: bool, reorder: bool, pipeline: type
) -> None:
    """Rank 1's loader fails at batch ``fail`` and ends one batch early. Every rank skips
    that batch and rank 0 its last: it hears of them in the id-count exchange, or in the roll
    call for batches no exchange announced (the first one; every one when the model gives
    its collection a KJT of its own, whose ids the pipeline cannot send early; every one in
    the base pipeline). The losses and parameters are those of the base pipeline fed only
    the batches every rank trained on."""
    import fxrec
    from fxrec.distributed import CommError

    n = 6
    batches = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=20 + rank)

    def build():  # type: ignore[no-untyped-def]
        model, opt = _build(reorder=reorder)
        if not optimized:
            return model, model, opt
        run = fxrec.optimize(model, (batches[0].dense, batches[0].sparse))
        return model, run, torch.optim.SGD(run.parameters(), lr=0.1)

    model, run, opt = build()
    with pipeline(run, opt) as pipe:
        it = _Loader(batches, fail if rank == 1 else None, n - 1 if rank == 1 else n)
        losses, errors = _drive(pipe, it)
        if pipeline is TrainPipelineSparseDist:  # ids sent early or not
            assert len(pipe._input_dist.enabled) == (0 if reorder else 1)
    if rank == 0:
        for exc in errors:
            assert isinstance(exc.__cause__, CommError)
            assert "rank(s) [1] have no batch" in str(exc.__cause__)
    expected = [(fail, "OSError")] if rank == 1 else [(fail, "MissingBatch"), (5, "MissingBatch")]
    assert _events(errors) == expected
    ref_model, ref_run, ref_opt = build()
    kept = [batches[i] for i in range(n - 1) if i != fail]
    _assert_trains_like_base(model, losses, ref_run, ref_opt, ref_model, kept)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize(
    ("fail", "optimized", "reorder", "pipeline"),
    [
        (2, False, False, TrainPipelineSparseDist),
        (0, False, False, TrainPipelineSparseDist),
        (2, True, False, TrainPipelineSparseDist),
        (0, True, False, TrainPipelineSparseDist),
        (2, True, True, TrainPipelineSparseDist),
        (2, False, False, TrainPipelineBase),
        (0, True, False, TrainPipelineBase),
    ],
)
def test_a_batch_missing_on_one_rank_is_skipped_on_every_rank(
    fail: int, optimized: bool, reorder: bool, pipeline: type
):
    from tests.distributed.launch import run_ranks

    # a timeout far longer than the run may take: peers waiting for it fail the deadline
    run_ranks(
        2, _one_rank_loses_a_batch, fail, optimized, reorder, pipeline, timeout=60.0, deadline=50.0
    )


def _base_pipeline_passes_stay_in_step(rank: int, world: int) -> None:
    """The base pipeline over a sharded model: rank 1's data ends two batches early, which
    ends rank 0's pass too (a PipelineError for the first batch it alone has, then
    StopIteration without reading the next); the next pass, on new iterators, trains every
    batch on both ranks."""
    n = 4
    first = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=80 + rank)
    second = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=90 + rank)
    model, opt = _build()
    with TrainPipelineBase(model, opt) as pipe:
        it = _Loader(first, None, n - 2 if rank == 1 else n)
        losses, errors = _drive(pipe, it)
        assert _events(errors) == ([] if rank == 1 else [(n - 2, "MissingBatch")])
        assert it.i == n - 1  # rank 0 read no batch past the one rank 1 lacked
        more, errors = _drive(pipe, iter(second))
        assert not errors and len(more) == n
    ref_model, ref_opt = _build()
    with TrainPipelineBase(ref_model, ref_opt) as base:
        want = [float(base.progress(iter([b]))) for b in first[: n - 2] + second]
    assert losses + more == pytest.approx(want, rel=1e-5, abs=1e-6)
    got, ref = params(model), params(ref_model)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
def test_one_rank_ending_its_data_ends_every_ranks_pass_in_the_base_pipeline():
    from tests.distributed.launch import run_ranks

    run_ranks(2, _base_pipeline_passes_stay_in_step, timeout=60.0, deadline=50.0)


def _saves_while_training(rank: int, world: int) -> None:
    """The model pickles while the pipeline runs (its collection's installed forward stays
    behind), and the copy computes what the model does."""
    import io

    batches = make_batches(KEYS, 3, input_type="kjt", weighted=True, seed=30 + rank)
    model, opt = _build()
    with TrainPipelineSparseDist(model, opt) as pipe:
        it = iter(batches)
        pipe.progress(it)
        pipe.progress(it)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copy = torch.load(buf, weights_only=False)
        assert "forward" not in copy.ebc.__dict__
        b = batches[2]
        with torch.no_grad():
            torch.testing.assert_close(copy(b.dense, b.sparse), model(b.dense, b.sparse))
        pipe.progress(it)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
def test_model_saved_while_the_pipeline_runs():
    from tests.distributed.launch import run_ranks

    run_ranks(2, _saves_while_training, timeout=10.0, deadline=100.0)


def _with_bad_id(batch: Batch) -> Batch:
    """``batch`` with one id past its table (the last id of the batch)."""
    from fxrec.sparse import KeyedJaggedTensor

    kjt = batch.sparse
    values = kjt.values().clone()
    values[-1] = NUM_EMB + 5
    bad = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), values, kjt.lengths(), weights=kjt.weights_or_none()
    )
    return Batch(batch.dense, bad, batch.labels)


def _one_rank_sends_a_bad_id(rank: int, world: int, row_wise: tuple[str, ...]) -> None:
    """Rank 1's batch 2 holds an id past its table. The sender refuses it before any
    exchange, so every rank skips that batch at once (the owner would refuse it only after
    the exchange, with its peers waiting for pooled rows until the timeout) and trains on."""
    n = 5
    batches = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=40 + rank)
    fed = [(_with_bad_id(b) if rank == 1 and i == 2 else b) for i, b in enumerate(batches)]
    model, opt = _build(row_wise)
    with TrainPipelineSparseDist(model, opt) as pipe:
        losses, errors = _drive(pipe, iter(fed))
    if rank == 1:
        assert all("outside table" in str(e.__cause__) for e in errors)
    assert _events(errors) == [(2, "ValueError" if rank == 1 else "MissingBatch")]
    ref_model, ref_opt = _build(row_wise)
    kept = [b for i, b in enumerate(batches) if i != 2]
    _assert_trains_like_base(model, losses, ref_model, ref_opt, ref_model, kept)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize("row_wise", [(), ("t2",)])
def test_a_bad_id_on_one_rank_is_skipped_on_every_rank(row_wise: tuple[str, ...]):
    from tests.distributed.launch import run_ranks

    # a timeout far longer than the test allows for the skip: a stall would fail it
    run_ranks(2, _one_rank_sends_a_bad_id, row_wise, timeout=60.0, deadline=40.0)


def _one_rank_fails_in_forward(rank: int, world: int) -> None:
    """Rank 1's forward fails on batch 2 (a dense batch of the wrong width) after the ids were
    exchanged: rank 0 waits for pooled rows until the group's timeout. A failed collective is
    a PipelineError too (no bare CommError from the roll call), saying that the group is
    likely unusable; then the pipeline stops: later calls raise a CommError saying so."""
    from fxrec.distributed import CommError

    batches = make_batches(KEYS, 5, input_type="kjt", weighted=True, seed=50 + rank)
    if rank == 1:
        batches[2] = batches[2].replace(dense=batches[2].dense[:, :2])
    model, opt = _build()
    errors: list = []
    with TrainPipelineSparseDist(model, opt) as pipe:
        it = iter(batches)
        with pytest.raises(CommError, match="pipeline stopped at batch") as stopped:
            for _ in range(5):
                errors += _drive(pipe, it, steps=1)[1]
    assert errors, "the failure reached no rank"
    assert stopped.value.__cause__ is errors[-1]
    if rank == 0:
        assert isinstance(errors[0].__cause__, CommError)
    comm = [e for e in errors if isinstance(e.__cause__, CommError)]
    assert all("likely unusable" in str(e) for e in comm)
    assert all("call progress() again" in str(e) for e in errors if e not in comm)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
def test_a_forward_failing_on_one_rank_raises_pipeline_errors_on_every_rank():
    from tests.distributed.launch import run_ranks

    run_ranks(2, _one_rank_fails_in_forward, timeout=3.0, deadline=90.0)


def _run_between_progress_calls(rank: int, world: int, mode: str) -> None:
    """progress() twice, a run() of other batches, progress() to the end: the ids sent early
    for the loop's next batch are dropped when the run starts, and sent again (after a roll
    call) when the loop resumes; losses and parameters are the base pipeline's."""
    import fxrec

    batches = make_batches(KEYS, 5, input_type="kjt", weighted=True, seed=40 + rank)
    other = make_batches(KEYS, 2, input_type="kjt", weighted=True, seed=50 + rank)
    results = []
    for cls in (TrainPipelineBase, TrainPipelineSparseDist):
        model, opt = _build(("t1",))
        run: nn.Module = model
        if mode == "optimized":
            run = fxrec.optimize(model, (batches[0].dense, batches[0].sparse))
            opt = torch.optim.SGD(run.parameters(), lr=0.1)
        with cls(run, opt) as pipe:
            it = iter(batches)
            losses = [float(pipe.progress(it)), float(pipe.progress(it))]
            losses += pipe.run(other)
            more, errors = _drive(pipe, it)
            assert not errors and pipe.stats.steps == 7
        results.append((losses + more, params(model)))
    (l0, p0), (l1, p1) = results
    assert l1 == pytest.approx(l0, rel=1e-6, abs=1e-7)
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize("mode", ["eager", "optimized"])
def test_a_run_between_progress_calls_trains_like_the_base_pipeline(mode: str):
    from tests.distributed.launch import run_ranks

    run_ranks(2, _run_between_progress_calls, mode, timeout=30.0, deadline=100.0)


def _fail_where_a_peer_ends(rank: int, world: int, pipeline: type) -> None:
    """Rank 0's loader fails at batch 3, where rank 1's data ends: rank 0 raises its own
    error for batch 3, then StopIteration (the peer's end is its end too), and both ranks
    start the next pass together. Losses and parameters are the base pipeline's on the
    batches both ranks trained."""
    n, end = 6, 3
    first = make_batches(KEYS, n, input_type="kjt", weighted=True, seed=100 + rank)
    second = make_batches(KEYS, end, input_type="kjt", weighted=True, seed=110 + rank)
    model, opt = _build()
    with pipeline(model, opt) as pipe:
        it = _Loader(first, end if rank == 0 else None, n if rank == 0 else end)
        losses, errors = _drive(pipe, it, steps=n + 1)
        assert _events(errors) == ([(end, "OSError")] if rank == 0 else [])
        assert len(losses) == end
        if pipeline is TrainPipelineBase:
            assert it.i == end + 1  # rank 0 read no batch past the one it failed on
        more, errors = _drive(pipe, iter(second), steps=end + 1)
        assert not errors and len(more) == end
    ref_model, ref_opt = _build()
    kept = first[:end] + second
    _assert_trains_like_base(model, losses + more, ref_model, ref_opt, ref_model, kept)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize("pipeline", [TrainPipelineBase, TrainPipelineSparseDist])
def test_a_batch_failing_where_a_peers_data_ends_ends_the_pass(pipeline: type):
    from tests.distributed.launch import run_ranks

    run_ranks(2, _fail_where_a_peer_ends, pipeline, timeout=10.0, deadline=40.0)


def _run_over_uneven_data(rank: int, world: int, pipeline: type) -> None:
    """Rank 0 has 5 batches, rank 1 has 4: run() returns the 4 losses on both ranks (rank 1's
    end of data ends the pass, it is no error), a second run() on the same iterators starts
    a new pass on both (which ends at once), and a run() of other batches trains them all.
    Losses and parameters are the base pipeline's on the batches both ranks trained."""
    batches = make_batches(KEYS, 5 - rank, input_type="kjt", weighted=True, seed=120 + rank)
    other = make_batches(KEYS, 2, input_type="kjt", weighted=True, seed=130 + rank)
    model, opt = _build()
    with pipeline(model, opt) as pipe:
        it = iter(batches)
        losses = pipe.run(it)
        assert len(losses) == 4
        assert pipe.run(it) == []
        more = pipe.run(other)
        assert len(more) == 2
    ref_model, ref_opt = _build()
    kept = batches[:4] + other
    _assert_trains_like_base(model, losses + more, ref_model, ref_opt, ref_model, kept)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _have_collection(), reason="needs fxrec.nn.EmbeddingBagCollection")
@pytest.mark.parametrize("pipeline", [TrainPipelineBase, TrainPipelineSparseDist])
def test_run_returns_on_every_rank_when_a_peers_data_ends_first(pipeline: type):
    from tests.distributed.launch import run_ranks

    run_ranks(2, _run_over_uneven_data, pipeline, timeout=10.0, deadline=40.0)
