"""Every call keeps laid-out members and their flat parameters in step (new data, flags): a
call that finds nothing changed since the last sync must not walk the layouts member by
member (a model with hundreds of per-feature sub-networks paid for that on every call), and
one that finds a change must still see it, whichever call comes first (with or without
autograd).

Changes are compared with a copy of the plain model made before ``fxrec.optimize`` and
changed the same way.
"""

from __future__ import annotations

import pytest
import torch

from fxrec.graph.params import FusedParameters
from tests.graph.test_drop_in import TOL
from tests.graph.test_flat_params import OPTIMS, D, N, _pair, _same_state, _step


def _x() -> torch.Tensor:
    return torch.randn(16, N * D)


def test_a_call_that_changes_nothing_walks_no_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    _, opt, _ = _pair()
    opt(_x())
    walked: list[str] = []
    original = FusedParameters._sync_data

    def counting(self: FusedParameters, name: str, *args: object) -> None:
        walked.append(name)
        original(self, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedParameters, "_sync_data", counting)
    opt(_x()).sum().backward()
    with torch.no_grad():
        opt(_x())
    opt.state_dict()
    assert walked == []
    opt.model.lins[0].weight.data = opt.model.lins[0].weight.data.clone()  # new data: a walk
    opt(_x())
    assert walked


def test_new_member_data_is_used_by_a_call_without_autograd() -> None:
    model, opt, ref = _pair()
    opt(_x())
    for m in (model, ref):
        m.lins[1].weight.data = m.lins[1].weight.data + 0.5
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=TOL, atol=TOL)
    _same_state(opt, ref)


def test_a_member_frozen_before_a_call_without_autograd_freezes_its_flat() -> None:
    """The flags are taken at the next call with autograd, which is the first they matter to."""
    model, opt, ref = _pair()
    opt(_x())  # synced: later calls compare with this state
    for m in (model, ref):
        m.lins.requires_grad_(False)
    with torch.no_grad():
        opt(_x())
    o_opt, o_ref = OPTIMS["sgd"](list(opt.parameters())), OPTIMS["sgd"](list(ref.parameters()))
    for _ in range(3):
        x = _x()
        assert _step(opt, o_opt, x) == pytest.approx(_step(ref, o_ref, x), rel=TOL, abs=TOL)
        _same_state(opt, ref)
    assert all(not p.requires_grad for p in model.lins.parameters())
    assert any(not p.requires_grad for p in opt.parameters())
