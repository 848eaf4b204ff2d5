"""Pytree registration: the sparse types' tensors are leaves for tree_flatten, AOTAutograd,
``torch.export`` and fxrec's kernel counter.

The spec (context) holds only static metadata (keys, a variable batch's per-key strides,
KeyedTensor widths, whether jagged values are weighted), never per-batch figures, so a new
batch reuses a compiled graph. The one exception is a KJT's stride where its lengths cannot
give it back (no keys; a variable batch's stride above its largest per-key batch). Offsets
are not leaves: they are derived from lengths, and keeping them out keeps the spec stable.
Weights are a leaf even when absent (``None``), so the context says which: an exported
program called with the other kind raises a clear error instead of failing on (or silently
dropping) the weights.

``torch.export.save``/``load`` write each context as JSON; the dumpable-context functions here
bring back the exact tuples, because a loaded program matches inputs against its spec by
equality. The types are also allowed in ``torch.load(weights_only=True)``, which is how a
saved program's example inputs are read back.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from fxrec.sparse.jagged_tensor import JaggedTensor
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.keyed_tensor import KeyedTensor

__all__ = ["register_pytrees"]

_registered = False


_WEIGHTED, _UNWEIGHTED = "weighted", "unweighted"


def _weighted(weights: torch.Tensor | None) -> str:
    return _UNWEIGHTED if weights is None else _WEIGHTED


def _jt_flatten(jt: JaggedTensor) -> tuple[list[Any], str]:
    return [jt.values(), jt.weights_or_none(), jt.lengths()], _weighted(jt.weights_or_none())


def _jt_flatten_with_keys(jt: JaggedTensor) -> tuple[list[tuple[Any, Any]], str]:
    leaves, ctx = _jt_flatten(jt)
    names = ("values", "weights", "lengths")
    return [(pytree.GetAttrKey(n), v) for n, v in zip(names, leaves)], ctx


def _jt_unflatten(leaves: Any, ctx: str) -> JaggedTensor:
    values, weights, lengths = leaves
    return JaggedTensor._make(values, weights, lengths, None)


# keys, stride per key (variable batch), weighted or not, the stride where it is not derived
_KJTContext = tuple[tuple[str, ...], tuple[int, ...] | None, str, int | None]


def _kjt_ctx(kjt: KeyedJaggedTensor) -> _KJTContext:
    spk = kjt._stride_per_key
    keys, weights = tuple(kjt.keys()), _weighted(kjt.weights_or_none())
    return keys, None if spk is None else tuple(spk), weights, _kept_stride(kjt)


def _kept_stride(kjt: KeyedJaggedTensor) -> int | None:
    """The stride, where the lengths and per-key strides would not give it back on unflatten
    (a KJT with no keys, a variable batch's explicit stride); else None (a per-batch figure)."""
    spk = kjt._stride_per_key
    if kjt.keys() and spk is None:
        return None  # lengths.numel() // len(keys)
    derived = 0 if spk is None else max(spk, default=0)
    stride = kjt.stride()
    return None if stride == derived else stride


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[Any], Any]:
    return [kjt.values(), kjt.weights_or_none(), kjt.lengths()], _kjt_ctx(kjt)


def _kjt_flatten_with_keys(kjt: KeyedJaggedTensor) -> tuple[list[tuple[Any, Any]], Any]:
    leaves, ctx = _kjt_flatten(kjt)
    names = ("values", "weights", "lengths")
    return [(pytree.GetAttrKey(n), v) for n, v in zip(names, leaves)], ctx


def _kjt_unflatten(leaves: Any, ctx: Any) -> KeyedJaggedTensor:
    values, weights, lengths = leaves
    keys, spk, _, stride = ctx
    return KeyedJaggedTensor._make(
        list(keys),
        values,
        weights,
        lengths,
        stride=stride,
        stride_per_key=None if spk is None else list(spk),
    )


def _kt_flatten(kt: KeyedTensor) -> tuple[list[Any], Any]:
    return [kt.values()], (tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim())


def _kt_flatten_with_keys(kt: KeyedTensor) -> tuple[list[tuple[Any, Any]], Any]:
    leaves, ctx = _kt_flatten(kt)
    return [(pytree.GetAttrKey("values"), leaves[0])], ctx


def _kt_unflatten(leaves: Any, ctx: Any) -> KeyedTensor:
    keys, lpk, key_dim = ctx
    kt = KeyedTensor.__new__(KeyedTensor)
    kt._keys, kt._length_per_key, kt._values, kt._key_dim = (
        list(keys),
        list(lpk),
        leaves[0],
        key_dim,
    )
    kt._offset_per_key, kt._index_per_key = None, None
    return kt


def _jt_dump(ctx: str) -> str:
    return json.dumps(ctx)


def _weights_of(saved: Any, dumped: str) -> str:
    if saved not in (_WEIGHTED, _UNWEIGHTED):
        raise ValueError(
            f"this file's pytree context {dumped!r} does not say whether the jagged values are "
            f"weighted (an older fxrec wrote it); export the program again with this fxrec."
        )
    return saved


def _jt_load(dumped: str) -> str:
    return _weights_of(json.loads(dumped), dumped)


def _kjt_dump(ctx: _KJTContext) -> str:
    keys, spk, weights, stride = ctx
    spk_list = None if spk is None else list(spk)
    d = {"keys": list(keys), "stride_per_key": spk_list, "weights": weights, "stride": stride}
    return json.dumps(d)


def _kjt_load(dumped: str) -> _KJTContext:
    d = json.loads(dumped)
    spk = d["stride_per_key"]
    weights = _weights_of(d.get("weights"), dumped)
    stride = d.get("stride")  # absent in older files: always derived then
    spk_tuple = None if spk is None else tuple(int(s) for s in spk)
    return tuple(d["keys"]), spk_tuple, weights, None if stride is None else int(stride)


def _kt_dump(ctx: tuple[tuple[str, ...], tuple[int, ...], int]) -> str:
    keys, lpk, key_dim = ctx
    return json.dumps({"keys": list(keys), "length_per_key": list(lpk), "key_dim": key_dim})


def _kt_load(dumped: str) -> tuple[tuple[str, ...], tuple[int, ...], int]:
    d = json.loads(dumped)
    return tuple(d["keys"]), tuple(int(n) for n in d["length_per_key"]), int(d["key_dim"])


def _spec_leaves(cls: type, flatten: Any) -> Any:
    """Leaves of ``obj`` for a graph built for ``spec``: an input of another structure (keys,
    per-key strides, widths, weighted or not) raises, saying what the graph was built for."""

    def fn(obj: Any, spec: pytree.TreeSpec) -> list[Any]:
        if not isinstance(obj, cls):
            raise ValueError(
                f"this program was exported for a {cls.__name__} here, got "
                f"{type(obj).__name__}: pass inputs of the example's types."
            )
        leaves, ctx = flatten(obj)
        if ctx != spec.context:
            raise ValueError(
                f"this program was exported for a {cls.__name__} with {_describe(spec.context)}, "
                f"got one with {_describe(ctx)}: pass inputs like the example, or export again "
                f"with an example like these inputs."
            )
        return leaves

    return fn


def _describe(ctx: Any) -> str:
    """A spec context in words (``(keys, stride_per_key, weighted, stride)`` for a KJT)."""
    if isinstance(ctx, str):  # JaggedTensor
        return f"{ctx} values"
    if len(ctx) == 4:  # KeyedJaggedTensor
        keys, spk, weights, stride = ctx
        per_key = "" if spk is None else f", stride per key {list(spk)}"
        rows = "" if stride is None else f", stride {stride}"
        return f"keys {list(keys)}{per_key}{rows}, {weights} values"
    keys, lpk, key_dim = ctx  # KeyedTensor
    return f"keys {list(keys)}, lengths per key {list(lpk)}, key dim {key_dim}"


def register_pytrees() -> None:
    """Register the three types once (idempotent; done on ``import fxrec.sparse``).

    Also allows them in ``torch.load(weights_only=True)``: they hold only tensors, ints, strings,
    lists and dicts, and a saved exported program's example inputs are read back that way.
    """
    global _registered
    if _registered:
        return
    for cls, flat, flat_keys, unflat, dump, load in (
        (JaggedTensor, _jt_flatten, _jt_flatten_with_keys, _jt_unflatten, _jt_dump, _jt_load),
        (
            KeyedJaggedTensor,
            _kjt_flatten,
            _kjt_flatten_with_keys,
            _kjt_unflatten,
            _kjt_dump,
            _kjt_load,
        ),
        (KeyedTensor, _kt_flatten, _kt_flatten_with_keys, _kt_unflatten, _kt_dump, _kt_load),
    ):
        pytree.register_pytree_node(
            cls,
            flat,
            unflat,
            flatten_with_keys_fn=flat_keys,
            serialized_type_name=f"fxrec.sparse.{cls.__name__}",
            to_dumpable_context=dump,
            from_dumpable_context=load,
        )
        fx_pytree.register_pytree_flatten_spec(cls, _spec_leaves(cls, flat))
    torch.serialization.add_safe_globals([JaggedTensor, KeyedJaggedTensor, KeyedTensor])
    _registered = True
