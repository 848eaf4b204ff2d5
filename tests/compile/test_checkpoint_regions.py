"""Checkpointed regions run eagerly as the model runs them: its variant and its options.

Dynamo captures both variants of ``torch.utils.checkpoint`` as one
``tag_activation_checkpoint`` op, whose eager implementation always runs non-reentrant and
passes the region's parameters as inputs: with a reentrant region whose input needs no
gradient, PyTorch gives the region's parameters none, while the op trained them (the loss
drifted from the model's within a few steps). It also ran each region node by node through
``fx.Interpreter`` under selective-checkpoint dispatch modes, about twice the model's step
time on small towers. Graphs that run eagerly call ``checkpoint`` itself on every region,
with the model's ``use_reentrant``, ``preserve_rng_state``, ``determinism_check`` and
``context_fn``.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import fxrec
from fxrec.compile.checkpoint import call_checkpoint, checkpoint_nodes, checkpointed
from fxrec.graph.effects import (
    has_side_effects,
    mutates_input,
    written_in_place,
    written_target,
    written_targets,
)
from fxrec.measure import count_kernels
from tests.compile.helpers import assert_same_state, dynamo_graph

# PyTorch's warnings for a reentrant region whose inputs need no gradient, and for a
# checkpoint called without ``use_reentrant``: the model and fxrec's run warn alike
pytestmark = [
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad"),
    pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant parameter"),
]

TOL = 1e-5
D, N, B = 8, 3, 16


class Towers(nn.Module):
    """One checkpointed tower per region on ``x``; per-slice LayerNorm + tanh of ``z``
    outside the regions (rules fuse those: the graph runs, not the model); then a head."""

    def __init__(self, reentrant: bool | None, p: float = 0.0, outside: bool = True, **options):
        super().__init__()
        self.options = dict(options)
        if reentrant is not None:
            self.options["use_reentrant"] = reentrant
        self.outside = outside
        self.towers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(D, D), nn.LayerNorm(D), nn.ReLU(), nn.Dropout(p), nn.Linear(D, D)
            )
            for _ in range(N)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))
        self.head = nn.Linear((2 if outside else 1) * N * D, 1)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        feats = []
        if self.outside:
            feats = [torch.tanh(n(part)) for n, part in zip(self.norms, z.split(D, 1))]
        outs = [checkpoint(t, x, **self.options) for t in self.towers]
        return self.head(torch.cat(feats + outs, 1)).squeeze(1)


def _optimized(model: nn.Module, args: tuple) -> tuple[nn.Module, Callable[[], dict]]:
    opt = fxrec.optimize(model, args)
    assert opt.fxrec_report.count() > 0  # rules fired: calls run fxrec's graph
    return opt, lambda: opt.fxrec_fused.grads(model)


def _compiled(model: nn.Module, args: tuple) -> tuple[nn.Module, Callable[[], dict]]:
    compiled = torch.compile(model, backend=fxrec.compile_backend("eager"), dynamic=False)
    return compiled, lambda: {n: p.grad for n, p in model.named_parameters()}


def _unchecked(model: nn.Module, args: tuple) -> tuple[nn.Module, Callable[[], dict]]:
    """``optimize`` without its first-call check: fxrec's graph runs even where it is wrong."""
    opt = fxrec.optimize(model, args, check=False)
    assert opt.fxrec_report.count() > 0
    return opt, lambda: opt.fxrec_fused.grads(model)


def _compiled_with(backend: Any) -> Callable[[nn.Module, tuple], tuple[nn.Module, Callable]]:
    def entry(model: nn.Module, args: tuple) -> tuple[nn.Module, Callable[[], dict]]:
        compiled = torch.compile(model, backend=backend, dynamic=False)
        return compiled, lambda: {n: p.grad for n, p in model.named_parameters()}

    return entry


ENTRY_POINTS = {"optimize": _optimized, "compile_backend_eager": _compiled}
MORE_ENTRY_POINTS = {
    "optimize_unchecked": _unchecked,
    "compile_backend_aot_eager": _compiled_with(fxrec.compile_backend("aot_eager")),
    "torch_compile_aot_eager": _compiled_with("aot_eager"),  # dynamo alone, no fxrec
}


def _inputs(x_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, D, requires_grad=x_grad), torch.randn(B, N * D)


def _step(module: nn.Module, optim: torch.optim.Optimizer, args: tuple, seed: int) -> Any:
    optim.zero_grad(set_to_none=True)
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch.manual_seed(seed)  # the same dropout masks for both, if both draw alike
    out = module(*leaves)
    (out * torch.linspace(0.5, 1.5, out.numel())).pow(2).mean().backward()
    return out.detach(), [a.grad for a in leaves]


def _assert_same_grad(got: torch.Tensor | None, want: torch.Tensor | None, name: str) -> None:
    assert (got is None) == (want is None), f"{name}: gradient {got} where the model has {want}"
    if want is not None:
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=name)


def _trains_like_plain(
    model: nn.Module, entry: str, x_grad: bool, reference: str | None = None
) -> None:
    """Three SGD steps on fresh inputs, the same seeds: outputs, every parameter's gradient
    (or its absence), the inputs' gradients, and the parameters after each step. The model
    runs as is, or through the ``reference`` entry point."""
    entries = ENTRY_POINTS | MORE_ENTRY_POINTS
    ref = copy.deepcopy(model)
    run, grads = entries[entry](model, _inputs(x_grad))
    ref_run = ref if reference is None else entries[reference](ref, _inputs(x_grad))[0]
    o_run = torch.optim.SGD(run.parameters(), lr=0.5)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    for seed in range(3):
        args = _inputs(x_grad)
        (got, got_in), (want, want_in) = (
            _step(run, o_run, args, seed),
            _step(ref_run, o_ref, args, seed),
        )
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        for i, (g, w) in enumerate(zip(got_in, want_in)):
            _assert_same_grad(g, w, f"input {i}")
        got_grads = grads()
        for name, p in ref.named_parameters():
            _assert_same_grad(got_grads.get(name), p.grad, name)
        o_run.step()
        o_ref.step()
        assert_same_state(run, ref, TOL)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["input_no_grad", "input_grad"])
@pytest.mark.parametrize(
    "reentrant", [False, True, None], ids=["non_reentrant", "reentrant", "default"]
)
def test_checkpointed_towers_train_like_the_plain_model(
    entry: str, p: float, x_grad: bool, reentrant: bool | None
) -> None:
    """Reentrant (explicit or PyTorch's default) with an input needing no gradient: the
    towers get none, as in the model."""
    _trains_like_plain(Towers(reentrant, p), entry, x_grad)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


OPTIONS = {
    "no_rng_state": {"preserve_rng_state": False},
    "no_determinism_check": {"determinism_check": "none"},
    "selective": {
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    },
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_checkpoint_options_are_kept(entry: str, option: str) -> None:
    """Without the RNG state kept, the recomputation draws new masks: in the model too."""
    _trains_like_plain(Towers(False, 0.3, **OPTIONS[option]), entry, x_grad=True)


def test_a_reentrant_region_keeps_no_rng_state_option() -> None:
    _trains_like_plain(Towers(True, 0.3, preserve_rng_state=False), "optimize", x_grad=True)


def _kernels(module: nn.Module, args: tuple) -> tuple[int, int]:
    def fresh() -> list[torch.Tensor]:  # no input gradient left to accumulate into
        return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]

    module(*fresh())  # compiled before counting
    count = count_kernels(module, *fresh())
    return count.forward, count.backward


KERNEL_CASES = {  # use_reentrant, input needs a gradient, options
    "non_reentrant": (False, True, {}),
    "reentrant": (True, True, {}),
    "reentrant_input_no_grad": (True, False, {}),
    "selective": (False, True, OPTIONS["selective"]),
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_kernels_equal_the_models(case: str) -> None:
    """Nothing to fuse: the regions' forward, recomputation and backward launch what the
    model launches (no recomputation and no tower backward for a reentrant region whose
    input needs no gradient; saved matmuls not recomputed)."""
    reentrant, x_grad, options = KERNEL_CASES[case]
    model = Towers(reentrant, outside=False, **options)
    compiled = torch.compile(
        copy.deepcopy(model), backend=fxrec.compile_backend("eager"), dynamic=False
    )
    args = _inputs(x_grad)
    assert _kernels(compiled, args) == _kernels(model, args)


def test_every_region_calls_checkpoint() -> None:
    """Regions drawing nothing run through ``checkpoint`` too (not node by node through
    PyTorch's op), with the model's options and no others (PyTorch keeps the RNG state by
    default); nested regions too."""

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(D, D), nn.Linear(D, D)

        def block(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(checkpoint(self.inner, x, use_reentrant=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=True)

    gm, _ = dynamo_graph(Nested(), torch.randn(B, D, requires_grad=True))
    (region,) = checkpoint_nodes(gm.graph)
    assert call_checkpoint(gm) == 2 and region.target is checkpointed
    assert region.kwargs == {"use_reentrant": True}
    assert checkpoint_nodes(gm.graph) == [region]  # still a region once rewritten
    assert call_checkpoint(gm) == 0


class SharedLayers(nn.Module):
    """Linears fused outside the regions (their weights laid out in one flat parameter),
    each also called inside a reentrant region: the region reads views of the flat one."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))
        self.head = nn.Linear(2 * N * D, 1)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        outside = [torch.tanh(lin(part)) for lin, part in zip(self.lins, z.split(D, 1))]
        inside = [checkpoint(lin, x, use_reentrant=True) for lin in self.lins]
        return self.head(torch.cat(outside + inside, 1)).squeeze(1)


@pytest.mark.parametrize("x_grad", [False, True], ids=["input_no_grad", "input_grad"])
def test_a_reentrant_region_reading_laid_out_parameters(x_grad: bool) -> None:
    _trains_like_plain(SharedLayers(), "optimize", x_grad)


class SliceArgument(Towers):
    """Slices of a parameter passed to a reentrant ``checkpoint`` as arguments: inputs
    needing a gradient, though ``x`` needs none."""

    def __init__(self) -> None:
        super().__init__(True)
        self.w = nn.Parameter(torch.randn(D, N * D))

    @staticmethod
    def mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        feats = [torch.tanh(n(part)) for n, part in zip(self.norms, z.split(D, 1))]
        outs = [
            checkpoint(self.mix, x, self.w[:, i * D : (i + 1) * D], use_reentrant=True)
            for i in range(N)
        ]
        return self.head(torch.cat(feats + outs, 1)).squeeze(1)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_parameter_slice_passed_to_a_reentrant_region(entry: str) -> None:
    _trains_like_plain(SliceArgument(), entry, x_grad=False)


class ComputedFromLaidOut(Towers):
    """A tensor computed from a laid-out Linear's weight (``w.t()``, ``w[0]``) passed to a
    reentrant ``checkpoint``: an input needing a gradient, though ``x`` needs none, so the
    region trains. Only the member views fxrec's layout puts in place of a parameter are
    parameters the region reads."""

    def __init__(self, form: str) -> None:
        super().__init__(True)
        self.form = form
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))  # fused: laid out

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        feats = [lin(part) for lin, part in zip(self.lins, z.split(D, 1))]
        outs = []
        for lin, tower in zip(self.lins, self.towers):
            if self.form == "transposed":
                w = lin.weight.t()
                outs.append(checkpoint(lambda a, w, t=tower: t(a @ w), x, w, use_reentrant=True))
            else:
                w = lin.weight[0]
                outs.append(checkpoint(lambda a, w, t=tower: t(a * w), x, w, use_reentrant=True))
        return self.head(torch.cat(feats + outs, 1)).squeeze(1)


@pytest.mark.parametrize("form", ["transposed", "row"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["input_no_grad", "input_grad"])
def test_a_tensor_computed_from_a_laid_out_parameter_is_an_input(form: str, x_grad: bool) -> None:
    _trains_like_plain(ComputedFromLaidOut(form), "optimize", x_grad)


class BatchNormTowers(Towers):
    """Towers with BatchNorm (running statistics written in place) and an EMA buffer,
    checkpointed; optionally the BatchNorm in a region of its own inside the tower's."""

    def __init__(self, reentrant: bool, nested: bool = False) -> None:
        super().__init__(reentrant)
        self.nested = nested
        self.norm_in = nn.ModuleList(nn.BatchNorm1d(D) for _ in range(N))
        self.register_buffer("ema", torch.zeros(D))

    def tower(self, i: int, x: torch.Tensor) -> torch.Tensor:
        h = self.towers[i][0](x)
        if self.nested:
            h = checkpoint(self.norm_in[i], h, use_reentrant=self.options["use_reentrant"])
        else:
            h = self.norm_in[i](h)
        if self.training:
            self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return self.towers[i][4](torch.relu(h) + self.ema)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        feats = [torch.tanh(n(part)) for n, part in zip(self.norms, z.split(D, 1))]
        outs = [checkpoint(self.tower, i, x, **self.options) for i in range(N)]
        return self.head(torch.cat(feats + outs, 1)).squeeze(1)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_buffers_written_in_a_region_train_like_the_plain_model(
    entry: str, nested: bool, reentrant: bool
) -> None:
    """Dynamo passes the buffers as the region's inputs; a non-reentrant ``checkpoint``
    saves its inputs, and one written in place failed its check in backward. The running
    statistics (written in forward and again in the recomputation) equal the model's."""
    _trains_like_plain(BatchNormTowers(reentrant, nested), entry, x_grad=True)


def test_a_region_recomputes_without_calling_its_graph_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-reentrant recomputation stops early by raising inside the region: called as a
    ``GraphModule``, the region caught that to format a traceback (~70 us a region a step).
    Its ``forward`` is called instead, in forward and in the recomputation."""
    compiled = torch.compile(Towers(False), backend=fxrec.compile_backend("eager"), dynamic=False)
    compiled(*_inputs(True)).sum().backward()  # compiled before counting
    calls: list[type] = []
    wrapped = fx.graph_module._WrappedCall.__call__

    def spy(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(obj))
        return wrapped(self, obj, *args, **kwargs)

    monkeypatch.setattr(fx.graph_module._WrappedCall, "__call__", spy)
    compiled(*_inputs(True)).sum().backward()
    assert calls == []


class WritesItsArgument(Towers):
    """Each region writes the tensor the model passes it: ``nn.ELU(inplace=True)`` on its
    own ``x * 2`` (``"elu"``) or ``a.mul_(2)`` on its own ``x.clone()`` (``"mul_"``). The
    expressions outside the regions are identical, but each is its own tensor: merged into
    one, every region wrote it (wrong outputs, or a failed version check in backward)."""

    def __init__(self, reentrant: bool, form: str) -> None:
        super().__init__(reentrant)
        self.form = form
        self.acts = nn.ModuleList(nn.ELU(inplace=True) for _ in range(N))

    def region(self, i: int, a: torch.Tensor) -> torch.Tensor:
        if self.form == "mul_":
            a.mul_(2.0)
        else:
            a = self.acts[i](a)
        return self.towers[i](a)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        feats = [torch.tanh(n(part)) for n, part in zip(self.norms, z.split(D, 1))]
        outs = [
            checkpoint(self.region, i, x * 2.0 if self.form == "elu" else x.clone(), **self.options)
            for i in range(N)
        ]
        return self.head(torch.cat(feats + outs, 1)).squeeze(1)


@pytest.mark.parametrize("entry", ["optimize_unchecked", "compile_backend_eager"])
@pytest.mark.parametrize("form", ["elu", "mul_"])
def test_reentrant_regions_writing_their_arguments_train_like_the_plain_model(
    form: str, entry: str
) -> None:
    _trains_like_plain(WritesItsArgument(True, form), entry, x_grad=False)


@pytest.mark.parametrize("entry", ["optimize_unchecked", "compile_backend_eager"])
@pytest.mark.parametrize("form", ["elu", "mul_"])
def test_non_reentrant_regions_writing_their_arguments_run_as_the_model(
    form: str, entry: str
) -> None:
    """The model's outputs; its backward fails (``checkpoint`` saved the argument the
    region then wrote), and so does fxrec's: the written argument stays the region's input."""
    model = WritesItsArgument(False, form)
    ref = copy.deepcopy(model)
    run, _ = MORE_ENTRY_POINTS.get(entry, _compiled)(model, _inputs(False))
    args = _inputs(False)
    got, want = run(*args), ref(*args)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    for out in (want, got):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("form", ["elu", "mul_"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_regions_writing_their_arguments_under_aot_eager(reentrant: bool, form: str) -> None:
    """AOTAutograd traces the regions (always non-reentrant) and their writes functionally:
    ``torch.compile(backend="aot_eager")`` trains where the model's non-reentrant backward
    fails, and trains reentrant towers the model does not; fxrec's graphs under it train
    as it does."""
    _trains_like_plain(
        WritesItsArgument(reentrant, form),
        "compile_backend_aot_eager",
        x_grad=False,
        reference="torch_compile_aot_eager",
    )


class NestedWrite(nn.Module):
    """A region whose nested region writes a view of its second argument, beside a region
    that only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def inner(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b[:, :2].mul_(2.0)
        return self.lin(a + b)

    def outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, a, b, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        read, written = x * 3.0, x * 2.0
        return checkpoint(self.outer, read, written, use_reentrant=True) + checkpoint(
            self.lin, read, use_reentrant=True
        )


def test_effects_see_the_arguments_a_region_writes() -> None:
    """Rules ask :mod:`fxrec.graph.effects` whether a node writes in place and what: a
    region writing its argument (in a nested region, through a view) answers with that
    argument, so dedup, dead code, fusions and schedules keep reads of it apart."""
    gm, _ = dynamo_graph(NestedWrite(), torch.randn(B, D))
    writes, reads = checkpoint_nodes(gm.graph)
    scaled = {n.args[1]: n for n in gm.graph.nodes if n.target is operator.mul}
    read, written = scaled[3.0], scaled[2.0]
    assert mutates_input(writes) and has_side_effects(writes)
    assert written_targets(writes) == [written] and written_target(writes) is written
    assert written_in_place(written) and not written_in_place(read)
    assert not mutates_input(reads) and written_targets(reads) == []
