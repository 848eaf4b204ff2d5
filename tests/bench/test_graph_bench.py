"""The graph section and the CLI: a tiny real run writes valid JSON; bad input fails clearly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import fxrec
from fxrec.__main__ import main
from fxrec.bench import graph, models


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FXREC_STRICT", "1")
    monkeypatch.setenv("FXREC_BENCH_DIR", str(tmp_path))


def test_cli_smoke_run_writes_json_and_plot(tmp_path, capsys) -> None:
    status = main(["bench", "graph", "--quick", "--only", "seed N=16"])
    assert status == 0
    data = json.loads((tmp_path / "graph.json").read_text())
    assert data["section"] == "graph" and data["quick"] is True
    rows = data["rows"]
    assert {(r["case"], r["batch"]) for r in rows} == {("seed N=16", 32), ("seed N=16", 2048)}
    for r in rows:
        assert r["equivalent"] is True
        # Eager runs split + 16 x (layer_norm, tanh) + cat: 2N+1 kernels at least.
        assert r["kernels"]["eager"]["forward"] >= 2 * 16 + 1
        assert r["kernels"]["fxrec"]["forward"] <= r["kernels"]["eager"]["forward"]
        assert r["median_ms"]["eager"] > 0 and r["median_ms"]["fxrec"] > 0
        assert r["speedup"] > 0
    assert any("independent of N" in g["goal"] for g in data["goals"])
    assert (tmp_path / "graph.png").stat().st_size > 0
    assert "speedup" in capsys.readouterr().out


class _WrongAfterOptimize(nn.Module):
    """Eager reference for a deliberately broken 'optimized' module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_equivalence_check_catches_a_wrong_output() -> None:
    model = _WrongAfterOptimize()
    opt = fxrec.optimize(copy.deepcopy(model), (torch.randn(2, 4),))
    with torch.no_grad():
        opt.model.lin.bias.add_(1e-2)  # a different model now
    with pytest.raises(graph.EquivalenceError, match="output 0"):
        graph.check_equivalence(model, opt, (torch.randn(5, 4),), "broken")


def test_equivalence_check_catches_a_wrong_gradient() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    class ScaledGrad(Scaled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            # Same value, twice the gradient.
            return 2 * out - out.detach()

    model = Scaled()
    twin = ScaledGrad()
    twin.load_state_dict(model.state_dict())
    opt = fxrec.optimize(twin, (torch.randn(2, 4),))
    with pytest.raises(graph.EquivalenceError, match="grad of lin"):
        graph.check_equivalence(model, opt, (torch.randn(5, 4),), "broken")


def test_equivalence_check_passes_on_an_optimized_model() -> None:
    model = models.SeedPattern(8, d=4)
    opt = fxrec.optimize(copy.deepcopy(model), models.make_inputs(model, 6))
    graph.check_equivalence(model, opt, models.make_inputs(model, 6), "seed")


def test_goals_flag_a_slowdown() -> None:
    row = {
        "case": "ranking 104 features",
        "group": "ranking",
        "batch": 256,
        "kernels": {"eager": {"forward": 10}, "fxrec": {"forward": 5}},
        "speedup": 0.5,
    }
    checked = {g["goal"]: g["met"] for g in graph.goals([row])}
    assert checked["ranking model, batch 256: training step >= 2x faster"] is False
    assert checked["no case where fxrec is slower than eager"] is False


def test_unknown_section_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "grpah"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section(s) grpah" in err and "graph" in err
    assert "usage: fxrec bench" in err  # the bench command's usage, not the top level's


def test_unknown_options_show_the_bench_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "usage: fxrec bench" in err


@pytest.mark.parametrize("flag", ["--steps", "--batch", "--tables"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_overlap_counts_must_be_positive(flag: str, value: str, capsys) -> None:
    from fxrec.bench.overlap import main as overlap_main

    with pytest.raises(SystemExit) as exc:  # before any process group starts
        overlap_main([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("at least 1" in err or "whole number" in err)


def test_cuda_without_gpu_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "graph", "--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bad_device_and_only_without_graph(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--device", "tpu"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "sparse", "--only", "seed"])
    assert "--only selects cases of the graph section" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a section after --only stays a section
        main(["bench", "--only", "seed", "sparse"])
    assert "--only selects cases of the graph section" in capsys.readouterr().err


def test_out_that_is_a_file_fails_before_any_section_runs(tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit):
        main(["bench", "sparse", "--out", str(afile)])
    assert "--out" in capsys.readouterr().err


def test_only_matching_nothing_fails_clearly() -> None:
    with pytest.raises(ValueError, match="no graph case matches"):
        graph.run(quick=True, only=["no-such-model"])


def test_missing_section_is_skipped_by_default_but_an_error_when_named(monkeypatch) -> None:
    from fxrec.bench import cli

    monkeypatch.setitem(cli.SECTIONS, "ghost", cli.Section("fxrec.bench.no_such_section", "x"))
    results, problems = cli.run_sections(["ghost"], quick=True)
    assert results == {} and problems == {}
    results, problems = cli.run_sections(["ghost"], quick=True, required=True)
    assert "not part of this build" in problems["ghost"]
