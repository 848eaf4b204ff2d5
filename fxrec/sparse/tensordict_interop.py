"""TensorDict <-> KeyedJaggedTensor, with per-id weights and a variable batch size per key.

Layout of the TensorDict (one entry per feature, in key order):

* unweighted feature: ``td[key]`` is a jagged nested tensor (``layout=torch.jagged``) of shape
  ``[B_key, j]`` holding the ids;
* weighted feature: ``td[key]`` is a sub-TensorDict ``{"values": ids_njt, "weights": w_njt}``
  whose two NJTs share offsets.

The weighted layout mirrors TorchRec's ``JaggedTensor(values=..., weights=...)``: a feature
stays ONE entry under its own name (so ``td[key]``, ``td.keys()``, ``td.select(...)`` and
``td.exclude(...)`` keep meaning "features"), and the field names are the accessors a TorchRec
user already calls. A parallel ``td["weights"]`` sub-dict would instead steal a feature name
and let ids and weights of one feature be selected apart.

If every feature has the same batch size the TensorDict gets ``batch_size=[B]``; otherwise
``batch_size=[]`` and each feature keeps its own (a variable-batch KJT).

The conversion to a KJT is a host hot path: one ``cat`` for values, one for offsets (lengths
come out of it in one vectorised step), one for weights, and a single small host read that
both checks the layout and yields ``length_per_key``; no per-row work. NJTs that carry both
offsets and lengths (non-contiguous, e.g. from ``torch.nested.narrow``) or offsets that do not
start at 0 are compacted correctly, per feature, off the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from fxrec.sparse import validation as V
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.segments import cumsum_list, single_threaded

__all__ = ["kjt_from_tensordict", "kjt_to_tensordict", "is_njt"]

try:
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
except ImportError:  # pragma: no cover - very old torch
    _NJT = None


def is_njt(x: Any) -> bool:
    """A jagged-layout nested tensor (``layout=torch.jagged``)."""
    if _NJT is not None:
        return type(x) is _NJT
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.jagged


def _entries(td: TensorDictBase, keys: Sequence[str]) -> list[Any]:
    store = getattr(td, "_tensordict", None)  # plain dict behind a TensorDict: no per-key checks
    if not isinstance(store, dict):
        store = dict(td.items())
    try:
        return [store[k] for k in keys]
    except KeyError:
        missing = [k for k in keys if k not in store]
        raise ValueError(
            f"features {missing[:5]} are not in the TensorDict (it has {list(store)[:10]})."
        ) from None


def _split_weighted(key: str, e: Any) -> tuple[Any, Any]:
    if isinstance(e, TensorDictBase):
        try:
            return e.get("values"), e.get("weights")
        except KeyError:
            raise ValueError(
                f"feature {key!r}: a weighted feature must be a sub-TensorDict "
                f'{{"values": ids_njt, "weights": weights_njt}}; got keys {list(e.keys())}.'
            ) from None
    return e, None


def _bad_entry(key: str, njt: Any, what: str = "ids") -> ValueError:
    desc = type(njt).__name__
    if isinstance(njt, torch.Tensor):
        desc = f"{desc} of shape {tuple(njt.shape)}, layout {njt.layout}"
    return ValueError(
        f"feature {key!r}: {what} must be a jagged nested tensor of shape [B, j] "
        f"(torch.nested.nested_tensor_from_jagged(values, offsets)); got {desc}."
    )


def kjt_from_tensordict(td: TensorDictBase, keys: Sequence[str] | None = None) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor with the features ``keys`` (default: all, in the TD's order).

    Keeps weights (sub-TensorDict ``{"values", "weights"}`` entries) and per-feature batch
    sizes. Raises ``ValueError`` naming the feature for malformed entries.
    """
    keys = list(td.keys()) if keys is None else list(keys)
    if not keys:
        return KeyedJaggedTensor.empty()
    entries = _entries(td, keys)
    # A TensorDict's batch_size binds every entry's first dim: one batch size for all keys.
    batch = int(td.batch_size[0]) if len(td.batch_size) else None
    if set(map(type, entries)) == {_NJT}:  # one C-level pass: the common, unweighted case
        values, lengths, spk, lpk = _concat(keys, entries, batch)
        weights = None
    else:
        values, lengths, weights, spk, lpk = _weighted(keys, entries, batch)
    uniform = all(s == spk[0] for s in spk)
    return KeyedJaggedTensor._make(
        keys,
        values,
        weights,
        lengths,
        stride=spk[0] if uniform else None,
        stride_per_key=None if uniform else spk,
        length_per_key=lpk,
    )


def _weighted(
    keys: list[str], entries: list[Any], batch: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], list[int]]:
    pairs = [_split_weighted(k, e) for k, e in zip(keys, entries)]
    ids = [p[0] for p in pairs]
    wts = [p[1] for p in pairs]
    weighted = [w is not None for w in wts]
    for k, n in zip(keys, ids):
        if not is_njt(n):
            raise _bad_entry(k, n)
    if not any(weighted):
        values, lengths, spk, lpk = _concat(keys, ids, batch)
        return values, lengths, None, spk, lpk
    if not all(weighted):
        missing = [k for k, w in zip(keys, weighted) if not w]
        raise ValueError(
            f"features {missing[:5]} have no weights while others do; make every feature a "
            f'{{"values", "weights"}} sub-TensorDict (weights of ones for unweighted ones).'
        )
    values, lengths, spk, lpk = _concat(keys, ids, batch)
    for k, w, n in zip(keys, wts, ids):
        if not is_njt(w):
            raise _bad_entry(k, w, "weights")
        if w._offsets is not n._offsets and w._offsets.shape[0] != n._offsets.shape[0]:
            raise ValueError(
                f"feature {k!r}: weights have {w._offsets.shape[0] - 1} rows but ids have "
                f"{n._offsets.shape[0] - 1}."
            )
    weights, w_lengths, _, _ = _concat(keys, wts, batch, ids=False)
    if not all(w._offsets is n._offsets for w, n in zip(wts, ids)) and not torch.equal(
        w_lengths, lengths
    ):
        raise ValueError(
            "the weights' offsets differ from the ids' offsets; build each weights NJT with "
            "the ids' offsets (nested_tensor_from_jagged(weights, ids.offsets()))."
        )
    if V.validation_enabled():
        V.check_weights(weights, values)
    return values, lengths, weights, spk, lpk


def _concat(
    keys: list[str], njts: list[Any], batch: int | None, ids: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """(values, lengths, stride_per_key, length_per_key) of the NJTs, key-major."""
    offs = [n._offsets for n in njts]
    vals = [n._values for n in njts]
    spk = [batch] * len(njts) if batch is not None else [o.shape[0] - 1 for o in offs]
    if any(n._lengths is not None for n in njts):
        return _concat_slow(keys, njts, spk, ids)
    validate = V.validation_enabled()
    # The big copy may use every thread; the small lengths work runs on one (see
    # single_threaded: on a busy host an OpenMP team can stall for milliseconds).
    values = _cat_values(keys, vals)
    with single_threaded():
        return _lengths_from_offsets(keys, njts, offs, vals, values, spk, validate, ids)


def _lengths_from_offsets(
    keys: list[str],
    njts: list[Any],
    offs: list[torch.Tensor],
    vals: list[torch.Tensor],
    values: torch.Tensor,
    spk: list[int],
    validate: bool,
    ids: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    k = len(njts)
    offsets = torch.cat(offs)
    s0 = spk[0]
    if all(s == s0 for s in spk):
        grid = offsets.view(k, s0 + 1)
        lengths = (grid[:, 1:] - grid[:, :-1]).reshape(-1)
        ends = grid[:, :: max(s0, 1)]  # columns 0 and s0: a view, read without a kernel
        pairs = ends.tolist() if s0 else [[r[0], r[0]] for r in ends.tolist()]
        first = [p[0] for p in pairs]
        last = [p[1] for p in pairs]
    else:
        bounds = cumsum_list([s + 1 for s in spk])
        starts = torch.tensor(bounds[:-1], dtype=torch.long, device=offsets.device)
        stops = torch.tensor([b - 1 for b in bounds[1:]], dtype=torch.long, device=offsets.device)
        edges = V.read_ints(
            torch.cat([offsets.index_select(0, starts), offsets.index_select(0, stops)])
        )
        first, last = edges[:k], edges[k:]
        keep_hi = torch.ones(offsets.numel(), dtype=torch.bool, device=offsets.device)
        keep_lo = keep_hi.clone()
        keep_hi[starts] = False
        keep_lo[stops] = False
        lengths = offsets[keep_hi] - offsets[keep_lo]
    if any(first) or last != [v.shape[0] for v in vals]:
        return _concat_slow(keys, njts, spk, ids)  # holes or shifted offsets: compact
    if validate and lengths.numel() and int(lengths.min()) < 0:
        bad = next(
            kk for kk, n in zip(keys, njts) if bool((n._offsets[1:] < n._offsets[:-1]).any())
        )
        raise ValueError(f"feature {bad!r}: offsets decrease (a negative bag length).")
    if ids and validate:
        _check_ids(keys, values, vals)
    return values, lengths, spk, last


def _cat_values(keys: list[str], vals: list[torch.Tensor]) -> torch.Tensor:
    """One ``cat``; per-bag values must be scalars (an NJT of shape ``[B, j]``)."""
    try:
        values = torch.cat(vals)
    except RuntimeError:
        values = None
    if values is None or values.dim() != 1:
        bad = next((k for k, v in zip(keys, vals) if v.dim() != 1), keys[0])
        raise ValueError(
            f"feature {bad!r}: expected one id (or weight) per position, an NJT of shape "
            f"[B, j]; got values of shape {tuple(vals[keys.index(bad)].shape)}."
        )
    return values


def _check_ids(keys: list[str], values: torch.Tensor, vals: list[torch.Tensor]) -> None:
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        bad = next(
            k for k, v in zip(keys, vals) if v.dtype.is_floating_point or v.dtype == torch.bool
        )
        V.check_ids(vals[keys.index(bad)], bad)


def _compact(njt: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of one NJT with holes or shifted offsets: a vectorised gather."""
    offsets = njt._offsets
    lengths = njt._lengths if njt._lengths is not None else offsets[1:] - offsets[:-1]
    lengths = lengths.to(offsets.dtype)
    total = int(lengths.sum()) if lengths.numel() else 0
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = offsets[:-1] - out_starts
    idx = torch.arange(total, device=offsets.device) + torch.repeat_interleave(
        shift, lengths, output_size=total
    )
    return njt._values.index_select(0, idx), lengths


def _concat_slow(
    keys: list[str], njts: list[Any], spk: list[int], ids: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    vals, lens = [], []
    for k, n in zip(keys, njts):
        if V.validation_enabled():
            o = n._offsets
            if o.numel() and int((o[1:] - o[:-1]).min() if o.numel() > 1 else 0) < 0:
                raise ValueError(f"feature {k!r}: offsets decrease (a negative bag length).")
            if n._lengths is not None and n._lengths.numel() and int(n._lengths.min()) < 0:
                raise ValueError(f"feature {k!r}: negative bag length.")
        v, ln = _compact(n)
        vals.append(v)
        lens.append(ln)
    values = _cat_values(keys, vals)
    if ids and V.validation_enabled():
        _check_ids(keys, values, vals)
    return values, torch.cat(lens), spk, [v.shape[0] for v in vals]


def kjt_to_tensordict(kjt: KeyedJaggedTensor) -> TensorDict:
    """A TensorDict of jagged nested tensors, one per feature (see the module docstring).

    Per-feature offsets come from one batched cumsum; each NJT views ``kjt.values()``.
    """
    keys = kjt.keys()
    if not keys:
        return TensorDict({}, batch_size=[])
    spk = kjt.stride_per_key()
    lpk = kjt.length_per_key()
    offsets = _per_key_offsets(kjt.lengths(), spk, lpk)
    vals = torch.split(kjt.values(), lpk)
    w = kjt.weights_or_none()
    wts = torch.split(w, lpk) if w is not None else None
    uniform = not kjt.variable_stride_per_key() or all(s == spk[0] for s in spk)
    batch = [spk[0]] if uniform else []
    out: dict[str, Any] = {}
    for i, k in enumerate(keys):
        ids = torch.nested.nested_tensor_from_jagged(vals[i], offsets=offsets[i])
        if wts is None:
            out[k] = ids
        else:
            wn = torch.nested.nested_tensor_from_jagged(wts[i], offsets=offsets[i])
            out[k] = TensorDict({"values": ids, "weights": wn}, batch_size=[spk[i]])
    return TensorDict(out, batch_size=batch)


def _per_key_offsets(lengths: torch.Tensor, spk: list[int], lpk: list[int]) -> list[torch.Tensor]:
    """Each key's offsets (``spk[k] + 1`` entries from 0), from one cumsum over all rows."""
    k = len(spk)
    lengths = lengths.long()
    s0 = spk[0]
    if all(s == s0 for s in spk):
        grid = lengths.new_zeros(k, s0 + 1)
        if s0:
            torch.cumsum(lengths.view(k, s0), dim=1, out=grid[:, 1:])
        return list(grid.unbind(0))
    glob = lengths.new_zeros(lengths.numel() + 1)
    if lengths.numel():
        torch.cumsum(lengths, 0, out=glob[1:])
    sizes = [s + 1 for s in spk]
    total = sum(sizes)
    seg = torch.repeat_interleave(
        torch.arange(k, device=lengths.device),
        torch.tensor(sizes, device=lengths.device),
        output_size=total,
    )
    idx = torch.arange(total, device=lengths.device) - seg
    base = torch.tensor(cumsum_list(lpk)[:-1], dtype=torch.long, device=lengths.device)
    flat = glob.index_select(0, idx) - base.index_select(0, seg)
    return list(torch.split(flat, sizes))
