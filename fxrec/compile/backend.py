"""``fxrec.compile_backend``: fxrec's rules on every graph dynamo hands a backend.

Dynamo keeps what it is good at (guards, graph breaks, input/output plumbing); fxrec
rewrites each graph, then hands it to an inner backend: ``"eager"`` runs the rewritten
graph as is, ``"inductor"`` compiles it, or any other backend callable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxrec.graph.capture import lift_params_to_attrs
from fxrec.graph.optimize_graph import RuleSpec, optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = ["compile_backend"]

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


def _inner_backend(inner: str | Backend) -> Backend:
    if callable(inner):
        return inner
    if inner == "eager":
        return lambda gm, ex: gm.forward
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    raise ValueError(f"inner backend must be 'eager', 'inductor' or a callable, not {inner!r}")


def compile_backend(
    inner: str | Backend = "inductor",
    *,
    rules: RuleSpec = None,
    model: nn.Module | None = None,
    owner: FusedParameters | None = None,
    report: Report | None = None,
) -> Backend:
    """A ``torch.compile`` backend running fxrec's rules before ``inner``.

    Usage: ``torch.compile(model, backend=fxrec.compile_backend())``. Parameters arrive as
    graph inputs, so fused weights are gathered in-graph. ``fxrec.optimize`` passes
    ``model`` and ``owner`` so that parameters become ``get_attr`` nodes and are laid out once.
    The backend's ``report`` attribute accumulates what each graph got.
    """
    inner_fn = _inner_backend(inner)
    rule_list = resolve_rules(rules)
    rep = report if report is not None else Report(capture="dynamo")

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        keep: list[int] | None = None
        if model is not None and owner is not None:
            gm, keep = lift_params_to_attrs(gm, example_inputs, model)
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        optimize_graph(gm, rule_list, owner=owner, report=rep, device_type=device)
        if keep is None:
            return inner_fn(gm, list(example_inputs))
        kept_inputs = [example_inputs[i] for i in keep]
        compiled = inner_fn(gm, kept_inputs)
        return lambda *args: compiled(*[args[i] for i in keep])

    backend.report = rep  # type: ignore[attr-defined]
    return backend
