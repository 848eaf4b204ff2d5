"""Benchmarks: ``python -m fxrec bench [SECTION ...]``; see :mod:`fxrec.bench.cli`.

Each section is a module with ``run(quick, device) -> dict`` that prints its tables and
returns JSON-able results; the CLI writes them to ``bench_results/<section>.json``.
"""

from __future__ import annotations
