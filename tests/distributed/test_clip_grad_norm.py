"""Gradient clipping of a sharded model under DDP: torch's clip_grad_norm_ sees one rank's
tables, so each rank scales the DDP-synced dense gradients by its own factor and the ranks
drift apart silently. fxrec.distributed.clip_grad_norm_ clips by the whole model's norm:
the same steps as clipping the unsharded model on the global batch, on every rank."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxrec.distributed import clip_grad_norm_
from fxrec.sparse import KeyedJaggedTensor
from tests.distributed.launch import run_ranks

KEYS = ["f0", "f1", "f2"]
ROWS, DIM, DENSE, BATCH, MAX_NORM = 11, 4, 3, 4, 0.05


class _Ranker(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense_arch = nn.Linear(DENSE, 4)
        self.over = nn.Linear(4 + DIM * len(KEYS), 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(torch.cat([self.dense_arch(dense), self.ebc(sparse).values()], 1))


def _models(row_wise: tuple[str, ...], sparse: bool = False) -> tuple[nn.Module, nn.Module]:
    """The unsharded model, and the same model with its collection sharded (its tables'
    gradients ``sparse`` or not)."""
    from fxrec.distributed import shard
    from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name=f"t{i}", feature_names=[k])
        for i, k in enumerate(KEYS)
    ]
    ref = _Ranker(EmbeddingBagCollection(tables=tables))
    model = copy.deepcopy(ref)
    model.ebc = EmbeddingBagCollection(tables=tables, sparse=sparse) if sparse else model.ebc
    model.ebc = shard(model.ebc, row_wise=row_wise)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(step: int, world: int) -> list[tuple[torch.Tensor, list, list]]:
    """Each rank's (dense, per-key lengths, per-key ids) for ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(world):
        lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in KEYS]
        ids = [torch.randint(0, ROWS, (int(n.sum()),), generator=g) for n in lengths]
        out.append((torch.randn(BATCH, DENSE, generator=g) * 3, lengths, ids))
    return out


def _kjt(parts: list[tuple[torch.Tensor, list, list]]) -> KeyedJaggedTensor:
    """The KJT of these ranks' rows, one after another in each key."""
    keys = range(len(KEYS))
    values = torch.cat([p[2][k] for k in keys for p in parts])
    lengths = torch.cat([p[1][k] for k in keys for p in parts])
    return KeyedJaggedTensor(KEYS, values, lengths=lengths)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean().mul(10)


def _reference_step(ref: nn.Module, sgd: torch.optim.Optimizer, parts: list, p: float) -> float:
    """One clipped step of the unsharded model on the global batch."""
    sgd.zero_grad()
    _loss(ref(torch.cat([d for d, _, _ in parts]), _kjt(parts))).backward()
    for t in ref.ebc.parameters():  # a table's gradient is the sum of every rank's batch's
        t.grad.mul_(len(parts))  # (the dense ones DDP averages): the same convention here
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, p)
    sgd.step()
    return float(norm)


def _clips_like_one_process(rank: int, world: int, mode: str, row_wise: tuple, p: float) -> None:
    import fxrec
    from fxrec.distributed import ignore_sharded_in_ddp

    ref, model = _models(row_wise, sparse=mode == "sparse")
    first = _batch(0, world)[rank]
    run = fxrec.optimize(model, (first[0], _kjt([first]))) if mode == "optimized" else model
    ddp = DistributedDataParallel(ignore_sharded_in_ddp(run) if mode != "optimized" else run)
    sgd = torch.optim.SGD(run.parameters(), lr=0.5)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        parts = _batch(step, world)
        sgd.zero_grad()
        _loss(ddp(parts[rank][0], _kjt([parts[rank]]))).backward()
        norm = clip_grad_norm_(ddp, MAX_NORM, p)
        sgd.step()
        want = _reference_step(ref, ref_sgd, parts, p)
        assert want > 2 * MAX_NORM  # the step is clipped
        assert float(norm) == pytest.approx(want, rel=1e-5)
    _assert_same_parameters(model, ref, row_wise)
    _assert_ranks_agree(model.over.weight, world)


def _assert_same_parameters(model: nn.Module, ref: nn.Module, row_wise: tuple) -> None:
    """Dense weights, this rank's tables and row blocks: the unsharded model's."""
    want = ref.state_dict()
    got = model.state_dict()
    assert got, "no parameters compared"
    for key, value in got.items():
        expected = want[key]
        table = key.split(".")[-2]
        rows = model.ebc.row_range(table) if table in row_wise else None
        if rows is not None:
            expected = expected[rows[0] : rows[1]]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


def _assert_ranks_agree(weight: torch.Tensor, world: int) -> None:
    every = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(every, weight.detach().contiguous())
    for other in every[1:]:
        assert torch.equal(other, every[0])


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "row_wise", "p"),
    [
        ("optimized", (), 2.0),
        ("plain", ("t1",), 2.0),
        ("optimized", ("t1",), math.inf),
        ("sparse", ("t1",), 2.0),
    ],
)
def test_sharded_clipping_equals_clipping_the_unsharded_model(
    mode: str, row_wise: tuple, p: float
) -> None:
    run_ranks(2, _clips_like_one_process, mode, row_wise, p, timeout=30.0, deadline=90.0)


def test_parameters_without_their_model_are_refused() -> None:
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    with pytest.raises(TypeError, match="model="):
        clip_grad_norm_([w], 1.0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(nn.Linear(2, 2), 1.0, norm_type=0)


class _Bags(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.bags = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.over = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.over(self.bags(ids))


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_sparse_gradients_clip_like_their_dense_equivalent(p: float) -> None:
    """``sparse=True`` tables (torch's clip_grad_norm_ raises on them: norms have no sparse
    kernels); ids repeat within the batch, so their gradient rows must be summed first."""
    torch.manual_seed(0)
    ref, model = _Bags(sparse=False), _Bags(sparse=True)
    model.load_state_dict(ref.state_dict())
    sgd, ref_sgd = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, ROWS // 2, (BATCH, 5), generator=g)  # repeated ids
        norms = []
        for m, opt, clip in ((model, sgd, clip_grad_norm_), (ref, ref_sgd, None)):
            opt.zero_grad()
            _loss(m(ids)).backward()
            if clip is None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, p)))
            else:
                norms.append(float(clip(m, MAX_NORM, p)))
            opt.step()
        assert norms[1] > 2 * MAX_NORM  # the step is clipped
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
