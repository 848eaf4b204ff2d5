"""When a horizontal fusion pays on the device at hand.

Fusing N parallel ops into one saves N-1 launches. On a GPU a launch costs microseconds
and the fused kernel streams memory as fast as the N small ones, so fusing always pays. On
a CPU an eager op costs ~5-10 us of dispatch, and N small ops each work on a tensor that
stays in cache while the next op of the member's chain reads it (LayerNorm -> affine ->
activation); the fused op works on one N-times-larger tensor that streams through memory
instead. Once each member's tensor is large, dispatch is a few percent of its time and the
lost cache locality costs more: measured here (training step, 1 thread), 8 towers at batch
2048 (128 Ki elements per member) run 1.3-1.6x *slower* fused, the seed pattern with 256
members at batch 2048 (8 Mi elements fused) 1.15x slower; at batch 256 both are faster fused.

The rule of thumb, calibrated with ``python -m fxrec bench graph`` on a 2-core AMD EPYC
(1 MiB L2 per core, 32 MiB L3): on CPU, fuse memory-bound ops (norms, pointwise ops) and
the GEMMs that feed them only while each member's result is at most
:data:`CPU_MEMBER_ELEMS` elements and the fused result at most :data:`CPU_GROUP_ELEMS`.
Larger groups are refused with the reason in the report (the model then runs those ops as
written: never slower). Grouped embedding lookups are not memory-bound this way (their
win is in the backward) and do not consult this model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from fxrec.graph import meta

__all__ = ["CPU_GROUP_ELEMS", "CPU_MEMBER_ELEMS", "cache_reason"]

CPU_MEMBER_ELEMS = 32 * 1024
CPU_GROUP_ELEMS = 4 * 1024 * 1024


def _numel(node: fx.Node) -> int | None:
    ti = meta.info(node)
    if not isinstance(ti, meta.TensorInfo) or not ti.static:
        return None
    return ti.numel()


def cache_reason(group: Sequence[fx.Node], device_type: str) -> str | None:
    """Why fusing ``group`` would be slower on ``device_type`` (None: it pays).

    Sizes come from the members' output metadata; a member without a static size (dynamic
    batch) gives no evidence against fusing.
    """
    if device_type != "cpu":
        return None
    sizes = [_numel(n) for n in group]
    known = [s for s in sizes if s is not None]
    if not known:
        return None
    largest, total = max(known), sum(known)
    if largest > CPU_MEMBER_ELEMS:
        return (
            f"CPU cost model: {largest} elements per member (> {CPU_MEMBER_ELEMS}): dispatch is "
            "negligible at this size and fused the members would stream through memory "
            "instead of cache"
        )
    if total > CPU_GROUP_ELEMS:
        return (
            f"CPU cost model: {total} elements fused (> {CPU_GROUP_ELEMS}): the fused tensor "
            "no longer stays in cache between the ops of the chain"
        )
    return None
