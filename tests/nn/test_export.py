"""torch.export of models with fxrec's collection, plain and optimized, strict and not: the
exported program computes what the model computes on fresh batches of other sizes, and
exporting leaves the module's caches holding no tracing-time tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim, ShapesCollection

import fxrec
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import KeyedJaggedTensor

KEYS = ["f0", "f1", "f2", "f3"]


class Ranker(nn.Module):
    """Three tables in two groups (dims 4 and 8), a LayerNorm + tanh per feature."""

    def __init__(self, weighted: bool) -> None:
        super().__init__()
        cfg = [("t0", 10, 4, ["f0", "f2"]), ("t1", 20, 8, ["f1"]), ("t2", 30, 4, ["f3"])]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=f)
                for t, n, d, f in cfg
            ],
            is_weighted=weighted,
        )
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in (4, 8, 4, 4))
        self.over = nn.Linear(20, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        d = self.ebc(kjt).to_dict()
        return self.over(torch.cat([torch.tanh(n(d[k])) for n, k in zip(self.norms, KEYS)], 1))


def _batch(rows: int, weighted: bool, g: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(KEYS) * rows,), generator=g)
    n = int(lengths.sum())
    ids = torch.randint(0, 10, (n,), generator=g)
    weights = torch.rand(n, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(KEYS, ids, lengths, weights=weights)


def _dynamic(kjt: KeyedJaggedTensor) -> ShapesCollection:
    """Any number of ids and rows (export's own rule: at least 2 rows per feature)."""
    sc = ShapesCollection()
    for t in (kjt.values(), kjt.lengths(), kjt.weights_or_none()):
        if t is not None:
            sc[t] = {0: Dim.DYNAMIC}
    return sc


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("optimized", [False, True])
def test_exported_program_matches_the_model(strict: bool, weighted: bool, optimized: bool):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Ranker(weighted).eval()
    example = _batch(3, weighted, g)
    run = fxrec.optimize(model, (example,)) if optimized else model
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no module state written while tracing
        ep = torch.export.export(run, (example,), strict=strict, dynamic_shapes=_dynamic(example))
    exported = ep.module()
    for rows in (2, 3, 7):
        kjt = _batch(rows, weighted, g)
        torch.testing.assert_close(exported(kjt), model(kjt), rtol=1e-5, atol=1e-6)
    caches = [model.ebc._device_consts, model.ebc._plans]
    assert not any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
                   for c in caches for v in c.values())
    torch.testing.assert_close(run(example), model(example), rtol=1e-5, atol=1e-6)
