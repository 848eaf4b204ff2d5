"""Per-id weights that require grad: the sharded collection returns their gradient (the
reverse all-to-all of the ids exchange), equal to the unsharded collection's, on every rank,
including a rank without tables and ranks whose own weights need no gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from fxrec.distributed import shard
from fxrec.sparse import KeyedJaggedTensor
from tests.distributed.launch import run_ranks
from tests.distributed.test_sharded_dtypes import check_against_unsharded, make_batch, make_ebc

pytestmark = pytest.mark.distributed


def _with_weights(kjt: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths())


def _weight_grads(
    rank: int, world: int, n_tables: int, row_wise: tuple[str, ...], grad_ranks: tuple[int, ...]
) -> None:
    ebc = make_ebc(weighted=True, n_tables=n_tables)
    sharded = shard(copy.deepcopy(ebc), row_wise=row_wise)
    needs_grad = rank in grad_ranks
    for step in range(2):  # two steps: nothing left over from the first exchange
        ebc.zero_grad()
        sharded.zero_grad()
        kjt = make_batch(ebc, rank, True, step)
        base = kjt.weights().clone().requires_grad_(needs_grad)
        ref_base = kjt.weights().clone().requires_grad_(needs_grad)
        # Computed by the model (not leaves); each collection reads its own graph.
        got_kjt = _with_weights(kjt, base * 1.5)
        ref_kjt = _with_weights(kjt, ref_base * 1.5)
        check_against_unsharded(ebc, sharded, got_kjt, rank, 1e-5, ref_kjt)
        if needs_grad:
            assert base.grad is not None, "the weights' gradient was dropped"
            torch.testing.assert_close(base.grad, ref_base.grad, rtol=1e-5, atol=1e-6)
        else:
            assert base.grad is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_wise", [(), ("t0", "t2")])
def test_weight_grads_match_unsharded(row_wise: tuple[str, ...]) -> None:
    run_ranks(2, _weight_grads, 4, row_wise, (0, 1), deadline=90)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("grad_ranks", [(0, 1, 2, 3), (3,)])
def test_weight_grads_with_a_rank_without_tables(grad_ranks: tuple[int, ...]) -> None:
    # 4 ranks, 3 tables: rank 3 reads no weights, yet must run the backward exchange.
    run_ranks(4, _weight_grads, 3, (), grad_ranks, deadline=150)


@pytest.mark.timeout(120)
def test_weight_grads_when_only_one_rank_needs_them() -> None:
    run_ranks(2, _weight_grads, 4, (), (1,), deadline=90)
