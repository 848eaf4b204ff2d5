"""Shared test set-up: deterministic seeds and a small thread count for the 2-core CI machine."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

settings.register_profile(
    "fxrec",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("fxrec")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing rule raises (``FXREC_STRICT=1``) instead of leaving its graph unoptimized."""
    monkeypatch.setenv("FXREC_STRICT", "1")
