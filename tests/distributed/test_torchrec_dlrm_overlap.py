"""The overlap rule reaches a sharded collection inside TorchRec's DLRM.

TorchRec's DLRM calls its collection from its ``SparseArch``, after the dense arch. The
capture traces through TorchRec's arches (the collection stays one call), so the exchanges
are in the graph and the rule moves them ahead of the dense arch: on the fake process group
the order is checked, on 2 gloo ranks outputs and gradients against the model as written.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxrec
from fxrec.graph.capture import capture_symbolic
from fxrec.passes.overlap import _apply, comm_kind, schedule
from tests.distributed.launch import run_ranks
from tests.distributed.test_overlap_pass import _windows, check_steps

dlrm = pytest.importorskip("torchrec.models.dlrm")
pytestmark = [
    pytest.mark.torchrec,
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered"),
    pytest.mark.filterwarnings("ignore:.*is_fx_tracing"),
]


@pytest.fixture
def fake_pg() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _collection() -> nn.Module:
    """Three tables of one dim (DLRM's interaction needs it); every rank builds the same."""
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(1234)
    tables = [EmbeddingBagConfig(f"t{i}", 11 + i, 8, [f"f{i}"]) for i in range(3)]
    return EmbeddingBagCollection(tables)


def _sharded_dlrm(ebc: nn.Module) -> nn.Module:
    from fxrec.distributed import shard

    torch.manual_seed(5)
    model = dlrm.DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=6,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
    )
    model.sparse_arch.embedding_bag_collection = shard(ebc)
    return model


def test_exchanges_move_ahead_of_the_dense_arch(fake_pg: None) -> None:
    gm = capture_symbolic(_sharded_dlrm(_collection()))
    requests = [n.name for n in gm.graph.nodes if comm_kind(n) == "request"]
    assert requests == ["request_counts", "send_ids", "request_pooled"]
    names = [n.name for n in gm.graph.nodes]
    dense = {n for n in names[: names.index("request_counts")] if n.startswith(("dense", "relu"))}
    assert len(dense) >= 3  # DLRM computes its dense arch first
    _apply(gm.graph, schedule(gm.graph))
    for request, between in _windows(gm):  # each exchange hides part of the dense arch
        assert dense & set(between), (request, between)


def _overlapped(rank: int, world: int) -> None:
    from tests.distributed.test_sharded_ebc import make_batch

    ebc = _collection()
    model = _sharded_dlrm(ebc)
    kjt = make_batch(ebc, rank, 4 + rank, False)
    dense = torch.randn(4 + rank, 6, generator=torch.Generator().manual_seed(rank))
    opt = fxrec.optimize(model, (dense, kjt), rules=["default", "overlap_comm"])
    assert opt.fxrec_report.count("overlap_comm") == 1, str(opt.fxrec_report)
    check_steps(model, opt, ebc, rank, torch.testing.assert_close)


@pytest.mark.distributed
def test_torchrec_dlrm_overlapped_on_two_gloo_ranks() -> None:
    run_ranks(2, _overlapped)
