"""The model's state stays the user's: what fxrec's own runs of the model (capture, check,
kernel counts) write must be put back, and edits made through the optimized module
(deleting and setting attributes, loading state dicts) must reach the model.

``nn.Embedding(max_norm=...)`` renormalizes, in place, the rows each forward looks up:
optimize's runs on the example inputs renormalized the example's rows, so the optimized
model trained from other values than the plain one."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrec
from tests.records import recorded

ROWS, D = 100, 8


class Renorms(nn.Module):
    """A max-norm lookup feeding four towers (fused, so laid out in flat parameters)."""

    def __init__(self, bag: bool = False, branchy: bool = False) -> None:
        super().__init__()
        self.emb = (
            nn.EmbeddingBag(ROWS, D, mode="sum", max_norm=1.0)
            if bag
            else nn.Embedding(ROWS, D, max_norm=1.0)
        )
        self.bag = bag
        self.branchy = branchy
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.branchy and ids.dim() > 2:  # a branch on the input's rank: dynamo captures it
            ids = ids.flatten(1)
        e = self.emb(ids) if self.bag else self.emb(ids).sum(1)
        return torch.cat([t(e) for t in self.towers], 1)


class RenormsByHand(nn.Module):
    """Renormalizes a bare parameter (no module says it will): a symbolic trace shows the
    write before anything runs; dynamo's capture runs it first, with nothing to copy from."""

    def __init__(self, branchy: bool = False) -> None:
        super().__init__()
        self.branchy = branchy
        self.table = nn.Parameter(torch.randn(ROWS, D) * 3)
        self.lin = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.branchy and ids.dim() > 2:  # a branch on the input's rank: dynamo captures it
            ids = ids.flatten(1)
        return self.lin(F.embedding(ids, self.table, max_norm=1.0).sum(1))


def _ids(batch: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, ROWS, (batch, 3))


class Norms(nn.Module):
    """Six LayerNorms on slices of the input (fused: laid out in flat parameters), a head."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(n))
        self.head = nn.Linear(n * D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.split(D, 1)
        return self.head(torch.cat([torch.tanh(n(p)) for n, p in zip(self.norms, parts)], 1))


def _x() -> torch.Tensor:
    return torch.randn(16, 6 * D)


def _trains_like(
    opt: fxrec.OptimizedModule,
    plain: nn.Module,
    inputs: Callable[[], torch.Tensor] = lambda: _ids(16),
    steps: int = 3,
) -> None:
    """Outputs, gradients and parameters after ``steps`` SGD steps on fresh inputs equal the
    plain model's."""
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(steps):
        ids = inputs()
        out, want = opt(ids), plain(ids)
        torch.testing.assert_close(out, want)
        for o, y in ((sgd, out), (sgd_plain, want)):
            o.zero_grad()
            y.square().mean().backward()
        grads = opt.fxrec_fused.grads(opt.model)
        for name, q in plain.named_parameters():
            torch.testing.assert_close(grads[name], q.grad, msg=name)
        sgd.step()
        sgd_plain.step()
    for (name, p), q in zip(opt.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
@pytest.mark.parametrize("branchy", [False, True], ids=["traced", "dynamo"])
def test_optimize_leaves_max_norm_tables_as_they_were(bag: bool, branchy: bool) -> None:
    model = Renorms(bag, branchy)
    plain = copy.deepcopy(model)
    example = _ids(10, low=50)  # rows 50..99, which the training batches may never touch
    with recorded("fxrec") as log:
        opt = fxrec.optimize(model, (example,))
    report = opt.fxrec_report
    assert report.count("parallel_linear_same_input") == 1
    assert (report.kernels_before, report.kernels_after) == ((12, 21), (5, 6))
    assert report.capture == ("dynamo" if branchy else "symbolic_trace")
    assert not [m for m in log.messages if "in place" in m], log.messages
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name
    _trains_like(opt, plain)


def test_a_parameter_a_traced_graph_writes_is_put_back() -> None:
    model = RenormsByHand()
    plain = copy.deepcopy(model)
    with recorded("fxrec") as log:
        opt = fxrec.optimize(model, (_ids(10, low=50),))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert not [m for m in log.messages if "in place" in m], log.messages
    assert torch.equal(model.table, plain.table)
    _trains_like(opt, plain)


class ScalesThroughData(nn.Module):
    """Towers on one input whose forward decays a parameter through ``.data`` (the old clamp
    idiom), which autograd's version counter does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.data.mul_(0.9)
        return torch.cat([t(x) for t in self.towers], 1) * self.scale


def test_a_parameter_a_traced_graph_writes_through_data_is_put_back() -> None:
    model = ScalesThroughData()
    opt = fxrec.optimize(model, (torch.randn(16, D),))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert opt.fxrec_report.count("parallel_linear_same_input") == 1
    assert model.scale.item() == 1.0


def test_a_parameter_written_without_a_copy_is_reported() -> None:
    model = RenormsByHand(branchy=True)
    with recorded("fxrec") as log:
        opt = fxrec.optimize(model, (_ids(4),))
    assert opt.fxrec_report.capture == "dynamo"
    written = [m for m in log.messages if "wrote parameters in place" in m]
    assert written, log.messages
    assert "(table)" in written[0] and "load_state_dict" in written[0]


class DecaysTables(nn.Module):
    """Tables fused into one lookup, which the forward decays in place under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(40, D)) for _ in range(4))
        self.head = nn.Linear(4 * D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for w in self.w:
                w.mul_(0.999)
        pooled = [F.embedding_bag(ids[:, 2 * i : 2 * i + 2], w) for i, w in enumerate(self.w)]
        return self.head(torch.cat(pooled, 1))


def test_members_a_forward_was_seen_writing_are_read_through_views_of_their_own() -> None:
    """Dynamo's capture runs the forward before fxrec sees its graph: the write is noted
    (and reported), and calls running the model as written read those members through
    single views, which autograd lets the forward write (one split's views it does not)."""
    torch.manual_seed(0)
    model = DecaysTables()
    opt = fxrec.optimize(model, (torch.randint(0, 40, (16, 8)),))
    # The check runs the forward twice, which decays the tables twice: the graph is dropped
    # (and so are its rewrites from the report), the tables stay laid out.
    assert any("check failed" in n for n in opt.fxrec_report.notes)
    assert opt.fxrec_report.count("parallel_embedding") == 0
    assert {id(w) for w in model.w} <= opt.fxrec_fused.member_ids()
    plain = copy.deepcopy(model)  # as optimize's first run left it
    _trains_like(opt, plain, lambda: torch.randint(0, 40, (16, 8)))


def test_a_submodule_deleted_then_set_again_is_set_on_the_model() -> None:
    model = Norms()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_x(),))
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    del opt.head
    head = nn.Linear(6 * D, 3)
    opt.head = head  # the model has no head now: still the model's name, not the wrapper's
    plain.head = copy.deepcopy(head)
    assert model.head is head and "head" not in opt._modules
    assert any(p is head.weight for p in opt.parameters())
    _trains_like(opt, plain, _x)


def test_a_state_dict_once_loaded_with_assign_loads_in_place() -> None:
    """``load_state_dict(sd, assign=True)`` on another module (a replica built on the meta
    device) marks ``sd``'s metadata in place; loading ``sd`` into the optimized module
    afterwards replaced its laid-out parameters, and the next call raised."""
    trained = Norms()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    sd = copy.deepcopy(trained.state_dict())
    with torch.device("meta"):
        replica = Norms()
    replica.load_state_dict(sd, assign=True)
    model = Norms()
    opt = fxrec.optimize(model, (_x(),))
    members = list(model.parameters())
    opt.load_state_dict(sd)
    assert all(p is q for p, q in zip(model.parameters(), members, strict=True))
    _trains_like(opt, trained, _x)


def test_load_state_dict_with_assign_is_refused() -> None:
    opt = fxrec.optimize(Norms(), (_x(),))
    with pytest.raises(ValueError, match="assign=False"):
        opt.load_state_dict(Norms().state_dict(), assign=True)
