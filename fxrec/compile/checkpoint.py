"""Activation-checkpointed regions of dynamo graphs: run eagerly as the model runs them, and
reported as left to themselves.

Dynamo captures ``torch.utils.checkpoint.checkpoint(fn, *args)``, either variant, as one
``tag_activation_checkpoint`` node calling a sub-graph (``wrap_body_0``) on the region's
tensors, the parameters it reads included. PyTorch's eager implementation of that op is
meant for AOTAutograd to trace: it runs the sub-graph node by node through
``fx.Interpreter`` under selective-checkpoint dispatch modes (twice the model's step time on
small towers), always non-reentrant, and without restoring the RNG state in the
recomputation. Run as it is, a region with dropout draws another mask in backward than in
forward, and a reentrant region whose inputs need no gradient gives its parameters one
(PyTorch's reentrant variant computes none). Graphs that run eagerly therefore call
``checkpoint`` itself on every region (:func:`call_checkpoint`), with the model's options.

Rules rewrite the top-level graph only: a region's nodes are left as written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as ckpt
from torch import nn

from fxrec.graph.effects import is_random, subgraphs
from fxrec.graph.params import OWNER_ATTR
from fxrec.graph.report import Report

logger = logging.getLogger(__name__)

__all__ = [
    "call_checkpoint",
    "checkpoint_nodes",
    "checkpointed",
    "eager_forward",
    "note_unfused",
]

_CONTEXT_FN = "_checkpoint_context_fn"  # where dynamo keeps a region's ``context_fn``
_NO_OPS = {torch._C._log_api_usage_once}  # dynamo records this call in some regions
# the options ``checkpoint`` takes (dynamo keeps only these on the node); others: left alone
_OPTIONS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop"}
_LAID_OUT = "fxrec_laid_out"  # positions of a region's views of fxrec's flat parameters


def _is_checkpoint(node: fx.Node) -> bool:
    tag = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return (
        node.op == "call_function"
        and (node.target is tag or node.target is checkpointed)
        and bool(subgraphs(node))
    )


def checkpoint_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The activation-checkpointed regions of ``graph`` (its top level), whether still
    dynamo's op or already calling :func:`checkpointed`."""
    return [n for n in graph.nodes if _is_checkpoint(n)]


def _laid_out(node: fx.Node, depth: int = 8) -> bool:
    """A view of fxrec's flat parameter (a laid-out member the region reads), made from
    nothing but the flat tensor in a few steps: no model hands fxrec's own attribute to
    ``checkpoint``."""
    if node.op == "get_attr":
        return str(node.target).startswith(OWNER_ATTR + ".")
    inputs = node.all_input_nodes
    if depth == 0 or not inputs or node.op not in ("call_function", "call_method"):
        return False
    return all(_laid_out(n, depth - 1) for n in inputs)


def _reentrant(
    body: fx.GraphModule, args: Sequence[Any], options: dict[str, Any], laid_out: Sequence[int]
) -> Any:
    """Reentrant checkpoint whose inputs are the region's arguments, not the parameters it
    reads (the model's, or views of the flat one at ``laid_out``): with no input needing a
    gradient, nothing inside gets one, as in PyTorch."""
    read = {i: a for i, a in enumerate(args) if i in laid_out or isinstance(a, nn.Parameter)}
    if not read:
        return ckpt.checkpoint(body, *args, **options)
    inputs = [a for i, a in enumerate(args) if i not in read]

    def region(*given: Any) -> Any:
        rest = iter(given)
        return body(*(read[i] if i in read else next(rest) for i in range(len(args))))

    return ckpt.checkpoint(region, *inputs, **options)


def checkpointed(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``body(*args)`` under ``torch.utils.checkpoint.checkpoint``, as the model called it.

    ``kwargs`` are the checkpoint's own options (dynamo passes the region's tensors
    positionally), and where the region reads laid-out parameters (see
    :func:`call_checkpoint`); ``use_reentrant`` left out is PyTorch's default, reentrant. A
    selective-checkpoint ``context_fn`` the model passed (kept on the body) is passed again.
    """
    options = dict(kwargs)
    laid_out = options.pop(_LAID_OUT, ())
    if options.get("use_reentrant") is None:
        options["use_reentrant"] = True
    context_fn = body.meta.get(_CONTEXT_FN)
    if context_fn is not None:
        options["context_fn"] = context_fn
    if options["use_reentrant"]:
        return _reentrant(body, args, options, laid_out)
    return ckpt.checkpoint(body, *args, **options)


def _rewrite(node: fx.Node, body: fx.GraphModule) -> bool:
    """Point ``node`` at :func:`checkpointed`; a region drawing nothing skips keeping the
    RNG state (nothing to draw again). False when its options are not ``checkpoint``'s."""
    unknown = set(node.kwargs) - _OPTIONS
    if unknown:
        logger.debug("fxrec: checkpointed region %s left to PyTorch: %s", node.name, unknown)
        return False
    kwargs = dict(node.kwargs)
    if "preserve_rng_state" not in kwargs and not any(is_random(n) for n in body.graph.nodes):
        kwargs["preserve_rng_state"] = False
    laid_out = [i for i, a in enumerate(node.args[1:]) if isinstance(a, fx.Node) and _laid_out(a)]
    if laid_out:
        kwargs[_LAID_OUT] = tuple(laid_out)
    node.kwargs = kwargs
    node.target = checkpointed
    return True


def call_checkpoint(gm: fx.GraphModule) -> int:
    """Make ``gm``'s checkpointed regions (nested ones too) call :func:`checkpointed`: the
    model's variant and options, the RNG state kept for a recomputation that draws, the
    body run as compiled code. In place; returns how many regions were rewritten (``gm``
    is recompiled if any)."""
    rewritten = 0
    for node in checkpoint_nodes(gm.graph):
        body = subgraphs(node)[0]
        rewritten += call_checkpoint(body)
        if node.target is not checkpointed and _rewrite(node, body):
            rewritten += 1
    if rewritten:
        gm.recompile()
        logger.debug("fxrec: %d checkpointed regions call torch.utils.checkpoint", rewritten)
    return rewritten


def eager_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """What the ``"eager"`` inner backend runs: ``gm.forward``, its checkpointed regions run
    as the model runs them (see :func:`call_checkpoint`). Other backends get dynamo's op,
    which AOTAutograd traces."""
    call_checkpoint(gm)
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
