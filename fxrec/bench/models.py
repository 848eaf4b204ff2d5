"""Reference models for the benchmark, written the way users write them.

These are deliberately *not* fxrec-friendly: per-feature modules in ``ModuleDict``s looked up
by feature name, loops over ``zip(torch.split(...), modules)``, shape checks, per-feature id
casts. That is what public ranking models look like, and what ``fxrec.optimize`` has to
capture and speed up without touching the model's code. Each model comes with a function
making fresh random inputs for a batch size (:func:`make_inputs`).

* :class:`SeedPattern`: split -> N x LayerNorm -> N x tanh -> cat (seed 001, Fig. 3).
* :class:`ParallelTowers`: 8 MLP towers (Linear-LayerNorm-ReLU x 3), on one shared input or
  on separate same-shaped inputs (seed 001, Case 2).
* :class:`MultiGateMoE`: a multi-gate mixture of experts with 2 tasks.
* :class:`RankingModel`: 100+ sparse features with per-feature ``nn.EmbeddingBag``, LayerNorm
  and tanh, a dense arch, an interaction (concat or pairwise dot) and several task towers.
* :class:`SyntheticGraph`: many parallel chains of norms, activations, linears, splits and cats,
  sized to a requested node count, for measuring how pass time scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import nn

__all__ = [
    "SeedPattern",
    "ParallelTowers",
    "MultiGateMoE",
    "RankingModel",
    "SyntheticGraph",
    "make_inputs",
    "synthetic_for_nodes",
]


class SeedPattern(nn.Module):
    """``cat([tanh(norm_i(x_i)) for x_i in split(x)])``: 2N+3 kernels forward when run eagerly."""

    def __init__(self, n: int, d: int = 16) -> None:
        super().__init__()
        self.d = d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for part, norm in zip(torch.split(x, self.d, 1), self.norms):
            outs.append(torch.tanh(norm(part)))
        return torch.cat(outs, 1)

    def example(self, batch: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch, self.d * len(self.norms)),)


def _block(d_in: int, d_out: int) -> list[nn.Module]:
    return [nn.Linear(d_in, d_out), nn.LayerNorm(d_out), nn.ReLU()]


class ParallelTowers(nn.Module):
    """N MLP towers (Linear-LayerNorm-ReLU x 3); one shared input or one input per tower."""

    def __init__(
        self,
        towers: int = 8,
        d_in: int = 64,
        hidden: Sequence[int] = (64, 64, 32),
        shared: bool = True,
    ) -> None:
        super().__init__()
        self.shared = shared
        self.d_in = d_in
        dims = [d_in, *hidden]
        self.towers = nn.ModuleList(
            nn.Sequential(*[m for a, b in pairwise(dims) for m in _block(a, b)])
            for _ in range(towers)
        )

    def forward(self, x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        if self.shared:
            outs = [tower(x) for tower in self.towers]
        else:
            if len(x) != len(self.towers):
                raise ValueError(f"expected {len(self.towers)} inputs, got {len(x)}")
            outs = [tower(xi) for tower, xi in zip(self.towers, x)]
        return torch.stack(outs, 1)

    def example(self, batch: int) -> tuple[Any]:
        if self.shared:
            return (torch.randn(batch, self.d_in),)
        return ([torch.randn(batch, self.d_in) for _ in self.towers],)


class MultiGateMoE(nn.Module):
    """MMoE: shared experts, one softmax gate and one tower per task."""

    def __init__(
        self,
        d_in: int = 64,
        experts: int = 8,
        d_expert: int = 32,
        tasks: int = 2,
        d_tower: int = 16,
    ) -> None:
        super().__init__()
        self.d_in = d_in
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_in, 64), nn.ReLU(), nn.Linear(64, d_expert), nn.ReLU())
            for _ in range(experts)
        )
        self.gates = nn.ModuleList(nn.Linear(d_in, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d_expert, d_tower), nn.ReLU(), nn.Linear(d_tower, 1))
            for _ in range(tasks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_out = torch.stack([e(x) for e in self.experts], 1)  # (B, E, D)
        preds = []
        for gate, tower in zip(self.gates, self.towers):
            w = torch.softmax(gate(x), dim=-1).unsqueeze(-1)  # (B, E, 1)
            preds.append(torch.sigmoid(tower((w * expert_out).sum(1))))
        return torch.cat(preds, 1)

    def example(self, batch: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch, self.d_in),)


class RankingModel(nn.Module):
    """A production-like multi-task ranking model.

    Per sparse feature: ids cast with ``.long()``, an ``nn.EmbeddingBag`` from a ``ModuleDict``
    looked up by feature name, then LayerNorm and tanh. A dense arch (MLP) embeds the dense
    features; an interaction ("cat": concatenation, "dot": DLRM's pairwise dot products)
    combines everything; each task has its own MLP tower on the interaction output.
    """

    def __init__(
        self,
        num_sparse: int = 104,
        num_dense: int = 13,
        dim: int = 16,
        rows: int = 1000,
        tasks: Sequence[str] = ("click", "like", "share", "watch_time"),
        interaction: str = "cat",
        bag_sizes: Sequence[int] = (1, 1, 1, 2, 4),
        tower_hidden: Sequence[int] = (128, 64),
    ) -> None:
        super().__init__()
        if interaction not in ("cat", "dot"):
            raise ValueError(f"interaction must be 'cat' or 'dot', not {interaction!r}")
        self.interaction = interaction
        self.num_dense = num_dense
        self.rows = rows
        self.feature_names = [f"f{i:03d}" for i in range(num_sparse)]
        # Bag sizes vary by feature (single-id and multi-hot features), fixed per feature.
        self.bag_size = {n: bag_sizes[i % len(bag_sizes)] for i, n in enumerate(self.feature_names)}
        self.embeddings = nn.ModuleDict(
            {n: nn.EmbeddingBag(rows, dim, mode="sum") for n in self.feature_names}
        )
        self.norms = nn.ModuleDict({n: nn.LayerNorm(dim) for n in self.feature_names})
        self.dense_arch = nn.Sequential(
            nn.Linear(num_dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU()
        )
        n_vec = num_sparse + 1
        d_inter = n_vec * dim if interaction == "cat" else dim + n_vec * (n_vec - 1) // 2
        self.register_buffer("_tri", torch.triu_indices(n_vec, n_vec, offset=1), persistent=False)
        dims = [d_inter, *tower_hidden]
        self.towers = nn.ModuleDict(
            {
                t: nn.Sequential(
                    *[m for a, b in pairwise(dims) for m in (nn.Linear(a, b), nn.ReLU())],
                    nn.Linear(dims[-1], 1),
                )
                for t in tasks
            }
        )

    def forward(
        self, dense: torch.Tensor, sparse: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if dense.dim() != 2:
            raise ValueError(
                f"dense features must be (batch, {self.num_dense}), got {tuple(dense.shape)}"
            )
        d = self.dense_arch(dense)
        pooled = [d]
        for name in self.feature_names:
            ids = sparse[name].long()
            pooled.append(torch.tanh(self.norms[name](self.embeddings[name](ids))))
        if self.interaction == "cat":
            z = torch.cat(pooled, 1)
        else:
            t = torch.stack(pooled, 1)  # (B, F+1, D)
            inter = torch.bmm(t, t.transpose(1, 2))
            z = torch.cat([d, inter[:, self._tri[0], self._tri[1]]], 1)
        return {task: tower(z) for task, tower in self.towers.items()}

    def example(self, batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dense = torch.randn(batch, self.num_dense)
        sparse = {
            n: torch.randint(0, self.rows, (batch, self.bag_size[n]), dtype=torch.int32)
            for n in self.feature_names
        }
        return dense, sparse


class SyntheticGraph(nn.Module):
    """``chains`` parallel chains over pieces of one input, ``depth`` blocks deep each.

    A block is LayerNorm -> tanh -> Linear -> relu -> split in halves -> cat (halves swapped):
    every op kind a rule family handles, repeated across chains, so each bucket of the search
    holds ``chains`` candidates. Written to be symbolically traceable (indexing, not
    iteration), so capture cost stays out of the pass-time figure. About
    ``chains * (1 + 8 * depth)`` nodes.
    """

    def __init__(self, chains: int, depth: int = 2, d: int = 8) -> None:
        super().__init__()
        self.chains, self.depth, self.d = chains, depth, d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(chains * depth))
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(chains * depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.d, 1)
        outs = []
        half = self.d // 2
        for c in range(self.chains):
            h = parts[c]
            for k in range(self.depth):
                i = c * self.depth + k
                h = torch.relu(self.linears[i](torch.tanh(self.norms[i](h))))
                halves = torch.split(h, half, 1)
                h = torch.cat([halves[1], halves[0]], 1)
            outs.append(h)
        return torch.cat(outs, 1)

    def example(self, batch: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch, self.chains * self.d),)


def synthetic_for_nodes(nodes: int, depth: int = 2) -> SyntheticGraph:
    """A :class:`SyntheticGraph` with about ``nodes`` graph nodes."""
    if nodes < 20:
        raise ValueError(f"a synthetic graph needs at least 20 nodes, got {nodes}")
    return SyntheticGraph(chains=max(1, round(nodes / (1 + 8 * depth))), depth=depth)


def make_inputs(
    model: nn.Module, batch: int, device: str | torch.device = "cpu"
) -> tuple[Any, ...]:
    """Fresh random inputs for ``model`` (one of this module's models) at ``batch``, on ``device``."""
    example = getattr(model, "example", None)
    if example is None:
        raise ValueError(f"{type(model).__name__} is not a benchmark model (no example())")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example(batch))
