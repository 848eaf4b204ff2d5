"""EmbeddingBagCollection: equal to one nn.EmbeddingBag per table (outputs and gradients),
for every pooling, weighted, shared tables and features, empty bags, every input kind; one
lookup per group; per-table checkpoints; sparse gradients."""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

from fxrec.measure import count_kernels
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.nn._fbgemm import has_kernel
from fxrec.sparse import JaggedTensor, KeyedJaggedTensor, kjt_to_tensordict, validation_disabled
from tests.nn.helpers import check_against_reference, mixed_tables, random_kjt, table_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")

BACKENDS = ["torch", "auto"]  # "auto" runs fbgemm's kernel where it is installed


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["sum", "mean", "max"])
def test_matches_per_table_reference(backend: str, pooling: str) -> None:
    tables = [
        EmbeddingBagConfig("t0", 10, 4, ["a", "b"], pooling=pooling),
        EmbeddingBagConfig("t1", 7, 4, ["c"], pooling=pooling),
        EmbeddingBagConfig("t2", 5, 6, ["d", "a"], pooling=pooling),
    ]
    ebc = EmbeddingBagCollection(tables, backend=backend)
    for seed in range(3):
        kjt = random_kjt(ebc, batch=5, gen=_gen(seed), extra_keys=("unused",))
        check_against_reference(ebc, kjt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_mixed_tables_match_reference(backend: str, weighted: bool) -> None:
    tables = [t for t in mixed_tables() if not (weighted and t.pooling == "max")]
    ebc = EmbeddingBagCollection(tables, backend=backend, is_weighted=weighted)
    assert ebc.output_keys() == [
        k for k in ["a@t0", "b", "c", "d", "a@t2", "e", "f", "g"] if not (weighted and k == "f")
    ]
    for seed in range(3):
        kjt = random_kjt(ebc, batch=4, gen=_gen(seed), weighted=weighted, extra_keys=("x",))
        check_against_reference(ebc, kjt, weights_grad=weighted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_mean_is_weighted_sum_over_bag_size(backend: str) -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("t", 6, 3, ["f"], pooling="mean")], backend=backend, is_weighted=True
    )
    kjt = KeyedJaggedTensor(
        ["f"],
        torch.tensor([1, 2, 4]),
        torch.tensor([0.5, 2.0, 3.0]),
        lengths=torch.tensor([2, 0, 1]),
    )
    w = ebc.embedding_bags["t"].weight.detach()
    expected = torch.stack([(0.5 * w[1] + 2.0 * w[2]) / 2, torch.zeros(3), 3.0 * w[4]])
    torch.testing.assert_close(ebc(kjt).values(), expected)
    check_against_reference(ebc, kjt, weights_grad=True)


def test_weights_ignored_when_not_weighted() -> None:
    ebc = EmbeddingBagCollection(mixed_tables())
    kjt = random_kjt(ebc, batch=3, gen=_gen(), weighted=True)
    plain = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths())
    torch.testing.assert_close(ebc(kjt).values(), ebc(plain).values(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_all_empty_bags(backend: str) -> None:
    ebc = EmbeddingBagCollection(mixed_tables(), backend=backend)
    keys = ebc.feature_names()
    empty = KeyedJaggedTensor(
        keys, torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.long)
    )
    out = ebc(empty)
    assert out.values().shape == (0, sum(ebc.output_dims()))
    no_ids = KeyedJaggedTensor(
        keys, torch.zeros(0, dtype=torch.long), lengths=torch.zeros(3 * len(keys), dtype=torch.long)
    )
    out = ebc(no_ids).values()
    assert out.shape == (3, sum(ebc.output_dims()))
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert all(torch.count_nonzero(g) == 0 for g in table_grads(ebc).values())


def test_input_kinds_give_identical_results() -> None:
    ebc = EmbeddingBagCollection(mixed_tables(), is_weighted=False)
    kjt = random_kjt(ebc, batch=6, gen=_gen(3))
    by_kjt = ebc(kjt).values()
    by_td = ebc(kjt_to_tensordict(kjt)).values()
    by_dict = ebc(kjt.to_dict()).values()
    assert torch.equal(by_kjt, by_td)
    assert torch.equal(by_kjt, by_dict)


def test_weighted_input_kinds_give_identical_results() -> None:
    tables = [t for t in mixed_tables() if t.pooling != "max"]
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    kjt = random_kjt(ebc, batch=5, gen=_gen(4), weighted=True)
    td = kjt_to_tensordict(kjt)
    assert isinstance(td, TensorDict)
    by_kjt = ebc(kjt).values()
    assert torch.equal(by_kjt, ebc(td).values())
    assert torch.equal(by_kjt, ebc(kjt.to_dict()).values())


def test_variable_batch_input_when_read_features_agree() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 9, 4, ["a", "b"])])
    # "other" has another batch size but no table reads it.
    kjt = KeyedJaggedTensor(
        ["other", "b", "a"],
        torch.tensor([0, 1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([1, 1, 1, 1, 2, 1, 0]),
        stride_per_key=[3, 2, 2],
    )
    ref = KeyedJaggedTensor(
        ["b", "a"], torch.tensor([3, 4, 5, 6]), lengths=torch.tensor([1, 2, 1, 0])
    )
    assert torch.equal(ebc(kjt).values(), ebc(ref).values())
    jt_dict = {"a": JaggedTensor(torch.tensor([6]), lengths=torch.tensor([1, 0]))}
    jt_dict["b"] = JaggedTensor(torch.tensor([3, 4, 5]), lengths=torch.tensor([1, 2]))
    assert ebc(jt_dict).values().shape == (2, 8)


def test_one_lookup_per_group_whatever_the_number_of_tables() -> None:
    tables = [EmbeddingBagConfig(f"t{i}", 50, 16, [f"f{i}"]) for i in range(26)]
    ebc = EmbeddingBagCollection(tables, backend="torch")
    assert len(ebc.layout().groups) == 1
    kjt = random_kjt(ebc, batch=8, gen=_gen(), shuffle=False)
    counts = count_kernels(lambda: ebc(kjt))
    assert counts.forward_ops["aten::_embedding_bag"] == 1
    assert counts.backward_ops["aten::_embedding_bag_backward"] == 1
    mixed = EmbeddingBagCollection(mixed_tables(), backend="torch")
    counts = count_kernels(lambda: mixed(random_kjt(mixed, 4, _gen())), backward=False)
    # groups: (4, sum), (8, mean), (4, max)
    assert len(mixed.layout().groups) == 3
    assert counts.forward_ops["aten::_embedding_bag"] == 3


def test_group_size_cap_splits_groups_and_keeps_results() -> None:
    tables = [EmbeddingBagConfig(f"t{i}", 100, 8, [f"f{i}"]) for i in range(6)]
    capped = EmbeddingBagCollection(tables, max_group_bytes=2 * 100 * 8 * 4, backend="torch")
    assert [g.tables for g in capped.layout().groups] == [(0, 1), (2, 3), (4, 5)]
    whole = EmbeddingBagCollection(tables, max_group_bytes=None, backend="torch")
    assert len(whole.layout().groups) == 1
    whole.load_state_dict(capped.state_dict())
    kjt = random_kjt(capped, batch=5, gen=_gen())
    # Per group one lookup; the id shift and the bag starts are done once for all groups.
    ops = count_kernels(lambda: capped(kjt), backward=False).forward_ops
    assert ops["aten::_embedding_bag"] == 3
    assert ops["aten::repeat_interleave"] == 2
    assert ops["aten::add"] == 1 and ops["aten::sub"] == 1
    torch.testing.assert_close(capped(kjt).values(), whole(kjt).values())
    check_against_reference(capped, kjt)


def test_state_dict_is_per_table_and_loads_both_ways() -> None:
    ebc = EmbeddingBagCollection(mixed_tables())
    sd = ebc.state_dict()
    assert list(sd) == [f"embedding_bags.t{i}.weight" for i in range(6)]
    for c in ebc.embedding_bag_configs():
        assert sd[f"embedding_bags.{c.name}.weight"].shape == (c.num_embeddings, c.embedding_dim)
    assert [n for n, _ in ebc.named_parameters()] == [
        f"groups.{i}.weight" for i in range(len(ebc.layout().groups))
    ]
    # Into a collection grouped differently (tables in another order, other cap).
    other = EmbeddingBagCollection(mixed_tables()[::-1], max_group_bytes=64)
    result = other.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in sd.items():
        assert torch.equal(other.state_dict()[k], v)
    # And a plain dict of fresh tensors back in.
    fresh = {k: torch.randn(v.shape) for k, v in sd.items()}
    ebc.load_state_dict(fresh)
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, fresh[k])
    kjt = random_kjt(ebc, 3, _gen())
    check_against_reference(ebc, kjt)


def test_state_dict_views_follow_training_and_nesting() -> None:
    model = torch.nn.Sequential(EmbeddingBagCollection([EmbeddingBagConfig("t", 4, 2, ["f"])]))
    ebc = model[0]
    with torch.no_grad():
        ebc.groups[0].weight.add_(1.0)
    assert torch.equal(model.state_dict()["0.embedding_bags.t.weight"], ebc.groups[0].weight)


def test_load_state_dict_errors() -> None:
    ebc = EmbeddingBagCollection(mixed_tables())
    sd = dict(ebc.state_dict())
    del sd["embedding_bags.t1.weight"]
    sd["embedding_bags.t2.bias"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as info:
        ebc.load_state_dict(sd)
    assert "embedding_bags.t1.weight" in str(info.value)
    assert "embedding_bags.t2.bias" in str(info.value)
    result = ebc.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["embedding_bags.t1.weight"]
    bad = dict(ebc.state_dict())
    bad["embedding_bags.t0.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags\.t0\.weight"):
        ebc.load_state_dict(bad)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_gradients_train_like_dense(optimizer: str) -> None:
    tables = [t for t in mixed_tables() if t.pooling != "max"]
    dense = EmbeddingBagCollection(tables, backend="torch")
    sparse = EmbeddingBagCollection(tables, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    if optimizer == "sgd":
        opt_d = torch.optim.SGD(dense.parameters(), lr=0.1)
        opt_s = torch.optim.SGD(sparse.parameters(), lr=0.1)
        steps = 3
    else:
        # Adam's first step moves exactly the rows with a gradient, as SparseAdam does;
        # later steps differ by design (dense Adam keeps moving rows through momentum).
        opt_d = torch.optim.Adam(dense.parameters(), lr=0.05)
        opt_s = torch.optim.SparseAdam(list(sparse.parameters()), lr=0.05)
        steps = 1
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    for step in range(steps):
        kjt = random_kjt(dense, batch=4, gen=_gen(step))
        target = torch.randn(4, sum(dense.output_dims()), generator=_gen(100 + step))
        for model, opt in ((dense, opt_d), (sparse, opt_s)):
            opt.zero_grad(set_to_none=True)
            loss = ((model(kjt).values() - target) ** 2).sum()
            loss.backward()
            assert all(p.grad.is_sparse == (model is sparse) for p in model.parameters())
            opt.step()
    for k, v in dense.state_dict().items():
        assert not torch.equal(v, before[k])
        torch.testing.assert_close(sparse.state_dict()[k], v, atol=1e-5, rtol=1e-5)


def test_symbolic_trace_keeps_the_collection_as_one_leaf() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(mixed_tables())
            self.proj = torch.nn.Linear(sum(self.ebc.output_dims()), 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.proj(self.ebc(kjt).values())

    model = Model()
    gm = torch.fx.symbolic_trace(model)
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["ebc", "proj"]
    assert list(gm.state_dict()) == list(model.state_dict())
    kjt = random_kjt(model.ebc, 4, _gen())
    torch.testing.assert_close(gm(kjt), model(kjt))

    from fxrec.graph.capture import capture_symbolic

    gm2 = capture_symbolic(model)
    assert [n.target for n in gm2.graph.nodes if n.op == "call_module"] == ["ebc", "proj"]


def test_torch_compile_eager_backend() -> None:
    tables = [t for t in mixed_tables() if t.pooling != "max"]
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    compiled = torch.compile(ebc, backend="eager")
    for seed in range(2):
        kjt = random_kjt(ebc, 3, _gen(seed), weighted=True)
        ebc.zero_grad(set_to_none=True)
        expected = ebc(kjt).values()
        expected.sum().backward()
        grads = [p.grad.clone() for p in ebc.parameters()]
        ebc.zero_grad(set_to_none=True)
        got = compiled(kjt).values()
        got.sum().backward()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads, [p.grad for p in ebc.parameters()]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("backend", "lookup", "error", "message"),
    [
        ("eager", "auto", ValueError, "is outside table"),  # fbgemm's nodes: the host check
        ("eager", "torch", RuntimeError, "embedding id outside its table"),
        ("aot_eager", "auto", RuntimeError, "embedding id outside its table"),
    ],
)
def test_compiled_collection_checks_every_id_against_its_own_table(
    backend: str, lookup: str, error: type[Exception], message: str
) -> None:
    """Compiled, an id past its own table but inside the grouped weight still raises instead
    of reading the next table's rows: a graph running fbgemm's lookup eagerly checks the ids
    as the collection does outside dynamo; torch's lookups have a device assert."""
    if lookup == "auto" and backend == "eager" and not has_kernel("cpu"):
        pytest.skip("fbgemm's CPU lookup is not installed")
    tables = [EmbeddingBagConfig(f"t{i}", 20 - 5 * i, 4, [f"f{i}"]) for i in range(3)]
    ebc = EmbeddingBagCollection(tables, backend=lookup)  # type: ignore[arg-type]
    assert len(ebc.groups) == 1  # one grouped weight of 20 + 15 + 10 rows
    torch._dynamo.reset()
    compiled = torch.compile(ebc, backend=backend)
    lengths = torch.tensor([1, 1, 1, 1, 1, 1])
    ok = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([0, 19, 0, 14, 0, 9]), lengths=lengths)
    torch.testing.assert_close(compiled(ok).values(), ebc(ok).values())
    for pos, bad in ((3, 15), (5, 10), (0, -1)):  # past t1, past t2, negative
        ids = ok.values().clone()
        ids[pos] = bad
        kjt = KeyedJaggedTensor(ok.keys(), ids, lengths=lengths)
        with pytest.raises(error, match=message):
            compiled(kjt)
    torch._dynamo.reset()


def test_deepcopy_and_to_keep_views_on_the_group_weight() -> None:
    import copy

    ebc = EmbeddingBagCollection(mixed_tables())
    twin = copy.deepcopy(ebc)
    with torch.no_grad():
        twin.groups[0].weight.zero_()
    assert torch.count_nonzero(twin.embedding_bags["t0"].weight) == 0
    assert torch.count_nonzero(ebc.embedding_bags["t0"].weight) > 0
    doubled = ebc.to(torch.float64)
    assert doubled.embedding_bags["t0"].weight.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_narrow_integer_ids_and_lengths(backend: str, dtype: torch.dtype) -> None:
    ebc = EmbeddingBagCollection(mixed_tables(), backend=backend)
    kjt = random_kjt(ebc, 4, _gen(7))
    narrow = KeyedJaggedTensor(kjt.keys(), kjt.values().to(dtype), lengths=kjt.lengths().int())
    torch.testing.assert_close(ebc(narrow).values(), ebc(kjt).values(), rtol=0, atol=0)


def test_meta_device_allocates_nothing() -> None:
    tables = [EmbeddingBagConfig(f"t{i}", 10**9, 128, [f"f{i}"]) for i in range(4)]
    ebc = EmbeddingBagCollection(tables, device="meta")
    assert all(p.is_meta for p in ebc.parameters())
    assert {k: tuple(v.shape) for k, v in ebc.state_dict().items()} == {
        f"embedding_bags.t{i}.weight": (10**9, 128) for i in range(4)
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_per_sample_weights_of_another_float_dtype(backend: str, sparse: bool) -> None:
    """Weights are cast to the table's dtype on every path (fbgemm's lookup did; torch's
    raised), and their gradient comes back in their own dtype."""
    tables = [t for t in mixed_tables() if t.pooling != "max"]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, backend=backend, sparse=sparse)
    kjt = random_kjt(ebc, 3, _gen(2), weighted=True)
    w64 = kjt.weights().double().requires_grad_()
    as64 = KeyedJaggedTensor(kjt.keys(), kjt.values(), w64, lengths=kjt.lengths())
    out = ebc(as64).values()
    torch.testing.assert_close(out, ebc(kjt).values())
    out.sum().backward()
    assert w64.grad is not None and w64.grad.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights_pool_as_their_float32_values(
    backend: str, dtype: torch.dtype
) -> None:
    """Weighted mean divides the weights by the bag size in float32 on every path, as if
    they had been converted first (fbgemm's path divided in their own dtype: errors of 1e-4
    in outputs and 4e-3 in gradients with bfloat16)."""
    tables = [t for t in mixed_tables() if t.pooling != "max"]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, backend=backend)
    kjt = random_kjt(ebc, 16, _gen(3), weighted=True)
    low = kjt.weights().to(dtype)
    grad = None
    results = []
    for w in (low, low.float()):
        out = ebc(KeyedJaggedTensor(kjt.keys(), kjt.values(), w, lengths=kjt.lengths())).values()
        grad = torch.randn_like(out, generator=_gen(4)) if grad is None else grad
        ebc.zero_grad()
        (out * grad).sum().backward()
        results.append((out, {k: g.clone() for k, g in ebc.table_grads().items()}))
    (out_low, grads_low), (out_exact, grads_exact) = results
    torch.testing.assert_close(out_low, out_exact, rtol=0, atol=0)
    for name in grads_exact:
        torch.testing.assert_close(grads_low[name], grads_exact[name], rtol=0, atol=0, msg=name)


@pytest.mark.skipif(not has_kernel("cpu"), reason="fbgemm's CPU lookup is not installed")
@pytest.mark.parametrize(
    ("feature", "bad", "table", "rows"), [("b", 7, "t1", 7), ("c", 9, "t1", 7)]
)
def test_fbgemm_error_names_the_feature_with_validation_off(
    feature: str, bad: int, table: str, rows: int
) -> None:
    """With validation off, fbgemm's own check is the only one: its error names the feature
    and its table's rows, also for a table read by several features (whose members share
    row offsets)."""
    tables = [
        EmbeddingBagConfig("t0", 10, 4, ["a"]),
        EmbeddingBagConfig("t1", 7, 4, ["b", "c"]),
        EmbeddingBagConfig("t3", 5, 4, ["x"]),
    ]
    ebc = EmbeddingBagCollection(tables, backend="fbgemm")
    keys = ["a", "b", "c", "x"]
    ids = torch.zeros(4, dtype=torch.long)
    ids[keys.index(feature)] = bad
    expected = f"'{feature} (table {table})': id {bad} is out of range for its table of {rows} rows"
    with validation_disabled(), pytest.raises(IndexError, match=re.escape(expected)):
        ebc(KeyedJaggedTensor(keys, ids, lengths=torch.ones(4, dtype=torch.long)))


def test_meta_collection_loads_a_checkpoint_with_assign() -> None:
    """``load_state_dict(assign=True)`` into a collection built on ``meta`` (the usual way
    to load a large model) gives real weights, on the checkpoint's device."""
    source = EmbeddingBagCollection(mixed_tables())
    ebc = EmbeddingBagCollection(mixed_tables(), device="meta")
    result = ebc.load_state_dict(source.state_dict(), assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(p.device.type == "cpu" for p in ebc.parameters())
    kjt = random_kjt(source, 3, _gen(1))
    torch.testing.assert_close(ebc(kjt).values(), source(kjt).values(), rtol=0, atol=0)


def test_table_grads_are_the_group_gradient_rows() -> None:
    ebc = EmbeddingBagCollection(mixed_tables(), backend="torch")
    assert all(g is None for g in ebc.table_grads().values())
    check_against_reference(ebc, random_kjt(ebc, 3, _gen(2)))
    expected = table_grads(ebc)
    for name, grad in ebc.table_grads().items():
        assert grad is not None and torch.equal(grad, expected[name])


def test_without_fbgemm_runs_pure_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxrec.nn import _fbgemm

    monkeypatch.setattr(_fbgemm, "fbgemm_installed", lambda: False)
    monkeypatch.setattr(_fbgemm, "load_fbgemm", lambda: False)
    ebc = EmbeddingBagCollection(mixed_tables())
    assert not ebc._use_fbgemm
    check_against_reference(ebc, random_kjt(ebc, 4, _gen(9)))
    with pytest.raises(ValueError, match="needs fbgemm_gpu"):
        EmbeddingBagCollection(mixed_tables(), backend="fbgemm")


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_call_under_inference_mode_keeps_training_calls_working(backend: str) -> None:
    # constants built on the first call must not be inference tensors (autograd refuses them)
    ebc = EmbeddingBagCollection(mixed_tables(), backend=backend)
    with torch.inference_mode():
        ebc(random_kjt(ebc, batch=4, gen=_gen(0)))
    check_against_reference(ebc, random_kjt(ebc, batch=4, gen=_gen(1)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_narrow_integer_lengths_whose_sums_overflow_them(backend: str, dtype: torch.dtype) -> None:
    # offsets of 100 + 100 + ... pass 127/255 (and 32767 for int16 with more bags)
    bag = 100
    n_bags = 8 if dtype != torch.int16 else 400
    tables = [EmbeddingBagConfig("t0", 10, 4, ["a"]), EmbeddingBagConfig("t1", 10, 4, ["b"])]
    ebc = EmbeddingBagCollection(tables, backend=backend)
    lengths = torch.full((2 * n_bags,), bag, dtype=torch.long)
    ids = torch.randint(0, 10, (int(lengths.sum()),), generator=_gen(3))
    wide = KeyedJaggedTensor(["a", "b"], ids, lengths=lengths)
    narrow = KeyedJaggedTensor(["a", "b"], ids, lengths=lengths.to(dtype))
    assert narrow.offsets().tolist() == wide.offsets().tolist()
    torch.testing.assert_close(ebc(narrow).values(), ebc(wide).values())


def test_weighted_groups_compile_in_one_graph_from_jagged_tensors() -> None:
    # a dict of JaggedTensors: per-key id counts are unknown to the compiler; the ids' and
    # the weights' slices of each group must still have one size
    tables = [
        EmbeddingBagConfig("t0", 10, 4, ["a"]),
        EmbeddingBagConfig("t1", 10, 4, ["b"], pooling="mean"),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, backend="torch")
    assert len(ebc.groups) == 2
    w = torch.rand(4, requires_grad=True)
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([1, 2, 3, 4]), w, lengths=torch.tensor([1, 1, 2, 0])
    )
    torch._dynamo.reset()
    compiled = torch.compile(ebc, fullgraph=True, backend="eager")
    got, want = compiled(kjt.to_dict()).values(), ebc(kjt.to_dict()).values()
    torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(got.sum(), w)
    (r,) = torch.autograd.grad(want.sum(), w)
    torch.testing.assert_close(g, r)
    torch._dynamo.reset()
