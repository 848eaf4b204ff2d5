"""Combined inputs: pack on the host, ``permute_and_split`` on the device side."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxrec.sparse as S
from fxrec.sparse import (
    CombinedFeatures,
    JaggedTensor,
    combined_to_kjt,
    kjt_to_tensordict,
    pack_features,
    permute_and_split,
    unpack_features,
)
from fxrec.sparse.ops import permute_and_split_impl
from fxrec.sparse.permute import fbgemm_available
from tests.sparse.helpers import RefFeatures, kjt_bags, ref_bags, ref_features

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu not installed")


def _reference(cf: CombinedFeatures, order: list[int]) -> list[tuple]:
    """Per-feature tensors by plain slicing (what the op must reproduce)."""
    lpk, spk = list(cf.length_per_key), list(cf.stride_per_key)
    vs = torch.split(cf.values, lpk)
    ls = torch.split(cf.lengths, spk)
    ws = torch.split(cf.weights, lpk) if cf.weights is not None else None
    return [(vs[o], ls[o], None if ws is None else ws[o]) for o in order]


@given(ref_features(), st.data())
def test_permute_and_split_matches_slicing(ref: RefFeatures, data: st.DataObject) -> None:
    cf = pack_features(ref.kjt())
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), max_size=7))
    vals, lens, wts = permute_and_split(
        cf.values, cf.lengths, cf.weights, cf.stride_per_key, cf.length_per_key, order
    )
    assert len(vals) == len(lens) == len(order)
    assert len(wts) == (len(order) if cf.weights is not None else 0)
    for i, (v, ln, w) in enumerate(_reference(cf, order)):
        assert torch.equal(vals[i], v) and torch.equal(lens[i], ln)
        if w is not None:
            assert torch.equal(wts[i], w)


@needs_fbgemm
@given(ref_features(max_batch=5, max_bag=4), st.data())
def test_fbgemm_and_torch_backends_agree(ref: RefFeatures, data: st.DataObject) -> None:
    cf = pack_features(ref.kjt())
    order = data.draw(st.lists(st.integers(0, len(ref.keys) - 1), max_size=7))
    args = (cf.values, cf.lengths, cf.weights, cf.stride_per_key, cf.length_per_key, order)
    a = permute_and_split_impl(*args, backend="fbgemm")
    b = permute_and_split_impl(*args, backend="torch")
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert x.dtype == y.dtype and torch.equal(x, y)
    # And the KJT permute built on the same helper.
    kjt = ref.kjt()
    S.set_backend("torch")
    try:
        p_torch = kjt.permute(order)
    finally:
        S.set_backend("auto")
    S.set_backend("fbgemm")
    try:
        p_fb = kjt.permute(order)
    finally:
        S.set_backend("auto")
    assert kjt_bags(p_torch) == kjt_bags(p_fb)


def test_outputs_own_their_memory() -> None:
    cf = pack_features(
        S.KeyedJaggedTensor(["a", "b"], torch.arange(6), lengths=torch.tensor([1, 2, 2, 1]))
    )
    for order in ([1, 0], [0, 0, 1]):
        vals, lens, _ = permute_and_split(
            cf.values, cf.lengths, None, cf.stride_per_key, cf.length_per_key, order
        )
        ptrs = {t.untyped_storage().data_ptr() for t in vals + lens}
        assert len(ptrs) == 2 * len(order)
        assert cf.values.untyped_storage().data_ptr() not in ptrs


def test_weights_gradient_accumulates_over_repeats() -> None:
    w = torch.rand(6, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    lengths = torch.tensor([1, 2, 2, 1])
    order = [1, 0, 1]
    _, _, wts = permute_and_split(torch.arange(6), lengths, w, [2, 2], [3, 3], order)
    ref = [w_ref[3:6], w_ref[0:3], w_ref[3:6]]
    coeffs = [torch.randn(3) for _ in order]
    sum((c * t).sum() for c, t in zip(coeffs, wts)).backward()
    sum((c * t).sum() for c, t in zip(coeffs, ref)).backward()
    assert torch.allclose(w.grad, w_ref.grad)
    # A feature that is dropped gets zero gradient.
    w.grad = None
    _, _, wts = permute_and_split(torch.arange(6), lengths, w, [2, 2], [3, 3], [1])
    wts[0].sum().backward()
    assert w.grad.tolist()[:3] == [0.0, 0.0, 0.0]


def test_opcheck() -> None:
    base = (torch.arange(6), torch.tensor([1, 2, 2, 1]))
    meta = ([2, 2], [3, 3], [1, 0, 1])
    op = torch.ops.fxrec.permute_and_split.default
    torch.library.opcheck(op, (*base, torch.rand(6), *meta))
    torch.library.opcheck(op, (*base, None, *meta))
    # opcheck's AOT test sums int and float outputs together, which torch refuses; the
    # backward is covered under aot_eager below instead.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, (*base, torch.rand(6, requires_grad=True), *meta), test_utils=utils)


def test_weights_gradient_under_aot_autograd() -> None:
    def f(weights: torch.Tensor) -> torch.Tensor:
        _, _, wts = permute_and_split(
            torch.arange(6), torch.tensor([1, 2, 2, 1]), weights, [2, 2], [3, 3], [1, 0, 1]
        )
        return sum((t * (i + 1)).sum() for i, t in enumerate(wts))

    w = torch.rand(6, requires_grad=True)
    w2 = w.detach().clone().requires_grad_(True)
    torch.compile(f, backend="aot_eager", fullgraph=True)(w).backward()
    f(w2).backward()
    assert torch.equal(w.grad, w2.grad)


def test_single_node_under_symbolic_trace() -> None:
    def f(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor):  # type: ignore[no-untyped-def]
        return permute_and_split(values, lengths, weights, [2, 2], [3, 3], [1, 0])

    gm = torch.fx.symbolic_trace(f)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.fxrec.permute_and_split.default] or [
        n.target for n in calls
    ] == [torch.ops.fxrec.permute_and_split]
    args = (torch.arange(6), torch.tensor([1, 2, 2, 1]), torch.rand(6))
    for x, y in zip(gm(*args), f(*args)):
        assert all(torch.equal(a, b) for a, b in zip(x, y))


def test_compiles_fullgraph_with_eager_backend() -> None:
    S.fbgemm_available()  # import outside the compiled region

    def f(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor):  # type: ignore[no-untyped-def]
        vals, lens, wts = permute_and_split(values, lengths, weights, [2, 2], [3, 3], [1, 0, 1])
        return [v * 2 for v in vals], lens, [w.sum() for w in wts]

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    args = (torch.arange(6), torch.tensor([1, 2, 2, 1]), torch.rand(6))
    got, want = compiled(*args), f(*args)
    for xs, ys in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(xs, ys))


def test_pack_from_kjt_tensordict_and_dict_agree() -> None:
    kjt = S.KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.arange(9),
        torch.rand(9),
        lengths=torch.tensor([2, 0, 1, 2, 1, 3]),
        stride_per_key=[1, 3, 2],
    )
    from_kjt = pack_features(kjt)
    assert from_kjt.values is kjt.values()  # already combined: no copy
    from_td = pack_features(kjt_to_tensordict(kjt))
    from_dict = pack_features(kjt.to_dict())
    for cf in (from_td, from_dict):
        assert cf.keys == from_kjt.keys
        assert cf.stride_per_key == (1, 3, 2) and cf.length_per_key == (2, 3, 4)
        assert torch.equal(cf.values, from_kjt.values) and torch.equal(cf.lengths, from_kjt.lengths)
        assert torch.equal(cf.weights, from_kjt.weights)
    sub = pack_features(kjt, ["c", "a"])
    assert sub.keys == ("c", "a") and sub.values.tolist() == [5, 6, 7, 8, 0, 1]
    for order in (["b", "a", "b"], ["c", "c"]):  # a repeated key repeats, whatever the input
        want = pack_features(kjt, order)
        for features in (kjt_to_tensordict(kjt), kjt.to_dict()):
            got = pack_features(features, order)
            assert got.keys == want.keys == tuple(order)
            assert got.stride_per_key == want.stride_per_key
            assert torch.equal(got.values, want.values) and torch.equal(got.lengths, want.lengths)
    with pytest.raises(ValueError, match="'zz'"):
        pack_features(kjt, ["zz"])
    with pytest.raises(ValueError, match="pack_features takes"):
        pack_features([1, 2])  # type: ignore[arg-type]


@given(ref_features(), st.data())
def test_combine_round_trips(ref: RefFeatures, data: st.DataObject) -> None:
    cf = pack_features(ref.kjt())
    assert kjt_bags(combined_to_kjt(cf)) == ref_bags(ref)
    names = data.draw(st.permutations(ref.keys))
    jts = unpack_features(cf, names)
    assert list(jts) == list(names)
    for k, jt in jts.items():
        assert isinstance(jt, JaggedTensor)
        assert [b.tolist() for b in jt.to_dense()] == ref.bags[k]
    assert kjt_bags(combined_to_kjt(cf, names)) == ref_bags(
        ref.select([ref.keys.index(k) for k in names])
    )
    moved = cf.to("meta", non_blocking=True)
    assert moved.values.device.type == "meta" and moved.length_per_key == cf.length_per_key


def test_combined_copy_count_is_constant() -> None:
    from fxrec.measure import count_kernels

    n = 4
    kjt = S.KeyedJaggedTensor(
        [f"f{i}" for i in range(n)],
        torch.arange(8),
        torch.rand(8),
        lengths=torch.ones(8, dtype=torch.long),
    )
    cf = pack_features(kjt)
    jts = list(kjt.to_dict().values())

    def copies(fn) -> int:  # type: ignore[no-untyped-def]
        ops = count_kernels(fn, backward=False).forward_ops
        return sum(v for k, v in ops.items() if k in ("aten::_to_copy", "aten::copy_"))

    assert copies(lambda: cf.to("meta", non_blocking=True)) == 3
    assert copies(lambda: [jt.to("meta", non_blocking=True) for jt in jts]) == 3 * n


def test_combined_features_is_a_pytree() -> None:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    cf = pack_features(S.KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2])))
    leaves, spec = tree_flatten(cf)
    assert sum(isinstance(x, torch.Tensor) for x in leaves) == 2
    back = tree_unflatten(leaves, spec)
    assert back.keys == cf.keys and back.length_per_key == cf.length_per_key


@given(ref_features(), st.data())
def test_kjt_slice_is_kept_with_the_features(ref: RefFeatures, data: st.DataObject) -> None:
    """A slice asked again is the same KJT (how a pipeline's early exchange is matched with
    the graph's); it holds exactly those features, weights only when asked for."""
    import copy
    import pickle

    cf = pack_features(ref.kjt())
    n = len(ref.keys)
    start = data.draw(st.integers(0, n))
    count = data.draw(st.integers(0, n - start))
    weighted = data.draw(st.booleans())
    kjt = cf.kjt_slice(start, count, weighted)
    assert cf.kjt_slice(start, count, weighted) is kjt
    picked = list(range(start, start + count))
    got, want = kjt_bags(kjt), ref_bags(ref.select(picked))
    if not weighted:
        got, want = [(k, b) for k, b, _ in got], [(k, b) for k, b, _ in want]
    assert got == want
    assert (kjt.weights_or_none() is not None) == (weighted and cf.weights is not None)
    assert kjt.values().untyped_storage().data_ptr() == cf.values.untyped_storage().data_ptr()
    key = (start, count, weighted and cf.weights is not None)
    assert cf.kept_slices() == {key: kjt}
    for other in (copy.deepcopy(cf), pickle.loads(pickle.dumps(cf)), cf.to("cpu")):
        assert other.kept_slices() == {}
        assert other.kjt_slice(start, count, weighted) is not kjt


def test_kjt_slice_is_not_kept_while_compiling() -> None:
    cf = pack_features(S.KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2])))

    @torch.compile(backend="eager", fullgraph=True)
    def lengths_of(values, lengths):
        c = CombinedFeatures(("a",), values, lengths, None, (2,), (3,))
        return c.kjt_slice(0, 1).lengths() + 1

    torch.testing.assert_close(lengths_of(cf.values, cf.lengths), cf.lengths + 1)
