"""Dropping exchanges of batches that will not run (close(), a skipped batch) after a peer
died: the wait fails, which is logged, never raised over the error that stopped the step, and
every exchange is forgotten."""

from __future__ import annotations

import pytest
from torch import nn

from fxrec.distributed import CommError
from fxrec.train.sparse_dist import InputDist


class _Failed:
    layout = None

    def __init__(self) -> None:
        self.drained = 0

    def drain(self) -> None:
        self.drained += 1
        raise CommError("rank 0: an id exchange failed: Connection reset by peer")


def test_discard_logs_a_failed_exchange_and_forgets_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fxrec.train import sparse_dist

    logged: list[str] = []
    monkeypatch.setattr(sparse_dist.logger, "warning", lambda msg, *a: logged.append(msg % a))
    inputs = InputDist(nn.Linear(2, 2))
    handles = [_Failed(), _Failed()]
    inputs._pending = {i: (None, (None, h)) for i, h in enumerate(handles)}
    inputs.discard()
    assert [h.drained for h in handles] == [1, 1]
    assert inputs._pending == {}
    assert len(logged) == 2 and "Connection reset by peer" in logged[0]
