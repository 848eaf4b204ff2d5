"""``JaggedTensor``: one batch of variable-length bags (one sparse feature).

Semantics follow ``torchrec.sparse.jagged_tensor.JaggedTensor``: ``values`` holds the bags
back to back along dim 0, ``lengths``/``offsets`` delimit them, ``weights`` (optional) holds one
float per value. Whichever of lengths/offsets is missing is derived lazily, without a sync.
"""

from __future__ import annotations

from typing import Any

import torch

from fxrec.sparse import validation as V
from fxrec.sparse._meta import SparseMeta
from fxrec.sparse.segments import to_offsets

__all__ = ["JaggedTensor"]


class JaggedTensor(metaclass=SparseMeta):
    """A batch of variable-length bags: ``values`` split by ``lengths`` (or ``offsets``).

    ``ProxyableClassMeta`` makes construction from FX proxies a single graph node, so models
    that build jagged tensors in ``forward`` stay symbolically traceable.
    """

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor needs lengths or offsets to delimit the bags.")
        if V.validation_enabled() and not getattr(values, "is_meta", False):  # no data to read
            lengths = _validate_jt(values, weights, lengths, offsets)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    @classmethod
    def _make(
        cls,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None,
    ) -> JaggedTensor:
        """Build from parts already known to be consistent (no validation)."""
        jt = cls.__new__(cls)
        jt._values, jt._weights, jt._lengths, jt._offsets = values, weights, lengths, offsets
        return jt

    # ---- constructors ------------------------------------------------------------------
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype = torch.long,
        weights_dtype: torch.dtype = torch.float32,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """A batch of zero bags."""
        return JaggedTensor._make(
            torch.empty(0, dtype=values_dtype, device=device),
            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            torch.empty(0, dtype=lengths_dtype, device=device),
            torch.zeros(1, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def from_dense(
        values: list[torch.Tensor], weights: list[torch.Tensor] | None = None
    ) -> JaggedTensor:
        """One bag per tensor in ``values`` (and per-value ``weights``), concatenated."""
        if weights is not None and len(weights) != len(values):
            raise ValueError(
                f"from_dense got {len(values)} value tensors but {len(weights)} weight tensors; "
                f"pass one weight tensor per bag."
            )
        device = values[0].device if values else None
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=device)
        vals = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
        w = torch.cat(weights) if weights else None
        return JaggedTensor(vals, weights=w, lengths=lengths)

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> JaggedTensor:
        """From a padded ``[B, L, ...]`` tensor, keeping the first ``lengths[b]`` of row b."""
        if values.dim() < 2 or values.size(0) != lengths.numel():
            raise ValueError(
                f"from_dense_lengths needs values of shape [B, L, ...] with B == len(lengths); "
                f"got {tuple(values.shape)} and {lengths.numel()} lengths."
            )
        mask = torch.arange(values.size(1), device=values.device) < lengths.unsqueeze(1)
        return JaggedTensor(
            values[mask], weights=weights[mask] if weights is not None else None, lengths=lengths
        )

    # ---- accessors -----------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("This JaggedTensor has no weights; use weights_or_none().")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            assert self._offsets is not None
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            assert self._lengths is not None
            self._offsets = to_offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        """Number of bags (the batch size)."""
        if self._lengths is not None:
            return self._lengths.numel()
        assert self._offsets is not None
        return max(self._offsets.numel() - 1, 0)

    # ---- dense views -----------------------------------------------------------------
    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag (views of ``values``)."""
        return list(torch.split(self._values, V.read_ints(self.lengths())))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        if self._weights is None:
            return None
        return list(torch.split(self._weights, V.read_ints(self.lengths())))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``[B, L, ...]``: each bag left-aligned, truncated or padded to ``L``.

        ``L`` is ``desired_length`` or, when omitted, the longest bag (one host read).
        """
        return _pad(self._values, self.lengths(), self.offsets(), desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        if self._weights is None:
            return None
        return _pad(self._weights, self.lengths(), self.offsets(), desired_length, padding_value)

    # ---- movement ----------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return JaggedTensor._make(
            mv(self._values), mv(self._weights), mv(self._lengths), mv(self._offsets)
        )

    def pin_memory(self) -> JaggedTensor:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return JaggedTensor._make(
            pin(self._values), pin(self._weights), pin(self._lengths), pin(self._offsets)
        )

    def record_stream(self, stream: Any) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        if self._values.numel() > 64 or self._values.is_meta:
            return (
                f"JaggedTensor(stride={self.stride()}, num_values={self._values.size(0)}, "
                f"weighted={self._weights is not None}, device={self.device()})"
            )
        rows = [r.tolist() for r in self.to_dense()]
        w = (
            ""
            if self._weights is None
            else f", weights={[r.tolist() for r in self.to_dense_weights() or []]}"
        )
        return f"JaggedTensor({rows}{w})"


def _pad(
    data: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    desired_length: int | None,
    padding_value: float,
) -> torch.Tensor:
    b = lengths.numel()
    if desired_length is None:
        desired_length = int(lengths.max()) if b else 0
    out = data.new_full((b, desired_length, *data.shape[1:]), padding_value)
    n = data.size(0)
    if n == 0 or desired_length == 0:
        return out
    row = torch.repeat_interleave(
        torch.arange(b, device=data.device), lengths.long(), output_size=n
    )
    pos = torch.arange(n, device=data.device) - offsets.long().index_select(0, row)
    keep = pos < desired_length
    out[row[keep], pos[keep]] = data[keep]
    return out


def _validate_jt(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        raise ValueError("JaggedTensor values must be a tensor with at least one dimension.")
    V.check_weights(weights, values)
    n = values.size(0)
    if offsets is not None:
        V.check_int_tensor(offsets, "offsets")
    if lengths is not None:
        V.check_int_tensor(lengths, "lengths")
        if offsets is not None:
            V.check_offsets_against_lengths(lengths, offsets)
    if lengths is None:
        assert offsets is not None
        return V.lengths_from_offsets(offsets, n)
    if offsets is not None:
        derived = V.lengths_from_offsets(offsets, n)
        if not torch.equal(derived, lengths.to(derived.dtype)):
            raise ValueError(
                "lengths and offsets disagree (lengths != diff(offsets)); pass only one of them."
            )
    V.check_lengths_values(lengths, n, [None], [lengths.numel()])
    return lengths
