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
both checks the layout and yields ``length_per_key``; no per-row work. When the features'
values are already adjacent slices of one buffer in key order (a loader that fills one
buffer, or :func:`kjt_to_tensordict`), the KJT's values are a view of that buffer and nothing
is copied; the same holds for offsets and weights. NJTs that carry both offsets and lengths
(non-contiguous, e.g. from ``torch.nested.narrow``) or offsets that do not start at 0 are
compacted correctly, per feature, off the fast path. :func:`tensordict_parts` does the same
work short of the joins, for a caller that copies the features once into its own buffer.

A pipeline's host stage can convert ahead of the step with :func:`prepare_kjt`; the model's
own ``kjt_from_tensordict`` on that TensorDict then returns the prepared KJT.

The same entries are read from a plain dict, and from per-sample TensorDicts lazily stacked
into a batch (each feature read as one NJT). On the ``meta`` device nothing is read back:
NJTs are taken as dense, with their values' counts, for shape inference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from fxrec.compiling import is_compiling
from fxrec.sparse import validation as V
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.segments import cumsum_list, single_threaded

__all__ = [
    "JaggedParts",
    "is_njt",
    "join_values",
    "kjt_from_tensordict",
    "kjt_to_tensordict",
    "prepare_kjt",
    "prepared_kjts",
    "record_conversions",
    "tensordict_from_jagged",
    "tensordict_parts",
]

try:
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
except ImportError:  # pragma: no cover - very old torch
    _NJT = None


def is_njt(x: Any) -> bool:
    """A jagged-layout nested tensor (``layout=torch.jagged``)."""
    if _NJT is not None:
        return type(x) is _NJT
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.jagged


# -- building TensorDicts ------------------------------------------------------------------------


def _njt(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``nested_tensor_from_jagged(values, offsets)`` at a quarter of its host cost.

    The public constructor dispatches a view op through Python (~60 us per NJT); building the
    NJT directly (~15 us) gives the same tensor, minus the autograd view link, so it is used
    only where no link is needed (no grad, not tracing or compiling).
    """
    if (
        _NJT is None
        or type(values) is not torch.Tensor
        or type(offsets) is not torch.Tensor
        or values.requires_grad
        or torch._C._len_torch_dispatch_stack() > 0  # fake or proxy modes record the view op
        or is_compiling()
    ):
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    return _NJT(values, offsets)


def _new_td(entries: dict[str, Any], batch: Sequence[int], device: torch.device | None) -> Any:
    """A TensorDict of entries known to be consistent: no per-entry shape/device checks."""
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)
    if new_unsafe is None:  # pragma: no cover - older tensordict
        return TensorDict(entries, batch_size=list(batch), device=device)
    return new_unsafe(entries, batch_size=torch.Size(batch), device=device)


def tensordict_from_jagged(
    keys: Sequence[str],
    values: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor] | None = None,
) -> TensorDict:
    """A TensorDict in this module's layout from per-feature ids, offsets (and weights).

    For loaders: builds each NJT and TensorDict directly, without the per-entry checks of the
    public constructors (several times cheaper per batch). Offsets are checked against the
    values on conversion (:func:`kjt_from_tensordict`), not here. A feature's ids and weights
    share its offsets tensor. Values that are adjacent slices of one buffer in key order
    convert to a KJT without a copy.
    """
    n = len(keys)
    if len(values) != n or len(offsets) != n or (weights is not None and len(weights) != n):
        raise ValueError(
            f"tensordict_from_jagged: {n} keys but {len(values)} values, {len(offsets)} "
            f"offsets{'' if weights is None else f', {len(weights)} weights'}."
        )
    if not keys:
        return TensorDict({}, batch_size=[])
    strides = [o.shape[0] - 1 for o in offsets]
    batch = [strides[0]] if all(s == strides[0] for s in strides) else []
    device = values[0].device
    entries: dict[str, Any] = {}
    for i, k in enumerate(keys):
        ids = _njt(values[i], offsets[i])
        if weights is None:
            entries[k] = ids
        else:
            w = _njt(weights[i], offsets[i])
            entries[k] = _new_td({"values": ids, "weights": w}, [strides[i]], device)
    return _new_td(entries, batch, device)


# -- preparing a conversion ahead of the step ----------------------------------------------------

_PREPARED = "_fxrec_prepared_kjts"
_recorders: list[list[tuple[Any, list[str]]]] = []


@contextlib.contextmanager
def record_conversions() -> Iterator[list[tuple[Any, list[str]]]]:
    """Collect ``(td, keys)`` for every :func:`kjt_from_tensordict` call in the block.

    A pipeline runs its first step under it to learn which TensorDicts of a batch its model
    converts, and with which keys, so that it can :func:`prepare_kjt` later batches.
    """
    log: list[tuple[Any, list[str]]] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def _snapshot(entries: list[Any]) -> list[Any]:
    """The objects a conversion read: entries and, for weighted ones, their two NJTs."""
    out: list[Any] = []
    for e in entries:
        out.append(e)
        if not is_njt(e) and isinstance(e, TensorDictBase):
            store = getattr(e, "_tensordict", None)
            if isinstance(store, dict):
                out += [store.get("values"), store.get("weights")]
            else:
                out += [e.get("values", None), e.get("weights", None)]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _versions(objs: list[Any]) -> list[Any]:
    """The version counters of the NJTs' tensors: an in-place edit (``values().add_(1)``,
    through any view) bumps them."""
    return [(o._values._version, o._offsets._version) if is_njt(o) else None for o in objs]


def prepare_kjt(td: TensorDictBase, keys: Sequence[str] | None = None) -> KeyedJaggedTensor:
    """Convert ``td`` now and keep the KJT with it.

    A later ``kjt_from_tensordict(td, keys)`` (same keys) returns this KJT without work, as
    long as ``td``'s entries are the same objects, unedited; replacing an entry, or editing
    its ids, offsets or weights in place, drops it. This moves the conversion to whoever
    calls this first: a train pipeline's host stage, off the step. Called again, it returns
    the KJT it kept, while that is still valid.
    """
    keys = list(td.keys()) if keys is None else list(keys)
    entries = _entries(td, keys) if keys else []
    kept = _lookup(td, keys, entries) if keys else None
    if kept is not None:  # prepared already, and still valid
        return kept
    kjt = _convert(td, keys, entries)
    attrs = getattr(td, "__dict__", None)
    if attrs is None:  # a TensorDict type without instance attributes: nothing to keep it in
        return kjt
    objs = _snapshot(entries)
    attrs.setdefault(_PREPARED, {})[tuple(keys)] = (objs, _versions(objs), kjt)
    return kjt


def prepared_kjts(td: Any) -> list[KeyedJaggedTensor]:
    """The KJTs :func:`prepare_kjt` kept with ``td`` (none for anything else)."""
    cache = getattr(td, "__dict__", {}).get(_PREPARED) if isinstance(td, TensorDictBase) else None
    return [kjt for _, _, kjt in cache.values()] if cache else []


def _lookup(td: Any, keys: list[str], entries: list[Any]) -> KeyedJaggedTensor | None:
    if not isinstance(td, TensorDictBase):  # a plain dict is never prepared (nor has __dict__)
        return None
    cache = getattr(td, "__dict__", {}).get(_PREPARED)
    if not cache:
        return None
    hit = cache.get(tuple(keys))
    if hit is None:
        return None
    objs, versions, kjt = hit
    now = _snapshot(entries)
    if not _same(objs, now) or _versions(now) != versions:
        return None
    return kjt


# -- TensorDict -> KJT ---------------------------------------------------------------------------


def _entries(td: TensorDictBase | Mapping[str, Any], keys: Sequence[str]) -> list[Any]:
    if isinstance(td, LazyStackedTensorDict):
        return _stacked_entries(td, keys)
    store = getattr(td, "_tensordict", None)  # plain dict behind a TensorDict: no per-key checks
    if not isinstance(store, dict):
        store = td if isinstance(td, dict) else dict(td.items())
    try:
        return [store[k] for k in keys]
    except KeyError:
        raise _missing(keys, store, "TensorDict" if hasattr(td, "batch_size") else "dict") from None


def _missing(keys: Sequence[str], store: Mapping[str, Any], where: str) -> ValueError:
    """Names the absent features; points nested groups (``td["user"]["a"]``) to a flat TD."""
    missing = [k for k in keys if k not in store]
    text = f"features {missing[:5]} are not in the {where} (it has {list(store)[:10]})."
    groups = [k for k, e in store.items() if _is_group(e)]
    if groups:
        text += (
            f" {groups[:5]} are nested groups of features, which are not read: flatten them "
            f'(td.flatten_keys(".") names their features "{groups[0]}.<feature>") and use '
            "those names as the tables' feature names, or give each feature a top-level key."
        )
    return ValueError(text)


def _is_group(e: Any) -> bool:
    """A sub-TensorDict (or dict) that is not a weighted feature's ``{"values", "weights"}``."""
    return isinstance(e, Mapping) and set(e.keys()) != {"values", "weights"}


def _stacked_entries(td: LazyStackedTensorDict, keys: Sequence[str]) -> list[Any]:
    """Per-sample TensorDicts lazily stacked into a batch: each feature read as one NJT.

    tensordict refuses a plain ``get`` of ragged entries (and stacks equal-length ones into a
    dense tensor); ``get(..., as_nested_tensor=True, layout=torch.jagged)`` gives the NJT,
    with offsets from 0, for any lengths.
    """
    if td.stack_dim != 0 or td.batch_dims != 1:
        raise ValueError(
            f"a LazyStackedTensorDict of batch_size {list(td.batch_size)} stacked on dim "
            f"{td.stack_dim} is not read: stack per-sample TensorDicts (batch_size=[]) on dim 0, "
            "or convert each feature with td.get(key, as_nested_tensor=True, layout=torch.jagged) "
            "into a TensorDict of batch_size [B]."
        )
    have = set(td.keys())
    if any(k not in have for k in keys):
        raise _missing(keys, dict.fromkeys(have), "TensorDict")
    first = td.tensordicts[0] if td.tensordicts else None
    out = []
    for k in keys:
        try:
            if first is not None and isinstance(first.get(k), TensorDictBase):
                parts = {f: _stacked_njt(td, (k, f)) for f in ("values", "weights")}
                out.append(TensorDict(parts, batch_size=td.batch_size))
            else:
                out.append(_stacked_njt(td, k))
        except (RuntimeError, KeyError) as e:
            raise ValueError(
                f"feature {k!r}: the samples' entries do not stack into a jagged nested tensor "
                f"({e}); give each sample a 1-D tensor of ids (a {{'values', 'weights'}} "
                "sub-TensorDict of two 1-D tensors for a weighted feature)."
            ) from e
    return out


def _stacked_njt(td: LazyStackedTensorDict, key: str | tuple[str, str]) -> torch.Tensor:
    return td.get(key, as_nested_tensor=True, layout=torch.jagged)


def _split_weighted(key: str, e: Any) -> tuple[Any, Any]:
    if isinstance(e, Mapping):  # a sub-TensorDict (or, in a plain dict, a dict)
        store = e if isinstance(e, dict) else getattr(e, "_tensordict", None)
        if isinstance(store, dict) and "values" in store and "weights" in store:
            return store["values"], store["weights"]
        keys = set(e.keys())  # (``get`` of a missing key gives None in newer tensordict)
        if not {"values", "weights"} <= keys:
            raise ValueError(
                f"feature {key!r}: a sub-TensorDict entry is a weighted feature, "
                f'{{"values": ids_njt, "weights": weights_njt}}; got keys {sorted(map(str, keys))}. '
                'Nested groups of features are not read: flatten them (td.flatten_keys(".")) '
                "or give each feature a top-level key."
            )
        return e.get("values"), e.get("weights")
    return e, None


def _bad_entry(key: str, njt: Any, what: str = "ids") -> ValueError:
    desc = type(njt).__name__
    if isinstance(njt, torch.Tensor):
        desc = f"{desc} of shape {tuple(njt.shape)}, layout {njt.layout}"
    return ValueError(
        f"feature {key!r}: {what} must be a jagged nested tensor of shape [B, j] "
        f"(torch.nested.nested_tensor_from_jagged(values, offsets)); got {desc}."
    )


def kjt_from_tensordict(
    td: TensorDictBase | Mapping[str, Any], keys: Sequence[str] | None = None
) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor with the features ``keys`` (default: all, in the TD's order).

    Keeps weights (sub-TensorDict ``{"values", "weights"}`` entries) and per-feature batch
    sizes. Raises ``ValueError`` naming the feature for malformed entries. Returns the KJT
    :func:`prepare_kjt` kept for these keys, if any. ``td`` may also be a plain dict of the
    same entries (each feature's rows are its NJT's), or per-sample TensorDicts stacked with
    ``LazyStackedTensorDict.lazy_stack(samples)``.
    """
    if is_compiling():
        return _converted_eagerly(td, keys)
    return _kjt_from_tensordict(td, keys)


def _kjt_from_tensordict(
    td: TensorDictBase | Mapping[str, Any], keys: Sequence[str] | None
) -> KeyedJaggedTensor:
    keys = list(td.keys()) if keys is None else list(keys)
    if _recorders and isinstance(td, TensorDictBase):  # (a plain dict cannot be prepared)
        for log in _recorders:
            log.append((td, keys))
    if not keys:
        return KeyedJaggedTensor.empty()
    entries = _entries(td, keys)
    prepared = _lookup(td, keys, entries)
    if prepared is not None:
        return prepared
    return _convert(td, keys, entries)


# Under dynamo (a model fxrec captures with it, ``torch.compile``), the conversion runs as
# written: it is host work (rows per key, offsets read back), which dynamo would split into
# frames of this module's functions guarded on each batch's rows. Those frames are shared by
# every compiled model and input signature, and would reach dynamo's recompile limit after a
# few batch sizes or rows per key.
_converted_eagerly = torch.compiler.disable(_kjt_from_tensordict)


@dataclass(frozen=True)
class JaggedParts:
    """A TensorDict's features before their values are joined into one buffer.

    What :func:`kjt_from_tensordict` would copy into a KJT's values (and weights), left as
    per-feature tensors for a caller that copies them once into its own buffer (the packer of
    :func:`~fxrec.passes.combine_inputs.combine_inputs`) instead of twice.
    """

    keys: list[str]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    weights: list[torch.Tensor] | None
    stride_per_key: list[int]
    length_per_key: list[int]

    @staticmethod
    def of_kjt(kjt: KeyedJaggedTensor) -> JaggedParts:
        """A KJT's features as one part each of values (and weights)."""
        w = kjt.weights_or_none()
        return JaggedParts(
            list(kjt.keys()),
            [kjt.values()],
            kjt.lengths(),
            None if w is None else [w],
            kjt.stride_per_key(),
            kjt.length_per_key(),
        )


def tensordict_parts(td: TensorDictBase, keys: Sequence[str] | None = None) -> JaggedParts:
    """The features ``keys`` of ``td`` as :class:`JaggedParts`, checked as on conversion.

    A KJT kept by :func:`prepare_kjt` for these keys comes back as one part (no work).
    """
    keys = list(td.keys()) if keys is None else list(keys)
    if not keys:
        return JaggedParts([], [], torch.empty(0, dtype=torch.long), None, [], [])
    entries = _entries(td, keys)
    prepared = _lookup(td, keys, entries)
    if prepared is not None:
        return JaggedParts.of_kjt(prepared)
    parts = _parts(td, keys, entries)
    _check_parts(parts)
    return parts


def _convert(
    td: TensorDictBase | Mapping[str, Any], keys: list[str], entries: list[Any]
) -> KeyedJaggedTensor:
    if not keys:
        return KeyedJaggedTensor.empty()
    p = _parts(td, keys, entries)
    # Checked once on the joined tensors; the parts are searched only to name a bad feature.
    try:
        values = join_values(p.values)
        weights = None if p.weights is None else join_values(p.weights)
    except RuntimeError:
        _check_parts(p)
        raise
    if values.dim() != 1 or (weights is not None and weights.dim() != 1):
        _check_parts(p)
    if V.validation_enabled():
        if _not_ids(values.dtype):
            _check_parts(p)
        V.check_weights(weights, values)
    spk = p.stride_per_key
    uniform = all(s == spk[0] for s in spk)
    return KeyedJaggedTensor._make(
        keys,
        values,
        weights,
        p.lengths,
        stride=spk[0] if uniform else None,
        stride_per_key=None if uniform else spk,
        length_per_key=p.length_per_key,
    )


def _check_parts(p: JaggedParts) -> None:
    """Per feature: one id (and weight) per position; with validation, integer ids and
    float weights. Raises ``ValueError`` naming the first bad feature."""
    _check_dims(p.keys, p.values)
    if p.weights is not None:
        _check_dims(p.keys, p.weights)
    if V.validation_enabled():
        _check_ids(p.keys, p.values)
        if p.weights is not None:
            for k, w, v in zip(p.keys, p.weights, p.values):
                V.check_weights(w, v, k)


def _parts(
    td: TensorDictBase | Mapping[str, Any], keys: list[str], entries: list[Any]
) -> JaggedParts:
    # A TensorDict's batch_size binds every entry's first dim: one batch size for all keys
    # (a plain dict has none: each NJT's rows count).
    size = getattr(td, "batch_size", None)
    batch = int(size[0]) if size else None
    if set(map(type, entries)) == {_NJT}:  # one C-level pass: the common, unweighted case
        values, lengths, spk, lpk = _concat(keys, entries, batch)
        weights = None
    else:
        values, lengths, weights, spk, lpk = _weighted(keys, entries, batch)
    return JaggedParts(keys, values, lengths, weights, spk, lpk)


def _weighted(
    keys: list[str], entries: list[Any], batch: int | None
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor] | None, list[int], list[int]]:
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
    if _shares_layout(wts, ids, lpk):
        weights = [w._values for w in wts]
    else:
        weights, w_lengths, _, _ = _concat(keys, wts, batch)
        if not lengths.is_meta and not torch.equal(w_lengths, lengths):  # (meta: no numbers)
            raise ValueError(
                "the weights' offsets differ from the ids' offsets; build each weights NJT "
                "with the ids' offsets (nested_tensor_from_jagged(weights, ids.offsets()))."
            )
    return values, lengths, weights, spk, lpk


def _shares_layout(wts: list[Any], ids: list[Any], lpk: list[int]) -> bool:
    """Weights on the ids' own offsets, dense and complete: their values need no lengths work.

    ``lpk`` (the ids' counts after any compaction) equal to both raw value counts rules out
    holes and shifted offsets, which would need the weights compacted the same way.
    """
    return all(
        w._offsets is n._offsets
        and w._lengths is None
        and n._lengths is None
        and w._values.shape[0] == n._values.shape[0] == c
        for w, n, c in zip(wts, ids, lpk)
    )


def _concat(
    keys: list[str], njts: list[Any], batch: int | None
) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int]]:
    """(values per key, lengths, stride_per_key, length_per_key) of the NJTs, key-major."""
    offs = [n._offsets for n in njts]
    vals = [n._values for n in njts]
    spk = [batch] * len(njts) if batch is not None else [o.shape[0] - 1 for o in offs]
    if offs and offs[0].is_meta:
        return _meta_lengths(keys, njts, offs, vals, spk)
    if any(n._lengths is not None for n in njts):
        return _concat_slow(keys, njts, spk)
    validate = V.validation_enabled()
    # Small lengths work: one thread (see single_threaded: on a busy host an OpenMP team can
    # stall for milliseconds).
    with single_threaded():
        return _lengths_from_offsets(keys, njts, offs, vals, spk, validate)


def _meta_lengths(
    keys: list[str],
    njts: list[Any],
    offs: list[torch.Tensor],
    vals: list[torch.Tensor],
    spk: list[int],
) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int]]:
    """Meta-device NJTs (shape inference) hold no offsets to read or check: each is taken as
    dense (offsets from 0 to its values' count, as every NJT without lengths is built)."""
    holed = [k for k, n in zip(keys, njts) if n._lengths is not None]
    if holed:
        raise ValueError(
            f"features {holed[:5]}: meta-device NJTs with lengths (holes, as torch.nested.narrow "
            "makes) have no known id count; build them from offsets only."
        )
    lengths = torch.cat([o[1:] - o[:-1] for o in offs])
    return vals, lengths, spk, [v.shape[0] for v in vals]


def _lengths_from_offsets(
    keys: list[str],
    njts: list[Any],
    offs: list[torch.Tensor],
    vals: list[torch.Tensor],
    spk: list[int],
    validate: bool,
) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int]]:
    k = len(njts)
    offsets = torch.cat(offs)  # small: cheaper than proving adjacency key by key
    s0 = spk[0]
    if all(s == s0 for s in spk):
        grid = offsets.view(k, s0 + 1)
        lengths = (grid[:, 1:] - grid[:, :-1]).reshape(-1)
        ends = grid[:, :: max(s0, 1)]  # columns 0 and s0: a view, read without a kernel
        pairs = ends.tolist() if s0 else [[r[0], r[0]] for r in ends.tolist()]
        first = [p[0] for p in pairs]
        last = [p[1] for p in pairs]
    else:
        # One diff over all keys; each key's rows are its slice without the junction entry
        # (slicing and one cat beat boolean-mask indexing, which counts the mask first).
        bounds = cumsum_list([s + 1 for s in spk])
        diffs = offsets[1:] - offsets[:-1]
        lengths = torch.cat([diffs[b : e - 1] for b, e in pairwise(bounds)])
        ends = bounds[:-1] + [b - 1 for b in bounds[1:]]
        edges = V.read_ints(
            offsets.index_select(0, torch.tensor(ends, dtype=torch.long, device=offsets.device))
        )
        first, last = edges[:k], edges[k:]
    if any(first) or last != [v.shape[0] for v in vals]:
        return _concat_slow(keys, njts, spk)  # holes or shifted offsets: compact
    if validate and lengths.numel() and int(lengths.min()) < 0:
        bad = next(
            kk for kk, n in zip(keys, njts) if bool((n._offsets[1:] < n._offsets[:-1]).any())
        )
        raise ValueError(f"feature {bad!r}: offsets decrease (a negative bag length).")
    return vals, lengths, spk, last


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` as a view, when the parts already lie end to end in one buffer.

    A loader that fills one buffer (or :func:`kjt_to_tensordict`) gives such parts; the view
    saves the copy. Separately allocated parts fail the address test at the first pair, so
    other inputs pay about a microsecond. ``None``: not adjacent, so copy.
    """
    p0, end, total = None, 0, 0
    size = parts[0].element_size()
    for p in parts:  # addresses only (cheap C calls); empty parts have none (data_ptr 0)
        n = p.numel()
        if not n:
            continue
        if p0 is None:
            p0, end = p, p.data_ptr()
        elif p.data_ptr() != end:
            return None
        end += n * size
        total += n
    if p0 is None:
        return None
    d0 = p0.dtype
    if not all(
        p.dtype is d0 and p.dim() == 1 and p.is_contiguous() and not p.requires_grad for p in parts
    ):
        return None
    try:  # bounds-checked against p0's storage: the range is inside one live allocation
        return p0.as_strided((total,), (1,))
    except RuntimeError:
        return None


def join_values(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D parts, or a view when they lie end to end (:func:`_joined`)."""
    parts = list(parts)
    joined = _joined(parts)
    return joined if joined is not None else torch.cat(parts)


def _not_ids(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex or dtype == torch.bool


def _check_ids(keys: list[str], vals: list[torch.Tensor]) -> None:
    for k, v in zip(keys, vals):
        if _not_ids(v.dtype):
            V.check_ids(v, k)


def _check_dims(keys: list[str], vals: list[torch.Tensor]) -> None:
    """One id (or weight) per position: each NJT's values must be 1-D."""
    for k, v in zip(keys, vals):
        if v.dim() != 1:
            raise ValueError(
                f"feature {k!r}: expected one id (or weight) per position, an NJT of shape "
                f"[B, j]; got values of shape {tuple(v.shape)}."
            )


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
    keys: list[str], njts: list[Any], spk: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int]]:
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
    return vals, torch.cat(lens), spk, [v.shape[0] for v in vals]


def kjt_to_tensordict(kjt: KeyedJaggedTensor) -> TensorDict:
    """A TensorDict of jagged nested tensors, one per feature (see the module docstring).

    Per-feature offsets are rows of one batched cumsum; each NJT views ``kjt.values()``, so
    converting back is copy-free.
    """
    keys = kjt.keys()
    if not keys:
        return TensorDict({}, batch_size=[])
    spk = kjt.stride_per_key()
    lpk = kjt.length_per_key()
    offsets = _per_key_offsets(kjt.lengths(), spk, lpk)
    vals = list(torch.split(kjt.values(), lpk))
    w = kjt.weights_or_none()
    wts = list(torch.split(w, lpk)) if w is not None else None
    return tensordict_from_jagged(keys, vals, offsets, wts)


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
