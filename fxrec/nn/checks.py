"""Input checks of the collection: vectorised, before any lookup, naming the bad key.

The id range check is one pass over ALL ids of the batch (a bound per id, two reductions,
one host read); only when it fails does a per-feature search find the culprit. Without it,
an id past its table would silently read the next table's rows of the grouped weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxrec.nn.functional import listed_ranges
from fxrec.nn.layout import Member

__all__ = ["assert_id_ranges", "check_dtypes", "check_id_ranges", "locate_bad_id"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_dtypes(values: torch.Tensor, weights: torch.Tensor | None, keys: Sequence[str]) -> None:
    """Ids must be integers and weights floats (cheap: metadata only)."""
    if values.dtype not in _INT_DTYPES:
        raise ValueError(
            f"ids of features {list(keys)[:5]} have dtype {values.dtype}; embedding ids are "
            f"row numbers: pass integer ids (.long()), and per-id floats as weights."
        )
    if weights is not None and not weights.is_floating_point():
        raise ValueError(
            f"weights of features {list(keys)[:5]} have dtype {weights.dtype}; per-sample "
            f"weights must be floating point (.float())."
        )


def check_id_ranges(
    values: torch.Tensor,
    members: Sequence[Member],
    counts: Sequence[int],
) -> None:
    """Raise ``ValueError`` unless every id of member ``m`` is in ``[0, m.num_embeddings)``.

    ``values`` holds the members' ids back to back, ``counts[i]`` of them for ``members[i]``.
    Meta-device ids (shape inference) hold no numbers to check.
    """
    if values.numel() == 0 or values.is_meta:
        return
    rows = [m.num_embeddings for m in members]
    if values.dtype not in (torch.int32, torch.int64):
        values = values.long()
    if all(r == rows[0] for r in rows):
        lo, hi = torch.aminmax(values)
        bad = int(lo) < 0 or int(hi) >= rows[0]
    else:
        limit = torch.repeat_interleave(
            torch.tensor(rows, dtype=torch.long, device=values.device),
            torch.tensor(list(counts), dtype=torch.long, device=values.device),
            output_size=values.numel(),
        )
        # min(id, limit - 1 - id) < 0  <=>  id < 0 or id >= limit
        margin = torch.minimum(values, limit - 1 - values).min()
        bad = int(margin) < 0
    if bad:
        raise locate_bad_id(values, members, counts)


def assert_id_ranges(
    values: torch.Tensor,
    lengths: torch.Tensor,
    stride_per_key: Sequence[int],
    members: Sequence[Member],
) -> None:
    """:func:`check_id_ranges` for traced graphs (``torch.compile``): a device-side assert.

    It reads nothing back, needs no per-key host counts (each id's bound comes from its
    row's key), and Inductor keeps it in the kernels it generates.
    """
    device = values.device
    rows = torch.tensor([m.num_embeddings for m in members], dtype=torch.long, device=device)
    spk = torch.tensor(list(stride_per_key), dtype=torch.long, device=device)
    per_row = torch.repeat_interleave(rows, spk, output_size=lengths.numel())
    limit = torch.repeat_interleave(per_row, lengths.long(), output_size=values.numel())
    ids = values.long()
    inside = torch.logical_and(ids >= 0, ids < limit).all()
    shown = listed_ranges(
        [f"{m.feature}.{m.table_name}" for m in members], [m.num_embeddings for m in members]
    )
    torch._assert_async(
        inside,
        f"embedding id outside its table; valid ids per feature.table: {shown}. Hash or clip "
        "ids into the table",
    )


def locate_bad_id(
    values: torch.Tensor, members: Sequence[Member], counts: Sequence[int]
) -> ValueError:
    """The error for the first member holding an id outside its table (failure path only)."""
    start = 0
    for m, n in zip(members, counts):
        ids = values[start : start + n]
        start += n
        wrong = (ids < 0) | (ids >= m.num_embeddings)
        if bool(wrong.any()):
            pos = int(torch.nonzero(wrong)[0, 0])
            return ValueError(
                f"feature {m.feature!r}: id {int(ids[pos])} (its id number {pos}) is outside "
                f"table {m.table_name!r}, which has {m.num_embeddings} rows (valid ids: 0.."
                f"{m.num_embeddings - 1}); hash or clip ids into the table, or enlarge "
                f"num_embeddings."
            )
    return ValueError("an id is outside its table, but it could not be located.")
