"""DistributedDataParallel over an optimized module: the flat parameters are all-reduced,
the members they hold are left alone, and training matches DDP over the original model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxrec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

D = 8


class Towers(nn.Module):
    """Per-slice LayerNorms (laid out in one flat parameter) and a Linear tower."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(4))
        self.head = nn.Linear(4 * D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, D, 1)
        return self.head(torch.cat([n(p).tanh() for n, p in zip(self.norms, parts)], 1))


class Heads(nn.Module):
    """Single-output heads on their own slices: one batched Linear over an (N, 1, in) flat
    weight, whose gradient comes back through a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, D, 1)
        return torch.cat([h(p.relu()) for h, p in zip(self.heads, parts)], 1)


def _same_training(
    rank: int, world: int, build: type[nn.Module], rule: str, members: set[str]
) -> None:
    torch.manual_seed(0)  # the same model on every rank
    model = build()
    ref = copy.deepcopy(model)
    torch.manual_seed(100 + rank)  # each rank its own data
    xs = [torch.randn(8, 4 * D) for _ in range(3)]
    opt = fxrec.optimize(model, (xs[0],))
    assert opt.fxrec_report.count(rule) == 1
    runs = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for module in (ref, opt):
            ddp = DDP(module)  # find_unused_parameters=False: every synced parameter gets a grad
            sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for x in xs:
                sgd.zero_grad()
                ddp(x).pow(2).mean().backward()
                sgd.step()
            runs.append(ddp)
    assert not [w for w in seen if "strides" in str(w.message)]  # gradients fit DDP's buckets
    assert set(runs[1].parameters_to_ignore) == {f"model.{m}" for m in members}
    want = ref.state_dict()
    for k, v in opt.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)


_NORMS = {f"norms.{i}.{w}" for i in range(4) for w in ("weight", "bias")}
_HEADS = {f"heads.{i}.{w}" for i in range(4) for w in ("weight", "bias")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "build, rule, members",
    [(Towers, "parallel_layer_norm", _NORMS), (Heads, "parallel_linear_batched", _HEADS)],
    ids=["norms", "heads"],
)
def test_ddp_over_an_optimized_module_trains_like_ddp_over_the_model(
    build: type[nn.Module], rule: str, members: set[str]
) -> None:
    run_ranks(2, _same_training, build, rule, members, timeout=30.0, deadline=100.0)


class ShardedRanker(nn.Module):
    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 4)
        self.sparse = sparse
        self.over = nn.Linear(12, 1)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return self.over(torch.cat([self.dense(dense), self.sparse(features).values()], 1))


def _tables_stay_each_ranks_own(rank: int, world: int, wrap: str) -> None:
    """Two tables of one shape on two ranks: DDP must neither broadcast rank 0's table over
    rank 1's nor average their gradients; the dense part is synced as usual."""
    import torch.distributed as dist

    from fxrec.distributed import ignore_sharded_in_ddp, shard
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
    from fxrec.sparse import KeyedJaggedTensor

    def build() -> nn.Module:
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                num_embeddings=10, embedding_dim=4, name=f"t{i}", feature_names=[f"f{i}"]
            )
            for i in range(2)
        ]
        return ShardedRanker(shard(EmbeddingBagCollection(tables=tables)))

    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(3):
        lengths = torch.randint(0, 3, (8,), generator=g)
        ids = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths)
        batches.append((torch.randn(4, 6, generator=g), kjt))
    ref = build()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for dense, kjt in batches:  # by hand: dense gradients averaged, tables' left alone
        sgd.zero_grad()
        ref(dense, kjt).pow(2).mean().backward()
        for p in (*ref.dense.parameters(), *ref.over.parameters()):
            dist.all_reduce(p.grad)
            p.grad /= world
        sgd.step()
    model = build()
    tables = {k: v.clone() for k, v in model.sparse.state_dict().items()}
    if wrap == "model":
        ddp = DDP(ignore_sharded_in_ddp(model))
    else:
        ddp = DDP(fxrec.optimize(model, batches[0]))
    for k, v in model.sparse.state_dict().items():
        assert torch.equal(v, tables[k]), k  # not overwritten by rank 0's
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for dense, kjt in batches:
        sgd.zero_grad()
        ddp(dense, kjt).pow(2).mean().backward()
        sgd.step()
    want = ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrap", ["model", "optimized"])
def test_ddp_leaves_sharded_tables_to_their_ranks(wrap: str) -> None:
    run_ranks(2, _tables_stay_each_ranks_own, wrap, timeout=30.0, deadline=100.0)
