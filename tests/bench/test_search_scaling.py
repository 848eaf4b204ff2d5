"""The search-scaling section measures real optimize passes on synthetic graphs."""

from __future__ import annotations

import pytest

from fxrec.bench import search_scaling


def test_small_sizes_are_measured_and_reported(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FXREC_STRICT", "1")
    monkeypatch.setenv("FXREC_BENCH_DIR", str(tmp_path))
    result = search_scaling.run(quick=True, sizes=(200, 400), profile=True)
    rows = result["rows"]
    assert [r["requested"] for r in rows] == [200, 400]
    for r in rows:
        assert abs(r["nodes"] - r["requested"]) <= 0.05 * r["requested"]
        assert 0 < r["pass_s"] <= r["optimize_s"]
        assert r["nodes_after"] < r["nodes"]  # parallel chains do fuse
    assert result["goals"][0]["goal"].startswith("10000 nodes")
    assert "cumulative" in (tmp_path / "search_profile.txt").read_text()
    assert (tmp_path / "search.png").stat().st_size > 0
