"""Exchanges a pipeline starts early are taken over by the request for the same KJT object
and the same collection (layout), each exactly once, and can be forgotten."""

from __future__ import annotations

import gc

import torch

from fxrec.distributed import dist_ops
from fxrec.sparse import KeyedJaggedTensor


def _layout(keys: tuple[str, ...]) -> dist_ops.IdsLayout:
    return dist_ops.IdsLayout(keys, (len(keys),), keys, "0")


def _handle(layout: dist_ops.IdsLayout) -> dist_ops.CountsHandle:
    t = torch.zeros(2, dtype=torch.long)
    return dist_ops.CountsHandle(layout, None, None, t, t, [0], 0)


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 0, 2, 0]))


def test_two_collections_reading_one_kjt_take_their_own_exchange() -> None:
    kjt, other = _kjt(), _kjt()
    la, lb = _layout(("a",)), _layout(("b",))
    ha, hb = _handle(la), _handle(lb)
    dist_ops.started_early(kjt, ha)
    dist_ops.started_early(kjt, hb)
    assert dist_ops._take_early(other, la) is None  # another object with equal contents
    assert dist_ops._take_early(kjt, lb) is hb
    assert dist_ops._take_early(kjt, la) is ha
    assert dist_ops._take_early(kjt, la) is None  # taken once
    dist_ops.started_early(kjt, ha)
    dist_ops.forget_early(kjt, la)
    assert dist_ops._take_early(kjt, la) is None
    assert not dist_ops._EARLY


def test_a_pipeline_dropped_without_close_leaves_no_exchange() -> None:
    from fxrec.train.sparse_dist import InputDist

    kjt, layout = _kjt(), _layout(("a",))
    handle = _handle(layout)
    dist = InputDist(torch.nn.Linear(1, 1))
    dist._pending[0] = (kjt, (kjt, handle))
    dist_ops.started_early(kjt, handle)
    del dist
    gc.collect()
    assert dist_ops._take_early(kjt, layout) is None
