"""Run a function on N local ranks (gloo over loopback), bounded in time.

Each rank is a forked process that joins a fresh process group on a free port; a failure
on any rank fails the test with that rank's traceback, and the whole run is killed after
``deadline`` seconds so a bug can never hang the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxrec.distributed import init_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    timeout: float,
    errors: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        init_distributed(
            "gloo",
            timeout=timeout,
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
        )
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 20.0,
    deadline: float = 60.0,
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; raise on any rank's failure."""
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, timeout, errors), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        os.kill(p.pid, 9)
        p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, tb = sorted(failures)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise AssertionError(f"ranks still running after {deadline} s (killed)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally: {bad}")
