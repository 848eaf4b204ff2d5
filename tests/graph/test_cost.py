"""The CPU cost model: fusions that would stream large tensors through memory are refused."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxrec
from fxrec.graph import cost, meta


def _nodes(*shapes: tuple[int, ...]) -> list[fx.Node]:
    g = fx.Graph()
    out = []
    for i, s in enumerate(shapes):
        n = g.placeholder(f"x{i}")
        meta.set_info(n, torch.empty(s, device="meta"))
        out.append(n)
    return out


def test_small_members_fuse_everywhere() -> None:
    group = _nodes(*[(256, 16)] * 64)
    assert cost.cache_reason(group, "cpu") is None
    assert cost.cache_reason(group, "cuda") is None


def test_large_members_are_refused_on_cpu_only() -> None:
    group = _nodes(*[(2048, 64)] * 8)  # 128 Ki elements each
    reason = cost.cache_reason(group, "cpu")
    assert reason is not None and "per member" in reason
    assert cost.cache_reason(group, "cuda") is None


def test_a_large_group_of_small_members_is_cut_into_chunks_on_cpu() -> None:
    group = _nodes(*[(2048, 16)] * 256)  # 32 Ki each, 8 Mi in all
    assert cost.cache_reason(group, "cpu") is None
    parts = cost.chunks(group, "cpu")
    assert [len(p) for p in parts] == [32] * 8
    assert [n for p in parts for n in p] == group  # written order, consecutive
    assert cost.chunks(group, "cuda") == [group]
    assert cost.chunks(group[:8], "cpu") == [group[:8]]


def test_a_group_within_the_heap_limit_stays_whole_on_cpu() -> None:
    # 100 members of 1024 x 32 (3.2 Mi elements fused): chunks would be strided slices
    # copied in and joined by a cat, which costs more than they save.
    group = _nodes(*[(1024, 32)] * 100)
    assert cost.chunks(group, "cpu") == [group]
    over = _nodes(*[(1024, 32)] * 129)  # just past CPU_GROUP_ELEMS
    assert len(cost.chunks(over, "cpu")) > 1


def test_chunks_never_leave_a_lone_member() -> None:
    group = _nodes(*[(2048, 16)] * 129)  # 4 chunks of 32 + 1 -> the last chunk takes 33
    assert [len(p) for p in cost.chunks(group, "cpu")] == [32, 32, 32, 33]


def test_unknown_sizes_give_no_evidence() -> None:
    g = fx.Graph()
    group = [g.placeholder("a"), g.placeholder("b")]
    assert cost.cache_reason(group, "cpu") is None


class Seed(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, 16, 1)
        return torch.cat([torch.tanh(self.norms[i](parts[i])) for i in range(len(parts))], 1)


@pytest.mark.parametrize(("batch", "fused"), [(32, True), (4096, False)])
def test_optimize_applies_the_cost_model_and_reports_it(batch: int, fused: bool) -> None:
    model = Seed(8)  # 4096 x 16 = 64 Ki elements per member: too large on CPU
    x = torch.randn(batch, 8 * 16)
    opt = fxrec.optimize(model, (x,))
    report = opt.fxrec_report
    assert (report.count("parallel_layer_norm") == 1) is fused
    reasons = " ".join(r.reason for r in report.refusals)
    assert ("CPU cost model" in reasons) is not fused
    torch.testing.assert_close(opt(x), model(x))
