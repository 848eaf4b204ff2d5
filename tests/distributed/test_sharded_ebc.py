"""ShardedEmbeddingBagCollection on 2 and 4 gloo ranks: outputs and gradients match the
unsharded collection on each rank's local batch (gradients summed over ranks)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import ShardingPlan, greedy_plan, shard, table_specs
from fxrec.sparse import KeyedJaggedTensor, kjt_to_tensordict
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def make_ebc(weighted: bool = False, n_tables: int = 3):
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(1234)  # every rank builds the same collection
    specs = [(11, 4, ["f0", "f1"]), (7, 8, ["f2"]), (19, 2, ["f3"]), (5, 6, ["f4"])]
    tables = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=fs)
        for i, (n, d, fs) in enumerate(specs[:n_tables])
    ]
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


def make_batch(ebc, rank: int, batch: int, weighted: bool, extra_key: bool = True):
    g = torch.Generator().manual_seed(100 + rank)
    keys, vals, lens = [], [], []
    for c in ebc.embedding_bag_configs():
        for f in c.feature_names:
            ln = torch.randint(0, 4, (batch,), generator=g)
            keys.append(f)
            lens.append(ln)
            vals.append(torch.randint(0, c.num_embeddings, (int(ln.sum()),), generator=g))
    if extra_key:  # a key no table reads: must be ignored
        keys.insert(0, "unused")
        lens.insert(0, torch.ones(batch, dtype=torch.int64))
        vals.insert(0, torch.zeros(batch, dtype=torch.int64))
    values = torch.cat(vals)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys, values, weights, lengths=torch.cat(lens))


def model_checkpoint_round_trip(sharded, state, whole) -> None:
    """Inside a model, the same keys; the model loads the unsharded model's full checkpoint
    on every rank (strict: whole row-wise tables cut, other ranks' tables skipped)."""
    model = torch.nn.ModuleDict({"sparse": sharded})
    saved = model.state_dict()
    assert set(saved) == {f"sparse.{k}" for k in state}
    for k, v in state.items():
        assert torch.equal(saved[f"sparse.{k}"], v)
    with torch.no_grad():
        for v in model.parameters():
            v.zero_()
    model.load_state_dict({f"sparse.{k}": v for k, v in whole.items()})
    for k, v in sharded.state_dict().items():
        assert torch.equal(v, state[k])
    model.load_state_dict(saved)  # this rank's own checkpoint loads too


def _check_equivalence(rank: int, world: int, weighted: bool, use_td: bool, n_tables: int) -> None:
    ebc = make_ebc(weighted, n_tables)
    sharded = shard(ebc)
    batch = 3 + rank  # uneven batches: uneven all-to-all splits
    kjt = make_batch(ebc, rank, batch, weighted, extra_key=not use_td)
    features = kjt_to_tensordict(kjt) if use_td else kjt

    ref = ebc(kjt)
    got = sharded(features)
    assert got.keys() == ref.keys()
    assert got.length_per_key() == ref.length_per_key()
    torch.testing.assert_close(got.values(), ref.values(), rtol=0, atol=1e-6)

    grad = torch.randn(ref.values().shape, generator=torch.Generator().manual_seed(7 + rank))
    (ref.values() * grad).sum().backward()
    (got.values() * grad).sum().backward()
    local = sharded.embedding_bags_local
    mine = local.table_grads() if local is not None else {}
    checked = 0
    for table, g in ebc.table_grads().items():
        g = g.clone()
        dist.all_reduce(g)  # the owner sees every rank's rows
        if table in mine:
            torch.testing.assert_close(mine[table], g, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == len(mine)  # 4 ranks, 3 tables: one rank owns none
    # state_dict: this rank's tables under the original keys, same values.
    state = sharded.state_dict()
    for k, v in state.items():
        assert torch.equal(v, ebc.state_dict()[k])
    model_checkpoint_round_trip(sharded, state, ebc.state_dict())


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matches_unsharded(world: int) -> None:
    run_ranks(world, _check_equivalence, False, False, 4 if world == 2 else 3)


def test_sharded_weighted_tensordict_input() -> None:
    run_ranks(2, _check_equivalence, True, True, 3)


def test_greedy_plan_balances_rows_times_dim() -> None:
    ebc = make_ebc(n_tables=4)
    specs = table_specs(ebc)
    plan = greedy_plan(specs, 2)
    # costs (rows x dim): t0 44, t1 56, t2 38, t3 30
    load = plan.load(specs)
    assert sum(load) == sum(t.cost for t in specs)
    assert max(load) - min(load) <= max(t.cost for t in specs)
    assert set(plan.owners) == {t.name for t in specs}
    assert greedy_plan(specs, 2) == plan  # deterministic: every rank agrees


def test_plan_validation_errors() -> None:
    specs = table_specs(make_ebc(n_tables=2))
    with pytest.raises(ValueError, match="without an owner"):
        ShardingPlan({"t0": 0}, 2).validate(specs)
    for rank in (5, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match=r"not integers in 0\.\.1"):
            ShardingPlan({"t0": 0, "t1": rank}, 2).validate(specs)  # type: ignore[dict-item]


def _missing_key(rank: int, world: int) -> None:
    ebc = make_ebc(n_tables=2)
    sharded = shard(ebc)
    kjt = KeyedJaggedTensor(["f0"], torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="missing features"):
        sharded(kjt)


def test_missing_feature_is_a_value_error() -> None:
    run_ranks(2, _missing_key)


def _torchrec_collection(rank: int, world: int) -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from fxrec.sparse import to_torchrec

    torch.manual_seed(77)  # every rank builds the same collection
    tables = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
        for i, (n, d) in enumerate([(9, 4), (6, 8), (12, 2)])
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    g = torch.Generator().manual_seed(rank)
    batch = 2 + rank
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, n, (int(ln.sum()),), generator=g)
            for n, ln in zip((9, 6, 12), lengths.view(3, batch))
        ]
    )
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths)
    want = ebc(to_torchrec(kjt)).values()
    for row_wise in ((), ("t2",)):
        sharded = shard(ebc, row_wise=row_wise)  # TorchRec's collection, sharded as fxrec's
        torch.testing.assert_close(sharded(kjt).values(), want, rtol=1e-5, atol=1e-6)
        assert set(sharded.state_dict()) <= set(ebc.state_dict())  # the same keys


@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="torchrec not installed")
def test_sharding_torchrec_collection() -> None:
    run_ranks(2, _torchrec_collection)


def _options_kept(rank: int, world: int) -> None:
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                num_embeddings=8, embedding_dim=4, name=f"t{i}", feature_names=[f"f{i}"]
            )
            for i in range(3)
        ],
        sparse=True,
        backend="torch",
    )
    sharded = shard(ebc, row_wise=["t0"])
    local = sharded.embedding_bags_local
    assert local.sparse and local.backend == "torch"
    kjt = make_batch(ebc, rank, 3, False)
    ref, got = ebc(kjt).values(), sharded(kjt).values()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert all(p.grad is None or p.grad.is_sparse for p in local.parameters())


def test_sharded_collection_keeps_sparse_gradients_and_backend() -> None:
    run_ranks(2, _options_kept)
