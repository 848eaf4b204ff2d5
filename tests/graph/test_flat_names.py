"""Flat tensors are named after what their members' names share, so code that picks
parameters by name (no weight decay on biases and norms, embeddings to a sparse optimizer)
picks the flat tensor as it picked its members.

The idioms run on the optimized module and on a plain copy of the model made before
``fxrec.optimize``; parameters are compared after a few steps on fresh random inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.graph.params import flat_name
from tests.graph.test_flat_params import N, Towers, _same_state


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class Ranker(nn.Module):
    """Parallel tables (one flat table once fused) and parallel towers (flat weights, biases
    and LayerNorm affines)."""

    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(40, 8, mode="sum") for _ in range(N))
        self.towers = nn.ModuleList(Tower() for _ in range(N))
        self.head = nn.Linear(N * 8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = [e(ids[:, i : i + 2]) for i, e in enumerate(self.embs)]
        return self.head(torch.cat([t(p) for t, p in zip(self.towers, pooled)], 1))


def _ids() -> torch.Tensor:
    return torch.randint(0, 40, (16, 2 * N))


def _no_decay_groups(module: nn.Module) -> list[dict]:
    named = list(module.named_parameters())
    plain = [p for n, p in named if n.endswith("bias") or "norm" in n]
    chosen = {id(p) for p in plain}
    return [
        {"params": [p for _, p in named if id(p) not in chosen], "weight_decay": 0.1},
        {"params": plain, "weight_decay": 0.0},
    ]


def _trained(module: nn.Module, optims: list[torch.optim.Optimizer], seed: int) -> None:
    torch.manual_seed(seed)
    for _ in range(3):
        for o in optims:
            o.zero_grad()
        module(_ids()).pow(2).mean().backward()
        for o in optims:
            o.step()


def _pair() -> tuple[fxrec.OptimizedModule, Ranker]:
    torch.manual_seed(0)
    model = Ranker()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_ids(),))
    assert opt.fxrec_fused.member_ids()
    return opt, ref


def test_no_weight_decay_on_biases_and_norms_picked_by_name_trains_like_the_model() -> None:
    opt, ref = _pair()
    names = [n for n, _ in opt.named_parameters()]
    assert "fxrec_fused.towers_x_norm_weight" in names, names
    assert "fxrec_fused.towers_x_lin_bias" in names, names
    _trained(opt, [torch.optim.AdamW(_no_decay_groups(opt), lr=0.05)], seed=1)
    _trained(ref, [torch.optim.AdamW(_no_decay_groups(ref), lr=0.05)], seed=1)
    _same_state(opt, ref)


def test_tables_picked_by_name_go_to_their_own_optimizer() -> None:
    opt, ref = _pair()

    def split(module: nn.Module) -> list[torch.optim.Optimizer]:
        named = list(module.named_parameters())
        tables = [p for n, p in named if "emb" in n]
        dense = [p for n, p in named if "emb" not in n]
        return [torch.optim.Adagrad(tables, lr=0.1), torch.optim.Adam(dense, lr=0.01)]

    assert any(n.startswith("fxrec_fused.emb") for n, _ in opt.named_parameters())
    _trained(opt, split(opt), seed=2)
    _trained(ref, split(ref), seed=2)
    _same_state(opt, ref)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_flat_names_keep_the_members_last_word(untraceable: bool) -> None:
    torch.manual_seed(0)
    opt = fxrec.optimize(Towers(untraceable), (torch.randn(8, N * 8),))
    flats = [n for n, _ in opt.named_parameters() if n.startswith("fxrec_fused.")]
    assert flats and all(n.endswith(("weight", "bias")) for n in flats), flats
    assert len(set(flats)) == len(flats)


class TwoStages(nn.Module):
    """Two sets of parallel Linears in one ModuleList: two flats share a name's words."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2 * N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = [torch.relu(self.layers[i](x)) for i in range(N)]
        return torch.cat([self.layers[N + i](h) for i, h in enumerate(hs)], 1)


@pytest.mark.parametrize("make", ["two_stages", "nested"])
def test_flats_sharing_words_and_flats_laid_out_in_others_end_as_their_members(
    make: str,
) -> None:
    """A count that tells two flats apart goes before the last word, and a flat laid out in
    another names the outer one after the model's parameters: both still end in ``bias``
    where their members do, so the no-decay idiom picks them."""
    from tests.graph.test_nested_layouts import TaskExperts

    torch.manual_seed(0)
    model = TwoStages() if make == "two_stages" else TaskExperts()
    x = torch.randn(16, 8 if make == "two_stages" else 16)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (x,))
    flats = [n for n, _ in opt.named_parameters() if n.startswith("fxrec_fused.")]
    assert len(flats) >= 4 and all(n.endswith(("weight", "bias")) for n in flats), flats
    for module in (opt, ref):
        o = torch.optim.AdamW(_no_decay_groups(module), lr=0.05)
        torch.manual_seed(3)
        for _ in range(3):
            o.zero_grad()
            module(torch.randn_like(x)).pow(2).mean().backward()
            o.step()
    _same_state(opt, ref)


def test_flat_name_of_members() -> None:
    assert flat_name(["towers.0.2.bias", "towers.1.2.bias"]) == "towers_x_2_bias"
    assert flat_name(["towers.10.bias", "towers.0.bias"]) == "towers_x_bias"
    assert flat_name(["emb_user.weight", "emb_item.weight"]) == "emb_x_weight"
    assert flat_name(["fxrec_fused.towers_x_bias", "head.bias"]) == "x_bias"
    assert flat_name(["a.weight", "b.bias"]) is None
    assert flat_name(["0.weight", "1.weight"]) == "x_weight"
    assert flat_name(["7.weight", "7.weight"]) == "p_7_weight"


@given(st.lists(st.from_regex(r"[a-z0-9_.]{1,12}", fullmatch=True), min_size=1, max_size=5))
def test_flat_names_are_attribute_names(names: list[str]) -> None:
    name = flat_name(names)
    assert name is None or (name.isidentifier() and "." not in name)
