"""Train pipelines: the plain one, and one that prepares batch i+1 while batch i trains.

:class:`TrainPipelineBase` does, per batch: host preparation (``host_fn``, e.g. the packer of
:func:`fxrec.passes.combine_inputs.combine_inputs`), copy to the device, forward, backward,
optimizer step. :class:`TrainPipelineSparseDist` does the same arithmetic in the same order
(same losses, same parameters), but a background thread reads, prepares and copies the next
batches (on CUDA on its own stream) into a bounded queue, and, when the model holds a
:class:`~fxrec.distributed.ShardedEmbeddingBagCollection`, the next batch's id counts travel
to their owners while this batch runs its backward and its ids while the optimizer steps
(:mod:`fxrec.train.sparse_dist`).

Failures: an exception from the data loader, from preparing or copying a batch, or from its
forward/backward/step is raised in the caller as :class:`PipelineError` with the batch's
index (0-based, counting every batch drawn). That batch is skipped; calling
:meth:`~TrainPipelineBase.progress` again continues with the next batch, and
:meth:`~TrainPipelineBase.close` (or leaving a ``with`` block) stops the background thread.
A loop that stops a pass early and goes on with a new iterator calls
:meth:`~TrainPipelineBase.end_pass` first (the batches read ahead are dropped); the background
thread calls ``next()`` only during ``progress()``, so a DataLoader with persistent workers
may reset its iterator between calls, and the pipeline starts over when it sees the reset.
A ``run()`` between ``progress()`` calls sets their pass aside, with the batches read ahead,
and the next ``progress()`` on its iterator goes on where it stopped (several passes may be
set aside at once; :meth:`~TrainPipelineBase.end_pass` ends the current one only).
With a sharded collection, both pipelines keep the ranks in step when only one rank loses a
batch (its loader fails, its batch is refused before the exchange, or its data ends): the
other ranks learn it in the id-count exchange, or in a roll call (the base pipeline holds one
for every batch), and raise :class:`PipelineError` for that batch too (and end their pass
with a rank whose data ended, a rank that failed on that batch itself included; ``run()``
returns there, as at the end of its own data). No call waits
forever: queue operations poll a stop flag, and collectives are bounded by the process
group's timeout. A collective that fails (a peer died or hung: a
:class:`~fxrec.distributed.CommError` other than ``MissingBatch``) leaves the group unusable:
its batch's :class:`PipelineError` says so, and every later ``progress()`` raises
``CommError``, so that a loop skipping failed batches ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from fxrec.train.batch import Batch
from fxrec.train.prepare import TensorDictPrep

logger = logging.getLogger(__name__)

__all__ = ["PipelineError", "PipelineStats", "TrainPipelineBase", "TrainPipelineSparseDist"]


class PipelineError(RuntimeError):
    """A batch failed; ``batch_index`` says which, ``__cause__`` says why."""

    def __init__(self, batch_index: int, stage: str, cause: BaseException) -> None:
        then = (
            "The ranks could not complete a collective, so their process group is likely "
            "unusable: close() the pipeline and restart the job (torchrun --max-restarts)."
            if _comm_failed(cause)
            else "The batch was skipped; call progress() again to continue, or close() to stop."
        )
        super().__init__(
            f"batch {batch_index} failed while {stage}: {type(cause).__name__}: {cause}. {then}"
        )
        self.batch_index = batch_index
        self.stage = stage


def _comm_failed(cause: BaseException) -> bool:
    """A collective timed out or broke (not: the peers agreed to skip a batch)."""
    try:
        from fxrec.distributed.comm import CommError, MissingBatch
    except ImportError:  # torch.distributed unavailable: no collectives
        return False
    return isinstance(cause, CommError) and not isinstance(cause, MissingBatch)


def _peer_data_ended(cause: BaseException | None) -> bool:
    """A ``MissingBatch`` saying that a peer's data ended: the end of the pass, not an error."""
    try:
        from fxrec.distributed.comm import MissingBatch
    except ImportError:  # torch.distributed unavailable: no peers
        return False
    return isinstance(cause, MissingBatch) and cause.ended


def _yielded(it: Iterator[Any]) -> int | None:
    """How many batches a DataLoader iterator yielded (None for other iterators)."""
    return getattr(it, "_num_yielded", None)


def _reset_since(it: Iterator[Any], yielded: int | None) -> bool:
    """A DataLoader iterator that yielded fewer batches than ``yielded``, counted earlier:
    its loader's ``iter()`` reset it (persistent workers) since, for a new pass."""
    now = _yielded(it)
    return yielded is not None and now is not None and now < yielded


@dataclass
class PipelineStats:
    """Counters a benchmark reads. ``host_s``: time preparing and copying batches."""

    steps: int = 0
    failed: int = 0
    host_s: float = 0.0
    copies: int = 0
    prepared: int = 0  # TensorDicts converted to KJTs in the host stage
    sent_early: int = 0  # batches whose ids went to their ranks while the batch before trained


def bce_loss(output: Any, batch: Batch) -> torch.Tensor:
    """Default loss: binary cross-entropy on logits (ranking models' click target)."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.binary_cross_entropy_with_logits(
        logits.reshape(-1), batch.labels.reshape(-1).to(logits.dtype)
    )


class TrainPipelineBase:
    """Copy batch to device, forward, backward, optimizer step; one batch at a time.

    Args:
        model: called as ``model(batch.dense, batch.sparse)`` for a :class:`Batch` (any other
            batch: ``model(batch)``, which must return the loss or ``(loss, ...)``).
        optimizer: stepped once per batch (``zero_grad`` before each forward).
        device: where batches go (default: the model's parameters' device).
        loss_fn: ``loss_fn(output, batch) -> loss`` or ``(loss, ...)`` for :class:`Batch`
            inputs (default BCE).
        host_fn: host-side preparation applied to each batch before the copy (e.g. packing
            sparse features); its time is counted in ``stats.host_s``.
        prepare_tensordicts: convert a batch's TensorDicts to KJTs in the host stage, as the
            model's own first-batch conversions did (see :mod:`fxrec.train.prepare`); the
            model still receives the TensorDicts and gets the same results.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str | None = None,
        *,
        loss_fn: Callable[[Any, Batch], torch.Tensor] = bce_loss,
        host_fn: Callable[[Any], Any] | None = None,
        prepare_tensordicts: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        if device is None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None else "cpu"
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.host_fn = host_fn
        self.stats = PipelineStats()
        self._td_prep = TensorDictPrep(prepare_tensordicts)
        self._index = 0  # next batch index to draw
        self._closed = False
        from fxrec.train.sparse_dist import RollCall

        # Sharded collections: which ranks have the batch about to train is agreed on
        self._roll_call = RollCall.of_model(model)
        self._peer_ended = False  # a peer's data ended: this rank's pass ends with it
        self._drawn_from: tuple[Iterator[Any], int | None] | None = None  # (iterator, yielded)
        self._broken: PipelineError | None = None  # a collective failed: no batch can train

    # -- pieces shared by both pipelines -----------------------------------------------------
    def _prepare(self, item: Any, non_blocking: bool = False) -> Any:
        moved, copies = self._prepare_counted(item, non_blocking)
        self.stats.copies += copies
        return moved

    def _prepare_counted(self, item: Any, non_blocking: bool) -> tuple[Any, int]:
        """The prepared batch, and its host-to-device copies."""
        t0 = time.perf_counter()
        if self.host_fn is not None:
            item = self.host_fn(item)
        if non_blocking and hasattr(item, "pin_memory"):
            item = item.pin_memory()  # page-locked memory: the stream's copy is asynchronous
        copies = item.transfer_count() if isinstance(item, Batch) else 0
        moved = item.to(self.device, non_blocking=non_blocking) if hasattr(item, "to") else item
        if isinstance(moved, Batch):
            self.stats.prepared += self._td_prep.apply(moved)
        self.stats.host_s += time.perf_counter() - t0
        return moved, copies

    def _forward(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, Batch):
            with self._td_prep.probe(batch):
                out = self.model(batch.dense, batch.sparse)
            out = self.loss_fn(out, batch)
        else:
            out = self.model(batch)
        return out[0] if isinstance(out, (tuple, list)) else out  # (loss, extras...)

    def _backward_step(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pipeline is closed; build a new one to train further.")

    # -- public API --------------------------------------------------------------------------
    def progress(self, dataloader_iter: Iterator[Any]) -> torch.Tensor:
        """Train on the next batch; return its loss (detached). ``StopIteration`` at the end.

        With sharded collections, every rank calls it at the same step: the ranks agree on
        each batch in a roll call, so that one a rank lacks (its loader failed, its batch was
        refused, its data ended) is skipped on every rank, and one rank's data ending ends
        every rank's pass.
        """
        self._check_open()
        return self._unless_broken(lambda: self._progress_from(dataloader_iter))

    def _unless_broken(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``step()``, unless a collective failed before; one failing in it stops the
        pipeline (see :meth:`_break`)."""
        if self._broken is not None:
            raise self._broken_error()
        try:
            return step()
        except PipelineError as err:
            if _comm_failed(err.__cause__):
                self._break(err)
            raise

    def _progress_from(self, it: Iterator[Any]) -> torch.Tensor:
        if self._ends_with_peer(it):
            raise StopIteration
        current = self._draw(it, self._index)
        self._drawn_from = (it, _yielded(it))
        peer_ended = self._roll_call is not None and self._agree_on(current)
        if current is None:
            raise StopIteration
        index, batch, exc, stage = current
        self._index = index + 1
        if exc is not None:
            self._skip(index, exc, stage, peer_ended=peer_ended)
        return self._train(index, batch)

    def _draw(self, it: Iterator[Any], index: int) -> tuple[int, Any, Exception | None, str] | None:
        """Batch ``index`` read and prepared, as ``(index, batch, error, stage)`` (a failure
        is this rank's to raise once its peers know); None when ``it`` ended."""
        try:
            item = next(it)
        except StopIteration:
            return None
        except Exception as exc:
            return index, None, exc, "reading it from the data loader"
        try:
            return index, self._prepare(item), None, ""
        except Exception as exc:
            return index, None, exc, "preparing and copying it"

    def _ends_with_peer(self, it: Iterator[Any]) -> bool:
        """Whether a peer's data ended the pass on ``it``: its next call here raises
        ``StopIteration`` (once). Another iterator, or this one reset by its DataLoader
        (persistent workers), is a new pass."""
        if not self._peer_ended:
            return False
        self._peer_ended = False
        assert self._drawn_from is not None
        source, yielded = self._drawn_from
        return it is source and not _reset_since(it, yielded)

    def _agree_on(self, current: tuple[int, Any, BaseException | None, str] | None) -> bool:
        """Roll call for a batch (in the overlapping pipeline, one no id-count exchange
        announced): raise for it, on every rank, if a rank has none (its loader failed or
        ended, or it refused its batch). Returns whether a peer's data ended at a batch this
        rank failed on itself: it raises its own error for it, and its pass ends there too."""
        rc = self._roll_call
        assert rc is not None
        mine = rc.ENDED if current is None else rc.FAILED if current[2] is not None else rc.HAVE
        try:
            states = rc.call(mine)
        except RuntimeError as err:  # CommError: a peer died or timed out in an earlier step
            index = self._index if current is None else current[0]
            raise PipelineError(index, "agreeing on it with the other ranks", err) from err
        missing = [r for r, st in enumerate(states) if st != rc.HAVE]
        ended = rc.ENDED in states
        if mine != rc.HAVE or not missing:
            return mine == rc.FAILED and ended
        from fxrec.distributed import MissingBatch
        from fxrec.distributed.dist_ops import why_absent

        index = current[0]  # type: ignore[index]
        err = MissingBatch(
            f"rank(s) {missing} have no batch {index} ({why_absent(ended)}); every rank skips it.",
            missing,
            ended,
        )
        self._skip(index, err, "agreeing on it with the other ranks")

    def _skip(
        self, index: int, err: BaseException, stage: str, *, peer_ended: bool = False
    ) -> NoReturn:
        """Raise for batch ``index``, which this rank does not train; ``peer_ended``: a
        peer's data ended at that batch (as a ``MissingBatch`` saying so does), which ends
        this rank's pass too."""
        self._index = index + 1
        self.stats.failed += 1
        if peer_ended or _peer_data_ended(err):
            self._peer_ended = True
            self._end_with_peer()
        raise PipelineError(index, stage, err) from err

    def _end_with_peer(self) -> None:
        """A peer's data ended this pass (nothing read ahead here to drop)."""

    def _break(self, err: PipelineError) -> None:
        """A collective failed (a peer died, hung or left): the process group is unusable, so
        no later batch can be agreed on or exchanged."""
        self._broken = err
        logger.warning("fxrec pipeline stopped after batch %d failed: %s", err.batch_index, err)

    def _broken_error(self) -> RuntimeError:
        """What every ``progress()`` raises once the pipeline stopped (not a PipelineError: a
        loop that skips failed batches would call it forever)."""
        from fxrec.distributed.comm import CommError

        err = self._broken
        assert err is not None
        error = CommError(
            f"this pipeline stopped at batch {err.batch_index}: the ranks could not complete a "
            "collective there (a peer died, hung or left; the cause below says which), so "
            "their process group is unusable and no later batch can train. close() the "
            "pipeline and restart the job from its last checkpoint (torchrun --max-restarts)."
        )
        error.__cause__ = err
        return error

    def _train(
        self, index: int, batch: Any, after_forward: Callable[[], None] | None = None
    ) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        try:
            loss = self._forward(batch)
            if after_forward is not None:
                after_forward()
            self._backward_step(loss)
        except PipelineError:
            raise
        except Exception as exc:
            self.optimizer.zero_grad(set_to_none=True)
            self.stats.failed += 1
            raise PipelineError(index, "training on it", exc) from exc
        self.stats.steps += 1
        return loss.detach()

    def run(self, batches: Iterable[Any], max_steps: int | None = None) -> list[float]:
        """Train on ``batches`` (at most ``max_steps``); the losses. Stops at the first error.

        Each call starts ``batches`` over (``iter(batches)``); pass an iterator to go on
        where the last call stopped. With sharded collections, a peer's data ending ends the
        pass here too, as this rank's own end of data does (it returns; it raises only for
        a batch this rank failed on itself).
        """
        return self._run(iter(batches), max_steps)

    def _run(self, it: Iterator[Any], max_steps: int | None) -> list[float]:
        losses: list[float] = []
        while max_steps is None or len(losses) < max_steps:
            try:
                losses.append(float(self.progress(it)))
            except StopIteration:
                break
            except PipelineError as err:
                if not _peer_data_ended(err.__cause__):
                    raise
                self._take_peer_end(it)
                break
        return losses

    def _take_peer_end(self, it: Iterator[Any]) -> None:
        """A peer's data ended the pass on ``it`` inside ``run()``, which returns there: the
        next call on ``it`` starts a new pass, as after this rank's own end of data."""
        self._ends_with_peer(it)

    def end_pass(self, dataloader_iter: Iterator[Any] | None = None) -> None:
        """End the current pass over the data early (a loop that stops before
        ``StopIteration``): this pipeline reads no batch ahead, so only a pass a peer's data
        ended is over (the next ``progress()`` on its iterator reads it again)."""
        self._check_open()
        last = self._drawn_from[0] if self._drawn_from is not None else None
        if dataloader_iter is None or dataloader_iter is last:
            self._peer_ended = False

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> TrainPipelineBase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_END = object()

# What a pass of TrainPipelineSparseDist over one iterator holds (see its ``_set_aside``).
_PASS_STATE = ("_source", "_thread", "_queue", "_halt", "_gate", "_copies", "_next", "_shift")
# Passes kept aside at once (each holds a reader thread and up to ``prefetch`` batches).
MAX_PASSES_ASIDE = 8


@dataclass
class _Parked:
    """A pass over an iterator set aside by ``run()``, to resume where it stopped."""

    state: dict[str, Any]  # the pipeline's attributes of that pass (``_PASS_STATE``)
    index: int  # the pipeline's next batch index when it was set aside


class _Gate:
    """Lets the reader call ``next()`` on its source only while a ``progress()`` call runs.

    Between calls the iterator is the caller's: a DataLoader with persistent workers resets,
    in ``iter()``, the very iterator object the reader reads, and a reset racing a ``next()``
    corrupts its bookkeeping. ``progress()`` opens the gate, and closes it before returning,
    waiting for a ``next()`` in flight.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._busy = False
        self.yielded: int | None = None  # a DataLoader iterator's count after the last next()

    def enter(self, stopped: Callable[[], bool], poll_s: float) -> bool:
        """Wait until ``next()`` may be called; False: the reader stops instead."""
        with self._cond:
            while not self._open:
                if stopped():
                    return False
                self._cond.wait(poll_s)
            self._busy = True
            return True

    def leave(self, source: Iterator[Any]) -> None:
        with self._cond:
            self._busy = False
            self.yielded = getattr(source, "_num_yielded", None)
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self, stopped: Callable[[], bool], poll_s: float) -> None:
        """Forbid further ``next()`` calls and wait for the one in flight, if any."""
        with self._cond:
            self._open = False
            while self._busy and not stopped():
                self._cond.wait(poll_s)


def _read(
    pipeline: weakref.ref,
    stopped: Callable[[], bool],
    gate: _Gate,
    q: queue.Queue,
    source: Iterator[Any],
    index: int,
    copies: dict[int, int],
    poll_s: float,
    threads: int | None,
    limit: int | None = None,
) -> None:
    """The reader thread of :class:`TrainPipelineSparseDist`: read, prepare and copy batches
    from ``source`` (the first one is batch ``index``) into ``q``, calling ``next()`` only
    while ``gate`` is open, and note each batch's host-to-device copies in ``copies``. After
    ``limit`` batches it ends its pass without calling ``next()`` again: the rest of the
    iterator is the caller's.

    It holds the pipeline weakly, and only while preparing a batch: a pipeline dropped
    without ``close()`` is collected, which stops it.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # this thread, and threads started meanwhile
    try:
        while gate.enter(stopped, poll_s):
            if limit is not None and limit <= 0:
                gate.leave(source)
                _put(stopped, q, _END, poll_s)
                return
            if limit is not None:
                limit -= 1
            item, exc = _next(gate, source)
            if isinstance(exc, StopIteration):
                _put(stopped, q, _END, poll_s)
                return
            entry: Any = (index, None, exc, "reading it from the data loader")
            if exc is not None and not isinstance(exc, Exception):
                # KeyboardInterrupt, SystemExit: raised as they are; progress() raises it,
                # and starts reading again after it
                _put(stopped, q, entry, poll_s)
                return
            if exc is None:
                owner = pipeline()
                if owner is None:
                    return
                entry = owner._entry(item, index, copies)
                del owner
            _put(stopped, q, entry, poll_s)
            index += 1
    finally:
        if threads is not None:  # threads started later take the process's count again
            torch.set_num_threads(before)


def _next(gate: _Gate, source: Iterator[Any]) -> tuple[Any, BaseException | None]:
    """``next(source)`` or what it raised; the gate is left as soon as it returns."""
    try:
        return next(source), None
    except BaseException as exc:
        return None, exc
    finally:
        gate.leave(source)


def _put(stopped: Callable[[], bool], q: queue.Queue, entry: Any, poll_s: float) -> None:
    while not stopped():
        try:
            q.put(entry, timeout=poll_s)
            return
        except queue.Full:
            continue


class TrainPipelineSparseDist(TrainPipelineBase):
    """Like :class:`TrainPipelineBase`, with batch i+1's reading, preparation, copy and id
    all-to-all overlapping batch i's training. Same losses and parameters as the base.

    Args (beyond the base's):
        prefetch: batches prepared ahead (the queue bound, >= 1).
        poll_s: how often blocked queue operations re-check for ``close()``.
        host_threads: intra-op threads of the background thread's torch ops (OpenMP's count
            is per thread: the training thread keeps its own). Default: 1 when training on
            the CPU, where a second OpenMP team would compete with the step's team for the
            same cores and stall both at their barriers; unchanged on CUDA.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str | None = None,
        *,
        loss_fn: Callable[[Any, Batch], torch.Tensor] = bce_loss,
        host_fn: Callable[[Any], Any] | None = None,
        prepare_tensordicts: bool = True,
        prefetch: int = 2,
        poll_s: float = 0.05,
        host_threads: int | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            loss_fn=loss_fn,
            host_fn=host_fn,
            prepare_tensordicts=prepare_tensordicts,
        )
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        if host_threads is not None and host_threads < 1:
            raise ValueError(f"host_threads must be at least 1, got {host_threads}")
        self.prefetch = prefetch
        self.poll_s = poll_s
        self.host_threads = host_threads
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()  # closed: every reader stops
        self._halt = threading.Event()  # the current reader stops (each reader has its own)
        self._gate = _Gate()
        self._copies: dict[int, int] = {}  # batches read ahead: their host-to-device copies
        self._shift = 0  # added to the reader's batch indices (batches other passes drew)
        self._parked: list[_Parked] = []  # passes run() interrupted, oldest first
        self._thread: threading.Thread | None = None
        self._source: Iterator[Any] | None = None
        self._exhausted = False  # the source ended: progress() accepts a new iterator
        self._next: tuple[int, Any, BaseException | None, str] | None = None
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        from fxrec.train.sparse_dist import InputDist

        self._input_dist = InputDist(model)
        self._announced = False  # the next batch's presence went out in its id-count exchange
        # A pipeline dropped without close(): its reader (which holds it weakly) stops.
        weakref.finalize(self, self._stop.set)

    # -- the producer thread -------------------------------------------------------------------
    def _entry(
        self, item: Any, index: int, copies_of: dict[int, int]
    ) -> tuple[int, Any, BaseException | None, str]:
        """Batch ``index`` read from the loader, prepared and copied: a queue entry (its copies
        noted in ``copies_of``, its reader's, which a pass set aside keeps)."""
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    batch, copies = self._prepare_counted(item, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                payload: Any = (batch, event)
            else:
                payload, copies = self._prepare_counted(item, non_blocking=False)
            # counted when the batch is trained: batches read ahead and dropped are not
            copies_of[index] = copies
            return index, payload, None, ""
        except Exception as exc:
            return index, None, exc, "preparing and copying it"

    def _start_reader(self, source: Iterator[Any], index: int, limit: int | None = None) -> None:
        threads = self.host_threads
        if threads is None and self.device.type == "cpu":
            threads = 1
        # Its own stop flag, gate and queue: a reader still stuck in next() after it was told
        # to stop can never feed a later pass.
        closed, halt = self._stop, threading.Event()
        self._halt, self._gate = halt, _Gate()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._copies, self._shift = {}, 0
        args = (weakref.ref(self), lambda: closed.is_set() or halt.is_set(), self._gate)
        self._thread = threading.Thread(
            target=_read,
            args=(*args, self._queue, source, index, self._copies, self.poll_s, threads, limit),
            name="fxrec-pipeline-copy",
            daemon=True,
        )
        self._thread.start()

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                if self._stop.is_set():
                    return _END  # closed (from another thread): no more batches
                if self._thread is None or not self._thread.is_alive():
                    # the producer ended (closed, or died in a way it could not report)
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _END

    def _stop_reader(self) -> None:
        """Stop the last iterator's reader (ended, or stopped early) and drop what it read."""
        if self._thread is None:
            return
        self._halt.set()
        self._thread.join(timeout=max(1.0, 20 * self.poll_s))
        if self._thread.is_alive():
            logger.warning(
                "fxrec pipeline: the last data loader is still blocked inside next(); its "
                "thread is a daemon and will not keep the process alive"
            )
        self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()
        self._copies.clear()
        self._next = None
        self._input_dist.discard()  # exchanges of batches read ahead that will not run

    def _start(self, source: Iterator[Any], limit: int | None = None) -> None:
        self._stop_reader()
        self._source = source
        self._exhausted = self._peer_ended = False
        self._announced = False  # the first batch of a pass is agreed on in a roll call
        # indices count every batch drawn, across epochs
        self._start_reader(source, self._index, limit)

    def _take(self) -> tuple[int, Any, BaseException | None, str] | None:
        entry = self._get()
        if entry is _END:
            return None
        index, payload, exc, stage = entry
        self.stats.copies += self._copies.pop(index, 0)
        index += self._shift  # batches drawn by other passes since this reader numbered it
        if exc is None and self._stream is not None:
            batch, event = payload
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            if isinstance(batch, Batch):
                batch.record_stream(current)
            payload = batch
        return index, payload, exc, stage

    # -- public API ----------------------------------------------------------------------------
    def run(self, batches: Iterable[Any], max_steps: int | None = None) -> list[float]:
        """Train on ``batches`` (at most ``max_steps``); the losses. Stops at the first error.

        Each call starts ``batches`` over (``iter(batches)``); pass an iterator to go on
        where the last call stopped. A pass left under way on another iterator (by
        ``progress()`` or ``run()``) is set aside with the batches it read ahead, and resumes
        where it stopped when its iterator comes back, as with the base pipeline. Up to
        ``MAX_PASSES_ASIDE`` passes are kept aside; setting aside one more ends the oldest
        (its batches read ahead are dropped, with a warning).
        """
        self._check_open()
        if isinstance(batches, Iterator):  # go on where the last call stopped, if it is ours
            if batches is not self._source and not self._is_parked(batches):
                self._set_aside()  # another iterator: the pass under way resumes later
            return self._run(batches, max_steps)
        # Starts over, as the base does. A DataLoader with persistent workers resets, in
        # iter(), the very iterator object a reader may be reading: readers only call next()
        # inside progress(), and one whose iterator is reset stops before reading it again.
        self._set_aside()
        it = iter(batches)
        if self._is_parked(it):
            # iter() gave back an iterator a pass is under way on (an iterable that is its own
            # iterator, or a DataLoader with persistent workers): go on with that pass, which
            # starts over if iter() reset it, and set it aside again for its other callers.
            try:
                return self._run(it, max_steps)
            finally:
                self._set_aside()
        # Read no batch past the ones this call trains: iter() may give back an iterator
        # the caller holds too, which goes on after them.
        self._start(it, limit=max_steps)
        try:
            return self._run(it, max_steps)
        finally:  # the iterator is this call's: the pass ends with it, as the base's does
            self._stop_reader()
            self._source = None

    def _parked_pass(self, it: Iterator[Any]) -> _Parked | None:
        return next((p for p in self._parked if p.state["_source"] is it), None)

    def _is_parked(self, it: Iterator[Any]) -> bool:
        return self._parked_pass(it) is not None

    def _set_aside(self) -> None:
        """Leave no pass under way: keep the current one (its reader and the batches it read
        ahead) for a later call on its iterator; an ended one stops."""
        if self._source is None or self._exhausted or self._peer_ended or self._thread is None:
            self._stop_reader()
            self._source = None
            return
        # Its next batch's ids were sent for the next step; a forward of another pass comes
        # first, so they are dropped, and that batch's collections send them when it resumes.
        self._input_dist.discard()
        self._parked.append(
            _Parked({name: getattr(self, name) for name in _PASS_STATE}, self._index)
        )
        if len(self._parked) > MAX_PASSES_ASIDE:
            oldest = self._parked[0]
            logger.warning(
                "fxrec pipeline: more than %d passes set aside; the oldest one ends and the "
                "batches it read ahead are dropped (a later progress() on its iterator goes on "
                "after them). Finish passes, or end them with end_pass(iterator).",
                MAX_PASSES_ASIDE,
            )
            self._end_parked(oldest)
        self._source = self._thread = self._next = None
        self._copies, self._shift = {}, 0
        self._queue, self._halt, self._gate = queue.Queue(self.prefetch), threading.Event(), _Gate()
        self._announced = False

    def _resume(self, it: Iterator[Any]) -> None:
        """Go on with the pass set aside on ``it`` where it stopped; the current one is set
        aside."""
        parked = self._parked_pass(it)
        assert parked is not None
        self._parked.remove(parked)
        self._set_aside()
        for name, value in parked.state.items():
            setattr(self, name, value)
        drawn = self._index - parked.index  # batches other passes drew meanwhile
        self._shift += drawn
        if self._next is not None:
            self._next = (self._next[0] + drawn, *self._next[1:])
        self._exhausted = self._peer_ended = False
        self._announced = False  # its next batch is agreed on in a roll call

    def _end_parked(self, parked: _Parked) -> None:
        """Stop a pass set aside; the batches it read ahead are dropped."""
        self._parked.remove(parked)
        logger.info("fxrec pipeline: a pass set aside ends; its batches read ahead are dropped")
        parked.state["_halt"].set()
        parked.state["_thread"].join(timeout=max(1.0, 20 * self.poll_s))

    def end_pass(self, dataloader_iter: Iterator[Any] | None = None) -> None:
        """End the pass under way before its end: the current one or, when a ``run()`` left
        none current, the one it set aside last (given ``dataloader_iter``: the pass on that
        iterator, current or set aside). The batches read ahead are dropped, and the next
        :meth:`progress` starts a new pass on the iterator it gets. Other passes set aside
        stay, to resume when their iterators come back (:meth:`close` ends them all).

        Call it when a loop stops before ``StopIteration`` (steps per epoch, a
        :class:`PipelineError` it breaks on) and the next pass is a new iterator. A DataLoader
        with persistent workers needs no call: its ``iter()`` resets the same iterator, and the
        pipeline starts over when it sees the reset. With sharded collections, every rank calls
        it at the same step.
        """
        self._check_open()
        if dataloader_iter is None:
            current = self._source is not None and not self._exhausted
            parked = None if current or not self._parked else self._parked[-1]
        else:
            parked = self._parked_pass(dataloader_iter)
        if parked is not None:
            self._end_parked(parked)
            return
        if dataloader_iter is None or dataloader_iter is self._source:
            self._stop_reader()
            self._source = None

    def progress(self, dataloader_iter: Iterator[Any]) -> torch.Tensor:
        self._check_open()
        if dataloader_iter is not self._source and self._is_parked(dataloader_iter):
            self._resume(dataloader_iter)  # a pass a run() interrupted
        if self._source is None or self._exhausted or self._was_reset(dataloader_iter):
            # The first iterator, or the next epoch's: a new one, or the same one reset (a
            # DataLoader with persistent workers returns the same iterator each epoch; one
            # truly exhausted ends the new pass at once).
            self._start(dataloader_iter)
        elif dataloader_iter is not self._source:
            raise ValueError(
                "TrainPipelineSparseDist reads ahead from its iterator: keep passing the same "
                "one until it raises StopIteration (then a new one, e.g. the next epoch's), or "
                "call end_pass() first to stop the current pass early."
            )
        self._gate.open()  # the reader calls next() only while this call runs
        try:
            return self._unless_broken(self._progress_batch)
        finally:
            self._gate.close(self._stop.is_set, self.poll_s)

    def _was_reset(self, it: Iterator[Any]) -> bool:
        """A DataLoader iterator that yielded fewer batches than the reader read from it: its
        loader's ``iter()`` reset it (persistent workers), and the batches read ahead are the
        last pass's."""
        if it is not self._source or not _reset_since(it, self._gate.yielded):
            return False
        logger.info("fxrec pipeline: the data loader's iterator was reset; a new pass starts")
        return True

    def _break(self, err: PipelineError) -> None:
        """A collective failed: as the base, and the reader stops."""
        try:
            self._stop_reader()  # drops the exchanges in flight, which fail on the group too
        except Exception as exc:
            logger.debug("fxrec pipeline: dropping exchanges after the failure: %s", exc)
        super()._break(err)

    def _progress_batch(self) -> torch.Tensor:
        if self._exhausted or self._peer_ended:
            self._exhausted = True
            raise StopIteration  # (without a roll call: the other ranks heard it once)
        current = self._next if self._next is not None else self._take()
        self._next = None
        announced, self._announced = self._announced, False
        peer_ended = self._roll_call is not None and not announced and self._agree_on(current)
        if current is None:
            self._exhausted = True
            raise StopIteration
        index, batch, exc, stage = current
        self._index = index + 1
        if exc is not None:
            if not isinstance(exc, Exception):  # KeyboardInterrupt...: as the base raises it
                # its reader stopped there; a later progress() reads on, as the base does
                self._thread.join(timeout=max(1.0, 20 * self.poll_s))  # type: ignore[union-attr]
                read = self._gate.yielded
                self._start_reader(self._source, index + 1)  # type: ignore[arg-type]
                self._gate.yielded = read
                raise exc
            if announced:  # its id-count exchange told whether a peer's data ended
                peer_ended = self._input_dist.peer_ended()
            self._skip(index, exc, stage, peer_ended=peer_ended)
        self._input_dist.probe(batch)

        def start_next() -> None:
            # Between forward(i) and backward(i): take batch i+1 and send its ids now.
            self._next = self._take()
            if self._next is not None and self._next[2] is None:
                try:
                    self._input_dist.start(self._next[1])
                    self.stats.sent_early += bool(self._input_dist.enabled)
                except Exception as err:  # a bad next batch fails as itself, not as batch i
                    self._fail_next(err)
            else:  # failed or no more data: the other ranks must hear it, and skip it too
                self._input_dist.start_absent(ended=self._next is None)
            self._announced = bool(self._input_dist.enabled)

        try:
            return self._train(index, batch, after_forward=start_next)
        except PipelineError:
            self._input_dist.retry_probe()  # (once the next batch's exchange started: no-op)
            raise

    def _skip(
        self, index: int, err: BaseException, stage: str, *, peer_ended: bool = False
    ) -> NoReturn:
        self._input_dist.discard()
        super()._skip(index, err, stage, peer_ended=peer_ended)

    def _end_with_peer(self) -> None:
        # its reader stops now: the next epoch's iter() may reset the very iterator
        self._stop_reader()

    def _take_peer_end(self, it: Iterator[Any]) -> None:
        if it is self._source:
            self._exhausted = True

    def _backward_step(self, loss: torch.Tensor) -> None:
        loss.backward()
        # Batch i+1's id counts travelled during the backward: send its ids now, so that they
        # travel while the optimizer steps. A failure belongs to batch i+1, not to batch i.
        try:
            self._input_dist.advance()
        except Exception as err:
            self._fail_next(err)
            self._input_dist.discard()
        self.optimizer.step()

    def _fail_next(self, err: BaseException) -> None:
        """Batch i+1 failed while its ids were being sent: it is raised as itself, later."""
        nxt = self._next
        if nxt is not None and nxt[2] is None:
            self._next = (nxt[0], None, err, "sending its ids to their owners")

    def close(self) -> None:
        """Stop the background thread (promptly) and drop prepared batches."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 20 * self.poll_s))
            if self._thread.is_alive():
                logger.warning(
                    "fxrec pipeline: the data loader is still blocked inside next(); its "
                    "thread is a daemon and will not keep the process alive"
                )
        while not self._queue.empty():
            self._queue.get_nowait()
        for parked in list(self._parked):
            self._end_parked(parked)
        self._input_dist.discard()
        self._input_dist.restore()
