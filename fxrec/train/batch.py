"""What a train pipeline moves: a :class:`Batch` of dense features, sparse features, labels.

``sparse`` may be a :class:`~fxrec.sparse.KeyedJaggedTensor`, a ``TensorDict`` of jagged
tensors (weights and a variable batch size included), a dict of JaggedTensors, or the
:class:`~fxrec.sparse.CombinedFeatures` of :func:`fxrec.passes.combine_inputs.combine_inputs`.
:func:`transfer_count` says how many host-to-device copies moving it costs: the figure the
combined-input pass exists to shrink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import LazyStackedTensorDict, TensorDictBase

from fxrec.sparse import CombinedFeatures, JaggedTensor, KeyedJaggedTensor
from fxrec.sparse.tensordict_interop import is_njt, prepared_kjts

__all__ = ["Batch", "move", "transfer_count"]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor a device transfer of ``obj`` copies (NJT: its values and offsets)."""
    if obj is None:
        return []
    if is_njt(obj):  # the parts themselves: NJT.values() dispatches through Python
        return [t for t in (obj._values, obj._offsets, obj._lengths) if t is not None]
    if isinstance(obj, torch.Tensor):
        if obj.is_nested and obj.layout == torch.jagged:
            parts = [obj.values(), obj.offsets(), getattr(obj, "_lengths", None)]
            return [t for t in parts if t is not None]
        return [obj]
    if isinstance(obj, CombinedFeatures):
        return obj.tensors()
    if isinstance(obj, KeyedJaggedTensor):
        parts = [obj.values(), obj.weights_or_none(), obj.lengths_or_none(), obj.offsets_or_none()]
        # to() moves lengths and offsets if both are held; count what is held.
        return [t for t in parts if t is not None]
    if isinstance(obj, JaggedTensor):
        parts = [obj.values(), obj.weights_or_none(), obj.lengths_or_none(), obj.offsets_or_none()]
        return [t for t in parts if t is not None]
    if isinstance(obj, LazyStackedTensorDict):  # per-sample TensorDicts: each one's own
        return [t for td in obj.tensordicts for t in _tensors(td)]
    if isinstance(obj, TensorDictBase):
        store = getattr(obj, "_tensordict", None)  # plain dict of entries: no per-key checks
        if isinstance(store, dict):
            return [t for v in store.values() for t in _tensors(v)]
        return [t for v in obj.values(include_nested=True, leaves_only=True) for t in _tensors(v)]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _prepared(obj: Any) -> list[Any]:
    """KJTs a host stage prepared for the TensorDicts in ``obj`` (see ``prepare_kjt``)."""
    parts = obj if isinstance(obj, (list, tuple)) else [obj]
    return [k for p in parts for k in prepared_kjts(p)]


def transfer_count(obj: Any) -> int:
    """Host-to-device copies that moving ``obj`` issues (one per tensor it holds)."""
    return len(_tensors(obj))


def move(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``obj`` on ``device``, for every sparse type fxrec knows and plain tensors/containers."""
    if obj is None:
        return None
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(o, device, non_blocking) for o in obj)
    if isinstance(obj, Mapping) and not hasattr(obj, "batch_size"):
        return {k: move(v, device, non_blocking) for k, v in obj.items()}
    return obj.to(device, non_blocking=non_blocking)


def _pin(obj: Any) -> Any:
    if obj is None:
        return None
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(o) for o in obj)
    if isinstance(obj, Mapping) and not hasattr(obj, "batch_size"):
        return {k: _pin(v) for k, v in obj.items()}
    return obj.pin_memory()


@dataclass
class Batch:
    """One training batch. ``model(batch.dense, batch.sparse)`` gives the logits."""

    dense: torch.Tensor
    sparse: Any
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        device = torch.device(device)
        return Batch(
            move(self.dense, device, non_blocking),
            move(self.sparse, device, non_blocking),
            move(self.labels, device, non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(_pin(self.dense), _pin(self.sparse), _pin(self.labels))

    def record_stream(self, stream: Any) -> None:
        """Keep the copied tensors alive until ``stream``'s queued work has used them."""
        for t in _tensors(self.dense) + _tensors(self.sparse) + _tensors(self.labels):
            t.record_stream(stream)
        for kjt in _prepared(self.sparse):  # made on the copy stream, read on ``stream``
            kjt.record_stream(stream)

    def transfer_count(self) -> int:
        return (
            transfer_count(self.dense) + transfer_count(self.sparse) + transfer_count(self.labels)
        )

    def replace(self, **changes: Any) -> Batch:
        return replace(self, **changes)
