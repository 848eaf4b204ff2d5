"""A rank that dies or never arrives makes the others fail with a clear CommError within the
configured timeout, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import CommError, init_distributed, shard
from fxrec.distributed.comm import blocked
from tests.distributed.launch import free_port, run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT = 1.5


def _one_rank_absent(rank: int, world: int, die: bool) -> None:
    if rank == 1:
        if die:
            dist.barrier()  # the group has formed on rank 0 too: it dies mid-run, not at start
            os._exit(3)  # crashes without a word
        time.sleep(TIMEOUT + 3)  # alive but never reaches the collective
        return
    if die:
        dist.barrier()
    t0 = time.monotonic()
    out = torch.empty(2)
    with (
        pytest.raises(CommError, match="rank 0: ids exchange failed"),
        blocked("test", "ids exchange"),
    ):
        dist.all_to_all_single(out, torch.ones(2))
    assert time.monotonic() - t0 < TIMEOUT + 2.0


def test_rank_that_never_arrives_times_out() -> None:
    run_ranks(2, _one_rank_absent, False, timeout=TIMEOUT, deadline=30)


def test_rank_that_dies_fails_the_others() -> None:
    # rank 1 exits with status 3 mid-run; rank 0 must get its CommError (a failure of rank 0
    # would be reported as "rank 0 failed" instead).
    with pytest.raises(AssertionError, match=r"exited abnormally: \[\(1, 3\)\]"):
        run_ranks(2, _one_rank_absent, True, timeout=TIMEOUT, deadline=30)


def _absent_at_counts(rank: int, world: int) -> None:
    from tests.distributed.test_sharded_ebc import make_batch, make_ebc

    ebc = make_ebc(n_tables=2)
    sharded = shard(ebc)
    if rank == 1:
        time.sleep(TIMEOUT + 3)  # alive but never sends its counts
        return
    t0 = time.monotonic()
    with pytest.raises(CommError, match="rank 0: exchange of id counts"):
        sharded(make_batch(ebc, rank, 3, False))  # asynchronous request, blocking wait
    assert time.monotonic() - t0 < TIMEOUT + 2.0


def test_async_count_exchange_times_out() -> None:
    run_ranks(2, _absent_at_counts, timeout=TIMEOUT, deadline=30)


def _absent_in_backward(rank: int, world: int) -> None:
    from tests.distributed.test_sharded_ebc import make_batch, make_ebc

    ebc = make_ebc(n_tables=2)
    sharded = shard(ebc)
    out = sharded(make_batch(ebc, rank, 3, False)).values()  # both ranks finish the forward
    if rank == 1:
        time.sleep(TIMEOUT + 3)  # alive but never sends its gradients back
        return
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"rank 0: pooled-embedding gradient .* \(1\.5 s\)"):
        out.sum().backward()  # the reverse all-to-all, run by autograd
    assert time.monotonic() - t0 < TIMEOUT + 2.0


def test_stall_in_backward_times_out() -> None:
    run_ranks(2, _absent_in_backward, timeout=TIMEOUT, deadline=30)


def test_rendezvous_without_peers_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(CommError, match="never arrived"):
        init_distributed(
            "gloo",
            timeout=TIMEOUT,
            rank=0,
            world_size=2,
            init_method=f"tcp://127.0.0.1:{free_port()}",
        )
    assert time.monotonic() - t0 < TIMEOUT + 5.0
    assert not dist.is_initialized()
