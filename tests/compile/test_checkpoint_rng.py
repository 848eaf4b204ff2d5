"""Activation checkpointing around dropout, captured by dynamo and run eagerly.

Dynamo captures ``torch.utils.checkpoint.checkpoint`` as a ``tag_activation_checkpoint`` node
whose eager implementation recomputes the region in backward without restoring the RNG state:
the recomputation drew another dropout mask, so gradients differed from the model's while
outputs matched. Training through ``fxrec.optimize`` or ``compile_backend("eager")`` must
follow the plain model step by step with the same seeds. Rules leave the regions as written,
and the report says how many nodes that left unfused.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxrec
from fxrec.compile.checkpoint import (
    call_checkpoint,
    checkpoint_nodes,
    checkpointed,
    note_unfused,
)
from fxrec.graph.effects import is_random
from fxrec.graph.report import Report
from tests.compile.helpers import assert_same_state, dynamo_graph

TOL = 1e-5


class CheckpointedTowers(nn.Module):
    """Parallel towers with dropout, checkpointed as one region, then a head."""

    def __init__(self, reentrant: bool, towers: int = 3, nested: bool = False) -> None:
        super().__init__()
        self.reentrant, self.nested = reentrant, nested
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Dropout(0.3), nn.Linear(12, 4))
            for _ in range(towers)
        )
        self.head = nn.Linear(4 * towers, 1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:  # the first tower in a region of its own, inside the outer one
            first = checkpoint(self.towers[0], x, use_reentrant=self.reentrant)
            return torch.cat([first, *(t(x) for t in self.towers[1:])], 1)
        return torch.cat([t(x) for t in self.towers], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _optimized(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, Callable[[], dict]]:
    opt = fxrec.optimize(model, (x,))
    return opt, lambda: opt.fxrec_fused.grads(model)


def _compiled(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, Callable[[], dict]]:
    compiled = torch.compile(model, backend=fxrec.compile_backend("eager"), dynamic=False)
    return compiled, lambda: {n: p.grad for n, p in model.named_parameters()}


ENTRY_POINTS = {"optimize": _optimized, "compile_backend_eager": _compiled}


def _step(module: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, seed: int) -> Any:
    optim.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both, if both draw alike
    out = module(x)
    out.pow(2).mean().backward()
    return out.detach()


def _trains_like_plain(model: nn.Module, entry: str) -> None:
    """Three SGD steps: outputs, every parameter's gradient, and the parameters after each
    step equal the plain model's on fresh inputs with the same seeds."""
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, requires_grad=True)
    run, grads = ENTRY_POINTS[entry](model, x)
    o_run = torch.optim.SGD(run.parameters(), lr=0.5)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    for seed in range(3):
        x = torch.randn(8, 16, requires_grad=True)
        got, want = _step(run, o_run, x, seed), _step(ref, o_ref, x, seed)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        got_grads = grads()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got_grads[name], p.grad, rtol=TOL, atol=TOL, msg=name)
        o_run.step()
        o_ref.step()
        assert_same_state(run, ref, TOL)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_dropout_trains_like_the_plain_model(entry: str, reentrant: bool) -> None:
    _trains_like_plain(CheckpointedTowers(reentrant), entry)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_nested_checkpointed_dropout_trains_like_the_plain_model(entry: str) -> None:
    _trains_like_plain(CheckpointedTowers(False, nested=True), entry)


def test_a_region_with_dropout_draws_and_keeps_its_rng() -> None:
    """Randomness inside a region is seen through the higher-order op's body; every region
    keeps PyTorch's default (the RNG state kept), whether it draws or not (eval mode)."""
    x = torch.randn(4, 16, requires_grad=True)
    gm, _ = dynamo_graph(CheckpointedTowers(False), x)
    (region,) = checkpoint_nodes(gm.graph)
    assert is_random(region)
    assert call_checkpoint(gm) == 1 and region.target is checkpointed
    assert "preserve_rng_state" not in region.kwargs  # checkpoint's default: kept
    assert any(is_random(n) for n in gm.graph.nodes)  # still seen as drawing once rewritten

    gm, _ = dynamo_graph(CheckpointedTowers(False).eval(), x)
    (region,) = checkpoint_nodes(gm.graph)
    assert not is_random(region)
    assert call_checkpoint(gm) == 1 and region.target is checkpointed
    assert "preserve_rng_state" not in region.kwargs


def test_the_backend_knows_a_checkpointed_graph_draws() -> None:
    be = fxrec.compile_backend("eager")
    x = torch.randn(4, 16, requires_grad=True)  # (reentrant: PyTorch warns on inputs without)
    torch.compile(CheckpointedTowers(True), backend=be)(x)
    assert be.draws


class CheckpointedNorms(nn.Module):
    """Parallel LayerNorm + tanh over slices: fused outside a region, left alone inside."""

    def __init__(self, ck: bool, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.ck, self.d = ck, d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.head = nn.Linear(n * d, 1)

    def feats(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.d, 1)
        return torch.cat([torch.tanh(n(p)) for p, n in zip(parts, self.norms)], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(
            checkpoint(self.feats, x, use_reentrant=False) if self.ck else self.feats(x)
        )


def _unfused_note(report: Report) -> tuple[int, int] | None:
    for note in report.notes:
        m = re.search(r"(\d+) nodes inside (\d+) checkpointed region", note)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def test_the_report_counts_the_nodes_left_inside_checkpointed_regions() -> None:
    """A split, 4 pieces, 4 LayerNorms, 4 tanh and a cat: 14 nodes left as written."""
    x = torch.randn(8, 32)
    opt = fxrec.optimize(CheckpointedNorms(True), (x,))
    assert _unfused_note(opt.fxrec_report) == (14, 1)
    assert opt.fxrec_report.count() == 0
    torch.testing.assert_close(opt(x), opt.model(x))
    plain = fxrec.optimize(CheckpointedNorms(False), (x,))
    assert _unfused_note(plain.fxrec_report) is None and plain.fxrec_report.count() > 0


def test_note_unfused_counts_nested_regions_once() -> None:
    x = torch.randn(4, 16)
    gm, _ = dynamo_graph(CheckpointedTowers(False, nested=True), x)
    report = Report()
    # outer body: the inner region's 4 nodes, 2 towers of 4, their cat, the inner getitem
    assert note_unfused(gm, report) == 4 + 2 * 4 + 1 + 1
    assert _unfused_note(report) == (14, 1)


class _BufferedBlock(nn.Module):
    """A BatchNorm and an EMA buffer updated in place, inside a checkpointed region."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return torch.relu(self.bn(h)) + self.ema


class _Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _BufferedBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_buffer_updates_inside_a_checkpointed_region_are_kept() -> None:
    """Dead-code elimination reaches only the graph rules rewrite: ``fx.Graph``'s own also
    cleaned the region's sub-graph, erasing its in-place buffer updates, whose results
    nothing reads (``num_batches_tracked`` stayed 0, the EMA at zeros)."""
    torch.manual_seed(0)
    plain, ours = _Buffered(), _Buffered()
    ours.load_state_dict(plain.state_dict())
    runs = [
        torch.compile(plain, backend="aot_eager", dynamic=False),
        torch.compile(ours, backend=fxrec.compile_backend("aot_eager"), dynamic=False),
    ]
    for step in range(3):
        x = torch.randn(16, 8) + step
        for run in runs:
            run(x).sum().backward()
    assert int(ours.block.bn.num_batches_tracked) == int(plain.block.bn.num_batches_tracked) == 3
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=TOL, atol=TOL, msg=name)
    torch._dynamo.reset()


def _fill(method: str, *args: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A draw of ``h``'s shape by an in-place sampler: ``torch.empty_like(h).method(*args)``."""
    return lambda h: getattr(torch.empty_like(h), method)(*args)


SAMPLERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bernoulli_": _fill("bernoulli_", 0.7),
    "cauchy_": _fill("cauchy_", 0.0, 0.05),
    "log_normal_": _fill("log_normal_", 0.0, 0.25),
    "geometric_": _fill("geometric_", 0.5),
    "exponential_": _fill("exponential_"),
    "normal_": _fill("normal_"),
    "uniform_": _fill("uniform_"),
}


class SampledTowers(CheckpointedTowers):
    """Each tower scales its hidden layer by a draw of an in-place sampler; per-slice
    LayerNorm + tanh outside the region (rules fuse those: the graph runs, not the model)."""

    def __init__(self, sampler: str, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.sampler = sampler
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))
        self.head = nn.Linear(4 * len(self.towers) + 16, 1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for tower in self.towers:
            h = tower[1](tower[0](x))
            outs.append(tower[3](h * SAMPLERS[self.sampler](h)))
        return torch.cat(outs, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [torch.tanh(n(part)) for n, part in zip(self.norms, x.split(4, 1))]
        inside = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(torch.cat([*feats, inside], 1))


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_in_place_samplers_in_a_region_train_like_the_plain_model(
    sampler: str, reentrant: bool
) -> None:
    """The recomputation in backward draws what the forward drew (PyTorch keeps the RNG
    state by default): the region drawing with ``empty_like(h).bernoulli_(p)`` was taken
    for one drawing nothing, its RNG state dropped, its gradients another mask's."""
    model = SampledTowers(sampler, reentrant)
    x = torch.randn(8, 16, requires_grad=True)
    assert fxrec.optimize(model, (x,)).fxrec_report.count() > 0  # rules fire: the graph runs
    _trains_like_plain(model, "optimize")


class _Draws(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin, self.op = nn.Linear(8, 8), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.lin(x))


def _attention(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def attend(h: torch.Tensor) -> torch.Tensor:
        q = h.view(2, 2, 2, 4)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=p).reshape(h.shape)

    return attend


DRAWS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    **{name: (lambda h, s=s: h * s(h), True) for name, s in SAMPLERS.items()},
    "binomial": (lambda h: torch.binomial(h.detach().abs().round(), torch.full_like(h, 0.5)), True),
    "standard_gamma": (lambda h: torch._standard_gamma(h.detach().abs() + 1), True),
    "rrelu_": (lambda h: F.rrelu_(h * 1, training=True), True),
    "rrelu_eval": (lambda h: F.rrelu_(h * 1), False),
    "dropout_": (lambda h: torch.dropout_(h * 1, 0.3, True), True),
    "dropout_eval": (lambda h: torch.dropout_(h * 1, 0.3, False), False),
    "native_dropout": (lambda h: torch.native_dropout(h, 0.3, True)[0], True),
    "attention_dropout": (_attention(0.2), True),
    "attention": (_attention(0.0), False),
    "tanh": (torch.tanh, False),
}


@pytest.mark.parametrize("op", sorted(DRAWS))
def test_random_ops_are_seen_drawing(op: str) -> None:
    """In-place samplers, and every op PyTorch tags as drawing from the RNG; dropout told
    not to train, and attention without dropout, draw nothing."""
    fn, draws = DRAWS[op]
    gm, _ = dynamo_graph(_Draws(fn), torch.randn(4, 8))
    assert any(is_random(n) for n in gm.graph.nodes) is draws
