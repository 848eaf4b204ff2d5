"""``torch.export`` of an optimized module, for serving.

``torch.export.export(opt, ...)`` lists a module's parameters twice over: through
``opt.named_parameters()`` (the flat parameters, without the members laid out in them) and
by walking every submodule (the members too), and fails when the two disagree. What is
exported here is the graph fxrec built for these inputs, holding only the tensors it reads:
the flat parameters and the model's other parameters and buffers, under their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxrec.graph.capture import prune_attrs

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
    serving). A model holding a sharded collection is refused: export its unsharded copy.
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
    return torch.export.export(prune_attrs(runner), flat, **export_kwargs)


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
