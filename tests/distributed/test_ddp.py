"""DistributedDataParallel over an optimized module: the flat parameters are all-reduced,
the members they hold are left alone, and training matches DDP over the original model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxrec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

D = 8


class Towers(nn.Module):
    """Per-slice LayerNorms (laid out in one flat parameter) and a Linear tower."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(4))
        self.head = nn.Linear(4 * D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, D, 1)
        return self.head(torch.cat([n(p).tanh() for n, p in zip(self.norms, parts)], 1))


def _same_training(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same model on every rank
    model = Towers()
    ref = copy.deepcopy(model)
    torch.manual_seed(100 + rank)  # each rank its own data
    xs = [torch.randn(8, 4 * D) for _ in range(3)]
    opt = fxrec.optimize(model, (xs[0],))
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    runs = []
    for module in (ref, opt):
        ddp = DDP(module)  # find_unused_parameters=False: every synced parameter gets a grad
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in xs:
            sgd.zero_grad()
            ddp(x).pow(2).mean().backward()
            sgd.step()
        runs.append(ddp)
    members = {f"model.norms.{i}.{w}" for i in range(4) for w in ("weight", "bias")}
    assert set(runs[1].parameters_to_ignore) == members  # synced through the flat ones
    want = ref.state_dict()
    for k, v in opt.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_ddp_over_an_optimized_module_trains_like_ddp_over_the_model() -> None:
    run_ranks(2, _same_training, timeout=30.0, deadline=100.0)
