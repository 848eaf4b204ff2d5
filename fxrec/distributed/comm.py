"""Process-group set-up, clear communication errors, and blocked-time accounting.

Every collective fxrec issues goes through here so that

* a peer that died or never arrived becomes a :class:`CommError` naming the operation and
  the group's timeout, raised on the surviving ranks within that timeout (gloo and NCCL
  enforce the process group's ``timeout``; we only translate their messages);
* the time a rank spends *blocked* on communication in the forward pass (inside a wait, or
  in a synchronous exchange) is accumulated in :data:`stats`, which is what the overlap
  benchmark reports (the backward all-to-all is only translated: :func:`translated`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "CommError",
    "MissingBatch",
    "CommStats",
    "blocked",
    "default_backend",
    "group_name",
    "group_timeout",
    "init_distributed",
    "stats",
    "translated",
]

DEFAULT_TIMEOUT_S = 60.0


class CommError(RuntimeError):
    """A collective did not complete: a peer rank died, hung, or never reached this step."""


class MissingBatch(CommError):
    """Ranks announced they have no batch for this step; ``ended``: a rank's data ended
    (rather than one batch failing to load), so its peers end too."""

    def __init__(self, message: str, ranks: list[int], ended: bool) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.ended = ended


@dataclass
class CommStats:
    """Seconds each kind of communication kept this rank blocked (since the last reset)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


stats = CommStats()


@torch.compiler.disable  # a process group's backend is opaque to dynamo: read it eagerly
def group_timeout(pg: dist.ProcessGroup | None = None) -> float | None:
    """The timeout (seconds) ``pg`` (default: the world group) really enforces, read from its
    backend; None when it cannot be read. What error messages quote: the value asked of
    :func:`init_distributed` is not applied to a group that already existed."""
    try:
        pg = pg if pg is not None else dist.group.WORLD
        if pg is None:
            return None
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # another backend or torch version: say it is unknown
        return None


def _timeout_text() -> str:
    seconds = group_timeout() if dist.is_initialized() else None
    if seconds is None:
        return "the process group's timeout"
    return f"the process-group timeout ({seconds:g} s)"


@contextlib.contextmanager
def blocked(kind: str, what: str) -> Iterator[None]:
    """Time a blocking communication step and turn backend failures into :class:`CommError`."""
    t0 = time.perf_counter()
    try:
        with translated(what):
            yield
    finally:
        stats.add(kind, time.perf_counter() - t0)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Turn backend failures of ``what`` into :class:`CommError`, without timing it.

    For the backward all-to-all: it is the same whatever the forward's schedule, so it stays
    out of :data:`stats`, which measures the forward waits that overlap can hide.
    """
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, dist.DistError) as exc:
        rank = dist.get_rank() if dist.is_initialized() else -1
        raise CommError(
            f"rank {rank}: {what} failed: {exc}. If a peer rank died, hung or never reached "
            f"this step, this is raised after {_timeout_text()}; check the other ranks' logs."
        ) from exc


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    backend: str | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT_S,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> None:
    """Initialise the default process group with a bounded timeout (torchrun env by default).

    ``timeout`` bounds every collective and the rendezvous itself: a rank that never arrives
    or dies makes the others raise :class:`CommError` after about that long, instead of
    hanging forever (torch's default is 10-30 minutes). A group that already exists is
    left as it is, timeout included (errors quote its own: :func:`group_timeout`).
    """
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if dist.is_initialized():
        actual = group_timeout()
        if actual != td.total_seconds():
            logger.warning(
                "init_distributed: the process group already exists; its timeout (%s) is "
                "kept, not the %g s asked for.",
                "unknown" if actual is None else f"{actual:g} s",
                td.total_seconds(),
            )
        return
    backend = backend or default_backend()
    kwargs: dict = {"backend": backend, "timeout": td}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    if init_method is not None:
        kwargs["init_method"] = init_method
    elif "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "init_distributed: no init_method and no MASTER_ADDR in the environment; launch "
            "with torchrun or pass init_method='tcp://host:port'."
        )
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, dist.DistError) as exc:
        raise CommError(
            f"process group did not form within {td.total_seconds():g} s: some rank never "
            f"arrived (check that every rank was launched with the same world size and "
            f"address). Backend said: {exc}"
        ) from exc
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def group_name(pg: dist.ProcessGroup | None = None) -> str:
    """The name functional collectives use to find ``pg`` (default group if None)."""
    pg = pg if pg is not None else dist.group.WORLD
    return pg.group_name
