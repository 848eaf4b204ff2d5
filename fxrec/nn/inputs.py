"""Turning a collection's input into one KJT in lookup order, with the structural checks.

Any accepted input (KJT, TensorDict of jagged tensors, ``dict[str, JaggedTensor]``, a dict
of jagged nested tensors, TorchRec's KJT) becomes a :class:`~fxrec.sparse.KeyedJaggedTensor`
whose keys are the collection's members group by group (a feature read by two tables appears
twice), so each group's ids, lengths and weights are one contiguous slice. The key
bookkeeping is done once per distinct input key list (:class:`Plan`, cached by the
collection).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxrec.nn.layout import Layout
from fxrec.sparse import KeyedJaggedTensor, kjt_from_tensordict
from fxrec.sparse.permute import permute_jagged
from fxrec.sparse.tensordict_interop import is_njt

__all__ = ["Plan", "as_kjt", "batch_size", "gather", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """Where the members sit in an input with given keys."""

    order: tuple[int, ...] | None  # input key per member, group-major; None: already so
    member_ranges: tuple[tuple[int, int], ...]  # per group: [start, end) among the members


def _missing(missing: list[str], have: Sequence[str]) -> ValueError:
    more = " ..." if len(have) > 8 else ""
    return ValueError(
        f"missing features {missing[:8]}: the collection reads them but the input does not "
        f"have them (it has {list(have)[:8]}{more})."
    )


def as_kjt(
    features: Any, keys: Sequence[str], weighted: bool, order: Sequence[str] | None = None
) -> KeyedJaggedTensor:
    """Any accepted input as a KJT holding (at least) the features ``keys`` (those a
    collection reads; other entries of a TensorDict or dict are left alone). A dict of
    JaggedTensors is joined in ``order`` (default ``keys``): the collection's lookup order,
    so that no gather follows."""
    if isinstance(features, KeyedJaggedTensor):
        return features
    if isinstance(features, Mapping) and not hasattr(features, "batch_size"):
        if _holds_njts(features, keys):  # read as a TensorDict's entries are
            return kjt_from_tensordict(features, keys=list(keys))
        return _from_jt_dict(features, keys if order is None else order, weighted)
    if hasattr(features, "batch_size") and hasattr(features, "keys"):  # a TensorDict
        return kjt_from_tensordict(features, keys=list(keys))
    if type(features).__module__.startswith("torchrec"):
        from fxrec.sparse import from_torchrec

        return from_torchrec(features)
    raise ValueError(
        f"EmbeddingBagCollection takes a KeyedJaggedTensor, a TensorDict of jagged tensors or "
        f"a dict of JaggedTensors or of jagged nested tensors, got {type(features).__name__}."
    )


def _holds_njts(features: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether a dict's features are jagged nested tensors (or weighted ``{"values",
    "weights"}`` dicts of them) rather than JaggedTensors; a mix raises."""
    read = [f for f in keys if f in features]
    njt = [f for f in read if is_njt(features[f]) or isinstance(features[f], Mapping)]
    if njt and len(njt) != len(read):
        other = [f for f in read if f not in njt]
        raise ValueError(
            f"features {njt[:5]} are jagged nested tensors but {other[:5]} are not; a dict of "
            "features holds either JaggedTensors or jagged nested tensors (layout=torch.jagged) "
            "for every feature."
        )
    return bool(njt)


def _from_jt_dict(
    features: Mapping[str, Any], order: Sequence[str], weighted: bool
) -> KeyedJaggedTensor:
    """The KJT built directly in ``order`` (one ``cat`` each, no gather afterwards)."""
    missing = list(dict.fromkeys(f for f in order if f not in features))
    if missing:
        raise _missing(missing, list(features))
    order = list(order)
    jts = [features[f] for f in order]
    for f, jt in zip(order, jts):
        if not hasattr(jt, "lengths") or not hasattr(jt, "values"):
            raise ValueError(
                f"feature {f!r}: expected a JaggedTensor or a jagged nested tensor, got "
                f"{type(jt).__name__}."
            )
        if weighted and jt.weights_or_none() is None:
            raise ValueError(
                f"feature {f!r} has no weights but the collection is weighted "
                f"(is_weighted=True); give every feature weights."
            )
    strides = [int(jt.lengths().numel()) for jt in jts]
    same = all(s == strides[0] for s in strides)
    return KeyedJaggedTensor(
        order,
        torch.cat([jt.values() for jt in jts]),
        weights=torch.cat([jt.weights() for jt in jts]) if weighted else None,
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=strides[0] if same else None,
        stride_per_key=None if same else strides,
    )


def make_plan(keys: Sequence[str], layout: Layout) -> Plan:
    """Raises ``ValueError`` naming the features the input lacks."""
    index = {k: i for i, k in enumerate(keys)}  # a repeated key: its last position
    missing = [f for f in layout.features if f not in index]
    if missing:
        raise _missing(missing, keys)
    order = tuple(index[layout.members[i].feature] for i in layout.group_major())
    ranges = []
    start = 0
    for g in layout.groups:
        ranges.append((start, start + len(g.members)))
        start += len(g.members)
    identity = order == tuple(range(len(keys)))
    return Plan(None if identity else order, tuple(ranges))


def batch_size(kjt: KeyedJaggedTensor, plan: Plan) -> int:
    """The one batch size of the features read; ``ValueError`` if they disagree."""
    if not kjt.variable_stride_per_key():
        return kjt.stride()
    spk = kjt.stride_per_key()
    pos = plan.order if plan.order is not None else range(len(spk))
    sizes = {kjt.keys()[p]: spk[p] for p in pos}
    if len(set(sizes.values())) > 1:
        listed = list(sizes.items())
        text = ", ".join(f"{k!r}: {v}" for k, v in listed[:8]) + (
            ", ..." if len(listed) > 8 else ""
        )
        raise ValueError(
            f"features have different batch sizes ({text}); the collection returns one "
            f"[batch, sum(dims)] tensor, so every feature it reads needs the same batch size."
        )
    return next(iter(sizes.values()), 0)


def gather(
    kjt: KeyedJaggedTensor, order: Sequence[int], weights: torch.Tensor | None
) -> KeyedJaggedTensor:
    """The input's keys in ``order`` (a gather; repeats repeat), with ``weights`` (or none).

    :func:`permute_jagged` picks the backend: weights that need a gradient, and ids or
    lengths narrower than int32, take its pure-torch gather.
    """
    spk = kjt.stride_per_key()
    lpk = kjt.length_per_key()
    values, lengths, gathered = permute_jagged(
        kjt.values(), kjt.lengths(), weights, spk, lpk, order
    )
    return KeyedJaggedTensor._make(
        [kjt.keys()[i] for i in order],
        values,
        gathered,
        lengths,
        stride_per_key=[spk[i] for i in order] if kjt.variable_stride_per_key() else None,
        length_per_key=[lpk[i] for i in order],
    )
