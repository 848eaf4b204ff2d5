"""Putting the owners' pooled blocks back in key order: exact, and linear in the key count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxrec
from fxrec.distributed.dist_ops import assemble_pooled, columns_of


def _case(dims: list[int], owners: list[int], world: int, batch: int):
    keys = [f"k{i}" for i in range(len(dims))]
    local = [[k for k, o in zip(keys, owners) if o == r] for r in range(world)]
    dims_per_rank = tuple(sum(d for d, o in zip(dims, owners) if o == r) for r in range(world))
    columns = columns_of(keys, dims, local)
    blocks = [torch.randn(batch, w) for w in dims_per_rank]
    # The reference: each key's columns read straight from its owner's block.
    starts = {
        k: sum(dims[keys.index(j)] for j in local[o][: local[o].index(k)])
        for k, o in zip(keys, owners)
    }
    return keys, dims_per_rank, columns, blocks, starts


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 12),
    world=st.integers(1, 4),
    batch=st.integers(0, 5),  # 0: a rank with an empty local batch
)
def test_matches_per_key_columns_and_gradients(data, n: int, world: int, batch: int) -> None:
    dims = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    owners = data.draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n))
    keys, dims_per_rank, columns, blocks, starts = _case(dims, owners, world, batch)
    flat = torch.cat([b.reshape(-1) for b in blocks]).requires_grad_(True)
    handle = SimpleNamespace(local_batch=batch)
    kt = assemble_pooled(flat, handle, dims_per_rank, columns, tuple(keys), tuple(dims))
    want = torch.cat(
        [blocks[o][:, starts[k] : starts[k] + d] for k, o, d in zip(keys, owners, dims)], 1
    )
    assert kt.keys() == keys
    assert torch.equal(kt.values(), want)
    g = torch.randn_like(want)
    kt.values().backward(g)
    # Each pooled value's gradient is the output gradient at its key's column.
    want_grad = [torch.zeros(batch, w) for w in dims_per_rank]
    pos = 0
    for k, o, d in zip(keys, owners, dims):
        want_grad[o][:, starts[k] : starts[k] + d] = g[:, pos : pos + d]
        pos += d
    assert torch.equal(flat.grad, torch.cat([w.reshape(-1) for w in want_grad]))


@pytest.mark.parametrize("n", [8, 64])
def test_kernels_do_not_grow_with_keys(n: int) -> None:
    # Keys alternate owners (as the greedy plan places equal tables): no run is contiguous.
    dims, owners = [4] * n, [i % 2 for i in range(n)]
    keys, dims_per_rank, columns, blocks, _ = _case(dims, owners, 2, 16)
    flat = torch.cat([b.reshape(-1) for b in blocks]).requires_grad_(True)
    handle = SimpleNamespace(local_batch=16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        kt = assemble_pooled(x, handle, dims_per_rank, columns, tuple(keys), tuple(dims))
        return kt.values()

    k = fxrec.count_kernels(fn, flat)
    assert k.forward_ops == {"aten::cat": 1, "aten::index_select": 1}
    # The loss seed; index_select's zeros + index_add; per owner block a copy out of the
    # strided slice of cat's gradient; the flat buffer's cat. Nothing per key.
    assert k.backward_ops == {
        "aten::ones_like": 1,
        "aten::new_zeros": 1,
        "aten::index_add": 1,
        "aten::clone": 2,
        "aten::cat": 1,
    }
