"""Kernel counting: the primary, deterministic figure on noisy machines.

A kernel is an ATen operator that launches work. View ops (``OpOverload.is_view``) and
metadata-only ops launch nothing and are not counted. Forward and backward are counted
separately. On CUDA, :func:`count_cuda_kernels` gives the profiler's device-kernel count.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["KernelCount", "count_kernels", "count_cuda_kernels"]

# Ops that only touch metadata or allocate without computing anything.
_FREE_OPS = {
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::_local_scalar_dense",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
    "aten::is_same_size",
    "aten::_has_compatible_shallow_copy_type",
    "aten::set_",
    "aten::resize_",
    "aten::_unsafe_view",  # a view without autograd's view tracking (``reshape`` after a copy)
}


def _is_kernel(func: torch._ops.OpOverload) -> bool:
    if getattr(func, "is_view", False):
        return False
    return func._schema.name not in _FREE_OPS


class _Counter(TorchDispatchMode):
    """Counts ATen kernels; safe to use around ``torch.compile``-d code (see FIELD_NOTES)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _is_kernel(func):
            self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class KernelCount:
    """Kernels launched by one call: ``forward`` and ``backward`` totals and per-op counts."""

    forward: int
    backward: int
    forward_ops: dict[str, int] = field(default_factory=dict)
    backward_ops: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __str__(self) -> str:
        return f"KernelCount(forward={self.forward}, backward={self.backward})"


def _tensors(out: Any) -> list[torch.Tensor]:
    # fxrec's sparse types are registered pytree nodes, so their tensors are leaves here too.
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _loss(out: Any) -> torch.Tensor | None:
    terms = [t.float().sum() for t in _tensors(out) if t.requires_grad]
    if not terms:
        return None
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def count_kernels(
    fn: Callable[..., Any], *args: Any, backward: bool = True, **kwargs: Any
) -> KernelCount:
    """Run ``fn(*args, **kwargs)`` once (and the backward of the sum of its outputs) and count kernels.

    The loss used for backward (a sum over every output that requires grad) is built outside the
    counted region, so the backward count is the model's own backward only. When ``fn`` is a
    module, gradients already in its parameters' ``.grad`` are set aside for the backward and
    put back after: the count is that of a step after ``zero_grad(set_to_none=True)`` (no
    accumulation kernels from an earlier call), and ``.grad`` is left as it was found.
    """
    with _Counter() as fwd:
        out = fn(*args, **kwargs)
    bwd = _Counter()
    if backward:
        loss = _loss(out)
        if loss is not None:
            params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
            kept = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                with bwd:
                    loss.backward()
            finally:
                for p, g in zip(params, kept):
                    p.grad = g
    return KernelCount(
        forward=sum(fwd.ops.values()),
        backward=sum(bwd.ops.values()),
        forward_ops=dict(fwd.ops),
        backward_ops=dict(bwd.ops),
    )


def count_cuda_kernels(fn: Callable[..., Any], *args: Any, backward: bool = True) -> KernelCount:
    """The profiler's count of CUDA kernels for one forward (and backward) call."""
    from torch.profiler import ProfilerActivity, profile

    def _device_kernels(prof: Any) -> tuple[int, dict[str, int]]:
        names: collections.Counter[str] = collections.Counter()
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                names[evt.name] += 1
        return sum(names.values()), dict(names)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pf:
        out = fn(*args)
        torch.cuda.synchronize()
    f, fo = _device_kernels(pf)
    b, bo = 0, {}
    loss = _loss(out) if backward else None
    if loss is not None:
        with profile(activities=[ProfilerActivity.CUDA]) as pb:
            loss.backward()
            torch.cuda.synchronize()
        b, bo = _device_kernels(pb)
    return KernelCount(forward=f, backward=b, forward_ops=fo, backward_ops=bo)
