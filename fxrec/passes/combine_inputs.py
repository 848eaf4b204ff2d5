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
from typing import Any

import torch
import torch.fx as fx
from tensordict import TensorDict, TensorDictBase
from torch import nn

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


# -- host side -----------------------------------------------------------------------------


def _chunk_of(
    slot: _Slot, args: Sequence[Any]
) -> KeyedJaggedTensor | JaggedParts | list[KeyedJaggedTensor]:
    """The slot's features as KJT(s), zero-copy for a KJT argument; a TensorDict's as its
    :class:`~fxrec.sparse.tensordict_interop.JaggedParts`, copied once, by the packer."""
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
    if slot.kind == _TD:
        td = args[slot.positions[0]]
        if not isinstance(td, TensorDictBase):
            raise ValueError(
                f"argument {slot.positions[0]} must be a TensorDict, got {type(td).__name__}."
            )
        return tensordict_parts(td, slot.keys)
    if slot.kind == _JT_DICT:
        d = args[slot.positions[0]]
        if not isinstance(d, Mapping):
            raise ValueError(f"argument {slot.positions[0]} must be a dict of JaggedTensor.")
        missing = [k for k in slot.keys if k not in d]
        if missing:
            raise ValueError(f"features {missing[:5]} are missing from the dict argument.")
        # one chunk per feature: a dict may mix weighted and unweighted features
        return [KeyedJaggedTensor.from_jt_dict({k: d[k]}) for k in slot.keys]
    if slot.kind == _JT:
        jt = args[slot.positions[0]]
        if not isinstance(jt, JaggedTensor):
            raise ValueError(f"argument {slot.keys[0]!r} must be a JaggedTensor.")
        return KeyedJaggedTensor.from_jt_dict({slot.keys[0]: jt})
    pv, pl, pw = slot.positions
    weights = args[pw] if pw >= 0 else None
    try:
        jt = JaggedTensor(args[pv], weights, lengths=args[pl])  # validates (when enabled)
    except ValueError as exc:
        raise ValueError(f"feature {slot.keys[0]!r}: {exc}") from None
    return KeyedJaggedTensor.from_jt_dict({slot.keys[0]: jt})


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


class InputPacker:
    """Host side of :func:`combine_inputs`: the model's arguments -> the new module's.

    ``packer(*args)`` returns ``(*dense_args, features)``, the dense arguments followed by
    the dense (non-jagged) entries of TensorDict arguments, if any;
    ``packer.unpack(*new_args)`` gives the original arguments back (the round trip). Pack in the data loader (or a pipeline's
    ``host_fn``), then move ``features`` with ``features.to(device)``: 2 copies, 3 if weighted.
    """

    def __init__(
        self, slots: Sequence[_Slot], num_args: int, weighted: Sequence[bool], dtypes: Any
    ) -> None:
        self.slots = tuple(slots)
        self.num_args = num_args
        self.keys = tuple(k for s in self.slots for k in s.keys)
        self.weighted = tuple(weighted)  # per feature, in self.keys order
        self._dtypes = dtypes  # (values, lengths, weights) dtypes of the example batch

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
        chunks: list[KeyedJaggedTensor | JaggedParts] = []
        for s in self.slots:
            if s.kind != _DENSE:
                got = _chunk_of(s, args)
                chunks += got if isinstance(got, list) else [got]
        features = self._combine(chunks)
        return (*(args[p] for p in self.dense_positions), *self._td_entries(args), features)

    def _combine(self, chunks: list[KeyedJaggedTensor | JaggedParts]) -> CombinedFeatures:
        spk: list[int] = []
        lpk: list[int] = []
        values: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        owners: dict[str, list[tuple[list[str], torch.Tensor]]] = {"ids": [], "lengths": []}
        any_weighted = any(self.weighted)
        i = 0
        for chunk in chunks:
            p = chunk if isinstance(chunk, JaggedParts) else JaggedParts.of_kjt(chunk)
            per_key = len(p.values) == len(p.keys)
            owners["ids"] += (
                [([k], v) for k, v in zip(p.keys, p.values)]
                if per_key
                else [(list(p.keys), p.values[0])]
            )
            owners["lengths"].append((list(p.keys), p.lengths))
            for k in p.keys:
                if (p.weights is not None) != self.weighted[i]:
                    state = "has" if p.weights is not None else "has no"
                    raise ValueError(
                        f"feature {k!r} {state} weights in this batch but not in the example "
                        "batch the model was combined for; every batch must agree."
                    )
                i += 1
            spk += p.stride_per_key
            lpk += p.length_per_key
            values += p.values
            lengths.append(p.lengths)
            if p.weights is not None:
                weights += p.weights
            elif any_weighted:
                n = sum(p.length_per_key)
                weights.append(torch.ones(n, dtype=self._dtypes[2], device=p.lengths.device))
        for name, dtype in (("ids", self._dtypes[0]), ("lengths", self._dtypes[1])):
            bad = [(keys, t.dtype) for keys, t in owners[name] if t.dtype != dtype]
            if bad:
                keys, got = bad[0]
                raise ValueError(
                    f"feature {keys[0]!r}: {name} of dtype {got}, but the model was combined "
                    f"for {dtype} (every feature's {name} share one tensor). Cast them in the "
                    "data loader."
                )
        return CombinedFeatures(
            self.keys,
            _cat(values),
            _cat(lengths),
            _cat(weights) if any_weighted else None,
            tuple(spk),
            tuple(lpk),
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
                out[s.positions[0]] = _rebuild_td(kjt, s.dense_keys, s.order, mine_dense, s.td_form)
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


def _dense_entries(td: Any, slot: _Slot) -> list[torch.Tensor]:
    if not isinstance(td, TensorDictBase):
        raise ValueError(
            f"argument {slot.positions[0]} must be a TensorDict, got {type(td).__name__}."
        )
    out = []
    for k in slot.dense_keys:
        value = td.get(k, None)
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
) -> Any:
    """The TensorDict of ``kjt``'s features and the ``dense`` entries, in its own order, with
    the example TensorDict's batch dims and device-or-none (``form``): model code may read
    ``td.shape``, ``td.numel()`` or ``td.device`` (a TensorDict built without ``batch_size``
    has none, while one built from the features has their batch)."""
    td = kjt_to_tensordict(kjt)
    if dense_keys:
        entries = dict(td.items())
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
            return _rebuild_td(kjt, self.dense_keys, self.order, dense, self.td_form)
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
            dense = tuple(k for k in order if _is_dense_entry(value.get(k)))
            if len(dense) == len(order):  # no features: a dense argument
                slots.append(_Slot(_DENSE, (i,)))
                continue
            kjt = kjt_from_tensordict(value, [k for k in order if k not in dense])
            form = (value.batch_dims, value.device is not None)
            slots.append(
                _Slot(_TD, (i,), tuple(kjt.keys()), dense_keys=dense, order=order, td_form=form)
            )
            weighted += [kjt.weights_or_none() is not None] * len(kjt.keys())
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
            root[target] = _get(wrapper if target.startswith("fxrec_combined_") else gm, target)
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


def _get(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
