"""Pytree registration, FX tracing and torch.compile with the sparse types."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from torch.utils._pytree import (
    tree_flatten,
    tree_map,
    tree_structure,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

import fxrec.sparse as S
from fxrec.measure import count_kernels
from fxrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tests.sparse.helpers import RefFeatures, kjt_bags, ref_bags, ref_features


@given(ref_features())
def test_kjt_pytree_round_trip(ref: RefFeatures) -> None:
    kjt = ref.kjt()
    leaves, spec = tree_flatten({"x": kjt, "kt": KeyedTensor(["a"], [2], torch.zeros(3, 2))})
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert len(tensors) == (4 if ref.wbags is not None else 3)
    back = tree_unflatten(leaves, spec)
    assert kjt_bags(back["x"]) == ref_bags(ref)
    assert back["x"].variable_stride_per_key() == kjt.variable_stride_per_key()
    doubled = tree_map(lambda t: t * 2 if t is not None and t.is_floating_point() else t, kjt)
    if ref.wbags is not None:
        assert torch.equal(doubled.weights(), kjt.weights() * 2)


def test_spec_ignores_per_batch_figures() -> None:
    a = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 0, 2, 0]))
    b = KeyedJaggedTensor(["a", "b"], torch.arange(5), lengths=torch.tensor([1, 1, 2, 1]))
    a.offsets()  # a cached offset must not change the spec either
    assert tree_flatten(a)[1] == tree_flatten(b)[1]


def _empty_kjt() -> KeyedJaggedTensor:
    empty = torch.zeros(0, dtype=torch.long)
    return KeyedJaggedTensor([], empty, lengths=empty, stride=4)


def _explicit_stride_vbe_kjt() -> KeyedJaggedTensor:
    lengths = torch.tensor([1, 2, 2])
    return KeyedJaggedTensor(
        ["a", "b"], torch.arange(5), lengths=lengths, stride_per_key=[1, 2], stride=6
    )


@pytest.mark.parametrize("make", [_empty_kjt, _explicit_stride_vbe_kjt], ids=["no_keys", "vbe"])
def test_a_stride_the_lengths_do_not_carry_survives_pytrees(make) -> None:  # type: ignore[no-untyped-def]
    """A KJT with no keys has a batch size its (empty) lengths do not carry, and so has a
    variable batch given a stride above its per-key batches: both came back with another
    stride (4 -> 0, 6 -> 2) from tree_map, and from a saved program's spec."""
    kjt = make()
    back = tree_map(lambda t: t, {"sparse": kjt})["sparse"]
    assert back.stride() == kjt.stride() and back.keys() == kjt.keys()
    spec = tree_structure(kjt)
    loaded = treespec_loads(treespec_dumps(spec))
    assert loaded == spec
    assert tree_unflatten(tree_flatten(kjt)[0], loaded).stride() == kjt.stride()


def test_jt_pytree() -> None:
    jt = JaggedTensor(torch.arange(3), weights=torch.rand(3), lengths=torch.tensor([1, 2]))
    leaves, spec = tree_flatten(jt)
    back = tree_unflatten(leaves, spec)
    assert torch.equal(back.offsets(), jt.offsets()) and torch.equal(back.weights(), jt.weights())


def test_kernel_counter_sees_kjt_outputs() -> None:
    w = torch.rand(5, requires_grad=True)

    def f() -> KeyedJaggedTensor:
        with S.validation_disabled():
            return KeyedJaggedTensor(["a"], torch.arange(5), w * 2, lengths=torch.tensor([2, 3]))

    kc = count_kernels(f)
    assert kc.backward > 0  # the weights inside the KJT reached the loss


def test_compile_fullgraph_uses_kjt_methods() -> None:
    S.fbgemm_available()
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.arange(9),
        torch.rand(9),
        lengths=torch.tensor([2, 0, 1, 2, 1, 3]),
        stride_per_key=[1, 3, 2],
    )

    def f(k: KeyedJaggedTensor):  # type: ignore[no-untyped-def]
        d = k.to_dict()
        p = k.permute([2, 0])
        return d["c"].weights() * 2, p.values(), p.lengths(), k["b"].offsets()

    got = torch.compile(f, backend="eager", fullgraph=True)(kjt)
    for x, y in zip(got, f(kjt)):
        assert torch.equal(x, y)


def test_compile_builds_kjt_inside_graph() -> None:
    def g(values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(["a", "b"], values + 1, lengths=lengths)

    v, ln = torch.arange(6), torch.tensor([1, 2, 2, 1])
    out = torch.compile(g, backend="eager", fullgraph=True)(v, ln)
    assert kjt_bags(out) == kjt_bags(g(v, ln))
