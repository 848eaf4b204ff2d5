"""CommError messages quote the timeout the process group really enforces: calling
``init_distributed(timeout=...)`` on a group that already exists changes neither."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fxrec.distributed import CommError, init_distributed
from fxrec.distributed.comm import blocked, group_timeout, translated
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT = 1.5


def _init_again(rank: int, world: int) -> None:
    init_distributed(timeout=600)  # the group exists (formed with TIMEOUT): left as it is
    assert group_timeout() == TIMEOUT
    if rank == 1:
        time.sleep(TIMEOUT + 3)  # alive but never reaches the collective
        return
    t0 = time.monotonic()
    with (
        pytest.raises(CommError, match=r"timeout \(1\.5 s\)") as info,
        blocked("test", "ids exchange"),
    ):
        dist.all_to_all_single(torch.empty(2), torch.ones(2))
    assert "600" not in str(info.value)
    assert time.monotonic() - t0 < TIMEOUT + 2.0


@pytest.mark.timeout(60)
def test_error_quotes_the_groups_timeout_after_init_again() -> None:
    run_ranks(2, _init_again, timeout=TIMEOUT, deadline=30)


def test_without_a_group_the_timeout_is_unknown() -> None:
    assert not dist.is_initialized()
    assert group_timeout() is None
    with (
        pytest.raises(CommError, match="after the process group's timeout;"),
        translated("an exchange"),
    ):
        raise RuntimeError("peer went away")


def _failed_in_a_compiled_frame(rank: int, world: int) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        with translated("an exchange"):
            if y.sum() > 0:  # a collective that failed, as dynamo traces its error path
                raise RuntimeError("peer went away")
        return y

    with pytest.raises(CommError, match=r"timeout \(1\.5 s\)"):
        torch.compile(step, backend="eager")(torch.ones(3))


@pytest.mark.timeout(60)
def test_error_in_a_compiled_frame_is_a_comm_error() -> None:
    run_ranks(1, _failed_in_a_compiled_frame, timeout=TIMEOUT, deadline=30)
