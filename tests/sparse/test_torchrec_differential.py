"""Same inputs into TorchRec's KJT and ours: same lengths, offsets, permute, split, to_dict."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, from_torchrec, to_torchrec
from tests.sparse.helpers import RefFeatures, kjt_bags, ref_features

trec = pytest.importorskip("torchrec.sparse.jagged_tensor")
pytestmark = pytest.mark.torchrec


def _theirs(ref: RefFeatures):  # type: ignore[no-untyped-def]
    return trec.KeyedJaggedTensor(
        keys=ref.keys,
        values=ref.values(),
        weights=ref.weights(),
        lengths=ref.lengths(),
        stride_per_key_per_rank=[[s] for s in ref.stride_per_key()] if ref.variable else None,
    )


def _same(ours: KeyedJaggedTensor, theirs) -> None:  # type: ignore[no-untyped-def]
    assert ours.keys() == theirs.keys()
    assert torch.equal(ours.values(), theirs.values())
    assert torch.equal(ours.lengths(), theirs.lengths())
    assert torch.equal(ours.offsets(), theirs.offsets())
    w = theirs.weights_or_none()
    assert (ours.weights_or_none() is None) == (w is None)
    if w is not None:
        assert torch.equal(ours.weights(), w)
    assert ours.stride_per_key() == theirs.stride_per_key()
    assert ours.stride() == theirs.stride()  # variable batch: kept through permute and split
    assert ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key()


@given(ref_features(max_batch=5))
def test_accessors_agree(ref: RefFeatures) -> None:
    ours, theirs = ref.kjt(), _theirs(ref)
    _same(ours, theirs)
    assert ours.variable_stride_per_key() == theirs.variable_stride_per_key()
    if not ref.variable:
        assert ours.stride() == theirs.stride()
    if not ref.variable and ours.stride() == 0:
        # TorchRec's to_dict raises IndexError on a batch of size 0; ours gives empty features.
        assert all(jt.stride() == 0 for jt in ours.to_dict().values())
        return
    d1, d2 = ours.to_dict(), theirs.to_dict()
    assert list(d1) == list(d2)
    for k in d1:
        assert torch.equal(d1[k].values(), d2[k].values())
        assert torch.equal(d1[k].lengths(), d2[k].lengths())
        assert torch.equal(d1[k].offsets(), d2[k].offsets())
        assert torch.equal(ours[k].values(), theirs[k].values())


@given(ref_features(max_batch=5), st.data())
def test_permute_agrees(ref: RefFeatures, data: st.DataObject) -> None:
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), min_size=1, max_size=7))
    _same(ref.kjt().permute(order), _theirs(ref).permute(order))


@given(ref_features(max_batch=5), st.data())
def test_split_agrees(ref: RefFeatures, data: st.DataObject) -> None:
    n = len(ref.keys)
    first = data.draw(st.integers(0, n))
    segments = [first, n - first]
    for a, b in zip(ref.kjt().split(segments), _theirs(ref).split(segments)):
        assert a.keys() == b.keys()
        assert torch.equal(a.values(), b.values())
        assert torch.equal(a.lengths(), b.lengths())
        assert a.stride() == b.stride()
        if a.keys():
            assert a.length_per_key() == b.length_per_key()


@given(ref_features(max_batch=5))
def test_conversions_round_trip(ref: RefFeatures) -> None:
    ours = ref.kjt()
    theirs = to_torchrec(ours)
    assert isinstance(theirs, trec.KeyedJaggedTensor)
    _same(ours, theirs)
    back = from_torchrec(_theirs(ref))
    assert isinstance(back, KeyedJaggedTensor)
    assert kjt_bags(back) == kjt_bags(ours)


def test_jt_and_kt_conversions() -> None:
    jt = JaggedTensor(torch.arange(3), weights=torch.rand(3), lengths=torch.tensor([1, 2]))
    t = to_torchrec(jt)
    assert isinstance(t, trec.JaggedTensor)
    assert torch.equal(t.offsets(), jt.offsets())
    back = from_torchrec(t)
    assert isinstance(back, JaggedTensor) and torch.equal(back.weights(), jt.weights())
    kt = KeyedTensor(["a", "b"], [2, 1], torch.randn(4, 3))
    tk = to_torchrec(kt)
    assert isinstance(tk, trec.KeyedTensor) and torch.equal(tk["b"], kt["b"])
    assert from_torchrec(tk).length_per_key() == [2, 1]


def test_regroup_agrees() -> None:
    a = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5))
    b = KeyedTensor(["c"], [1], torch.randn(4, 1))
    groups = [["c", "a"], ["b"]]
    ours = KeyedTensor.regroup([a, b], groups)
    theirs = trec.KeyedTensor.regroup([to_torchrec(a), to_torchrec(b)], groups)
    for x, y in zip(ours, theirs):
        assert torch.equal(x, y)


def test_regroup_takes_a_repeated_key_from_its_last_holder_as_torchrec() -> None:
    a = KeyedTensor(["x", "y"], [1, 1], torch.randn(3, 2))
    b = KeyedTensor(["y", "z"], [1, 2], torch.randn(3, 3))
    for groups in ([["y", "z"]], [["z", "y", "x"]]):
        ours = KeyedTensor.regroup([a, b], groups)
        theirs = trec.KeyedTensor.regroup([to_torchrec(a), to_torchrec(b)], groups)
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y)
    dup = KeyedTensor(["y", "y"], [1, 1], torch.randn(3, 2))
    assert torch.equal(KeyedTensor.regroup([dup], [["y"]])[0], dup["y"])
    assert torch.equal(
        KeyedTensor.regroup_as_dict([a, b], [["y"]], ["g"])["g"],
        trec.KeyedTensor.regroup_as_dict([to_torchrec(a), to_torchrec(b)], [["y"]], ["g"])["g"],
    )


def test_torchrecs_empty_kjt_converts() -> None:
    """TorchRec's ``KeyedJaggedTensor.empty()`` holds float32 values; no ids to check."""
    ours = from_torchrec(trec.KeyedJaggedTensor.empty())
    assert ours.keys() == [] and ours.values().numel() == 0
    assert not ours.values().dtype.is_floating_point


def test_conversion_errors() -> None:
    with pytest.raises(ValueError, match="to_torchrec takes"):
        to_torchrec(torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from_torchrec takes"):
        from_torchrec(torch.zeros(1))


@pytest.mark.parametrize("weighted", [False, True])
def test_torchrecs_collection_reads_our_kjt(weighted: bool) -> None:
    import copy

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    import fxrec

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=7, feature_names=["c"]),
    ]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    ref = copy.deepcopy(ebc)
    lengths = torch.tensor([1, 2, 0, 1, 3, 1])
    n = int(lengths.sum())
    values = torch.randint(0, 7, (n,))
    weights = torch.rand(n) if weighted else None
    ours = KeyedJaggedTensor(["b", "a", "c"], values, weights, lengths=lengths)
    theirs = to_torchrec(ours)
    opt = fxrec.optimize(ebc, (ours,))
    for got in (ebc(ours), opt(ours)):
        want = ref(theirs)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values(), want.values())
    opt(ours).values().sum().backward()
    ref(theirs).values().sum().backward()
    grads = opt.fxrec_fused.grads(ebc)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
