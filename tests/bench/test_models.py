"""The benchmark's reference models build, run forward and backward, and look like users' models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from fxrec.bench import models
from fxrec.graph.capture import CaptureError, capture_symbolic


def _train_step(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    out = model(*inputs)
    loss = sum(t.float().sum() for t in tree_leaves(out))
    loss.backward()
    return [t for t in tree_leaves(out)]


@pytest.mark.parametrize(
    "build",
    [
        lambda: models.SeedPattern(16),
        lambda: models.ParallelTowers(),
        lambda: models.ParallelTowers(shared=False),
        lambda: models.MultiGateMoE(),
        lambda: models.RankingModel(num_sparse=104, rows=50),
        lambda: models.RankingModel(num_sparse=12, rows=50, interaction="dot"),
        lambda: models.synthetic_for_nodes(200),
    ],
    ids=["seed", "towers", "towers-own-inputs", "mmoe", "ranking", "ranking-dot", "synthetic"],
)
def test_models_run_forward_and_backward(build) -> None:
    model = build()
    x = models.make_inputs(model, 8)
    outs = _train_step(model, x)
    assert all(o.shape[0] == 8 and torch.isfinite(o).all() for o in outs)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    # Fresh inputs every call.
    y = models.make_inputs(model, 8)
    assert any(not torch.equal(a, b) for a, b in zip(tree_leaves(x), tree_leaves(y)))


def test_seed_pattern_matches_its_definition() -> None:
    m = models.SeedPattern(5, d=4)
    (x,) = models.make_inputs(m, 3)
    want = torch.cat([torch.tanh(norm(p)) for p, norm in zip(x.split(4, 1), m.norms)], 1)
    torch.testing.assert_close(m(x), want)
    # Written as users write it: symbolic tracing cannot iterate over torch.split.
    with pytest.raises(CaptureError):
        capture_symbolic(m)


def test_ranking_model_is_production_like() -> None:
    m = models.RankingModel(rows=20)
    assert len(m.embeddings) >= 100 and isinstance(m.embeddings, nn.ModuleDict)
    assert all(isinstance(e, nn.EmbeddingBag) for e in m.embeddings.values())
    dense, sparse = models.make_inputs(m, 4)
    assert set(sparse) == set(m.feature_names)
    assert all(v.dtype == torch.int32 for v in sparse.values())  # cast with .long() inside
    out = m(dense, sparse)
    assert set(out) == {"click", "like", "share", "watch_time"}
    with pytest.raises(ValueError, match="dense features"):
        m(dense[0], sparse)


def test_ranking_rejects_unknown_interaction() -> None:
    with pytest.raises(ValueError, match="interaction"):
        models.RankingModel(num_sparse=2, interaction="mlp")


@pytest.mark.parametrize("nodes", [500, 2000])
def test_synthetic_graph_has_about_the_requested_nodes(nodes: int) -> None:
    gm = capture_symbolic(models.synthetic_for_nodes(nodes))
    assert abs(len(gm.graph.nodes) - nodes) <= 0.05 * nodes


def test_make_inputs_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch"):
        models.make_inputs(models.SeedPattern(2), 0)
    with pytest.raises(ValueError, match="not a benchmark model"):
        models.make_inputs(nn.Linear(2, 2), 4)
    with pytest.raises(ValueError, match="at least 20"):
        models.synthetic_for_nodes(5)
