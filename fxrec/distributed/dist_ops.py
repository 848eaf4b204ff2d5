"""The embedding all-to-alls, each split into a *request* and a *wait*.

These functions are ``torch.fx.wrap``-ped: symbolic tracing records each as one node, so a
traced model shows every all-to-all as a request node and a wait node, and the overlap pass
(:mod:`fxrec.passes.overlap`) can move compute between them. Each carries an attribute
``_fxrec_comm`` ("request" or "wait") by which the pass recognises it.

Ids (input dist): split sizes depend on the data, so every rank first tells each owner how
many ids and rows it will send: :func:`request_counts` (asynchronous ``all_to_all_single``
of a small counts tensor) and :func:`wait_counts`. :func:`send_ids` then starts the ids,
lengths and weights, packed side by side per destination into one ``async_op=True``
exchange (one round trip, not three; it returns an :class:`IdsHandle` that holds the
``Work``), and :func:`wait_ids` waits for them and unpacks. The chain request -> wait -> request
-> wait gives the overlap pass one window per exchange. Ids and lengths travel as int64,
weights as float64 (:data:`WEIGHTS_WIRE_DTYPE`),
whatever each rank's dtypes (ranks may differ). Weights travel only for a weighted collection
(``IdsLayout.weighted``, the same on every rank, never read from one rank's input); when
any rank's weights require grad (a flag in the counts), every rank sends them by the
functional all-to-all, whose backward returns each weight's gradient to its source.

A train pipeline may start batch i+1's id-count exchange before batch i's step ends
(:func:`started_early`); the :func:`request_counts` of the forward that receives that very
KJT then takes it over instead of starting its own, and :func:`wait_counts` and
:func:`send_ids` return what is already known or in flight. That works inside a captured
graph too, where the pipeline cannot swap the collection's forward.

Every wait runs inside :func:`fxrec.distributed.comm.blocked`: a peer that never arrives
makes it raise :class:`CommError` after the process group's timeout.

Pooled embeddings (output dist): the traceable functional collective
``torch.ops._c10d_functional.all_to_all_single`` + ``wait_tensor``. Its gradient is the
reverse all-to-all (reversed split sizes), so gradients travel back to the owners; run
eagerly, that backward exchange also raises :class:`CommError` on a failure
(:func:`~fxrec.distributed.comm.translated`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from fxrec.compiling import is_compiling
from fxrec.distributed.comm import CommError, MissingBatch, blocked, translated
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor
from fxrec.sparse.validation import validation_enabled

__all__ = [
    "CountsHandle",
    "IdsHandle",
    "IdsSplits",
    "assemble_pooled",
    "ABSENT",
    "ENDED",
    "absent_ranks",
    "announce_refusal",
    "key_index",
    "request_absent",
    "request_counts",
    "request_ids",
    "request_pooled",
    "send_ids",
    "forget_early",
    "started_early",
    "watch_requests",
    "wait_counts",
    "wait_ids",
    "wait_pooled",
]


#: The dtype per-id weights travel in, whatever each rank's (ranks may differ; the exchange
#: needs one). float64 holds every float weight exactly, so the owner's lookup casts and
#: divides them as the unsharded collection does: fbgemm divides a mean bag's weights in
#: their dtype then rounds to float32 (float64 then float32 is the same rounding for float32
#: weights), torch's kernel casts them to the table's dtype first.
WEIGHTS_WIRE_DTYPE = torch.float64


@dataclass(frozen=True)
class IdsLayout:
    """Static description of the input dist (hashable constants, so it can sit in a graph).

    ``send_keys``: every key the collection reads, owner-major (rank 0's keys first).
    ``keys_per_rank``: how many of those keys each rank owns.
    ``local_keys``: this rank's keys, in the order its local lookup expects.
    """

    send_keys: tuple[str, ...]
    keys_per_rank: tuple[int, ...]
    local_keys: tuple[str, ...]
    group_name: str
    weighted: bool = False  # the collection pools with per-id weights: they travel
    # (feature, table rows, table name) of every key the collection reads: ids are checked
    # against them before anything is sent (the owner would refuse a bad one after the
    # exchange, with its peers already waiting for its pooled rows)
    rows: tuple[tuple[str, int, str], ...] = ()

    def features(self) -> list[str]:
        """The features the collection reads, by their own names (``send_keys`` name a
        row-wise feature's shards)."""
        return [f for f, _, _ in self.rows] if self.rows else list(self.send_keys)


@dataclass
class CountsHandle:
    """An id-count exchange in flight; keeps the ids (owner-major) for :func:`send_ids`
    (``kjt`` None: this rank takes part without a batch, see :func:`request_absent`)."""

    layout: IdsLayout
    kjt: KeyedJaggedTensor | None
    work: Any
    send: torch.Tensor  # must outlive the exchange
    recv: torch.Tensor
    ids_to: list[int]
    batch: int
    sent: IdsHandle | None = None  # the ids, once a pipeline started sending them early

    def drain(self) -> None:
        """Wait for whatever is in flight (so that its buffers can be released)."""
        with translated("an id exchange started for a batch that did not run"):
            self.work.wait()
            if self.sent is not None:
                for w in self.sent.works:
                    w.wait()
                if self.sent.weights_async:
                    torch.ops._c10d_functional.wait_tensor(self.sent.weights)


@dataclass
class IdsSplits:
    """Split sizes of the ids all-to-all, known once every rank's counts arrived."""

    layout: IdsLayout
    kjt: KeyedJaggedTensor | None
    ids_to: list[int]  # ids this rank sends to each owner
    ids_from: list[int]  # ids this rank receives from each source
    batch_sizes: list[int]  # rows each source rank sends (its local batch)
    batch: int
    sent: IdsHandle | None = None  # ids already in flight (see :class:`CountsHandle`)
    weights_grad: bool = False  # some rank's weights require grad: every rank tracks them


@dataclass
class IdsHandle:
    """An input dist in flight: buffers, the ``Work`` handles and every rank's batch size."""

    layout: IdsLayout
    works: list[Any]
    buffer: torch.Tensor  # every source's lengths, ids (and weights' bits), as received
    sizes: tuple[list[int], ...]  # per source: lengths, ids (, weights) in ``buffer``
    weights: torch.Tensor | None
    batch_sizes: list[int]  # rows each source rank sends (its local batch)
    local_batch: int
    weights_async: bool = False  # ``weights``: a functional all-to-all's, with autograd
    keep: tuple[torch.Tensor, ...] = ()  # send buffers, alive until the exchange is waited


def _pg(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def key_index(kjt: KeyedJaggedTensor, keys: Sequence[str]) -> dict[str, int]:
    """Position of each key of ``kjt``, after checking that it has one batch size and every
    key in ``keys`` (what a sharded collection reads)."""
    if kjt.variable_stride_per_key():
        raise ValueError(
            "ShardedEmbeddingBagCollection needs one batch size for every key; got a variable "
            f"batch per key {kjt.stride_per_key()}. Pad the batch to a common size."
        )
    index = {k: i for i, k in enumerate(kjt.keys())}
    missing = [k for k in keys if k not in index]
    if missing:
        raise ValueError(
            f"input is missing features {missing} of the sharded collection (got keys {kjt.keys()})"
        )
    return index


def _owner_major(kjt: KeyedJaggedTensor, layout: IdsLayout) -> KeyedJaggedTensor:
    index = key_index(kjt, layout.send_keys)
    return kjt.permute([index[k] for k in layout.send_keys])


def _counts_to(kjt: KeyedJaggedTensor, layout: IdsLayout) -> list[int]:
    """How many ids this rank sends to each owner (``kjt`` is owner-major)."""
    lpk = kjt.length_per_key()
    ids_to: list[int] = []
    start = 0
    for n in layout.keys_per_rank:
        ids_to.append(sum(lpk[start : start + n]))
        start += n
    return ids_to


# Exchanges a train pipeline started ahead of the forward that needs them: (id(kjt), layout)
# -> (kjt, handle), one per collection reading that KJT; and, while a pipeline probes its
# first batch, the requests the forward makes.
_EARLY: dict[tuple[int, IdsLayout], tuple[KeyedJaggedTensor, CountsHandle]] = {}
_WATCHED: list[list[tuple[KeyedJaggedTensor, IdsLayout]]] = []


def started_early(kjt: KeyedJaggedTensor, handle: CountsHandle) -> None:
    """``handle`` is the exchange of ``kjt``, started ahead of its forward: that forward's
    :func:`request_counts` of the same object and layout takes it over."""
    _EARLY[(id(kjt), handle.layout)] = (kjt, handle)


def forget_early(kjt: KeyedJaggedTensor, layout: IdsLayout) -> None:
    """Drop the exchange :func:`started_early` registered for ``kjt`` and ``layout``, if any."""
    entry = _EARLY.get((id(kjt), layout))
    if entry is not None and entry[0] is kjt:
        del _EARLY[(id(kjt), layout)]


@contextlib.contextmanager
def watch_requests() -> Iterator[list[tuple[KeyedJaggedTensor, IdsLayout]]]:
    """The (features, layout) of every :func:`request_counts` made inside the block (how a
    pipeline learns whether a captured graph hands the batch's KJT to the exchange as is)."""
    seen: list[tuple[KeyedJaggedTensor, IdsLayout]] = []
    _WATCHED.append(seen)
    try:
        yield seen
    finally:
        _WATCHED.remove(seen)


@torch.compiler.disable  # dynamo would guard on the id of every batch's KJT
def _take_early(kjt: KeyedJaggedTensor, layout: IdsLayout) -> CountsHandle | None:
    entry = _EARLY.get((id(kjt), layout))
    if entry is None or entry[0] is not kjt:
        return None
    del _EARLY[(id(kjt), layout)]
    return entry[1]


@torch.fx.wrap
def request_counts(kjt: KeyedJaggedTensor, layout: IdsLayout, rows: Any = None) -> CountsHandle:
    """Start telling every owner how many ids and rows it will get (returns at once).

    Asynchronous so that the overlap pass can run compute while the counts travel; the
    split sizes of the ids all-to-all are only known after :func:`wait_counts`. ``rows``:
    the :class:`~fxrec.distributed.row_wise.RowShards` that route row-wise features' ids to
    their row blocks first. An exchange started early for ``kjt`` is taken over.
    """
    for seen in _WATCHED:
        seen.append((kjt, layout))
    early = _take_early(kjt, layout)
    if early is not None:
        return early
    try:
        grad = _check_input(kjt, layout)
    except ValueError as exc:
        announce_refusal(exc, layout)
        raise
    if rows is not None:
        kjt = rows.route(kjt)
    pg = _pg(layout.group_name)
    kjt = _owner_major(kjt, layout)
    batch = kjt.stride()
    ids_to = _counts_to(kjt, layout)
    send = torch.tensor([[c, batch, grad] for c in ids_to], dtype=torch.int64).flatten()
    recv = torch.empty_like(send)
    try:
        work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(f"rank {pg.rank()}: could not start the id-count exchange: {exc}") from exc
    return CountsHandle(layout, kjt, work, send, recv, ids_to, batch)


@torch.compiler.disable  # run, not traced: dynamo switches validation off while it traces
def _check_input(kjt: KeyedJaggedTensor, layout: IdsLayout) -> int:
    """Refuse, before any exchange, an input the collection cannot take (features it reads
    missing, a variable batch per key) or the unsharded collection refuses (non-integer ids,
    ids outside their tables, a weighted collection's input without weights); 1 if this
    rank's weights need a grad.

    Ids go on the wire as int64: a float id would be silently truncated there. Under dynamo
    (a model ``fxrec.optimize`` captures with it) the check still runs: an id refused only
    by its owner's lookup would fail that rank mid-exchange, and its peers would wait for
    the group's timeout instead of hearing at once that this rank has no batch.
    """
    key_index(kjt, layout.features())
    values, weights = kjt.values(), kjt.weights_or_none()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(
            f"ids of features {kjt.keys()[:5]} have dtype {values.dtype}; embedding ids are "
            "row numbers: pass integer ids (.long()), and per-id floats as weights."
        )
    if layout.rows and validation_enabled():
        _check_id_ranges(kjt, layout.rows)
    if not layout.weighted:
        return 0  # an unweighted collection ignores weights, as the unsharded one does
    if weights is None:
        raise ValueError(
            "this collection is weighted (is_weighted=True) but the input has no weights; "
            "pass per-id weights (KeyedJaggedTensor(..., weights=...))."
        )
    if not weights.is_floating_point():
        raise ValueError(
            f"weights of features {kjt.keys()[:5]} have dtype {weights.dtype}; per-sample "
            "weights must be floating point (.float())."
        )
    return int(torch.is_grad_enabled() and weights.requires_grad)


def _check_id_ranges(kjt: KeyedJaggedTensor, rows: tuple[tuple[str, int, str], ...]) -> None:
    """Every id of a key the collection reads inside its table (one pass over the ids)."""
    from fxrec.nn.checks import check_id_ranges
    from fxrec.nn.layout import Member

    tables = {f: (n, t) for f, n, t in rows}
    keys = kjt.keys()
    members = []
    for k in keys:  # keys the collection does not read take any id: it ignores them
        n, table = tables.get(k, (2**62, ""))
        members.append(Member(k, k, 0, table, 0, 0, n, 0))
    check_id_ranges(kjt.values(), members, kjt.length_per_key())


ABSENT = -1  # the batch size a rank announces when its batch for this exchange failed
ENDED = -2  # ... and when its data ended


def request_absent(layout: IdsLayout, ended: bool = False) -> CountsHandle:
    """Take part in an id-count exchange without a batch (returns at once).

    A rank whose next batch failed to load, or whose data ended, still has to meet the other
    ranks' exchange; announcing :data:`ABSENT` (or :data:`ENDED`) tells them to skip the
    batch (see :func:`absent_ranks`) instead of sending ids no one will look up.
    """
    pg = _pg(layout.group_name)
    code = ENDED if ended else ABSENT
    send = torch.tensor([[0, code, 0]] * pg.size(), dtype=torch.int64).flatten()
    recv = torch.empty_like(send)
    try:
        work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(f"rank {pg.rank()}: could not start the id-count exchange: {exc}") from exc
    return CountsHandle(layout, None, work, send, recv, [0] * pg.size(), code)


def announce_refusal(exc: BaseException, layout: IdsLayout) -> None:
    """This rank refused its input (``exc``) before the exchange the other ranks are in:
    announce no batch, so that they skip it at once (``MissingBatch``) instead of waiting
    for ids until the group's timeout. The handle goes with the error
    (``exc.fxrec_absent``), for a train pipeline that keeps it as its exchange."""
    if getattr(exc, "fxrec_absent", None) is None:
        exc.fxrec_absent = request_absent(layout)  # type: ignore[attr-defined]


def absent_ranks(splits: IdsSplits) -> list[int]:
    """The ranks that announced no batch in this exchange (:func:`request_absent`)."""
    return [r for r, b in enumerate(splits.batch_sizes) if b in (ABSENT, ENDED)]


@torch.fx.wrap
def wait_counts(handle: CountsHandle) -> IdsSplits:
    """Wait for every rank's counts: the split sizes of the ids all-to-all."""
    with blocked("ids_counts", "exchange of id counts (input all-to-all)"):
        handle.work.wait()
    recv = handle.recv.view(-1, 3).tolist()
    return IdsSplits(
        handle.layout,
        handle.kjt,
        handle.ids_to,
        [c for c, _, _ in recv],
        [b for _, b, _ in recv],
        handle.batch,
        handle.sent,
        any(g for _, _, g in recv),
    )


def why_absent(ended: bool) -> str:
    """Why ranks have no batch for an exchange, in a peer's words: it cannot tell a loader
    that failed from a batch its own rank refused before sending anything."""
    if ended:
        return "their data loader ended"
    return (
        "their data loader failed, or their batch was refused before the exchange, e.g. "
        "for an id outside its table: see those ranks' errors"
    )


@torch.fx.wrap
def send_ids(splits: IdsSplits) -> IdsHandle:
    """Start sending every key's ids to the rank that owns its table (returns at once)."""
    if splits.sent is not None:
        return splits.sent
    layout, kjt = splits.layout, splits.kjt
    pg = _pg(layout.group_name)
    me = pg.rank()
    absent = absent_ranks(splits)
    if absent or kjt is None:
        ended = any(b == ENDED for b in splits.batch_sizes)
        raise MissingBatch(
            f"rank {me}: rank(s) {absent or [me]} have no batch for this exchange "
            f"({why_absent(ended)}); no ids are sent, so every rank skips this batch.",
            absent or [me],
            ended,
        )
    ids_from, ids_to = splits.ids_from, splits.ids_to
    len_to = [n * splits.batch for n in layout.keys_per_rank]
    len_from = [layout.keys_per_rank[me] * b for b in splits.batch_sizes]

    # One wire dtype: ranks may hold int32 ids and int64 lengths, or the other way round.
    values_in = kjt.values().to(torch.int64)
    lengths_in = kjt.lengths().to(torch.int64)
    weights_in = kjt.weights().to(WEIGHTS_WIRE_DTYPE) if layout.weighted else None
    packed = [lengths_in, values_in]
    if weights_in is not None and not splits.weights_grad:
        packed.append(weights_in.view(torch.int64))  # the bits, unchanged
    send, send_sizes = _pack(packed, [len_to, ids_to, ids_to])
    recv_sizes = [sum(parts) for parts in zip(len_from, *[ids_from] * (len(packed) - 1))]
    buffer = send.new_empty(sum(recv_sizes))
    weights = None
    try:
        works = [
            dist.all_to_all_single(buffer, send, recv_sizes, send_sizes, group=pg, async_op=True)
        ]
        if weights_in is not None and splits.weights_grad:
            weights = _send_weights(weights_in, ids_from, ids_to, layout.group_name)
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(f"rank {me}: could not start the ids all-to-all: {exc}") from exc
    return IdsHandle(
        layout,
        works,
        buffer,
        (len_from, ids_from, ids_from)[: len(packed)],
        weights,
        splits.batch_sizes,
        splits.batch,
        weights_async=weights is not None,
        keep=(send,),
    )


@torch.compiler.disable  # host-side sizes from the counts: dynamo would guard on each
def _pack(tensors: list[torch.Tensor], sizes: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """One send buffer for several all-to-alls of one dtype: every destination's pieces of
    each tensor, side by side (one exchange, so one round trip rather than one each)."""
    sizes = sizes[: len(tensors)]
    pieces = [t.split(s) for t, s in zip(tensors, sizes)]
    per_rank = [piece for dest in zip(*pieces) for piece in dest]
    return torch.cat(per_rank), [sum(parts) for parts in zip(*sizes)]


@torch.compiler.disable
def _unpack(buffer: torch.Tensor, sizes: tuple[list[int], ...]) -> list[torch.Tensor]:
    """The tensors :func:`_pack` sent, as received: each source's pieces, joined."""
    flat = [n for source in zip(*sizes) for n in source]
    pieces = buffer.split(flat)
    k = len(sizes)
    return [torch.cat(pieces[i::k]) for i in range(k)]


def _send_weights(
    weights: torch.Tensor, ids_from: list[int], ids_to: list[int], group: str
) -> torch.Tensor:
    """Weights by the differentiable all-to-all (wait with ``wait_tensor``): its backward
    sends each weight's gradient back to the rank it came from.

    Every rank must run that backward once any does (some rank's weights require grad),
    so weights that need none here still join the graph, as a leaf of their own.
    """
    with torch.enable_grad():  # a pipeline may send the ids outside the forward
        if not weights.requires_grad:
            weights = weights.detach().requires_grad_()
        return _exchange(
            weights.contiguous(), ids_from, ids_to, group, "per-id weight gradient all-to-all"
        )


@torch.fx.wrap
def request_ids(kjt: KeyedJaggedTensor, layout: IdsLayout) -> IdsHandle:
    """Counts then ids in one call, for eager callers (blocks on the counts exchange).

    Traced models use :func:`request_counts`, :func:`wait_counts` and :func:`send_ids` as
    separate nodes instead, so that compute can also hide the counts exchange.
    """
    return send_ids(wait_counts(request_counts(kjt, layout)))


@torch.fx.wrap
def wait_ids(handle: IdsHandle) -> KeyedJaggedTensor:
    """Wait for the ids; return one KJT of this rank's keys over every rank's batch.

    Rows are source-rank-major within each key (rank 0's batch, then rank 1's ...), which is
    the row order the pooled output is sent back in.
    """
    weights = handle.weights
    with blocked("ids_wait", "ids all-to-all"):
        for w in handle.works:
            w.wait()
        if handle.weights_async:
            weights = torch.ops._c10d_functional.wait_tensor(weights)
    lengths, values, *bits = _unpack(handle.buffer, handle.sizes)
    if bits:
        weights = bits[0].view(WEIGHTS_WIRE_DTYPE)
    keys = list(handle.layout.local_keys)
    nk = len(keys)
    world = len(handle.batch_sizes)
    total = sum(handle.batch_sizes)
    if nk == 0:
        return KeyedJaggedTensor([], values, weights, lengths=lengths, stride=total)
    # Received blocks are (source rank, key); the lookup wants key-major over all rows.
    staged = KeyedJaggedTensor(
        [f"{r}/{k}" for r in range(world) for k in keys],
        values,
        weights,
        lengths=lengths,
        stride_per_key=[b for b in handle.batch_sizes for _ in range(nk)],
    )
    order = [r * nk + k for k in range(nk) for r in range(world)]
    perm = staged.permute(order)
    return KeyedJaggedTensor(
        keys, perm.values(), perm.weights_or_none(), lengths=perm.lengths(), stride=total
    )


@torch.fx.wrap
def request_pooled(
    pooled: torch.Tensor, handle: IdsHandle, dims_per_rank: tuple[int, ...]
) -> torch.Tensor:
    """Start sending each source rank its rows of this rank's pooled embeddings.

    ``pooled`` is ``[sum of batches, local dims]``, rows source-rank-major. Returns the
    receive buffer (not ready until :func:`wait_pooled`).
    """
    me = _pg(handle.layout.group_name).rank()
    local_dim = dims_per_rank[me]
    in_splits = [b * local_dim for b in handle.batch_sizes]
    out_splits = [handle.local_batch * d for d in dims_per_rank]
    flat = pooled.contiguous().view(-1)
    if torch.is_grad_enabled() and not flat.requires_grad:
        # Every rank must run the reverse all-to-all in backward, including one that owns no
        # table (or only frozen ones): otherwise the others wait for it forever. The same
        # holds for the weights' exchange, which no lookup of such a rank reads: tied here.
        if handle.weights_async and handle.weights is not None:
            flat = _Tied.apply(flat, handle.weights)
        else:
            flat = flat.detach().requires_grad_()
    try:
        return _exchange(
            flat,
            out_splits,
            in_splits,
            handle.layout.group_name,
            "pooled-embedding gradient all-to-all",
        )
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(f"rank {me}: could not start the pooled all-to-all: {exc}") from exc


def _exchange(
    flat: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str, what: str
) -> torch.Tensor:
    """The functional all-to-all; run eagerly, its backward raises :class:`CommError`
    naming ``what`` (the pooled embeddings' or the weights' gradient exchange).

    Under ``torch.compile`` the op itself is kept: the graph shows the collective (for the
    overlap rule) and the compiled backward is the op's own autograd formula.
    """
    if is_compiling():
        return torch.ops._c10d_functional.all_to_all_single(flat, out_splits, in_splits, group)
    return _AllToAll.apply(flat, out_splits, in_splits, group, what)


class _AllToAll(torch.autograd.Function):
    """A functional all-to-all whose backward (the reverse all-to-all) raises CommError.

    The op's registered backward waits outside fxrec: a peer that stalls in backward would
    surface as the backend's bare RuntimeError, with no operation or timeout named.
    """

    @staticmethod
    def forward(
        ctx: Any,
        flat: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: str,
        what: str,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits, group, what)
        return torch.ops._c10d_functional.all_to_all_single(flat, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits, group, what = ctx.splits
        with translated(f"{what} (backward)"):
            sent = torch.ops._c10d_functional.all_to_all_single(
                grad.contiguous(), in_splits, out_splits, group
            )
            return torch.ops._c10d_functional.wait_tensor(sent), None, None, None, None


class _Tied(torch.autograd.Function):
    """``flat`` unchanged, with a zero gradient for ``other``: makes backward reach
    ``other``'s exchange on a rank whose output does not depend on it."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.like = (other.shape, other.dtype, other.device)
        return flat.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


@torch.fx.wrap
def wait_pooled(received: torch.Tensor) -> torch.Tensor:
    """Wait for the pooled embeddings (gradient: identity; the request's autograd reverses)."""
    with blocked("pooled_wait", "pooled-embedding all-to-all"):
        return torch.ops._c10d_functional.wait_tensor(received)


@torch.fx.wrap
def assemble_pooled(
    received: torch.Tensor,
    handle: IdsHandle,
    dims_per_rank: tuple[int, ...],
    columns: tuple[tuple[int, int, int], ...],
    keys: tuple[str, ...],
    dims: tuple[int, ...],
) -> KeyedTensor:
    """Owner blocks -> the unsharded collection's ``[B, sum dims]`` in its key order.

    ``columns[i] = (owner, start, width)``: key ``i``'s columns inside its owner's block.
    The blocks are laid side by side (one ``cat``) and their columns put in key order by one
    ``index_select``. A ``cat`` of one narrow slice per key would cost, in backward, a
    zero-filled block-sized gradient per key: quadratic in the number of keys (100 keys at
    batch 1024 spent most of a training step there).
    """
    b = handle.local_batch
    if not columns:
        return KeyedTensor(list(keys), list(dims), received.new_zeros(b, 0))
    blocks = list(torch.split(received, [b * d for d in dims_per_rank]))
    blocks = [blk.view(b, d) for blk, d in zip(blocks, dims_per_rank)]
    wide = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
    order = _column_order(columns, dims_per_rank)
    if order is None:
        values = wide
    else:
        unit, index = order
        units = wide.view(b, wide.shape[1] // unit, unit)
        # Explicit width: a rank whose local batch is 0 has nothing to infer -1 from.
        values = units.index_select(1, index.to(wide.device)).view(b, index.numel() * unit)
    return KeyedTensor(list(keys), list(dims), values)


def _column_order(
    columns: tuple[tuple[int, int, int], ...], dims_per_rank: tuple[int, ...]
) -> tuple[int, torch.Tensor] | None:
    """Keys' columns of the side-by-side owner blocks, in key order; None if already so.

    Returned as ``(unit, index)``: the columns cut in runs of ``unit`` (the gcd of every
    key's width and position), and the runs to take, in order. Gathering runs of a
    key's embedding dim instead of single columns is several times faster both ways.
    """
    base = [0]
    for d in dims_per_rank:
        base.append(base[-1] + d)
    spans = [(base[owner] + start, width) for owner, start, width in columns]
    pos = 0
    for first, width in spans:
        if first != pos:
            break
        pos += width
    else:
        if pos == base[-1]:
            return None
    unit = math.gcd(base[-1], *(v for span in spans for v in span))
    index = [i for first, width in spans for i in range(first // unit, (first + width) // unit)]
    return unit, torch.tensor(index, dtype=torch.long)


for _fn, _kind in (
    (request_counts, "request"),
    (wait_counts, "wait"),
    (send_ids, "request"),
    (request_ids, "request"),
    (wait_ids, "wait"),
    (request_pooled, "request"),
    (wait_pooled, "wait"),
):
    _fn._fxrec_comm = _kind  # type: ignore[attr-defined]


def columns_of(
    keys: Sequence[str], dims: Sequence[int], local_keys_per_rank: Sequence[Sequence[str]]
) -> tuple[tuple[int, int, int], ...]:
    """Where each key's pooled columns sit among the owner blocks (see :func:`assemble_pooled`)."""
    dim_of = dict(zip(keys, dims))
    where: dict[str, tuple[int, int, int]] = {}
    for owner, lk in enumerate(local_keys_per_rank):
        start = 0
        for k in lk:
            where[k] = (owner, start, dim_of[k])
            start += dim_of[k]
    return tuple(where[k] for k in keys)
