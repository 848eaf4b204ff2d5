"""Laid-out parameters where their views meet unusual tensors and code: sparse gradients of
fused tables (``sparse=True``), members written in place while the model runs (a forward
pre-hook clamping a weight, ``max_norm`` renormalizing a table), and sizes read while
``torch.jit.trace`` runs.

Each test compares the optimized module with a plain copy of the model made before
``fxrec.optimize``: gradients by name, and parameters after a few optimizer steps on fresh
random inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrec
import fxrec.graph.module
from fxrec.graph import params
from tests.graph.test_flat_params import D, N, Towers, _same_state, _step

TABLES, ROWS, DIM = 4, 50, 8


class Tables(nn.Module):
    """Parallel EmbeddingBags (one flat table once fused) and a Linear on their outputs."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.embs = nn.ModuleList(
            nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse) for _ in range(TABLES)
        )
        self.top = nn.Linear(TABLES * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(torch.cat([e(ids[:, i : i + 1]) for i, e in enumerate(self.embs)], 1))


class RenormedTable(Tables):
    """Fused tables also read as tokens with ``max_norm``, which renormalizes them in place
    (two reads of one flat table: its members' views would come from one split)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = [F.embedding(ids[:, :2], self.embs[i].weight, max_norm=1.0) for i in (1, 2)]
        return super().forward(ids) + sum(t.sum((1, 2)) for t in tokens).unsqueeze(1)


def _ids() -> torch.Tensor:
    return torch.randint(0, ROWS, (16, TABLES))


def _tables(model: nn.Module) -> tuple[fxrec.OptimizedModule, nn.Module]:
    """(the optimized module, a plain copy made before optimize); its tables laid out."""
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_ids(),))
    assert opt.fxrec_fused.member_ids()
    return opt, ref


# -- sparse gradients ----------------------------------------------------------------------------
def test_sparse_table_gradients_by_name_match_the_model() -> None:
    torch.manual_seed(0)
    model = Tables()
    opt, ref = _tables(model)
    ids = _ids()
    opt(ids).sum().backward()
    ref(ids).sum().backward()
    got = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        assert got[name] is not None and got[name].layout == p.grad.layout, name
        torch.testing.assert_close(got[name].to_dense(), p.grad.to_dense(), msg=name)


def test_a_penalty_on_sparse_tables_trains_like_the_model() -> None:
    """A loss term on the model's own parameters: the members' dense gradients are moved
    into the flat table's sparse gradient."""
    torch.manual_seed(0)
    model = Tables()
    opt, ref = _tables(model)
    o_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ids = _ids()
        for module, owner, optim in ((opt, model, o_opt), (ref, ref, o_ref)):
            optim.zero_grad()
            penalty = sum(p.pow(2).sum() for n, p in owner.named_parameters() if "embs" in n)
            (module(ids).sum() + 1e-2 * penalty).backward()
            optim.step()
    _same_state(opt.model, ref)


# -- members written in place while the model runs -----------------------------------------------
def _clamp(mod: nn.Module, args: object) -> None:
    with torch.no_grad():
        mod.weight.clamp_(-0.05, 0.05)


def test_a_pre_hook_clamping_a_member_in_place_trains_like_the_model() -> None:
    """The hooked Linear runs through ``functional_call`` with a view of its flat
    parameter, which the hook writes: not an output of a multi-output ``split``."""
    torch.manual_seed(0)
    model = Towers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    assert opt.fxrec_fused.member_ids()
    for m in (model, ref):  # registered after optimize: the graphs are built again
        m.lins[1].register_forward_pre_hook(_clamp)
    o_opt = torch.optim.SGD(opt.parameters(), lr=0.05)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(3):
        x = torch.randn(8, N * D)
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=1e-5)
    _same_state(opt.model, ref)


def test_a_fused_table_renormalized_by_max_norm_trains_like_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The graph's read of the table with ``max_norm`` writes it in place. The check passes
    (forced: optimize's own runs renormalize the table too, which the check compares)."""
    monkeypatch.setattr(fxrec.graph.module, "_same_outputs", lambda *a, **k: True)
    torch.manual_seed(0)
    model = RenormedTable(sparse=False)
    ref = copy.deepcopy(model)
    batches = [_ids() for _ in range(3)]
    opt = fxrec.optimize(model, (batches[0],))  # renorms the rows the first step renorms
    o_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids in batches:
        for module, optim in ((opt, o_opt), (ref, o_ref)):
            optim.zero_grad()
            module(ids).sum().backward()
            optim.step()
    _same_state(opt.model, ref)


# -- torch.jit.trace -----------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the int() reads it warns of
def test_member_rows_read_while_jit_tracing_are_ints() -> None:
    """Under ``torch.jit.trace`` a size is a traced tensor; the row counts that graph code
    is built with must be Python ints, or the generated code names ``int64``."""
    torch.manual_seed(0)
    model = Towers()
    opt = fxrec.optimize(model, (torch.randn(8, N * D),))
    opt.requires_grad_(False)  # (the tracer refuses to capture tensors that need gradients)
    members = [ms for _, ms in opt.fxrec_fused._members.values()]
    seen: list[object] = []

    def read(x: torch.Tensor) -> torch.Tensor:
        for ms in members:
            seen.extend(params._rows(ms))
            seen.extend(params._slot("cat", m).rows for m in ms)
        return x + 1

    torch.jit.trace(read, (torch.randn(2),))
    assert seen and all(type(r) is int for r in seen)
