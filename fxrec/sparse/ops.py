"""``torch.ops.fxrec.permute_and_split``: per-feature tensors back from combined inputs.

The device half of seed 000 §3.1: the host sends ONE values, ONE lengths (and ONE weights)
tensor for all features; this op recovers each feature's ``(values, lengths, weights)`` in any
requested order (repeats allowed, omitted features dropped). It is registered with
``torch.library`` (real kernel, fake kernel, autograd for weights), so it is one node under
``torch.fx`` and ``torch.compile``.

Schema::

    fxrec::permute_and_split(Tensor values, Tensor lengths, Tensor? weights,
                             SymInt[] stride_per_key, SymInt[] length_per_key, int[] order)
        -> (Tensor[] values, Tensor[] lengths, Tensor[] weights)

``stride_per_key``/``length_per_key`` are host-side figures the packer already knows (rows and
ids per feature), so the kernel never reads device memory to size its outputs. Outputs are
fresh tensors (custom ops may not return aliases): a full permutation is one batched
``split_with_sizes_copy`` per tensor; a selection with repeats or omissions first gathers
with fbgemm's ``permute_*_sparse_data`` (or a torch gather without fbgemm).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxrec.sparse.permute import get_backend, permute_jagged
from fxrec.sparse.segments import segment_gather_index

__all__ = ["permute_and_split", "permute_and_split_impl"]

_Out = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _split_copy(src: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Pieces of ``src`` as fresh tensors.

    On CUDA the ``out=`` overload has a one-kernel path for all pieces (as FSDP2 uses); on the
    CPU the functional overload avoids a Python allocation per piece.
    """
    if not sizes:
        return []
    if src.device.type == "cuda":
        outs = [src.new_empty((n, *src.shape[1:])) for n in sizes]
        torch.split_with_sizes_copy(src, sizes, dim=0, out=outs)
        return outs
    return list(torch.split_with_sizes_copy(src, sizes, dim=0))


def permute_and_split_impl(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: Sequence[int],
    length_per_key: Sequence[int],
    order: Sequence[int],
    backend: str | None = None,
) -> _Out:
    """The real kernel (also callable directly, e.g. to compare the two backends)."""
    spk = [int(s) for s in stride_per_key]
    lpk = [int(n) for n in length_per_key]
    order = [int(o) for o in order]
    if sorted(order) == list(range(len(spk))):
        # Every feature once: split in place order, hand the pieces back reordered.
        vals = _split_copy(values, lpk)
        lens = _split_copy(lengths, spk)
        wts = _split_copy(weights, lpk) if weights is not None else []
        return (
            [vals[o] for o in order],
            [lens[o] for o in order],
            [wts[o] for o in order] if wts else [],
        )
    pv, pl, pw = permute_jagged(values, lengths, weights, spk, lpk, order, backend=backend)
    sel_l = [lpk[o] for o in order]
    sel_s = [spk[o] for o in order]
    return (
        _split_copy(pv, sel_l),
        _split_copy(pl, sel_s),
        _split_copy(pw, sel_l) if pw is not None else [],
    )


@torch.library.custom_op(
    "fxrec::permute_and_split",
    mutates_args=(),
    schema=(
        "(Tensor values, Tensor lengths, Tensor? weights, SymInt[] stride_per_key, "
        "SymInt[] length_per_key, int[] order) -> (Tensor[], Tensor[], Tensor[])"
    ),
)
def _permute_and_split_op(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: Sequence[int],
    length_per_key: Sequence[int],
    order: Sequence[int],
) -> _Out:
    return permute_and_split_impl(
        values, lengths, weights, stride_per_key, length_per_key, order, get_backend()
    )


@_permute_and_split_op.register_fake
def _(values, lengths, weights, stride_per_key, length_per_key, order):  # type: ignore[no-untyped-def]
    vals = [values.new_empty((length_per_key[o], *values.shape[1:])) for o in order]
    lens = [lengths.new_empty(stride_per_key[o]) for o in order]
    wts = [weights.new_empty(length_per_key[o]) for o in order] if weights is not None else []
    return vals, lens, wts


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    _values, _lengths, weights, _stride_per_key, length_per_key, order = inputs
    ctx.length_per_key = list(length_per_key)
    ctx.order = list(order)
    ctx.weighted = weights is not None
    if weights is not None:
        ctx.w_shape, ctx.w_dtype, ctx.w_device = weights.shape, weights.dtype, weights.device


def _backward(ctx, grad_values, grad_lengths, grad_weights):  # type: ignore[no-untyped-def]
    if not ctx.weighted:
        return None, None, None, None, None, None
    lpk, order = ctx.length_per_key, ctx.order
    grads = [
        g if g is not None else torch.zeros(lpk[o], dtype=ctx.w_dtype, device=ctx.w_device)
        for g, o in zip(grad_weights, order)
    ]
    # Scatter-add each output's gradient to its feature's slice (repeats accumulate).
    idx = segment_gather_index(lpk, order, ctx.w_device)
    gw = torch.zeros(ctx.w_shape, dtype=ctx.w_dtype, device=ctx.w_device)
    if grads:
        gw.index_add_(0, idx, torch.cat(grads))
    return None, None, gw, None, None, None


_permute_and_split_op.register_autograd(_backward, setup_context=_setup_context)


def permute_and_split(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: Sequence[int],
    length_per_key: Sequence[int],
    order: Sequence[int],
) -> _Out:
    """Per-feature ``(values, lengths, weights)`` lists in ``order``; see the module docstring.

    ``weights`` list is empty when ``weights`` is None.
    """
    return torch.ops.fxrec.permute_and_split(
        values, lengths, weights, list(stride_per_key), list(length_per_key), list(order)
    )
