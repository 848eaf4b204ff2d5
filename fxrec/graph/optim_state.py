"""Optimizer state in the model's terms, for moving training jobs on and off fxrec.

An optimizer over ``opt.parameters()`` holds flat parameters in place of the members laid
out in them, so its ``state_dict()`` neither loads into a plain job's optimizer nor takes a
plain job's, and its entries follow the layout: a job resumed with another layout (the
example's dict keys in another order) would give each member another member's state.
:func:`optim_state_dict` writes the state as a plain optimizer over the model's parameters
in the same groups has it (each group's parameters in the order given to
:func:`fxrec.param_groups`, else in ``model.named_parameters()`` order; a flat's state sliced
per member); :func:`load_optim_state_dict` loads such a state (from a
plain job, or from :func:`optim_state_dict`) into the optimizer over the current layout.

Optimizers over an optimized module also record each flat's layout in their own
``state_dict()``; loading it into an optimizer over another layout raises at the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxrec.graph.params import _Member, _member_slice, install_step_checks, step_checks

__all__ = ["load_optim_state_dict", "optim_state_dict"]

LAYOUT_KEY = "fxrec_layout"  # per flat parameter in a state_dict: {member name: position}
_SCALAR_KEYS = frozenset({"step"})  # state that is one value per parameter, whatever its shape


@dataclass
class _Entry:
    """One parameter of the plain optimizer: a model parameter, and where the optimizer
    keeps its state (``held``: itself, or the flat parameter it is laid out in)."""

    name: str | None
    tensor: torch.Tensor
    held: torch.Tensor
    how: str = ""
    member: _Member | None = None


def optim_state_dict(opt: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state (built on ``opt.parameters()`` or :func:`fxrec.param_groups`) as a
    plain optimizer over ``opt.model``'s parameters in the same groups would give it.

    Loads into such a plain optimizer (``load_state_dict``), or with
    :func:`load_optim_state_dict` into an optimizer over any layout. Its tensors are copies,
    the state when it was taken, whatever the optimizer does after. A flat parameter's
    per-element state (Adam's moments, momentum) is copied out per member; its scalar state
    (``step``) goes to each member.
    """
    plain = _plain_groups(opt, optimizer)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, entries in zip(optimizer.param_groups, plain):
        ids = []
        for e in entries:
            held = optimizer.state.get(e.held)
            if held:
                state[index] = {k: _piece(k, v, e) for k, v in held.items() if k != LAYOUT_KEY}
            ids.append(index)
            index += 1
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**options, "params": ids})
    return {"state": state, "param_groups": groups}


def load_optim_state_dict(
    opt: Any, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load ``state_dict``, a plain optimizer's (over ``opt.model``'s parameters, each group in
    the order given to :func:`fxrec.param_groups`, else in ``named_parameters()`` order) or
    :func:`optim_state_dict`'s, into ``optimizer`` over ``opt``'s current layout. Groups must match one-to-one, as :func:`fxrec.param_groups`
    keeps them; members of one flat parameter must agree on scalar state (``step``). The
    optimizer gets copies: training it leaves ``state_dict`` as it was, for other loads."""
    plain = _plain_groups(opt, optimizer)
    saved_groups = list(state_dict["param_groups"])
    _check_groups(plain, saved_groups)
    saved_state = state_dict["state"]
    fx_state: dict[int, dict[str, Any]] = {}
    fx_groups = []
    index = 0
    for group, entries, saved in zip(optimizer.param_groups, plain, saved_groups):
        ids = _saved_ids(entries, saved)
        pieces: dict[int, list[tuple[_Entry, dict[str, Any] | None]]] = {}
        for e, i in zip(entries, ids):
            pieces.setdefault(id(e.held), []).append((e, saved_state.get(i)))
        fx_ids = []
        for p in group["params"]:
            got = _assemble(p, pieces.get(id(p), []))
            if got:
                fx_state[index] = got
            fx_ids.append(index)
            index += 1
        options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        fx_groups.append({**options, "params": fx_ids})
    optimizer.load_state_dict({"state": fx_state, "param_groups": fx_groups})


def _plain_groups(opt: Any, optimizer: torch.optim.Optimizer) -> list[list[_Entry]]:
    """Each optimizer group's parameters as the plain optimizer holds them."""
    fused = getattr(opt, "fxrec_fused", None)
    if fused is None or not hasattr(opt, "model"):
        raise TypeError(
            "fxrec.optim_state_dict takes the module fxrec.optimize returned and the "
            f"optimizer built on it, got {type(opt).__name__}."
        )
    track(opt)
    model = opt.model
    named = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    listed = _LISTED.get(opt, {})
    members: dict[str, list[tuple[str, _Member]]] = {}
    for loc in fused.locate().values():
        members.setdefault(loc[0], []).append((loc[1], loc[2]))
    flats = {id(getattr(fused, n)): n for n in members}
    out = []
    for group in optimizer.param_groups:
        entries = []
        for p in group["params"]:
            flat = flats.get(id(p))
            if flat is None:
                entries.append(_Entry(names.get(id(p)), p, p))
                continue
            for how, m in members[flat]:
                entries.append(_Entry(names.get(id(m.tensor)), m.tensor, p, how, m))
        order = listed.get(tuple(id(p) for p in group["params"]), named)
        entries.sort(key=lambda e: order.get(id(e.tensor), len(order)))
        out.append(entries)
    return out


# The order of the model's parameters in each group given to fxrec.param_groups, by the
# tensors of the group it returned (an optimizer copies and replaces group dicts, never its
# tensors): a plain optimizer on those groups saves their state in that order.
_LISTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_orders(opt: Any, listed: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> None:
    """Each group returned by one ``fxrec.param_groups`` call lists these parameters of the
    model, in order. Orders of earlier calls are dropped past 1024 groups, never this call's."""
    orders = _LISTED.setdefault(opt, {})
    for group, params in listed:
        key = tuple(id(p) for p in group["params"])
        orders.pop(key, None)
        orders[key] = {id(p): i for i, p in enumerate(params)}
    while len(orders) > max(1024, len(listed)):  # the oldest first: earlier calls'
        del orders[next(iter(orders))]


def _piece(key: str, value: Any, e: _Entry) -> Any:
    """A copy of ``e``'s part of its held tensor's state ``value``. The optimizer updates its
    state in place: a state dict sharing it would follow later steps for unfused parameters
    but not for members (whose slices are copies), a state of no one moment."""
    if not isinstance(value, torch.Tensor):
        return value
    if e.member is None or key in _SCALAR_KEYS or not value.dim() or value.shape != e.held.shape:
        return value.clone()
    return _member_slice(value, e.how, e.member).clone(memory_format=torch.contiguous_format)


def _check_groups(plain: list[list[_Entry]], saved: list[Mapping[str, Any]]) -> None:
    if len(saved) != len(plain) or any(len(g["params"]) != len(e) for g, e in zip(saved, plain)):
        raise ValueError(
            "fxrec.load_optim_state_dict: the state holds groups of "
            f"{[len(g['params']) for g in saved]} parameters, the optimizer's groups hold "
            f"{[len(e) for e in plain]} of the model's parameters. Build the optimizer's groups "
            "as the saving job did, on the model's parameters through "
            "fxrec.param_groups(opt, groups); a state from an optimizer over flat parameters "
            "(its own state_dict()) is saved with fxrec.optim_state_dict(opt, optimizer)."
        )


def _saved_ids(entries: list[_Entry], saved: Mapping[str, Any]) -> list[Any]:
    """The saved ids of ``entries``, in order: by name where the state names its parameters
    (``param_names``: an optimizer built on ``named_parameters()``), else by position."""
    ids = list(saved["params"])
    names = saved.get("param_names")
    if names is None:
        return ids
    by_name = dict(zip(names, ids))
    missing = [e.name for e in entries if e.name not in by_name]
    if missing:
        raise ValueError(
            f"fxrec.load_optim_state_dict: the state has no entry for {missing[:4]} in its "
            f"group (it names {list(names)[:4]}...): build the groups as the saving job did."
        )
    return [by_name[e.name] for e in entries]


def _assemble(
    p: torch.Tensor, pieces: list[tuple[_Entry, dict[str, Any] | None]]
) -> dict[str, Any] | None:
    """The state of ``p`` (a parameter or a flat parameter) from its members' states."""
    if len(pieces) == 1 and pieces[0][0].member is None:
        st = pieces[0][1]
        if st is None:
            return None
        return {k: _owned(k, v, p) for k, v in st.items() if k != LAYOUT_KEY}
    states = [st for _, st in pieces]
    if all(st is None for st in states):
        return None
    keys = [sorted(k for k in st if k != LAYOUT_KEY) if st else [] for st in states]
    if any(k != keys[0] for k in keys):
        raise ValueError(_disagree(pieces, "which state they have", keys))
    out: dict[str, Any] = {}
    for key in keys[0]:
        values = [st[key] for st in states]  # type: ignore[index]
        out[key] = _assemble_value(p, key, pieces, values)
    return out


def _assemble_value(
    p: torch.Tensor, key: str, pieces: list[tuple[_Entry, Any]], values: list[Any]
) -> Any:
    first = values[0]
    shaped = [
        isinstance(v, torch.Tensor) and key not in _SCALAR_KEYS and v.shape == e.tensor.shape
        for (e, _), v in zip(pieces, values)
    ]
    if all(shaped) and (first.dim() or key not in _SCALAR_KEYS):
        out = torch.zeros_like(p, dtype=first.dtype)
        with torch.no_grad():
            for (e, _), v in zip(pieces, values):
                _member_slice(out, e.how, e.member).copy_(v)  # type: ignore[arg-type]
        return out
    if not all(_equal(first, v) for v in values):
        raise ValueError(_disagree(pieces, f"{key!r}", [_show(v) for v in values]))
    return _owned(key, first, p)


def _owned(key: str, value: Any, p: torch.Tensor) -> Any:
    """A copy of saved state ``value`` for ``p``'s optimizer to update in place. Torch's
    ``load_state_dict`` keeps the tensors it is given: without the copy, two optimizers
    loaded from one state dict (a resume and a plain check), or a state taken from a running
    optimizer, would step the same tensors and drift from the continuing job."""
    if not isinstance(value, torch.Tensor):
        return value
    if key in _SCALAR_KEYS:  # torch keeps ``step`` where it was saved
        return value.clone()
    return value.to(device=p.device, copy=True)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    return a == b


def _show(v: Any) -> Any:
    return v.tolist() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _disagree(pieces: list[tuple[_Entry, Any]], what: str, got: list[Any]) -> str:
    named = [f"{e.name}: {g}" for (e, _), g in zip(pieces, got)]
    return (
        f"fxrec.load_optim_state_dict: parameters laid out in one flat parameter differ in "
        f"{what} ({'; '.join(named[:4])}{'; ...' if len(named) > 4 else ''}), which one "
        "tensor's state cannot hold. Load a state where they agree (parameters trained "
        "together), or optimize with fxrec.optimize(..., keep_params=True)."
    )


# Layout records: optimizers over an optimized module write each flat's member order into
# their state_dict() and check it against the current layout at their next step. fxrec's step
# hook meets each optimizer at its first step and gives it the hooks that do this; later steps
# cost one set lookup, and a check runs only after a load_state_dict.

_TRACKED: weakref.WeakSet = weakref.WeakSet()  # optimized modules whose layouts are recorded
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers given the record and load hooks
_LOADED: weakref.WeakSet = weakref.WeakSet()  # hooked optimizers loaded since their last check


def track(opt: Any) -> None:
    """Record ``opt``'s layouts in the state of optimizers over it (see module docstring)."""
    if getattr(opt, "fxrec_fused", None) is None:
        return
    _TRACKED.add(opt)
    if _on_step not in step_checks:
        step_checks.append(_on_step)
        install_step_checks()


def _layouts(opt: Any) -> dict[int, tuple[str, dict[str, int]]]:
    """For each flat parameter of ``opt``, by id: its name and its members' names, each with
    its position in the flat (stacking index or first row, through nested layouts)."""
    fused = opt.fxrec_fused
    names = {id(p): n for n, p in opt.model.named_parameters(remove_duplicate=False)}
    by_flat: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for key, (flat, how, m) in fused.locate().items():
        pos = tuple(s.index if s.how == "stack" else s.offset for s in m.within)
        pos += (m.index if how == "stack" else m.offset,)
        by_flat.setdefault(flat, []).append((pos, names.get(key, "?")))
    out = {}
    for flat, held in by_flat.items():
        ordered = [n for _, n in sorted(held)]
        out[id(getattr(fused, flat))] = (flat, {n: i for i, n in enumerate(ordered)})
    return out


def _held(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, dict[str, int]]]:
    """The flat parameters ``optimizer`` holds, with their layouts."""
    layouts: dict[int, tuple[str, dict[str, int]]] = {}
    for opt in list(_TRACKED):
        layouts.update(_layouts(opt))
    return [
        (p, *layouts[id(p)])
        for g in optimizer.param_groups
        for p in g["params"]
        if id(p) in layouts
    ]


def _on_step(optimizer: torch.optim.Optimizer) -> None:
    """Before every optimizer's step: the first step hooks it (its state, loaded before, is
    checked then); later ones check only state loaded since."""
    if not _TRACKED:
        return
    if optimizer not in _HOOKED:
        _HOOKED.add(optimizer)
        try:
            optimizer.register_state_dict_post_hook(_record_layouts)
            optimizer.register_load_state_dict_post_hook(_LOADED.add)
        except AttributeError:  # skips Optimizer.__init__ (TorchRec's KeyedOptimizer): no hooks
            return
    elif optimizer not in _LOADED:
        return
    _LOADED.discard(optimizer)
    _check_layouts(optimizer)


def _record_layouts(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """State dict post hook: each flat parameter's entry gets its layout."""
    held = {id(p): layout for p, _, layout in _held(optimizer)}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = sd["state"].get(index)
            if id(p) in held and entry is not None:
                sd["state"][index] = {**entry, LAYOUT_KEY: dict(held[id(p)])}
            index += 1
    return sd


def _check_layouts(optimizer: torch.optim.Optimizer) -> None:
    """A flat parameter's state loaded from a state_dict recorded with another layout would
    update each member with another member's state: raise."""
    for p, name, layout in _held(optimizer):
        st = optimizer.state.get(p)
        saved = st.get(LAYOUT_KEY) if st else None
        if saved is None:
            continue
        if dict(saved) != layout:
            raise RuntimeError(
                f"fxrec: the optimizer state loaded for fxrec_fused.{name} was saved with its "
                f"parameters laid out in another order (saved: {_order(saved)}; now: "
                f"{_order(layout)}): each would be updated with another's state. The layout "
                "follows the example inputs given to fxrec.optimize (a dict's key order). Save "
                "with fxrec.optim_state_dict(opt, optimizer) and load with "
                "fxrec.load_optim_state_dict(opt, optimizer, state), which match state by "
                "parameter, or optimize with example inputs ordered as the saving job's."
            )
        del st[LAYOUT_KEY]


def _order(layout: Mapping[str, int]) -> str:
    names = sorted(layout, key=layout.__getitem__)
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
