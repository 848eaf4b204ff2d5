"""Parameters of fused layers, laid out once.

A fused layer needs its members' weights side by side (concatenated or stacked along dim 0).
Gathering them inside the graph every step (``torch.cat`` of N weights) is what makes
PyTorch's own batch fusions slower than eager on real multi-task models. fxrec instead
allocates ONE parameter holding the members' values and re-points each member parameter's
storage at its slice (``member.data = flat[i]``). So:

* a step reads the fused weight directly: no gather in forward, no scatter in backward;
* the user's original ``nn.Parameter`` objects still exist, share storage with the fused
  one, and so always show the trained values: ``state_dict()`` keys, shapes and values stay
  the original ones, and ``load_state_dict`` writes through into the fused parameter;
* a gradient that still reaches a member (a loss term on the model's parameters, an L2
  penalty selected by name) is moved into its slice of the fused parameter's gradient;
* the optimizer must be built on the optimized module's ``parameters()`` (which yields the
  fused parameter, not the members) *after* ``fxrec.optimize``.

Users who cannot rebuild their optimizer pass ``keep_params=True``: members stay the
trained leaves and the fused weight is gathered in-graph (slower, but nothing moves). Graphs
whose parameters are graph inputs (``torch.compile`` backends) always gather in-graph.
"""

from __future__ import annotations

import logging
import operator
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from fxrec.graph.effects import has_hooks, written_in_place

logger = logging.getLogger(__name__)

__all__ = ["FusedParameters", "ParamStore"]

OWNER_ATTR = "fxrec_fused"


@dataclass
class _Member:
    tensor: torch.Tensor  # the user's Parameter or buffer object
    index: int  # position along dim 0 of the flat tensor (stacked layout)
    offset: int  # start row in the flat tensor (concatenated layout)
    ptr: int = 0  # where its data was pointed last: another address means new data
    # where its flat tensor sits in an outer flat tensor (see ``FusedParameters.locate``)
    within: tuple[_Slot, ...] = ()


@dataclass(frozen=True)
class _Slot:
    """Where a member sits in its flat tensor, without holding the member."""

    how: str  # "stack" or "cat"
    index: int
    offset: int
    rows: int
    # the slots of the flat tensors it sits in, outermost first: a layout of flat tensors
    # (a Linear's concatenated weights, then those stacked across parallel towers)
    within: tuple[_Slot, ...] = ()


def _slot(how: str, m: _Member) -> _Slot:
    # ``int``: under ``torch.jit.trace`` a size is a traced tensor, which graph code would bake in
    return _Slot(how, m.index, m.offset, int(m.tensor.shape[0]) if m.tensor.dim() else 1, m.within)


def _member_slice(flat: torch.Tensor, how: str, m: _Member) -> torch.Tensor:
    """``m``'s part of ``flat`` (or of its gradient), as a view."""
    return _slot_view(flat, _slot(how, m))


def _slot_view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    for outer in slot.within:
        flat = _slot_view(flat, outer)
    if slot.how == "stack":
        piece = flat[slot.index]
        if piece.is_contiguous() and piece.stride() != _dense_strides(piece.shape):
            # a flat restrided by ``_grad_strides``: members keep the strides they were made with
            piece = piece.as_strided(piece.shape, _dense_strides(piece.shape))
        return piece
    return flat.narrow(0, slot.offset, slot.rows)


def _sparse_slot(grad: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """A sparse gradient's part at ``slot``, as a new sparse tensor: sparse tensors have no
    views of their rows (``narrow`` / ``as_strided`` are not implemented for them)."""
    for outer in slot.within:
        grad = _sparse_slot(grad, outer)
    if slot.how == "stack":
        return grad.select(0, slot.index)
    return grad.narrow_copy(0, slot.offset, slot.rows)


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _grad_strides(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` with the strides its gradient comes back with, where a size-1 dim leaves a
    choice. A batched Linear's ``(N, 1, in)`` weight (single-output heads) gets its gradient
    through a transpose, with stride 1 on the size-1 dim: DDP compares strides exactly and
    would warn that the gradient breaks its bucket's layout. The memory is the same."""
    if flat.dim() != 3 or flat.shape[1] != 1 or not flat.is_contiguous():
        return flat
    return flat.as_strided(flat.shape, (flat.stride(0), 1, flat.stride(2)))


@dataclass
class _Viewed:
    """A flat tensor's data when its members were last pointed at it: another address on
    the same tensor object means its data was replaced (``flat.data = t``,
    ``vector_to_parameters``) and the members still view the old data."""

    flat: torch.Tensor  # the flat tensor object (another object: swapped, e.g. by export)
    ptr: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Fingerprint:
    """The flat tensors and members as the last sync left them: a call that finds them all
    the same (no new data, no flag set, no flat tensor swapped) has nothing to sync."""

    params: list[torch.Tensor]  # the owner's ``_parameters`` values
    buffers: list[torch.Tensor]  # and ``_buffers`` values
    tensors: list[torch.Tensor]  # the flat tensors and their members
    ptrs: list[int]  # their data pointers
    flags: list[bool]  # their ``requires_grad``

    @classmethod
    def of(cls, owner: FusedParameters) -> _Fingerprint:
        tensors = [getattr(owner, n) for n in owner._members]
        tensors += [m.tensor for _, ms in owner._members.values() for m in ms]
        return cls(
            list(owner._parameters.values()),
            list(owner._buffers.values()),
            tensors,
            list(map(_DATA_PTR, tensors)),
            list(map(_REQUIRES_GRAD, tensors)),
        )

    def matches(self, owner: FusedParameters, flags: bool = True) -> bool:
        """Per call: C-level passes over the tensors, no Python loop (~0.07 us a member and
        pass); ``flags=False`` leaves the ``requires_grad`` flags unchecked."""
        params, buffers = owner._parameters, owner._buffers
        return (
            len(params) == len(self.params)
            and all(map(operator.is_, self.params, params.values()))
            and len(buffers) == len(self.buffers)
            and all(map(operator.is_, self.buffers, buffers.values()))
            and list(map(_DATA_PTR, self.tensors)) == self.ptrs
            and (not flags or list(map(_REQUIRES_GRAD, self.tensors)) == self.flags)
        )


_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


# Every laid-out member parameter in the process, by id: (member, its flat parameter, where it
# sits), the tensors held weakly. An optimizer built on the model before ``fxrec.optimize``
# holds the members, whose gradients now go to the flat parameters: it would skip them, every
# step, silently.
_LAID_OUT: dict[int, tuple[weakref.ref, weakref.ref, _Slot]] = {}
_FLATS: dict[int, weakref.ref] = {}  # every flat parameter holding laid-out members, by id
# The FusedParameters holding each flat parameter of ``_FLATS`` at its root, by the flat's id.
_FLAT_OWNERS: dict[int, weakref.ref] = {}
_step_hook: list[RemovableHandle] = []


@dataclass
class _GradNote:
    """What went into one ``.grad`` tensor of a flat parameter (a new tensor: a new note)."""

    grad: weakref.ref
    graph: bool = False  # autograd accumulated into it: a graph read the flat parameter
    moved: set[int] = field(default_factory=set)  # members whose own gradients were moved in


_NOTES: dict[int, tuple[weakref.ref, _GradNote]] = {}  # by id of the flat parameter


def _note(flat: torch.Tensor) -> _GradNote:
    """The note on ``flat``'s current ``.grad`` (which is not None)."""
    key = id(flat)
    entry = _NOTES.get(key)
    if entry is not None and entry[0]() is flat and entry[1].grad() is flat.grad:
        return entry[1]

    def forget(ref: weakref.ref) -> None:  # the flat parameter died: its id may be reused
        if _NOTES.get(key, (None,))[0] is ref:
            del _NOTES[key]

    note = _GradNote(weakref.ref(flat.grad))
    _NOTES[key] = (weakref.ref(flat, forget), note)
    return note


def _graph_grad(flat: torch.Tensor) -> None:
    """Post-accumulate hook on each flat parameter: autograd reached it, so a graph read it
    (tells the optimizer check a stale optimizer from the plain model trained directly)."""
    _note(flat).graph = True


def _grad_to_flat(member: torch.Tensor) -> None:
    """Post-accumulate hook on each laid-out member.

    A gradient that reaches the member itself (a loss term on the model's parameters: an L2
    penalty selected by name) goes into the member's slice of the flat parameter's gradient,
    which the optimizer on ``opt.parameters()`` and ``grads`` read, and leaves the member (an
    optimizer holding both, ``ddp.parameters()``, would apply it twice). A flat tensor laid
    out in another (see ``FusedParameters.locate``) is read by graphs only: its gradient
    counts as the graph's.
    """
    entry = _LAID_OUT.get(id(member))
    g = member.grad
    if entry is None or entry[0]() is not member or g is None or _counting_kernels():
        return
    flat = entry[1]()
    if flat is None:
        return
    with torch.no_grad():
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)  # keeps the flat's strides (``_grad_strides``)
        if flat.grad.is_sparse:
            full = torch.zeros_like(flat)
            _slot_view(full, entry[2]).add_(g)
            flat.grad = flat.grad + full.to_sparse(flat.grad.sparse_dim())
        else:
            _slot_view(flat.grad, entry[2]).add_(g)
    note = _note(flat)
    inner = _FLATS.get(id(member))
    if inner is not None and inner() is member:
        note.graph = True
    else:
        note.moved.add(id(member))
    member.grad = None


def _counting_kernels() -> bool:
    """Is ``fxrec.count_kernels`` counting (the plain model's step, for the report)? Its
    gradients then stay where eager puts them: the count is eager's, and ``count_kernels``
    restores them, not the flat parameters' gradients."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fxrec.measure import _Counter

    return any(isinstance(mode, _Counter) for mode in _get_current_dispatch_mode_stack())


def _hook(t: torch.Tensor, fn: object) -> None:
    """Register fxrec's post-accumulate hook ``fn`` on ``t`` once (copies and unpickled
    tensors come without hooks); a tensor that needs no gradient gets it when it does."""
    hooks = t._post_accumulate_grad_hooks
    if t.requires_grad and not (hooks and any(h is fn for h in hooks.values())):
        t.register_post_accumulate_grad_hook(fn)  # type: ignore[arg-type]


def _watch(member: torch.Tensor, flat: torch.Tensor, slot: _Slot) -> None:
    key = id(member)

    def forget(ref: weakref.ref) -> None:  # the member died: its id may be reused
        if _LAID_OUT.get(key, (None,))[0] is ref:
            del _LAID_OUT[key]

    entry = _LAID_OUT.get(key)
    if entry is None or entry[0]() is not member or entry[1]() is not flat or entry[2] != slot:
        _LAID_OUT[key] = (weakref.ref(member, forget), weakref.ref(flat), slot)
    fkey = id(flat)

    def drop(ref: weakref.ref) -> None:  # the flat parameter died
        if _FLATS.get(fkey) is ref:
            del _FLATS[fkey]
            _FLAT_OWNERS.pop(fkey, None)

    if fkey not in _FLATS or _FLATS[fkey]() is not flat:
        _FLATS[fkey] = weakref.ref(flat, drop)
    _hook(member, _grad_to_flat)
    _hook(flat, _graph_grad)
    install_step_checks()


# Checks other modules add to the one step hook (``fxrec.graph.optim_state``'s layouts).
step_checks: list[Callable[[torch.optim.Optimizer], None]] = []


def install_step_checks() -> None:
    """Run fxrec's checks before every optimizer's step (one global hook, installed once)."""
    if not _step_hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook.append(register_optimizer_step_pre_hook(_check_optimizer))


def laid_out(tensors: Sequence[torch.Tensor]) -> int:
    """How many of ``tensors`` are members laid out in a live flat parameter."""
    count = 0
    for t in tensors:
        entry = _LAID_OUT.get(id(t))
        count += entry is not None and entry[0]() is t and entry[1]() is not None
    return count


def _check_optimizer(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Before any optimizer's step: the checks below, then those in ``step_checks``."""
    _sync_members(optimizer)
    _refuse_whole_tensor_optimizer(optimizer)
    _refuse_stale_optimizer(optimizer, args, kwargs)
    for check in step_checks:
        check(optimizer)


def _sync_members(optimizer: torch.optim.Optimizer) -> None:
    """Members given new data since the last call (``w.data = w.data.clamp(-c, c)`` between
    backward and step) pass it to the flat parameters the optimizer holds before the step
    updates them: after it, the members' stale data would overwrite the step."""
    if not _FLAT_OWNERS:
        return
    done: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _FLAT_OWNERS.get(id(p))
            owner = ref() if ref is not None else None
            if owner is not None and id(owner) not in done:
                done.add(id(owner))
                owner.sync_data()


def _whole_tensor_optimizers() -> tuple[type, ...]:
    names = ("Adafactor", "Muon")
    return tuple(c for n in names if isinstance(c := getattr(torch.optim, n, None), type))


def _refuse_whole_tensor_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise for an optimizer whose update of a tensor depends on the whole tensor (Adafactor's
    factored moments and RMS scaling, Muon's orthogonalization) holding a flat parameter: it
    would treat the members laid out in it as one matrix, unlike on the model."""
    if not isinstance(optimizer, _whole_tensor_optimizers()):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _FLATS.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"fxrec: {type(optimizer).__name__} computes each parameter's update from "
                    f"the whole tensor, and it holds a flat parameter of shape {tuple(p.shape)} "
                    "in which fxrec.optimize laid out several of the model's parameters: it "
                    "would update them as one tensor, not as the model's parameters. Optimize "
                    "with fxrec.optimize(..., keep_params=True), which keeps each original "
                    "parameter its own tensor."
                )


def _refuse_stale_optimizer(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Before any optimizer's step: raise if it holds a laid-out member that got no gradient
    while its flat parameter did (the backward went through the flat parameters), and not
    that flat parameter too (``ddp.parameters()`` walks into the members as well: harmless).

    A flat gradient made only of its members' own gradients (see ``_grad_to_flat``) is the
    plain model trained directly, with an optimizer on its parameters: they get them back.
    """
    held: set[int] | None = None
    back: dict[int, tuple[torch.Tensor, set[int]]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _LAID_OUT.get(id(p))
            if entry is None or entry[0]() is not p or p.grad is not None:
                continue
            flat = entry[1]()
            if flat is None or flat.grad is None:
                continue
            if held is None:
                held = {id(q) for g in optimizer.param_groups for q in g["params"]}
            if id(flat) in held:
                continue
            entry = _NOTES.get(id(flat))
            note = entry[1] if entry is not None and entry[0]() is flat else None
            if note is not None and note.grad() is flat.grad and not note.graph and note.moved:
                back[id(flat)] = (flat, note.moved)  # the plain model trained directly
                continue
            raise RuntimeError(
                f"fxrec: this {type(optimizer).__name__} holds a parameter of shape "
                f"{tuple(p.shape)} that fxrec.optimize laid out into a flat parameter: "
                "its gradient goes to the flat one, so the optimizer would never update "
                "it. Build the optimizer after optimize, on opt.parameters() "
                "(fxrec.param_groups(opt, groups) for parameter groups), or optimize with "
                "keep_params=True."
            )
    if back:
        _give_back(back)


def _give_back(back: dict[int, tuple[torch.Tensor, set[int]]]) -> None:
    """Members moved into the flat gradients in ``back`` (by flat id: the flat parameter, the
    ids of its members moved in) take their gradients back; those flat gradients go."""
    dense: dict[int, torch.Tensor] = {}
    for key, (flat, _) in back.items():
        grad = flat.grad
        assert grad is not None
        dense[key] = grad.coalesce() if grad.is_sparse else grad
    for ref, owner, slot in list(_LAID_OUT.values()):
        member, flat = ref(), owner()
        flat_moved = back.get(id(flat)) if member is not None and flat is not None else None
        if flat_moved is not None and flat_moved[0] is flat and id(member) in flat_moved[1]:
            grad = dense[id(flat)]
            member.grad = (
                _sparse_slot(grad, slot) if grad.is_sparse else _slot_view(grad, slot).clone()
            )
    for flat, _ in back.values():
        flat.grad = None


def has_grad_hooks(t: torch.Tensor) -> bool:
    """Does ``t`` carry hooks of the user's on its own gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``)? Such hooks run only while ``t`` is the leaf
    autograd reaches, which a laid-out member no longer is (fxrec's own hooks excepted)."""
    if t._backward_hooks:
        return True
    hooks = t._post_accumulate_grad_hooks
    return bool(hooks) and any(
        h is not _grad_to_flat and h is not _graph_grad for h in hooks.values()
    )


_NAME_PARTS = re.compile(r"[^0-9A-Za-z]+")
_DYNAMO_PREFIX = re.compile(r"^(L__self___|L_self_|self_|L_)")


def flat_name(names: Sequence[str]) -> str | None:
    """A flat tensor's name made of what its members' names share, e.g. ``towers.0.2.bias``
    and ``towers.1.2.bias`` give ``towers_x_2_bias``: code that picks parameters by name
    (``n.endswith("bias")``, ``"emb" in n``) picks the flat tensor as it picked its members.
    None when the names share nothing."""
    words = [
        [w for w in _NAME_PARTS.split(_DYNAMO_PREFIX.sub("", n.removeprefix(OWNER_ATTR + ".")))]
        for n in names
    ]
    words = [[w for w in ws if w] for ws in words]
    if not words or not all(words):
        return None
    head: list[str] = []
    for parts in zip(*words):
        if len(set(parts)) > 1:
            break
        head.append(parts[0])
    shortest = min(len(ws) for ws in words)
    tail: list[str] = []
    for i in range(1, shortest - len(head) + 1):
        parts = {ws[-i] for ws in words}
        if len(parts) > 1:
            break
        tail.insert(0, parts.pop())
    if not head and not tail:
        return None
    middle = ["x"] if len(head) + len(tail) < max(len(ws) for ws in words) else []
    name = "_".join(head + middle + tail)
    return name if name[0].isalpha() else f"p_{name}"


class FusedParameters(nn.Module):
    """Owns the flat parameters and buffers of fused layers and keeps members as views."""

    def __init__(self) -> None:
        super().__init__()
        self._members: dict[str, tuple[str, list[_Member]]] = {}
        self._by_ids: dict[tuple[str, tuple[int, ...]], str] = {}
        self._index: dict[int, tuple[str, str, _Member]] | None = None  # see locate()
        self._inner: dict[str, tuple[str, str, _Member]] = {}  # see _inner_flats()
        self._synced: dict[str, bool] = {}  # each flat parameter's flag at the last sync
        self._viewed: dict[str, _Viewed] = {}  # each flat's data as its members view it
        self._hooks_seen = -1  # RemovableHandle.next_id when members last had no grad hooks
        self._fingerprint: _Fingerprint | None = None  # see sync_requires_grad()
        self.frozen = False

    def __setstate__(self, state: dict) -> None:
        """Unpickled: the index by tensor ids is rebuilt, and the members registered as laid
        out again (ids and gradient hooks are per process)."""
        super().__setstate__(state)
        self._index = None
        self._inner = {}
        self._fingerprint = None
        self.__dict__.setdefault("_viewed", {})  # pickled before it existed: no check until relink
        self._hooks_seen = -1  # hook handle ids are per process
        self._by_ids = {
            (how, tuple(id(m.tensor) for m in members)): name
            for name, (how, members) in self._members.items()
        }
        for root in dict.fromkeys(map(self._root, self._members)):  # the registry and the
            self._watch_members(root)  # gradient hooks are per process

    def laid_out(self) -> bool:
        """Are any parameters laid out in flat tensors? (One dict read: checked per call.)"""
        return bool(self._members)

    def reads_through_flats(self) -> bool:
        """Must this call read laid-out parameters through the flat tensors? Only with
        autograd (so that gradients reach them): without it the members, which share the
        flat tensors' storage, read the same values, and the model runs as written."""
        return bool(self._members) and torch.is_grad_enabled()

    def freeze(self) -> None:
        """No new layouts from now on: graphs built later reuse the existing ones.

        ``parameters()`` then stays what the user's optimizer was built on; a layout made by
        a graph built later (another input shape, eval mode) would take its members away from
        that optimizer.
        """
        if not self.frozen:  # (written once: under torch.export a write is a side effect)
            self.frozen = True

    def sync_requires_grad(self) -> None:
        """Keep each flat parameter's ``requires_grad`` and its members' the same.

        A flag set on the flat parameter since the last sync (``opt.requires_grad_(False)``,
        which reaches the flat parameters, not the members) goes to its members; otherwise
        the members' flags (``opt.model.tower.requires_grad_(False)``) go to it. Freezing
        only some members cannot be expressed by one tensor, so it raises with what to do.
        Runs on every call, so it also keeps members viewing their flat tensor's data (see
        :meth:`sync_data`) and refuses gradient hooks on members (see ``_refuse_grad_hooks``).
        A call that finds every flag and data pointer as the last sync left them (the common
        case, see :class:`_Fingerprint`) does nothing more; one without autograd (which the
        flags do not affect) compares only the data pointers, and leaves flags set since to
        the next call with autograd.
        """
        if not self._members:  # nothing laid out: no flag, data or hook to look at
            return
        if RemovableHandle.next_id != self._hooks_seen:  # some hook was registered since
            self._refuse_grad_hooks()
        fp = self._fingerprint
        if fp is not None and fp.matches(self, torch.is_grad_enabled()):
            return
        self._sync_all_data()
        for name in self._outer_first():  # a flag set on a flat tensor goes to what it holds
            flat = getattr(self, name)
            if isinstance(flat, nn.Parameter) and flat.requires_grad is not self._synced.get(
                name, flat.requires_grad
            ):
                for m in self._members[name][1]:
                    m.tensor.requires_grad_(flat.requires_grad)
        for name in reversed(self._outer_first()):  # members' flags go to their flat tensor
            self._take_flags(name)
        self._fingerprint = _Fingerprint.of(self) if self._own_flats() else None

    def _own_flats(self) -> bool:
        """Are the flat tensors registered the ones the members view (not tensors given for
        one call: ``torch.func.functional_call`` on ``opt``'s names, which may have no
        storage)?"""
        viewed = self._viewed
        return all(
            n in viewed and viewed[n].flat is t
            for n, t in (*self._parameters.items(), *self._buffers.items())
        )

    def _unchanged(self, flags: bool = True) -> bool:
        fp = self._fingerprint
        return fp is not None and fp.matches(self, flags)

    def _take_flags(self, name: str) -> None:
        """The flat parameter ``name`` takes its members' ``requires_grad`` (one flag)."""
        flat = getattr(self, name)
        if not isinstance(flat, nn.Parameter):
            return
        members = self._members[name][1]
        if any(m.tensor.requires_grad is not flat.requires_grad for m in members):
            flags = {m.tensor.requires_grad for m in members}
            if len(flags) > 1:
                raise RuntimeError(
                    f"fxrec: some parameters laid out together in fxrec_fused.{name} have "
                    "requires_grad=False and others True; they share one tensor. Freeze "
                    "parameters before fxrec.optimize (frozen ones are not fused with "
                    "trainable ones), or optimize with keep_params=True."
                )
            flat.requires_grad_(flags.pop())
        if self._synced.get(name) is not flat.requires_grad:
            self._synced[name] = flat.requires_grad
            if flat.requires_grad:  # hooks need tensors that require gradients
                self._watch_members(name)

    def sync_data(self) -> None:
        """Members view their flat tensors' current data again, wherever either was given new
        data since (see :meth:`sync_requires_grad`); for readers of the members that run
        without a forward (``state_dict``). Outer flat tensors first: a flat tensor laid out
        in another follows it before its own members follow it."""
        if not self._unchanged(flags=False):
            self._sync_all_data()

    def _sync_all_data(self) -> None:
        # members' new values, taken before any is written back: a member's new data may be
        # another member's slice (``a.data, b.data = b.data, a.data``), in any flat tensor
        with torch.inference_mode(False):
            new = {
                id(m): m.tensor.data.clone()
                for _, members in self._members.values()
                for m in members
                if m.tensor.data_ptr() != m.ptr
            }
        for name in self._outer_first():
            how, members = self._members[name]
            self._sync_data(name, how, getattr(self, name), members, new)

    def _outer_first(self) -> list[str]:
        """The flat tensors' names, each before the flat tensors laid out in it (a layout is
        made after the flat tensors it holds)."""
        return list(reversed(self._members))

    def _refuse_grad_hooks(self) -> None:
        """A gradient hook registered on a member after it was laid out would never run (its
        gradient goes to the flat parameter): raise. Run only when a hook handle was made
        since the last clean check, so the per-call cost is one integer compared."""
        seen = RemovableHandle.next_id
        for name, (_, members) in self._members.items():
            for m in members:
                t = m.tensor
                if t.requires_grad and has_grad_hooks(t):
                    raise RuntimeError(
                        "fxrec: a gradient hook (register_hook / "
                        "register_post_accumulate_grad_hook) was registered on a parameter of "
                        f"shape {tuple(t.shape)} after fxrec.optimize laid it out in the flat "
                        f"parameter fxrec_fused.{name}; its gradient goes to that flat "
                        "parameter, so the hook would never run. Register the hook before "
                        "fxrec.optimize (such a parameter is not laid out), or optimize with "
                        "keep_params=True."
                    )
        self._hooks_seen = seen

    def _sync_data(
        self,
        name: str,
        how: str,
        flat: torch.Tensor,
        members: list[_Member],
        new: dict[int, torch.Tensor],
    ) -> None:
        """Per call, so cheap: one address per member and per flat tensor.

        A flat tensor given new data (``vector_to_parameters(v, opt.parameters())``) is what
        the graphs read and the optimizer steps: its members view it again (else
        ``state_dict()`` would show the old values). A member given new data
        (``member.data = t``) has its values (``new``, by member record id) taken back into
        the flat tensor.
        """
        stray = [m for m in members if m.tensor.data_ptr() != m.ptr]
        seen = self._viewed.get(name)
        if seen is not None and seen.flat is flat and flat.data_ptr() != seen.ptr:
            taken = {id(m) for m in stray}
            self._follow_new_data(name, how, flat, [m for m in members if id(m) not in taken])
        if stray:
            self._take_back(name, how, flat, stray, new)

    def _follow_new_data(
        self, name: str, how: str, flat: torch.Tensor, members: list[_Member]
    ) -> None:
        """``flat`` was given new data: ``members`` view it (same shape, dtype, device only)."""
        seen = self._viewed[name]
        got = (flat.shape, flat.dtype, flat.device)
        if got != (seen.shape, seen.dtype, seen.device):
            raise RuntimeError(
                f"fxrec: fxrec_fused.{name} was given data of another shape, dtype or device "
                f"({tuple(flat.shape)}, {flat.dtype}, {flat.device}; its members need "
                f"{tuple(seen.shape)}, {seen.dtype}, {seen.device}), which the model's "
                "parameters laid out in it cannot view. Give it data of the same shape, dtype "
                "and device (or copy values in place: `with torch.no_grad(): p.copy_(t)`), "
                "convert the optimized module as a whole (opt.to(...), opt.double()), or put "
                "its old data back and optimize again."
            )
        with torch.inference_mode(False):
            for m in members:
                m.tensor.data = _member_slice(flat.data, how, m)
                m.ptr = m.tensor.data_ptr()
        self._record(name, flat)

    def _record(self, name: str, flat: torch.Tensor) -> None:
        """Remember ``flat``'s data as its members now view it (see :class:`_Viewed`)."""
        self._viewed[name] = _Viewed(flat, flat.data_ptr(), flat.shape, flat.dtype, flat.device)

    def _take_back(
        self,
        name: str,
        how: str,
        flat: torch.Tensor,
        stray: list[_Member],
        new: dict[int, torch.Tensor],
    ) -> None:
        """Members given new data since they were laid out (``member.data = t``): the values
        go into the flat tensor, and the members view it again. Data of another shape, dtype
        or device (the model converted instead of the optimized module) cannot, and raises."""
        with torch.inference_mode(False):  # new data under inference_mode stays trainable
            for m in stray:
                t = m.tensor
                value = new.get(id(m), t.data)
                part = _member_slice(flat.data, how, m)
                if (t.shape, t.dtype, t.device) != (part.shape, part.dtype, part.device):
                    raise RuntimeError(
                        f"fxrec: a parameter laid out in fxrec_fused.{name} now holds data of "
                        f"another shape, dtype or device ({tuple(t.shape)}, {t.dtype}, {t.device}) "
                        "than that flat tensor, which the optimizer holds. Convert the optimized "
                        "module (opt.to(...), opt.double()) rather than the model, or optimize again."
                    )
                with torch.no_grad():
                    part.copy_(value)
                t.data = part
                m.ptr = t.data_ptr()

    def copy_layouts(self, memo: dict[int, object]) -> FusedParameters:
        """The same layouts over deep copies of the members (``memo``: ``copy.deepcopy``'s).

        Each flat tensor's copy goes into ``memo``, and a copy already there (an optimizer
        copied first: ``copy.deepcopy((optimizer, opt))``) becomes the copy's flat tensor,
        so a module and optimizer copied together stay linked, as a plain model's do.
        """
        out = FusedParameters()
        for name, (how, members) in self._members.items():
            copies = [memo.get(id(m.tensor)) for m in members]
            if any(not isinstance(t, torch.Tensor) for t in copies):
                raise RuntimeError(f"fxrec: the members of fxrec_fused.{name} were not copied.")
            flat = getattr(self, name)
            copied = memo.get(id(flat))
            if not isinstance(copied, torch.Tensor):
                out.add(how, copies, name=name)  # type: ignore[arg-type]
                getattr(out, name).requires_grad_(flat.requires_grad)
                memo[id(flat)] = getattr(out, name)
            elif (copied.shape, copied.dtype) == (flat.shape, flat.dtype):
                out._install(name, how, copied, copies)  # type: ignore[arg-type]
            else:
                raise RuntimeError(f"fxrec: the copy of fxrec_fused.{name} has another shape.")
        out._synced = dict(self._synced)
        out.frozen = self.frozen
        return out

    def view_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s slice of its flat tensor, as a view, if ``t`` is a laid-out member.

        For graphs that take a member as an input (a graph dynamo reuses for sibling
        modules): the view carries its gradient to the flat parameter.
        """
        loc = self.locate().get(id(t))
        if loc is None:
            return None
        flat, how, m = loc
        return _member_slice(getattr(self, flat), how, m) if m.tensor is t else None

    def member_ids(self) -> set[int]:
        return {id(m.tensor) for _, ms in self._members.values() for m in ms}

    def locate(self) -> dict[int, tuple[str, str, _Member]]:
        """For every laid-out model tensor id: (flat name, layout, member record); kept until
        the next layout (read-only for callers).

        Flat tensors can themselves be laid out in another (each parallel tower's Linears
        concatenated, then those weights stacked across the towers): only the outermost is
        trained, so that is the flat name given, and the record's ``within`` holds the path
        down to the member's slice. The flat tensors laid out in others are not listed (see
        :meth:`_inner_flats`)."""
        if self._index is None:
            self._index, self._inner = self._locations()
        return self._index

    def _inner_flats(self) -> dict[str, tuple[str, str, _Member]]:
        """For each flat tensor laid out in another: its location, as :meth:`locate`'s."""
        self.locate()
        return self._inner

    def _locations(
        self,
    ) -> tuple[dict[int, tuple[str, str, _Member]], dict[str, tuple[str, str, _Member]]]:
        flats = {id(getattr(self, n)): n for n in self._members}
        placed: dict[str, tuple[str, tuple[_Slot, ...]]] = {}  # flat -> outermost, path to it
        for name in self._outer_first():
            placed.setdefault(name, (name, ()))
            root, path = placed[name]
            how, ms = self._members[name]
            for m in ms:
                inner = flats.get(id(m.tensor))
                if inner is not None:
                    placed[inner] = (root, (*path, _slot(how, m)))
        index: dict[int, tuple[str, str, _Member]] = {}
        inner_flats: dict[str, tuple[str, str, _Member]] = {}
        for name, (how, ms) in self._members.items():
            root, path = placed[name]
            for m in ms:
                loc = (root, how, replace(m, within=path) if path else m)
                inner = flats.get(id(m.tensor))
                if inner is not None:
                    inner_flats[inner] = loc
                else:
                    index[id(m.tensor)] = loc
        return index, inner_flats

    def grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Each of ``model``'s parameter gradients by name, read through the flat layouts.

        A fused member's gradient lives in its flat parameter's ``.grad`` (the leaf the
        optimizer holds); this returns the member's slice of it, as a view, so per-parameter
        code (clipping, logging, tests) keeps the original names and shapes. A sparse gradient
        (tables with ``sparse=True``) has no views of its rows: its members' parts are sparse
        copies, so writing into them does not reach the flat gradient.
        """
        where = self.locate()
        out: dict[str, torch.Tensor | None] = {}
        coalesced: dict[str, torch.Tensor] = {}  # each sparse flat gradient, coalesced once
        for name, p in model.named_parameters():
            loc = where.get(id(p))
            if loc is None:
                out[name] = p.grad
                continue
            flat, how, m = loc
            g = getattr(self, flat).grad
            if g is not None and g.is_sparse:
                g = coalesced.setdefault(flat, g.coalesce())
                out[name] = _sparse_slot(g, _slot(how, m))
                continue
            out[name] = None if g is None else _member_slice(g, how, m)
        return out

    def views(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each laid-out parameter of ``model`` by name, as a view of its flat parameter.

        Where many members of a flat parameter are read, one ``split`` / ``unbind`` of it
        makes their views (its backward is one ``cat`` / ``stack``, see :func:`_split_whole`).
        Autograd forbids writing such views in place, so a model with hooks (which may clamp
        a weight) or ``max_norm`` layers gets one ``narrow`` / ``select`` per member."""
        where = self.locate()
        held = [
            (name, where[id(p)])
            for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in where and where[id(p)][2].tensor is p
        ]
        counts: dict[str, int] = {}
        for _, (flat, _, _) in held:
            counts[flat] = counts.get(flat, 0) + 1
        pieces: dict[str, Sequence[torch.Tensor]] = {}
        if not _writes_own(model):
            for flat, n in counts.items():
                how, members = self._members[flat]
                if _split_whole(len(members), n):
                    pieces[flat] = _split(getattr(self, flat), how, _rows(members))
        out: dict[str, torch.Tensor] = {}
        for name, (flat, how, m) in held:
            split = pieces.get(flat)
            if split is None:
                out[name] = _member_slice(getattr(self, flat), how, m)
                continue
            first, *rest = (*m.within, _slot(how, replace(m, within=())))
            piece = split[first.index]
            for step in rest:
                piece = _slot_view(piece, step)
            out[name] = piece
        return out

    def lookup(self, how: str, tensors: Sequence[torch.Tensor]) -> str | None:
        return self._by_ids.get((how, tuple(id(t) for t in tensors)))

    def add(
        self,
        how: str,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str] | None = None,
        name: str | None = None,
    ) -> str:
        """Lay ``tensors`` out in one new flat tensor (``how`` is "stack" or "cat"), named
        ``name``, or after the members' ``names`` (see ``flat_name``), or ``how`` and a count."""
        existing = self.lookup(how, tensors)
        if existing is not None:
            return existing
        if name is None:
            name = self._free_name(flat_name(names) if names else None, how)
        # normal tensors even under torch.inference_mode(): the model trains on them afterwards
        with torch.no_grad(), torch.inference_mode(False):
            data = torch.stack(list(tensors)) if how == "stack" else torch.cat(list(tensors))
            data = _grad_strides(data)
        if all(isinstance(t, nn.Parameter) for t in tensors):
            data = nn.Parameter(data, requires_grad=tensors[0].requires_grad)
        self._install(name, how, data, tensors)
        return name

    def _free_name(self, wanted: str | None, how: str) -> str:
        """``wanted`` if no attribute has it yet, else with a count before its last word
        (``layers_x_bias``, ``layers_x_2_bias``: still ending as its members' names do), or
        ``how`` and a count."""
        if not wanted:
            wanted = f"{how}{len(self._members)}"
        head, _, last = wanted.rpartition("_")
        name, count = wanted, 2
        while name in self._members or hasattr(self, name):
            name, count = (f"{head}_{count}_{last}" if head else f"{last}_{count}"), count + 1
        return name

    def _install(
        self, name: str, how: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor]
    ) -> None:
        """Register ``flat`` (holding ``tensors``' values laid out ``how``) as ``name``, and
        point ``tensors`` at their slices of it."""
        if isinstance(flat, nn.Parameter):
            self.register_parameter(name, flat)
        else:
            self.register_buffer(name, flat)
        members, offset = [], 0
        for i, t in enumerate(tensors):
            members.append(_Member(t, i, offset))
            offset += int(t.shape[0]) if t.dim() else 1
        self._members[name] = (how, members)
        self._by_ids[(how, tuple(id(t) for t in tensors))] = name
        self._index = None
        self.relink(name)

    def relink(self, name: str | None = None) -> None:
        """Point every member's storage at its slice of the flat tensor again (``name``'s,
        and those of the flat tensors laid out in it; None: all)."""
        names = self._outer_first()
        if name is not None:
            inner = {name}
            for n in names:  # outer first: a flat tensor's own members are known by now
                if n in inner:
                    inner.update(self._flat_names(self._members[n][1]))
            names = [n for n in names if n in inner]
        for n in names:
            how, members = self._members[n]
            flat = getattr(self, n)
            with torch.inference_mode(False):
                for m in members:
                    m.tensor.data = _member_slice(flat.data, how, m)
                    m.ptr = m.tensor.data_ptr()
            self._record(n, flat)
        for root in dict.fromkeys(self._root(n) for n in names):
            self._watch_members(root)
        self._fingerprint = None

    def _root(self, name: str) -> str:
        """The outermost flat tensor holding the flat tensor ``name`` (itself if none)."""
        inner = self._inner_flats()
        return inner[name][0] if name in inner else name

    def _flat_names(self, members: list[_Member]) -> list[str]:
        """The names of the flat tensors among ``members``."""
        flats = {id(getattr(self, n)): n for n in self._members}
        return [flats[id(m.tensor)] for m in members if id(m.tensor) in flats]

    def _watch_members(self, name: str) -> None:
        """Register ``name``'s members as laid out (for the optimizer checks) and route
        gradients that reach them into the outermost flat parameter's (see ``_grad_to_flat``
        and :meth:`locate`)."""
        root = self._root(name)
        flat = getattr(self, root)
        if not isinstance(flat, nn.Parameter):
            return
        for loc in (*self.locate().values(), *self._inner_flats().values()):
            if loc[0] == root:
                _watch(loc[2].tensor, flat, _slot(loc[1], loc[2]))
        if id(flat) in _FLATS:
            _FLAT_OWNERS[id(flat)] = weakref.ref(self)

    def check_conversion(self, fn: object) -> None:
        """Refuse a conversion (``module._apply``'s ``fn``) that would give members new tensor
        objects instead of new data (``to("meta")``, an overwriting conversion mode): they
        would no longer be views of the flat tensors. Tried on the smallest member."""
        members = [m.tensor for _, ms in self._members.values() for m in ms]
        if not members:
            return
        t = min(members, key=torch.Tensor.numel)
        with torch.no_grad():
            out = fn(t)  # type: ignore[operator]
        future = torch.__future__
        if (
            future.get_overwrite_module_params_on_conversion()
            or future.get_swap_module_params_on_conversion()
            or not torch._has_compatible_shallow_copy_type(t, out)
        ):
            raise ValueError(
                f"fxrec: this conversion (to {out.device} / {out.dtype}) replaces parameter "
                "objects instead of their data, which would detach the parameters fxrec laid "
                "out together. Convert the model first, then call fxrec.optimize."
            )

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        """Nothing of its own to load: checkpoints hold the members, which write through."""

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self.relink()
        return out


class ParamStore:
    """Gives rules a node that yields N parameters laid out side by side."""

    def __init__(self, gm: fx.GraphModule, owner: FusedParameters | None) -> None:
        self.gm = gm
        self.owner = owner
        # Attribute path -> tensor. Attributes are added while rules run, never reassigned.
        self._tensors: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] | None = None  # see names_of()

    def _owned_tensor(self, node: fx.Node) -> torch.Tensor | None:
        if node.op != "get_attr":
            return None
        return self.target_tensor(node.target)

    def can_lay_out(self, ts: Sequence[torch.Tensor | None]) -> bool:
        """Can these model tensors (None: not one) become views of one new flat tensor?"""
        if self.owner is None or any(t is None for t in ts):
            return False
        if len({id(t) for t in ts}) != len(ts):
            return False  # a parameter shared between members: refuse the layout
        if any(has_grad_hooks(t) for t in ts):  # type: ignore[arg-type]
            return False  # its hooks run only while it is the leaf gradients reach
        grads = {t.requires_grad for t in ts}
        kinds = {isinstance(t, nn.Parameter) for t in ts}
        if self.owner.frozen:
            return False
        taken = self.owner.member_ids()
        fresh = all(id(t) not in taken for t in ts)
        return len(grads) == 1 and len(kinds) == 1 and fresh

    def combined(self, nodes: Sequence[fx.Node], how: str) -> fx.Node:
        """A node holding ``torch.stack(nodes)`` (how="stack") or ``torch.cat(nodes)`` ("cat").

        Laid out once when possible (a ``get_attr`` of a flat tensor); otherwise, or when the
        same members were laid out before, gathered in the graph. Insert point: the caller's
        current ``graph.inserting_*`` context.
        """
        node = self.laid_out_node([self._owned_tensor(n) for n in nodes], how)
        if node is not None:
            return node
        fn = torch.stack if how == "stack" else torch.cat  # gathered in-graph
        node = self.gm.graph.call_function(fn, (list(nodes), 0))  # dim given: shape arithmetic
        from fxrec.graph.meta import infer

        infer(self.gm, node)
        return node

    def target_tensor(self, target: str) -> torch.Tensor | None:
        """The model tensor at ``target`` (a qualified attribute name), else None."""
        t = self._tensors.get(target)
        if t is not None:
            return t
        obj: object = self.gm
        for part in target.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        if not isinstance(obj, torch.Tensor):
            return None
        self._tensors[target] = obj
        return obj

    def names_of(self, ts: Sequence[torch.Tensor]) -> list[str] | None:
        """The graph's attribute names of ``ts`` (None when one has none); a flat tensor's
        are its members' (a flat laid out in another is named after the model's names)."""
        if self._names is None or any(id(t) not in self._names for t in ts):
            self._names = {}  # rules add flat tensors: read again when one is not known
            for name, t in self.gm.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(t), name)
            for name, t in self.gm.named_buffers(remove_duplicate=False):
                self._names.setdefault(id(t), name)
        names: list[str] = []
        for t in ts:
            name = self._names.get(id(t))
            if name is None:
                return None
            flat = name.removeprefix(OWNER_ATTR + ".")
            inner = self.owner._members.get(flat) if self.owner is not None else None
            if name.startswith(OWNER_ATTR + ".") and inner is not None:
                more = self.names_of([m.tensor for m in inner[1]])
                if more is None:
                    return None
                names.extend(more)
            else:
                names.append(name)
        return names

    def is_laid_out(self, ts: Sequence[torch.Tensor | None], how: str) -> bool:
        """Are these exact tensors already one flat tensor laid out ``how``?"""
        if self.owner is None or any(t is None for t in ts):
            return False
        return self.owner.lookup(how, ts) is not None  # type: ignore[arg-type]

    def laid_out_node(self, ts: Sequence[torch.Tensor | None], how: str) -> fx.Node | None:
        """A ``get_attr`` of one flat tensor holding ``ts`` laid out ``how``, or None.

        Reuses an existing layout of exactly these tensors, or creates one when they can be
        laid out (model parameters this graph owns, not shared with another layout).
        """
        if self.owner is None or any(t is None for t in ts):
            return None
        name = self.owner.lookup(how, ts)  # type: ignore[arg-type]
        if name is None and self.can_lay_out(ts):  # type: ignore[arg-type]
            name = self.owner.add(how, ts, self.names_of(ts))  # type: ignore[arg-type]
        if name is None:
            return None
        if not hasattr(self.gm, OWNER_ATTR):
            self.gm.add_submodule(OWNER_ATTR, self.owner)
        node = self.gm.graph.get_attr(f"{OWNER_ATTR}.{name}")
        from fxrec.graph.meta import set_info

        set_info(node, getattr(self.owner, name))
        return node

    def rebind(self) -> int:
        """Route every remaining read of a laid-out member through its flat tensor.

        Once a parameter lives in a flat tensor, gradients must reach the flat tensor (the
        one the optimizer holds) from *every* graph, including graphs where that member was
        not fused (another input shape, eval mode, a cost the model refused) and second uses
        of a fused module. Reads are ``get_attr`` nodes, rerouted to a view of the flat
        tensor, and ``call_module`` nodes of modules holding a member parameter (symbolic
        tracing keeps ``nn`` layers whole), rerouted to ``torch.func.functional_call`` with
        those views. Returns the number of reads rerouted.
        """
        if self.owner is None:
            return 0
        reads = self._member_reads()
        if not reads:
            return 0
        graph = self.gm.graph
        counts: dict[str, int] = {}
        written: set[str] = set()  # flat tensors a read may write in place: no split of them
        for node, held in reads:
            write = self._may_write(node)
            for _, loc in held:
                counts[loc[0]] = counts.get(loc[0], 0) + 1
                if write:
                    written.add(loc[0])
        members = {n: len(self.owner._members[n][1]) for n in counts}
        views = _FlatViews(
            self, {n: n not in written and _split_whole(members[n], c) for n, c in counts.items()}
        )
        for node, held in reads:
            with graph.inserting_before(node):
                if node.op == "call_module":
                    new = self._call_with(node, {name: views.of(loc) for name, loc in held})
                else:
                    new = views.of(held[0][1])
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        return len(reads)

    def _member_reads(self) -> list[tuple[fx.Node, list[tuple[str, tuple[str, str, _Member]]]]]:
        """The graph's reads of laid-out tensors, each with (name in its module, location):
        members, and flat tensors laid out in another (a graph that fused a layer but not
        the towers around it), read from the outermost flat tensor too."""
        assert self.owner is not None
        where = self.owner.locate()
        inner = self.owner._inner_flats()
        reads: list[tuple[fx.Node, list[tuple[str, tuple[str, str, _Member]]]]] = []
        for node in self.gm.graph.nodes:
            if node.op == "call_module":
                mod = self.gm.get_submodule(node.target)
                held = [
                    (name, where[id(p)])
                    for name, p in mod.named_parameters(remove_duplicate=False)
                    if id(p) in where
                ]
                if held:
                    reads.append((node, held))
                continue
            if node.op == "get_attr" and node.target.startswith(OWNER_ATTR + "."):
                loc = inner.get(node.target[len(OWNER_ATTR) + 1 :])
                if loc is not None:
                    reads.append((node, [("", loc)]))
                continue
            t = self._owned_tensor(node)
            if t is not None and id(t) in where:
                reads.append((node, [("", where[id(t)])]))
        return reads

    def _may_write(self, node: fx.Node) -> bool:
        """Might the read ``node``'s member be written in place while the graph runs (a hook
        clamping a weight, ``max_norm`` renormalizing a table)? Such a member must be a
        single-output view (``narrow`` / ``select``): autograd forbids writing the outputs of
        one ``split`` / ``unbind`` in place, or reading any of them after such a write."""
        if node.op != "call_module":
            return written_in_place(node) or any(_renorms(u, node) for u in node.users)
        return any(_may_write_own(m) for m in self.gm.get_submodule(node.target).modules())

    def _call_with(self, node: fx.Node, params: dict[str, fx.Node]) -> fx.Node:
        """``node``'s module called with ``params`` (views) in place of its own: the layer's
        functional op for a plain ``nn.Linear`` / ``nn.LayerNorm`` without hooks (the common
        case, a few microseconds), else ``torch.func.functional_call`` (about 20 more)."""
        graph = self.gm.graph
        mod = self.gm.get_submodule(node.target)
        plain = len(node.args) == 1 and not node.kwargs and not has_hooks(mod)
        if plain and type(mod) in (nn.Linear, nn.LayerNorm):

            def param(name: str) -> fx.Node | None:
                if name in params:
                    return params[name]
                held = getattr(mod, name)
                return None if held is None else graph.get_attr(f"{node.target}.{name}")

            w, b = param("weight"), param("bias")
            if type(mod) is nn.Linear:
                return graph.call_function(F.linear, (node.args[0], w, b))
            shape = tuple(mod.normalized_shape)
            return graph.call_function(F.layer_norm, (node.args[0], shape, w, b, mod.eps))
        module = graph.get_attr(node.target)
        return graph.call_function(
            _functional_call, (module, params, tuple(node.args), dict(node.kwargs))
        )

    def flat_node(self, name: str) -> fx.Node:
        """A ``get_attr`` of the owner's flat tensor ``name`` (at the insert point)."""
        if not hasattr(self.gm, OWNER_ATTR):
            self.gm.add_submodule(OWNER_ATTR, self.owner)
        return self.gm.graph.get_attr(f"{OWNER_ATTR}.{name}")


def _functional_call(module: nn.Module, params: dict, args: tuple, kwargs: dict) -> object:
    """``torch.func.functional_call`` with plain containers: an ``fx.Interpreter`` (non-strict
    export runs graphs through one) hands a node's dict arguments over as fx's immutable
    dicts, which ``functional_call`` writes to."""
    return torch.func.functional_call(module, dict(params), tuple(args), dict(kwargs))


_RENORMING = (F.embedding, F.embedding_bag)  # with ``max_norm``, they renormalize rows in place


def _renorms(user: fx.Node, weight: fx.Node) -> bool:
    """Does ``user`` renormalize ``weight`` in place (``F.embedding(ids, w, max_norm=1.0)``)?"""
    if user.op != "call_function" or user.target not in _RENORMING:
        return False
    args = dict(zip(("input", "weight", "_", "max_norm"), user.args)) | dict(user.kwargs)
    return args.get("weight") is weight and args.get("max_norm") is not None


def _may_write_own(mod: nn.Module) -> bool:
    """Might calling ``mod`` write its own parameters in place: hooks, ``max_norm``, or a
    ``forward`` outside ``torch.nn`` (any code)?"""
    return (
        has_hooks(mod)
        or getattr(mod, "max_norm", None) is not None
        or not type(mod).__module__.startswith("torch.nn.")
    )


# Parameters a forward was seen writing in place (``F.embedding(..., max_norm=)`` on a
# parameter, a clamp under no_grad), by id: fxrec's runs copy them first, as known writers,
# and the model runs as written read them through views of their own (see ``_writes_own``).
_written_in_place: dict[int, weakref.ref] = {}


def seen_written(p: torch.Tensor) -> bool:
    ref = _written_in_place.get(id(p))
    return ref is not None and ref() is p


def note_written(p: torch.Tensor) -> None:
    key = id(p)

    def forget(ref: weakref.ref) -> None:  # the parameter died: its id may be reused
        if _written_in_place.get(key) is ref:
            del _written_in_place[key]

    if not seen_written(p):
        _written_in_place[key] = weakref.ref(p, forget)


def note_graph_writes(gm: fx.GraphModule) -> None:
    """Note the parameters ``gm`` writes in place (``w.mul_(...)`` under no_grad,
    ``F.embedding(ids, w, max_norm=...)``) before anything runs it, so that fxrec's own runs
    copy them first and put them back."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not (
            written_in_place(node) or any(_renorms(u, node) for u in node.users)
        ):
            continue
        try:
            note_written(gm.get_parameter(str(node.target)))
        except AttributeError:  # a buffer or constant: not a parameter to put back
            continue


def _writes_own(model: nn.Module) -> bool:
    """Might running ``model`` as written write its parameters in place, as far as can be
    seen without running it: module hooks (its own or global ones), ``max_norm`` layers, or
    parameters a run was seen writing."""
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, f"_global{h}", None) for h in _HOOK_DICTS):
        return True
    if _written_in_place and any(seen_written(p) for p in model.parameters()):
        return True
    return any(has_hooks(m) or getattr(m, "max_norm", None) is not None for m in model.modules())


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _split_whole(members: int, reads: int) -> bool:
    """Read ``reads`` of a flat tensor's ``members`` through ONE split of it (``unbind`` /
    ``split``) rather than one view each? Each view's backward (``select``, ``narrow``) is a zero-filled
    gradient of the WHOLE flat tensor plus its accumulation: two kernels and a flat tensor's
    traffic per member read. A split's backward is one ``stack`` / ``cat``; its forward makes
    a view of every member, so it pays once a quarter of them are read."""
    return reads > 1 and 4 * reads >= members


def _split(flat: torch.Tensor, how: str, rows: list[int]) -> Sequence[torch.Tensor]:
    """Every member's part of ``flat``, by one op (``rows``: each member's, for "cat"); also
    the target of the graph node that does it."""
    if how == "stack":
        return flat.unbind(0)
    return flat.split(rows)


def _rows(members: list[_Member]) -> list[int]:
    # ``int``: under ``torch.jit.trace`` a size is a traced tensor, which graph code would bake in
    return [int(m.tensor.shape[0]) for m in members] if members[0].tensor.dim() else []


class _FlatViews:
    """Members' views of their flat tensors for one graph: each flat tensor split once (at its
    first read, which precedes the others) where :func:`_split_whole` says so."""

    def __init__(self, store: ParamStore, whole: dict[str, bool]) -> None:
        self.store = store
        self.whole = whole
        self.split: dict[str, fx.Node] = {}

    def of(self, loc: tuple[str, str, _Member]) -> fx.Node:
        """A view of the member at ``loc``: its flat tensor's slot, through the slots of the
        flat tensors it sits in (``within``), outermost first."""
        name, how, m = loc
        graph = self.store.gm.graph
        steps = (*m.within, _slot(how, replace(m, within=())))
        if not self.whole.get(name):
            node = self.store.flat_node(name)
        else:
            pieces = self.split.get(name)
            if pieces is None:
                assert self.store.owner is not None
                outer_how, members = self.store.owner._members[name]
                flat = self.store.flat_node(name)
                pieces = graph.call_function(_split, (flat, outer_how, _rows(members)))
                self.split[name] = pieces
            node = graph.call_function(operator.getitem, (pieces, steps[0].index))
            steps = steps[1:]
        for step in steps:
            if step.how == "stack":
                node = graph.call_function(operator.getitem, (node, step.index))
            else:
                node = graph.call_method("narrow", (node, 0, step.offset, step.rows))
        return node
