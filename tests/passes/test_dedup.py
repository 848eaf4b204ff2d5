"""dedup family: duplicate pure work computed once, unused pure work removed, effects kept."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxrec
from tests.compile.helpers import compiled_matches_eager
from tests.passes.test_linear import check_equivalent, fired, forward_ops

RULES = ["dedup", "dead_code"]


def _x(b: int) -> tuple:
    return (torch.randn(b, 8),)


def test_same_table_looked_up_twice_is_looked_up_once() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Embedding(20, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.t(ids) * 2 + self.t(ids)

    opt = check_equivalent(Twice, lambda b: (torch.randint(0, 20, (b,)),), rules=RULES)
    assert fired(opt, "dedup") == 1
    assert forward_ops(opt, torch.randint(0, 20, (4,)))["aten::embedding"] == 1


def test_repeated_pure_functions_and_methods() -> None:
    class Rep(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.tanh(x) + torch.tanh(x)  # call_function twice
            b = x.sigmoid() * x.sigmoid()  # call_method twice
            return a + b + F.softmax(x, dim=1) + F.softmax(x, dim=1)

    opt = check_equivalent(Rep, _x, rules=RULES)
    assert fired(opt, "dedup") == 3
    ops = forward_ops(opt, torch.randn(4, 8))
    assert ops["aten::tanh"] == 1 and ops["aten::sigmoid"] == 1 and ops["aten::_softmax"] == 1


def test_different_arguments_are_kept() -> None:
    class Diff(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # 1 and 1.0 and True hash alike in Python: the key must tell them apart
            a = x.sum(1, keepdim=True) + x.sum(0, keepdim=True)
            return a + torch.clamp(x, 1) + torch.clamp(x, 1.0) + torch.clamp(x, True)

    opt = check_equivalent(Diff, _x, rules=RULES)
    assert fired(opt, "dedup") == 0
    assert forward_ops(opt, torch.randn(4, 8))["aten::clamp"] == 3


def test_random_ops_are_never_merged_or_removed() -> None:
    class Rand(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            unused = F.dropout(x, 0.5, True)  # noqa: F841  draws random numbers: stays
            torch.rand_like(x)  # consumes the RNG stream: stays
            return self.drop(x) + self.drop(x)

    model = Rand()
    opt = __import__("fxrec").optimize(Rand(), _x(4), rules=RULES)
    assert opt.fxrec_report.count("dedup") == 0
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    got = opt(x)
    torch.testing.assert_close(got, want)


def test_reads_around_in_place_writes_are_not_merged() -> None:
    class Mut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.0
            a = y.sum()
            y.add_(1)  # a write between two identical reads
            b = y.sum()
            return a + b

    opt = check_equivalent(Mut, _x, rules=RULES)
    assert fired(opt, "dedup") == 0


def test_dead_pure_work_is_removed_side_effects_kept() -> None:
    class Dead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.unused(torch.tanh(x))  # pure, unused
            y = x * 2
            y.relu_()  # in place: must stay even though its result is unused
            return y

    opt = check_equivalent(Dead, _x, rules=RULES)
    assert fired(opt, "dead_code") >= 1
    ops = forward_ops(opt, torch.randn(4, 8))
    assert "aten::addmm" not in ops and "aten::tanh" not in ops
    assert ops["aten::relu_"] == 1


def test_shared_linear_applied_twice_to_one_input() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) - 3 * self.a(x)

    opt = check_equivalent(Twice, _x, rules=RULES)
    assert fired(opt, "dedup") == 1
    assert forward_ops(opt, torch.randn(4, 8))["aten::addmm"] == 1


def test_training_batch_norm_is_never_merged() -> None:
    class BN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x) + self.bn(x)  # two running-statistics updates

    opt = check_equivalent(BN, _x, rules=RULES)
    assert fired(opt, "dedup") == 0


def test_unused_split_pieces_are_merged() -> None:
    """Each unread split output costs a zeros kernel in backward: merge them."""

    class Pieces(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = torch.split(x, 1, 1)  # 8 pieces, 2 read
            return parts[3] * parts[6]

    opt = check_equivalent(Pieces, _x, rules=["merge_unused_pieces"])
    assert fired(opt, "merge_unused_pieces") == 1
    import fxrec

    x = torch.randn(4, 8, requires_grad=True)
    plain = fxrec.count_kernels(Pieces(), x).backward_ops
    fused = fxrec.count_kernels(opt, x).backward_ops
    assert plain["aten::zeros"] == 6 and fused["aten::zeros"] == 3


IN_PLACE_MODULES = {
    "elu": lambda: nn.ELU(inplace=True),
    "leaky_relu": lambda: nn.LeakyReLU(0.1, inplace=True),
    "relu6": lambda: nn.ReLU6(inplace=True),
    "selu": lambda: nn.SELU(inplace=True),
}


@pytest.mark.parametrize("act", sorted(IN_PLACE_MODULES))
def test_in_place_modules_in_a_dynamo_graph_keep_their_inputs_apart(act: str) -> None:
    """Dynamo records ``nn.ELU(inplace=True)`` as ``F.elu(h, 1.0, True)``, ``inplace`` by
    position: the activation writes its own ``x * 2``; merged with the other one, the sum
    read the written tensor."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act, self.lin = IN_PLACE_MODULES[act](), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.act(x * 2.0)) + x * 2.0

    x = torch.randn(4, 8, requires_grad=True)
    compiled_matches_eager(Twice(), (x,), fxrec.compile_backend("eager", rules=["dedup"]))


class RegionsWritingTheirArgument(nn.Module):
    """Each checkpointed tower applies ``nn.ELU(inplace=True)`` to its own ``x * 2``: the
    writes happen inside the regions' bodies, on the arguments dynamo passes them."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.towers = nn.ModuleList(
            nn.Sequential(nn.ELU(inplace=True), nn.Linear(8, 8)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [checkpoint(t, x * 2.0, use_reentrant=self.reentrant) for t in self.towers]
        return torch.cat(outs, 1)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_arguments_a_checkpointed_region_writes_are_not_merged(
    reentrant: bool, backend: str
) -> None:
    """Merged, the three ``x * 2`` became one tensor every region wrote: wrong outputs with
    ``"eager"``, a failed version check with ``"aot_eager"``. (Training through such
    regions: tests/compile/test_checkpoint_regions.py.)"""
    model, x = RegionsWritingTheirArgument(reentrant), torch.randn(4, 8)
    compiled = torch.compile(
        copy.deepcopy(model), backend=fxrec.compile_backend(backend), dynamic=False
    )
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
