"""combine_inputs: the rewritten model computes the same outputs and gradients from ONE
CombinedFeatures, its graph starts with one permute_and_split, and the packer round-trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

import fxrec
from fxrec.passes.combine_inputs import combine_inputs
from fxrec.sparse import CombinedFeatures, JaggedTensor, KeyedJaggedTensor, kjt_to_tensordict
from fxrec.train import transfer_count
from tests.sparse.helpers import RefFeatures, ref_features, separate_buffers
from tests.train.helpers import NUM_EMB, TinyRanker, make_kjt

PS = torch.ops.fxrec.permute_and_split.default


def n_split_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is PS)


def first_compute_node(gm):
    skip = {"placeholder", "get_attr"}
    return next(
        n
        for n in gm.graph.nodes
        if n.op not in skip and not (n.op == "call_function" and n.target is getattr)
    )


class PerFeatureTensors(nn.Module):
    """forward(dense, ids_0, len_0[, w_0], ids_1, ...): the layout the pass exists for."""

    def __init__(self, weighted: list[bool]) -> None:
        super().__init__()
        self.weighted = weighted
        self.bags = nn.ModuleList(nn.EmbeddingBag(NUM_EMB, 3, mode="sum") for _ in weighted)
        self.over = nn.Linear(2 + 3 * len(weighted), 1)

    def forward(self, dense, *sparse):
        parts, i = [dense], 0
        for f, w in enumerate(self.weighted):
            ids, lens = sparse[i], sparse[i + 1]
            psw = sparse[i + 2] if w else None
            i += 3 if w else 2
            offsets = torch.cumsum(lens, 0) - lens
            parts.append(self.bags[f](ids, offsets, per_sample_weights=psw))
        return self.over(torch.cat(parts, 1))


def make_args(weighted, batch, g):
    args = [torch.randn(batch, 2, generator=g)]
    names = {}
    for f, w in enumerate(weighted):
        lens = torch.randint(0, 4, (batch,), generator=g)
        ids = torch.randint(0, NUM_EMB, (int(lens.sum()),), generator=g)
        base = len(args)
        args += [ids, lens]
        names[f"f{f}"] = [base, base + 1]
        if w:
            args.append(torch.rand(ids.numel(), generator=g))
            names[f"f{f}"].append(base + 2)
    return args, names


def traced_with_names(model, n_args):
    """Trace ``model`` with named positional args a0, a1, ... (a *args forward cannot be)."""
    names = [f"a{i}" for i in range(n_args)]
    src = f"def forward(self, {', '.join(names)}):\n    return self.m({', '.join(names)})\n"
    ns: dict = {}
    exec(src, ns)
    wrapper = type("Named", (nn.Module,), {"forward": ns["forward"]})()
    wrapper.m = model
    return torch.fx.symbolic_trace(wrapper), names


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def check_same(model, new, args, new_args):
    model.zero_grad()
    new.zero_grad()
    ref = model(*args)
    ref.sum().backward()
    ref_g = grads(model)
    model.zero_grad()
    got = new(*new_args)
    got.sum().backward()
    got_g = grads(new) if any(True for _ in new.parameters()) else grads(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert set(got_g) == set(ref_g) and ref_g
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], rtol=0, atol=0)


@settings(deadline=None, max_examples=25)
@given(
    weighted=st.lists(st.booleans(), min_size=1, max_size=6),
    batch=st.integers(1, 6),
    other_batch=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_per_feature_tensors(weighted, batch, other_batch, seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = PerFeatureTensors(weighted)
    args, idx = make_args(weighted, batch, g)
    gm, names = traced_with_names(model, len(args))
    features = {k: [names[i] for i in v] for k, v in idx.items()}
    new, packer = combine_inputs(gm, args, features=features)

    assert n_split_nodes(new) == 1
    assert first_compute_node(new).target is PS
    new_args = packer(*args)
    assert isinstance(new_args[-1], CombinedFeatures) and len(new_args) == 2
    # H2D copies: 2 (3 with weights) for all features, instead of 2-3 per feature
    assert transfer_count(new_args[-1]) == (3 if any(weighted) else 2)
    assert transfer_count(args[1:]) == sum(3 if w else 2 for w in weighted)
    check_same(gm, new, args, new_args)
    # the packer's inverse gives back the very same tensors' values
    back = packer.unpack(*new_args)
    assert len(back) == len(args)
    for a, b in zip(args, back):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # the graph bakes in no batch size or id count
    args2, _ = make_args(weighted, other_batch, g)
    check_same(gm, new, args2, packer(*args2))


class DictAndJT(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(NUM_EMB, 2, mode="sum", include_last_offset=True)
        self.b = nn.EmbeddingBag(NUM_EMB, 2, mode="sum", include_last_offset=True)
        self.c = nn.EmbeddingBag(NUM_EMB, 2, mode="sum", include_last_offset=True)

    def forward(self, feats, solo, dense):
        x = self.a(feats["x"].values(), feats["x"].offsets())
        y = self.b(feats["y"].values(), feats["y"].offsets(), feats["y"].weights())
        z = self.c(solo.values(), solo.offsets())
        return torch.cat([x, y, z], 1) * dense


def _dict_and_jt_args(seed: int, batch: int):  # type: ignore[no-untyped-def]
    """DictAndJT's inputs: features x (unweighted) and y (weighted), solo, dense."""
    g = torch.Generator().manual_seed(seed)
    kjt = make_kjt(["x", "y", "solo"], batch, g, weighted=True, vbe=False)
    d = kjt.to_dict()
    feats = {"x": JaggedTensor(d["x"].values(), lengths=d["x"].lengths()), "y": d["y"]}
    solo = JaggedTensor(d["solo"].values(), lengths=d["solo"].lengths())
    return feats, solo, torch.randn(batch, 6, generator=g)


def test_dict_of_jagged_tensors_and_a_jagged_tensor():
    feats, solo, dense = _dict_and_jt_args(0, 5)
    model = DictAndJT()
    new, packer = combine_inputs(model, (feats, solo, dense))
    assert n_split_nodes(new) == 1
    new_args = packer(feats, solo, dense)
    check_same(model, new, (feats, solo, dense), new_args)
    f2, s2, d2 = packer.unpack(*new_args)
    assert d2 is dense and f2["x"].weights_or_none() is None and s2.weights_or_none() is None
    torch.testing.assert_close(f2["y"].weights(), feats["y"].weights())
    torch.testing.assert_close(s2.lengths(), solo.lengths())


def test_a_jagged_tensor_argument_named_like_a_feature():
    # the argument's name is only fxrec's key for it: a feature of that name is no clash
    feats, solo, dense = _dict_and_jt_args(1, 4)
    feats["solo"] = solo  # a feature named like the argument; the model does not read it

    model = DictAndJT()
    new, packer = combine_inputs(model, (feats, solo, dense))
    check_same(model, new, (feats, solo, dense), packer(feats, solo, dense))


@pytest.mark.parametrize("input_type", ["kjt", "td"])
@pytest.mark.parametrize("weighted,vbe", [(False, False), (True, False), (True, True)])
def test_kjt_and_tensordict_inputs(input_type, weighted, vbe):
    keys = ["f0", "f1", "f2", "f3"]
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = TinyRanker(keys, weighted=weighted, vbe=vbe)
    kjt = make_kjt(keys, 4, g, weighted, vbe)
    sparse = kjt_to_tensordict(kjt) if input_type == "td" else kjt
    dense = torch.randn(4, 3, generator=g)
    new, packer = combine_inputs(model, (dense, sparse))
    # a KJT/TensorDict already is one layout: rebuilt as views, no split, no copy
    assert n_split_nodes(new) == 0
    new_args = packer(dense, sparse)
    cf = new_args[-1]
    assert transfer_count(cf) == (3 if weighted else 2)
    assert transfer_count(sparse) >= transfer_count(cf)
    # packing copies nothing: a KJT is one buffer, and so is this TensorDict (its NJTs view
    # one buffer end to end), whose per-feature parts the packer joins as a view
    assert cf.values.data_ptr() == kjt.values().data_ptr()
    if weighted:
        assert cf.weights.data_ptr() == kjt.weights().data_ptr()
    check_same(model, new, (dense, sparse), new_args)
    _d2, s2 = packer.unpack(*new_args)
    k2 = s2 if input_type == "kjt" else fxrec.sparse.kjt_from_tensordict(s2)
    assert k2.keys() == keys and k2.stride_per_key() == kjt.stride_per_key()
    torch.testing.assert_close(k2.values(), kjt.values())
    torch.testing.assert_close(k2.lengths(), kjt.lengths())
    assert (k2.weights_or_none() is None) == (not weighted)


class TwoKJTs(nn.Module):
    """The usual split: unweighted features in one KJT, weighted ones in another."""

    def __init__(self):
        super().__init__()
        self.u = nn.EmbeddingBag(NUM_EMB, 2, mode="sum", include_last_offset=True)
        self.w = nn.EmbeddingBag(NUM_EMB, 2, mode="sum", include_last_offset=True)

    def forward(self, plain, weighted):
        a = plain["u"]
        b = weighted["w"]
        assert_no_weights(a)
        return self.u(a.values(), a.offsets()) + self.w(b.values(), b.offsets(), b.weights())


@torch.fx.wrap
def assert_no_weights(jt):
    if jt.weights_or_none() is not None:
        raise AssertionError("an unweighted feature came back with weights")


def test_weighted_and_unweighted_kjts_combined():
    g = torch.Generator().manual_seed(2)
    plain = make_kjt(["u"], 3, g, weighted=False, vbe=False)
    weighted = make_kjt(["w"], 3, g, weighted=True, vbe=False)
    model = TwoKJTs()
    new, packer = combine_inputs(model, (plain, weighted))
    new_args = packer(plain, weighted)
    assert transfer_count(new_args[-1]) == 3
    check_same(model, new, (plain, weighted), new_args)
    with pytest.raises(ValueError, match="not in"):
        packer(weighted, plain)  # arguments swapped: feature names differ
    w_as_plain = KeyedJaggedTensor(["w"], weighted.values(), lengths=weighted.lengths())
    with pytest.raises(ValueError, match="weights"):
        packer(plain, w_as_plain)


def test_optimize_runs_the_combined_module():
    keys = ["f0", "f1"]
    g = torch.Generator().manual_seed(3)
    model = TinyRanker(keys, weighted=True)
    kjt = make_kjt(keys, 4, g, True, False)
    dense = torch.randn(4, 3, generator=g)
    new, packer = combine_inputs(model, (dense, kjt))
    new_args = packer(dense, kjt)
    opt = fxrec.optimize(new, new_args)
    torch.testing.assert_close(opt(*new_args), model(dense, kjt), rtol=0, atol=0)


def test_state_dict_keys_are_the_models():
    model = TinyRanker(["f0", "f1"])
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3), make_kjt(["f0", "f1"], 2, g, False, False))
    new, _ = combine_inputs(model, args)
    assert set(new.state_dict()) == set(model.state_dict())
    for k, v in new.state_dict().items():  # the model's own tensors, not copies
        assert v.data_ptr() == model.state_dict()[k].data_ptr()
    other = TinyRanker(["f0", "f1"])
    new.load_state_dict(other.state_dict())  # strict: checkpoints load both ways
    torch.testing.assert_close(model.over.weight, other.over.weight)


class _Hooked(nn.Module):
    """A submodule tracing goes through, whose checkpoints pass through a load hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.loaded = 0
        self._register_load_state_dict_pre_hook(self._count)

    def _count(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.loaded += 1

    def forward(self, x):
        return self.lin(x)


class _WithUnusedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyRanker(["f0", "f1"])
        self.head = _Hooked()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # never read
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, dense, kjt):
        return self.head(torch.cat([self.inner(dense, kjt)] * 4, 1))


def test_the_models_own_submodules_and_tensors_stay():
    """Modules traced through keep their type and hooks (a sharded collection takes each
    rank's tables in one); a buffer the forward never reads stays in the state_dict."""
    model = _WithUnusedBuffer()
    model.inner.eval()  # children keep their own modes
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3), make_kjt(["f0", "f1"], 2, g, False, False))
    new, packer = combine_inputs(model, args)
    assert new.head is model.head and new.inner is model.inner
    assert new.steps is model.steps and "scratch" not in new.state_dict()
    assert set(new.state_dict()) == set(model.state_dict())
    assert new.training and not new.inner.training
    new.load_state_dict(model.state_dict())
    assert model.head.loaded == 1
    torch.testing.assert_close(new(*packer(*args)), model(*args), rtol=0, atol=0)


def test_clear_errors():
    model = TinyRanker(["f0"])
    with pytest.raises(ValueError, match="no sparse inputs"):
        combine_inputs(nn.Linear(2, 2), (torch.randn(1, 2),))
    g = torch.Generator().manual_seed(0)
    kjt = make_kjt(["f0"], 2, g, False, False)
    with pytest.raises(ValueError, match="arguments"):
        combine_inputs(model, (torch.randn(2, 3),))
    gm, _names = traced_with_names(PerFeatureTensors([False]), 3)
    args = [torch.randn(2, 2), torch.tensor([1, 2]), torch.tensor([1, 1])]
    with pytest.raises(ValueError, match="no forward argument"):
        combine_inputs(gm, args, features={"f0": ("a1", "nope")})
    with pytest.raises(ValueError, match="values_arg"):
        combine_inputs(gm, args, features={"f0": ("a1",)})
    _new, packer = combine_inputs(gm, args, features={"f0": ("a1", "a2")})
    with pytest.raises(ValueError, match=r"feature 'f0': ids of dtype torch\.int32"):
        packer(args[0], args[1].int(), args[2])
    with pytest.raises(ValueError, match=r"feature 'f0': .*(lengths|sum)"):
        packer(args[0], args[1], torch.tensor([5, 5]))  # lengths do not sum to the ids
    with pytest.raises(ValueError, match="arguments"):
        packer(args[0])
    _, p2 = combine_inputs(model, (torch.randn(2, 3), kjt))
    with pytest.raises(ValueError, match="not in"):
        p2(torch.randn(2, 3), KeyedJaggedTensor(["zz"], kjt.values(), lengths=kjt.lengths()))


@pytest.mark.parametrize("part", ["ids", "lengths"])
def test_example_features_of_mixed_dtypes_are_refused_when_combining(part):
    # every feature's ids (and lengths) share one tensor: an example batch whose features
    # disagree is refused here, naming them, rather than by its own packer later
    feats, solo, dense = _dict_and_jt_args(2, 3)
    x = feats["x"]
    values, lengths = x.values(), x.lengths()
    if part == "ids":
        values = values.int()
    else:
        lengths = lengths.int()
    feats["x"] = JaggedTensor(values, lengths=lengths)
    with pytest.raises(ValueError, match=rf"{part} of different dtypes") as info:
        combine_inputs(DictAndJT(), (feats, solo, dense))
    msg = str(info.value)
    assert "torch.int32: ['x']" in msg and "torch.int64: ['y', 'solo']" in msg
    assert "Cast them" in msg


@torch.fx.wrap
def _read(features):
    return fxrec.sparse.kjt_from_tensordict(features).values().float().sum()


class ReadsTwoTensorDicts(nn.Module):
    def forward(self, dense, plain, weighted):
        return dense.sum() + _read(plain) + _read(weighted)


@settings(deadline=None, max_examples=30)
@given(ref_features(max_keys=5, max_batch=4), ref_features(max_keys=4, max_batch=4))
def test_tensordicts_are_packed_as_their_features(a, b):
    # The packer copies each TensorDict's per-feature parts once into the combined tensors:
    # they must hold exactly the features' ids, bag sizes and weights, key after key.
    b = RefFeatures(  # feature names must be unique across arguments
        [f"w{k}" for k in b.keys],
        {f"w{k}": v for k, v in b.bags.items()},
        None if b.wbags is None else {f"w{k}": v for k, v in b.wbags.items()},
        b.variable,
    )
    tds = [separate_buffers(kjt_to_tensordict(r.kjt()), r.keys) for r in (a, b)]
    dense = torch.ones(2)
    new, packer = combine_inputs(ReadsTwoTensorDicts(), (dense, *tds))
    cf = packer(dense, *tds)[-1]
    assert list(cf.keys) == a.keys + b.keys
    assert torch.equal(cf.values, torch.cat([a.values(), b.values()]))
    assert torch.equal(cf.lengths, torch.cat([a.lengths(), b.lengths()]))
    assert list(cf.stride_per_key) == a.stride_per_key() + b.stride_per_key()
    if a.wbags is None and b.wbags is None:
        assert cf.weights is None
    else:  # an unweighted argument's features get weights of one
        wa = a.weights() if a.wbags is not None else torch.ones(a.values().numel())
        wb = b.weights() if b.wbags is not None else torch.ones(b.values().numel())
        assert torch.equal(cf.weights, torch.cat([wa, wb]))
    torch.testing.assert_close(new(*packer(dense, *tds)), ReadsTwoTensorDicts()(dense, *tds))


class TorchRecRanker(nn.Module):
    """A model on TorchRec's own types: its collection takes TorchRec's KJT."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        tables = [
            EmbeddingBagConfig(
                num_embeddings=NUM_EMB, embedding_dim=3, name=f"t_{k}", feature_names=[k]
            )
            for k in keys
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
        self.over = nn.Linear(3 + 3 * len(keys), 1)

    def forward(self, dense, features):
        return self.over(torch.cat([dense, self.ebc(features).values()], 1))


@pytest.mark.torchrec
def test_torchrec_kjt_is_combined_and_rebuilt_as_torchrecs():
    pytest.importorskip("torchrec")
    from fxrec.sparse import to_torchrec

    keys = ["f0", "f1", "f2"]
    g = torch.Generator().manual_seed(0)
    model = TorchRecRanker(keys)
    args = (torch.randn(4, 3, generator=g), to_torchrec(make_kjt(keys, 4, g, True, False)))
    new, packer = combine_inputs(model, args)
    for batch in (4, 2):
        theirs = to_torchrec(make_kjt(keys[::-1], batch, g, True, False))  # other key order
        call = (torch.randn(batch, 3, generator=g), theirs)
        check_same(model, new, call, packer(*call))
    with pytest.raises(ValueError, match="must be TorchRec's KeyedJaggedTensor"):
        packer(args[0], make_kjt(keys, 4, g, True, False))


class _Counting(DictAndJT):
    """Counts its calls in a buffer, in place, whose result the forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, feats, solo, dense):  # type: ignore[no-untyped-def]
        self.calls.add_(1)
        return super().forward(feats, solo, dense)


def test_in_place_buffer_updates_nothing_reads_stay():
    """Dead-code elimination keeps what has side effects: fx's own erased ``calls.add_(1)``."""
    model = _Counting()
    args = _dict_and_jt_args(0, 4)
    new, packer = combine_inputs(model, args)
    before = int(model.calls)
    check_same(model, new, args, packer(*args))
    assert int(model.calls) == before + 2  # the model's call and the combined module's


@torch.fx.wrap
def _kjt_of(td):
    return fxrec.sparse.kjt_from_tensordict(td)


class DenseInTensorDict(nn.Module):
    """Reads dense entries of its TensorDict next to the features (the usual TD batch)."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = keys
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(NUM_EMB, 3, mode="sum", include_last_offset=True) for _ in keys
        )
        self.over = nn.Linear(3 + 1 + 3 * len(keys), 1)

    def forward(self, td):
        kjt = _kjt_of(td.select(*self.keys))
        pooled = [
            bag(kjt[k].values(), kjt[k].offsets(), kjt[k].weights_or_none())
            for k, bag in zip(self.keys, self.bags)
        ]
        return self.over(torch.cat([td["dense"], td["age"].unsqueeze(1), *pooled], 1))


def _td_with_dense(keys, batch, g):  # type: ignore[no-untyped-def]
    """Weighted features (sub-TensorDicts) with dense entries first and in the middle."""
    from tensordict import TensorDict

    feats = kjt_to_tensordict(make_kjt(keys, batch, g, weighted=True, vbe=False))
    entries = {"dense": torch.randn(batch, 3, generator=g), "f0": feats["f0"]}
    entries["age"] = torch.rand(batch, generator=g)
    entries["f1"] = feats["f1"]
    return TensorDict(entries, batch_size=[batch])


def _train_alike(plain: nn.Module, new: nn.Module, packer, batches) -> None:  # type: ignore[no-untyped-def]
    """SGD steps of the plain model on each TensorDict batch and of the combined one on its
    packed form: every parameter ends exactly equal."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, new)]
    for td in batches:
        for m, opt, args in ((plain, opts[0], (td,)), (new, opts[1], packer(td))):
            opt.zero_grad()
            m(*args).sum().backward()
            opt.step()
    want, got = dict(plain.named_parameters()), dict(new.named_parameters())
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_tensordict_dense_entries_travel_as_dense_arguments():
    # Only a TensorDict's jagged entries are features; its dense ones go through the packer as
    # dense arguments and are put back, in place, into the TensorDict the graph rebuilds.
    import copy

    keys = ["f0", "f1"]
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = DenseInTensorDict(keys)
    plain = copy.deepcopy(model)  # the combined module trains the model's own parameters
    td = _td_with_dense(keys, 4, g)
    new, packer = combine_inputs(model, (td,))
    new_args = packer(td)
    assert len(new_args) == 3 and new_args[0] is td["dense"] and new_args[1] is td["age"]
    assert list(new_args[-1].keys) == keys and transfer_count(new_args[-1]) == 3
    check_same(plain, new, (td,), new_args)
    (back,) = packer.unpack(*new_args)
    assert list(back.keys()) == list(td.keys()) and back["dense"] is td["dense"]
    torch.testing.assert_close(back["f1"]["weights"].values(), td["f1"]["weights"].values())
    # fresh batches of other sizes
    _train_alike(plain, new, packer, [_td_with_dense(keys, n, g) for n in (3, 5, 4)])
    with pytest.raises(ValueError, match="entry 'age' must be a dense tensor"):
        packer(td.exclude("age"))


class ReadsBatchDims(DenseInTensorDict):
    """Scales by the TensorDict's own numel (1 for a TensorDict built without batch_size)."""

    def forward(self, td):
        return super().forward(td) / td.numel() * (1 + td.batch_dims)


@pytest.mark.parametrize("with_dense", [True, False])
def test_rebuilt_tensordict_keeps_the_examples_batch_size(with_dense):
    # A TensorDict built without batch_size has batch_size [] and no device; the one the
    # graph rebuilds from the features had [B] and the features' device.
    import copy

    from tensordict import TensorDict

    keys = ["f0", "f1"]
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)

    def batch(n):  # type: ignore[no-untyped-def]
        td = _td_with_dense(keys, n, g)
        td = td if with_dense else td.select(*keys)
        return TensorDict(dict(td.items()))

    model = ReadsBatchDims(keys) if with_dense else DenseOnlyFeatures(keys)
    plain = copy.deepcopy(model)
    td = batch(4)
    assert td.batch_size == torch.Size([]) and td.device is None
    new, packer = combine_inputs(model, (td,))
    (back,) = packer.unpack(*packer(td))
    assert back.batch_size == td.batch_size and back.device is None
    check_same(plain, new, (td,), packer(td))
    _train_alike(plain, new, packer, [batch(n) for n in (3, 5)])


class DenseOnlyFeatures(nn.Module):
    """Features only; reads the TensorDict's numel (its rebuild takes no dense entries)."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = keys
        self.bag = nn.EmbeddingBag(NUM_EMB, 3, mode="sum", include_last_offset=True)

    def forward(self, td):
        kjt = _kjt_of(td)
        return self.bag(kjt["f0"].values(), kjt["f0"].offsets()) / td.numel()


# -- per-feature inputs: joined once, checked once ------------------------------------------
# The packer joins the per-feature tensors of tensor / JaggedTensor / dict-of-JaggedTensor
# arguments with one cat each and checks them on the joined tensors (one host read); it must
# give exactly what building one checked KJT per feature gave, and name the wrong feature.


class MixedForms(nn.Module):
    """Tensor features a (weighted) and b, a dict of JaggedTensors {x, y (weighted)}, a
    JaggedTensor, and a KJT: every way a feature can arrive, in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleDict(
            {k: nn.EmbeddingBag(NUM_EMB, 3, mode="sum") for k in ("a", "b", "x", "y", "s", "k")}
        )
        self.over = nn.Linear(2 + 3 * 6, 1)

    def _bag(self, key, ids, lengths, weights=None):  # type: ignore[no-untyped-def]
        return self.bags[key](ids, torch.cumsum(lengths, 0) - lengths, per_sample_weights=weights)

    def forward(self, dense, ids_a, len_a, w_a, ids_b, len_b, feats, solo, kjt):  # type: ignore[no-untyped-def]
        x, y, k = feats["x"], feats["y"], kjt["k"]
        parts = [
            dense,
            self._bag("a", ids_a, len_a, w_a),
            self._bag("b", ids_b, len_b),
            self._bag("x", x.values(), x.lengths()),
            self._bag("y", y.values(), y.lengths(), y.weights()),
            self._bag("s", solo.values(), solo.lengths()),
            self._bag("k", k.values(), k.lengths()),
        ]
        return self.over(torch.cat(parts, 1))


def _bag_tensors(batch, g, weighted=False):  # type: ignore[no-untyped-def]
    lengths = torch.randint(0, 4, (batch,), generator=g)
    ids = torch.randint(0, NUM_EMB, (int(lengths.sum()),), generator=g)
    return ids, lengths, (torch.rand(ids.numel(), generator=g) if weighted else None)


def _mixed_batch(batch, g):  # type: ignore[no-untyped-def]
    ids_a, len_a, w_a = _bag_tensors(batch, g, weighted=True)
    ids_b, len_b, _ = _bag_tensors(batch, g)
    x, y, s = (_bag_tensors(batch, g, weighted=w) for w in (False, True, False))
    feats = {"x": JaggedTensor(x[0], lengths=x[1]), "y": JaggedTensor(y[0], y[2], lengths=y[1])}
    solo = JaggedTensor(s[0], lengths=s[1])
    kjt = make_kjt(["k"], batch, g, weighted=False, vbe=False)
    dense = torch.randn(batch, 2, generator=g)
    return (dense, ids_a, len_a, w_a, ids_b, len_b, feats, solo, kjt)


def test_mixed_per_feature_inputs_train_like_the_plain_model():
    import copy

    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = MixedForms()
    plain = copy.deepcopy(model)
    new, packer = combine_inputs(
        model,
        _mixed_batch(4, g),
        features={"a": ("ids_a", "len_a", "w_a"), "b": ("ids_b", "len_b")},
    )
    assert packer.keys == ("a", "b", "x", "y", "solo", "k") and n_split_nodes(new) == 1
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, new)]
    for batch in (5, 3, 6):  # fresh batches, of other sizes than the example
        args = _mixed_batch(batch, g)
        check_same(plain, new, args, packer(*args))
        for m, opt, call in ((plain, opts[0], args), (new, opts[1], packer(*args))):
            opt.zero_grad()
            m(*call).sum().backward()
            opt.step()
    want, got = dict(plain.named_parameters()), dict(new.named_parameters())
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


class ReadsAll(nn.Module):
    """Reads every argument it is given (the packer, not the model, is under test)."""

    def forward(self, *xs):  # type: ignore[no-untyped-def]
        return torch.stack([x.float().sum() for x in xs]).sum()


def _dict_reader(keys):  # type: ignore[no-untyped-def]
    src = "def forward(self, d):\n    return " + " + ".join(
        f"d[{k!r}].values().float().sum()" for k in keys
    )
    ns: dict = {}
    exec(src + "\n", ns)
    return torch.fx.symbolic_trace(type("ReadsDict", (nn.Module,), {"forward": ns["forward"]})())


def _per_feature_packer(form, feats):  # type: ignore[no-untyped-def]
    """(packer, its arguments) for ``feats`` = [(key, ids, lengths, weights or None)] given
    as tensor arguments or as a dict of JaggedTensors."""
    if form == "dict":
        d = {k: JaggedTensor(v, w, lengths=ln) for k, v, ln, w in feats}
        return combine_inputs(_dict_reader(list(d)), [d])[1], [d]
    args, names = [], {}
    for k, v, ln, w in feats:
        names[k] = [len(args), len(args) + 1] + ([len(args) + 2] if w is not None else [])
        args += [v, ln] + ([w] if w is not None else [])
    gm, arg_names = traced_with_names(ReadsAll(), len(args))
    features = {k: [arg_names[i] for i in idx] for k, idx in names.items()}
    return combine_inputs(gm, args, features=features)[1], args


def _per_feature_kjts(feats):  # type: ignore[no-untyped-def]
    """What the combined features must equal: one checked KJT per feature, joined."""
    kjts = [
        KeyedJaggedTensor.from_jt_dict({k: JaggedTensor(v, w, lengths=ln)}) for k, v, ln, w in feats
    ]
    any_w = any(w is not None for *_, w in feats)
    weights = [
        kj.weights() if kj.weights_or_none() is not None else torch.ones(kj.values().numel())
        for kj in kjts
    ]
    return (
        torch.cat([kj.values() for kj in kjts]),
        torch.cat([kj.lengths() for kj in kjts]),
        torch.cat(weights) if any_w else None,
        tuple(kj.stride() for kj in kjts),
        tuple(n for kj in kjts for n in kj.length_per_key()),
    )


@st.composite
def per_feature_inputs(draw):  # type: ignore[no-untyped-def]
    """Features of their own batch sizes (0 included), empty ones, weighted or not."""
    n = draw(st.integers(1, 7))
    ids_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    lengths_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    feats = []
    for i in range(n):
        lens = draw(st.lists(st.integers(0, 3), min_size=0, max_size=5))
        if draw(st.booleans()) and lens:
            lens = [0] * len(lens)  # an empty feature
        total = sum(lens)
        ids = torch.tensor(
            draw(st.lists(st.integers(0, NUM_EMB - 1), min_size=total, max_size=total)),
            dtype=ids_dtype,
        )
        w = torch.rand(total) if draw(st.booleans()) else None
        feats.append((f"f{i}", ids, torch.tensor(lens, dtype=lengths_dtype), w))
    return feats


@settings(deadline=None, max_examples=40)
@given(feats=per_feature_inputs(), form=st.sampled_from(["tensors", "dict"]))
def test_packed_per_feature_inputs_equal_per_feature_kjts(feats, form):
    packer, args = _per_feature_packer(form, feats)
    cf = packer(*args)[-1]
    values, lengths, weights, spk, lpk = _per_feature_kjts(feats)
    assert cf.keys == tuple(k for k, *_ in feats)
    for got, want in ((cf.values, values), (cf.lengths, lengths), (cf.weights, weights)):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert cf.stride_per_key == spk and cf.length_per_key == lpk
    back = packer.unpack(*packer(*args))
    if form == "tensors":
        for a, b in zip(args, back):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "form,weighted,kernels",
    [("tensors", "none", 5), ("tensors", "all", 6), ("dict", "none", 5), ("dict", "half", 7)],
)
def test_packing_per_feature_inputs_takes_kernels_independent_of_the_feature_count(
    form, weighted, kernels
):
    # 2 cats (3 weighted) joining the features, a sum and a min checking their lengths, a cat
    # for the one host read of both, and, mixing weighted and unweighted features, one tensor
    # of ones: however many features (per-feature checks were ~9 kernels per feature).
    from fxrec.measure import count_kernels

    g = torch.Generator().manual_seed(0)
    for n in (3, 12):
        feats = []
        for i in range(n):
            w = weighted == "all" or (weighted == "half" and i % 2 == 0)
            feats.append((f"f{i}", *_bag_tensors(6, g, weighted=w)))
        packer, args = _per_feature_packer(form, feats)
        counts = count_kernels(lambda: packer(*args), backward=False)  # noqa: B023
        assert counts.forward == kernels, counts.forward_ops


def _four_tensor_features(g):  # type: ignore[no-untyped-def]
    feats = [(f"f{i}", *_bag_tensors(4, g, weighted=i == 3)) for i in range(4)]
    return feats, *_per_feature_packer("tensors", feats)


def _with(args, feats, key, **change):  # type: ignore[no-untyped-def]
    """``args`` with one feature's ids / lengths / weights replaced."""
    out = list(args)
    pos = 0
    for k, _v, _ln, w in feats:
        if k == key:
            for j, part in enumerate(("ids", "lengths", "weights")):
                if part in change:
                    out[pos + j] = change[part]
        pos += 3 if w is not None else 2
    return out


def test_bad_per_feature_tensors_are_refused_naming_the_feature():
    g = torch.Generator().manual_seed(1)
    feats, packer, args = _four_tensor_features(g)
    ids2, len2 = feats[2][1], feats[2][2]
    neg = len2.clone()  # same sum, one negative length
    neg[0], neg[1] = int(len2[0]) + int(len2[1]) + 1, -1
    cases = [
        (dict(lengths=neg), r"feature 'f2': .*negative length"),
        (dict(lengths=len2 + 1), r"feature 'f2': .*lengths sum to"),
        (dict(ids=ids2.float()), r"feature 'f2': .*integers"),
        (dict(ids=ids2.int()), r"feature 'f2': ids of dtype torch\.int32"),
        (dict(lengths=len2.int()), r"feature 'f2': lengths of dtype torch\.int32"),
        (dict(ids=ids2.view(-1, 1)), r"feature 'f2': .*1-D"),
        (dict(ids=ids2.tolist()), r"feature 'f2': .*tensor"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            packer(*_with(args, feats, "f2", **change))
    w3 = feats[3][3]
    with pytest.raises(ValueError, match=r"feature 'f3': weights must be 1-D with one weight"):
        packer(*_with(args, feats, "f3", weights=w3[:-1] if w3.numel() else torch.ones(1)))
    with pytest.raises(ValueError, match=r"feature 'f3': weights must be floating point"):
        packer(*_with(args, feats, "f3", weights=w3.long()))
    packer(*args)  # the good batch still packs


def test_bad_dict_features_are_refused_naming_the_feature():
    g = torch.Generator().manual_seed(2)
    feats = [(f"f{i}", *_bag_tensors(4, g, weighted=i == 0)) for i in range(3)]
    packer, (d,) = _per_feature_packer("dict", feats)
    f1 = d["f1"]
    cases = [
        (JaggedTensor._make(f1.values().float(), None, f1.lengths(), None), "integers"),
        (JaggedTensor._make(f1.values(), None, f1.lengths() + 1, None), "lengths sum to"),
        (f1.values(), "must be a JaggedTensor"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=rf"feature 'f1'.*{message}"):
            packer({**d, "f1": bad})
    with pytest.raises(ValueError, match=r"feature 'f1' has weights in this batch but had none"):
        packer(
            {
                **d,
                "f1": JaggedTensor(
                    f1.values(), torch.ones(f1.values().numel()), lengths=f1.lengths()
                ),
            }
        )
    f0 = d["f0"]
    with pytest.raises(ValueError, match=r"feature 'f0' has no weights in this batch but had "):
        packer({**d, "f0": JaggedTensor(f0.values(), None, lengths=f0.lengths())})


def test_without_validation_per_feature_inputs_are_still_checked_for_dtypes():
    from fxrec.sparse import validation_disabled

    g = torch.Generator().manual_seed(3)
    feats, packer, args = _four_tensor_features(g)
    with validation_disabled():
        cf = packer(*args)[-1]
        assert cf.length_per_key == tuple(v.numel() for _, v, *_ in feats)
        with pytest.raises(ValueError, match=r"feature 'f1': ids of dtype torch\.int32"):
            packer(*_with(args, feats, "f1", ids=feats[1][1].int()))


class ReadsLazyStack(nn.Module):
    """fxrec's collection on per-sample TensorDicts lazily stacked, beside their dense
    entries (a float vector and a scalar per sample)."""

    def __init__(self, weighted: bool, with_dense: bool) -> None:
        super().__init__()
        from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

        tables = [
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=NUM_EMB, embedding_dim=3, feature_names=[f"f{i}"]
            )
            for i in range(2)
        ]
        self.ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
        self.with_dense = with_dense
        self.over = nn.Linear(6 + (4 if with_dense else 0), 1)

    def forward(self, td):
        parts = [self.ebc(td).values()]
        if self.with_dense:
            parts += [td["dense"], td["age"].unsqueeze(1)]
        return self.over(torch.cat(parts, 1))


def _lazy_samples(lengths, weighted, with_dense, g):  # type: ignore[no-untyped-def]
    """Per-sample TensorDicts (``lengths``: each sample's id count per feature), lazily
    stacked; the dense entries come first and between the features."""
    from tensordict import LazyStackedTensorDict, TensorDict

    samples = []
    for row in lengths:
        entries: dict = {"dense": torch.randn(3, generator=g)} if with_dense else {}
        for f, n in enumerate(row):
            ids = torch.randint(0, NUM_EMB, (n,), generator=g)
            w = torch.rand(n, generator=g)
            entries[f"f{f}"] = TensorDict({"values": ids, "weights": w}, []) if weighted else ids
            if with_dense and f == 0:
                entries["age"] = torch.rand((), generator=g)
        samples.append(TensorDict(entries, batch_size=[]))
    return LazyStackedTensorDict.lazy_stack(samples, 0)


@st.composite
def sample_lengths(draw):  # type: ignore[no-untyped-def]
    """Each sample's id count per feature (2 features); a feature's counts may all be equal."""
    batch = draw(st.integers(1, 5))
    cols = []
    for _ in range(2):
        if draw(st.booleans()):
            cols.append([draw(st.integers(0, 3))] * batch)
        else:
            cols.append(draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)))
    return [list(r) for r in zip(*cols)]


@settings(deadline=None, max_examples=30)
@given(
    lengths=sample_lengths(),
    other=sample_lengths(),
    weighted=st.booleans(),
    with_dense=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lazily_stacked_samples_are_packed_as_the_collection_reads_them(
    lengths, other, weighted, with_dense, seed
):
    # A plain get of the stack would fail on ragged ids and stack equal-length ones into a
    # dense tensor; each sample's 1-D integer ids are a feature, its float vector dense.
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = ReadsLazyStack(weighted, with_dense)
    td = _lazy_samples(lengths, weighted, with_dense, g)
    new, packer = combine_inputs(model, (td,))
    new_args = packer(td)
    assert list(new_args[-1].keys) == ["f0", "f1"]
    assert transfer_count(new_args[-1]) == (3 if weighted else 2)
    assert len(new_args) == (3 if with_dense else 1)
    check_same(model, new, (td,), new_args)
    later = _lazy_samples(other, weighted, with_dense, g)
    check_same(model, new, (later,), packer(later))


def test_lazily_stacked_dense_entry_of_other_shapes_is_refused():
    g = torch.Generator().manual_seed(6)
    model = ReadsLazyStack(weighted=False, with_dense=True)
    _, packer = combine_inputs(model, (_lazy_samples([[1, 2], [3, 0]], False, True, g),))
    td = _lazy_samples([[1, 1], [2, 2]], False, True, g)
    td.tensordicts[1]["dense"] = torch.randn(4, generator=g)
    with pytest.raises(ValueError, match=r"entry 'dense' must be a dense tensor.*same shape"):
        packer(td)


class WeightedAndPlainCollections(nn.Module):
    """An unweighted and a weighted collection reading one TensorDict, each its own features
    (plain jagged tensors for the first, ``{"values", "weights"}`` sub-TensorDicts for the
    second). ``reads_td``: the forward also reads the TensorDict itself, so the graph rebuilds
    a TensorDict rather than handing the collections a KJT."""

    def __init__(self, weighted: list[bool], reads_td: bool) -> None:
        super().__init__()
        from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

        def collection(want: bool):  # type: ignore[no-untyped-def]
            tables = [
                EmbeddingBagConfig(
                    name=f"t{i}", num_embeddings=NUM_EMB, embedding_dim=2, feature_names=[f"f{i}"]
                )
                for i, w in enumerate(weighted)
                if w == want
            ]
            return EmbeddingBagCollection(tables, is_weighted=want) if tables else None

        self.plain = collection(False)
        self.weighted = collection(True)
        self.reads_td = reads_td
        self.over = nn.Linear(2 + 2 * len(weighted) + int(reads_td), 1)

    def forward(self, dense, td):
        parts = [dense]
        for ebc in (self.plain, self.weighted):
            if ebc is not None:
                parts.append(ebc(td).values())
        if self.reads_td:
            parts.append(_first_rows(td, dense))
        return self.over(torch.cat(parts, 1))


@torch.fx.wrap
def _first_rows(td, dense):
    """A column that tells the TensorDict's layout: which features are sub-TensorDicts
    (weighted) and which plain jagged tensors, and its batch size."""
    code = sum(2**i for i, k in enumerate(td.keys()) if isinstance(td[k], TensorDictBase))
    return dense.new_full((dense.shape[0], 1), float(code + td.numel()))


def _mixed_td(weighted, batch, max_ids, g):  # type: ignore[no-untyped-def]
    """The README's layout: a plain NJT per unweighted feature, a ``{"values", "weights"}``
    sub-TensorDict (NJTs on one offsets tensor) per weighted one."""
    entries = {}
    for i, w in enumerate(weighted):
        lengths = torch.randint(0, max_ids + 1, (batch,), generator=g)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        ids = torch.nested.nested_tensor_from_jagged(
            torch.randint(0, NUM_EMB, (int(lengths.sum()),), generator=g), offsets
        )
        if w:
            wts = torch.nested.nested_tensor_from_jagged(
                torch.rand(ids.values().numel(), generator=g), offsets
            )
            entries[f"f{i}"] = TensorDict({"values": ids, "weights": wts}, batch_size=[batch])
        else:
            entries[f"f{i}"] = ids
    return TensorDict(entries, batch_size=[batch])


def _assert_same_layout(got, want):  # type: ignore[no-untyped-def]
    """Same keys in the same order; each feature plain or weighted as in ``want``, with its
    ids, rows and weights."""
    assert list(got.keys()) == list(want.keys()) and got.batch_size == want.batch_size
    for k in list(want.keys()):  # (iterating a TensorDict gives its rows)
        a, b = got[k], want[k]
        assert isinstance(a, TensorDictBase) == isinstance(b, TensorDictBase), k
        pairs = (
            [(a["values"], b["values"]), (a["weights"], b["weights"])]
            if isinstance(b, TensorDictBase)
            else [(a, b)]
        )
        for x, y in pairs:
            torch.testing.assert_close(x.values(), y.values(), rtol=0, atol=0)
            torch.testing.assert_close(x.offsets(), y.offsets(), rtol=0, atol=0)


@settings(deadline=None, max_examples=30)
@given(
    weighted=st.lists(st.booleans(), min_size=1, max_size=5),
    batch=st.integers(1, 5),
    other_batch=st.integers(1, 5),
    max_ids=st.integers(0, 4),
    reads_td=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tensordict_of_weighted_and_unweighted_features(
    weighted, batch, other_batch, max_ids, reads_td, seed
):
    # Each collection reads its own features from one TensorDict, as in the plain model; the
    # combined features carry weights of ones for the unweighted ones (3 copies, or 2 when
    # none is weighted), which the unweighted collection never reads.
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = WeightedAndPlainCollections(weighted, reads_td)
    td = _mixed_td(weighted, batch, max_ids, g)
    dense = torch.randn(batch, 2, generator=g)
    new, packer = combine_inputs(model, (dense, td))
    assert n_split_nodes(new) == 0
    new_args = packer(dense, td)
    cf = new_args[-1]
    assert transfer_count(cf) == (3 if any(weighted) else 2)
    assert sorted(cf.keys) == sorted(td.keys())
    if any(weighted):
        for k, n, w in zip(cf.keys, cf.length_per_key, torch.split(cf.weights, cf.length_per_key)):
            if not weighted[int(k[1:])]:
                assert torch.equal(w, torch.ones(n))
    check_same(model, new, (dense, td), new_args)
    _, back = packer.unpack(*new_args)
    _assert_same_layout(back, td)
    later = _mixed_td(weighted, other_batch, max_ids, g)
    dense2 = torch.randn(other_batch, 2, generator=g)
    check_same(model, new, (dense2, later), packer(dense2, later))


def test_a_batch_weighted_otherwise_than_the_example_is_refused_naming_the_feature():
    g = torch.Generator().manual_seed(7)
    model = WeightedAndPlainCollections([False, True, False], reads_td=False)
    dense = torch.randn(3, 2, generator=g)
    _, packer = combine_inputs(model, (dense, _mixed_td([False, True, False], 3, 2, g)))
    flipped = _mixed_td([False, True, True], 3, 2, g)
    with pytest.raises(ValueError, match="feature 'f2' has weights in this batch but had none"):
        packer(dense, flipped)
    dropped = _mixed_td([False, False, False], 3, 2, g)
    with pytest.raises(ValueError, match="feature 'f1' has no weights in this batch but had"):
        packer(dense, dropped)


def _mixed_batches(weighted, n, g):  # type: ignore[no-untyped-def]
    from fxrec.train import Batch

    out = []
    for i in range(n):
        b = 3 + i % 3
        td = _mixed_td(weighted, b, 3, g)
        out.append(
            Batch(
                torch.randn(b, 2, generator=g), td, torch.randint(0, 2, (b,), generator=g).float()
            )
        )
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline", ["TrainPipelineBase", "TrainPipelineSparseDist"])
@pytest.mark.parametrize("optimized", [False, True])
def test_pipelines_train_combined_mixed_tensordicts_like_a_plain_loop(pipeline, optimized):
    import copy

    from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist

    cls = {
        "TrainPipelineBase": TrainPipelineBase,
        "TrainPipelineSparseDist": TrainPipelineSparseDist,
    }[pipeline]
    weighted = [False, True, False, True]
    g = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    plain = WeightedAndPlainCollections(weighted, reads_td=False)
    model = copy.deepcopy(plain)
    batches = _mixed_batches(weighted, 5, g)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    ref_losses = []
    for b in batches:
        ref_opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(
            plain(b.dense, b.sparse).view(-1), b.labels
        )
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))

    new, packer = combine_inputs(model, (batches[0].dense, batches[0].sparse))

    def host_fn(b):  # type: ignore[no-untyped-def]
        return Batch(b.dense, packer(b.dense, b.sparse)[1], b.labels)

    run: nn.Module = new
    if optimized:
        run = fxrec.optimize(new, (batches[0].dense, host_fn(batches[0]).sparse))
    opt = torch.optim.SGD(run.parameters(), lr=0.1)
    with cls(run, opt, host_fn=host_fn) as pipe:
        losses = pipe.run(batches)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    want, got = plain.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
