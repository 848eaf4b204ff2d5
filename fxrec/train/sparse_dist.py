"""Send batch i+1's ids to their owning ranks while batch i is still training.

For each :class:`~fxrec.distributed.ShardedEmbeddingBagCollection` in the model, the first
batch is run normally while a wrapper around its forward checks that the collection receives
the batch's own sparse object (``batch.sparse`` or one element of it, unmodified). If it
does, its ``forward`` is swapped, on that instance only, for one that consumes ids already on
their way (TorchRec's pipelines rewrite the sharded modules' forwards the same way). Inside a
graph captured by ``fxrec.optimize`` the module is no longer called: there the pipeline
watches the graph's id-count requests instead, and if one receives the batch's KJT as it is
(a TensorDict's KJT kept with it, or for combined features the KJT slice of them the graph
rebuilds, kept with them too), the graph's request takes over the exchange the pipeline
started (see ``dist_ops.started_early``). Otherwise (the model transforms the features
first) the collection keeps requesting its own ids in its forward and the pipeline only
overlaps the reading and copying of batches.

Batch i+1's exchange runs in two asynchronous steps, so that no rank blocks on another in
the middle of batch i: :meth:`InputDist.start` (between forward and backward) starts the
id-count exchange, which travels during the backward; :meth:`InputDist.advance` (after the
backward) reads the counts and starts the ids all-to-all, which travels during the optimizer
step. Every rank runs the same program, so every rank issues the collectives in the same
order. A rank whose next batch failed to load (or whose data ended) still takes part in the
count exchange, announcing that it has no batch (:meth:`InputDist.start_absent`); the other
ranks then skip that batch too, raising for it, rather than sending ids no rank would use.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxrec.sparse import CombinedFeatures

logger = logging.getLogger(__name__)

__all__ = ["InputDist", "RollCall"]


def _sharded_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from fxrec.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    except ImportError:  # torch.distributed unavailable
        return []
    return [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]


class InputDist:
    """Early id all-to-alls for the sharded collections of ``model`` (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = _sharded_modules(model)
        self.enabled: list[nn.Module] = []
        self._probed = not self.modules
        self._pending: dict[int, tuple[Any, Any]] = {}  # id(module) -> (features, (kjt, handle))
        # id(module) -> which part of batch.sparse it reads, and for combined features, which
        # of their KJT slices (fxrec.sparse.CombinedFeatures.kjt_slice's arguments)
        self._where: dict[int, tuple[int, tuple[int, int, bool] | None]] = {}
        self._in_graph: set[int] = set()  # id(module) of those whose graph takes exchanges over
        self._ended = False  # a rank announced in the next batch's exchange that its data ended
        self._probing = False
        self._watch = contextlib.ExitStack()
        # A pipeline dropped without close() leaves no exchange for a later forward to take.
        weakref.finalize(self, _forget_all, self._pending)

    def probe(self, batch: Any) -> None:
        """On the first batch: find the collections that receive ``batch.sparse`` itself."""
        if self._probed:
            return
        self._probed = True
        sparse = getattr(batch, "sparse", None)
        # the sparse object itself, or one element of a tuple/list of them
        parts = list(sparse) if isinstance(sparse, (tuple, list)) else [sparse]
        seen: dict[int, int | None] = {}
        # A wrapped forward, not a forward hook: hooks would make fxrec.optimize build other
        # graphs (it keys graphs on hooks, which symbolic tracing would otherwise drop).
        for m in self.modules:
            m.forward = _recording(m, m.forward, parts, seen)  # type: ignore[method-assign]
        from fxrec.distributed import dist_ops
        from fxrec.distributed.sharded_ebc import kept_kjt

        for m in self.modules:  # a TensorDict's KJT kept: one its conversion in a graph returns
            for part in parts:
                with contextlib.suppress(TypeError, ValueError):
                    kept_kjt(part, m._layout)
        self._requests = self._watch.enter_context(dist_ops.watch_requests())
        self._probing = True
        self._seen = seen
        self._parts = parts

    def retry_probe(self) -> None:
        """The probed batch failed before its next batch's exchange started (a batch every
        rank skips): probe the next batch instead, as the first one."""
        if self._probing:
            self._end_probe()
            self._probed = False

    def _end_probe(self) -> None:
        for m in self.modules:
            if "forward" in m.__dict__:
                del m.forward
        self._watch.close()
        self._probing = False

    def _finish_probe(self) -> None:
        if not self._probing:
            return
        self._end_probe()
        for m in self.modules:
            seen = self._seen.get(id(m))
            where = None if seen is None else (seen, None)
            if where is not None:
                self._install(m)
            else:
                where = self._graph_reads(m)
                if where is not None:
                    self._in_graph.add(id(m))
            if where is not None:
                self.enabled.append(m)
                self._where[id(m)] = where
            else:
                logger.info(
                    "fxrec pipeline: %s does not receive the batch's sparse features as they "
                    "are; its ids are sent in its own forward (no early all-to-all)",
                    type(m).__name__,
                )

    def _graph_reads(self, m: nn.Module) -> tuple[int, tuple[int, int, bool] | None] | None:
        """Which part of the first batch's sparse input a captured graph handed, as it is,
        to ``m``'s id-count request, and which KJT slice of it for combined features (None:
        it transformed it, or never made one)."""
        from fxrec.distributed.sharded_ebc import read_kjt

        asked = [kjt for kjt, layout in self._requests if layout == m._layout]
        for i, part in enumerate(self._parts):
            if isinstance(part, CombinedFeatures):  # the graph rebuilt a KJT slice of it
                for key, kjt in part.kept_slices().items():
                    if any(a is kjt for a in asked):
                        return i, key
                continue
            try:
                kjt = read_kjt(part, m._layout)  # a TensorDict: the KJT kept in probe()
            except (TypeError, ValueError):
                continue
            if any(a is kjt for a in asked):
                return i, None
        return None

    def _install(self, m: nn.Module) -> None:
        original = m.forward
        pending = self._pending

        def forward(features: Any) -> Any:
            entry = pending.pop(id(m), None)
            if entry is None or entry[0] is not features:
                if entry is not None:
                    _drain(entry[1])
                return original(features)
            return _forward_from_ids(m, entry[1])

        m.forward = forward  # type: ignore[method-assign]
        m._fxrec_pipeline_forward = original  # type: ignore[attr-defined]

    def start(self, batch: Any) -> None:
        """Start the id-count exchange of ``batch`` for every enabled collection (call between
        forward and backward: the counts travel while the backward runs)."""
        self._finish_probe()
        if not self.enabled:
            return
        from fxrec.distributed import dist_ops

        self._ended = False
        sparse = batch.sparse
        parts = list(sparse) if isinstance(sparse, (tuple, list)) else [sparse]
        error: Exception | None = None
        for m in self.enabled:
            self._drop_stale(m)
            if error is None:
                part, piece = self._where[id(m)]
                features = parts[part]
                try:
                    if piece is not None:  # the slice the graph will rebuild, that very KJT
                        features = features.kjt_slice(*piece)
                    kjt, handle = m.request_counts(features)
                    self._pending[id(m)] = (features, (kjt, handle))
                    if id(m) in self._in_graph:
                        dist_ops.started_early(kjt, handle)
                    continue
                except Exception as exc:  # a bad batch: the peers still get their exchange
                    error = exc
                    announced = getattr(exc, "fxrec_absent", None)  # by the refusing request
                    if announced is not None:
                        self._pending[id(m)] = (None, (None, announced))
                        continue
            self._pending[id(m)] = (None, (None, m.request_absent()))
        if error is not None:
            raise error

    def start_absent(self, ended: bool = False) -> None:
        """This rank has no next batch (its loader failed, or ``ended``): take part in the
        id-count exchanges anyway, announcing it, so the other ranks skip that batch too
        instead of waiting for ids that never come (call where :meth:`start` would be)."""
        self._finish_probe()
        self._ended = False
        for m in self.enabled:
            self._drop_stale(m)
            self._pending[id(m)] = (None, (None, m.request_absent(ended)))

    def _drop_stale(self, m: nn.Module) -> None:
        stale = self._pending.pop(id(m), None)
        if stale is not None:
            _drain(stale[1])

    def advance(self) -> None:
        """The counts have arrived: start sending the ids (call after the backward; the ids
        travel while the optimizer steps). Every rank calls it at the same point.

        Raises :class:`~fxrec.distributed.CommError` when a rank announced no batch; no ids
        are sent then, on any rank.
        """
        from fxrec.distributed import dist_ops

        for key, (_, (kjt, handle)) in list(self._pending.items()):
            if handle.sent is None:
                splits = dist_ops.wait_counts(handle)
                self._ended |= dist_ops.ENDED in splits.batch_sizes
                if kjt is None:  # this rank announced no batch: nothing to send
                    del self._pending[key]
                    continue
                handle.sent = dist_ops.send_ids(splits)

    def peer_ended(self) -> bool:
        """Whether a peer announced that its data ended in the exchange of a batch this rank
        had none of (its own failure is raised for that batch, and its pass ends there too,
        as its peers' does)."""
        from fxrec.distributed import dist_ops

        ended = self._ended
        for _, (_, handle) in self._pending.values():
            if handle.sent is None:  # not advanced (the step before failed)
                ended = ended or dist_ops.ENDED in dist_ops.wait_counts(handle).batch_sizes
        return ended

    def discard(self) -> None:
        """Drop ids requested for a batch that will not run (wait so buffers are released).

        An exchange that failed (a peer died) is only logged: the batch it was for will not
        run, and the collective that failed, or the next one, raises where it belongs.
        """
        self._finish_probe()
        requests = list(self._pending.values())
        self._pending.clear()
        for _, request in requests:
            try:
                _drain(request)
            except RuntimeError as exc:  # CommError
                logger.warning("fxrec pipeline: dropping an exchange that failed: %s", exc)

    def restore(self) -> None:
        """Give every collection its own forward back."""
        for m in self.enabled:
            saved = getattr(m, "_fxrec_pipeline_forward", None)
            if saved is not None:
                del m.forward
                del m._fxrec_pipeline_forward
        self.enabled = []


class RollCall:
    """Which ranks have the batch about to train: one all-reduce of a flag per rank.

    The id-count exchange of batch i+1 tells every rank which peers have it; a batch that had
    none (the first of an iterator, any batch when the model transforms the features before
    its collections, whose ids are then not sent early, and every batch of
    ``TrainPipelineBase``) is agreed on here, so that a rank whose
    loader failed, or ended early, never leaves the others training a batch against the
    wrong peers. It runs on a CPU (gloo) group: no device synchronisation.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @staticmethod
    def of_model(model: nn.Module) -> RollCall | None:
        """For the group of ``model``'s sharded collections (see :meth:`of`)."""
        return RollCall.of(_sharded_modules(model))

    @staticmethod
    def of(modules: list[nn.Module]) -> RollCall | None:
        """For the collections' group, or None in a single process (every rank must build
        the pipeline at the same point: on a non-gloo backend this creates a gloo group)."""
        if not modules or not dist.is_initialized():
            return None
        group = modules[0].process_group
        if dist.get_world_size(group) == 1:
            return None
        if dist.get_backend(group) != "gloo":
            group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
        return RollCall(group)

    HAVE, FAILED, ENDED = 1, 2, 3

    def call(self, state: int) -> list[int]:
        """Every rank's state (:attr:`HAVE`, :attr:`FAILED` or :attr:`ENDED`); this one's is
        ``state``."""
        from fxrec.distributed.comm import translated

        states = torch.zeros(self.world, dtype=torch.int32)
        states[self.rank] = state
        with translated("roll call of the ranks' next batch"):
            dist.all_reduce(states, group=self.group)
        return states.tolist()


def _recording(m: nn.Module, forward: Any, parts: list[Any], seen: dict[int, int | None]) -> Any:
    """``forward``, noting which of ``parts`` (if any) the collection receives as is."""

    def probing(features: Any, *args: Any, **kwargs: Any) -> Any:
        where = [i for i, p in enumerate(parts) if features is p]
        seen[id(m)] = where[0] if where else None
        return forward(features, *args, **kwargs)

    return probing


def _drain(request: Any) -> None:
    """Wait for an exchange no forward took over; a captured graph no longer may."""
    _forget(request)
    request[1].drain()


def _forget(request: Any) -> None:
    from fxrec.distributed import dist_ops

    kjt, handle = request
    if kjt is not None:
        dist_ops.forget_early(kjt, handle.layout)


def _forget_all(pending: dict[int, tuple[Any, Any]]) -> None:
    for _, request in pending.values():
        _forget(request)


def _forward_from_ids(m: Any, request: Any) -> Any:
    """The collection's forward, from an exchange already in flight (its ids already sent
    once the backward advanced it; not when no backward ran in between)."""
    from fxrec.distributed import dist_ops

    kjt, handle = request
    ids = dist_ops.send_ids(dist_ops.wait_counts(handle))
    return m.finish(dist_ops.wait_ids(ids), ids, kjt)
