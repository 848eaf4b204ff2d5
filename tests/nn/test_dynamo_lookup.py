"""The collection inside graphs dynamo captures: where the graph runs eagerly, each group
fbgemm looks up is one ``fxrec::tbe_lookup`` node running fbgemm's op (its own backward),
after one ``fxrec::check_ids`` node running the collection's eager id check; graphs traced
further (AOTAutograd, Inductor) and exported programs do both in torch ops. Every path
computes the plain model's outputs and gradients."""

from __future__ import annotations

import contextlib
import copy
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxrec
from fxrec.measure import KernelCount, count_kernels
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.nn._fbgemm import has_kernel
from fxrec.sparse import KeyedJaggedTensor, kjt_to_tensordict, validation_disabled

pytestmark = [
    pytest.mark.skipif(not has_kernel("cpu"), reason="fbgemm's CPU lookup is not installed"),
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered"),
]

TBE = "fbgemm::dense_embedding_codegen_lookup_function"
TABLES = {
    # three tables of one group (20 + 15 + 10 rows): an id past its table reads the next's
    "one_group": [EmbeddingBagConfig(f"t{i}", 20 - 5 * i, 4, [f"f{i}"]) for i in range(3)],
    # a table read by two features, a feature read by two tables, mean pooling, two dims,
    # and a max-pooled table, which torch looks up beside fbgemm's groups
    "mixed": [
        EmbeddingBagConfig("t0", 10, 4, ["f0", "f1"]),
        EmbeddingBagConfig("t1", 7, 4, ["f2", "f0"], pooling="mean"),
        EmbeddingBagConfig("t2", 5, 6, ["f1"], pooling="mean"),
        EmbeddingBagConfig("t3", 6, 4, ["f2"], pooling="max"),
    ],
}
FBGEMM_GROUPS = {"one_group": 1, "mixed": 3}


class Untraceable(nn.Module):
    """Pooled features into a linear head; ``torch.ones`` of a traced size stops symbolic
    tracing, so fxrec captures the model with dynamo."""

    def __init__(self, tables: str, weighted: bool = False) -> None:
        super().__init__()
        configs = [t for t in TABLES[tables] if not (weighted and t.pooling == "max")]
        self.ebc = EmbeddingBagCollection(configs, is_weighted=weighted)
        self.head = nn.Linear(sum(self.ebc.output_dims()) + 1, 1)

    def forward(self, features: Any) -> torch.Tensor:
        pooled = self.ebc(features).values()
        return self.head(torch.cat([pooled, self._ones(pooled)], 1)).squeeze(1)

    def _ones(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.ones(pooled.shape[0], 1)


class Traceable(Untraceable):
    def _ones(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(pooled[:, :1])


def _batch(
    ebc: EmbeddingBagCollection, rows: int, seed: int, tensordict: bool = False
) -> KeyedJaggedTensor | Any:
    """Ids inside every table that reads them, 0 to 3 per bag."""
    g = torch.Generator().manual_seed(seed)
    keys = ebc.feature_names()
    limit = {
        f: min(t.num_embeddings for t in ebc.embedding_bag_configs() if f in t.feature_names)
        for f in keys
    }
    lengths = torch.randint(0, 4, (len(keys) * rows,), generator=g)
    per_key = lengths.view(len(keys), rows).sum(1).tolist()
    ids = torch.cat([torch.randint(0, limit[f], (n,), generator=g) for f, n in zip(keys, per_key)])
    weights = torch.rand(ids.numel(), generator=g) if ebc.is_weighted() else None
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, ids, lengths, weights=weights)
    return kjt_to_tensordict(kjt) if tensordict else kjt


def _with_id(kjt: KeyedJaggedTensor, feature: str, value: int) -> KeyedJaggedTensor:
    """``kjt`` with the first id of ``feature`` replaced by ``value``."""
    ids = kjt.values().clone()
    ids[kjt.offset_per_key()[kjt.keys().index(feature)]] = value
    return KeyedJaggedTensor.from_lengths_sync(kjt.keys(), ids, kjt.lengths())


def _assert_trains_like(
    run: Callable[[Any], torch.Tensor],
    grads: Callable[[], dict[str, torch.Tensor | None]],
    plain: nn.Module,
    batch: Any,
) -> None:
    """``run(batch)`` and its gradients (``grads()``, by parameter name) are the plain
    model's, with weights that give every output row its own gradient."""
    out, want = run(batch), plain(batch)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    scale = torch.linspace(-1.0, 2.0, out.numel()).view(out.shape)
    (out * scale).sum().backward()
    (want * scale).sum().backward()
    got = grads()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    plain.zero_grad(set_to_none=True)


def _kernels(run: Callable[..., Any], batch: Any) -> KernelCount:
    run(batch)  # the plain collection builds its per-device constants on its first call
    return count_kernels(run, batch)


@pytest.mark.parametrize("tables", ["one_group", "mixed"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("tensordict", [False, True], ids=["kjt", "tensordict"])
def test_dynamo_capture_keeps_fbgemm_lookup(tables: str, weighted: bool, tensordict: bool):
    torch.manual_seed(0)
    model = Untraceable(tables, weighted)
    plain = copy.deepcopy(model)
    example = _batch(model.ebc, 6, 0, tensordict)
    opt = fxrec.optimize(model, (example,))
    assert opt.fxrec_report.capture == "dynamo"
    for rows, seed in ((6, 0), (6, 1), (9, 2)):
        opt.zero_grad(set_to_none=True)
        batch = _batch(model.ebc, rows, seed, tensordict)
        _assert_trains_like(opt, lambda: opt.fxrec_fused.grads(model), plain, batch)
    got, want = _kernels(opt, example), _kernels(plain, example)
    assert got.forward_ops[TBE] == want.forward_ops[TBE] == FBGEMM_GROUPS[tables]
    if not tensordict:  # (a TensorDict's conversion differs in dynamo's graph)
        assert got.forward_ops == want.forward_ops
    lookup = ("aten::_embedding_bag", "aten::_assert_async", "aten::repeat_interleave")
    assert [got.forward_ops.get(k) for k in lookup] == [want.forward_ops.get(k) for k in lookup]
    assert got.backward_ops == want.backward_ops


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize(("feature", "bad"), [("f1", 15), ("f2", 10), ("f0", -1)])
def test_dynamo_capture_raises_the_collections_error(validate: bool, feature: str, bad: int):
    """An id outside its own table but inside the group's weight raises, in the captured
    graph, what the plain model raises: the check's ``ValueError`` naming the feature, or with
    validation off, fbgemm's ``IndexError`` naming the feature and its table."""
    torch.manual_seed(0)
    model = Untraceable("one_group")
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_batch(model.ebc, 4, 0),))
    assert opt.fxrec_report.capture == "dynamo"
    kjt = _with_id(_batch(model.ebc, 4, 1), feature, bad)
    want = ValueError if validate else IndexError
    with contextlib.nullcontext() if validate else validation_disabled():
        with pytest.raises(want) as plain_error:
            plain(kjt)
        assert feature in str(plain_error.value)
        with pytest.raises(want, match=re.escape(str(plain_error.value))) as error:
            opt(kjt)
    # raised by the captured graph itself (optimize then reruns the model for its own error)
    assert type(error.value.__cause__) is want
    assert str(error.value.__cause__) == str(plain_error.value)


class Pooled(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features: Any) -> torch.Tensor:
        return self.ebc(features).values()


def _graphs(into: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        into.append(gm)
        return gm.forward

    return backend


def _calls(gm: torch.fx.GraphModule) -> Counter[Any]:
    """How often the graph calls each function (an op by its default overload)."""
    return Counter(
        n.target.default if isinstance(n.target, torch._ops.OpOverloadPacket) else n.target
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_dynamo_graph_holds_one_check_and_one_node_per_fbgemm_group(dynamic: bool) -> None:
    """A collection first called under dynamo, in one graph: the check and each fbgemm
    group's lookup are single nodes holding their description (no tensor built in the
    graph); the max-pooled group is torch's lookup, checked by the same node."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Pooled(EmbeddingBagCollection(TABLES["mixed"]))
    plain = copy.deepcopy(model)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=_graphs(graphs), fullgraph=True, dynamic=dynamic)
    for rows, seed in ((5, 0), (7, 1)):
        model.zero_grad(set_to_none=True)
        grads = lambda: {n: p.grad for n, p in model.named_parameters()}  # noqa: E731
        _assert_trains_like(compiled, grads, plain, _batch(model.ebc, rows, seed))
    calls = _calls(graphs[0])
    assert calls[torch.ops.fxrec.check_ids.default] == 1
    assert calls[torch.ops.fxrec.tbe_lookup.default] == FBGEMM_GROUPS["mixed"]
    assert calls[torch.nn.functional.embedding_bag] == 1  # the max-pooled table
    assert calls[torch._assert_async] == 0
    lookups = [n for n in graphs[0].graph.nodes if "tbe_lookup" in str(n.target)]
    built = (torch.tensor, torch.arange)
    assert not any(a.target in built for n in lookups for a in n.all_input_nodes)
    torch._dynamo.reset()


def _compiled_backends() -> list[Any]:
    return ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.mark.parametrize("inner", ["eager", *_compiled_backends()])
def test_compile_backend_keeps_fbgemm_where_the_graph_runs_eagerly(inner: str) -> None:
    """``torch.compile(model, backend=fxrec.compile_backend(inner))``: fbgemm's lookup with
    ``"eager"`` (the plain model's kernels), torch's traced further. Same training either way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Untraceable("mixed", weighted=True)
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxrec.compile_backend(inner))
    grads = lambda: {n: p.grad for n, p in model.named_parameters()}  # noqa: E731
    for rows, seed in ((6, 0), (6, 1)):
        model.zero_grad(set_to_none=True)
        _assert_trains_like(compiled, grads, plain, _batch(model.ebc, rows, seed))
    batch = _batch(model.ebc, 6, 1)
    got, want = _kernels(compiled, batch), _kernels(plain, batch)
    if inner == "eager":
        assert got.forward_ops == want.forward_ops
        assert got.backward_ops == want.backward_ops
    else:
        assert TBE not in got.forward_ops and "aten::_embedding_bag_backward" in got.backward_ops
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", _compiled_backends())
def test_optimize_compiled_further_looks_up_in_torch_and_asserts(backend: str) -> None:
    """Traced further, the lookups are torch's and the check a device assert; an id outside
    its table still gets the model's own error (``optimize`` reruns the model for it)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Untraceable("one_group")
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, (_batch(model.ebc, 6, 0),), backend=backend)
    assert opt.fxrec_report.capture == "dynamo"
    for rows, seed in ((6, 0), (6, 1)):
        opt.zero_grad(set_to_none=True)
        batch = _batch(model.ebc, rows, seed)
        _assert_trains_like(opt, lambda: opt.fxrec_fused.grads(model), plain, batch)
    with pytest.raises(ValueError, match="feature 'f1': id 15") as error:
        opt(_with_id(_batch(model.ebc, 6, 0), "f1", 15))
    assert isinstance(error.value.__cause__, RuntimeError)  # the compiled graph's assert
    torch._dynamo.reset()


def test_export_of_a_traced_model_keeps_torch_lookups() -> None:
    """``fxrec.export`` of a model symbolic tracing captures: the program looks up with
    torch's ops (portable: no lookup op of fbgemm's or fxrec's) and takes other batch sizes;
    the optimized module's own calls still run fbgemm's lookup."""
    from torch.export import Dim, ShapesCollection

    torch.manual_seed(0)
    model = Traceable("mixed", weighted=True).eval()
    plain = copy.deepcopy(model)
    example = _batch(model.ebc, 4, 0)
    opt = fxrec.optimize(model, (example,)).eval()
    assert opt.fxrec_report.capture == "symbolic_trace"
    shapes = ShapesCollection()
    for t in (example.values(), example.lengths(), example.weights()):
        shapes[t] = {0: Dim.DYNAMIC}
    program = fxrec.export(opt, (example,), dynamic_shapes=shapes)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("embedding_codegen" in op or op.startswith("fxrec.") for op in ops), ops
    assert any("embedding_bag" in op for op in ops), ops
    for rows, seed in ((2, 1), (4, 2), (9, 3)):
        batch = _batch(model.ebc, rows, seed)
        torch.testing.assert_close(program.module()(batch), plain(batch), rtol=1e-5, atol=1e-6)
    assert count_kernels(opt, example).forward_ops[TBE] == FBGEMM_GROUPS["mixed"]
