"""JaggedTensor and KeyedTensor semantics (dense views, regroup with gradients)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxrec.sparse import JaggedTensor, KeyedTensor


@given(st.lists(st.lists(st.integers(0, 50), max_size=4), max_size=5), st.integers(0, 4))
def test_jagged_dense_round_trips(bags: list[list[int]], width: int) -> None:
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
    values = torch.tensor([i for b in bags for i in b], dtype=torch.long)
    weights = values.float() / 7
    jt = JaggedTensor(values, weights=weights, lengths=lengths)
    assert [t.tolist() for t in jt.to_dense()] == bags
    assert jt.offsets().tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    padded = jt.to_padded_dense(width, padding_value=-1)
    expect = [(b + [-1] * width)[:width] for b in bags]
    assert padded.tolist() == expect
    pw = jt.to_padded_dense_weights(width)
    assert pw is not None and pw.shape == (len(bags), width)
    by_offsets = JaggedTensor(values, weights=weights, offsets=jt.offsets())
    assert torch.equal(by_offsets.lengths(), lengths)
    again = (
        JaggedTensor.from_dense([torch.tensor(b, dtype=torch.long) for b in bags]) if bags else None
    )
    if again is not None:
        assert [t.tolist() for t in again.to_dense()] == bags


def test_padded_dense_defaults_to_longest_bag_and_keeps_trailing_dims() -> None:
    jt = JaggedTensor(torch.arange(10.0).view(5, 2), lengths=torch.tensor([2, 0, 3]))
    out = jt.to_padded_dense()
    assert out.shape == (3, 3, 2)
    assert out[2, 2].tolist() == [8.0, 9.0]
    assert out[1].abs().sum() == 0


def test_from_dense_lengths() -> None:
    dense = torch.tensor([[1, 2, 3], [4, 5, 6]])
    jt = JaggedTensor.from_dense_lengths(dense, torch.tensor([2, 0]))
    assert [t.tolist() for t in jt.to_dense()] == [[1, 2], []]


def test_jagged_to_and_empty() -> None:
    jt = JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2]))
    assert jt.to("meta").values().device.type == "meta"
    e = JaggedTensor.empty(is_weighted=True)
    assert e.stride() == 0 and e.weights().numel() == 0


def _kts() -> tuple[KeyedTensor, KeyedTensor]:
    a = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5, requires_grad=True))
    b = KeyedTensor(["c"], [1], torch.randn(4, 1, requires_grad=True))
    return a, b


def test_keyed_tensor_accessors() -> None:
    a, _ = _kts()
    assert a.offset_per_key() == [0, 2, 5]
    assert torch.equal(a["b"], a.values()[:, 2:5])
    d = a.to_dict()
    assert list(d) == ["a", "b"] and torch.equal(d["a"], a.values()[:, :2])
    with pytest.raises(KeyError):
        a["z"]
    with pytest.raises(ValueError, match="columns"):
        KeyedTensor(["a"], [3], torch.zeros(2, 4))


def test_regroup_matches_manual_cat_with_gradients() -> None:
    a, b = _kts()
    groups = [["c", "a"], ["b", "a"]]
    out = KeyedTensor.regroup([a, b], groups)
    ref = [
        torch.cat([b.values(), a.values()[:, :2]], 1),
        torch.cat([a.values()[:, 2:], a.values()[:, :2]], 1),
    ]
    for o, r in zip(out, ref):
        assert torch.equal(o, r)
    g = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, [a.values(), b.values()], g)
    want = torch.autograd.grad(ref, [a.values(), b.values()], g)
    for x, y in zip(got, want):
        assert torch.allclose(x, y)
    named = KeyedTensor.regroup_as_dict([a, b], groups, ["x", "y"])
    assert torch.equal(named["y"], ref[1])
    with pytest.raises(ValueError, match="in no KeyedTensor"):
        KeyedTensor.regroup([a], [["c"]])


def test_from_tensor_list() -> None:
    ts = [torch.randn(2, 3), torch.randn(2, 1)]
    kt = KeyedTensor.from_tensor_list(["x", "y"], ts)
    assert kt.length_per_key() == [3, 1]
    assert torch.equal(kt["y"], ts[1])
