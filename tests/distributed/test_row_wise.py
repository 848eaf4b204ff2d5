"""Row-wise sharding: ids routed to their row block, partial sums merged; on 2 and 4 gloo
ranks, outputs and gradients match the unsharded collection (up to float rounding: a bag's
sum is associated per block, then across blocks)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxrec.distributed import ShardingPlan, greedy_plan, shard, table_specs
from fxrec.distributed.plan import row_bounds
from fxrec.distributed.row_wise import RowShards, merge_row_shards, shard_name, split_rows
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor, kjt_to_tensordict
from tests.distributed.launch import run_ranks


@st.composite
def routed_batches(draw):
    world = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 5))
    n_feat = draw(st.integers(1, 3))
    rows = [draw(st.integers(world, 12)) for _ in range(n_feat)]
    rw = [draw(st.booleans()) for _ in range(n_feat)]
    lengths = [draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch)) for _ in rw]
    ids = [
        draw(st.lists(st.integers(0, r - 1), min_size=sum(ln), max_size=sum(ln)))
        for r, ln in zip(rows, lengths)
    ]
    mean = [draw(st.booleans()) for _ in rw]
    return world, batch, rows, rw, lengths, ids, mean


def _kjt(keys, lengths, ids, weighted: bool) -> KeyedJaggedTensor:
    values = torch.tensor([i for per in ids for i in per], dtype=torch.long)
    weights = torch.rand(values.numel(), dtype=torch.float64) if weighted else None
    lens = torch.tensor([n for per in lengths for n in per], dtype=torch.long)
    return KeyedJaggedTensor(keys, values, weights, lengths=lens)


def _shards(keys, rows, rw, mean, world, dim) -> RowShards:
    chosen = [i for i, r in enumerate(rw) if r]
    return RowShards(
        tuple(keys[i] for i in chosen),
        tuple(row_bounds(rows[i], world) for i in chosen),
        tuple(mean[i] for i in chosen),
        tuple(keys),
        (dim,) * len(keys),
        world,
    )


@given(routed_batches(), st.booleans())
@settings(deadline=None, max_examples=60)
def test_split_rows_routes_every_id_to_its_block_in_order(case, weighted) -> None:
    world, batch, rows, rw, lengths, ids, mean = case
    keys = [f"f{i}" for i in range(len(rows))]
    kjt = _kjt(keys, lengths, ids, weighted)
    shards = _shards(keys, rows, rw, mean, world, 2)
    out = split_rows(kjt, shards).to_dict()
    w_in = kjt.to_dict()
    for i, k in enumerate(keys):
        bags = [ids[i][sum(lengths[i][:b]) : sum(lengths[i][: b + 1])] for b in range(batch)]
        if not rw[i]:
            assert out[k].values().tolist() == ids[i]
            continue
        assert k not in out
        bounds = row_bounds(rows[i], world)
        for r in range(world):
            jt = out[shard_name(k, r)]
            lo, hi = bounds[r], bounds[r + 1]
            want = [[x - lo for x in bag if lo <= x < hi] for bag in bags]
            assert jt.lengths().tolist() == [len(b) for b in want]
            assert jt.values().tolist() == [x for b in want for x in b]
            if weighted:  # each weight still belongs to its id
                src = w_in[k]
                pairs = dict(zip(range(src.values().numel()), src.weights().tolist()))
                order = [
                    j
                    for b in range(batch)
                    for j in range(sum(lengths[i][:b]), sum(lengths[i][: b + 1]))
                    if lo <= ids[i][j] < hi
                ]
                assert jt.weights().tolist() == [pairs[j] for j in order]


@given(routed_batches(), st.booleans())
@settings(deadline=None, max_examples=60)
def test_sum_of_block_lookups_is_the_table_lookup(case, weighted) -> None:
    # split -> each block looked up with sum pooling -> merged == the unsharded lookup
    world, _, rows, rw, lengths, ids, mean = case
    dim = 3
    keys = [f"f{i}" for i in range(len(rows))]
    kjt = _kjt(keys, lengths, ids, weighted)
    shards = _shards(keys, rows, rw, mean, world, dim)
    g = torch.Generator().manual_seed(sum(rows))
    tables = [torch.randn(r, dim, generator=g, dtype=torch.float64) for r in rows]
    parts = kjt.to_dict()
    want = []
    for i, k in enumerate(keys):
        jt = parts[k]
        mode = "mean" if (mean[i] and rw[i]) else "sum"
        w = jt.weights() if weighted else None
        pooled = F.embedding_bag(
            jt.values(),
            tables[i],
            jt.offsets(),
            mode="sum",
            per_sample_weights=w,
            include_last_offset=True,
        )
        if mode == "mean":
            pooled = pooled / jt.lengths().clamp(min=1).unsqueeze(1)
        want.append(pooled)
    routed = split_rows(kjt, shards).to_dict()
    wire_keys, wire_dims = shards.wire_keys()
    cols = []
    for wk in wire_keys:
        base, _, r = wk.partition("#rw")
        i = keys.index(base)
        table = tables[i]
        if r:
            b = row_bounds(rows[i], world)
            table = table[b[int(r)] : b[int(r) + 1]]
        jt = routed[wk]
        cols.append(
            F.embedding_bag(
                jt.values(),
                table,
                jt.offsets(),
                mode="sum",
                per_sample_weights=jt.weights() if weighted else None,
                include_last_offset=True,
            )
        )
    wire = KeyedTensor(wire_keys, wire_dims, torch.cat(cols, 1))
    got = merge_row_shards(wire, kjt, shards)
    assert got.keys() == keys
    torch.testing.assert_close(got.values(), torch.cat(want, 1), rtol=1e-12, atol=1e-12)


def test_greedy_plan_splits_row_wise_tables_first() -> None:
    from tests.distributed.test_sharded_ebc import make_ebc

    specs = table_specs(make_ebc(n_tables=4))  # t0 11x4, t1 7x8, t2 19x2, t3 5x6
    plan = greedy_plan(specs, 2, row_wise=["t2"])
    assert plan.row_wise == ("t2",) and "t2" not in plan.owners
    # t2's rows split 9 + 10 (x2 columns) first; then t1 (56), t0 (44), t3 (30) greedily
    assert plan.owners == {"t1": 0, "t0": 1, "t3": 1}
    assert plan.load(specs) == [18 + 56, 20 + 44 + 30]
    plan.validate(specs)
    with pytest.raises(ValueError, match="does not have"):
        greedy_plan(specs, 2, row_wise=["nope"])
    with pytest.raises(ValueError, match="choose one"):
        ShardingPlan({"t0": 0, "t1": 1, "t2": 0, "t3": 1}, 2, ("t2",)).validate(specs)
    with pytest.raises(ValueError, match="more than once"):
        ShardingPlan({"t0": 0, "t1": 1, "t3": 1}, 2, ("t2", "t2")).validate(specs)
    with pytest.raises(ValueError, match="cannot be split"):
        row_bounds(3, 4)


# -- on gloo ranks ---------------------------------------------------------------------------


def _ebc(weighted: bool, mean_t2: bool = True):
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(4321)  # every rank builds the same collection
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                num_embeddings=11, embedding_dim=4, name="t0", feature_names=["f0", "f1"]
            ),
            EmbeddingBagConfig(num_embeddings=7, embedding_dim=8, name="t1", feature_names=["f2"]),
            EmbeddingBagConfig(
                num_embeddings=19,
                embedding_dim=2,
                name="t2",
                feature_names=["f3"],
                pooling="mean" if mean_t2 else "sum",
            ),
        ],
        is_weighted=weighted,
    )


def _row_wise_matches(rank: int, world: int, weighted: bool, use_td: bool) -> None:
    from tests.distributed.test_sharded_ebc import make_batch

    ebc = _ebc(weighted)
    sharded = shard(ebc, row_wise=["t0", "t2"])
    batch = 3 + rank  # uneven batches
    kjt = make_batch(ebc, rank, batch, weighted, extra_key=not use_td)
    ref = ebc(kjt)
    got = sharded(kjt_to_tensordict(kjt) if use_td else kjt)
    assert got.keys() == ref.keys() and got.length_per_key() == ref.length_per_key()
    torch.testing.assert_close(got.values(), ref.values(), rtol=1e-5, atol=1e-6)

    grad = torch.randn(ref.values().shape, generator=torch.Generator().manual_seed(9 + rank))
    (ref.values() * grad).sum().backward()
    (got.values() * grad).sum().backward()
    mine = sharded.embedding_bags_local.table_grads()
    full = {t: g.clone() for t, g in ebc.table_grads().items()}
    for g in full.values():
        dist.all_reduce(g)  # every rank's rows reach the holder
    for table in ("t0", "t2"):
        lo, hi = sharded.row_range(table)
        torch.testing.assert_close(
            mine[shard_name(table, rank)], full[table][lo:hi], rtol=1e-5, atol=1e-6
        )
    if "t1" in mine:
        torch.testing.assert_close(mine["t1"], full["t1"], rtol=1e-5, atol=1e-6)
    # state_dict: original keys; a row-wise table's entry is this rank's block of rows
    state = sharded.state_dict()
    whole = ebc.state_dict()
    for table in ("t0", "t2"):
        lo, hi = sharded.row_range(table)
        assert torch.equal(
            state[f"embedding_bags.{table}.weight"], whole[f"embedding_bags.{table}.weight"][lo:hi]
        )
    # loading the whole tables back takes this rank's rows
    with torch.no_grad():
        for v in sharded.embedding_bags_local.parameters():
            v.zero_()
    sharded.load_state_dict(whole)
    for k, v in sharded.state_dict().items():
        assert torch.equal(v, state[k])
    from tests.distributed.test_sharded_ebc import model_checkpoint_round_trip

    model_checkpoint_round_trip(sharded, state, whole)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_row_wise_matches_unsharded(world: int) -> None:
    run_ranks(world, _row_wise_matches, False, False)


@pytest.mark.distributed
def test_row_wise_weighted_tensordict_input() -> None:
    run_ranks(2, _row_wise_matches, True, True)


def _row_wise_errors(rank: int, world: int) -> None:
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    def ebc(rows: int, pooling: str):
        return EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(num_embeddings=rows, embedding_dim=2, name="t", pooling=pooling)
            ]
        )

    with pytest.raises(ValueError, match="max"):
        shard(ebc(8, "max"), row_wise=["t"])
    with pytest.raises(ValueError, match="cannot be split"):
        shard(ebc(1, "sum"), row_wise=["t"])
    sharded = shard(ebc(8, "sum"), row_wise=["t"])
    bad = KeyedJaggedTensor(["t"], torch.tensor([3, 8]), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"feature 't': id 8 .* outside table 't'"):
        sharded(bad)  # refused on the source rank, before any exchange


@pytest.mark.distributed
def test_row_wise_errors() -> None:
    run_ranks(2, _row_wise_errors)


def _wrong_sized_checkpoint(rank: int, world: int) -> None:
    ebc = _ebc(False)
    sharded = shard(ebc, row_wise=["t0"])
    model = torch.nn.ModuleDict({"sparse": sharded})
    before = {k: v.clone() for k, v in sharded.state_dict().items()}
    lo, hi = sharded.row_range("t0")
    whole = {f"sparse.{k}": v for k, v in ebc.state_dict().items()}
    wrong = [
        ("sparse.embedding_bags.t0.weight", (12, 4), r"torch.Size\(\[11, 4\]\) \(row-wise"),
        ("sparse.embedding_bags.t0.weight", (hi - lo + 1, 4), r"torch.Size\(\[11, 4\]\)"),
        ("sparse.embedding_bags.t1.weight", (7, 3), r"torch.Size\(\[7, 8\]\)\.$"),
    ]
    for key, shape, current in wrong:
        if key.endswith("t1.weight") and "embedding_bags.t1.weight" not in before:
            continue  # the other rank holds t1
        bad = dict(whole, **{key: torch.randn(shape)})
        for strict in (True, False):
            with torch.no_grad():
                for v in model.parameters():
                    v.zero_()
            # as the unsharded collection: a size mismatch under the checkpoint's key
            with pytest.raises(RuntimeError, match="size mismatch") as info:
                model.load_state_dict(bad, strict=strict)
            message = str(info.value)
            assert f"size mismatch for {key}: copying a param with shape {shape}" in message
            assert re.search(current, message, re.M) and "Missing key" not in message
            for k, v in sharded.state_dict().items():  # the refused table is not written
                assert torch.equal(v, torch.zeros_like(v) if key.endswith(k) else before[k])


@pytest.mark.distributed
def test_wrong_sized_checkpoint_is_a_size_mismatch() -> None:
    run_ranks(2, _wrong_sized_checkpoint)


def _compiled_matches(rank: int, world: int, row_wise: tuple[str, ...]) -> None:
    # torch.compile with fxrec's backend around a model holding a sharded collection: dynamo
    # breaks the graph at each exchange; the pieces fxrec rewrites must compute the same.
    import fxrec
    from tests.distributed.test_overlap_pass import check_steps, tiny_sharded_dlrm

    ebc, model = tiny_sharded_dlrm(row_wise)
    compiled = torch.compile(model, backend=fxrec.compile_backend("aot_eager"))

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    check_steps(model, compiled, ebc, rank, close)


@pytest.mark.distributed
def test_sharded_model_under_torch_compile_with_fxrec_backend() -> None:
    # t1 and t3 stay table-wise: both kinds in one model
    run_ranks(2, _compiled_matches, ("t0", "t2"), deadline=120.0)
