"""Batched sparse features: ``JaggedTensor``, ``KeyedJaggedTensor``, ``KeyedTensor``.

Semantics match TorchRec's types of the same names. Also here: TensorDict conversions
(weights and variable batch included), TorchRec conversions, the combined-input packer and
``torch.ops.fxrec.permute_and_split`` (seed 000 §3.1), and the validation switch.
"""

from __future__ import annotations

from fxrec.sparse.combine import CombinedFeatures, combined_to_kjt, pack_features, unpack_features
from fxrec.sparse.jagged_tensor import JaggedTensor
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.keyed_tensor import KeyedTensor
from fxrec.sparse.ops import permute_and_split
from fxrec.sparse.permute import fbgemm_available, get_backend, set_backend
from fxrec.sparse.pytree import register_pytrees
from fxrec.sparse.tensordict_interop import (
    kjt_from_tensordict,
    kjt_to_tensordict,
    prepare_kjt,
    record_conversions,
    tensordict_from_jagged,
)
from fxrec.sparse.torchrec_interop import from_torchrec, to_torchrec
from fxrec.sparse.validation import set_validation, validation_disabled, validation_enabled

__all__ = [
    "CombinedFeatures",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "combined_to_kjt",
    "fbgemm_available",
    "from_torchrec",
    "get_backend",
    "kjt_from_tensordict",
    "kjt_to_tensordict",
    "pack_features",
    "permute_and_split",
    "prepare_kjt",
    "record_conversions",
    "set_backend",
    "set_validation",
    "tensordict_from_jagged",
    "to_torchrec",
    "unpack_features",
    "validation_disabled",
    "validation_enabled",
]

register_pytrees()
