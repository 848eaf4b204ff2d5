"""Optimizer parameter groups written for the model, applied to the optimized module.

Rec-model owners group parameters by name or shape: no weight decay on biases and norms, a
learning rate per tower. ``opt.parameters()`` lists flat parameters (``fxrec_fused.*``) in
place of the members they hold, whose names and shapes such rules no longer see; grouping
them by name would silently put every fused bias into the decay group.
:func:`param_groups` takes the groups built on the model's own parameters and gives each
member's flat parameter its member's group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fxrec.graph.optim_state import remember_orders, track

__all__ = ["param_groups"]


def param_groups(opt: Any, groups: Iterable[Any]) -> list[dict[str, Any]]:
    """``groups`` (an optimizer's ``params`` argument: tensors, or dicts with ``"params"``,
    built on the model's parameters) with each laid-out member replaced by the flat
    parameter of ``opt`` (an :class:`~fxrec.OptimizedModule`) that holds it.

    The groups come back one-to-one (same count and order), so per-group schedules
    (``LambdaLR`` with one lambda per group) and options changed later by group index reach
    the same parameters as on the model. A flat parameter goes to the group of its members;
    members of one flat parameter in different groups (even with equal options: a schedule
    may change them apart), or some of them in no group (left out of the optimizer), cannot
    be honoured by one tensor, and raise with what to do.

    Example::

        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
        optimizer = torch.optim.AdamW(
            fxrec.param_groups(opt, [{"params": decay}, {"params": no_decay, "weight_decay": 0}])
        )
    """
    listed = list(groups)
    if not listed:
        raise ValueError("param_groups got no parameters.")
    if not isinstance(listed[0], Mapping):
        listed = [{"params": listed}]
    fused = opt.fxrec_fused
    track(opt)  # its optimizer's state_dict() records the layouts (see optim_state)
    where = fused.locate()
    names = {id(p): n for n, p in opt.model.named_parameters(remove_duplicate=False)}
    out: list[dict[str, Any]] = []
    listed_params: list[list[torch.Tensor]] = []  # each group's parameters, as given
    group_of: dict[str, int] = {}  # flat parameter name -> the group it went to
    seen: set[int] = set()
    for gi, group in enumerate(listed):
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        mine: list[torch.Tensor] = []
        for p in params:
            seen.add(id(p))
            hit = where.get(id(p))
            if hit is None:
                mine.append(p)
                continue
            flat = hit[0]
            if flat not in group_of:  # the flat parameter goes to its members' group
                group_of[flat] = gi
                mine.append(getattr(fused, flat))
            elif group_of[flat] != gi:
                raise ValueError(_split_message(names, p, where, flat, listed, group_of[flat], gi))
        out.append({**group, "params": mine})
        listed_params.append(params)
    for flat in group_of:
        left = [m.tensor for f, _, m in where.values() if f == flat and id(m.tensor) not in seen]
        if left:
            raise ValueError(
                f"{names.get(id(left[0]), 'a parameter')!r} is in no group, but it is laid "
                f"out in fxrec_fused.{flat} with parameters that are: one tensor cannot be "
                "half optimized. Put it in a group (lr=0 to keep it fixed), or freeze it "
                "before fxrec.optimize."
            )
    remember_orders(opt, list(zip(out, listed_params)))
    return out


def _split_message(
    names: Mapping[int, str],
    p: torch.Tensor,
    where: Mapping[int, Any],
    flat: str,
    listed: list[Any],
    first: int,
    other: int,
) -> str:
    """Why a flat parameter whose members sit in two groups is refused, and what to do."""
    held = [names.get(i, "?") for i, loc in where.items() if loc[0] == flat]
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    why = ""
    if _options(listed[first]) == _options(listed[other]):
        why = (
            " (their options are equal now, but a per-group schedule or a later change by "
            f"group index would give group {other}'s members group {first}'s)"
        )
    return (
        f"{names.get(id(p), 'a parameter')!r} is in group {other}, but parameters laid out "
        f"with it in fxrec_fused.{flat} ({shown}) are in group {first}: one tensor sits in "
        f"one optimizer group{why}. Put them in one group, or optimize with "
        "fxrec.optimize(..., keep_params=True), which keeps each parameter its own tensor."
    )


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
