"""Conversions between fxrec's sparse types and TorchRec's (``torchrec.sparse.jagged_tensor``).

No copies: the converted object holds the same tensors. TorchRec is imported only when a
conversion runs, so fxrec works without it. A variable batch size maps to TorchRec's
``stride_per_key_per_rank`` with one rank (``[[b] for b in stride_per_key]``).
"""

from __future__ import annotations

from typing import Any

from fxrec.sparse.jagged_tensor import JaggedTensor
from fxrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from fxrec.sparse.keyed_tensor import KeyedTensor

__all__ = ["to_torchrec", "from_torchrec", "torchrec_types"]


def torchrec_types() -> Any:
    """TorchRec's ``jagged_tensor`` module, or an ImportError saying how to install it."""
    try:
        from torchrec.sparse import jagged_tensor
    except ImportError as e:
        raise ImportError(
            "this conversion needs TorchRec; install the extra with `pip install fxrec[torchrec]` "
            f"(torchrec and fbgemm-gpu-cpu, or fbgemm-gpu on CUDA). Import failed with: {e}"
        ) from e
    return jagged_tensor


def to_torchrec(x: JaggedTensor | KeyedJaggedTensor | KeyedTensor) -> Any:
    """The TorchRec object with the same contents (same tensors, no copy)."""
    jt = torchrec_types()
    if isinstance(x, KeyedJaggedTensor):
        variable = x.variable_stride_per_key()
        return jt.KeyedJaggedTensor(
            keys=list(x.keys()),
            values=x.values(),
            weights=x.weights_or_none(),
            lengths=x.lengths(),
            offsets=x.offsets_or_none(),
            stride=None if variable else x.stride(),
            stride_per_key_per_rank=[[s] for s in x.stride_per_key()] if variable else None,
            length_per_key=x.length_per_key_or_none(),
        )
    if isinstance(x, JaggedTensor):
        return jt.JaggedTensor(
            values=x.values(),
            weights=x.weights_or_none(),
            lengths=x.lengths(),
            offsets=x.offsets_or_none(),
        )
    if isinstance(x, KeyedTensor):
        return jt.KeyedTensor(
            keys=list(x.keys()),
            length_per_key=list(x.length_per_key()),
            values=x.values(),
            key_dim=x.key_dim(),
        )
    raise ValueError(
        f"to_torchrec takes a JaggedTensor, KeyedJaggedTensor or KeyedTensor, got "
        f"{type(x).__name__}."
    )


def from_torchrec(x: Any) -> JaggedTensor | KeyedJaggedTensor | KeyedTensor:
    """fxrec's object with the same contents (validated like any fxrec constructor)."""
    jt = torchrec_types()
    if isinstance(x, jt.KeyedJaggedTensor):
        if x.inverse_indices_or_none() is not None:
            raise ValueError(
                "this TorchRec KJT carries inverse_indices (deduplicated variable-batch "
                "embeddings), which fxrec does not model; expand it before converting."
            )
        variable = x.variable_stride_per_key()
        values = x.values()
        if values.numel() == 0 and values.dtype.is_floating_point:
            values = values.long()  # TorchRec's KeyedJaggedTensor.empty() holds float32 ids
        return KeyedJaggedTensor(
            keys=list(x.keys()),
            values=values,
            weights=x.weights_or_none(),
            lengths=x.lengths(),
            stride=None if variable else x.stride(),
            stride_per_key=x.stride_per_key() if variable else None,
            length_per_key=x.length_per_key_or_none(),
        )
    if isinstance(x, jt.JaggedTensor):
        return JaggedTensor(values=x.values(), weights=x.weights_or_none(), lengths=x.lengths())
    if isinstance(x, jt.KeyedTensor):
        return KeyedTensor(
            keys=list(x.keys()),
            length_per_key=list(x.length_per_key()),
            values=x.values(),
            key_dim=x.key_dim(),
        )
    raise ValueError(
        f"from_torchrec takes TorchRec's JaggedTensor, KeyedJaggedTensor or KeyedTensor, got "
        f"{type(x).__name__}."
    )
