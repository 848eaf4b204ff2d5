"""``fxrec.optimize`` on a sharded model whose ranks change local batch size at different steps.

A new input signature normally builds (and runs, to check) a new graph. On one rank alone its
collectives would meet no peer; graphs that communicate are therefore reused for inputs of the
same structure, and every rank keeps calling the same collectives in the same order.
"""

from __future__ import annotations

import pytest
import torch

import fxrec
from tests.distributed.launch import run_ranks
from tests.distributed.test_overlap_pass import check_steps, tiny_sharded_dlrm


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want)


def _uneven_steps(rank: int, world: int) -> None:
    from tests.distributed.test_sharded_ebc import make_batch

    ebc, model = tiny_sharded_dlrm(("t0",))
    first = make_batch(ebc, rank, 4, False)
    opt = fxrec.optimize(model, (torch.randn(4, 6), first), rules=["default", "overlap_comm"])
    sizes = [4, 3, 3, 5] if rank == 0 else [4, 4, 3, 2]  # rank 0 changes size a step earlier
    check_steps(model, opt, ebc, rank, _close, sizes)
    opt.eval()  # every rank switches together: one new graph each
    with torch.no_grad():
        kjt = make_batch(ebc, rank, 2 + rank, False)
        dense = torch.randn(2 + rank, 6)
        torch.testing.assert_close(opt(dense, kjt), model.eval()(dense, kjt))


@pytest.mark.distributed
def test_ranks_changing_batch_size_at_different_steps() -> None:
    run_ranks(2, _uneven_steps, deadline=120.0)


def _keys_reordered_on_one_rank(rank: int, world: int) -> None:
    """Rank 0's batch comes with its keys in another order, once: a new input structure. It
    runs the model eagerly (same collectives as rank 1's graph), not a new graph's build."""
    from tests.distributed.test_sharded_ebc import make_batch

    ebc, model = tiny_sharded_dlrm(())
    first = make_batch(ebc, rank, 4, False)
    opt = fxrec.optimize(model, (torch.randn(4, 6), first), rules=["default", "overlap_comm"])
    for step in range(3):
        kjt = make_batch(ebc, rank + 10 * step, 4, False)
        if rank == 0 and step == 1:
            kjt = kjt.permute(list(range(len(kjt.keys())))[::-1])
        dense = torch.randn(4, 6)
        got = opt(dense, kjt)
        (grad,) = torch.autograd.grad(got.sum(), model.over.weight)
        want = model(dense, kjt)
        (want_grad,) = torch.autograd.grad(want.sum(), model.over.weight)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, want_grad)
    new_structure = any("new structure" in n for n in opt.fxrec_report.notes)
    assert new_structure == (rank == 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_new_input_structure_on_one_rank() -> None:
    run_ranks(2, _keys_reordered_on_one_rank, timeout=20.0, deadline=100.0)
