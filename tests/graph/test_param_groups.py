"""fxrec.param_groups: optimizer groups built on the model's parameters (no weight decay on
biases and norms, a learning rate per tower) train the optimized module as they train the
model; groups one flat parameter cannot honour raise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 1))
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x) for t in self.towers], 1)


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return name.endswith("bias") or name.split(".")[2] == "1"  # towers.i.1: the LayerNorm


def _groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": 0.5},
        {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0, "lr": 3e-2},
    ]


@pytest.mark.parametrize("optim", [torch.optim.AdamW, torch.optim.SGD])
def test_groups_built_on_the_model_train_the_optimized_module_alike(optim: type) -> None:
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(32, 16),))
    assert opt.fxrec_fused.member_ids()  # something is laid out
    o_ref = optim(_groups(ref), lr=1e-2)
    o_opt = optim(fxrec.param_groups(opt, _groups(model)), lr=1e-2)
    flat = {id(p) for p in opt.fxrec_fused.parameters()}
    assert any(id(p) in flat for p in o_opt.param_groups[1]["params"])
    held = [id(p) for g in o_opt.param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in opt.parameters())  # each once, none left
    for _ in range(4):
        x = torch.randn(32, 16)
        for m, o in ((ref, o_ref), (opt, o_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    want = ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_groups_one_flat_parameter_cannot_honour_raise() -> None:
    model = Towers()
    opt = fxrec.optimize(model, (torch.randn(32, 16),))
    t0, t1 = model.towers[0][1], model.towers[1][1]  # LayerNorms laid out together
    assert opt.fxrec_fused.view_of(t0.weight) is not None
    others = [p for p in model.parameters() if p is not t0.weight and p is not t1.weight]
    split = [{"params": [t0.weight, *others]}, {"params": [t1.weight], "lr": 0.5}]
    with pytest.raises(ValueError, match="are in group 0: one tensor sits in one"):
        fxrec.param_groups(opt, split)
    left_out = [p for p in model.parameters() if p is not t1.weight]
    with pytest.raises(ValueError, match="in no group"):
        fxrec.param_groups(opt, left_out)
    with pytest.raises(ValueError, match="no parameters"):
        fxrec.param_groups(opt, [])
    # equal options too: a schedule per group would move them apart
    same = [{"params": [t0.weight, *others]}, {"params": [t1.weight]}]
    with pytest.raises(ValueError, match=r"one optimizer group.*keep_params=True"):
        fxrec.param_groups(opt, same)


def _per_tower(model: nn.Module) -> list[dict]:
    return [{"params": list(t.parameters())} for t in model.towers]


def test_groups_come_back_one_to_one() -> None:
    model = Towers()
    opt = fxrec.optimize(model, (torch.randn(32, 16),))
    got = fxrec.param_groups(opt, _groups(model))
    assert [len(g["params"]) > 0 for g in got] == [True, True]
    assert [g["weight_decay"] for g in got] == [0.5, 0.0]
    with pytest.raises(ValueError, match=r"group 1, but .* are in group 0"):
        fxrec.param_groups(opt, _per_tower(model))


def test_a_schedule_per_group_trains_each_group_as_the_model() -> None:
    """One group per tower, a ``LambdaLR`` lambda each (the last tower frozen by lr 0): with
    the towers' layers laid out across towers, only keep_params can honour it."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model.state_dict())
    opt = fxrec.optimize(model, (torch.randn(32, 16),), keep_params=True)
    lams = [lambda e: 1.0, lambda e: 0.5**e, lambda e: 2.0, lambda e: 0.0]
    pairs = []
    for m, groups in ((ref, _per_tower(ref)), (opt, fxrec.param_groups(opt, _per_tower(model)))):
        o = torch.optim.SGD(groups, lr=0.1)
        assert [len(g["params"]) for g in o.param_groups] == [6, 6, 6, 6]
        pairs.append((m, o, torch.optim.lr_scheduler.LambdaLR(o, lams)))
    for _ in range(4):
        x = torch.randn(32, 16)
        for m, o, sched in pairs:
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
            sched.step()
    want = ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)
        if k.startswith("towers.3."):
            assert torch.equal(v, start[k]), k  # lr 0: untouched
