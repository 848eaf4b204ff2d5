"""The pipeline benchmark compares KJT and TensorDict input on the same data: check that the
two loaders collate identical features, and that the goal verdicts follow the figures."""

from __future__ import annotations

import torch

from fxrec.bench.pipeline import _goals
from fxrec.bench.pipeline_data import QUICK, Loader, make_dataset
from fxrec.sparse import kjt_from_tensordict


def small_cfg():
    return QUICK.__class__(
        **{
            **QUICK.__dict__,
            "tables": 6,
            "weighted_tables": 2,
            "batch": 16,
            "rows": 50,
            "distinct_batches": 2,
        }
    )


def test_kjt_and_tensordict_loaders_carry_the_same_features():
    cfg = small_cfg()
    keys, wkeys, raws = make_dataset(cfg, seed=3)
    kjt_batches = Loader(keys, wkeys, raws, "kjt")
    td_batches = Loader(keys, wkeys, raws, "td")
    for _ in range(3):  # cycles past the distinct batches
        a, b = next(kjt_batches), next(td_batches)
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        for kjt, td, weighted in zip(a.sparse, b.sparse, (False, True)):
            conv = kjt_from_tensordict(td)
            assert conv.keys() == kjt.keys()
            assert torch.equal(conv.values(), kjt.values())
            assert torch.equal(conv.lengths(), kjt.lengths())
            assert (kjt.weights_or_none() is not None) == weighted
            if weighted:
                assert torch.equal(conv.weights(), kjt.weights())
    assert kjt_batches.host_s > 0 and td_batches.host_s > 0


def test_pregenerated_batches_are_fresh_objects_with_the_collated_features():
    # Built before the timed steps, one object per step: no state cached on a batch object
    # (a KJT's offsets, a TensorDict's prepared KJT) can carry from one step to the next.
    cfg = small_cfg()
    keys, wkeys, raws = make_dataset(cfg, seed=4)
    for kind in ("kjt", "td"):
        pre = Loader(keys, wkeys, raws, kind, pregenerate=5)
        ref = Loader(keys, wkeys, raws, kind)
        got = [next(pre) for _ in range(6)]  # one past the pregenerated batches: collated
        assert pre.host_s > 0
        assert len({id(s) for b in got for s in b.sparse}) == 12
        for a, b in zip(got, (next(ref) for _ in range(6))):
            assert torch.equal(a.dense, b.dense)
            for x, y in zip(a.sparse, b.sparse):
                if kind == "td":
                    x, y = kjt_from_tensordict(x), kjt_from_tensordict(y)
                assert x.keys() == y.keys()
                assert torch.equal(x.values(), y.values())
                assert torch.equal(x.lengths(), y.lengths())


def test_ids_per_feature_are_skewed_and_in_range():
    cfg = small_cfg()
    _, _, raws = make_dataset(cfg, seed=0)
    raw = raws[0]
    per_feature = [int(ln.sum()) for ln in raw.lengths]
    assert max(per_feature) > 3 * min(per_feature)  # heavy and light features
    for ids, ln in zip(raw.ids, raw.lengths):
        assert ids.numel() == int(ln.sum())
        assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < cfg.rows)
    # Zipf ids: the most frequent row is far more frequent than the median row
    counts = torch.bincount(torch.cat(raw.ids), minlength=cfg.rows).float()
    assert counts.max() > 5 * counts.median().clamp(min=1)


def test_goal_verdicts_follow_the_throughputs():
    def row(p, i, f, thr):
        return {"pipeline": p, "input": i, "fxrec": f, "throughput": thr}

    sd, bs = "TrainPipelineSparseDist", "TrainPipelineBase"
    rows = [
        row(sd, "kjt", "on", 100.0),
        row(sd, "td", "on", 99.0),
        row(sd, "kjt", "off", 100.0),
        row(sd, "td", "off", 90.0),
        row(bs, "kjt", "on", 80.0),
        row(bs, "td", "on", 120.0),
        row(bs, "kjt", "off", 90.0),
        row(bs, "td", "off", 70.0),
    ]
    got = {g["goal"]: g["met"] for g in _goals(rows)}
    assert got[f"TD within 2% of KJT throughput ({sd}, fxrec on)"] is True
    assert got[f"TD within 2% of KJT throughput ({sd}, fxrec off)"] is False
    assert got[f"{sd} faster than {bs} (kjt, fxrec on)"] is True
    assert got[f"{sd} faster than {bs} (td, fxrec on)"] is False
    assert got[f"fxrec on faster than off ({bs}, kjt)"] is False
    assert got[f"fxrec on faster than off ({sd}, td)"] is True


def test_goal_ratios_are_paired_round_by_round():
    # A slow round (the machine drifted) hits both variants; paired ratios cancel it, while
    # the medians over all steps would not.
    sd, bs = "TrainPipelineSparseDist", "TrainPipelineBase"

    def row(p, i, f, rounds):
        return {"pipeline": p, "input": i, "fxrec": f, "throughput": 1.0, "round_p50_ms": rounds}

    rows = [
        row(sd, "kjt", "on", [10.0, 10.0, 30.0]),
        row(sd, "td", "on", [10.1, 10.1, 30.3]),  # 1% slower in every round
        row(bs, "kjt", "on", [11.0, 33.0, 33.0]),  # SparseDist 1.1x faster in every round
    ]
    got = {g["goal"]: g for g in _goals(rows)}
    gap = got[f"TD within 2% of KJT throughput ({sd}, fxrec on)"]
    assert gap["met"] and abs(gap["value"] - 0.99) < 0.01
    assert "rounds 0.99-0.99" in gap["detail"]
    faster = got[f"{sd} faster than {bs} (kjt, fxrec on)"]
    assert faster["met"] and abs(faster["value"] - 1.1) < 1e-9


def test_fxrec_on_variant_computes_the_model_and_fuses_its_per_feature_chain():
    # What "fxrec on" runs: combine_inputs (symbolic tracing of the model) then optimize.
    import copy

    import fxrec
    from fxrec.bench.pipeline_data import PipelineRankingModel, make_collections
    from fxrec.passes.combine_inputs import combine_inputs

    cfg = small_cfg()
    torch.manual_seed(0)
    model = PipelineRankingModel(cfg, *make_collections(cfg))
    keys, wkeys, raws = make_dataset(cfg, seed=5)
    for kind in ("kjt", "td"):
        loader = Loader(keys, wkeys, raws, kind)
        b = next(loader)
        combined, packer = combine_inputs(copy.deepcopy(model), (b.dense, *b.sparse))
        opt = fxrec.optimize(combined, packer(b.dense, *b.sparse))
        fired = {f.rule for f in opt.fxrec_report.firings}
        assert {"parallel_layer_norm", "parallel_unary"} <= fired
        b = next(loader)  # a fresh batch
        want = model(b.dense, *b.sparse)
        got = opt(*packer(b.dense, *b.sparse))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.zero_grad()
        opt.zero_grad()
        want.square().sum().backward()
        got.square().sum().backward()
        grads = opt.fxrec_fused.grads(combined)  # members' gradients through the flat layout
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5)


def test_section_runs_end_to_end_and_reports_every_variant(tmp_path, monkeypatch):
    # Wiring, not speed: every variant trains, and the JSON, the goals and the plot come out.
    import importlib.util
    import json

    from fxrec.bench.pipeline import run

    monkeypatch.setenv("FXREC_BENCH_DIR", str(tmp_path))
    cfg = QUICK.__class__(
        **{**small_cfg().__dict__, "rounds": 2, "steps_per_round": 2, "warmup": 1}
    )
    for loader in ("pregenerated", "collate"):
        result = run(config=cfg, loader=loader)
        peer = importlib.util.find_spec("torchrec") is not None
        rows = result["rows"]
        assert len(rows) == 8 + (2 if peer else 0), result.get("note")
        for r in rows:
            assert len(r["round_p50_ms"]) == cfg.rounds and r["throughput"] > 0
        fx_on = [r for r in rows if r["fxrec"] == "on"]
        # dense, labels, and one combined ids, lengths and weights tensor each
        assert {r["h2d_copies_per_batch"] for r in fx_on} == {5.0}
        assert len(result["goals"]) == 10 and set(result["loader_collate_ms"]) == {"kjt", "td"}
        saved = json.loads((tmp_path / "pipeline.json").read_text())
        assert saved["loader"] == loader
        assert (tmp_path / "pipeline.png").stat().st_size > 0
