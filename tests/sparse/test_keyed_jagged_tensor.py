"""KeyedJaggedTensor semantics against a plain list-of-bags reference."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxrec.sparse as S
from fxrec.sparse import JaggedTensor, KeyedJaggedTensor
from tests.sparse.helpers import RefFeatures, kjt_bags, ref_bags, ref_features


def _example(weighted: bool = True) -> KeyedJaggedTensor:
    #   f0: [0,1] []    [2]
    #   f1: [3]   [4]   [5,6,7]
    w = torch.arange(8, dtype=torch.float32) / 10 if weighted else None
    return KeyedJaggedTensor(
        ["f0", "f1"], torch.arange(8), w, lengths=torch.tensor([2, 0, 1, 1, 1, 3])
    )


def test_accessors_match_layout() -> None:
    kjt = _example()
    assert kjt.keys() == ["f0", "f1"]
    assert len(kjt) == 2
    assert kjt.stride() == 3
    assert kjt.stride_per_key() == [3, 3]
    assert not kjt.variable_stride_per_key()
    assert kjt.length_per_key() == [3, 5]
    assert kjt.offset_per_key() == [0, 3, 8]
    assert kjt.lengths_offset_per_key() == [0, 3, 6]
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 8]
    assert kjt.weights_or_none() is not None
    jt = kjt["f1"]
    assert jt.values().tolist() == [3, 4, 5, 6, 7]
    assert jt.lengths().tolist() == [1, 1, 3]
    assert jt.offsets().tolist() == [0, 1, 2, 5]
    assert torch.equal(jt.weights(), torch.tensor([0.3, 0.4, 0.5, 0.6, 0.7]))
    with pytest.raises(KeyError, match="f9"):
        kjt["f9"]
    with pytest.raises(ValueError, match="weights_or_none"):
        _example(weighted=False).weights()


def test_offsets_constructor_equals_lengths_constructor() -> None:
    a = _example()
    b = KeyedJaggedTensor.from_offsets_sync(
        ["f0", "f1"], torch.arange(8), torch.tensor([0, 2, 2, 3, 4, 5, 8]), weights=a.weights()
    )
    assert torch.equal(a.lengths(), b.lengths())
    assert b.length_per_key_or_none() == [3, 5]  # synced
    assert kjt_bags(a) == kjt_bags(b)


@given(ref_features())
def test_round_trip_to_dict_and_from_jt_dict(ref: RefFeatures) -> None:
    kjt = ref.kjt()
    assert kjt_bags(kjt) == ref_bags(ref)
    d = kjt.to_dict()
    assert list(d) == ref.keys
    for k, jt in d.items():
        assert [b.tolist() for b in jt.to_dense()] == ref.bags[k]
        assert jt.stride() == len(ref.bags[k])
    back = KeyedJaggedTensor.from_jt_dict(d)
    assert kjt_bags(back) == ref_bags(ref)
    uniform = len(set(ref.stride_per_key())) <= 1
    assert back.variable_stride_per_key() == (not uniform)


@given(ref_features(), st.data())
def test_permute_is_a_gather(ref: RefFeatures, data: st.DataObject) -> None:
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), min_size=0, max_size=7))
    out = ref.kjt().permute(order)
    assert kjt_bags(out) == ref_bags(ref.select(order))
    assert out.length_per_key() == [sum(len(b) for b in ref.bags[ref.keys[i]]) for i in order]


@contextlib.contextmanager
def _sparse_backend(name: str) -> Iterator[None]:
    S.set_backend(name)
    try:
        yield
    finally:
        S.set_backend("auto")


_BACKENDS = ["torch", *(["fbgemm"] if S.fbgemm_available() else [])]


@pytest.mark.parametrize("backend", _BACKENDS)
@given(ref_features(weighted=True), st.data())
def test_permute_routes_weight_gradients(
    backend: str, ref: RefFeatures, data: st.DataObject
) -> None:
    """Each output weight's gradient lands on its source (repeats add up, drops get zero),
    whichever backend is chosen: fbgemm's own autograd misroutes it."""
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), min_size=1, max_size=6))
    kjt = ref.kjt()
    w = kjt.weights().detach().requires_grad_(True)
    kjt = KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        w,
        lengths=kjt.lengths(),
        stride_per_key=kjt.stride_per_key() if ref.variable else None,
    )
    with _sparse_backend(backend):
        out = kjt.permute(order)
    upstream = torch.randn(out.weights().numel())
    (out.weights() * upstream).sum().backward()
    lpk = kjt.length_per_key()
    starts = [0, *itertools.accumulate(lpk)]
    expected = torch.zeros_like(w)
    pos = 0
    for i in order:
        expected[starts[i] : starts[i + 1]] += upstream[pos : pos + lpk[i]]
        pos += lpk[i]
    torch.testing.assert_close(w.grad if w.grad is not None else torch.zeros_like(w), expected)


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize(
    ("ids", "lengths"),
    [(torch.int16, torch.int64), (torch.uint8, torch.int32), (torch.int32, torch.int16)],
)
@given(ref=ref_features(), data=st.data())
def test_permute_takes_narrow_integer_dtypes(
    backend: str, ids: torch.dtype, lengths: torch.dtype, ref: RefFeatures, data: st.DataObject
) -> None:
    """Ids and lengths of any integer dtype permute (fbgemm has int32/int64 kernels only)."""
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), max_size=6))
    kjt = ref.kjt()
    narrow = KeyedJaggedTensor(
        kjt.keys(),
        kjt.values().to(ids),
        kjt.weights_or_none(),
        lengths=kjt.lengths().to(lengths),
        stride_per_key=kjt.stride_per_key() if ref.variable else None,
    )
    with _sparse_backend(backend):
        out = narrow.permute(order)
    assert out.values().dtype == ids and out.lengths().dtype == lengths
    assert kjt_bags(out) == ref_bags(ref.select(order))


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(ref=ref_features(), data=st.data())
def test_permute_takes_low_precision_weights(
    backend: str, dtype: torch.dtype, ref: RefFeatures, data: st.DataObject
) -> None:
    """fbgemm has float32/float64 weight kernels only: other weights take the torch path."""
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), max_size=6))
    kjt = ref.kjt()
    w = torch.rand(kjt.values().numel(), generator=torch.Generator().manual_seed(0))
    low = KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        w.to(dtype),
        lengths=kjt.lengths(),
        stride_per_key=kjt.stride_per_key() if ref.variable else None,
    )
    full = KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        w.to(dtype).float(),
        lengths=kjt.lengths(),
        stride_per_key=kjt.stride_per_key() if ref.variable else None,
    )
    with _sparse_backend(backend):
        out, want = low.permute(order), full.permute(order)
    assert out.weights().dtype == dtype
    assert torch.equal(out.weights().float(), want.weights())
    assert torch.equal(out.values(), want.values())


@given(ref_features(min_keys=0), st.data())
def test_split_gives_views(ref: RefFeatures, data: st.DataObject) -> None:
    kjt = ref.kjt()
    n = len(ref.keys)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    bounds = [0, *cuts, n]
    segments = [b - a for a, b in itertools.pairwise(bounds)]
    parts = kjt.split(segments)
    assert len(parts) == len(segments)
    got = [t for p in parts for t in kjt_bags(p)]
    assert got == ref_bags(ref)
    for p in parts:
        if p.values().numel():
            assert (
                p.values().untyped_storage().data_ptr() == kjt.values().untyped_storage().data_ptr()
            )


def test_split_rejects_bad_segments() -> None:
    with pytest.raises(ValueError, match="sum to the number of keys"):
        _example().split([1, 2])


@given(st.lists(ref_features(weighted=True, variable=False, max_keys=3), min_size=1, max_size=3))
def test_concat_keeps_every_key(refs: list[RefFeatures]) -> None:
    kjts = []
    for i, r in enumerate(refs):
        renamed = RefFeatures(
            [f"{k}_{i}" for k in r.keys],
            {f"{k}_{i}": v for k, v in r.bags.items()},
            {f"{k}_{i}": v for k, v in (r.wbags or {}).items()},
            r.variable,
        )
        kjts.append(renamed.kjt())
    out = KeyedJaggedTensor.concat(kjts)
    assert kjt_bags(out) == [t for k in kjts for t in kjt_bags(k)]


def test_concat_of_different_batch_sizes_is_variable() -> None:
    a = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    b = KeyedJaggedTensor(["b"], torch.arange(1), lengths=torch.tensor([1]))
    out = KeyedJaggedTensor.concat([a, b])
    assert out.stride_per_key() == [2, 1]
    assert out.variable_stride_per_key()
    with pytest.raises(ValueError, match="weighted and unweighted"):
        KeyedJaggedTensor.concat([a, _example()])


def test_variable_stride_accessors() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.arange(9),
        lengths=torch.tensor([2, 0, 1, 2, 1, 3]),
        stride_per_key=[1, 3, 2],
    )
    assert kjt.variable_stride_per_key()
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [2, 3, 4]
    assert kjt.lengths_offset_per_key() == [0, 1, 4, 6]
    assert kjt["c"].lengths().tolist() == [1, 3]
    p = kjt.permute([2, 0])
    assert p.stride_per_key() == [2, 1]
    assert p.stride() == 3  # the batch's stride, kept as TorchRec keeps it
    assert [s.stride() for s in kjt.split([1, 2])] == [3, 3]


def test_to_does_not_carry_stale_tensor_caches() -> None:
    kjt = _example()
    before = kjt.to_dict()
    moved = kjt.to("meta")
    assert moved.values().device.type == "meta"
    assert moved.length_per_key() == [3, 5]  # Python-int metadata travels
    # TorchRec's to() hands back the old device's cached dict; ours rebuilds from moved tensors.
    assert moved.to_dict()["f1"].values().device.type == "meta"
    assert before["f1"].values().device.type == "cpu"
    permuted = kjt.permute([1, 0])
    assert list(permuted.to_dict()) == ["f1", "f0"]


def test_to_dict_returns_a_fresh_dict_each_call() -> None:
    kjt = _example()
    d = kjt.to_dict()
    d.pop("f0")
    assert list(kjt.to_dict()) == ["f0", "f1"]


def test_empty_and_zero_length_bags() -> None:
    e = KeyedJaggedTensor.empty(is_weighted=True)
    assert e.keys() == [] and e.stride() == 0 and e.length_per_key() == []
    assert e.to_dict() == {}
    z = KeyedJaggedTensor(
        ["a", "b"], torch.zeros(0, dtype=torch.long), lengths=torch.zeros(6, dtype=torch.int32)
    )
    assert z.length_per_key() == [0, 0]
    assert z.stride() == 3
    assert [b.tolist() for b in z["b"].to_dense()] == [[], [], []]
    assert z.permute([1]).lengths().tolist() == [0, 0, 0]


def test_record_stream_and_pin_memory_exist() -> None:
    kjt = _example()
    assert callable(kjt.record_stream)
    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
        assert kjt.pin_memory().values().is_pinned()


def test_repr_shows_bags_for_small_inputs() -> None:
    r = repr(_example(weighted=False))
    assert "KeyedJaggedTensor(keys=['f0', 'f1']" in r
    assert "[[0, 1], [], [2]]" in r


def test_getitem_matches_jagged_tensor() -> None:
    kjt = _example()
    jt = kjt["f0"]
    assert isinstance(jt, JaggedTensor)
    assert jt.to_padded_dense().tolist() == [[0, 1], [0, 0], [2, 0]]
