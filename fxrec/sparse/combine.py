"""Combined input features (seed 000 §3.1), host side: many features, one tensor each.

``pack_features`` turns a KJT, a TensorDict or a dict of JaggedTensors (or of jagged nested
tensors) into a :class:`CombinedFeatures`: ONE values tensor, ONE lengths tensor, optionally
ONE weights tensor, plus host metadata (keys, rows and ids per feature). Moving it to the
device is one copy per tensor (``pin_memory()`` then ``to(device, non_blocking=True)``)
instead of two or three per feature; on the device ``torch.ops.fxrec.permute_and_split`` (see
:mod:`fxrec.sparse.ops`) recovers each feature in any order.

Validation happens here, on the host, before any device work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

from fxrec.compiling import is_compiling
from fxrec.sparse.jagged_tensor import JaggedTensor
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.ops import permute_and_split

__all__ = ["CombinedFeatures", "pack_features", "combined_to_kjt", "unpack_features"]


@dataclass(frozen=True)
class CombinedFeatures:
    """All features of a batch in one values / lengths (/ weights) tensor, key-major.

    ``stride_per_key[i]`` rows and ``length_per_key[i]`` ids belong to ``keys[i]``; these
    Python ints let the device side size its outputs without reading device memory.
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None
    stride_per_key: tuple[int, ...]
    length_per_key: tuple[int, ...]

    def _map(self, fn: Any) -> CombinedFeatures:
        return CombinedFeatures(
            self.keys,
            fn(self.values),
            fn(self.lengths),
            None if self.weights is None else fn(self.weights),
            self.stride_per_key,
            self.length_per_key,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CombinedFeatures:
        """One copy per tensor (2, or 3 when weighted), whatever the number of features."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> CombinedFeatures:
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: Any) -> None:
        for t in (self.values, self.lengths, self.weights):
            if t is not None:
                t.record_stream(stream)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a host-to-device transfer moves."""
        return [t for t in (self.values, self.lengths, self.weights) if t is not None]

    def kjt_slice(self, start: int, count: int, weighted: bool = True) -> KeyedJaggedTensor:
        """Features ``start .. start+count`` as a KJT of views (no copy), without weights
        unless ``weighted``.

        Asked again, the same slice is the same object (kept with these features, which are
        immutable): a train pipeline that sends a batch's ids early registers its exchange
        under the very KJT the model's graph later rebuilds from the batch.
        """
        key = (start, count, weighted and self.weights is not None)
        compiling = is_compiling()
        kept = {} if compiling else self.__dict__.setdefault(_SLICES, {})
        kjt = kept.get(key)
        if kjt is None:
            kjt = _slice(self, *key)
            if not compiling:
                kept[key] = kjt
        return kjt

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the kept slices behind (views of the original tensors)."""
        state = dict(self.__dict__)
        state.pop(_SLICES, None)
        return state

    def kept_slices(self) -> dict[tuple[int, int, bool], KeyedJaggedTensor]:
        """The slices :meth:`kjt_slice` made, by ``(start, count, weighted)``."""
        return dict(self.__dict__.get(_SLICES, {}))

    def index(self, keys: Sequence[str]) -> list[int]:
        """Positions of ``keys`` (``ValueError`` naming an unknown key)."""
        pos = {k: i for i, k in enumerate(self.keys)}
        out = []
        for k in keys:
            if k not in pos:
                raise ValueError(
                    f"feature {k!r} is not in these combined features ({list(self.keys)[:10]})."
                )
            out.append(pos[k])
        return out


_SLICES = "_fxrec_kjt_slices"


def _slice(cf: CombinedFeatures, start: int, count: int, weighted: bool) -> KeyedJaggedTensor:
    lpk = cf.length_per_key
    spk = cf.stride_per_key
    a, b = sum(lpk[:start]), sum(lpk[: start + count])
    la, lb = sum(spk[:start]), sum(spk[: start + count])
    mine = list(spk[start : start + count])
    uniform = all(s == mine[0] for s in mine) if mine else True
    return KeyedJaggedTensor._make(
        list(cf.keys[start : start + count]),
        cf.values[a:b],
        cf.weights[a:b] if weighted and cf.weights is not None else None,
        cf.lengths[la:lb],
        stride=(mine[0] if mine else 0) if uniform else None,
        stride_per_key=None if uniform else mine,
        length_per_key=list(lpk[start : start + count]),
    )


def pack_features(
    features: KeyedJaggedTensor | TensorDictBase | Mapping[str, JaggedTensor],
    keys: Sequence[str] | None = None,
) -> CombinedFeatures:
    """Combine ``features`` (optionally only/in the order of ``keys``) into one set of tensors.

    A KJT already is combined: with its own key order this costs nothing (no copy).
    """
    from fxrec.sparse.tensordict_interop import kjt_from_tensordict

    if isinstance(features, KeyedJaggedTensor):
        kjt = features
        if keys is not None and list(keys) != kjt.keys():
            idx = kjt.index_per_key()
            missing = [k for k in keys if k not in idx]
            if missing:
                raise ValueError(
                    f"features {missing[:5]} are not in the KeyedJaggedTensor ({kjt.keys()[:10]})."
                )
            kjt = kjt.permute([idx[k] for k in keys])
    elif isinstance(features, TensorDictBase):
        kjt = kjt_from_tensordict(features, keys)
    elif isinstance(features, Mapping) and _holds_njts(features, keys):
        kjt = kjt_from_tensordict(features, keys)  # read as a TensorDict's entries are
    elif isinstance(features, Mapping):
        names = list(features) if keys is None else list(keys)
        missing = [k for k in names if k not in features]
        if missing:
            raise ValueError(f"features {missing[:5]} are not in the dict ({list(features)[:10]}).")
        kjt = KeyedJaggedTensor.from_jt_dict({k: features[k] for k in dict.fromkeys(names)})
        if kjt.keys() != names:  # a repeated key repeats, as for a KJT or a TensorDict
            idx = kjt.index_per_key()
            kjt = kjt.permute([idx[k] for k in names])
    else:
        raise ValueError(
            f"pack_features takes a KeyedJaggedTensor, a TensorDict or a dict of JaggedTensor or "
            f"of jagged nested tensors, got {type(features).__name__}."
        )
    weights = kjt.weights_or_none()
    return CombinedFeatures(
        tuple(kjt.keys()),
        kjt.values().contiguous(),
        kjt.lengths().contiguous(),
        None if weights is None else weights.contiguous(),
        tuple(kjt.stride_per_key()),
        tuple(kjt.length_per_key()),
    )


def _holds_njts(features: Mapping[str, Any], keys: Sequence[str] | None) -> bool:
    """A dict of jagged nested tensors (a TensorDict's entries), not of JaggedTensors."""
    from fxrec.sparse.tensordict_interop import is_njt

    names = list(features) if keys is None else [k for k in keys if k in features]
    return any(is_njt(features[k]) or isinstance(features[k], Mapping) for k in names)


def combined_to_kjt(cf: CombinedFeatures, keys: Sequence[str] | None = None) -> KeyedJaggedTensor:
    """A KJT over the combined tensors: a zero-copy view, or permuted to ``keys``' order."""
    kjt = _slice(cf, 0, len(cf.keys), True)
    if keys is None or list(keys) == list(cf.keys):
        return kjt
    return kjt.permute(cf.index(keys))


def unpack_features(
    cf: CombinedFeatures, keys: Sequence[str] | None = None
) -> dict[str, JaggedTensor]:
    """Per-feature JaggedTensors (in ``keys``' order) via ONE ``permute_and_split`` call."""
    names = list(cf.keys) if keys is None else list(keys)
    order = cf.index(names)
    vals, lens, wts = permute_and_split(
        cf.values, cf.lengths, cf.weights, cf.stride_per_key, cf.length_per_key, order
    )
    return {
        k: JaggedTensor._make(vals[i], wts[i] if wts else None, lens[i], None)
        for i, k in enumerate(names)
    }


def _cf_flatten(cf: CombinedFeatures) -> tuple[list[Any], Any]:
    return [cf.values, cf.lengths, cf.weights], (cf.keys, cf.stride_per_key, cf.length_per_key)


def _cf_unflatten(leaves: Any, ctx: Any) -> CombinedFeatures:
    values, lengths, weights = leaves
    keys, spk, lpk = ctx
    return CombinedFeatures(keys, values, lengths, weights, spk, lpk)


pytree.register_pytree_node(
    CombinedFeatures,
    _cf_flatten,
    _cf_unflatten,
    serialized_type_name="fxrec.sparse.CombinedFeatures",
)
