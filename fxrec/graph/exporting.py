"""``torch.export`` of an optimized module, for serving.

``torch.export.export(opt, ...)`` lists a module's parameters twice over: through
``opt.named_parameters()`` (the flat parameters, without the members laid out in them) and
by walking every submodule (the members too), and fails when the two disagree. What is
exported here is the graph fxrec built for these inputs, holding only the tensors it reads:
the flat parameters and the model's other parameters and buffers, under their names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from fxrec.graph.capture import capture_symbolic, prune_attrs
from fxrec.graph.optimize_graph import optimize_graph
from fxrec.graph.params import FusedParameters, ParamStore, note_graph_writes
from fxrec.passes.embedding import eager_only_lookups

if TYPE_CHECKING:
    from fxrec.graph.module import OptimizedModule

logger = logging.getLogger(__name__)

__all__ = ["export"]


def export(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    **export_kwargs: Any,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` for modules returned by :func:`fxrec.optimize` (any other
    module is passed through). Takes the same arguments (``dynamic_shapes=``, ``strict=``).

    The program computes what ``model`` computes in its current mode (``eval()`` first for
    serving). Lookups that calls run through fbgemm (which has no fake kernel to trace) are
    done with torch ops in the program, as in graphs compiled further. A model holding a
    sharded collection is refused: export its unsharded copy.
    Only symbolically traced models have a graph that can be exported: a model fxrec
    captured with dynamo raises, and ``torch.export.export(opt.model, ...)`` exports it
    unoptimized.
    """
    from fxrec.graph.module import OptimizedModule, _Unfused

    _refuse_sharded(model)
    if not isinstance(model, OptimizedModule):
        return torch.export.export(model, tuple(args), dict(kwargs or {}), **export_kwargs)
    runner, call_args, call_kwargs = model._runner(tuple(args), dict(kwargs or {}))
    if isinstance(runner, _Unfused):  # the trace nothing rewrote: calls run the model instead
        runner = runner.gm
    if not isinstance(runner, fx.GraphModule):
        if model._backend != "eager":
            why = f"it was optimized with backend={model._backend!r}: optimize it with the default"
        elif model.fxrec_report.capture == "dynamo":
            why = "it was captured with dynamo (the report's notes say why symbolic tracing could not)"
        else:
            why = "it runs eagerly for these inputs (the report's notes say why)"
        raise ValueError(
            f"fxrec.export: {type(model.model).__name__} has no graph to export: {why}. "
            "torch.export.export(opt.model, ...) exports the model unoptimized."
        )
    model.fxrec_fused.sync_data()
    # the trace's placeholders: forward's arguments in order, keyword-only ones last
    flat = call_args + tuple(call_kwargs.values())
    if eager_only_lookups(runner):
        runner = _graph_traced_further(model, flat)
    return torch.export.export(prune_attrs(runner), flat, **export_kwargs)


def _graph_traced_further(model: OptimizedModule, args: tuple[Any, ...]) -> fx.GraphModule:
    """The model's graph for ``args`` as the rules build it for a graph traced further
    (``runs_eagerly=False``, as under ``backend="inductor"``): the graph calls run holds
    fbgemm lookups, which have no fake kernel to export; this one does them with torch ops.

    It reads the parameters through the layouts calls use and makes none: the optimizer
    holds those. Checked against the model's trace on ``args``; where it disagrees, the
    trace itself (reading the laid-out parameters) is exported, as calls would run it.
    """
    from fxrec.graph.module import (
        _device_type,
        _hooks_silenced,
        _preserved_state,
        _run_annotating,
        _same_outputs,
    )

    traced = capture_symbolic(model.model)
    gm = fx.GraphModule(traced, _graph_copy(traced), type(model.model).__name__)
    note_graph_writes(gm)
    with _preserved_state(model.model, args), _hooks_silenced(model.model):
        reference = _run_annotating(gm, args)
    owner = model._owner()
    with _no_new_layouts(owner):
        optimize_graph(
            gm, model._rules, owner=owner, device_type=_device_type(args), runs_eagerly=False
        )
    with _hooks_silenced(model.model):
        if _same_outputs(model.model, gm, args, reference):
            return gm
    logger.warning(
        "fxrec.export: the graph rewritten for tracing disagrees with the model on the "
        "example inputs; exporting the model's graph unfused"
    )
    return _read_through_flats(traced, owner)


def _read_through_flats(traced: fx.GraphModule, owner: FusedParameters | None) -> fx.GraphModule:
    """A copy of the model's trace, unfused, reading laid-out members through their flat
    tensors (the members the program holds are those)."""
    gm = fx.GraphModule(traced, _graph_copy(traced), type(traced).__name__)
    ParamStore(gm, owner).rebind()
    gm.recompile()
    return gm


def _graph_copy(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph that rules may rewrite (the trace itself stays as captured)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


@contextlib.contextmanager
def _no_new_layouts(owner: FusedParameters | None) -> Iterator[None]:
    """Rules reuse ``owner``'s layouts and make no new ones (as once it is frozen) inside."""
    if owner is None or owner.frozen:
        yield
        return
    owner.frozen = True
    try:
        yield
    finally:
        owner.frozen = False


def _refuse_sharded(model: nn.Module) -> None:
    """A sharded collection exchanges ids and rows with its peers inside forward: no exported
    program can do that, and dynamo would fail deep inside the exchange."""
    from fxrec.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    names = [n for n, m in model.named_modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    if names:
        raise ValueError(
            f"fxrec.export: {type(model).__name__} holds sharded embedding collections "
            f"({', '.join(repr(n) for n in names[:3])}), which communicate with the other "
            "ranks inside forward and cannot be exported. Export the unsharded model instead: "
            "load the full checkpoint into an unsharded copy and export that."
        )
