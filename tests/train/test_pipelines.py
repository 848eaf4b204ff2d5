"""TrainPipelineBase and TrainPipelineSparseDist: same arithmetic, errors with batch index,
bounded queues, clean shutdown. Everything here runs on one process (CPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fxrec
from fxrec.train import Batch, PipelineError, TrainPipelineBase, TrainPipelineSparseDist
from tests.train.helpers import NUM_EMB, fresh, make_batches, params

KEYS = ["f0", "f1", "f2"]
PIPELINES = [TrainPipelineBase, TrainPipelineSparseDist]


def reference(batches, **model_kw):
    """Losses and parameters of a hand-written loop: the semantics both pipelines keep."""
    model, opt = fresh(KEYS, **model_kw)
    losses = []
    for b in batches:
        opt.zero_grad()
        out = model(b.dense, b.sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out.view(-1), b.labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, params(model)


def assert_same(got_losses, got_params, ref_losses, ref_params):
    assert got_losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    assert got_params.keys() == ref_params.keys()
    for k in ref_params:
        torch.testing.assert_close(got_params[k], ref_params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
@pytest.mark.parametrize(
    "input_type,weighted,vbe",
    [("kjt", False, False), ("kjt", True, True), ("td", False, False), ("td", True, True)],
)
def test_pipelines_match_a_plain_loop(pipeline_cls, input_type, weighted, vbe):
    batches = make_batches(KEYS, 7, input_type=input_type, weighted=weighted, vbe=vbe, seed=3)
    ref_losses, ref_params = reference(batches, weighted=weighted, vbe=vbe)
    model, opt = fresh(KEYS, weighted=weighted, vbe=vbe)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = pipe.run(batches)
        assert pipe.stats.steps == 7 and pipe.stats.failed == 0
        assert pipe.stats.copies > 0
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
@pytest.mark.parametrize("input_type", ["kjt", "td"])
def test_pipelines_train_an_fxrec_optimized_model(pipeline_cls, input_type):
    batches = make_batches(KEYS, 5, input_type=input_type, weighted=True, seed=5)
    ref_losses, ref_params = reference(batches, weighted=True)
    model, _ = fresh(KEYS, weighted=True)
    opt_model = fxrec.optimize(model, (batches[0].dense, batches[0].sparse))
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.1)
    with pipeline_cls(opt_model, opt) as pipe:
        losses = pipe.run(batches)
    assert_same(losses, params(model), ref_losses, ref_params)


class FlakyLoader:
    """An iterator whose ``fail_at``-th item raises (and the iterator goes on after it)."""

    def __init__(self, batches, fail_at):
        self.batches, self.fail_at, self.i = batches, set(fail_at), 0

    def __iter__(self):
        return self

    def __next__(self):
        i = self.i
        self.i += 1
        if i >= len(self.batches):
            raise StopIteration
        if i in self.fail_at:
            raise OSError(f"disk read failed at {i}")
        return self.batches[i]


def drive(pipe, it):
    """Train to the end; return (losses, [(index, cause type)] of failures)."""
    losses, errors = [], []
    while True:
        try:
            losses.append(float(pipe.progress(it)))
        except StopIteration:
            return losses, errors
        except PipelineError as e:
            errors.append((e.batch_index, type(e.__cause__)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_failing_loader_raises_with_index_and_continues(pipeline_cls):
    batches = make_batches(KEYS, 6, seed=7)
    keep = [b for i, b in enumerate(batches) if i not in (1, 4)]
    ref_losses, ref_params = reference(keep)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt) as pipe:
        losses, errors = drive(pipe, FlakyLoader(batches, fail_at=[1, 4]))
    assert errors == [(1, OSError), (4, OSError)]
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_bad_batches_raise_with_index_and_are_skipped(pipeline_cls):
    batches = make_batches(KEYS, 6, seed=9)
    bad = list(batches)
    kjt = bad[2].sparse  # an id outside the tables: the forward fails
    bad_values = kjt.values().clone()
    bad_values[0] = NUM_EMB + 5
    bad[2] = bad[2].replace(
        sparse=fxrec.KeyedJaggedTensor(kjt.keys(), bad_values, lengths=kjt.lengths())
    )
    bad[4] = "not a batch"  # the host step fails
    keep = [b for i, b in enumerate(batches) if i not in (2, 4)]
    ref_losses, ref_params = reference(keep)
    model, opt = fresh(KEYS)

    def host_fn(item):
        if not isinstance(item, Batch):
            raise ValueError(f"expected a Batch, got {type(item).__name__}")
        return item

    with pipeline_cls(model, opt, host_fn=host_fn) as pipe:
        losses, errors = drive(pipe, iter(bad))
    assert [i for i, _ in errors] == [2, 4]
    assert errors[1][1] is ValueError
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(30)
def test_queue_is_bounded_and_close_stops_the_reader():
    drawn = []

    def endless():
        i = 0
        while True:
            drawn.append(i)
            yield make_batches(KEYS, 1, seed=i)[0]
            i += 1

    model, opt = fresh(KEYS)
    pipe = TrainPipelineSparseDist(model, opt, prefetch=2, poll_s=0.01)
    it = endless()
    pipe.progress(it)
    time.sleep(0.3)
    # 1 trained + 1 taken early for the next step + 2 queued + 1 held by the blocked reader
    assert len(drawn) <= 5
    pipe.close()
    assert not pipe._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.progress(it)


@pytest.mark.timeout(30)
def test_close_returns_while_the_loader_is_stuck():
    gate = threading.Event()
    batches = make_batches(KEYS, 2, seed=1)

    def stuck():
        yield batches[0]
        gate.wait(20)  # a loader that never answers
        yield batches[1]

    model, opt = fresh(KEYS)
    pipe = TrainPipelineSparseDist(model, opt, poll_s=0.01)
    it = stuck()
    t0 = time.perf_counter()
    # progress on batch 0 waits for batch 1 between its forward and backward; unblock it
    # from another thread after a moment to prove progress waits rather than failing
    threading.Timer(0.2, gate.set).start()
    pipe.progress(it)
    pipe.progress(it)
    with pytest.raises(StopIteration):
        pipe.progress(it)
    pipe.close()
    assert time.perf_counter() - t0 < 10

    gate2 = threading.Event()

    def stuck_forever():
        yield batches[0]
        gate2.wait(60)
        yield batches[1]

    pipe = TrainPipelineSparseDist(model, opt, poll_s=0.01)
    it = stuck_forever()
    threading.Timer(0.2, pipe.close).start()  # close from elsewhere while the step waits
    t0 = time.perf_counter()
    with pytest.raises((StopIteration, RuntimeError)):
        pipe.progress(it)
        pipe.progress(it)
    assert time.perf_counter() - t0 < 10
    gate2.set()


def test_sparse_dist_refuses_a_different_iterator():
    batches = make_batches(KEYS, 3)
    model, opt = fresh(KEYS)
    with TrainPipelineSparseDist(model, opt) as pipe:
        pipe.progress(iter(batches))
        with pytest.raises(ValueError, match="iterator"):
            pipe.progress(iter(batches))


@pytest.mark.parametrize("pipeline_cls", [TrainPipelineBase, TrainPipelineSparseDist])
def test_run_over_several_epochs(pipeline_cls):
    """``run`` takes a new iterator each call: one per epoch, once the last one ended."""
    batches = make_batches(KEYS, 3)
    ref_losses, ref_params = reference(batches + batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt) as pipe:
        losses = pipe.run(batches) + pipe.run(batches)
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.parametrize("pipeline_cls", [TrainPipelineBase, TrainPipelineSparseDist])
def test_loss_fn_may_return_extras(pipeline_cls):
    from fxrec.train.pipeline import bce_loss

    batches = make_batches(KEYS, 3)
    ref_losses, ref_params = reference(batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, loss_fn=lambda out, b: (bce_loss(out, b), {"n": 1})) as pipe:
        losses = pipe.run(batches)
    assert_same(losses, params(model), ref_losses, ref_params)


def test_prefetch_must_be_positive():
    model, opt = fresh(KEYS)
    with pytest.raises(ValueError, match="prefetch"):
        TrainPipelineSparseDist(model, opt, prefetch=0)


@pytest.mark.parametrize("host_threads,want", [(None, 1), (3, 3)])
def test_background_thread_sets_its_own_op_threads_only(host_threads, want):
    # On the CPU the reading thread's ops run on one thread by default (a second OpenMP team
    # would fight the step's for the same cores); the training thread keeps its count.
    seen = []

    def host_fn(batch):
        seen.append(torch.get_num_threads())
        return batch

    main_threads = torch.get_num_threads()
    model, opt = fresh(KEYS)
    with TrainPipelineSparseDist(model, opt, host_fn=host_fn, host_threads=host_threads) as pipe:
        pipe.run(make_batches(KEYS, 3, seed=2))
    assert seen and set(seen) == {want}
    assert torch.get_num_threads() == main_threads
    later: list[int] = []  # a thread started after the pipeline: the process's count again
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [main_threads]


class _Interrupted:
    """Yields ``n`` batches, raises KeyboardInterrupt once (a BaseException, not an
    Exception), then yields the rest."""

    def __init__(self, batches: list, n: int) -> None:
        self.it, self.n = iter(batches), n

    def __iter__(self) -> _Interrupted:
        return self

    def __next__(self):  # type: ignore[no-untyped-def]
        if self.n == 0:
            self.n = -1
            raise KeyboardInterrupt("ctrl-c in the loader")
        self.n -= 1
        return next(self.it)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_an_interrupt_in_the_loader_is_raised_as_it_is(pipeline_cls):
    """Raised as it is; caught, the next calls read on (the overlapping pipeline's reader
    stopped at it: it used to report the end of the data instead)."""
    batches = make_batches(KEYS, 4)
    ref_losses, ref_params = reference(batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt) as pipe:
        it = _Interrupted(batches, 2)
        losses = [float(pipe.progress(it)), float(pipe.progress(it))]
        with pytest.raises(KeyboardInterrupt, match="ctrl-c"):
            pipe.progress(it)
        losses += [float(pipe.progress(it)), float(pipe.progress(it))]
        with pytest.raises(StopIteration):
            pipe.progress(it)
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(30)
def test_a_pipeline_dropped_without_close_is_collected_and_its_reader_stops():
    import gc
    import weakref

    def endless():
        while True:
            yield from make_batches(KEYS, 2)

    model, opt = fresh(KEYS)
    pipe = TrainPipelineSparseDist(model, opt, poll_s=0.01)
    pipe.progress(endless())
    thread, ref = pipe._thread, weakref.ref(pipe)
    del pipe
    gc.collect()
    assert ref() is None
    thread.join(timeout=5.0)
    assert not thread.is_alive()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_batch_indices_count_every_batch_drawn_across_epochs(pipeline_cls):
    batches = make_batches(KEYS, 3)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt) as pipe:
        first, errors = drive(pipe, iter(batches))
        assert len(first) == 3 and not errors
        losses, errors = drive(pipe, FlakyLoader(batches, fail_at=[1]))
    assert len(losses) == 2
    assert errors == [(4, OSError)]  # epoch 2's second batch is the fifth drawn


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_run_with_max_steps_starts_its_batches_over_each_call(pipeline_cls):
    batches = make_batches(KEYS, 4)
    ref_losses, ref_params = reference(batches[:2] + batches[:2])
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt) as pipe:
        losses = pipe.run(batches, max_steps=2) + pipe.run(batches, max_steps=2)
    assert_same(losses, params(model), ref_losses, ref_params)


def test_host_threads_must_be_positive():
    model, opt = fresh(KEYS)
    with pytest.raises(ValueError, match="host_threads"):
        TrainPipelineSparseDist(model, opt, host_threads=0)


def _first(items):  # type: ignore[no-untyped-def]
    return items[0]


def _persistent_loader(batches):  # type: ignore[no-untyped-def]
    """A DataLoader whose iter() returns the same iterator object each epoch, reset."""
    from torch.utils.data import DataLoader

    return DataLoader(
        batches, batch_size=1, collate_fn=_first, num_workers=1, persistent_workers=True
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_persistent_workers_train_every_epoch(pipeline_cls):
    """Each epoch's ``iter(loader)`` is the last epoch's iterator, reset: a pass that ended
    starts over on it (it used to end at once from the second epoch on)."""
    batches = make_batches(KEYS, 4, seed=11)
    loader = _persistent_loader(batches)
    assert iter(loader) is iter(loader)
    ref_losses, ref_params = reference(batches * 4)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = []
        for _ in range(3):  # TorchRec's epoch loop
            epoch, errors = drive(pipe, iter(loader))
            assert len(epoch) == len(batches) and not errors
            losses += epoch
        losses += pipe.run(loader)
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_run_starts_a_persistent_workers_loader_over(pipeline_cls):
    """``run`` stops reading ahead before its ``iter()`` resets the iterator being read."""
    batches = make_batches(KEYS, 4, seed=12)
    loader = _persistent_loader(batches)
    ref_losses, ref_params = reference(batches[:2] + batches[:2] + batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = pipe.run(loader, max_steps=2) + pipe.run(loader, max_steps=2)
        losses += pipe.run(loader)
    assert_same(losses, params(model), ref_losses, ref_params)


def _epochs(pipe, loader, steps):  # type: ignore[no-untyped-def]
    """An epoch loop that stops each epoch after ``steps[e]`` batches (or at its end)."""
    losses = []
    for n in steps:
        it = iter(loader)
        for _ in range(n):
            try:
                losses.append(float(pipe.progress(it)))
            except StopIteration:
                break
    return losses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_persistent_workers_epoch_stopped_early_starts_over(pipeline_cls):
    """The next epoch's ``iter()`` resets the iterator the pass stopped on: the batches read
    ahead of it are the old pass's (they used to be trained as the new epoch, or the reset
    raced the reader's next() and raised KeyError)."""
    batches = make_batches(KEYS, 4, seed=13)
    ref_losses, ref_params = reference(batches[:2] + batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = _epochs(pipe, _persistent_loader(batches), steps=(2, 100))
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_end_pass_lets_a_loop_stopped_early_take_a_new_iterator(pipeline_cls):
    batches = make_batches(KEYS, 4, seed=14)
    ref_losses, ref_params = reference(batches[:2] + batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        it = iter(batches)
        losses = [float(pipe.progress(it)), float(pipe.progress(it))]
        pipe.end_pass()
        losses += drive(pipe, iter(batches))[0]
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
@pytest.mark.parametrize("persistent", [False, True])
def test_run_with_max_steps_then_progress_starts_a_new_pass(pipeline_cls, persistent):
    """``run`` over an iterable ends its pass when it returns: the iterator it drew is its
    own (its batches read ahead used to be trained as the next pass, or progress() refused
    the next iterator)."""
    batches = make_batches(KEYS, 4, seed=15)
    loader = _persistent_loader(batches) if persistent else batches
    ref_losses, ref_params = reference(batches[:2] + batches)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = pipe.run(loader, max_steps=2)
        losses += drive(pipe, iter(loader))[0]
    assert_same(losses, params(model), ref_losses, ref_params)


# -- a run() between progress() calls ------------------------------------------------------------
# A short pass (``run(list)``, ``run(iterator)``) in the middle of a progress() loop: the
# overlapping pipeline has read batches ahead of the loop's iterator, and must train them when
# the loop goes on, as the base pipeline does (they used to be dropped silently).


def _interrupted_loop(pipe, it, other, steps_before=3):  # type: ignore[no-untyped-def]
    """``steps_before`` progress() calls, ``run(other)``, then progress() to the end."""
    losses = [float(pipe.progress(it)) for _ in range(steps_before)]
    losses += pipe.run(other)
    return losses + drive(pipe, it)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
@pytest.mark.parametrize("other_as", ["list", "iterator"])
def test_run_between_progress_calls_resumes_the_loop_where_it_stopped(pipeline_cls, other_as):
    batches = make_batches(KEYS, 7, seed=21)
    other = make_batches(KEYS, 2, seed=22)
    trained = batches[:3] + other + batches[3:]
    ref_losses, ref_params = reference(trained)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        runs = other if other_as == "list" else iter(other)
        losses = _interrupted_loop(pipe, iter(batches), runs)
        assert pipe.stats.steps == len(trained)
        assert pipe.stats.copies == sum(b.transfer_count() for b in trained)
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_two_iterators_stopped_early_each_go_on_where_they_stopped(pipeline_cls):
    """``run(x, max_steps)`` leaves ``x`` under way; the loop's iterator and ``x`` then take
    turns, each resuming its own batches."""
    batches = make_batches(KEYS, 5, seed=23)
    other = make_batches(KEYS, 3, seed=24)
    trained = batches[:2] + other[:1] + batches[2:3] + other[1:] + batches[3:]
    ref_losses, ref_params = reference(trained)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        it, x = iter(batches), iter(other)
        losses = [float(pipe.progress(it)), float(pipe.progress(it))]
        losses += pipe.run(x, max_steps=1)
        losses.append(float(pipe.progress(it)))
        losses += pipe.run(x)
        losses += drive(pipe, it)[0]
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_batch_indices_count_the_batches_of_a_run_between_progress_calls(pipeline_cls):
    batches = make_batches(KEYS, 6, seed=25)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        it = FlakyLoader(batches, fail_at=[3])
        losses = [float(pipe.progress(it)) for _ in range(3)]  # batches 0, 1, 2
        losses += pipe.run(batches[:2])  # batches 3, 4
        more, errors = drive(pipe, it)
    assert len(losses) + len(more) == 3 + 2 + 2
    assert errors == [(5, OSError)]  # the loop's fourth batch is the sixth drawn


@pytest.mark.timeout(60)
def test_end_pass_ends_the_current_pass_only_and_close_ends_those_set_aside():
    batches = make_batches(KEYS, 8, seed=26)
    model, opt = fresh(KEYS)
    with TrainPipelineSparseDist(model, opt, "cpu", poll_s=0.01) as pipe:
        it, x = iter(batches), iter(batches)
        pipe.progress(it)
        reader = pipe._thread
        pipe.run(batches[:1])
        assert reader.is_alive()  # kept, with the batches it read ahead, for `it`
        pipe.progress(x)
        current = pipe._thread
        pipe.end_pass()  # x's pass, not the one set aside
        current.join(timeout=5.0)
        assert not current.is_alive() and reader.is_alive()
        pipe.run(batches[:1])  # `it` is still set aside
        pipe.end_pass(it)
        reader.join(timeout=5.0)
        assert not reader.is_alive()
        pipe.progress(it)  # goes on after the batches its ended pass read ahead
        reader = pipe._thread
        pipe.run(batches[:1])
    reader.join(timeout=5.0)
    assert not reader.is_alive()


def test_end_pass_after_a_run_ends_the_pass_that_run_set_aside():
    """A loop over ``it`` that ran ``run(...)`` last, then stops early and calls
    ``end_pass()`` as an epoch's end: no pass is current, so the one the run set aside ends
    (its reader stopped, not kept for an iterator that never comes back)."""
    batches = make_batches(KEYS, 8, seed=30)
    model, opt = fresh(KEYS)
    with TrainPipelineSparseDist(model, opt, "cpu", poll_s=0.01) as pipe:
        readers = []
        for _ in range(3):  # epochs
            it = iter(batches)
            pipe.progress(it)
            readers.append(pipe._thread)
            pipe.run(batches[:1])
            pipe.end_pass()
        for reader in readers:
            reader.join(timeout=5.0)
            assert not reader.is_alive()
        assert not pipe._parked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_a_second_pass_set_aside_keeps_the_first(pipeline_cls):
    """``run(x, max_steps)`` sets the loop's pass aside, then a ``run()`` sets ``x``'s aside:
    both resume with the batches they read ahead (the loop's used to be dropped silently)."""
    batches = make_batches(KEYS, 7, seed=27)
    other = make_batches(KEYS, 3, seed=28)
    short = make_batches(KEYS, 2, seed=29)
    trained = batches[:2] + other[:1] + short + other[1:] + batches[2:]
    ref_losses, ref_params = reference(trained)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, "cpu") as pipe:
        it, x = iter(batches), iter(other)
        losses = [float(pipe.progress(it)), float(pipe.progress(it))]
        losses += pipe.run(x, max_steps=1)
        losses += pipe.run(short)
        losses += drive(pipe, x)[0]
        losses += drive(pipe, it)[0]
        assert pipe.stats.steps == len(trained)
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
def test_more_passes_set_aside_than_kept_end_the_oldest(monkeypatch):
    monkeypatch.setattr("fxrec.train.pipeline.MAX_PASSES_ASIDE", 2)
    batches = make_batches(KEYS, 4, seed=30)
    model, opt = fresh(KEYS)
    with TrainPipelineSparseDist(model, opt, "cpu", poll_s=0.01) as pipe:
        readers = []
        for _ in range(3):
            pipe.progress(iter(batches))
            readers.append(pipe._thread)
            pipe.run(batches[:1])
        readers[0].join(timeout=5.0)
        assert not readers[0].is_alive()
        assert readers[1].is_alive() and readers[2].is_alive()


class SharedIterable:
    """An iterable whose ``iter()`` gives back the one iterator it holds, not reset (a loader
    that is its own iterator)."""

    def __init__(self, batches):
        self.it = iter(batches)

    def __iter__(self):
        return self.it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_run_with_max_steps_reads_no_batch_past_them(pipeline_cls):
    """The iterator ``run(iterable, max_steps)`` draws may be the caller's too: the batches
    after ``max_steps`` are left to it (they used to be read ahead and dropped)."""
    batches = make_batches(KEYS, 6, seed=31)
    ref_losses, ref_params = reference(batches)
    model, opt = fresh(KEYS)
    shared = SharedIterable(batches)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = pipe.run(shared, max_steps=2)
        losses += drive(pipe, shared.it)[0]
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_run_over_an_iterable_giving_back_the_loops_iterator_goes_on_with_it(pipeline_cls):
    batches = make_batches(KEYS, 7, seed=32)
    ref_losses, ref_params = reference(batches)
    model, opt = fresh(KEYS)
    shared = SharedIterable(batches)
    with pipeline_cls(model, opt, "cpu") as pipe:
        losses = [float(pipe.progress(shared.it)), float(pipe.progress(shared.it))]
        losses += pipe.run(shared, max_steps=2)
        losses += drive(pipe, shared.it)[0]
    assert_same(losses, params(model), ref_losses, ref_params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_run_on_a_persistent_workers_loader_in_a_loop_over_it(pipeline_cls):
    """``run(loader, max_steps)`` resets the loop's iterator (the same object): the loop then
    goes on after the batches ``run`` trained (those it read ahead used to be dropped)."""
    batches = make_batches(KEYS, 7, seed=33)
    ref_losses, ref_params = reference(batches[:2] + batches[:2] + batches[2:])
    model, opt = fresh(KEYS)
    loader = _persistent_loader(batches)
    with pipeline_cls(model, opt, "cpu") as pipe:
        it = iter(loader)
        losses = [float(pipe.progress(it)), float(pipe.progress(it))]
        losses += pipe.run(loader, max_steps=2)
        losses += drive(pipe, it)[0]
    assert_same(losses, params(model), ref_losses, ref_params)
