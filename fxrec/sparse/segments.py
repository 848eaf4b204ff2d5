"""Vectorised helpers on jagged layouts: offsets, segment gathers. No per-row Python loops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "cumsum_list",
    "to_offsets",
    "segment_gather_index",
    "gather_segments",
    "single_threaded",
]


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the enclosed small host ops on this thread alone.

    Lengths/offsets work is a few 10K-100K elements: above ATen's parallel grain (32K) it
    opens an OpenMP team, and on a busy host a team waits for a descheduled worker: measured
    here with 2 threads, one 51K-element subtraction took 7 ms instead of 25 us. One thread
    is both fast and predictable at these sizes. OpenMP's thread count is per calling thread,
    so other threads keep theirs.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def cumsum_list(xs: Sequence[int]) -> list[int]:
    """``[0, x0, x0+x1, ...]`` on Python ints."""
    out = [0]
    acc = 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive-then-inclusive cumsum: ``[0, l0, l0+l1, ...]`` in ``lengths``' dtype, or in
    int32 for narrower integers (whose sums would wrap around)."""
    dtype = lengths.dtype if lengths.dtype in (torch.int32, torch.int64) else torch.int32
    out = lengths.new_zeros(lengths.numel() + 1, dtype=dtype)
    if lengths.numel():
        torch.cumsum(lengths, dim=0, dtype=dtype, out=out[1:])
    return out


def segment_gather_index(
    seg_lengths: Sequence[int], order: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Row indices that gather contiguous segments (``seg_lengths``) in ``order``.

    Built with a fixed handful of kernels whatever the number of segments; duplicates repeat a
    segment, omitted segments are dropped.
    """
    starts = cumsum_list(seg_lengths)
    sel_starts = [starts[i] for i in order]
    sel_lens = [seg_lengths[i] for i in order]
    total = sum(sel_lens)
    out_starts = cumsum_list(sel_lens)[:-1]
    shift = torch.tensor([s - o for s, o in zip(sel_starts, out_starts)], dtype=torch.long)
    lens = torch.tensor(sel_lens, dtype=torch.long)
    if device.type != "cpu":
        shift = shift.to(device, non_blocking=True)
        lens = lens.to(device, non_blocking=True)
    idx = torch.arange(total, dtype=torch.long, device=device)
    return idx + torch.repeat_interleave(shift, lens, output_size=total)


def gather_segments(
    data: torch.Tensor, seg_lengths: Sequence[int], order: Sequence[int]
) -> torch.Tensor:
    """Concatenate the contiguous segments of ``data`` in ``order`` (a copy)."""
    if list(order) == list(range(len(seg_lengths))):
        return data.clone()
    idx = segment_gather_index(seg_lengths, order, data.device)
    return data.index_select(0, idx)
