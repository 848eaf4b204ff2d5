"""Sparse inputs in the forms users hold them: a plain dict of jagged nested tensors, per-sample
TensorDicts lazily stacked into a batch, TensorDicts grouping features in sub-TensorDicts, and
any of them on the meta device (shape inference, a planner's dry run).

Each accepted form must train exactly as the same features given as a KJT (outputs, table
gradients and parameters after optimizer steps); a form that is not read must say how to
convert it; on the meta device the collection must return what it returns on a real one,
shape and dtype, without reading a number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.nn.checks import check_id_ranges
from fxrec.sparse import (
    JaggedTensor,
    KeyedJaggedTensor,
    kjt_from_tensordict,
    kjt_to_tensordict,
    pack_features,
    set_validation,
    to_torchrec,
    validation_enabled,
)
from tests.nn.helpers import mixed_tables, random_kjt, table_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")

Form = Callable[[KeyedJaggedTensor], Any]


def _weighted_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig("t0", 11, 4, ["a", "b"]),
        EmbeddingBagConfig("t1", 7, 8, ["c"], pooling="mean"),
        EmbeddingBagConfig("t2", 5, 4, ["d", "a"]),
    ]


def _rows(kjt: KeyedJaggedTensor) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each feature's ids (and weights) row by row, as a loader holds them."""
    out = {}
    for k, jt in kjt.to_dict().items():
        lengths = jt.lengths().tolist()
        ids = list(torch.split(jt.values(), lengths))
        w = jt.weights_or_none()
        out[k] = (ids, [] if w is None else list(torch.split(w, lengths)))
    return out


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def dict_of_njts(kjt: KeyedJaggedTensor, sub: type = dict) -> dict[str, Any]:
    """``{feature: njt}``, or ``{feature: {"values": njt, "weights": njt}}`` when weighted
    (the inner mapping a dict or, with ``sub=TensorDict``, a sub-TensorDict)."""
    out: dict[str, Any] = {}
    for k, (ids, ws) in _rows(kjt).items():
        if not ws:
            out[k] = _nested(ids)
        elif sub is dict:
            out[k] = {"values": _nested(ids), "weights": _nested(ws)}
        else:
            out[k] = TensorDict({"values": _nested(ids), "weights": _nested(ws)}, [len(ids)])
    return out


def lazy_stack(kjt: KeyedJaggedTensor) -> LazyStackedTensorDict:
    """Per-sample TensorDicts (batch_size=[]) lazily stacked on dim 0."""
    rows = _rows(kjt)
    batch = kjt.stride()
    samples = []
    for i in range(batch):
        entries: dict[str, Any] = {}
        for k, (ids, ws) in rows.items():
            entries[k] = ids[i] if not ws else TensorDict({"values": ids[i], "weights": ws[i]}, [])
        samples.append(TensorDict(entries, batch_size=[]))
    return LazyStackedTensorDict.lazy_stack(samples, 0)


def _train_alike(form: Form, tables: list[EmbeddingBagConfig], weighted: bool, **kw: Any) -> None:
    """Three Adagrad steps on fresh random batches: ``form(kjt)`` against ``kjt`` itself."""
    torch.manual_seed(0)
    ours = EmbeddingBagCollection(tables, is_weighted=weighted)
    ref = EmbeddingBagCollection(tables, is_weighted=weighted)
    ref.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.Adagrad(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        kjt = random_kjt(ref, 5, gen, weighted=weighted, **kw)
        out, expected = ours(form(kjt)).values(), ref(kjt).values()
        torch.testing.assert_close(out, expected)
        grad = torch.randn(expected.shape, generator=gen)
        out.backward(grad)
        expected.backward(grad)
        got, want = table_grads(ours), table_grads(ref)
        for name in want:
            torch.testing.assert_close(got[name], want[name])
        opt_ours.step()
        opt_ref.step()
        opt_ours.zero_grad()
        opt_ref.zero_grad()
    for (name, p), q in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


# -- a plain dict of jagged nested tensors ------------------------------------------------------


def test_dict_of_njts_trains_as_the_kjt() -> None:
    _train_alike(dict_of_njts, mixed_tables(), weighted=False)


@pytest.mark.parametrize("sub", [dict, TensorDict])
def test_weighted_dict_of_njts_trains_as_the_kjt(sub: type) -> None:
    _train_alike(lambda kjt: dict_of_njts(kjt, sub), _weighted_tables(), weighted=True)


def test_pack_features_reads_a_dict_of_njts_as_the_kjt() -> None:
    gen = torch.Generator().manual_seed(3)
    kjt = random_kjt(EmbeddingBagCollection(_weighted_tables()), 4, gen, weighted=True)
    order = ["c", "a", "d"]
    got = pack_features(dict_of_njts(kjt), order)
    want = pack_features(kjt, order)
    assert got.keys == want.keys and got.stride_per_key == want.stride_per_key
    assert got.length_per_key == want.length_per_key
    assert torch.equal(got.values, want.values) and torch.equal(got.lengths, want.lengths)
    assert torch.equal(got.weights, want.weights)


def test_dict_mixing_jagged_tensors_and_njts_says_what_it_takes() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 5, 2, ["a", "b"])])
    features = {
        "a": _nested([torch.tensor([1]), torch.tensor([2, 3])]),
        "b": JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
    }
    with pytest.raises(ValueError, match="either JaggedTensors or jagged nested tensors"):
        ebc(features)


# -- per-sample TensorDicts, lazily stacked -----------------------------------------------------


def test_lazy_stack_of_samples_trains_as_the_kjt() -> None:
    _train_alike(lazy_stack, mixed_tables(), weighted=False)


def test_weighted_lazy_stack_of_samples_trains_as_the_kjt() -> None:
    _train_alike(lazy_stack, _weighted_tables(), weighted=True)


def test_lazy_stack_of_equal_length_samples_is_read_as_bags() -> None:
    # tensordict stacks equal-length entries into a dense [B, n] tensor on a plain get().
    _train_alike(lazy_stack, mixed_tables(), weighted=False, max_len=1)
    kjt = KeyedJaggedTensor(["a"], torch.tensor([4, 5, 6]), lengths=torch.tensor([1, 1, 1]))
    got = kjt_from_tensordict(lazy_stack(kjt))
    assert got.values().tolist() == [4, 5, 6] and got.lengths().tolist() == [1, 1, 1]


def test_lazy_stack_not_of_samples_says_how_to_convert() -> None:
    rows = [TensorDict({"a": torch.tensor([[i, i]])}, batch_size=[1]) for i in range(3)]
    stacked = LazyStackedTensorDict.lazy_stack(rows, 1)
    with pytest.raises(ValueError, match=r"stacked on dim 1.*as_nested_tensor=True"):
        kjt_from_tensordict(stacked, ["a"])
    scalars = [TensorDict({"a": torch.tensor(i)}, batch_size=[]) for i in range(3)]
    with pytest.raises(ValueError, match=r"feature 'a'.*1-D tensor of ids"):
        kjt_from_tensordict(LazyStackedTensorDict.lazy_stack(scalars, 0), ["a"])


# -- nested groups of features ------------------------------------------------------------------


def _grouped(kjt: KeyedJaggedTensor) -> TensorDict:
    njts = dict_of_njts(kjt)
    user = TensorDict({k: njts[k] for k in ("a", "b")}, batch_size=[kjt.stride()])
    item = TensorDict({"c": njts["c"]}, batch_size=[kjt.stride()])
    return TensorDict({"user": user, "item": item}, batch_size=[kjt.stride()])


def test_nested_groups_error_points_to_flatten_keys() -> None:
    tables = [EmbeddingBagConfig("t0", 20, 4, ["a", "b"]), EmbeddingBagConfig("t1", 30, 4, ["c"])]
    kjt = random_kjt(EmbeddingBagCollection(tables), 3, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"\['user', 'item'\] are nested groups.*flatten_keys"):
        EmbeddingBagCollection(tables)(_grouped(kjt))
    # what the message says to do: flattened keys as the tables' feature names
    dotted = [
        EmbeddingBagConfig("t0", 20, 4, ["user.a", "user.b"]),
        EmbeddingBagConfig("t1", 30, 4, ["item.c"]),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(dotted)
    ref = EmbeddingBagCollection(tables)
    ref.load_state_dict(ebc.state_dict())
    out = ebc(_grouped(kjt).flatten_keys(".")).values()
    torch.testing.assert_close(out, ref(kjt).values())


# -- the meta device ----------------------------------------------------------------------------


def _meta_td(kjt: KeyedJaggedTensor) -> Any:
    return kjt_to_tensordict(kjt).to("meta")


def _to_meta(entries: dict[str, Any]) -> dict[str, Any]:
    return {k: _to_meta(e) if isinstance(e, dict) else e.to("meta") for k, e in entries.items()}


META_FORMS: dict[str, Form] = {
    "kjt": lambda kjt: kjt.to("meta"),
    "torchrec_kjt": lambda kjt: to_torchrec(kjt).to("meta"),
    "tensordict": _meta_td,
    "dict_of_njts": lambda kjt: _to_meta(dict_of_njts(kjt)),
    "lazy_stack": lambda kjt: lazy_stack(kjt).to("meta"),
    "jagged_tensors": lambda kjt: {
        k: JaggedTensor(jt.values().to("meta"), lengths=jt.lengths().to("meta"))
        for k, jt in kjt.to_dict().items()
    },
}


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("form", list(META_FORMS))
def test_meta_input_gives_the_real_devices_shape_and_dtype(form: str, validate: bool) -> None:
    was = validation_enabled()
    set_validation(validate)
    try:
        for dtype in (torch.float32, torch.float16):
            real = EmbeddingBagCollection(mixed_tables()).to(dtype)
            kjt = random_kjt(real, 6, torch.Generator().manual_seed(11))
            want = real(kjt).values()
            meta = EmbeddingBagCollection(mixed_tables(), device="meta").to(dtype)
            out = meta(META_FORMS[form](kjt)).values()
            assert (out.device.type, out.shape, out.dtype) == ("meta", want.shape, want.dtype)
            out.sum().backward()  # gradients reach every group's weight, as on a real device
            for g in meta.groups:
                assert g.weight.grad is not None and g.weight.grad.shape == g.weight.shape
    finally:
        set_validation(was)


@pytest.mark.parametrize("form", ["kjt", "tensordict", "dict_of_njts", "lazy_stack"])
def test_weighted_meta_input_gives_the_real_devices_shape(form: str) -> None:
    real = EmbeddingBagCollection(_weighted_tables(), is_weighted=True)
    kjt = random_kjt(real, 4, torch.Generator().manual_seed(1), weighted=True)
    want = real(kjt).values()
    meta = EmbeddingBagCollection(_weighted_tables(), is_weighted=True, device="meta")
    out = meta(META_FORMS[form](kjt)).values()
    assert (out.device.type, out.shape, out.dtype) == ("meta", want.shape, want.dtype)


def test_meta_output_matches_torchrecs_shape() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

    specs = [("t0", ["a", "b"], 20, 4), ("t1", ["c"], 30, 8)]
    trec = TorchRecEBC(
        [
            TorchRecConfig(name=t, feature_names=f, num_embeddings=r, embedding_dim=d)
            for t, f, r, d in specs
        ],
        device=torch.device("meta"),
    )
    ours = EmbeddingBagCollection(trec.embedding_bag_configs(), device="meta")
    kjt = random_kjt(ours, 3, torch.Generator().manual_seed(2))
    want = trec(to_torchrec(kjt).to("meta")).values()
    for x in (to_torchrec(kjt).to("meta"), _meta_td(kjt)):
        out = ours(x).values()
        assert (out.device, out.shape, out.dtype) == (want.device, want.shape, want.dtype)


def test_id_range_check_reads_no_meta_ids() -> None:
    ebc = EmbeddingBagCollection(mixed_tables())
    members = [ebc.layout().members[i] for i in ebc.layout().group_major()]
    ids = torch.empty(len(members), dtype=torch.long, device="meta")
    check_id_ranges(ids, members, [1] * len(members))  # nothing to read: no error


def test_meta_kjt_builds_with_validation_on() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.empty(5, dtype=torch.long, device="meta"),
        lengths=torch.empty(4, dtype=torch.long, device="meta"),
    )
    assert validation_enabled() and kjt.stride() == 2 and kjt.values().device.type == "meta"


# -- lazily stacked samples through fxrec.optimize and the pipelines ------------------------------


class _Towers(torch.nn.Module):
    """The collection, then parallel towers fxrec fuses (built for its output's width)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(mixed_tables())

    def build(self, width: int) -> _Towers:
        self.towers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.LayerNorm(4)) for _ in range(3)
        )
        return self

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        e = self.ebc(sparse).values()
        return torch.cat([t(e) for t in self.towers], 1).sum(1) + dense.sum(1)


def test_lazy_stack_of_samples_trains_optimized_and_in_a_pipeline() -> None:
    import copy

    import fxrec
    from fxrec.train import Batch, TrainPipelineBase, transfer_count

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    model = _Towers()
    kjt = random_kjt(model.ebc, 4, gen)
    model.build(model.ebc(kjt).values().shape[1])
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(4, 2), lazy_stack(kjt)))
    assert opt.fxrec_report.count() > 0

    def loss_fn(out: torch.Tensor, batch: Batch) -> torch.Tensor:
        return (out - batch.labels).square().mean()

    pipe = TrainPipelineBase(opt, torch.optim.SGD(opt.parameters(), lr=0.01), loss_fn=loss_fn)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.01)
    batches = []
    for rows in (4, 3, 4):
        kjt = random_kjt(ref.ebc, rows, gen)
        batches.append((torch.randn(rows, 2), kjt, torch.randn(rows)))
    stacked = [Batch(d, lazy_stack(k), y) for d, k, y in batches]
    assert transfer_count(stacked[0].sparse) == sum(
        transfer_count(td) for td in stacked[0].sparse.tensordicts
    )
    it = iter(stacked)
    for dense, kjt, labels in batches:
        got = pipe.progress(it)
        sgd.zero_grad()
        want = loss_fn(ref(dense, kjt), Batch(dense, kjt, labels))
        want.backward()
        sgd.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(opt.get_parameter(name), p, rtol=1e-5, atol=1e-5, msg=name)


class _Checked(torch.nn.Module):
    """The collection behind a check on the batch (no symbolic trace: dynamo captures it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(mixed_tables())

    def forward(self, sparse: Any) -> torch.Tensor:
        out = self.ebc(sparse).values()
        if out.shape[0] > 0:
            out = out * 2.0
        return out


def test_dict_of_njts_runs_a_dynamo_captured_model() -> None:
    import copy

    import fxrec

    torch.manual_seed(0)
    model = _Checked()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    opt = fxrec.optimize(model, (dict_of_njts(random_kjt(ref.ebc, 3, gen)),))
    assert opt.fxrec_report.capture == "dynamo"
    for rows in (3, 4):
        kjt = random_kjt(ref.ebc, rows, gen)
        torch.testing.assert_close(opt(dict_of_njts(kjt)), ref(kjt))
