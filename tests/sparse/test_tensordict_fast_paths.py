"""TensorDict fast paths: one-buffer (zero-copy) conversion, the direct builder, prepared KJTs."""

from __future__ import annotations

import torch
from hypothesis import given
from tensordict import TensorDict

from fxrec.sparse import (
    KeyedJaggedTensor,
    kjt_from_tensordict,
    kjt_to_tensordict,
    prepare_kjt,
    record_conversions,
    tensordict_from_jagged,
)
from fxrec.sparse.tensordict_interop import join_values, prepared_kjts, tensordict_parts
from tests.sparse.helpers import (
    RefFeatures,
    kjt_bags,
    ref_bags,
    ref_features,
    separate_buffers,
    td_parts,
)


def _same_kjt(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys() == b.keys()
    assert torch.equal(a.values(), b.values())
    assert torch.equal(a.lengths(), b.lengths())
    wa, wb = a.weights_or_none(), b.weights_or_none()
    assert (wa is None) == (wb is None)
    if wa is not None:
        assert torch.equal(wa, wb)
    assert a.stride_per_key() == b.stride_per_key()
    assert a.length_per_key() == b.length_per_key()
    assert a.variable_stride_per_key() == b.variable_stride_per_key()


@given(ref_features(max_keys=6, max_batch=5))
def test_one_buffer_input_is_viewed_and_equals_the_copying_path(ref: RefFeatures) -> None:
    kjt = ref.kjt()
    one = kjt_to_tensordict(kjt)  # every feature's ids are adjacent slices of kjt.values()
    viewed = kjt_from_tensordict(one)
    copied = kjt_from_tensordict(separate_buffers(one, ref.keys))
    _same_kjt(viewed, copied)
    assert kjt_bags(viewed) == ref_bags(ref)
    if kjt.values().numel():
        assert viewed.values().data_ptr() == kjt.values().data_ptr()
        assert copied.values().data_ptr() != kjt.values().data_ptr()
        if ref.wbags is not None:
            assert viewed.weights().data_ptr() == kjt.weights().data_ptr()


@given(ref_features(min_keys=2, max_keys=5, max_batch=4))
def test_one_buffer_in_another_key_order_is_copied(ref: RefFeatures) -> None:
    one = kjt_to_tensordict(ref.kjt())
    order = list(range(len(ref.keys)))[::-1]
    got = kjt_from_tensordict(one, [ref.keys[i] for i in order])
    assert kjt_bags(got) == ref_bags(ref.select(order))


def test_adjacent_addresses_but_strided_parts_are_copied() -> None:
    buf = torch.arange(20)
    strided, dense = buf[0:10:2], buf[5:10]  # dense starts where strided's 5 items "end"
    td = TensorDict(
        {
            "a": torch.nested.nested_tensor_from_jagged(strided, torch.tensor([0, 2, 5])),
            "b": torch.nested.nested_tensor_from_jagged(dense, torch.tensor([0, 4, 5])),
        },
        batch_size=[2],
    )
    kjt = kjt_from_tensordict(td)
    assert kjt.values().tolist() == [0, 2, 4, 6, 8, 5, 6, 7, 8, 9]
    assert kjt.lengths().tolist() == [2, 3, 4, 1]


@given(ref_features(max_keys=5, max_batch=4))
def test_builder_matches_the_public_constructors(ref: RefFeatures) -> None:
    public = kjt_to_tensordict(ref.kjt())
    ids, offs, wts = td_parts(public, ref.keys)
    fast = tensordict_from_jagged(ref.keys, ids, offs, wts)
    assert list(fast.keys()) == ref.keys
    assert fast.batch_size == public.batch_size
    for k in ref.keys:
        a, b = fast[k], public[k]
        pairs = (
            [(a, b)] if wts is None else [(a["values"], b["values"]), (a["weights"], b["weights"])]
        )
        for x, y in pairs:
            assert x.layout == torch.jagged and x.shape[0] == y.shape[0]
            assert [t.tolist() for t in x.unbind()] == [t.tolist() for t in y.unbind()]
        if wts is not None:  # ids and weights of a feature share one offsets tensor
            assert a["values"].offsets() is a["weights"].offsets()
    assert kjt_bags(kjt_from_tensordict(fast)) == ref_bags(ref)


@given(ref_features(max_keys=6, max_batch=5))
def test_parts_joined_are_the_conversion(ref: RefFeatures) -> None:
    # The packer copies a TensorDict's parts once into its own buffer; joined here, they must
    # be what kjt_from_tensordict gives, for separate buffers and for one buffer (a view).
    for td in (
        separate_buffers(kjt_to_tensordict(ref.kjt()), ref.keys),
        kjt_to_tensordict(ref.kjt()),
    ):
        want = kjt_from_tensordict(td)
        p = tensordict_parts(td)
        assert p.keys == ref.keys and len(p.values) == len(ref.keys)
        assert torch.equal(join_values(p.values), want.values())
        assert torch.equal(p.lengths, want.lengths())
        assert (p.weights is None) == (want.weights_or_none() is None)
        if p.weights is not None:
            assert torch.equal(join_values(p.weights), want.weights())
        assert p.stride_per_key == want.stride_per_key()
        assert p.length_per_key == want.length_per_key()


def test_parts_of_a_prepared_tensordict_are_the_prepared_kjt() -> None:
    td = _td()
    kjt = prepare_kjt(td, ["a", "b"])
    p = tensordict_parts(td, ["a", "b"])
    assert len(p.values) == 1 and p.values[0] is kjt.values() and p.lengths is kjt.lengths()
    assert len(tensordict_parts(td, ["b"]).values) == 1  # other keys: converted, one part


def test_builder_checks_its_arguments() -> None:
    import pytest

    with pytest.raises(ValueError, match="2 keys but 1 values"):
        tensordict_from_jagged(["a", "b"], [torch.arange(2)], [torch.tensor([0, 2])] * 2)
    assert tensordict_from_jagged([], [], []).batch_size == torch.Size([])


def _td() -> TensorDict:
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"], torch.arange(7), lengths=torch.tensor([1, 2, 0, 1, 3, 0])
    )
    return separate_buffers(kjt_to_tensordict(kjt), ["a", "b", "c"])


def test_prepared_kjt_is_returned_for_the_same_keys_only() -> None:
    td = _td()
    prepared = prepare_kjt(td, ["c", "a"])
    assert prepared_kjts(td) == [prepared]
    assert kjt_from_tensordict(td, ["c", "a"]) is prepared
    other = kjt_from_tensordict(td)  # other keys: converted afresh
    assert other is not prepared and other.keys() == ["a", "b", "c"]
    _same_kjt(prepared, kjt_from_tensordict(_td(), ["c", "a"]))


def test_replacing_an_entry_drops_the_prepared_kjt() -> None:
    td = _td()
    prepared = prepare_kjt(td)
    td["b"] = torch.nested.nested_tensor_from_jagged(torch.tensor([9, 9]), torch.tensor([0, 0, 2]))
    got = kjt_from_tensordict(td)
    assert got is not prepared
    assert got.values().tolist() == [0, 1, 2, 9, 9, 4, 5, 6]


def test_preparing_again_keeps_the_kjt_until_the_ids_change() -> None:
    td = _td()
    prepared = prepare_kjt(td)
    assert prepare_kjt(td) is prepared  # still valid: no second conversion
    td["a"].values().add_(1)  # an in-place edit of the ids
    again = prepare_kjt(td)
    assert again is not prepared and again.values().tolist()[0] == 1
    assert kjt_from_tensordict(td) is again


def test_replacing_a_weight_drops_the_prepared_kjt() -> None:
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    w = torch.nested.nested_tensor_from_jagged(torch.tensor([0.5, 1.5]), ids.offsets())
    sub = TensorDict({"values": ids, "weights": w}, batch_size=[2])
    td = TensorDict({"a": sub}, batch_size=[2])
    prepared = prepare_kjt(td)
    sub["weights"] = torch.nested.nested_tensor_from_jagged(torch.tensor([2.0, 3.0]), ids.offsets())
    got = kjt_from_tensordict(td)
    assert got is not prepared and got.weights().tolist() == [2.0, 3.0]


def test_record_conversions_logs_the_calls_in_its_block() -> None:
    td = _td()
    kjt_from_tensordict(td)
    with record_conversions() as log:
        kjt_from_tensordict(td, ["b"])
        prepare_kjt(td, ["a"])  # preparing is not the model converting
    kjt_from_tensordict(td)
    assert [(t is td, keys) for t, keys in log] == [(True, ["b"])]
