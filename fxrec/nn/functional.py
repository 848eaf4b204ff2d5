"""Grouped embedding-bag lookups: many tables' bags pooled by ONE ``embedding_bag`` call.

The tables of a group are laid out one after another in one weight (table ``t`` owns rows
``[row_offset[t], row_offset[t] + num_embeddings[t])``); each id is shifted by its table's
row offset, and one offsets tensor delimits every bag of every table. One call then replaces
one call per table: the saving is launches and per-call overhead, which dominate when bags
are small (26 tables x batch 256 x 1 id: ~2x on a training step).

Pooling definitions (for every ``mode``, an empty bag pools to zeros):

* ``"sum"``: ``sum_i w_i * e_i`` (``w_i = 1`` when unweighted);
* ``"mean"``: ``(1 / L) * sum_i w_i * e_i`` with ``L`` the bag's id count. With weights this
  is the weighted sum divided by the bag size, the definition fbgemm's table-batched kernels
  use in their forward (TorchRec's unsharded collection refuses weighted mean). It is linear in the weights, reduces to the plain mean for unit weights, and never divides
  by a sum of weights that can be zero. (``sum(w * e) / sum(w)`` would be the other choice.)
* ``"max"``: elementwise max over the bag; per-sample weights are undefined and refused.

Two entry points:

* :func:`embedding_bag_grouped` for inputs already in one flat layout (what the
  collection uses);
* :func:`grouped_embedding_bag` for N separate lookups shaped like ``nn.EmbeddingBag`` calls
  (2-D ``[B, L]`` ids, or 1-D ids with offsets) that a graph rewrite merges into one call; it
  returns the N pooled outputs.

Ids of a grouped lookup are checked per table (:func:`check_member_ids`,
:func:`check_jagged_ids`): in one weight, an id past its own table would silently read the
next table's row where the separate lookup raised.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fxrec.nn.tracing import is_symbolic_tracing, leaf_function_call
from fxrec.sparse.validation import is_tracing, validation_enabled

__all__ = [
    "embedding_bag_grouped",
    "grouped_embedding_bag",
    "ids_dtype",
    "shift_ids",
    "offsets_from_lengths",
    "check_member_ids",
    "check_jagged_ids",
    "out_of_range_error",
]

_MODES = ("sum", "mean", "max")


def _check_mode(mode: str, weighted: bool, sparse: bool) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
    if weighted and mode == "max":
        raise ValueError(
            "per-sample weights are undefined for max pooling; use sum or mean pooling, or "
            "drop the weights."
        )
    if sparse and mode == "max":
        raise ValueError(
            "sparse gradients are not available for max pooling (torch's embedding_bag has "
            "none); use sparse=False for max-pooled tables."
        )


def offsets_from_lengths(lengths: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` (bag boundaries with the last offset) in ``dtype``."""
    out = torch.zeros(lengths.numel() + 1, dtype=dtype or lengths.dtype, device=lengths.device)
    if lengths.numel():
        torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def shift_ids(
    ids: torch.Tensor,
    row_offsets: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """``ids`` with the ``k``-th run of ``counts[k]`` ids shifted by ``row_offsets[k]``.

    Two kernels (``repeat_interleave`` + ``add``) whatever the number of tables; no host read
    (``output_size`` is the known id count).
    """
    shift = torch.repeat_interleave(row_offsets, counts, output_size=ids.numel())
    return ids + shift.to(ids.dtype)


# The assert message lists this many lookups' ranges, then how many more there are.
_LISTED_RANGES = 8


def check_member_ids(
    ids: torch.Tensor,
    bounds: torch.Tensor,
    dim: int,
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    *,
    compiled: bool = False,
) -> torch.Tensor:
    """``ids`` unchanged, once member ``i``'s ids (index ``i`` of ``dim``) lie in ``[0, sizes[i])``.

    A fused lookup reads one laid-out weight, where an id past its own table would read the
    next table's row instead of raising as the separate lookup does. ``bounds`` is ``[2, N]``
    like ``ids``: each member's first and last valid id (0 and ``sizes[i] - 1``); ``names``
    name the members in errors. :func:`_how_to_check` says when and how the check runs.
    """
    if is_symbolic_tracing():
        node = leaf_function_call(
            check_member_ids, (ids, bounds, dim, names, sizes), {"compiled": compiled}
        )
        if node is not None:
            return node  # one graph node, as the rewrite wrote it
    shape = [1] * ids.dim()
    shape[dim] = len(sizes)
    low, high = bounds[0].view(shape), bounds[1].view(shape)
    pos = _first_outside(ids, low, high, names, sizes, compiled)
    if pos is not None:
        member = pos[dim]
        raise out_of_range_error(names[member], int(ids[tuple(pos)]), sizes[member])
    return ids


def check_jagged_ids(
    ids: torch.Tensor,
    bounds: torch.Tensor,
    counts: torch.Tensor,
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    *,
    compiled: bool = False,
) -> torch.Tensor:
    """:func:`check_member_ids` for 1-D ids, member ``i`` owning the ``i``-th run of ``counts[i]``.

    ``bounds`` is ``[2, ids.numel()]``: each id's first and last valid id (0 and its table's
    size - 1); ``counts`` is read only to name the member of a bad id.
    """
    if is_symbolic_tracing():
        node = leaf_function_call(
            check_jagged_ids, (ids, bounds, counts, names, sizes), {"compiled": compiled}
        )
        if node is not None:
            return node
    pos = _first_outside(ids, bounds[0], bounds[1], names, sizes, compiled)
    if pos is not None:
        ends = list(itertools.accumulate(int(c) for c in counts.tolist()))
        member = bisect.bisect_right(ends, pos[0])
        raise out_of_range_error(names[member], int(ids[pos[0]]), sizes[member])
    return ids


def _first_outside(
    ids: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    names: Sequence[str],
    sizes: Sequence[int],
    compiled: bool,
) -> list[int] | None:
    """The position of an id outside ``[low, high]`` if the host check finds one, else None."""
    how = _how_to_check(ids, compiled)
    if how == "assert":
        ok = torch.logical_and(ids >= low, ids <= high).all()
        torch._assert_async(ok, _ranges_message(names, sizes))
    if how != "host":
        return None
    inside = torch.clamp(ids, low, high)
    if torch.equal(inside, ids):
        return None
    return torch.nonzero(inside != ids)[0].tolist()


def _how_to_check(ids: torch.Tensor, compiled: bool) -> str:
    """``"host"``, ``"assert"`` or ``"off"``: how a grouped lookup checks its ids now.

    Eagerly on CPU: a ``clamp`` into the bounds and an ``equal`` with the ids (two kernels,
    the one host read in ``equal``), then an ``IndexError`` naming the member;
    ``fxrec.sparse.set_validation(False)`` turns it off, as it does the other input checks.
    Graphs compiled further (``compiled``), tracers and other devices assert on the device
    instead: ``torch._assert_async`` reads nothing back, and Inductor keeps it in its
    generated kernels, which raise a ``RuntimeError`` listing each member's range. Compiled
    graphs always check: the switch is read at run time, after tracing.
    """
    if compiled or is_tracing():
        return "assert"
    if not validation_enabled():
        return "off"
    return "host" if type(ids) is torch.Tensor and ids.device.type == "cpu" else "assert"


def _ranges_message(names: Sequence[str], sizes: Sequence[int]) -> str:
    """The device assert's message: plain characters only (Inductor pastes it into C++)."""
    return (
        f"embedding id out of range in a fused lookup; valid ids per lookup: "
        f"{listed_ranges(names, sizes)}. Fix the ids fed to that lookup, or enlarge its table"
    )


def listed_ranges(names: Sequence[str], sizes: Sequence[int]) -> str:
    """``"a 0..9, b 0..4 and 3 more"`` in characters a C++ string literal takes as they are."""
    shown = [
        f"{re.sub(r'[^A-Za-z0-9_.]', '_', n)} 0..{s - 1}"
        for n, s in zip(names[:_LISTED_RANGES], sizes)
    ]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def out_of_range_error(name: str, value: int, rows: int) -> IndexError:
    """The error of an id outside its table, naming the lookup and its valid range."""
    return IndexError(
        f"embedding lookup {name!r}: id {value} is out of range for its table of {rows} "
        f"rows (valid ids: 0..{rows - 1}); fix the ids fed to this lookup, or enlarge the "
        f"table's num_embeddings."
    )


def ids_dtype(ids: torch.Tensor, num_rows: int) -> torch.dtype:
    """int32 ids stay int32 while the grouped row numbers fit; anything else becomes int64."""
    if ids.dtype == torch.int32 and num_rows < 2**31:
        return torch.int32
    return torch.int64


def embedding_bag_grouped(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    *,
    sparse: bool = False,
    include_last_offset: bool = True,
) -> torch.Tensor:
    """Pool every bag of a group in one ``F.embedding_bag`` call.

    Args:
        weight: ``[rows, dim]`` grouped weight (the tables' rows one after another).
        ids: 1-D row numbers into ``weight`` (already shifted by their table's row offset).
        offsets: bag boundaries including the last one (``num_bags + 1`` entries), or only
            the bag starts when ``include_last_offset`` is False (the last bag ends at the
            end of ``ids``).
        mode: ``"sum"``, ``"mean"`` or ``"max"`` (see the module docstring).
        per_sample_weights: optional weight per id (sum and mean pooling).
        sparse: give ``weight`` a sparse gradient.

    Returns:
        ``[num_bags, dim]``: bag ``b`` pools ``ids[offsets[b]:offsets[b + 1]]``.
    """
    weighted = per_sample_weights is not None
    _check_mode(mode, weighted, sparse)
    if offsets.dtype != ids.dtype:
        offsets = offsets.to(ids.dtype)
    if weighted and per_sample_weights.dtype != weight.dtype:
        # torch's kernel wants the table's dtype (fbgemm's casts): any float weights work
        per_sample_weights = per_sample_weights.to(weight.dtype)
    if weighted and mode == "mean":
        # Weighted mean = weighted sum with each weight divided by its bag's size.
        bounds = (
            offsets
            if include_last_offset
            else torch.cat([offsets, offsets.new_full((1,), ids.numel())])
        )
        lengths = bounds[1:] - bounds[:-1]
        sizes = torch.repeat_interleave(lengths, lengths, output_size=ids.numel())
        per_sample_weights = per_sample_weights / sizes.to(per_sample_weights.dtype)
        mode = "sum"
    return F.embedding_bag(
        ids,
        weight,
        offsets,
        mode=mode,
        sparse=sparse,
        per_sample_weights=per_sample_weights,
        include_last_offset=include_last_offset,
    )


def grouped_embedding_bag(
    weight: torch.Tensor,
    ids: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor | None] | None,
    row_offsets: Sequence[int],
    mode: str = "sum",
    per_sample_weights: Sequence[torch.Tensor | None] | None = None,
    *,
    include_last_offset: bool = False,
    sparse: bool = False,
) -> list[torch.Tensor]:
    """N ``nn.EmbeddingBag``-style lookups into one grouped weight, as ONE kernel call.

    Member ``i`` reads the table that starts at row ``row_offsets[i]`` of ``weight``; its
    ``ids[i]`` is either 2-D ``[B_i, L_i]`` (fixed-size bags, ``offsets[i]`` None) or 1-D with
    ``offsets[i]`` (bag starts, plus the end when ``include_last_offset``), exactly as
    ``F.embedding_bag`` takes them. Returns the N pooled outputs ``[B_i, dim]`` (views of one
    tensor), equal to the N separate lookups. This is the target of the graph rule that
    groups parallel ``nn.EmbeddingBag`` calls; the ids are not range-checked here (a rewrite
    keeps the original module's behaviour only if ids were valid), so validate upstream.

    Under ``torch.fx`` symbolic tracing it records itself as ONE ``call_function`` node (so a
    rewritten graph re-traces to the same graph); dynamo traces through it into plain ops.
    """
    if is_symbolic_tracing():
        node = leaf_function_call(
            grouped_embedding_bag,
            (weight, ids, offsets, row_offsets, mode, per_sample_weights),
            {"include_last_offset": include_last_offset, "sparse": sparse},
        )
        if node is not None:
            return node  # one graph node; index it (``out[i]``) for member i
    n = len(ids)
    if n == 0:
        return []
    if len(row_offsets) != n:
        raise ValueError(f"got {n} id tensors but {len(row_offsets)} row offsets.")
    offs_in = list(offsets) if offsets is not None else [None] * n
    psw_in = list(per_sample_weights) if per_sample_weights is not None else [None] * n
    if len(offs_in) != n or len(psw_in) != n:
        raise ValueError("ids, offsets and per_sample_weights need one entry per member.")
    weighted = [w is not None for w in psw_in]
    if any(weighted) and not all(weighted):
        raise ValueError("give per-sample weights to every member or to none.")
    _check_mode(mode, weighted[0], sparse)

    flat: list[torch.Tensor] = []
    bag_offsets: list[torch.Tensor] = []
    bags: list[int] = []
    for i, (x, o) in enumerate(zip(ids, offs_in)):
        if x.dim() == 2:
            if o is not None:
                raise ValueError(f"member {i}: 2-D ids take no offsets (each row is a bag).")
            b, length = x.shape
            flat.append(x.reshape(-1))
            bag_offsets.append(
                torch.arange(0, b * length + 1, max(length, 1), device=x.device)[: b + 1]
                if length
                else torch.zeros(b + 1, dtype=torch.long, device=x.device)
            )
            bags.append(b)
        elif x.dim() == 1:
            if o is None:
                raise ValueError(f"member {i}: 1-D ids need offsets.")
            if not include_last_offset:
                o = torch.cat([o, o.new_full((1,), x.numel())])
            flat.append(x)
            bag_offsets.append(o)
            bags.append(o.numel() - 1)
        else:
            raise ValueError(f"member {i}: ids must be 1-D or 2-D, got shape {tuple(x.shape)}.")
    counts = [x.numel() for x in flat]
    dtype = ids_dtype(
        flat[0] if all(x.dtype == flat[0].dtype for x in flat) else flat[0].long(),
        weight.size(0),
    )
    all_ids = torch.cat([x.to(dtype) for x in flat])
    device = all_ids.device
    if any(row_offsets):
        all_ids = shift_ids(
            all_ids,
            torch.tensor(list(row_offsets), dtype=dtype, device=device),
            torch.tensor(counts, dtype=torch.long, device=device),
        )
    # Bag boundaries of member i move by the ids before it; the shared boundary is kept once.
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    firsts = [o[:-1].to(dtype) for o in bag_offsets]
    shifted = torch.cat(firsts)
    if any(starts):
        shifted = shifted + torch.repeat_interleave(
            torch.tensor(starts, dtype=dtype, device=device),
            torch.tensor(bags, dtype=torch.long, device=device),
            output_size=shifted.numel(),
        )
    all_offsets = torch.cat([shifted, shifted.new_full((1,), all_ids.numel())])
    psw = torch.cat([w.reshape(-1) for w in psw_in]) if weighted[0] else None
    out = embedding_bag_grouped(weight, all_ids, all_offsets, mode, psw, sparse=sparse)
    return list(torch.split(out, bags))
