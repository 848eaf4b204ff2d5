"""fxrec.export refuses a model holding a sharded collection up front (its forward
communicates), and the unsharded copy it points to exports."""

from __future__ import annotations

import copy

import pytest
import torch

import fxrec
from tests.distributed.launch import run_ranks


def _export(rank: int, world: int) -> None:
    from tests.distributed.test_overlap_pass import TinyDLRM, tiny_sharded_dlrm
    from tests.distributed.test_sharded_ebc import make_batch

    ebc, model = tiny_sharded_dlrm(("t0",))
    model.eval()
    batch = (torch.randn(4, 6), make_batch(ebc, rank, 4, False, extra_key=False))
    opt = fxrec.optimize(model, batch, rules=["default", "overlap_comm"])
    for target in (opt, model):
        with pytest.raises(ValueError) as info:
            fxrec.export(target, batch)
        message = str(info.value)
        assert "holds sharded embedding collections ('" in message
        assert "cannot be exported" in message
        assert "load the full checkpoint into an unsharded copy and export that" in message
    plain = TinyDLRM(copy.deepcopy(ebc), model.over.in_features - 8).eval()
    plain.load_state_dict(
        {**model.state_dict(), **{f"sparse.{k}": v for k, v in ebc.state_dict().items()}}
    )
    program = fxrec.export(fxrec.optimize(plain, batch), batch)
    torch.testing.assert_close(program.module()(*batch), model(*batch), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_export_refuses_a_sharded_model() -> None:
    run_ranks(2, _export, timeout=15.0, deadline=120.0)
