"""Shared checks for the compile tests: compiled-with-fxrec vs eager, outputs and gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

import fxrec


def outputs_and_grads(model: nn.Module, args: tuple, fn: Callable[..., Any] | None = None) -> Any:
    """Run ``fn`` (default ``model``) on fresh leaf copies of ``args``; outputs + every grad."""
    model.zero_grad(set_to_none=True)
    leaves = [
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    out = (fn if fn is not None else model)(*leaves)
    flat = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
    loss = sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum() for o in flat)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    grads = [p.grad for _, p in sorted(model.named_parameters())]
    grads += [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    return [o.detach() for o in flat], grads


def assert_same(got: Any, want: Any, tol: float = 1e-5) -> None:
    (go, gg), (wo, wg) = got, want
    assert len(go) == len(wo) and len(gg) == len(wg)
    for a, b in zip(go + gg, wo + wg):
        if b is None:
            assert a is None
            continue
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def compiled_matches_eager(
    model: nn.Module, args: tuple, backend: Any, *, dynamic: bool | None = False
) -> None:
    """``torch.compile(model, backend)`` computes eager's outputs and gradients."""
    twin = copy.deepcopy(model)
    want = outputs_and_grads(model, args)
    compiled = torch.compile(twin, backend=backend, dynamic=dynamic)
    got = outputs_and_grads(twin, args, compiled)
    assert_same(got, want)


class GraphRecorder:
    """An inner backend that keeps every graph it is handed (and runs it eagerly)."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.inputs: list[list[Any]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm)
        self.inputs.append(list(example_inputs))
        return gm.forward


def dynamo_graph(fn: Callable[..., Any], *args: Any) -> tuple[fx.GraphModule, list[Any]]:
    """The single graph dynamo hands a backend for ``fn(*args)`` (a fresh copy)."""
    rec = GraphRecorder()
    torch._dynamo.reset()
    torch.compile(fn, backend=rec, fullgraph=True)(*args)
    torch._dynamo.reset()
    gm = rec.graphs[0]
    return fx.GraphModule(gm, copy.deepcopy(gm.graph)), rec.inputs[0]


def through_inductor_pass(
    model: nn.Module, xs: Sequence[torch.Tensor], params_only: bool = False
) -> Callable[..., Any]:
    """``model`` as the graph dynamo hands Inductor, after fxrec's pass, run as it is
    (Inductor's C++ build is slow on 2 cores): called with new inputs, it returns the graph's
    first output. The graph reads the model's tensors as inputs (``params_only``: check that
    they are all parameters)."""
    leaves = [x.clone().requires_grad_() for x in xs]
    gm, inputs = dynamo_graph(model, *leaves)
    fxrec.inductor_pass()(gm.graph)
    gm.recompile()
    where = {id(x): i for i, x in enumerate(leaves)}
    if params_only:
        assert all(id(a) in where or isinstance(a, nn.Parameter) for a in inputs)

    def run(*args: torch.Tensor) -> Any:
        return gm(*(args[where[id(a)]] if id(a) in where else a for a in inputs))[0]

    return run


_VIEWS = {"split", "chunk", "unbind", "narrow", "view", "reshape", "getitem", "split_with_sizes"}


def op_count(gm: fx.GraphModule) -> int:
    """Call nodes that compute something (views and tuple indexing are free)."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op.startswith("call")
        and (n.target if isinstance(n.target, str) else getattr(n.target, "__name__", ""))
        not in _VIEWS
    )


def assert_same_state(run: nn.Module, ref: nn.Module, tol: float) -> None:
    """``run``'s state dict (under ``torch.compile``'s wrapper or not) equals ``ref``'s."""
    state = run.state_dict()
    for name, p in ref.state_dict().items():
        key = name if name in state else f"_orig_mod.{name}"  # torch.compile's wrapper
        torch.testing.assert_close(state[key], p, rtol=tol, atol=tol, msg=name)
