"""Optional fbgemm table-batched lookups (``fbgemm_gpu``'s dense TBE op), guarded.

Measured on this project's 2-core CPU (training step, forward + backward + SGD, one
thread, interleaved medians; ``python -m fxrec.bench.embedding``), against TorchRec's
collection: 26 tables x 1 id x dim 16, 1,000 rows each: fbgemm 2.4-3.1x, torch's
``F.embedding_bag`` on the same grouped weight 1.4-1.5x; 100 tables x ~20 ids x dim 64: 1.8-2.0x
against 1.1-1.2x. The gain is mostly in the backward (torch's CPU dense embedding-bag backward
sorts the ids). So the collection uses fbgemm where it is installed and the group
qualifies; everything else falls back to pure torch, with the same results:

* only sum and mean pooling (fbgemm has no max);
* weighted mean is run as a weighted sum with the weights divided by the bag size:
  fbgemm-gpu-cpu 1.8.0's own weighted MEAN backward returns the weighted-SUM gradient (the
  ``1 / L`` factor of its forward is missing), so its MEAN mode is used unweighted only;
* dense gradients only (``sparse=True`` uses torch's sparse embedding-bag gradient);
* under dynamo, through ``torch.ops.fxrec.tbe_lookup`` (:func:`lookup`): fbgemm's op has no
  fake kernel on CPU, so dynamo's graph holds this one opaque node instead. Run eagerly (the
  backend ``"eager"``, ``fxrec.optimize``'s default) it is fbgemm's op, autograd included;
  traced further (AOTAutograd: ``"aot_eager"``, Inductor) it decomposes into torch's
  ``embedding_bag``. ``torch.ops.fxrec.check_ids`` puts the collection's eager id check
  there, before the lookups, and a device assert in traced graphs (:func:`check_ids`);
* not under ``torch.export`` or symbolic tracing: an exported program keeps torch's ops;
* only on devices where the op has a kernel.

The op's CPU kernel refuses an id outside its own table (:func:`pooled_lookup` names the
member in an ``IndexError``); on other devices :func:`check_on_device` asserts first.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import warnings
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from fxrec.compiling import is_compiling
from fxrec.nn.checks import assert_id_ranges, check_id_ranges
from fxrec.nn.functional import embedding_bag_grouped, out_of_range_error, shift_ids
from fxrec.nn.layout import Member
from fxrec.sparse.validation import read_ints, segment_sums, validation_enabled

logger = logging.getLogger(__name__)

__all__ = [
    "fbgemm_installed",
    "load_fbgemm",
    "has_kernel",
    "FbgemmGroupMeta",
    "lookup",
    "check_ids",
    "pooled_lookup",
    "check_on_device",
    "out_of_range",
]

_OP = "fbgemm::dense_embedding_codegen_lookup_function"
_POOLING = {"sum": 0, "mean": 1}


def fbgemm_installed() -> bool:
    """Whether ``fbgemm_gpu`` can be imported (cheap: does not import it)."""
    return importlib.util.find_spec("fbgemm_gpu") is not None


@functools.lru_cache(maxsize=1)
def load_fbgemm() -> bool:
    """Import fbgemm_gpu once (registers its ops); False if the import fails."""
    if not fbgemm_installed():
        return False
    try:
        importlib.import_module("fbgemm_gpu")
    except Exception as exc:  # a broken install must not break the collection
        logger.warning("fbgemm_gpu is installed but failed to import (%s); using torch.", exc)
        return False
    # The op's CPU kernel records its own autograd graph, so torch's "no autograd kernel"
    # fallback warns on every first backward; the gradients are right (the tests compare
    # them with torch's own embedding_bag), so this one message is silenced.
    warnings.filterwarnings(
        "ignore",
        message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel",
        category=UserWarning,
    )
    return hasattr(torch.ops.fbgemm, "dense_embedding_codegen_lookup_function")


@functools.lru_cache(maxsize=8)
def has_kernel(device_type: str) -> bool:
    """Whether the dense TBE op runs on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    if not load_fbgemm():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(_OP, key)


class FbgemmGroupMeta:
    """The op's static per-feature description of one group (tensors built once per device)."""

    def __init__(
        self,
        row_offsets: Sequence[int],
        dim: int,
        num_rows: int,
        member_rows: Sequence[int],
        names: Sequence[str] = (),
    ) -> None:
        self.dim = dim
        self.num_members = len(row_offsets)
        self.total_dim = dim * self.num_members
        self.total_hash_size_bits = int(math.log2(float(num_rows)) + 1) if num_rows else 0
        self.row_offsets = list(row_offsets)
        self.num_rows = num_rows
        self.member_rows = list(member_rows)
        self.names = tuple(names)  # each member's name, for the error of an id out of range
        self._tensors: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._rows: dict[torch.device, torch.Tensor | None] = {}

    def rows(self, device: torch.device) -> torch.Tensor | None:
        """Each member's table rows where tables are shared (see :func:`pooled_lookup`)."""
        if device not in self._rows:
            shared = not _distinct_tables(self.row_offsets, self.num_rows, self.member_rows)
            with torch.inference_mode(False):
                self._rows[device] = (
                    torch.tensor(self.member_rows, dtype=torch.long, device=device)
                    if shared
                    else None
                )
        return self._rows[device]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self._tensors.get(device)
        if t is None:
            d = self.dim
            with torch.inference_mode(False):  # kept for training calls too
                t = (
                    torch.tensor(
                        [r * d for r in self.row_offsets], dtype=torch.long, device=device
                    ),
                    torch.arange(
                        0, (self.num_members + 1) * d, d, dtype=torch.int32, device=device
                    ),
                    torch.tensor(
                        [*self.row_offsets, self.num_rows], dtype=torch.long, device=device
                    ),
                )
            self._tensors[device] = t
        return t


def lookup(
    weight: torch.Tensor,
    meta: FbgemmGroupMeta,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    checked: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, members * dim]`` pooled outputs (member-major columns) from unshifted ids.

    ``ids`` are each member's own row numbers (the op adds the row offsets itself);
    ``offsets`` delimit the ``members * B`` bags, member-major, last offset included.
    Under dynamo the lookup is one ``torch.ops.fxrec.tbe_lookup`` node holding the group's
    description, which reads ``checked`` (the token of :func:`check_ids`): the check runs
    first.
    """
    if is_compiling():
        return torch.ops.fxrec.tbe_lookup(
            weight,
            ids,
            offsets,
            per_sample_weights,
            checked,
            meta.row_offsets,
            meta.member_rows,
            meta.num_rows,
            mode,
            list(meta.names),
        )
    weights_offsets, d_offsets, hash_size_cumsum = meta.tensors(weight.device)
    return pooled_lookup(
        weight,
        weights_offsets,
        d_offsets,
        hash_size_cumsum,
        ids,
        offsets,
        meta.total_dim,
        meta.dim,
        meta.total_hash_size_bits,
        mode,
        per_sample_weights,
        names=meta.names,
        check_ids=False,  # the collection checks every id before any lookup
        rows=meta.rows(weight.device),
    )


def _distinct_tables(starts: Sequence[int], num_rows: int, rows: Sequence[int]) -> bool:
    """Does each member read a table of its own, in order (so that ``hash_size_cumsum``,
    the starts then ``num_rows``, gives each member's rows by differences)?"""
    ends = [*starts[1:], num_rows]
    return all(e - s == r for s, e, r in zip(starts, ends, rows))


def pooled_lookup(
    weight: torch.Tensor,
    weights_offsets: torch.Tensor,
    d_offsets: torch.Tensor,
    hash_size_cumsum: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    total_dim: int,
    dim: int,
    hash_bits: int,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
    names: Sequence[str] = (),
    check_ids: bool = True,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`lookup` with the group's description as tensors and ints.

    This is the form a graph node calls (graph modules hold tensors and constants, not
    :class:`FbgemmGroupMeta`); ``weights_offsets`` is each member's first element in the
    flattened ``weight``, ``hash_size_cumsum`` each member's first row then the total rows.
    ``names`` name the members in the error of an id outside its table; ``check_ids=False``
    skips the id checks for callers that validated the ids already.

    ``rows``: each member's table rows, given where members share a table (a table looked up
    twice, a table read by several features). Their ``hash_size_cumsum`` entries repeat, so
    the op's own bounds check sees tables of 0 or negative rows and lets ids outside a table
    read another table's rows: such groups are checked here, before the lookup.
    """
    pooling = _POOLING[mode]
    if per_sample_weights is not None and mode == "mean":
        lengths = offsets[1:] - offsets[:-1]
        sizes = torch.repeat_interleave(lengths, lengths, output_size=ids.numel())
        # in float32, which the op takes: dividing in float16/bfloat16 first would round twice
        per_sample_weights = per_sample_weights.float() / sizes.float()
        pooling = _POOLING["sum"]
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    if offsets.dtype != ids.dtype:
        offsets = offsets.to(ids.dtype)
    if check_ids and validation_enabled():
        if ids.device.type != "cpu":
            check_on_device(_member_rows(hash_size_cumsum, rows), ids, offsets, names)
        elif rows is not None:  # the op's own check does not see shared tables
            err = out_of_range(rows, ids, offsets, names)
            if err is not None:
                raise err
    try:
        return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=weight.view(-1),
            weights_offsets=weights_offsets,
            D_offsets=d_offsets,
            total_D=total_dim,
            max_D=dim,
            hash_size_cumsum=hash_size_cumsum,
            total_hash_size_bits=hash_bits,
            indices=ids,
            offsets=offsets,
            pooling_mode=pooling,
            indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
            feature_requires_grad=None,
            output_dtype=0,
        )
    except RuntimeError as exc:
        err = out_of_range(_member_rows(hash_size_cumsum, rows), ids, offsets, names)
        if err is None:
            raise
        raise err from exc


def check_on_device(
    rows: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    names: Sequence[str] = (),
) -> None:
    """Assert on the device, without a sync, that every id lies in its own table (``rows``:
    each member's table rows).

    Not fbgemm's ``bounds_check_indices``: it lets ``-1`` through (its mark of a pruned row),
    which the separate lookup refuses.
    """
    member = _tables_of_ids(rows, ids, offsets)
    ok = torch.logical_and(ids >= 0, ids < rows[member]).all()
    listed = ", ".join(names) or f"{rows.numel()} tables"
    torch._assert_async(ok, f"embedding id out of range in a table-batched lookup of {listed}")


def out_of_range(
    rows: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    names: Sequence[str],
) -> IndexError | None:
    """The error naming the first id outside its own table (``rows``: each member's table
    rows), or None if there is none."""
    member = _tables_of_ids(rows, ids, offsets)
    bad = torch.nonzero((ids < 0) | (ids >= rows[member]))
    if bad.numel() == 0:
        return None
    pos = int(bad[0, 0])
    m = int(member[pos])
    name = names[m] if m < len(names) else f"member {m} of a table-batched lookup"
    return out_of_range_error(name, int(ids[pos]), int(rows[m]))


def _member_rows(hash_size_cumsum: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Each member's table rows: ``rows`` where given, else (members reading distinct tables
    in order) the differences of ``hash_size_cumsum``."""
    return hash_size_cumsum[1:] - hash_size_cumsum[:-1] if rows is None else rows


def _tables_of_ids(rows: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each id's member: bags are ``(member, row)``-major, ``B`` per member."""
    bags = offsets.numel() - 1
    per_bag = torch.arange(bags, device=ids.device) // max(bags // max(rows.numel(), 1), 1)
    lengths = (offsets[1:] - offsets[:-1]).long()
    return torch.repeat_interleave(per_bag, lengths, output_size=ids.numel())


# ---- the lookup and the collection's id check as nodes of dynamo's graphs ------------------
#
# Both are CompositeImplicitAutograd: dynamo records each as one node and never looks inside;
# a graph run eagerly calls them on real tensors (fbgemm's op, its own autograd; the host
# check raising the collection's error), while AOTAutograd and export trace through them on
# fake tensors, where they are torch ops (fbgemm's CPU op has no fake kernel).

torch.library.define(
    "fxrec::tbe_lookup",
    "(Tensor weight, Tensor ids, Tensor offsets, Tensor? per_sample_weights, Tensor? checked, "
    "int[] row_offsets, int[] member_rows, int num_rows, str mode, str[] names) -> Tensor",
)
torch.library.define(
    "fxrec::check_ids",
    "(Tensor values, Tensor lengths, SymInt[] stride_per_key, SymInt[]? counts, "
    "int[] rows, str[] features, str[] tables) -> Tensor",
)


def _traced(*tensors: torch.Tensor | None) -> bool:
    """Are these tensors being traced (fake or functional tensors, a recording proxy mode)
    rather than computed?"""
    if get_proxy_mode() is not None:
        return True
    return any(t is not None and (is_fake(t) or torch._is_functional_tensor(t)) for t in tensors)


@torch.library.impl("fxrec::tbe_lookup", "CompositeImplicitAutograd")
def _tbe_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    checked: torch.Tensor | None,
    row_offsets: Sequence[int],
    member_rows: Sequence[int],
    num_rows: int,
    mode: str,
    names: Sequence[str],
) -> torch.Tensor:
    if _traced(weight, ids, offsets, per_sample_weights):
        return _lookup_in_torch(weight, row_offsets, ids, offsets, mode, per_sample_weights)
    meta = _group_meta(
        tuple(row_offsets), weight.shape[1], num_rows, tuple(member_rows), tuple(names)
    )
    return lookup(weight, meta, ids, offsets, mode, per_sample_weights)


@functools.lru_cache(maxsize=256)
def _group_meta(
    row_offsets: tuple[int, ...],
    dim: int,
    num_rows: int,
    member_rows: tuple[int, ...],
    names: tuple[str, ...],
) -> FbgemmGroupMeta:
    """One description (and its tensors) per group a graph looks up."""
    return FbgemmGroupMeta(row_offsets, dim, num_rows, member_rows, names)


def _lookup_in_torch(
    weight: torch.Tensor,
    row_offsets: Sequence[int],
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    """What fbgemm's lookup computes, in torch ops: ids shifted by their member's first row
    (members of one table need no shift), one ``embedding_bag``, its ``[members * B, dim]``
    rows laid out ``[B, members * dim]``."""
    members, dim = len(row_offsets), weight.shape[1]
    bags = offsets.numel() - 1
    batch = bags // members
    ids, offsets = ids.long(), offsets.long()
    if batch and any(r != 0 for r in row_offsets):  # each member's ids: between its bags' ends
        starts = torch.tensor(list(row_offsets), dtype=torch.long, device=ids.device)
        ids = shift_ids(ids, starts, offsets[::batch].diff())
    pooled = embedding_bag_grouped(
        weight, ids, offsets, mode, per_sample_weights, include_last_offset=True
    )
    return pooled.view(members, batch, dim).transpose(0, 1).reshape(batch, members * dim)


def check_ids(
    values: torch.Tensor,
    lengths: torch.Tensor,
    stride_per_key: Sequence[int],
    counts: Sequence[int] | None,
    members: Sequence[Member],
) -> torch.Tensor:
    """The collection's id check as one node of a dynamo graph; a token for the lookups.

    Run eagerly it is the check outside dynamo (``check_id_ranges``, on while validation
    is); traced further, a device assert (``assert_id_ranges``), which is always on.
    """
    return torch.ops.fxrec.check_ids(
        values,
        lengths,
        list(stride_per_key),
        None if counts is None else list(counts),
        [m.num_embeddings for m in members],
        [m.feature for m in members],
        [m.table_name for m in members],
    )


@torch.library.impl("fxrec::check_ids", "CompositeImplicitAutograd")
def _check_ids(
    values: torch.Tensor,
    lengths: torch.Tensor,
    stride_per_key: Sequence[int],
    counts: Sequence[int] | None,
    rows: Sequence[int],
    features: Sequence[str],
    tables: Sequence[str],
) -> torch.Tensor:
    members = _checked_members(tuple(rows), tuple(features), tuple(tables))
    if _traced(values, lengths):
        assert_id_ranges(values, lengths, stride_per_key, members)
    elif validation_enabled():
        if counts is None:
            counts = read_ints(segment_sums(lengths, stride_per_key))
        check_id_ranges(values, members, counts)
    return torch.empty(0, dtype=values.dtype, device=values.device)


@functools.lru_cache(maxsize=64)
def _checked_members(
    rows: tuple[int, ...], features: tuple[str, ...], tables: tuple[str, ...]
) -> tuple[Member, ...]:
    """The members as the checks read them (feature, table name, rows)."""
    return tuple(
        Member(
            key=f,
            feature=f,
            table=-1,
            table_name=t,
            group=-1,
            row_offset=0,
            num_embeddings=r,
            dim=0,
        )
        for r, f, t in zip(rows, features, tables)
    )
