"""Permuting key-major jagged data by key: fbgemm's one-kernel gathers when present, else torch.

``permute_jagged`` is the one place that knows both backends; :class:`KeyedJaggedTensor.permute`
and the ``fxrec::permute_and_split`` op call it. Both backends give bit-identical results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from fxrec.sparse.segments import gather_segments

__all__ = ["fbgemm_available", "set_backend", "get_backend", "permute_jagged"]

logger = logging.getLogger(__name__)
_BACKENDS = ("auto", "fbgemm", "torch")
_backend = os.environ.get("FXREC_SPARSE_BACKEND", "auto")


_fbgemm: bool | None = None


def fbgemm_available() -> bool:
    """Whether ``torch.ops.fbgemm.permute_2D_sparse_data`` can be loaded (imported once).

    A plain module flag rather than ``lru_cache``, which dynamo would re-trace on every call.
    """
    global _fbgemm
    if _fbgemm is None:
        try:
            import fbgemm_gpu  # noqa: F401

            _fbgemm = hasattr(torch.ops.fbgemm, "permute_2D_sparse_data")
        except Exception as e:  # ImportError, or a broken binary
            logger.debug("fbgemm_gpu not usable (%s); using pure torch sparse kernels", e)
            _fbgemm = False
    return _fbgemm


def set_backend(name: str) -> None:
    """``"auto"`` (fbgemm when importable), ``"fbgemm"`` or ``"torch"``."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}.")
    if name == "fbgemm" and not fbgemm_available():
        raise ValueError("backend 'fbgemm' needs fbgemm_gpu: pip install fxrec[torchrec].")
    _backend = name


def get_backend() -> str:
    """The backend in use now: ``"fbgemm"`` or ``"torch"``."""
    if _backend == "torch":
        return "torch"
    if _backend == "fbgemm":
        return "fbgemm"
    return "fbgemm" if fbgemm_available() else "torch"


_FBGEMM_INDEX_DTYPES = (torch.int32, torch.int64)


def _fbgemm_handles(
    values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
) -> bool:
    """Whether fbgemm's permute kernels compute this case right.

    They have kernels for int32/int64 ids and lengths and float32/float64 weights only,
    and their autograd drops or misroutes the weights' gradient (wrong sums for repeated
    keys, ``None`` for a variable batch, errors for dropped keys): weights that need a
    gradient take the torch path.
    """
    if values.dtype not in _FBGEMM_INDEX_DTYPES or lengths.dtype not in _FBGEMM_INDEX_DTYPES:
        return False
    if weights is None:
        return True
    if weights.dtype not in (torch.float32, torch.float64):
        return False
    return not (weights.requires_grad and torch.is_grad_enabled())


def permute_jagged(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: Sequence[int],
    length_per_key: Sequence[int],
    order: Sequence[int],
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gather keys of a key-major jagged batch in ``order`` (duplicates repeat, omitted drop).

    Returns new ``(values, lengths, weights)`` tensors, never views of the inputs.
    """
    backend = backend or get_backend()
    if backend == "fbgemm" and not _fbgemm_handles(values, lengths, weights):
        backend = "torch"
    order = list(order)
    total = sum(length_per_key[i] for i in order)
    degenerate = not order or values.numel() == 0 or lengths.numel() == 0
    if backend == "fbgemm" and not degenerate:
        perm = torch.tensor(order, dtype=torch.int32)
        if perm.device != values.device:
            perm = perm.to(values.device, non_blocking=True)
        s0 = stride_per_key[0]
        if all(s == s0 for s in stride_per_key):
            pl, pv, pw = torch.ops.fbgemm.permute_2D_sparse_data(
                perm, lengths.view(len(stride_per_key), s0), values, weights, total
            )
            return pv, pl.reshape(-1), pw
        spk = torch.tensor(list(stride_per_key), dtype=lengths.dtype, device=lengths.device)
        lpk = torch.tensor(list(length_per_key), dtype=lengths.dtype, device=lengths.device)
        rows = sum(stride_per_key[i] for i in order)
        _, pl, _ = torch.ops.fbgemm.permute_1D_sparse_data(perm, spk, lengths, None, rows)
        _, pv, pw = torch.ops.fbgemm.permute_1D_sparse_data(perm, lpk, values, weights, total)
        return pv, pl, pw
    pv = gather_segments(values, length_per_key, order)
    pw = gather_segments(weights, length_per_key, order) if weights is not None else None
    s0 = stride_per_key[0] if stride_per_key else 0
    if stride_per_key and all(s == s0 for s in stride_per_key):
        idx = torch.tensor(order, dtype=torch.long, device=lengths.device)
        pl = lengths.view(len(stride_per_key), s0).index_select(0, idx).reshape(-1)
    else:
        pl = gather_segments(lengths, stride_per_key, order)
    return pv, pl, pw
