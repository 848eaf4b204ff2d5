"""Combined sparse inputs (seed 000 §3.1, Fig. 3): one host-to-device copy set per batch.

A model whose ``forward`` takes many per-feature sparse inputs (separate ids/lengths[/weights]
tensors, single ``JaggedTensor`` s, dicts of them, a ``KeyedJaggedTensor``, a ``TensorDict``
of jagged tensors) is rewritten into one whose ``forward`` takes its dense inputs followed by
ONE :class:`~fxrec.sparse.CombinedFeatures` (one values, one lengths, optionally one weights
tensor). Moving a batch to the device then costs 2 copies (3 with weights) instead of 2-3 per
feature. :func:`combine_inputs` also returns the matching host-side :class:`InputPacker` for
the data loader: ``new(*packer(*args))`` computes exactly what ``model(*args)`` computes.

What the rewritten graph starts with:

* per-feature consumers (tensor arguments, ``JaggedTensor`` s, dicts of them) read the pieces
  of ONE ``torch.ops.fxrec.permute_and_split`` node;
* a KJT argument is rebuilt as a zero-copy view of its slice of the combined tensors (a KJT
  already is combined; splitting it to join it again would copy twice), TorchRec's KJT as
  TorchRec's (for models holding TorchRec's modules), and so is a TensorDict
  argument that feeds fxrec's own collections (which take KJTs); other TensorDict uses get a
  TensorDict of views over that slice. A TensorDict's dense (non-jagged) entries are not
  features: they travel as dense arguments and are put back into the rebuilt TensorDict,
  which has the example's batch dims and device-or-none (``td.shape``, ``td.numel()``).
  Per-sample TensorDicts lazily stacked are read as the collections read them: a sample's
  1-D integer tensor is a feature's ids (equal in number across samples or not), a
  ``{"values", "weights"}`` sub-TensorDict a weighted feature, other entries dense.
* a TensorDict mixing weighted and unweighted features (the layout the collections read:
  each reads its own) is packed as its unweighted features, then its weighted ones (one
  conversion each), and the combined features carry weights for every feature: ones for the
  unweighted ones, so still one weights tensor (3 copies). The KJT handed to fxrec's
  collections carries those ones, which an unweighted collection never reads; a rebuilt
  TensorDict (and ``packer.unpack``) gives the unweighted features back as plain jagged
  tensors, in the TensorDict's own order. (A weighted collection reading an unweighted
  feature, which the model itself refuses, would read weights of 1 from that KJT.) A KJT
  has weights for every key or none, so the question does not arise for KJT arguments:
  give a weighted collection its own KJT, as TorchRec's models do.

Order of use: ``new, packer = combine_inputs(model, args)``, then ``fxrec.optimize(new,
packer(*args))`` (the rebuilt arguments are tracing leaves, so the graph rules see the same
graph as before); in a train pipeline, pack in its ``host_fn``.

Per-batch sizes (rows and ids per feature) travel inside ``CombinedFeatures`` as host ints, so
the graph bakes in neither the batch size nor the number of ids; only the feature names and
their order are fixed, as they are in the model's signature.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torch import nn

from fxrec.graph import meta
from fxrec.graph.capture import CaptureError, capture_symbolic
from fxrec.graph.effects import eliminate_dead_code
from fxrec.sparse import (
    CombinedFeatures,
    JaggedTensor,
    KeyedJaggedTensor,
    from_torchrec,
    kjt_from_tensordict,
    kjt_to_tensordict,
    to_torchrec,
)
from fxrec.sparse import validation as V
from fxrec.sparse.tensordict_interop import JaggedParts, join_values, tensordict_parts

logger = logging.getLogger(__name__)

__all__ = ["InputPacker", "combine_inputs"]

# Slot kinds: how one argument of the original forward is carried.
_DENSE, _TENSORS, _JT, _JT_DICT, _KJT, _TD = "dense", "tensors", "jt", "jt_dict", "kjt", "td"
_TR_KJT = "torchrec_kjt"  # TorchRec's KeyedJaggedTensor: combined as ours, rebuilt as theirs
_KEYED = (_KJT, _TD, _TR_KJT)  # kinds rebuilt from one slice of the combined features


@dataclass(frozen=True)
class _Slot:
    kind: str
    positions: tuple[int, ...]  # argument positions (three for "tensors": values, lengths, weights)
    keys: tuple[str, ...] = ()  # features carried, in packing order
    start: int = 0  # index of the first of them among the combined features
    dense_keys: tuple[str, ...] = ()  # a TensorDict's dense entries, carried as dense arguments
    order: tuple[str, ...] = ()  # a TensorDict's entries, in its own order
    td_form: tuple[int, bool] = (1, True)  # a TensorDict's batch dims, and whether it has a device
    # a TensorDict mixing weighted and unweighted features: its unweighted keys, then its
    # weighted ones (``keys`` in that order), each read with one conversion; () otherwise
    groups: tuple[tuple[str, ...], ...] = ()

    def key_groups(self) -> tuple[tuple[str, ...], ...]:
        """The keys the packer reads with one conversion each."""
        return self.groups or (self.keys,)


# -- host side -----------------------------------------------------------------------------

_PER_FEATURE = (_TENSORS, _JT, _JT_DICT)  # kinds that hold one set of tensors per feature


class _Loose(NamedTuple):
    """The per-feature tensors of one argument (or of consecutive tensor features), not yet
    joined: the packer joins them all at once and checks them on the joined tensors, instead
    of building and validating a JaggedTensor and a KJT per feature (tens of microseconds
    each)."""

    keys: tuple[str, ...]
    values: list[torch.Tensor]
    lengths: list[torch.Tensor]
    weights: list[torch.Tensor | None]


@dataclass(frozen=True)
class _TensorRun:
    """Consecutive tensor features (slots of kind "tensors"): their argument positions, to
    gather them in one go."""

    keys: tuple[str, ...]
    values: tuple[int, ...]
    lengths: tuple[int, ...]
    weights: tuple[int, ...]  # -1: unweighted

    def gather(self, args: Sequence[Any]) -> _Loose:
        return _Loose(
            self.keys,
            [args[p] for p in self.values],
            [args[p] for p in self.lengths],
            [args[p] if p >= 0 else None for p in self.weights],
        )


def _plan(slots: Sequence[_Slot]) -> list[_Slot | _TensorRun]:
    """The sparse slots in packing order, consecutive tensor features merged into runs."""
    plan: list[_Slot | _TensorRun] = []
    run: list[_Slot] = []
    for s in [*slots, None]:
        if s is not None and s.kind == _DENSE:
            continue  # no features: a run goes on across it
        if s is not None and s.kind == _TENSORS:
            run.append(s)
            continue
        if run:
            keys = tuple(k for r in run for k in r.keys)
            pv, pl, pw = (tuple(r.positions[j] for r in run) for j in range(3))
            plan.append(_TensorRun(keys, pv, pl, pw))
            run = []
        if s is not None:
            plan.append(s)
    return plan


def _loose_of(slot: _Slot, args: Sequence[Any]) -> _Loose:
    """A per-feature slot's tensors, as given (checked by the packer once joined)."""
    if slot.kind == _TENSORS:
        pv, pl, pw = slot.positions
        return _Loose(slot.keys, [args[pv]], [args[pl]], [args[pw] if pw >= 0 else None])
    if slot.kind == _JT:
        jt = args[slot.positions[0]]
        if not isinstance(jt, JaggedTensor):
            raise ValueError(f"argument {slot.keys[0]!r} must be a JaggedTensor.")
        jts = [jt]
    else:
        d = args[slot.positions[0]]
        if not isinstance(d, Mapping):
            raise ValueError(f"argument {slot.positions[0]} must be a dict of JaggedTensor.")
        try:
            jts = [d[k] for k in slot.keys]
        except KeyError:
            missing = [k for k in slot.keys if k not in d]
            raise ValueError(
                f"features {missing[:5]} are missing from the dict argument."
            ) from None
        for k, jt in zip(slot.keys, jts):
            if not isinstance(jt, JaggedTensor):
                raise ValueError(
                    f"feature {k!r} of the dict argument {slot.positions[0]} must be a "
                    f"JaggedTensor, got {type(jt).__name__}."
                )
    return _Loose(
        slot.keys,
        [jt.values() for jt in jts],
        [jt.lengths() for jt in jts],
        [jt.weights_or_none() for jt in jts],
    )


def _kjts_of(part: _Loose) -> list[KeyedJaggedTensor]:
    """One validated KJT per feature (when validation is on): the checks the packer makes on
    the joined tensors, made feature by feature, to say which feature is wrong and how."""
    out = []
    for k, v, ln, w in zip(part.keys, part.values, part.lengths, part.weights):
        try:
            jt = JaggedTensor(v, w, lengths=ln)
            out.append(KeyedJaggedTensor.from_jt_dict({k: jt}))
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(
                msg if msg.startswith("feature ") else f"feature {k!r}: {msg}"
            ) from None
    return out


def _chunk_of(
    slot: _Slot, args: Sequence[Any]
) -> KeyedJaggedTensor | list[JaggedParts] | list[KeyedJaggedTensor]:
    """The slot's features as KJT(s), zero-copy for a KJT argument; a TensorDict's as its
    :class:`~fxrec.sparse.tensordict_interop.JaggedParts` (one per key group), copied once,
    by the packer."""
    if slot.kind in _PER_FEATURE:
        return _kjts_of(_loose_of(slot, args))
    if slot.kind in (_KJT, _TR_KJT):
        kjt = args[slot.positions[0]]
        if slot.kind == _TR_KJT and _is_torchrec_kjt(kjt):
            kjt = from_torchrec(kjt)  # zero-copy
        elif not isinstance(kjt, KeyedJaggedTensor) or slot.kind == _TR_KJT:
            want = "TorchRec's" if slot.kind == _TR_KJT else "fxrec's"
            raise ValueError(
                f"argument {slot.positions[0]} must be {want} KeyedJaggedTensor (as in the "
                f"example batch), got {type(kjt).__module__}.{type(kjt).__name__}."
            )
        if tuple(kjt.keys()) != slot.keys:
            kjt = kjt.permute(_index(kjt.keys(), slot.keys, "KeyedJaggedTensor"))
        return kjt
    td = args[slot.positions[0]]
    if not isinstance(td, TensorDictBase):
        raise ValueError(
            f"argument {slot.positions[0]} must be a TensorDict, got {type(td).__name__}."
        )
    return [tensordict_parts(td, keys) for keys in slot.key_groups()]


def _td_weighted(td: TensorDictBase, keys: Sequence[str]) -> list[bool]:
    """Which features of ``td`` are weighted (a ``{"values", "weights"}`` sub-TensorDict),
    as the collections read them: per-sample TensorDicts lazily stacked by their first
    sample's entries."""
    source = td
    if isinstance(td, LazyStackedTensorDict) and td.tensordicts:
        source = td.tensordicts[0]
    return [isinstance(source.get(k, None), Mapping) for k in keys]


def _weight_groups(keys: Sequence[str], weighted: Sequence[bool]) -> tuple[tuple[str, ...], ...]:
    """A TensorDict's features as (unweighted, weighted) key groups, each in the TensorDict's
    order; () when they all agree (one group, in the TensorDict's order)."""
    if all(weighted) or not any(weighted):
        return ()
    plain = tuple(k for k, w in zip(keys, weighted) if not w)
    return plain, tuple(k for k, w in zip(keys, weighted) if w)


def _is_torchrec_kjt(value: Any) -> bool:
    """TorchRec's KeyedJaggedTensor, recognised without importing TorchRec."""
    t = type(value)
    return t.__name__ == "KeyedJaggedTensor" and t.__module__.startswith("torchrec.")


def _index(have: Sequence[str], want: Sequence[str], what: str) -> list[int]:
    pos = {k: i for i, k in enumerate(have)}
    missing = [k for k in want if k not in pos]
    if missing:
        raise ValueError(
            f"features {missing[:5]} are not in the {what} (it has {list(have)[:10]})."
        )
    return [pos[k] for k in want]


@dataclass
class _Pieces:
    """What the packer joins, feature after feature, before joining it."""

    spk: list[int] = dataclasses.field(default_factory=list)  # rows per feature
    lpk: list[int] = dataclasses.field(default_factory=list)  # ids per feature
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    lengths: list[torch.Tensor] = dataclasses.field(default_factory=list)
    weights: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # KJT / TensorDict parts' tensors and their features, to name one of a wrong dtype
    owners: dict[str, list[tuple[list[str], torch.Tensor]]] = dataclasses.field(
        default_factory=lambda: {"ids": [], "lengths": []}
    )
    loose: list[_Loose] = dataclasses.field(default_factory=list)
    loose_at: list[int] = dataclasses.field(default_factory=list)  # their features' positions


class InputPacker:
    """Host side of :func:`combine_inputs`: the model's arguments -> the new module's.

    ``packer(*args)`` returns ``(*dense_args, features)``, the dense arguments followed by
    the dense (non-jagged) entries of TensorDict arguments, if any;
    ``packer.unpack(*new_args)`` gives the original arguments back (the round trip). Pack in the data loader (or a pipeline's
    ``host_fn``), then move ``features`` with ``features.to(device)``: 2 copies, 3 if weighted.
    Per-feature tensors (tensor features, JaggedTensors, dicts of them) are joined with one
    ``cat`` each and checked once on the joined tensors, with one host read; only when a
    check fails are the features checked one by one, to name the wrong one.
    """

    def __init__(
        self, slots: Sequence[_Slot], num_args: int, weighted: Sequence[bool], dtypes: Any
    ) -> None:
        self.slots = tuple(slots)
        self.num_args = num_args
        self.keys = tuple(k for s in self.slots for k in s.keys)
        self.weighted = tuple(weighted)  # per feature, in self.keys order
        self._dtypes = dtypes  # (values, lengths, weights) dtypes of the example batch
        self._plan = _plan(self.slots)

    @property
    def dense_positions(self) -> tuple[int, ...]:
        return tuple(s.positions[0] for s in self.slots if s.kind == _DENSE)

    def _td_entries(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The dense entries of the TensorDict arguments (after the dense arguments)."""
        out = []
        for s in self.slots:
            if s.kind == _TD and s.dense_keys:
                out += _dense_entries(args[s.positions[0]], s)
        return out

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if len(args) != self.num_args:
            raise ValueError(
                f"the packer takes the model's {self.num_args} arguments, got {len(args)}."
            )
        parts: list[Any] = []
        for s in self._plan:
            if isinstance(s, _TensorRun):
                parts.append(s.gather(args))
            elif s.kind in _PER_FEATURE:
                parts.append(_loose_of(s, args))
            elif s.kind == _TD:
                parts += self._td_parts(s, args)
            else:
                parts.append(_chunk_of(s, args))
        features = self._combine(parts)
        return (*(args[p] for p in self.dense_positions), *self._td_entries(args), features)

    def _td_parts(self, slot: _Slot, args: Sequence[Any]) -> list[JaggedParts]:
        """A TensorDict's features, one part per key group; a refused batch whose features
        are weighted otherwise than the example's is refused saying which feature differs."""
        try:
            return _chunk_of(slot, args)  # type: ignore[return-value]
        except ValueError:
            td = args[slot.positions[0]]
            if isinstance(td, TensorDictBase):
                self._check_weighted(slot.keys, _td_weighted(td, slot.keys), slot.start)
            raise

    def _combine(self, parts: list[Any]) -> CombinedFeatures:
        """One values, lengths (and weights) tensor for all parts, in order; per-feature
        tensors (:class:`_Loose`) are checked once, on the joined tensors."""
        acc = _Pieces()
        for part in parts:
            if isinstance(part, _Loose):
                self._add_loose(acc, part)
            else:
                self._add_keyed(
                    acc, part if isinstance(part, JaggedParts) else JaggedParts.of_kjt(part)
                )
        for name, dtype in (("ids", self._dtypes[0]), ("lengths", self._dtypes[1])):
            bad = [(keys, t.dtype) for keys, t in acc.owners[name] if t.dtype != dtype]
            if bad:
                keys, got = bad[0]
                raise _dtype_error(keys[0], name, got, dtype)
        if acc.loose:
            self._check_loose(acc.loose)
        try:
            joined = (
                _cat(acc.values),
                _cat(acc.lengths),
                _cat(acc.weights) if any(self.weighted) else None,
            )
        except (RuntimeError, TypeError):  # e.g. features on different devices
            self._explain(acc.loose)
            raise
        if acc.loose and any(t is not None and t.dim() != 1 for t in joined):
            self._explain(acc.loose)
            raise ValueError("the per-feature tensors must be 1-D (one id per position).")
        if acc.loose and V.validation_enabled():
            self._check_counts(acc, *joined)
        return CombinedFeatures(self.keys, *joined, tuple(acc.spk), tuple(acc.lpk))

    def _add_loose(self, acc: _Pieces, part: _Loose) -> None:
        """Per-feature tensors, as given: their sizes are host metadata (no reads)."""
        i, n = len(acc.spk), len(part.keys)
        self._check_weighted(part.keys, [w is not None for w in part.weights], i)
        acc.loose.append(part)
        acc.loose_at += range(i, i + n)
        try:
            acc.spk += [t.shape[0] for t in part.lengths]
            acc.lpk += [t.shape[0] for t in part.values]
        except (AttributeError, IndexError, TypeError):  # not tensors, or 0-d ones
            self._explain(acc.loose)
            raise
        acc.values += part.values
        acc.lengths += part.lengths
        if any(self.weighted):
            counts = acc.lpk[i:]
            plain = [c for c, w in zip(counts, part.weights) if w is None]
            if plain:  # one tensor of ones, sliced, for the features without weights
                dev = part.lengths[0].device
                ones = torch.ones(max(plain), dtype=self._dtypes[2], device=dev)
            acc.weights += [ones[:c] if w is None else w for c, w in zip(counts, part.weights)]

    def _add_keyed(self, acc: _Pieces, p: JaggedParts) -> None:
        """A KJT's or TensorDict's features, checked when they were built."""
        if len(p.values) == len(p.keys):
            acc.owners["ids"] += [([k], v) for k, v in zip(p.keys, p.values)]
        else:
            acc.owners["ids"].append((list(p.keys), p.values[0]))
        acc.owners["lengths"].append((list(p.keys), p.lengths))
        self._check_weighted(p.keys, [p.weights is not None] * len(p.keys), len(acc.spk))
        acc.spk += p.stride_per_key
        acc.lpk += p.length_per_key
        acc.values += p.values
        acc.lengths.append(p.lengths)
        if p.weights is not None:
            acc.weights += p.weights
        elif any(self.weighted):
            n = sum(p.length_per_key)
            acc.weights.append(torch.ones(n, dtype=self._dtypes[2], device=p.lengths.device))

    def _check_weighted(self, keys: Sequence[str], has: list[bool], start: int) -> None:
        """Each feature has weights in this batch exactly when it had in the example."""
        if has == list(self.weighted[start : start + len(has)]):
            return
        for j, (k, h) in enumerate(zip(keys, has)):
            if h != self.weighted[start + j]:
                now, then = ("has", "had none") if h else ("has no", "had weights")
                raise ValueError(
                    f"feature {k!r} {now} weights in this batch but {then} in the example "
                    "batch the model was combined for; every batch must agree."
                )

    def _check_loose(self, loose: list[_Loose]) -> None:
        """Per-feature tensors of the example's dtypes (weights: floating point), checked as
        sets over all features (whether they are 1-D shows on the joined tensors)."""
        ids_dtype, lengths_dtype, _ = self._dtypes
        try:
            ok = self._same_dtypes(loose, ids_dtype, lengths_dtype)
        except AttributeError:  # not tensors
            ok = False
        if not ok:
            self._explain(loose)
            raise ValueError("the per-feature tensors do not have the example batch's dtypes.")

    @staticmethod
    def _same_dtypes(loose: list[_Loose], ids_dtype: Any, lengths_dtype: Any) -> bool:
        ok = {v.dtype for p in loose for v in p.values} == {ids_dtype}
        ok = ok and {t.dtype for p in loose for t in p.lengths} == {lengths_dtype}
        if ok and V.validation_enabled():
            ok = all(
                d.is_floating_point
                for d in {t.dtype for p in loose for t in p.weights if t is not None}
            )
        return ok

    def _check_counts(
        self,
        acc: _Pieces,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> None:
        """One device, one weight per id, lengths >= 0 that count each feature's ids: checked
        on the joined tensors with one host read (the features' id counts are known)."""
        loose, spk, lpk = acc.loose, acc.spk, acc.lpk
        if lengths.device != values.device or (
            weights is not None and weights.device != values.device
        ):
            self._explain(loose)
            raise ValueError(
                f"the features' ids are on {values.device} but their lengths on "
                f"{lengths.device}{'' if weights is None else f', weights on {weights.device}'}; "
                "move them to one device."
            )
        if weights is not None and any(
            w is not None and w.shape[0] != v.shape[0]
            for p in loose
            for v, w in zip(p.values, p.weights)
        ):
            self._explain(loose)
            raise ValueError("a weighted feature has not one weight per id.")
        try:
            per_key = V.check_lengths_values(lengths, values.shape[0], self.keys, spk)
        except ValueError:
            self._explain(loose)
            raise
        if per_key == lpk:
            return
        bad = next((j for j in acc.loose_at if per_key[j] != lpk[j]), None)
        if bad is not None:
            self._explain(loose)
            raise ValueError(
                f"feature {self.keys[bad]!r}: lengths sum to {per_key[bad]} but it has "
                f"{lpk[bad]} ids; its lengths must count exactly its ids."
            )

    def _explain(self, loose: list[_Loose]) -> None:
        """Raise the error of the first wrong feature among ``loose``, checked one by one:
        taken only when a check of the joined tensors failed, to name the feature."""
        for part in loose:
            _kjts_of(part)  # with validation on: the full per-feature checks and messages
        ids_dtype, lengths_dtype, _ = self._dtypes
        for part in loose:
            for k, v, ln, w in zip(part.keys, part.values, part.lengths, part.weights):
                for name, t, dtype in (("ids", v, ids_dtype), ("lengths", ln, lengths_dtype)):
                    if not isinstance(t, torch.Tensor) or t.dim() != 1:
                        raise ValueError(
                            f"feature {k!r}: {name} must be a 1-D tensor, got {_describe(t)}."
                        )
                    if t.dtype != dtype:
                        raise _dtype_error(k, name, t.dtype, dtype)
                if w is not None and (not isinstance(w, torch.Tensor) or w.dim() != 1):
                    raise ValueError(
                        f"feature {k!r}: weights must be a 1-D tensor, got {_describe(w)}."
                    )

    def unpack(self, *new_args: Any) -> tuple[Any, ...]:
        """The original arguments from ``(*dense_args, features)`` (the packer's inverse)."""
        *dense, cf = new_args
        if not isinstance(cf, CombinedFeatures) or tuple(cf.keys) != self.keys:
            raise ValueError("the last argument must be the CombinedFeatures this packer made.")
        out: list[Any] = [None] * self.num_args
        for p, v in zip(self.dense_positions, dense):
            out[p] = v
        entries = iter(dense[len(self.dense_positions) :])  # the TensorDicts' dense entries
        jts = _pieces_to_jts(cf, self.weighted)
        for s in self.slots:
            if s.kind == _DENSE:
                continue
            mine = self.weighted[s.start : s.start + len(s.keys)]
            if s.kind == _KJT:
                out[s.positions[0]] = _kjt_slice(cf, s.start, len(s.keys), mine)
            elif s.kind == _TR_KJT:
                out[s.positions[0]] = to_torchrec(_kjt_slice(cf, s.start, len(s.keys), mine))
            elif s.kind == _TD:
                kjt = _kjt_slice(cf, s.start, len(s.keys), mine)
                mine_dense = [next(entries) for _ in s.dense_keys]
                out[s.positions[0]] = _rebuild_td(
                    kjt, s.dense_keys, s.order, mine_dense, s.td_form, mine
                )
            elif s.kind == _JT_DICT:
                out[s.positions[0]] = {k: jts[s.start + j] for j, k in enumerate(s.keys)}
            elif s.kind == _JT:
                out[s.positions[0]] = jts[s.start]
            else:
                jt = jts[s.start]
                pv, pl, pw = s.positions
                out[pv], out[pl] = jt.values(), jt.lengths()
                if pw >= 0:
                    out[pw] = jt.weights()
        return tuple(out)


def _dtype_error(key: str, name: str, got: torch.dtype, want: torch.dtype) -> ValueError:
    return ValueError(
        f"feature {key!r}: {name} of dtype {got}, but the model was combined for {want} "
        f"(every feature's {name} share one tensor). Cast them in the data loader."
    )


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """One copy of all parts (none for one part, or parts already end to end in a buffer)."""
    return parts[0] if len(parts) == 1 else join_values(parts)


def _pieces_to_jts(cf: CombinedFeatures, weighted: Sequence[bool]) -> list[JaggedTensor]:
    kjt = _kjt_slice(cf, 0, len(cf.keys), weighted)
    d = kjt.to_dict() if cf.keys else {}
    return [_maybe_unweighted(d[k], w) for k, w in zip(cf.keys, weighted)]


def _maybe_unweighted(jt: JaggedTensor, weighted: bool) -> JaggedTensor:
    if weighted or jt.weights_or_none() is None:
        return jt
    return JaggedTensor._make(jt.values(), None, jt.lengths(), None)


def _kjt_slice(
    cf: CombinedFeatures, start: int, count: int, weighted: Sequence[bool]
) -> KeyedJaggedTensor:
    """Features ``start .. start+count`` of ``cf`` as a KJT of views (no copy); ``weighted``:
    those features' flags (weights are dropped if none of them had any)."""
    return cf.kjt_slice(start, count, any(weighted))


def _is_dense_entry(value: Any) -> bool:
    """A TensorDict entry that is no feature: a plain (not nested) tensor."""
    return isinstance(value, torch.Tensor) and not value.is_nested


def _dense_keys(td: TensorDictBase) -> tuple[str, ...]:
    """A TensorDict's entries that are no features, in its order."""
    keys = list(td.keys())  # (iterating a TensorDict gives its rows)
    if isinstance(td, LazyStackedTensorDict):
        return tuple(k for k in keys if not _is_stacked_feature(td, k))
    return tuple(k for k in keys if _is_dense_entry(td.get(k)))


def _is_stacked_feature(td: LazyStackedTensorDict, key: str) -> bool:
    """Is ``key`` a feature of TensorDicts lazily stacked? Read sample by sample: a plain
    ``get`` stacks them, which fails on ragged ids and makes equal-length ones dense.

    As the collections read per-sample TensorDicts (:func:`~fxrec.sparse.kjt_from_tensordict`),
    a sample's 1-D tensor of integers is its ids, whatever their number, and a sub-TensorDict
    a weighted feature's ``{"values", "weights"}``; entries of one shape in every sample that
    are not ids (floating point, 0-d, more dims) are dense.
    """
    entries = [sample.get(key) for sample in td.tensordicts]
    if not all(_is_dense_entry(e) for e in entries):
        return True
    if len({e.shape for e in entries}) > 1:
        return True  # no dense tensor stacks them
    of_samples = td.stack_dim == 0 and td.batch_dims == 1
    return of_samples and bool(entries) and entries[0].dim() == 1 and _holds_ids(entries[0])


def _holds_ids(t: torch.Tensor) -> bool:
    """Integer ids (not floating point, complex or bool values)."""
    d = t.dtype
    return not (d.is_floating_point or d.is_complex or d == torch.bool)


def _dense_entries(td: Any, slot: _Slot) -> list[torch.Tensor]:
    if not isinstance(td, TensorDictBase):
        raise ValueError(
            f"argument {slot.positions[0]} must be a TensorDict, got {type(td).__name__}."
        )
    out = []
    for k in slot.dense_keys:
        try:
            value = td.get(k, None)
        except RuntimeError as exc:  # per-sample entries lazily stacked, of different shapes
            raise ValueError(
                f"TensorDict argument {slot.positions[0]}: entry {k!r} must be a dense tensor "
                "(as in the example batch), of one shape in every sample: give each sample "
                f"the same shape, or 1-D integer ids to make it a feature ({exc})"
            ) from exc
        if not _is_dense_entry(value):
            raise ValueError(
                f"TensorDict argument {slot.positions[0]}: entry {k!r} must be a dense tensor "
                f"(as in the example batch), got {type(value).__name__}."
            )
        out.append(value)
    return out


def _rebuild_td(
    kjt: KeyedJaggedTensor,
    dense_keys: Sequence[str],
    order: Sequence[str],
    dense: Sequence[torch.Tensor],
    form: tuple[int, bool],
    weighted: Sequence[bool],
) -> Any:
    """The TensorDict of ``kjt``'s features and the ``dense`` entries, in its own order, with
    the example TensorDict's batch dims and device-or-none (``form``): model code may read
    ``td.shape``, ``td.numel()`` or ``td.device`` (a TensorDict built without ``batch_size``
    has none, while one built from the features has their batch). Features the example gave
    without weights (``weighted``, per key of ``kjt``) are plain jagged tensors again, though
    the combined features carry weights of ones for them."""
    td = kjt_to_tensordict(kjt)
    plain = [k for k, w in zip(kjt.keys(), weighted) if not w] if any(weighted) else []
    if dense_keys or plain:
        entries = dict(td.items())
        for k in plain:
            entries[k] = entries[k]["values"]
        entries.update(zip(dense_keys, dense))
        batch = list(td.batch_size)
        if any(list(t.shape[: len(batch)]) != batch for t in dense):
            batch = []  # a dense entry of another batch size: no common batch dimension
        td = TensorDict({k: entries[k] for k in order}, batch_size=batch, device=td.device)
    batch_dims, has_device = form
    if td.batch_dims > batch_dims:
        td.batch_size = td.batch_size[:batch_dims]
    if not has_device and td.device is not None:
        td.clear_device_()
    return td


# -- device side: leaf modules that rebuild the original argument types -----------------------


class _Rebuild(nn.Module):
    """Rebuilds one original sparse argument from the combined input (a tracing leaf).

    A leaf so that re-capturing the rewritten module (``fxrec.optimize`` on it) keeps one node
    per argument instead of tracing into Python object construction.
    """

    _fxrec_leaf = True

    def __init__(
        self,
        kind: str,
        keys: Sequence[str],
        start: int,
        weighted: Sequence[bool],
        dense_keys: Sequence[str] = (),
        order: Sequence[str] = (),
        td_form: tuple[int, bool] = (1, True),
    ) -> None:
        super().__init__()
        self.kind = kind
        self.keys = tuple(keys)
        self.start = start
        self.weighted = tuple(weighted)
        self.dense_keys = tuple(dense_keys)  # a TensorDict's dense entries: parts after cf
        self.order = tuple(order)
        self.td_form = td_form  # the example TensorDict's batch dims and device-or-none

    def forward(self, *parts: Any) -> Any:
        if self.kind in _KEYED:
            cf, *dense = parts
            kjt = _kjt_slice(cf, self.start, len(self.keys), self.weighted)
            if self.kind == _TR_KJT:
                return to_torchrec(kjt)
            if self.kind == _KJT:
                return kjt
            return _rebuild_td(kjt, self.dense_keys, self.order, dense, self.td_form, self.weighted)
        # JaggedTensor kinds: ``start`` indexes the permute_and_split pieces.
        vals, lens, wts = parts
        n = len(self.keys)
        sl = slice(self.start, self.start + n)
        jts = [
            JaggedTensor._make(v, w if flag else None, ln, None)
            for v, ln, w, flag in zip(
                vals[sl], lens[sl], wts[sl] if wts else [None] * n, self.weighted
            )
        ]
        return jts[0] if self.kind == _JT else dict(zip(self.keys, jts))

    def extra_repr(self) -> str:
        return f"{self.kind}, keys={list(self.keys)[:4]}{'...' if len(self.keys) > 4 else ''}"


# -- the pass ------------------------------------------------------------------------------


def _classify(
    placeholders: list[fx.Node], args: Sequence[Any], features: Mapping[str, Sequence[str]]
) -> tuple[list[_Slot], list[bool]]:
    pos_of = {p.target: i for i, p in enumerate(placeholders)}
    in_features: dict[int, str] = {}
    tensor_slots: dict[int, _Slot] = {}
    for key, names in features.items():
        names = list(names)
        if len(names) not in (2, 3):
            raise ValueError(
                f"features[{key!r}] must name (values_arg, lengths_arg[, weights_arg]), got {names}."
            )
        missing = [n for n in names if n not in pos_of]
        if missing:
            raise ValueError(
                f"features[{key!r}]: no forward argument named {missing} (have {list(pos_of)})."
            )
        ps = [pos_of[n] for n in names]
        for p in ps:
            if p in in_features:
                raise ValueError(f"argument {placeholders[p].target!r} is named by two features.")
            in_features[p] = key
        tensor_slots[ps[0]] = _Slot(_TENSORS, (ps[0], ps[1], ps[2] if len(ps) == 3 else -1), (key,))

    slots: list[_Slot] = []
    weighted: list[bool] = []
    for i, value in enumerate(args):
        if i in tensor_slots:
            s = tensor_slots[i]
            slots.append(s)
            weighted.append(s.positions[2] >= 0)
            continue
        if i in in_features:
            continue
        if isinstance(value, KeyedJaggedTensor) or _is_torchrec_kjt(value):
            keys = tuple(value.keys())
            kind = _KJT if isinstance(value, KeyedJaggedTensor) else _TR_KJT
            slots.append(_Slot(kind, (i,), keys))
            weighted += [value.weights_or_none() is not None] * len(keys)
        elif isinstance(value, TensorDictBase):
            order = tuple(value.keys())
            dense = _dense_keys(value)
            if len(dense) == len(order):  # no features: a dense argument
                slots.append(_Slot(_DENSE, (i,)))
                continue
            feats = [k for k in order if k not in dense]
            flags = _td_weighted(value, feats)
            groups = _weight_groups(feats, flags)
            for keys in groups or (feats,):
                kjt_from_tensordict(value, list(keys))  # checks the example as read
            keys = tuple(k for g in groups for k in g) if groups else tuple(feats)
            flag_of = dict(zip(feats, flags))
            form = (value.batch_dims, value.device is not None)
            slots.append(
                _Slot(_TD, (i,), keys, dense_keys=dense, order=order, td_form=form, groups=groups)
            )
            weighted += [flag_of[k] for k in keys]
        elif isinstance(value, JaggedTensor):
            slots.append(_Slot(_JT, (i,), (str(placeholders[i].target),)))
            weighted.append(value.weights_or_none() is not None)
        elif (
            isinstance(value, Mapping)
            and value
            and all(isinstance(v, JaggedTensor) for v in value.values())
        ):
            slots.append(_Slot(_JT_DICT, (i,), tuple(value)))
            weighted += [v.weights_or_none() is not None for v in value.values()]
        else:
            slots.append(_Slot(_DENSE, (i,)))
    # A JaggedTensor argument's key is its name, which only we chose: it yields to features.
    named = {k for s in slots if s.kind != _JT for k in s.keys}
    slots = [
        _Slot(_JT, s.positions, (f"{s.keys[0]} (argument {s.positions[0]})",))
        if s.kind == _JT and s.keys[0] in named
        else s
        for s in slots
    ]
    # Features must be unique across arguments; number them in packing order.
    out, start, seen = [], 0, set()
    for s in slots:
        dup = [k for k in s.keys if k in seen]
        if dup:
            raise ValueError(
                f"feature {dup[0]!r} appears in two arguments; feature names must be unique."
            )
        seen.update(s.keys)
        out.append(dataclasses.replace(s, start=start))
        start += len(s.keys)
    return out, weighted


def _takes_kjt() -> tuple[Any, ...]:
    """Functions that accept a KJT wherever they accept a TensorDict (sharded collections)."""
    try:
        from fxrec.distributed.sharded_ebc import as_kjt
    except ImportError:
        return ()
    return (as_kjt,)


_TAKES_KJT = _takes_kjt()


def _feeds_fxrec_collection(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Is every use of ``node`` a call of an fxrec module (they all take KJTs as well)?"""
    if not node.users:
        return False
    for user in node.users:
        if user.op == "call_function" and user.target in _TAKES_KJT:
            continue
        if user.op != "call_module":
            return False
        mod = gm.get_submodule(str(user.target))
        if not type(mod).__module__.startswith(("fxrec.nn", "fxrec.distributed")):
            return False
    return True


def combine_inputs(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    features: Mapping[str, Sequence[str]] | None = None,
) -> tuple[fx.GraphModule, InputPacker]:
    """Rewrite ``model`` to take its sparse inputs combined; return it and the host packer.

    Args:
        model: a module whose ``forward`` symbolically traces (or an ``fx.GraphModule``).
        example_inputs: one batch of ``model``'s positional arguments; sparse arguments are
            recognised by type (KJT, TensorDict, JaggedTensor, dict of JaggedTensor).
        features: for plain tensor arguments, ``{feature: (values_arg, lengths_arg[,
            weights_arg])}`` by ``forward`` argument name (tensors alone do not say which
            ones form a feature).

    The combined features take 2 copies to the device, 3 when any feature is weighted:
    features without weights (tensors, JaggedTensors, a TensorDict's plain jagged entries
    beside weighted ones) then carry weights of ones. Arguments are rebuilt with or without
    weights as the example had them, except the one KJT fxrec's collections receive for a
    TensorDict mixing both: it carries the ones, which unweighted collections never read.

    Returns:
        ``(new_module, packer)`` with ``new_module(*packer(*args)) == model(*args)``, same
        gradients, and the model's ``state_dict`` keys.
    """
    example_inputs = tuple(example_inputs)
    if isinstance(model, fx.GraphModule):
        gm = model
    else:
        try:
            gm = capture_symbolic(model)
        except CaptureError as exc:
            raise ValueError(
                f"combine_inputs rewrites a symbolically traceable forward: {exc}. Move "
                "data-dependent control flow out of the forward that takes the sparse inputs."
            ) from exc
    old = gm.graph
    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    if len(example_inputs) != len(placeholders):
        raise ValueError(
            f"example_inputs has {len(example_inputs)} arguments; forward takes "
            f"{len(placeholders)} ({[p.target for p in placeholders]})."
        )
    slots, weighted = _classify(placeholders, example_inputs, features or {})
    sparse = [s for s in slots if s.kind != _DENSE]
    if not sparse:
        raise ValueError(
            "combine_inputs found no sparse inputs: pass a KJT / TensorDict / JaggedTensor "
            "argument, or name tensor features with features={name: (values, lengths)}."
        )

    dtypes = _example_dtypes(slots, example_inputs)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for s in slots:
        if s.kind == _DENSE:
            ph = placeholders[s.positions[0]]
            env[ph] = graph.node_copy(ph)
    entry_nodes = _td_entry_placeholders(graph, slots, placeholders)
    cf = graph.placeholder("features")
    wrapper = nn.Module()
    pieces = None
    # Only features read one by one go through permute_and_split; KJT/TensorDict arguments
    # are views of the combined tensors (see the module docstring).
    split_order = [
        s.start + j
        for s in sparse
        if s.kind in (_TENSORS, _JT, _JT_DICT)
        for j in range(len(s.keys))
    ]
    piece_of = {f: i for i, f in enumerate(split_order)}
    ops_needed = bool(split_order)
    if ops_needed:
        get = {
            a: graph.call_function(getattr, (cf, a))
            for a in ("values", "lengths", "weights", "stride_per_key", "length_per_key")
        }
        split = graph.call_function(
            torch.ops.fxrec.permute_and_split.default,
            (
                get["values"],
                get["lengths"],
                get["weights"],
                get["stride_per_key"],
                get["length_per_key"],
                split_order,
            ),
        )
        pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(3)]
    for s in sparse:
        name = f"fxrec_combined_{s.positions[0]}"
        if s.kind == _TENSORS:
            vals, lens, wts = pieces  # type: ignore[misc]
            pv, pl, pw = s.positions
            at = piece_of[s.start]
            env[placeholders[pv]] = graph.call_function(operator.getitem, (vals, at))
            env[placeholders[pl]] = graph.call_function(operator.getitem, (lens, at))
            if pw >= 0:
                env[placeholders[pw]] = graph.call_function(operator.getitem, (wts, at))
            continue
        kind = s.kind
        ph = placeholders[s.positions[0]]
        if kind == _TD and not s.dense_keys and _feeds_fxrec_collection(ph, gm):
            kind = _KJT  # fxrec's collections take KJTs too: skip building a TensorDict
        mine = weighted[s.start : s.start + len(s.keys)]
        if kind in _KEYED:
            rebuild = _Rebuild(kind, s.keys, s.start, mine, s.dense_keys, s.order, s.td_form)
            setattr(wrapper, name, rebuild)
            args: tuple[Any, ...] = (cf, *entry_nodes.get(s.positions[0], []))
        else:
            setattr(wrapper, name, _Rebuild(kind, s.keys, piece_of[s.start], mine))
            args = tuple(pieces)  # type: ignore[arg-type]
        env[ph] = graph.call_module(name, args)
    for node in old.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            target = str(node.target)
            root[target] = meta.resolve_attr(
                wrapper if target.startswith("fxrec_combined_") else gm, target
            )
    new = fx.GraphModule(root, graph, f"Combined{type(model).__name__}")
    _adopt_hierarchy(new, model)
    eliminate_dead_code(new.graph)  # keeps in-place buffer updates nothing reads
    new.graph.lint()
    new.recompile()
    packer = InputPacker(slots, len(example_inputs), weighted, dtypes)
    logger.info(
        "combine_inputs: %d features from %d arguments -> 1 CombinedFeatures (%s)",
        len(weighted),
        len(sparse),
        "one permute_and_split" if ops_needed else "views only",
    )
    return new, packer


def _td_entry_placeholders(
    graph: fx.Graph, slots: Sequence[_Slot], placeholders: Sequence[fx.Node]
) -> dict[int, list[fx.Node]]:
    """One placeholder per dense entry of a TensorDict argument (``<argument>_<entry>``), in
    the packer's order: argument position -> its entries' placeholders."""
    taken = {str(p.target) for p in placeholders} | {"features"}
    out: dict[int, list[fx.Node]] = {}
    for s in slots:
        if s.kind != _TD or not s.dense_keys:
            continue
        nodes = out.setdefault(s.positions[0], [])
        for key in s.dense_keys:
            base = re.sub(r"\W", "_", f"{placeholders[s.positions[0]].target}_{key}")
            name, n = base, 1
            while name in taken:
                name, n = f"{base}_{n}", n + 1
            taken.add(name)
            nodes.append(graph.placeholder(name))
    return out


def _adopt_hierarchy(new: fx.GraphModule, model: nn.Module) -> None:
    """Give ``new`` the model's own children and tensors, not the stubs ``fx.GraphModule``
    builds on the paths the graph uses: submodules traced through (a sharded collection, whose
    checkpoint hooks take each rank's tables and which train pipelines look for) and tensors
    the forward never reads (a buffer) stay part of the module and of its ``state_dict``."""
    for name, child in model.named_children():
        setattr(new, name, child)
    for name, p in model.named_parameters(recurse=False):
        new.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        new.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
    new.training = model.training  # (not train(): its children keep their own modes)


def _example_dtypes(slots: Sequence[_Slot], args: Sequence[Any]) -> tuple[Any, Any, Any]:
    """(ids, lengths, weights) dtypes of the example batch (weights: its first weighted
    feature's, float32 when none is weighted). Every feature's ids (and lengths) share one
    tensor, so the example's features must agree: the packer would refuse the example."""
    parts: list[JaggedParts] = []
    for s in slots:
        if s.kind != _DENSE:
            got = _chunk_of(s, args)
            for c in got if isinstance(got, list) else [got]:
                parts.append(c if isinstance(c, JaggedParts) else JaggedParts.of_kjt(c))
    if not parts:
        raise ValueError("no sparse inputs")
    ids: dict[torch.dtype, list[str]] = {}
    lengths: dict[torch.dtype, list[str]] = {}
    for p in parts:
        if len(p.values) == len(p.keys):  # one ids tensor per feature
            for k, v in zip(p.keys, p.values):
                ids.setdefault(v.dtype, []).append(k)
        else:
            ids.setdefault(p.values[0].dtype, []).extend(p.keys)
        lengths.setdefault(p.lengths.dtype, []).extend(p.keys)
    for name, by_dtype in (("ids", ids), ("lengths", lengths)):
        if len(by_dtype) > 1:
            which = "; ".join(f"{d}: {keys[:5]}" for d, keys in by_dtype.items())
            raise ValueError(
                f"the example batch's features have {name} of different dtypes ({which}); "
                f"every feature's {name} share one tensor. Cast them to one dtype in the data "
                "loader (e.g. torch.int64)."
            )
    w = next((p.weights[0] for p in parts if p.weights), None)
    return next(iter(ids)), next(iter(lengths)), torch.float32 if w is None else w.dtype
