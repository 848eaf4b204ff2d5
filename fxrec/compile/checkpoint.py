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
``checkpoint`` itself on every region (:func:`call_checkpoint`), with the model's options
(PyTorch's defaults where it gave none: the RNG state kept).

Dynamo also passes a region the buffers it reads as its inputs; the model's region reads
them itself. ``checkpoint`` saves its inputs for the recomputation, and a buffer written in
place after that (BatchNorm's running statistics, by the region or by a later one) fails
the saved tensors' check in backward: such tensors are read by the region, not passed to
``checkpoint``.

Rules rewrite the top-level graph only: a region's nodes are left as written.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as ckpt
from torch import nn

from fxrec.graph.effects import subgraphs, view_bases, written_inputs
from fxrec.graph.params import OWNER_ATTR, _split
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
_WRITTEN = "fxrec_written"  # positions of the buffers a region writes in place


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


def _laid_out(node: fx.Node) -> bool:
    """A laid-out member the region reads: the view of fxrec's flat parameter its layout put
    in place of the model's parameter (see ``ParamStore.rebind``), which keeps that read's
    value (a parameter). A tensor the model computes from one (``w.t()``, ``w[0]``) is an
    input of the region, as in PyTorch."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return (value is None or isinstance(value, nn.Parameter)) and _flat_view(node)


def _flat_view(node: fx.Node) -> bool:
    """Is ``node`` a ``get_attr`` of a flat parameter, or a view of one as the layout makes
    them: its ``_split`` into members, and ``getitem`` / ``narrow`` of a member's slot?"""
    if node.op == "get_attr":
        return str(node.target).startswith(OWNER_ATTR + ".")
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        step = isinstance(node.args[1], int)
    else:
        step = (node.op, node.target) in (("call_function", _split), ("call_method", "narrow"))
    return step and _flat_view(source)


def _reading(
    body: fx.GraphModule, args: Sequence[Any], read: dict[int, Any]
) -> tuple[Callable[..., Any], list[Any]]:
    """``body`` as a function of ``args`` but those at ``read``'s positions, which it reads
    itself (as the model's region reads its parameters and buffers); and those inputs.
    ``body.forward``, not ``body``: a non-reentrant recomputation stops early by raising
    inside the region, which a ``GraphModule`` call catches to format its traceback."""
    inputs = [a for i, a in enumerate(args) if i not in read]
    if not read:
        return body.forward, inputs

    def region(*given: Any) -> Any:
        rest = iter(given)
        return body.forward(*(read[i] if i in read else next(rest) for i in range(len(args))))

    return region, inputs


def _reentrant(
    body: fx.GraphModule, args: Sequence[Any], options: dict[str, Any], read: dict[int, Any]
) -> Any:
    """Reentrant checkpoint whose inputs are the region's arguments, not the parameters and
    buffers it reads (the model's parameters, views of the flat one, those in ``read``):
    with no input needing a gradient, nothing inside gets one, as in PyTorch."""
    read = read | {i: a for i, a in enumerate(args) if isinstance(a, nn.Parameter)}
    region, inputs = _reading(body, args, read)
    return ckpt.checkpoint(region, *inputs, **options)


def _state(args: Sequence[Any], written: Sequence[int]) -> dict[int, Any]:
    """The arguments at ``written`` that hold state (buffers: no gradient), by position. A
    tensor needing a gradient written in place stays an input: ``checkpoint`` refuses it
    in backward, as it does in the model."""
    return {
        i: args[i]
        for i in written
        if isinstance(args[i], torch.Tensor) and not args[i].requires_grad
    }


def checkpointed(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``body(*args)`` under ``torch.utils.checkpoint.checkpoint``, as the model called it.

    ``kwargs`` are the checkpoint's own options (dynamo passes the region's tensors
    positionally), where the region reads laid-out parameters and which buffers it writes in
    place (see :func:`call_checkpoint`); ``use_reentrant`` left out is PyTorch's default,
    reentrant. A selective-checkpoint ``context_fn`` the model passed (kept on the body) is
    passed again.
    """
    options = dict(kwargs)
    laid_out = options.pop(_LAID_OUT, ())
    written = options.pop(_WRITTEN, ())
    if options.get("use_reentrant") is None:
        options["use_reentrant"] = True
    context_fn = body.meta.get(_CONTEXT_FN)
    if context_fn is not None:
        options["context_fn"] = context_fn
    state = _state(args, written)
    if options["use_reentrant"]:
        return _reentrant(body, args, options, state | {i: args[i] for i in laid_out})
    region, inputs = _reading(body, args, state)
    return ckpt.checkpoint(region, *inputs, **options)


def _holds_state(arg: Any) -> bool:
    """Is ``arg`` (a view of) a tensor the graph is given rather than computes: a buffer
    dynamo passes the region, which the model's region reads itself? A tensor the model
    computes and passes (``checkpoint(f, x * 2)``) is the region's input in the model too:
    written in place, it fails the saved inputs' check in backward there as here."""
    return isinstance(arg, fx.Node) and view_bases(arg)[-1].op in ("placeholder", "get_attr")


def _rewrite(node: fx.Node, body: fx.GraphModule) -> bool:
    """Point ``node`` at :func:`checkpointed`, with the model's options as given (PyTorch's
    defaults for the others), and where the region reads laid-out parameters or writes
    buffers (:func:`_holds_state`). False when its options are not ``checkpoint``'s."""
    unknown = set(node.kwargs) - _OPTIONS
    if unknown:
        logger.debug("fxrec: checkpointed region %s left to PyTorch: %s", node.name, unknown)
        return False
    kwargs = dict(node.kwargs)
    laid_out = [i for i, a in enumerate(node.args[1:]) if isinstance(a, fx.Node) and _laid_out(a)]
    if laid_out:
        kwargs[_LAID_OUT] = tuple(laid_out)
    written = tuple(i for i in written_inputs(body) if _holds_state(node.args[1 + i]))
    if written:
        kwargs[_WRITTEN] = written
    node.kwargs = kwargs
    node.target = checkpointed
    return True


def call_checkpoint(gm: fx.GraphModule) -> int:
    """Make ``gm``'s checkpointed regions (nested ones too) call :func:`checkpointed`: the
    model's variant and options (the RNG state kept unless it said otherwise), the body run
    as compiled code. In place; returns how many regions were rewritten (``gm``
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
