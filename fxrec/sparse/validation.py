"""Input validation for the sparse types: clear ``ValueError``s instead of wrong answers.

Checks are on by default in every public constructor. They are vectorised (a few tensor ops
and at most one host read per constructor, never a loop over rows) and are skipped while FX
or dynamo trace, where values are not known. The hot path can switch them off globally with
:func:`set_validation` or locally with :func:`validation_disabled`.

Value checks (negative lengths, sums) read tensor contents, which synchronises an accelerator;
validate on the host before the copy, as :func:`fxrec.sparse.pack_features` does, and switch
validation off for device-side constructions if that sync matters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch.fx import _symbolic_trace

from fxrec.compiling import is_compiling
from fxrec.sparse.segments import single_threaded

__all__ = [
    "set_validation",
    "validation_enabled",
    "validation_disabled",
    "is_tracing",
]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_state = threading.local()
_global_enabled = True


def set_validation(enabled: bool) -> None:
    """Turn input validation on or off for the whole process (it is on by default)."""
    global _global_enabled
    _global_enabled = bool(enabled)


@contextlib.contextmanager
def validation_disabled() -> Iterator[None]:
    """Skip validation inside the ``with`` block (this thread only): for trusted hot paths."""
    prev = getattr(_state, "off", 0)
    _state.off = prev + 1
    try:
        yield
    finally:
        _state.off = prev


def is_tracing() -> bool:
    """True under torch.compile/dynamo, export or ``torch.fx.symbolic_trace``."""
    if is_compiling():
        return True
    # The module flag, read directly: ``is_fx_tracing()`` logs a warning on every call.
    return bool(getattr(_symbolic_trace, "_is_fx_tracing_flag", False))


def validation_enabled() -> bool:
    """Whether constructors validate now: switched on and not tracing."""
    if not _global_enabled or getattr(_state, "off", 0):
        return False
    return not is_tracing()


def _where(key: str | None) -> str:
    return f"feature {key!r}: " if key is not None else ""


def check_int_tensor(t: torch.Tensor, name: str, key: str | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{_where(key)}{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(
            f"{_where(key)}{name} must have an integer dtype (int32 or int64), got {t.dtype}; "
            f"convert it with .long() or .int()."
        )
    if t.dim() != 1:
        raise ValueError(f"{_where(key)}{name} must be 1-D, got shape {tuple(t.shape)}.")


def check_ids(values: torch.Tensor, key: str | None = None) -> None:
    if not isinstance(values, torch.Tensor):
        raise ValueError(
            f"{_where(key)}values must be a torch.Tensor, got {type(values).__name__}."
        )
    if values.dtype not in _INT_DTYPES:
        raise ValueError(
            f"{_where(key)}ids (values) must be integers, got {values.dtype}; embedding ids "
            f"are row indices: convert them with .long(), and pass per-id floats as weights=."
        )
    if values.dim() != 1:
        raise ValueError(f"{_where(key)}ids must be 1-D, got shape {tuple(values.shape)}.")


def check_weights(
    weights: torch.Tensor | None, values: torch.Tensor, key: str | None = None
) -> None:
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor):
        raise ValueError(
            f"{_where(key)}weights must be a torch.Tensor, got {type(weights).__name__}."
        )
    if not weights.is_floating_point():
        raise ValueError(
            f"{_where(key)}weights must be floating point, got {weights.dtype}; "
            f"convert them with .float()."
        )
    if weights.shape[:1] != values.shape[:1] or weights.dim() != 1:
        raise ValueError(
            f"{_where(key)}weights must be 1-D with one weight per id: got shape "
            f"{tuple(weights.shape)} for {values.shape[0]} ids."
        )
    if weights.device != values.device:
        raise ValueError(
            f"{_where(key)}weights are on {weights.device} but values on {values.device}; "
            f"move both to one device."
        )


def check_offsets_against_lengths(
    lengths: torch.Tensor, offsets: torch.Tensor, key: str | None = None
) -> None:
    if offsets.numel() != lengths.numel() + 1:
        raise ValueError(
            f"{_where(key)}offsets must have one more entry than lengths: got "
            f"{offsets.numel()} offsets for {lengths.numel()} lengths."
        )


def read_ints(t: torch.Tensor) -> list[int]:
    """One host read of a small integer tensor."""
    out = t.tolist()
    if out and not isinstance(out[0], int):  # unbacked sizes (non-strict torch.export)
        for x in out:
            torch._check(x >= 0)
        return out
    return [int(x) for x in out]


def lengths_from_offsets(
    offsets: torch.Tensor, num_values: int, key: str | None = None, check: bool = True
) -> torch.Tensor:
    """``diff(offsets)``, checking (when ``check``) start 0, end == num_values, monotonic."""
    if offsets.numel() == 0:
        if check:
            raise ValueError(
                f"{_where(key)}offsets must have at least one entry (0): for an empty batch "
                f"pass offsets=[0] or lengths=[]."
            )
        return offsets.new_zeros(0)
    lengths = offsets[1:] - offsets[:-1]
    if check:
        stats = torch.stack(
            [
                offsets[0].long(),
                offsets[-1].long(),
                lengths.min().long()
                if lengths.numel()
                else offsets.new_zeros((), dtype=torch.long),
            ]
        )
        first, last, low = read_ints(stats)
        if first != 0:
            raise ValueError(f"{_where(key)}offsets must start at 0, got {first}.")
        if low < 0:
            bad = int(torch.nonzero(lengths < 0)[0, 0])
            raise ValueError(
                f"{_where(key)}offsets must be non-decreasing, but offsets[{bad + 1}] < "
                f"offsets[{bad}]; pass cumulative sums of non-negative lengths."
            )
        if last != num_values:
            raise ValueError(
                f"{_where(key)}offsets end at {last} but there are {num_values} values; "
                f"the last offset must equal the number of ids."
            )
    return lengths


def segment_sums(lengths: torch.Tensor, stride_per_key: Sequence[int]) -> torch.Tensor:
    """Per-segment sums of ``lengths`` (segments of ``stride_per_key`` rows), vectorised."""
    n = len(stride_per_key)
    if n == 0:
        return lengths.new_zeros(0, dtype=torch.long)
    if lengths.numel() == 0:
        return lengths.new_zeros(n, dtype=torch.long)
    first = stride_per_key[0]
    if all(s == first for s in stride_per_key):
        return lengths.view(n, first).sum(dim=1, dtype=torch.long)
    csum = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=csum[1:])
    bounds = [0]
    for s in stride_per_key:
        bounds.append(bounds[-1] + s)
    idx = torch.tensor(bounds, dtype=torch.long).to(lengths.device, non_blocking=True)
    ends = csum.index_select(0, idx)
    return ends[1:] - ends[:-1]


def check_lengths_values(
    lengths: torch.Tensor,
    num_values: int,
    keys: Sequence[str | None],
    stride_per_key: Sequence[int],
) -> list[int]:
    """Check lengths >= 0 and sum == num_values; return the per-key id counts (one host read)."""
    with single_threaded():
        return _check_lengths_values(lengths, num_values, keys, stride_per_key)


def _check_lengths_values(
    lengths: torch.Tensor,
    num_values: int,
    keys: Sequence[str | None],
    stride_per_key: Sequence[int],
) -> list[int]:
    sums = segment_sums(lengths, stride_per_key)
    low = (
        lengths.min().long().view(1)
        if lengths.numel()
        else torch.zeros(1, dtype=torch.long, device=lengths.device)
    )
    stats = read_ints(torch.cat([sums, low]))
    per_key, low_v = stats[:-1], stats[-1]
    if low_v < 0:
        row = int(torch.nonzero(lengths < 0)[0, 0])
        k, r = _key_of_row(row, stride_per_key)
        raise ValueError(
            f"{_where(keys[k])}negative length {int(lengths[row])} at batch row {r}; "
            f"lengths count the ids of each bag and must be >= 0."
        )
    total = sum(per_key)
    if total != num_values:
        named = [(k, n) for k, n in zip(keys, per_key) if k is not None]
        detail = ", ".join(f"{k!r}: {n}" for k, n in named[:8]) + (
            ", ..." if len(named) > 8 else ""
        )
        detail = f" (ids per feature: {detail})" if named else ""
        raise ValueError(
            f"lengths sum to {total} but there are {num_values} values{detail}; "
            f"each feature's lengths must count exactly its ids, in key-major order."
        )
    return per_key


def _key_of_row(row: int, stride_per_key: Sequence[int]) -> tuple[int, int]:
    start = 0
    for k, s in enumerate(stride_per_key):
        if row < start + s:
            return k, row - start
        start += s
    return len(stride_per_key) - 1, row - start


def keys_list(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list; a str is refused (``list("ab")`` would be two keys)."""
    if isinstance(keys, str):
        raise ValueError(f"keys must be a list of str, got the str {keys!r}; use [{keys!r}].")
    return list(keys)


def check_keys(keys: Sequence[str]) -> None:
    """Keys are a list of str. Repeats are allowed: ``permute`` repeats a key on purpose."""
    if not isinstance(keys, (list, tuple)):
        raise ValueError(f"keys must be a list of str, got {type(keys).__name__}.")
    for k in keys:
        if not isinstance(k, str):
            raise ValueError(f"keys must be str, got {k!r} ({type(k).__name__}).")
