"""``KeyedJaggedTensor``: many sparse features of one batch in one key-major layout.

Semantics follow ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor``: ``values`` holds every
feature's ids back to back (feature 0's bags, then feature 1's ...), ``lengths`` holds one
entry per (feature, row) in the same order. ``stride_per_key`` gives each feature its own batch
size (variable batch); otherwise every feature has ``stride`` rows.

Derived per-key figures (``length_per_key`` etc.) need a host read; they are computed once
per instance, lazily (or for free during validation). Python-int metadata travels to the
results of ``to``/``pin_memory``/``permute``/``split`` (it stays true); tensor caches such as
``to_dict()``'s never do, so a moved or permuted KJT can never hand back stale tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxrec.sparse import validation as V
from fxrec.sparse._meta import SparseMeta
from fxrec.sparse.jagged_tensor import JaggedTensor
from fxrec.sparse.permute import permute_jagged
from fxrec.sparse.segments import cumsum_list, to_offsets

__all__ = ["KeyedJaggedTensor"]


class KeyedJaggedTensor(metaclass=SparseMeta):
    """Keyed, optionally weighted, jagged batch of sparse features (key-major layout).

    Args:
        keys: feature names, one per key-major block.
        values: 1-D integer ids of all features, key-major.
        weights: optional 1-D float weight per id.
        lengths / offsets: bag sizes (or their cumulative sums, starting at 0), one per
            (key, row); give either.
        stride: rows per key when every key has the same batch size (inferred if omitted).
        stride_per_key: rows of each key, for a variable batch size per key.
        length_per_key: optional ids per key, when the caller already knows them (saves a
            host read).
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key: Sequence[int] | None = None,
        length_per_key: Sequence[int] | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError(
                "KeyedJaggedTensor needs lengths or offsets (one entry per key and batch row)."
            )
        self._init(
            V.keys_list(keys),
            values,
            weights,
            lengths,
            offsets,
            stride,
            None if stride_per_key is None else [int(s) for s in stride_per_key],
            None if length_per_key is None else [int(n) for n in length_per_key],
        )
        if V.validation_enabled() and not getattr(values, "is_meta", False):  # no data to read
            self._validate()

    def _init(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None,
        stride: int | None,
        stride_per_key: list[int] | None,
        length_per_key: list[int] | None,
    ) -> None:
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._stride_per_key = stride_per_key
        self._length_per_key = length_per_key
        # Per-instance caches (never copied to other instances).
        self._offset_per_key: list[int] | None = None
        self._index_per_key: dict[str, int] | None = None
        self._jt_dict: dict[str, JaggedTensor] | None = None

    @classmethod
    def _make(
        cls,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key: list[int] | None = None,
        length_per_key: list[int] | None = None,
    ) -> KeyedJaggedTensor:
        """Build from parts already known to be consistent (no validation, no host reads)."""
        kjt = cls.__new__(cls)
        kjt._init(keys, values, weights, lengths, offsets, stride, stride_per_key, length_per_key)
        return kjt

    def _validate(self) -> None:
        V.check_keys(self._keys)
        V.check_ids(self._values)
        V.check_weights(self._weights, self._values)
        n = self._values.size(0)
        keys = self._keys
        if self._offsets is not None:
            V.check_int_tensor(self._offsets, "offsets")
            if self._lengths is not None:
                V.check_int_tensor(self._lengths, "lengths")
                V.check_offsets_against_lengths(self._lengths, self._offsets)
            derived = V.lengths_from_offsets(self._offsets, n)
            if self._lengths is None:
                self._lengths = derived
            elif not torch.equal(derived, self._lengths.to(derived.dtype)):
                raise ValueError(
                    "lengths and offsets disagree (lengths != diff(offsets)); pass only one."
                )
        lengths = self.lengths()
        V.check_int_tensor(lengths, "lengths")
        if lengths.device != self._values.device:
            raise ValueError(
                f"lengths are on {lengths.device} but values on {self._values.device}; "
                f"move both to one device."
            )
        rows = lengths.numel()
        spk = self._stride_per_key
        if spk is not None:
            if len(spk) != len(keys):
                raise ValueError(
                    f"stride_per_key has {len(spk)} entries for {len(keys)} keys; give one "
                    f"batch size per key."
                )
            for k, s in zip(keys, spk):
                if s < 0:
                    raise ValueError(f"feature {k!r}: stride_per_key is negative ({s}).")
            if sum(spk) != rows:
                raise ValueError(
                    f"stride_per_key sums to {sum(spk)} rows but lengths has {rows} entries; "
                    f"lengths needs one entry per row of each key."
                )
        elif not keys:
            if rows:
                raise ValueError(f"a KeyedJaggedTensor without keys got {rows} lengths.")
        else:
            stride = self._stride
            if stride is None:
                if rows % len(keys):
                    raise ValueError(
                        f"{rows} lengths can't be split evenly over {len(keys)} keys "
                        f"(mismatched batch sizes); pass stride_per_key=[...] for a variable "
                        f"batch size per key."
                    )
            elif stride * len(keys) != rows:
                raise ValueError(
                    f"stride={stride} with {len(keys)} keys needs {stride * len(keys)} lengths, "
                    f"got {rows} (mismatched batch sizes); pass stride_per_key=[...] if the "
                    f"keys have different batch sizes."
                )
        per_key = V.check_lengths_values(lengths, n, keys, self.stride_per_key())
        if self._length_per_key is not None and list(self._length_per_key) != per_key:
            raise ValueError(
                f"length_per_key={self._length_per_key} disagrees with the lengths "
                f"({per_key}); drop it to have it computed."
            )
        self._length_per_key = per_key

    # ---- constructors ------------------------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key: Sequence[int] | None = None,
    ) -> KeyedJaggedTensor:
        """Construct and compute the per-key figures now (one host read)."""
        kjt = KeyedJaggedTensor(
            keys, values, weights, lengths=lengths, stride=stride, stride_per_key=stride_per_key
        )
        return kjt.sync()

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key: Sequence[int] | None = None,
    ) -> KeyedJaggedTensor:
        kjt = KeyedJaggedTensor(
            keys, values, weights, offsets=offsets, stride=stride, stride_per_key=stride_per_key
        )
        return kjt.sync()

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One KJT from per-feature jagged tensors; different batch sizes give variable stride.

        Either every feature is weighted or none is.
        """
        keys = list(jt_dict)
        jts = list(jt_dict.values())
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            missing = [k for k, w in zip(keys, weighted) if not w]
            raise ValueError(
                f"features {missing[:5]} have no weights while others do; give every feature "
                f"weights (e.g. ones) or none."
            )
        if not jts:
            return KeyedJaggedTensor.empty()
        strides = [jt.stride() for jt in jts]
        uniform = all(s == strides[0] for s in strides)
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if weighted[0] else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
            stride=strides[0] if uniform else None,
            stride_per_key=None if uniform else strides,
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype = torch.long,
        weights_dtype: torch.dtype = torch.float32,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """A KJT with no keys."""
        return KeyedJaggedTensor._make(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            length_per_key=[],
        )

    @staticmethod
    def concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of all inputs, in order (one ``cat`` each for values, lengths, weights)."""
        if not kjts:
            raise ValueError("KeyedJaggedTensor.concat needs at least one KeyedJaggedTensor.")
        weighted = kjts[0].weights_or_none() is not None
        for k in kjts:
            if (k.weights_or_none() is not None) != weighted:
                raise ValueError(
                    f"can't concat weighted and unweighted KJTs (keys {k.keys()[:5]}); give "
                    f"every input weights or none."
                )
        variable = any(k.variable_stride_per_key() for k in kjts)
        strides = [k.stride() for k in kjts if k._keys]
        if not variable and any(s != strides[0] for s in strides):
            variable = True  # different batch sizes: keep each key's own
        keys = [key for k in kjts for key in k._keys]
        lpk = None
        if all(k._length_per_key is not None for k in kjts):
            lpk = [n for k in kjts for n in k._length_per_key or []]
        return KeyedJaggedTensor._make(
            keys,
            torch.cat([k._values for k in kjts]),
            torch.cat([k.weights() for k in kjts]) if weighted else None,
            torch.cat([k.lengths() for k in kjts]),
            stride=None if variable else (strides[0] if strides else 0),
            stride_per_key=[s for k in kjts for s in k.stride_per_key()] if variable else None,
            length_per_key=lpk,
        )

    # ---- accessors -----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("This KeyedJaggedTensor has no weights; use weights_or_none().")
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
            self._offsets = to_offsets(self.lengths())
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        """Rows per key. With a variable batch size per key: the ``stride`` given to the
        constructor, else the largest per-key batch size."""
        if self._stride is None:
            if self._stride_per_key is not None:
                return max(self._stride_per_key, default=0)
            if not self._keys:
                self._stride = 0
            else:
                rows = (
                    self._lengths.numel()
                    if self._lengths is not None
                    else max(self._offsets.numel() - 1, 0)  # type: ignore[union-attr]
                )
                self._stride = rows // len(self._keys)
        return self._stride

    def stride_per_key(self) -> list[int]:
        if self._stride_per_key is not None:
            return self._stride_per_key
        return [self.stride()] * len(self._keys)

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key is not None

    def length_per_key(self) -> list[int]:
        """Ids per key (a host read the first time, then cached)."""
        if self._length_per_key is None:
            self._length_per_key = V.read_ints(
                V.segment_sums(self.lengths(), self.stride_per_key())
            )
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Start of each key's ids in ``values``, plus the end: ``len(keys) + 1`` entries."""
        if self._offset_per_key is None:
            self._offset_per_key = cumsum_list(self.length_per_key())
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def inverse_indices_or_none(self) -> None:
        """None: no per-key batch expansion (TorchRec's variable-batch inverse indices) is
        held. TorchRec's own modules ask for it, so they read this KJT as they read theirs."""
        return None

    def lengths_offset_per_key(self) -> list[int]:
        """Start of each key's rows in ``lengths``, plus the end."""
        return cumsum_list(self.stride_per_key())

    def index_per_key(self) -> dict[str, int]:
        """Key -> position (for a repeated key, its last position, as in TorchRec)."""
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def sync(self) -> KeyedJaggedTensor:
        """Compute the per-key figures now, so later accessors need no host read."""
        self.offset_per_key()
        return self

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str) -> JaggedTensor:
        idx = self.index_per_key().get(key)
        if idx is None:
            raise KeyError(
                f"no feature {key!r} in this KeyedJaggedTensor (keys: {self._keys[:10]})."
            )
        return self._jt(idx)

    def _jt(self, idx: int) -> JaggedTensor:
        opk = self.offset_per_key()
        lopk = self.lengths_offset_per_key()
        a, b = opk[idx], opk[idx + 1]
        return JaggedTensor._make(
            self._values[a:b],
            None if self._weights is None else self._weights[a:b],
            self.lengths()[lopk[idx] : lopk[idx + 1]],
            None,
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Key -> JaggedTensor (views). Computed once per instance."""
        if self._jt_dict is None:
            lpk = self.length_per_key()
            spk = self.stride_per_key()
            vals = torch.split(self._values, lpk)
            wts = torch.split(self._weights, lpk) if self._weights is not None else None
            lens = torch.split(self.lengths(), spk)
            self._jt_dict = {
                k: JaggedTensor._make(vals[i], None if wts is None else wts[i], lens[i], None)
                for i, k in enumerate(self._keys)
            }
        return dict(self._jt_dict)

    # ---- transformations -----------------------------------------------------------------
    def permute(
        self, indices: Sequence[int], indices_tensor: torch.Tensor | None = None
    ) -> KeyedJaggedTensor:
        """Keys in the order ``indices`` (a gather: repeats repeat a key, omitted keys drop)."""
        del indices_tensor  # accepted for TorchRec compatibility; the list is authoritative
        order = [int(i) for i in indices]
        k = len(self._keys)
        for i in order:
            if not -k <= i < k:
                raise ValueError(f"permute index {i} out of range for {k} keys.")
        order = [i % k for i in order]
        lpk = self.length_per_key()
        spk = self.stride_per_key()
        values, lengths, weights = permute_jagged(
            self._values, self.lengths(), self._weights, spk, lpk, order
        )
        return KeyedJaggedTensor._make(
            [self._keys[i] for i in order],
            values,
            weights,
            lengths,
            stride=self.stride(),  # a variable batch keeps its stride, as TorchRec's does
            stride_per_key=[spk[i] for i in order] if self._stride_per_key is not None else None,
            length_per_key=[lpk[i] for i in order],
        )

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[i]`` keys each (views, no copies)."""
        segments = [int(s) for s in segments]
        if any(s < 0 for s in segments) or sum(segments) != len(self._keys):
            raise ValueError(
                f"split segments {segments} must be non-negative and sum to the number of "
                f"keys ({len(self._keys)})."
            )
        opk = self.offset_per_key()
        lopk = self.lengths_offset_per_key()
        lpk = self.length_per_key()
        spk = self.stride_per_key()
        lengths = self.lengths()
        out: list[KeyedJaggedTensor] = []
        start = 0
        for seg in segments:
            end = start + seg
            a, b = opk[start], opk[end]
            out.append(
                KeyedJaggedTensor._make(
                    self._keys[start:end],
                    self._values[a:b],
                    None if self._weights is None else self._weights[a:b],
                    lengths[lopk[start] : lopk[end]],
                    stride=self.stride(),  # a variable batch keeps its stride, as TorchRec's
                    stride_per_key=spk[start:end] if self._stride_per_key is not None else None,
                    length_per_key=lpk[start:end],
                )
            )
            start = end
        return out

    # ---- movement ------------------------------------------------------------------------
    def _map(self, fn: Any) -> KeyedJaggedTensor:
        def f(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return KeyedJaggedTensor._make(
            self._keys,
            fn(self._values),
            f(self._weights),
            f(self._lengths),
            f(self._offsets),
            stride=self._stride,
            stride_per_key=self._stride_per_key,
            length_per_key=self._length_per_key,
        )

    def to(
        self,
        device: torch.device | str,
        non_blocking: bool = False,
        dtype: torch.dtype | None = None,
    ) -> KeyedJaggedTensor:
        """A copy on ``device`` (``dtype``, if given, applies to the weights, as in TorchRec)."""
        out = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if dtype is not None and out._weights is not None:
            out._weights = out._weights.to(dtype)
        return out

    def pin_memory(self) -> KeyedJaggedTensor:
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: Any) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        keys = self._keys if len(self._keys) <= 8 else [*self._keys[:8], "..."]
        small = len(self._keys) <= 8
        stride = (
            f"stride_per_key={self._stride_per_key}"
            if self._stride_per_key is not None and small
            else f"stride={self.stride()}"
        )
        head = (
            f"KeyedJaggedTensor(keys={keys}, {stride}, num_values={self._values.size(0)}, "
            f"weighted={self._weights is not None}, device={self.device()}"
        )
        if self._values.numel() > 64 or not small or self._values.is_meta or V.is_tracing():
            return head + ")"
        body = ", ".join(f"{k!r}: {jt!r}" for k, jt in zip(self._keys, self._per_key_list()))
        return f"{head}, {{{body}}})"

    def _per_key_list(self) -> list[JaggedTensor]:
        return [self._jt(i) for i in range(len(self._keys))]
