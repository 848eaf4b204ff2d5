"""``keep_freed_memory``: large buffers come from glibc's heap and stay there once freed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, json, sys, torch
from fxrec.bench.common import keep_freed_memory
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
a, b = torch.ones(5 << 20), torch.ones(5 << 20)  # two 20 MiB buffers
brk = libc.sbrk(0)
in_heap = a.data_ptr() < brk and b.data_ptr() < brk
del a, b
print(json.dumps({"kept": kept, "in_heap": in_heap, "trimmed": libc.sbrk(0) < brk}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator only")
def test_large_buffers_stay_in_the_heap() -> None:
    default = _probe("default")
    assert default["in_heap"] is False  # glibc maps them afresh: every step faults them in
    kept = _probe("keep")
    assert kept["kept"] is True
    assert kept["in_heap"] is True
    assert kept["trimmed"] is False  # freed, the heap is not given back to the kernel
