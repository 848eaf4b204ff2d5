"""TensorDict <-> KJT: weights, variable batch, empty features, odd nested tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from tensordict import TensorDict

from fxrec.sparse import KeyedJaggedTensor, kjt_from_tensordict, kjt_to_tensordict
from tests.sparse.helpers import RefFeatures, kjt_bags, ref_bags, ref_features


def _njt(bags: list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.long)
    offsets = torch.zeros(len(bags) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    values = torch.tensor([i for b in bags for i in b], dtype=dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


@given(ref_features(max_batch=4))
def test_kjt_tensordict_round_trip(ref: RefFeatures) -> None:
    kjt = ref.kjt()
    td = kjt_to_tensordict(kjt)
    assert list(td.keys()) == ref.keys
    for k in ref.keys:
        entry = td[k]
        ids = entry["values"] if ref.wbags is not None else entry
        assert [t.tolist() for t in ids.unbind()] == ref.bags[k]
        if ref.wbags is not None:
            got = [t.tolist() for t in entry["weights"].unbind()]
            assert got == [[pytest.approx(w) for w in b] for b in ref.wbags[k]]
    back = kjt_from_tensordict(td)
    assert kjt_bags(back) == kjt_bags(kjt) == ref_bags(ref)
    assert back.length_per_key_or_none() == kjt.length_per_key()  # known without a re-read
    uniform = len(set(ref.stride_per_key())) <= 1
    assert back.variable_stride_per_key() == (not uniform)
    assert td.batch_size == (torch.Size([ref.stride_per_key()[0]]) if uniform else torch.Size([]))


def test_keys_select_and_order() -> None:
    td = TensorDict(
        {"a": _njt([[1], [2, 3]]), "b": _njt([[4], []]), "c": _njt([[], [5]])}, batch_size=[2]
    )
    kjt = kjt_from_tensordict(td, ["c", "a"])
    assert kjt.keys() == ["c", "a"]
    assert kjt.values().tolist() == [5, 1, 2, 3]
    assert kjt.lengths().tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError, match=r"\['zz'\] are not in the TensorDict"):
        kjt_from_tensordict(td, ["a", "zz"])


def test_variable_batch_keeps_each_features_rows() -> None:
    # TorchRec's maybe_td_to_kjt assigns these bags to the wrong rows; here each key keeps its own.
    td = TensorDict({"a": _njt([[1, 2]]), "b": _njt([[3], [], [4, 5]])}, batch_size=[])
    kjt = kjt_from_tensordict(td)
    assert kjt.stride_per_key() == [1, 3]
    assert [b.tolist() for b in kjt["b"].to_dense()] == [[3], [], [4, 5]]


def test_njt_with_offsets_and_lengths_is_compacted() -> None:
    values = torch.arange(10)
    offsets = torch.tensor([0, 3, 3, 7, 10])
    holes = torch.nested.nested_tensor_from_jagged(
        values, offsets=offsets, lengths=torch.tensor([2, 0, 1, 3])
    )
    td = TensorDict({"x": holes, "y": _njt([[1], [2], [3], [4]])}, batch_size=[4])
    kjt = kjt_from_tensordict(td)
    assert [b.tolist() for b in kjt["x"].to_dense()] == [[0, 1], [], [3], [7, 8, 9]]
    assert kjt.length_per_key() == [6, 4]


def test_narrowed_njt_is_handled() -> None:
    # torch.nested.narrow gives a non-contiguous NJT: offsets into a padded buffer plus lengths.
    dense = torch.arange(6).view(2, 3)
    narrowed = torch.nested.narrow(
        dense, dim=1, start=torch.tensor([0, 1]), length=torch.tensor([2, 1]), layout=torch.jagged
    )
    assert not narrowed.is_contiguous()
    kjt = kjt_from_tensordict(TensorDict({"x": narrowed}, batch_size=[2]))
    assert [b.tolist() for b in kjt["x"].to_dense()] == [[0, 1], [4]]


def test_shifted_offsets_are_handled() -> None:
    values = torch.arange(10)
    shifted = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([2, 4, 4, 7]))
    kjt = kjt_from_tensordict(TensorDict({"x": shifted}, batch_size=[3]))
    assert [b.tolist() for b in kjt["x"].to_dense()] == [[2, 3], [], [4, 5, 6]]


def test_empty_features_and_zero_length_bags() -> None:
    td = TensorDict({"a": _njt([[], [], []]), "b": _njt([[1], [], []])}, batch_size=[3])
    kjt = kjt_from_tensordict(td)
    assert kjt.length_per_key() == [0, 1]
    assert kjt.lengths().tolist() == [0, 0, 0, 1, 0, 0]
    assert kjt_from_tensordict(TensorDict({}, batch_size=[])).keys() == []
    back = kjt_to_tensordict(kjt)
    assert [t.tolist() for t in back["a"].unbind()] == [[], [], []]


def test_bad_entries_raise_naming_the_feature() -> None:
    good = _njt([[1], [2]])
    with pytest.raises(ValueError, match="feature 'd': ids must be a jagged nested tensor"):
        kjt_from_tensordict(TensorDict({"a": good, "d": torch.zeros(2, 3)}, batch_size=[2]))
    with pytest.raises(ValueError, match=r"feature 'f': ids .* must be integers"):
        kjt_from_tensordict(
            TensorDict({"a": good, "f": _njt([[1.0], [2.0]], torch.float32)}, batch_size=[2])
        )
    weighted = TensorDict(
        {"values": good, "weights": _njt([[1.0], [2.0]], torch.float32)}, batch_size=[2]
    )
    with pytest.raises(ValueError, match=r"features \['a'\] have no weights"):
        kjt_from_tensordict(TensorDict({"a": good, "w": weighted}, batch_size=[2]))
    odd_w = TensorDict(
        {"values": good, "weights": _njt([[1.0, 2.0], []], torch.float32)}, batch_size=[2]
    )
    with pytest.raises(ValueError, match="offsets differ"):
        kjt_from_tensordict(TensorDict({"w": odd_w}, batch_size=[2]))
    group = TensorDict({"x": good}, batch_size=[2])  # a nested group of features
    with pytest.raises(ValueError, match=r"feature 'grp': a sub-TensorDict .* got keys \['x'\]"):
        kjt_from_tensordict(TensorDict({"a": good, "grp": group}, batch_size=[2]))


def test_weighted_td_matches_kjt_constructor() -> None:
    ids = _njt([[1, 2], [3]])
    w = torch.nested.nested_tensor_from_jagged(torch.tensor([0.5, 1.5, 2.5]), offsets=ids.offsets())
    td = TensorDict(
        {"a": TensorDict({"values": ids, "weights": w}, batch_size=[2])}, batch_size=[2]
    )
    kjt = kjt_from_tensordict(td)
    ref = KeyedJaggedTensor(
        ["a"], torch.tensor([1, 2, 3]), torch.tensor([0.5, 1.5, 2.5]), lengths=torch.tensor([2, 1])
    )
    assert kjt_bags(kjt) == kjt_bags(ref)
