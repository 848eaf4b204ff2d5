"""The pipelines convert TensorDict input in their host stage, as the model itself would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxrec.sparse import kjt_from_tensordict
from fxrec.sparse.tensordict_interop import prepared_kjts
from fxrec.train import Batch, TrainPipelineBase, TrainPipelineSparseDist
from tests.sparse.helpers import separate_buffers
from tests.train.helpers import fresh, make_batches, params
from tests.train.test_pipelines import assert_same, reference

KEYS = ["f0", "f1", "f2"]
PIPELINES = [TrainPipelineBase, TrainPipelineSparseDist]


class Spy(nn.Module):
    """Records, per step, whether the model's conversion found a KJT the pipeline prepared."""

    def __init__(self, inner: nn.Module, keys: list[str] | None = None) -> None:
        super().__init__()
        self.inner, self.keys, self.hits = inner, keys, []

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        kjt = kjt_from_tensordict(sparse, self.keys)
        self.hits.append(any(kjt is k for k in prepared_kjts(sparse)))
        return self.inner(dense, kjt)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
@pytest.mark.parametrize("keys", [None, ["f2", "f0", "f1"]])
def test_later_batches_are_converted_ahead_with_the_models_keys(pipeline_cls, keys):
    batches = make_batches(KEYS, 8, input_type="td", weighted=True, seed=11)
    ref_losses, ref_params = reference(batches, weighted=True)
    inner, opt = fresh(KEYS, weighted=True)
    model = Spy(inner, keys)
    with pipeline_cls(model, opt) as pipe:
        losses = pipe.run(batches)
        prepared = pipe.stats.prepared
    assert_same(losses, params(inner), ref_losses, ref_params)
    assert not model.hits[0]  # the first batch teaches the pipeline
    # the base pipeline prepares every later batch; the overlapping one all but those it
    # had read ahead before the first forward (at most its queue plus one)
    ahead = 1 if pipeline_cls is TrainPipelineBase else 1 + 2 + 1
    assert sum(model.hits) == prepared >= len(batches) - ahead
    assert all(model.hits[ahead:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_nothing_is_prepared_when_the_model_does_not_convert(pipeline_cls):
    class ReadsEntries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
            counts = torch.stack([sparse[k].offsets()[-1] for k in KEYS]).float().sum()
            return self.lin(dense[:, :1]) + counts * 0

    batches = make_batches(KEYS, 4, input_type="td", seed=2)
    model = ReadsEntries()
    with pipeline_cls(model, torch.optim.SGD(model.parameters(), lr=0.1)) as pipe:
        pipe.run(batches)
        assert pipe.stats.prepared == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_preparation_can_be_turned_off(pipeline_cls):
    batches = make_batches(KEYS, 4, input_type="td", seed=4)
    model, opt = fresh(KEYS)
    with pipeline_cls(model, opt, prepare_tensordicts=False) as pipe:
        pipe.run(batches)
        assert pipe.stats.prepared == 0 and pipe.stats.steps == 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_a_batch_that_fails_to_convert_fails_in_its_step(pipeline_cls):
    batches = make_batches(KEYS, 5, input_type="td", seed=6, vary_batch=False)
    td = batches[3].sparse.clone()
    td["f1"] = torch.zeros(4, 2)  # not a jagged tensor: conversion raises
    bad = [*batches[:3], Batch(batches[3].dense, td, batches[3].labels), batches[4]]
    model, opt = fresh(KEYS)
    errors = []
    with pipeline_cls(model, opt) as pipe:
        it = iter(bad)
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            except Exception as e:
                errors.append((e.batch_index, e.stage, type(e.__cause__)))
    assert errors == [(3, "training on it", ValueError)]


class HashesInPlace(nn.Module):
    """Edits the batch's ids in place before converting (hashing raw ids into range)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        sparse["f1"].values().remainder_(5)
        return self.inner(dense, kjt_from_tensordict(sparse))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline_cls", PIPELINES)
def test_ids_edited_in_place_by_the_model_are_seen(pipeline_cls):
    """A KJT prepared ahead of the step is dropped once the model edits the ids it was
    made from: the model sees its edit, as without preparation."""

    def fresh_batches():  # the model edits them: each run gets its own
        batches = make_batches(KEYS, 5, input_type="td", seed=8)
        # each feature in its own buffer: the prepared KJT holds a copy of the ids
        return [Batch(b.dense, separate_buffers(b.sparse, KEYS), b.labels) for b in batches]

    results = []
    for prepare in (False, True):
        inner, opt = fresh(KEYS)
        with pipeline_cls(HashesInPlace(inner), opt, prepare_tensordicts=prepare) as pipe:
            losses = pipe.run(fresh_batches())
        results.append((losses, params(inner)))
    (ref_losses, ref_params), (losses, got) = results
    assert_same(losses, got, ref_losses, ref_params)
