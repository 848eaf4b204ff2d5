"""``fxrec.optimize(..., backend=...)``: fxrec's graphs, parameters laid out once, compiled.

AOTAutograd backends lift the graph module's parameters as inputs, so they must see only
leaf parameters (flat ones and unfused originals), never the member views. Training is
checked through an optimizer: parameters only match eager's if every gradient reached the
leaf the optimizer holds.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_leaves

import fxrec
from fxrec.bench.models import ParallelTowers, RankingModel


@pytest.fixture(autouse=True)
def _counters() -> None:
    counters.clear()  # after the dynamo reset of tests/compile/conftest.py


def _ranking() -> RankingModel:
    return RankingModel(num_sparse=4, dim=8, rows=50, tasks=("a", "b"), tower_hidden=(16,))


class NormTowers(nn.Module):
    """Three towers with BatchNorm (running statistics to write back); dynamo captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
            for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:  # symbolic tracing cannot take this branch
            x = x * 1.0
        return torch.cat([t(p) for t, p in zip(self.towers, torch.split(x, 8, 1))], 1)

    def example(self, batch: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch, 24),)


def _loss(out: Any) -> torch.Tensor:
    """Weights differ per element, so a gradient routed to the wrong row shows."""
    return sum(
        (t * torch.linspace(0.5, 1.5, t.numel()).view(t.shape)).sum() for t in tree_leaves(out)
    )


def _train_like_eager(model: nn.Module, backend: str, steps: int = 2) -> fxrec.OptimizedModule:
    """Train ``model`` optimized and a copy eagerly side by side; outputs and state must agree."""
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, model.example(4), backend=backend)  # type: ignore[operator]
    sgd = torch.optim.SGD(opt.parameters(), lr=0.01)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(steps):
        args = model.example(4)  # type: ignore[operator]
        out, want = opt(*args), ref(*args)
        for a, b in zip(tree_leaves(out), tree_leaves(want)):
            torch.testing.assert_close(a, b)
        for o, loss in ((sgd, _loss(out)), (sgd_ref, _loss(want))):
            o.zero_grad()
            loss.backward()
            o.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    return opt


def test_dynamo_capture_aot_eager_trains_like_eager_without_recompiles() -> None:
    opt = _train_like_eager(_ranking(), "aot_eager", steps=3)
    assert opt.fxrec_report.capture == "dynamo"
    assert opt.fxrec_report.count("parallel_embedding") >= 1
    assert len(opt.fxrec_fused.member_ids()) > 0  # laid out once, not gathered in-graph
    assert counters["stats"]["unique_graphs"] == 1  # the check's compile is the training one


def test_running_statistics_written_back_and_eval_matches() -> None:
    model = NormTowers()
    opt = _train_like_eager(model, "aot_eager")
    assert opt.fxrec_report.count("parallel_batch_norm") == 1
    ref = copy.deepcopy(model).eval()
    opt.eval()
    (x,) = model.example(4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x))


def test_symbolic_trace_aot_eager_trains_like_eager() -> None:
    model = ParallelTowers(towers=3, d_in=8, hidden=(8, 4))
    model.example = lambda b: (torch.randn(b, 8),)  # type: ignore[method-assign]
    opt = _train_like_eager(model, "aot_eager")
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert len(opt.fxrec_fused.member_ids()) > 0


@pytest.mark.slow
def test_inductor_trains_like_eager() -> None:
    _train_like_eager(_ranking(), "inductor")


def test_bad_backend_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown inner backend 'no_such_backend'"):
        fxrec.optimize(_ranking(), backend="no_such_backend")


class SparseNorms(nn.Module):
    """KJT in (dynamo captures the zip over a split), per-feature LayerNorms on the pools."""

    def __init__(self) -> None:
        super().__init__()
        from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(f"t{i}", 10, 8, [f"f{i}"]) for i in range(3)]
        )
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(3))

    def forward(self, kjt: Any) -> torch.Tensor:
        pooled = self.ebc(kjt).values()
        return torch.cat([n(p).tanh() for p, n in zip(torch.split(pooled, 8, 1), self.norms)], 1)


def _kjt(gen: torch.Generator, batch: int = 4) -> Any:
    from fxrec.sparse import KeyedJaggedTensor

    lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
    ids = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(["f0", "f1", "f2"], ids, lengths=lengths)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_kjt_input_with_a_new_id_count_every_batch_keeps_training(backend: str) -> None:
    """Signatures key a KJT by its features: its id count changes within one capture, which
    must not run dynamo into its recompile limit (and its eager frames, on the members)."""
    gen = torch.Generator().manual_seed(0)
    model = SparseNorms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_kjt(gen),), backend=backend)
    assert opt.fxrec_report.capture == "dynamo"
    sgd_o = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    w = torch.linspace(-1, 1, 24)
    for _ in range(12):
        kjt = _kjt(gen)
        for m, sgd in ((opt, sgd_o), (ref, sgd_r)):
            sgd.zero_grad()
            (m(kjt) * w).sum().backward()
            sgd.step()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3  # static, then one symbolic recompile


class ZipNorms(nn.Module):
    """The seed pattern over ``zip(split, norms)``: dynamo captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([n(p).tanh() for p, n in zip(torch.split(x, 8, 1), self.norms)], 1)


def test_more_batch_sizes_than_cached_signatures_under_inductor() -> None:
    """A graph compiled for one batch size, called directly, must never get another."""
    from fxrec.graph.module import MAX_CACHED_SIGNATURES

    model = ZipNorms()
    opt = fxrec.optimize(model, (torch.randn(16, 32),), backend="inductor")
    assert opt.fxrec_report.capture == "dynamo"
    for b in range(2, MAX_CACHED_SIGNATURES + 4):
        x = torch.randn(b, 32)
        torch.testing.assert_close(opt(x), model(x))
    assert len(opt._runners) <= MAX_CACHED_SIGNATURES


class DroppedNorms(ZipNorms):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x))


def test_random_draws_do_not_send_an_inductor_capture_to_eager() -> None:
    """Inductor draws dropout masks differently: the check cannot compare them, and must not
    replace the compiled graphs with the model run eagerly."""
    from fxrec.graph.module import _DynamoRunner

    model = DroppedNorms().train()
    opt = fxrec.optimize(model, (torch.randn(16, 32),), backend="inductor")
    assert all(isinstance(r, _DynamoRunner) for r in opt._runners.values())
    assert any("draw random numbers" in n for n in opt.fxrec_report.notes)
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    x = torch.randn(16, 32)
    dropped = (opt(x) == 0).float().mean().item()
    assert 0.1 < dropped < 0.4  # a quarter dropped, Inductor's way
    opt.eval()
    model.eval()
    torch.testing.assert_close(opt(x), model(x))


def test_more_signatures_than_the_cache_holds_stop_recompiling() -> None:
    """Batch sizes past the cache share one symbolic capture; taking turns recompiles nothing."""
    from fxrec.graph.module import MAX_CACHED_SIGNATURES

    model = ZipNorms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 32),), backend="eager")
    sizes = range(2, MAX_CACHED_SIGNATURES + 6)
    graphs = []
    for _ in range(2):
        for b in sizes:
            x, w = torch.randn(b, 32), torch.randn(b, 32)
            out = opt(x)
            torch.testing.assert_close(out, ref(x))
            (out * w).sum().backward()
            (ref(x) * w).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]  # the second round compiled nothing
    assert any("share one capture" in n for n in opt.fxrec_report.notes)
    for name, g in opt.fxrec_fused.grads(model).items():  # gradients reached the flat tensors
        torch.testing.assert_close(g, dict(ref.named_parameters())[name].grad)
