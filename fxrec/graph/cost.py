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

The rule of thumb, calibrated with ``python -m fxrec bench graph`` and the seed pattern at
1 and 2 threads on a 2-core AMD EPYC (1 MiB L2 per core, 32 MiB L3): on CPU, fuse
memory-bound ops (norms, pointwise ops) and the GEMMs that feed them only while each
member's result is at most :data:`CPU_MEMBER_ELEMS` elements (larger members are refused,
with the reason in the report: the model runs those ops as written). A group whose fused
result stays within :data:`CPU_GROUP_ELEMS` (16 MiB of float32) stays whole: cutting it
would make each chunk a strided slice of its input, copied before the norm and joined by a
``cat`` after, and that costs more than the cache it saves (100 LayerNorms of 1024 x 32:
1.06x whole vs 0.84x in 1 Mi chunks at 1 thread, 2.1x vs 1.6x at 2). Past that size the
fused tensors no longer come from the allocator's heap (glibc maps blocks over 32 MiB
afresh, and every fresh page faults), so the group is cut into consecutive chunks of
:data:`CPU_CHUNK_ELEMS` (:func:`chunks`): 256 LayerNorms of 2048 x 16 become 8 fused
LayerNorms of 32 members (1.07x at 1 thread, 1.9x at 2; whole: 1.0x, 1.7x; chunks of 8
members gain a little more at 1 thread, 1.2x, for four times the kernels).
GEMMs batched over separate inputs (``torch.stack`` of N activations, then one ``bmm``) pay
on a CPU only while each member's input is small: the stack copies every input each step,
and one ``bmm`` runs N GEMMs no faster than N calls once each is more than a few
microseconds. Measured against N separate Linears (1 thread, batch 256, 2 to 8 members):
inputs of 16-32 features gain 1.04-1.6x training and lose up to 0.8x under ``no_grad``;
64 features gain 1.0-1.2x training and lose 0.86-0.95x; from 128 features (32 Ki elements
per member) the batched form is never faster (0.86-1.02x training, 0.57-0.89x under
``no_grad``), two towers' last Linears included. Such sets are refused past
:data:`CPU_STACKED_INPUT_ELEMS` elements per member's input (:func:`stacked_inputs_reason`).
Grouped embedding lookups are not memory-bound this way (their win is in the backward) and
do not consult this model.

When Inductor compiles the rewritten graph for a CPU (fxrec's pre-grad pass, or
``backend="inductor"``), its generated code already runs each member's elementwise chain as
one loop without eager dispatch, so the launches a fusion saves are worth less: copying a
few separate inputs or weights together every step no longer pays, and one ``bmm`` over N
stacked GEMMs runs slower than Inductor's N GEMMs. There, in-graph weight gathers and batched
GEMMs are refused, and so are sets of fewer than :data:`INDUCTOR_CPU_COPY_MEMBERS` members
that would copy their inputs together (:func:`inductor_on_cpu`, :func:`copy_reason`).
Measured against ``torch.compile``: parallel towers (8 members) through the pre-grad pass
0.65x with those fusions, 0.99x without, and through ``backend="inductor"`` 0.78x with the
batched GEMMs, 1.08x without; the ranking model's 104 per-feature LayerNorms still pay for
their copy (1.5x of ``torch.compile`` without that fusion, 1.6-1.7x with it). Fusions over
pieces of one tensor copy nothing and stay (the seed pattern: 1.35x).

Members that are pieces of a few tensors (400 per-feature LayerNorms of three dims fused
into one per dim, then 400 tanh) are fused run by run, each run of consecutive pieces a view
of its tensor, rather than copied together with a ``cat`` into one set: a run pays its
extra launch while it holds at least :data:`CPU_VIEW_RUN_ELEMS` elements on a CPU (copying
that many floats costs about one eager dispatch, ~0.5 ns per element against 2-5 us per
launch here) and :data:`VIEW_RUN_ELEMS` elsewhere (a GPU launch costs about as much as
copying a few MiB); smaller runs are copied with the rest (:func:`view_run_pays`). A run
that reads only part of a tensor autograd tracks costs, in backward, a zero-filled gradient
of the whole tensor, added to its other gradients (the ``narrow``'s backward): on a CPU such
a run of N members pays only while the tensor holds at most N - 1 times
:data:`CPU_VIEW_RUN_ELEMS` elements (:func:`partial_view_pays`); FiBiNET's runs
``v_i * x[:, i+1:]`` over a (2048, 20, 8) ``x`` made its training step 1.1x slower.

Binary ops whose operands are copied together (a ``cat`` per operand that is not a run of
pieces) pay on a CPU only while each member's copied operands hold at most
:data:`CPU_COPIED_MEMBER_ELEMS` elements (:func:`copy_volume_reason`): a member saves about
three launches (its forward op and the two gradients of its backward), and past that the
copy and, in backward, the add of each operand's gradient through a strided slice of the
fused one cost more. Measured on FiBiNET's 380 parallel ``v_i * f_j`` (members of 2048 x 8,
both operands copied): training 11-26% slower fused at batch 2048, even at batch 256.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from fxrec.graph import meta

__all__ = [
    "CPU_CHUNK_ELEMS",
    "CPU_COPIED_MEMBER_ELEMS",
    "CPU_GROUP_ELEMS",
    "CPU_MEMBER_ELEMS",
    "CPU_STACKED_INPUT_ELEMS",
    "CPU_VIEW_RUN_ELEMS",
    "INDUCTOR_CPU_COPY_MEMBERS",
    "VIEW_RUN_ELEMS",
    "cache_reason",
    "chunks",
    "copy_reason",
    "copy_volume_reason",
    "inductor_on_cpu",
    "partial_view_pays",
    "stacked_inputs_reason",
    "view_run_pays",
]

CPU_MEMBER_ELEMS = 32 * 1024
CPU_GROUP_ELEMS = 4 * 1024 * 1024
CPU_CHUNK_ELEMS = 1024 * 1024
CPU_STACKED_INPUT_ELEMS = 16 * 1024
INDUCTOR_CPU_COPY_MEMBERS = 32
CPU_VIEW_RUN_ELEMS = 4 * 1024
VIEW_RUN_ELEMS = 1024 * 1024
CPU_COPIED_MEMBER_ELEMS = 8 * 1024


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
    largest = max(known)
    if largest > CPU_MEMBER_ELEMS:
        return (
            f"CPU cost model: {largest} elements per member (> {CPU_MEMBER_ELEMS}): dispatch is "
            "negligible at this size and fused the members would stream through memory "
            "instead of cache"
        )
    return None


def inductor_on_cpu(ctx: Any) -> bool:
    """True when Inductor compiles the rewritten graph for a CPU (see the module notes).

    ``ctx``: a :class:`~fxrec.graph.rule.RewriteContext` (its ``device_type`` and
    ``for_inductor``).
    """
    return bool(ctx.for_inductor) and ctx.device_type == "cpu"


def copy_reason(ctx: Any, members: int, what: str) -> str | None:
    """Why joining ``what`` of ``members`` (copied each step) is refused here, or None."""
    if not inductor_on_cpu(ctx) or members >= INDUCTOR_CPU_COPY_MEMBERS:
        return None
    return (
        f"Inductor on CPU: {what} would be copied together every step, and for fewer than "
        f"{INDUCTOR_CPU_COPY_MEMBERS} members Inductor's own loop per member is cheaper"
    )


def copy_volume_reason(device_type: str, copied_elems: int) -> str | None:
    """Why copying ``copied_elems`` elements of operands per member together costs more than
    the launches the fusion saves on ``device_type`` (None: it pays; see the module notes)."""
    if device_type != "cpu" or copied_elems <= CPU_COPIED_MEMBER_ELEMS:
        return None
    return (
        f"CPU cost model: {copied_elems} operand elements per member copied together (> "
        f"{CPU_COPIED_MEMBER_ELEMS}): the cats and their gradients cost more than the launches "
        "saved"
    )


def view_run_pays(elems: int, device_type: str) -> bool:
    """Whether a run of pieces of one tensor holding ``elems`` elements in all should be fused
    on its own, as a view, rather than copied together with other members (module notes)."""
    return elems >= (CPU_VIEW_RUN_ELEMS if device_type == "cpu" else VIEW_RUN_ELEMS)


def partial_view_pays(members: int, base_elems: int, device_type: str) -> bool:
    """Whether a run of ``members`` reading part of a tensor of ``base_elems`` elements that
    autograd tracks pays for that tensor's zero-filled gradient in backward (module notes)."""
    return device_type != "cpu" or base_elems <= (members - 1) * CPU_VIEW_RUN_ELEMS


def stacked_inputs_reason(device_type: str, input_elems: int) -> str | None:
    """Why GEMMs over separate inputs of ``input_elems`` elements each should not be stacked
    into one batched GEMM on ``device_type`` (None: they may; see the module notes)."""
    if device_type != "cpu" or input_elems <= CPU_STACKED_INPUT_ELEMS:
        return None
    return (
        f"CPU cost model: {input_elems} input elements per member (> "
        f"{CPU_STACKED_INPUT_ELEMS}): stacking the separate inputs costs more than one batched "
        "GEMM saves over separate ones"
    )


def chunks(group: Sequence[fx.Node], device_type: str) -> list[list[fx.Node]]:
    """``group`` cut into consecutive sets whose fused tensors stay in cache on a CPU.

    Members are kept in the model's written order (:func:`fxrec.graph.meta.program_order`),
    so each chunk of a split's pieces is still a run of pieces (a view, no copy). On a GPU,
    or when sizes are unknown, the group stays whole.
    """
    if device_type != "cpu":
        return [list(group)]
    sizes = [_numel(n) for n in group]
    if any(s is None for s in sizes) or sum(sizes) <= CPU_GROUP_ELEMS:  # type: ignore[arg-type]
        return [list(group)]
    per = max(2, CPU_CHUNK_ELEMS // max(sizes))  # type: ignore[type-var]
    ordered = sorted(group, key=meta.program_order)
    parts = [ordered[i : i + per] for i in range(0, len(ordered), per)]
    if len(parts) > 1 and len(parts[-1]) < 2:  # a lone member: give it to the chunk before
        parts[-2].extend(parts.pop())
    return parts
