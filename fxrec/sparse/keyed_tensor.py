"""``KeyedTensor``: pooled outputs of many keys side by side in one dense tensor.

Semantics follow ``torchrec.sparse.jagged_tensor.KeyedTensor``: key ``i`` owns
``length_per_key[i]`` consecutive slices of ``values`` along ``key_dim`` (by default dim 1,
so ``values`` is ``[B, sum(dims)]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxrec.sparse import validation as V
from fxrec.sparse._meta import SparseMeta
from fxrec.sparse.segments import cumsum_list

__all__ = ["KeyedTensor"]


class KeyedTensor(metaclass=SparseMeta):
    """Dense values of many keys, concatenated along ``key_dim``."""

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
    ) -> None:
        self._keys = V.keys_list(keys)
        self._length_per_key = [int(n) for n in length_per_key]
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key: list[int] | None = None
        self._index_per_key: dict[str, int] | None = None
        if V.validation_enabled():
            V.check_keys(self._keys)
            if len(self._keys) != len(self._length_per_key):
                raise ValueError(
                    f"KeyedTensor got {len(self._keys)} keys but {len(self._length_per_key)} "
                    f"lengths; give one length (width) per key."
                )
            negative = [k for k, n in zip(self._keys, self._length_per_key) if n < 0]
            if negative:
                raise ValueError(f"KeyedTensor key {negative[0]!r} has a negative width.")
            width = values.size(key_dim) if values.dim() > key_dim else -1
            if sum(self._length_per_key) != width:
                raise ValueError(
                    f"KeyedTensor lengths sum to {sum(self._length_per_key)} but values have "
                    f"{width} columns along key_dim={key_dim} (shape {tuple(values.shape)})."
                )

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate per-key tensors (one ``cat``)."""
        return KeyedTensor(
            keys,
            [t.shape[key_dim] for t in tensors],
            torch.cat(list(tensors), dim=cat_dim),
            key_dim,
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            self._offset_per_key = cumsum_list(self._length_per_key)
        return self._offset_per_key

    def _key_indices(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        idx = self._key_indices().get(key)
        if idx is None:
            raise KeyError(f"no key {key!r} in this KeyedTensor (keys: {self._keys[:10]}).")
        opk = self.offset_per_key()
        return self._values.narrow(self._key_dim, opk[idx], self._length_per_key[idx])

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Key -> view of its slice."""
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts))

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[torch.Tensor]:
        """One tensor per group: the groups' keys' slices concatenated in the given order.

        Keys may come from any of ``keyed_tensors`` (all with the same ``key_dim``); a key held
        more than once is taken from its last holder, as in TorchRec (and as ``kt[key]``). One
        ``cat`` per group, differentiable.
        """
        if not keyed_tensors:
            raise ValueError("KeyedTensor.regroup needs at least one KeyedTensor.")
        key_dim = keyed_tensors[0].key_dim()
        where: dict[str, torch.Tensor] = {}
        for kt in keyed_tensors:
            if kt.key_dim() != key_dim:
                raise ValueError("KeyedTensor.regroup needs every input to have the same key_dim.")
            for k, t in zip(kt.keys(), torch.split(kt.values(), kt.length_per_key(), key_dim)):
                where[k] = t  # a key in several: the last one wins, as in TorchRec
        out = []
        for g in groups:
            missing = [k for k in g if k not in where]
            if missing:
                raise ValueError(
                    f"regroup: keys {missing[:5]} are in no KeyedTensor; available: "
                    f"{list(where)[:10]}."
                )
            out.append(torch.cat([where[k] for k in g], dim=key_dim))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor],
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
    ) -> dict[str, torch.Tensor]:
        """``regroup``, with each group's result under the name in ``keys``."""
        if len(groups) != len(keys):
            raise ValueError(
                f"regroup_as_dict got {len(groups)} groups but {len(keys)} names; give one name "
                f"per group."
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return self._with(self._values.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KeyedTensor:
        return self._with(self._values.pin_memory())

    def _with(self, values: torch.Tensor) -> KeyedTensor:
        kt = KeyedTensor.__new__(KeyedTensor)
        kt._keys, kt._length_per_key, kt._values, kt._key_dim = (
            self._keys,
            self._length_per_key,
            values,
            self._key_dim,
        )
        kt._offset_per_key, kt._index_per_key = None, None
        return kt

    def record_stream(self, stream: Any) -> None:
        self._values.record_stream(stream)

    def __repr__(self) -> str:
        keys = self._keys if len(self._keys) <= 8 else [*self._keys[:8], "..."]
        return (
            f"KeyedTensor(keys={keys}, length_per_key={self._length_per_key[:8]}, "
            f"values={tuple(self._values.shape)} {self._values.dtype}, key_dim={self._key_dim})"
        )
