"""Activation-checkpointed regions of dynamo graphs: run eagerly with the model's RNG, and
reported as left to themselves.

Dynamo captures ``torch.utils.checkpoint.checkpoint(fn, *args)`` as one
``tag_activation_checkpoint`` node calling a sub-graph (``wrap_body_0``). PyTorch's eager
implementation of that op recomputes the region in backward without restoring the RNG state
(it leaves that to AOTAutograd and Inductor, which fix each random op's seed): run as it is,
a region with dropout draws another mask in backward than in forward, and gradients differ
from the model's. Graphs that run eagerly therefore call ``checkpoint`` itself on such
regions, as the model does, with the RNG state kept for the recomputation.

Rules rewrite the top-level graph only: a region's nodes are left as written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as ckpt

from fxrec.graph.effects import is_random, subgraphs
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_nodes", "checkpointed", "eager_forward", "keep_rng", "note_unfused"]

_CONTEXT_FN = "_checkpoint_context_fn"  # where dynamo keeps a region's ``context_fn``
_NO_OPS = {torch._C._log_api_usage_once}  # dynamo records this call in some regions


def _is_checkpoint(node: fx.Node) -> bool:
    tag = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return node.op == "call_function" and node.target is tag and bool(subgraphs(node))


def checkpoint_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The activation-checkpointed regions of ``graph`` (its top level)."""
    return [n for n in graph.nodes if _is_checkpoint(n)]


def checkpointed(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``body(*args)`` under ``torch.utils.checkpoint.checkpoint``, as the model called it.

    ``kwargs`` are the checkpoint's own (dynamo passes the region's inputs positionally).
    Non-reentrant, as the higher-order op runs it; the RNG state is kept for the
    recomputation unless the model asked otherwise; a selective-checkpoint ``context_fn``
    the model passed (kept on the body) is passed again.
    """
    options = {**kwargs, "use_reentrant": False}
    options.setdefault("preserve_rng_state", True)
    context_fn = body.meta.get(_CONTEXT_FN)
    if context_fn is not None:
        options["context_fn"] = context_fn
    return ckpt.checkpoint(body, *args, **options)


def keep_rng(gm: fx.GraphModule) -> int:
    """Make ``gm``'s checkpointed regions that draw random numbers call :func:`checkpointed`
    (nested regions too), so that recomputation draws what forward drew. In place; returns
    how many regions were rewritten (``gm`` is recompiled if any)."""
    rewritten = 0
    for node in checkpoint_nodes(gm.graph):
        body = subgraphs(node)[0]
        if not any(is_random(n) for n in body.graph.nodes):
            continue
        rewritten += keep_rng(body)
        node.target = checkpointed
        rewritten += 1
    if rewritten:
        gm.recompile()
        logger.debug("fxrec: %d checkpointed regions keep the RNG state", rewritten)
    return rewritten


def eager_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """What the ``"eager"`` inner backend runs: ``gm.forward``, its checkpointed regions
    drawing in backward what they drew in forward (see :func:`keep_rng`)."""
    keep_rng(gm)
    return gm.forward


def _computing_nodes(body: fx.GraphModule) -> int:
    """Nodes of ``body`` that compute (its nested regions' too)."""
    count = 0
    for n in body.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and n.target not in _NO_OPS:
            inner = subgraphs(n) if n.op == "call_function" else []
            count += sum(_computing_nodes(b) for b in inner) if inner else 1
    return count


def note_unfused(gm: fx.GraphModule, report: Report) -> int:
    """Note in ``report`` how many nodes inside ``gm``'s checkpointed regions rules left
    alone (they rewrite the top-level graph only); returns that count."""
    regions = checkpoint_nodes(gm.graph)
    count = sum(_computing_nodes(subgraphs(n)[0]) for n in regions)
    if count:
        report.note(
            f"activation checkpointing: {count} nodes inside {len(regions)} checkpointed "
            "region(s) left unfused: rules rewrite only the graph outside "
            "torch.utils.checkpoint regions"
        )
    return count
