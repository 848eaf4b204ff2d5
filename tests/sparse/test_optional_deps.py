"""fxrec.sparse works without TorchRec and fbgemm (pure torch paths, clear ImportError)."""

from __future__ import annotations

import sys

import pytest
import torch

import fxrec.sparse as S
from fxrec.sparse import permute as P


def test_without_fbgemm_uses_torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "_fbgemm", False)
    monkeypatch.setattr(P, "_backend", "auto")
    assert S.get_backend() == "torch"
    kjt = S.KeyedJaggedTensor(["a", "b"], torch.arange(5), lengths=torch.tensor([2, 0, 1, 2]))
    assert kjt.permute([1, 1, 0]).values().tolist() == [2, 3, 4, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="pip install fxrec\\[torchrec\\]"):
        S.set_backend("fbgemm")
    with pytest.raises(ValueError, match="backend must be one of"):
        S.set_backend("cuda")


def test_torchrec_conversion_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "torchrec" or m.startswith("torchrec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchrec", None)
    kjt = S.KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2]))
    with pytest.raises(ImportError, match="pip install fxrec\\[torchrec\\]"):
        S.to_torchrec(kjt)
