"""A sharded model that ``fxrec.optimize`` captures with dynamo (a forward hook on its dense
tower stops symbolic tracing): no rank may run the model a second time on its own, which
would send its collectives twice and abort every rank ("collective mismatch").

* Local batch sizes that vary make dynamo recompile the sparse plumbing between the
  collectives until its recompile limit: those frames run eagerly, the call is not replayed.
* An id outside its table is refused before the exchange, as without dynamo: that rank
  raises a ValueError naming it, its peers a MissingBatch at once, and training goes on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_ranks

KEYS = ["f0", "f1", "f2"]
SIZES = [[3, 2], [4, 1], [2, 5], [1, 3], [5, 4], [2, 2]]  # local batch per step, per rank


class _Dlrm(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.ebc = ebc
        self.top = nn.Linear(16, 1)

    def forward(self, dense: torch.Tensor, kjt: object) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense), self.ebc(kjt).values()], 1))


def _model() -> _Dlrm:
    from fxrec.distributed import shard
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=23, embedding_dim=4, name="t0", feature_names=["f0"]),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["f1"]),
        EmbeddingBagConfig(num_embeddings=9, embedding_dim=4, name="t2", feature_names=["f2"]),
    ]
    model = _Dlrm(EmbeddingBagCollection(tables))
    model.bottom.register_forward_hook(lambda m, i, o: o)  # activation logging, say
    model.ebc = shard(model.ebc, row_wise=["t0"])
    return model


def _batch(step: int, rank: int, bad: bool = False) -> tuple[torch.Tensor, object]:
    from fxrec.sparse import KeyedJaggedTensor

    b = SIZES[step % len(SIZES)][rank]
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(1, 3, (len(KEYS) * b,), generator=g)
    ids = torch.randint(0, 7, (int(lengths.sum()),), generator=g)
    if bad:
        ids[int(lengths[:b].sum())] = 7  # f1's first id: t1 has 7 rows
    return torch.randn(b, 4, generator=g), KeyedJaggedTensor(KEYS, ids, lengths=lengths)


def _varying_batches(rank: int, world: int) -> None:
    import fxrec

    torch._dynamo.reset()
    # reached within a few steps, and on one rank only, as where only its batch sizes vary
    torch._dynamo.config.recompile_limit = 2 if rank == 0 else 64
    model = _model()
    opt = fxrec.optimize(model, _batch(0, rank))
    assert opt.fxrec_report.capture == "dynamo"
    for step in range(len(SIZES)):
        dense, kjt = _batch(step, rank)
        out = opt(dense, kjt)
        out.sum().backward()
        with torch.no_grad():  # the same sharded model, run as written: the same exchanges
            torch.testing.assert_close(out, model(dense, kjt), rtol=1e-5, atol=1e-6)


def _bad_id(rank: int, world: int) -> None:
    import fxrec
    from fxrec.distributed import MissingBatch

    torch._dynamo.reset()
    opt = fxrec.optimize(_model(), _batch(0, rank))
    assert opt.fxrec_report.capture == "dynamo"
    for step in range(3):
        dense, kjt = _batch(step, rank, bad=step == 1 and rank == 1)
        if step != 1:
            opt(dense, kjt).sum().backward()
            continue
        expected = (ValueError, "outside table 't1'") if rank == 1 else (MissingBatch, r"\[1\]")
        with pytest.raises(expected[0], match=expected[1]):
            opt(dense, kjt)


@pytest.mark.distributed
def test_varying_local_batches_never_replay_a_call() -> None:
    run_ranks(2, _varying_batches, timeout=15.0, deadline=120.0)


@pytest.mark.distributed
def test_an_id_outside_its_table_is_refused_before_the_exchange() -> None:
    run_ranks(2, _bad_id, timeout=15.0, deadline=120.0)


class _TwoCollections(nn.Module):
    def __init__(self, e1: nn.Module, e2: nn.Module) -> None:
        super().__init__()
        self.e1, self.e2 = e1, e2

    def forward(self, kjt: object) -> torch.Tensor:
        return torch.cat([self.e1(kjt).values(), self.e2(kjt).values()], 1)


def _compiled_with_an_empty_batch(rank: int, world: int) -> None:
    import copy

    import fxrec
    from fxrec.distributed import shard
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
    from fxrec.sparse import KeyedJaggedTensor

    torch._dynamo.reset()
    torch.manual_seed(0)
    e1 = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name=f"t{i}", feature_names=[k])
            for i, k in enumerate(KEYS)
        ]
    )
    e2 = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=10, embedding_dim=2, name="s", feature_names=["f0", "f2"]
            )
        ]
    )
    ref = _TwoCollections(copy.deepcopy(e1), copy.deepcopy(e2))
    model = torch.compile(
        _TwoCollections(shard(e1), shard(e2)), backend=fxrec.compile_backend("eager")
    )
    for step, batch in enumerate([[3, 2], [3, 5], [2, 0], [4, 3]]):
        g = torch.Generator().manual_seed(10 * step + rank)
        lengths = torch.randint(1, 3, (len(KEYS) * batch[rank],), generator=g)
        values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(KEYS, values, lengths=lengths)
        torch.testing.assert_close(model(kjt), ref(kjt), rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_compiled_sharded_collections_take_an_empty_local_batch() -> None:
    run_ranks(2, _compiled_with_an_empty_batch, timeout=15.0, deadline=150.0)
