"""Parallel MLP towers and a multi-gate mixture of experts, fused layer by layer.

Chained atomic rules (Linear, LayerNorm, ReLU, split/cat) fuse N towers into a forward
whose kernel count does not depend on N; every rewrite keeps outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxrec
from tests.passes.test_linear import check_equivalent, fired


def _tower(d: int, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU()]
    return nn.Sequential(*layers)


class Towers(nn.Module):
    """N towers of (Linear, LayerNorm, ReLU) x 3, on one input or on one input each."""

    def __init__(self, n: int, d: int = 8, separate: bool = False) -> None:
        super().__init__()
        self.separate = separate
        self.towers = nn.ModuleList(_tower(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.separate:  # x: (B, N, d), one slice per tower
            xs = torch.unbind(x, 1)
            return torch.cat([t(xs[i]) for i, t in enumerate(self.towers)], 1)
        return torch.cat([t(x) for t in self.towers], 1)


class MMoE(nn.Module):
    """Multi-gate mixture of experts with 2 tasks (Ma et al. 2018)."""

    def __init__(self, experts: int = 4, tasks: int = 2, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
            for _ in range(experts)
        )
        self.gates = nn.ModuleList(nn.Linear(d, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1)) for _ in range(tasks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.stack([ex(x) for ex in self.experts], 1)  # (B, E, h)
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = F.softmax(gate(x), dim=1).unsqueeze(2)
            outs.append(torch.sigmoid(tower((e * w).sum(1))))
        return torch.cat(outs, 1)


def _counts(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    k = fxrec.count_kernels(model, x)
    return k.forward, k.backward


@pytest.mark.parametrize("separate", [False, True])
def test_towers_kernel_count_independent_of_n(separate: bool) -> None:
    counts = {}
    for n in (4, 8):
        shape = (n, 8) if separate else (8,)
        opt = check_equivalent(
            lambda n=n: Towers(n, separate=separate),
            lambda b, shape=shape: (torch.randn(b, *shape),),
            steps=2,
        )
        x = torch.randn(4, *shape)
        counts[n] = _counts(opt, x)
        eager = _counts(Towers(n, separate=separate), x)
        assert counts[n][0] < eager[0] and counts[n][1] < eager[1]
        assert fired(opt, "parallel_linear_batched") == (3 if separate else 2)
    assert counts[4] == counts[8]
    # per layer: one matmul, layer_norm + addcmul, relu; then one cat: the towers' results
    # are rows of one contiguous (N, B, d) tensor, joined along the feature dim
    assert counts[8][0] == 13


def test_eight_towers_forward_ops() -> None:
    opt = check_equivalent(lambda: Towers(8), lambda b: (torch.randn(b, 8),), steps=1)
    x = torch.randn(4, 8)
    ops = fxrec.count_kernels(opt, x).forward_ops
    assert ops == {
        "aten::addmm": 1,
        "aten::baddbmm": 2,
        "aten::native_layer_norm": 3,
        "aten::addcmul": 3,
        "aten::relu": 3,
        "aten::cat": 1,  # the towers' (N, B, d) rows joined along the feature dim
    }


def test_mmoe_two_tasks() -> None:
    counts = {}
    for experts in (4, 8):
        opt = check_equivalent(
            lambda e=experts: MMoE(experts=e), lambda b: (torch.randn(b, 8),), steps=2
        )
        counts[experts] = _counts(opt, torch.randn(4, 8))
        assert fired(opt, "parallel_linear_same_input") >= 1  # experts and gates: one Linear
        assert fired(opt, "parallel_linear_batched") >= 2  # expert layer 2, the 2 task towers
    assert counts[4] == counts[8]
    # one Linear for experts + gates; expert layer 2 and the two task layers as baddbmm;
    # 3 relus; 2 x (softmax, mul, sum); the stack of the 2 mixtures; one sigmoid; the cat of
    # the two task outputs (rows of one (2, B, 1) tensor)
    assert counts[8][0] == 16
    ops = fxrec.count_kernels(opt, torch.randn(4, 8)).forward_ops
    assert ops == {
        "aten::addmm": 1,
        "aten::baddbmm": 3,
        "aten::relu": 3,
        "aten::_softmax": 2,
        "aten::mul": 2,
        "aten::sum": 2,
        "aten::stack": 1,
        "aten::sigmoid": 1,
        "aten::cat": 1,
    }
    assert counts[8][0] < _counts(MMoE(experts=8), torch.randn(4, 8))[0]


# -- property: random graphs of linears, lookups and casts -------------------------------------
class RandomNet(nn.Module):
    """Parallel branches drawn by hypothesis: lookups (with casts) and Linear chains."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = spec
        d = spec["d"]
        self.tables = nn.ModuleList(nn.Embedding(7 + i, d) for i in range(spec["lookups"]))
        self.chains = nn.ModuleList(
            nn.Sequential(
                *[
                    nn.Linear(d, d, bias=spec["bias"][i % len(spec["bias"])])
                    for _ in range(spec["depth"][i])
                ]
            )
            for i in range(len(spec["depth"]))
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cols = torch.unbind(ids, 1)
        feats = [t(cols[i % len(cols)].long()) for i, t in enumerate(self.tables)]
        if self.spec["dup"] and self.tables:
            feats.append(self.tables[0](cols[0].long()))  # a repeated lookup
        d = self.spec["d"]
        if self.spec["pieces"]:  # pieces of one tensor
            inputs = list(torch.split(x, d, 1))
        elif self.spec["shared"]:  # one input for every chain
            inputs = [x[:, :d]] * len(self.chains)
        else:  # separate tensors of one shape
            inputs = [torch.tanh(x[:, :d]) + i for i in range(len(self.chains))]
        outs = []
        for i, c in enumerate(self.chains):
            h = c(inputs[i])
            outs.append(torch.relu(h) if self.spec["act"] else h)
        return torch.cat(feats + outs, 1)


@settings(max_examples=30)
@given(
    lookups=st.integers(0, 4),
    depth=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    bias=st.lists(st.booleans(), min_size=1, max_size=3),
    pieces=st.booleans(),
    shared=st.booleans(),
    act=st.booleans(),
    dup=st.booleans(),
    keep=st.booleans(),
)
def test_random_graphs_keep_outputs_and_gradients(
    lookups: int,
    depth: list[int],
    bias: list[bool],
    pieces: bool,
    shared: bool,
    act: bool,
    dup: bool,
    keep: bool,
) -> None:
    d = 4
    spec = {
        "d": d,
        "lookups": lookups,
        "depth": depth,
        "bias": bias,
        "pieces": pieces,
        "shared": shared,
        "act": act,
        "dup": dup,
    }
    n_in = len(depth) * d

    def make() -> nn.Module:
        torch.manual_seed(1)
        return RandomNet(spec)

    def inputs(b: int) -> tuple:
        return torch.randn(b, n_in), torch.randint(0, 7, (b, 2), dtype=torch.int32)

    check_equivalent(make, inputs, batches=(3, 5), steps=2, keep_params=keep)
