"""torch.export of models with fxrec's collection, plain and optimized, strict and not: the
exported program computes what the model computes on fresh batches of other sizes, and
exporting leaves the module's caches holding no tracing-time tensors. A program saved with
``torch.export.save`` and read back with ``torch.export.load`` (how it reaches a serving host)
takes sparse inputs as the exported one does, and loads without falling back to unsafe
unpickling."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, ShapesCollection

import fxrec
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tests.records import recorded

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
    assert not any(
        isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
        for c in caches
        for v in c.values()
    )
    torch.testing.assert_close(run(example), model(example), rtol=1e-5, atol=1e-6)


class Heads(nn.Module):
    """Dense and sparse input; two Linear heads on one input (fused: laid-out parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = Ranker(False).ebc
        self.bottom = nn.Linear(6, 4)
        self.a = nn.Linear(24, 3)
        self.b = nn.Linear(24, 3)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([self.bottom(dense), self.ebc(kjt).values()], 1)
        return self.a(x) * torch.sigmoid(self.b(x))


@pytest.mark.parametrize("strict", [False, True])
def test_fxrec_export_of_laid_out_parameters(strict: bool) -> None:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Heads()
    example = (torch.randn(3, 6), _batch(3, False, g))
    opt = fxrec.optimize(model, example)  # in training mode
    assert opt.fxrec_report.count("parallel_linear_same_input") == 1
    assert opt.fxrec_fused.member_ids()
    opt.eval()  # the eval graph is built by the export
    shapes = _dynamic(example[1])
    shapes[example[0]] = {0: Dim.DYNAMIC}
    ep = fxrec.export(opt, example, dynamic_shapes=shapes, strict=strict)
    exported = ep.module()
    for rows in (2, 5):
        batch = (torch.randn(rows, 6), _batch(rows, False, g))
        torch.testing.assert_close(exported(*batch), model(*batch), rtol=1e-5, atol=1e-6)
    # what the program holds: the flat parameters, not the members laid out in them
    names = set(ep.state_dict)
    assert {"a.weight", "b.weight"}.isdisjoint(names) and any("fxrec_fused" in n for n in names)


EIGHT = [f"g{i}" for i in range(8)]


class PerFeatureBags(nn.Module):
    """A bag and a LayerNorm + relu per feature, offsets made from each feature's lengths:
    eight features, enough for the fused lookup, whose offsets stack the features' pieces of
    the KJT's lengths, one row each."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum") for _ in EIGHT)
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in EIGHT)
        self.out = nn.Linear(4 * len(EIGHT), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        parts = []
        for bag, norm, k in zip(self.bags, self.norms, EIGHT):
            jt = kjt[k]
            lengths = jt.lengths()
            parts.append(torch.relu(norm(bag(jt.values(), torch.cumsum(lengths, 0) - lengths))))
        return self.out(torch.cat(parts, 1))


def _eight(rows: int, g: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(EIGHT) * rows,), generator=g)
    ids = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(EIGHT, ids, lengths)


def test_exported_fused_offsets_take_other_batch_sizes() -> None:
    """The stacked pieces are unflattened by their count, not by the example's rows."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = PerFeatureBags().eval()
    example = _eight(8, g)
    opt = fxrec.optimize(model, (example,))
    assert opt.fxrec_report.count("stack_of_pieces") > 0
    ep = fxrec.export(opt, (example,), dynamic_shapes=_dynamic(example), strict=False)
    for rows in (3, 5, 8):
        kjt = _eight(rows, g)
        torch.testing.assert_close(ep.module()(kjt), model(kjt), rtol=1e-5, atol=1e-6)


def test_torch_export_of_laid_out_parameters_says_what_to_do() -> None:
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(3, 6), _batch(3, False, g))
    opt = fxrec.optimize(Heads().eval(), example)
    with pytest.raises(RuntimeError, match=r"fxrec\.export\(opt, args"):
        torch.export.export(opt, example, strict=False)


def test_torch_export_builds_the_graph_of_another_mode() -> None:
    """Optimized in training mode, exported in eval mode with a dynamic dense batch: the graph
    is built while exporting, from fake inputs of symbolic sizes (parameters not laid out)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Heads()
    example = (torch.randn(3, 6), _batch(3, False, g))
    opt = fxrec.optimize(model, example, keep_params=True)
    opt.eval()
    shapes = _dynamic(example[1])
    shapes[example[0]] = {0: Dim.DYNAMIC}
    ep = torch.export.export(opt, example, strict=False, dynamic_shapes=shapes)
    for rows in (2, 5):
        batch = (torch.randn(rows, 6), _batch(rows, False, g))
        torch.testing.assert_close(ep.module()(*batch), model(*batch), rtol=1e-5, atol=1e-6)


def test_fxrec_export_of_a_dynamo_capture_raises() -> None:
    class Untraceable(Heads):
        def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            if dense.sum() > 1e9:  # data-dependent: symbolic tracing fails
                dense = dense * 2
            return super().forward(dense, kjt)

    g = torch.Generator().manual_seed(0)
    example = (torch.randn(3, 6), _batch(3, False, g))
    opt = fxrec.optimize(Untraceable().eval(), example)
    with pytest.raises(ValueError, match="captured with dynamo"):
        fxrec.export(opt, example)
    torch._dynamo.reset()


def _save_and_load(ep: torch.export.ExportedProgram, path: Path) -> torch.export.ExportedProgram:
    torch.export.save(ep, path)
    with recorded("torch._export.serde.serialize") as records:
        loaded = torch.export.load(path)
    assert not records.messages, records.messages  # no unsafe-unpickling fallback
    assert loaded.call_spec.in_spec == ep.call_spec.in_spec
    return loaded


@pytest.mark.parametrize("optimized", [False, True])
def test_saved_and_loaded_program_takes_kjt_inputs(optimized: bool, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Heads().eval()
    example = (torch.randn(3, 6), _batch(3, False, g))
    shapes = _dynamic(example[1])
    shapes[example[0]] = {0: Dim.DYNAMIC}
    if optimized:
        ep = fxrec.export(fxrec.optimize(model, example).eval(), example, dynamic_shapes=shapes)
    else:
        ep = torch.export.export(model, example, dynamic_shapes=shapes)
    loaded = _save_and_load(ep, tmp_path / "heads.pt2")
    for rows in (2, 5, 9):
        batch = (torch.randn(rows, 6), _batch(rows, False, g))
        torch.testing.assert_close(loaded.module()(*batch), model(*batch), rtol=1e-5, atol=1e-6)
    dense, kjt = loaded.example_inputs[0]
    assert isinstance(kjt, KeyedJaggedTensor) and kjt.keys() == KEYS
    torch.testing.assert_close((dense, kjt.values()), (example[0], example[1].values()))


class KeyedHeads(nn.Module):
    """A KeyedTensor of two keys (widths 3 and 5), a Linear per key."""

    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Linear(3, 2)
        self.v = nn.Linear(5, 2)

    def forward(self, kt: KeyedTensor) -> torch.Tensor:
        d = kt.to_dict()
        return self.u(d["u"]) * torch.sigmoid(self.v(d["v"]))


class Bags(nn.Module):
    """Sum-pooled bags of a JaggedTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, jt: JaggedTensor) -> torch.Tensor:
        return self.bag(jt.values(), jt.offsets()[:-1])


def _kt(rows: int, g: torch.Generator) -> KeyedTensor:
    return KeyedTensor(["u", "v"], [3, 5], torch.randn(rows, 8, generator=g))


def _jt(rows: int, g: torch.Generator) -> JaggedTensor:
    lengths = torch.randint(0, 4, (rows,), generator=g)
    return JaggedTensor(torch.randint(0, 10, (int(lengths.sum()),), generator=g), lengths=lengths)


@pytest.mark.parametrize("kind", ["keyed_tensor", "jagged_tensor"])
def test_saved_and_loaded_program_takes_kt_and_jt_inputs(kind: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, make = (KeyedHeads(), _kt) if kind == "keyed_tensor" else (Bags(), _jt)
    example = make(3, g)
    shapes = ShapesCollection()
    for t in pytree.tree_leaves(example):
        if t is not None:
            shapes[t] = {0: Dim.DYNAMIC}
    ep = torch.export.export(model, (example,), dynamic_shapes=shapes)
    loaded = _save_and_load(ep, tmp_path / f"{kind}.pt2")
    for rows in (2, 6):
        x = make(rows, g)
        torch.testing.assert_close(loaded.module()(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "value",
    [
        KeyedJaggedTensor(["a", "b"], torch.arange(5), lengths=torch.tensor([1, 0, 2, 2])),
        KeyedJaggedTensor(
            ["a", "b"], torch.arange(5), lengths=torch.tensor([1, 2, 2]), stride_per_key=[1, 2]
        ),
        KeyedTensor(["u", "v"], [2, 1], torch.zeros(3, 2, 2), key_dim=0),
        JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2])),
    ],
    ids=["kjt", "kjt_variable_batch", "kt_key_dim_0", "jt"],
)
def test_pytree_spec_survives_serialization(value: object) -> None:
    """What export writes for an input's spec reads back equal (tuples stay tuples)."""
    spec = pytree.tree_structure(value)
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec


class MaybeWeighted(nn.Module):
    """Sums the values, weighted when the KJT has weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        w = kjt.weights_or_none()
        x = kjt.values().float() if w is None else kjt.values().float() * w
        return self.lin(x.sum().view(1, 1))


def _small_kjt(weighted: bool, keys: tuple[str, ...] = ("a", "b")) -> KeyedJaggedTensor:
    weights = torch.rand(4) if weighted else None
    return KeyedJaggedTensor(
        list(keys), torch.arange(4), weights, lengths=torch.tensor([1, 2, 0, 1])
    )


@pytest.mark.parametrize("weighted", [True, False])
def test_program_called_with_the_other_kind_of_kjt_says_so(weighted: bool, tmp_path: Path):
    """Weights are part of the input spec: a program exported for weighted KJTs refuses
    unweighted ones (it failed on a None deep inside), and one exported for unweighted KJTs
    refuses weighted ones (it dropped their weights silently)."""
    example = _small_kjt(weighted)
    shapes = ShapesCollection()
    for t in pytree.tree_leaves(example):
        if t is not None:
            shapes[t] = {0: Dim.DYNAMIC}
    ep = torch.export.export(MaybeWeighted(), (example,), dynamic_shapes=shapes)
    for program in (ep, _save_and_load(ep, tmp_path / "w.pt2")):
        torch.testing.assert_close(program.module()(example), ep.module()(example))
        want, other = ("'weighted'", "'unweighted'") if weighted else ("'unweighted'", "'weighted'")
        with pytest.raises(ValueError, match=f"(?s)tree spec.*{want}.*got inputs.*{other}"):
            program.module()(_small_kjt(not weighted))
    spec = pytree.tree_structure(example)  # graphs that flatten by spec say it in words
    with pytest.raises(
        ValueError, match=r"exported for a KeyedJaggedTensor with keys \['a', 'b'\]"
    ):
        fx_pytree.tree_flatten_spec(_small_kjt(not weighted), spec)
    with pytest.raises(ValueError, match=r"got one with keys \['a', 'c'\]"):
        fx_pytree.tree_flatten_spec(_small_kjt(weighted, ("a", "c")), spec)


class PlainBags(nn.Module):
    """Four ``nn.EmbeddingBag``s on 2-D ids (one bag per row), then a Linear: in float32 on a
    CPU with fbgemm, the fused lookup of graphs run eagerly is fbgemm's table-batched one.
    ``bag_lens``: ids per bag of each table (mixed lengths share fbgemm's lookup only)."""

    def __init__(self, mode: str, bag_lens: tuple[int, ...], weighted: bool) -> None:
        super().__init__()
        self.bag_lens, self.weighted = bag_lens, weighted
        starts = [sum(bag_lens[:i]) for i in range(len(bag_lens))]
        self.spans = [(a, a + n) for a, n in zip(starts, bag_lens)]
        self.bags = nn.ModuleList(nn.EmbeddingBag(50, 8, mode=mode) for _ in bag_lens)
        self.head = nn.Linear(8 * len(bag_lens), 1)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        parts = []
        for bag, (a, b) in zip(self.bags, self.spans):
            w = weights[:, a:b] if self.weighted else None
            parts.append(bag(ids[:, a:b], per_sample_weights=w))
        return self.head(torch.cat(parts, 1))


def _plain_batch(rows: int, model: PlainBags, weighted: bool) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 50, (rows, sum(model.bag_lens)))
    return (ids, torch.rand(ids.shape)) if weighted else (ids,)


PLAIN_CASES = {
    "sum": ("sum", (2, 2, 2, 2), False),
    "mean": ("mean", (2, 2, 2, 2), False),
    "weighted": ("sum", (2, 2, 2, 2), True),
    "mixed_bag_lengths": ("sum", (2, 3, 2, 3), False),
}


@pytest.mark.parametrize(
    ("case", "strict"),
    [(c, s) for c in PLAIN_CASES for s in (False, True)],
)
def test_export_of_fused_bags_does_their_lookup_in_torch_ops(
    case: str, strict: bool, tmp_path: Path
) -> None:
    """Calls run fbgemm's lookup, which has no fake kernel; the program does it with torch ops
    (the rules' form for graphs traced further), takes any batch size, and survives a save
    and load. Exporting leaves the module's graphs and layouts as they were."""
    from fxrec.nn._fbgemm import has_kernel, pooled_lookup

    mode, bag_lens, weighted = PLAIN_CASES[case]
    model = PlainBags(mode, bag_lens, weighted).eval()
    plain = copy.deepcopy(model)
    example = _plain_batch(8, model, weighted)
    opt = fxrec.optimize(model, example).eval()
    params = list(opt.parameters())
    fired = [f.detail for f in opt.fxrec_report.firings if f.rule == "parallel_embedding"]
    assert fired and (not has_kernel("cpu") or "fbgemm" in fired[0])
    batch = Dim("batch", min=2)
    shapes = tuple({0: batch} for _ in example)
    ep = fxrec.export(opt, example, dynamic_shapes=shapes, strict=strict)
    lookups = [
        str(n.target)
        for n in ep.graph.nodes
        if n.op == "call_function" and re.search("embedding_bag|index_select", str(n.target))
    ]
    # one for bags of one length; torch's form takes one length per lookup, and the tables of
    # each length, apart in fbgemm's laid-out table, would be gathered per call: one a table
    assert len(lookups) == (1 if len(set(bag_lens)) == 1 else len(bag_lens)), lookups
    loaded = _save_and_load(ep, tmp_path / "bags.pt2")
    for rows in (2, 5, 8, 13):
        x = _plain_batch(rows, model, weighted)
        want = plain(*x)
        torch.testing.assert_close(ep.module()(*x), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loaded.module()(*x), want, rtol=1e-5, atol=1e-6)
    # the module's own calls: the same parameters, outputs and gradients as the model
    assert list(opt.parameters()) == params
    runner, _, _ = opt._runner(example, {})
    assert has_kernel("cpu") == any(n.target is pooled_lookup for n in runner.graph.nodes)
    out = opt(*example)
    torch.testing.assert_close(out, plain(*example), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    plain(*example).sum().backward()
    grads = opt.fxrec_fused.grads(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


def test_export_of_fused_bags_falls_back_to_the_unfused_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the graph rewritten for tracing disagreed with the model, the model's trace is
    exported, reading the tables through the flat one that holds them."""
    import fxrec.graph.module as module

    model = PlainBags("sum", (2, 2, 2, 2), False).eval()
    plain = copy.deepcopy(model)
    example = _plain_batch(8, model, False)
    opt = fxrec.optimize(model, example).eval()
    monkeypatch.setattr(module, "_same_outputs", lambda *args, **kwargs: False)
    with recorded("fxrec") as logs:
        ep = fxrec.export(opt, example, dynamic_shapes=({0: Dim("batch", min=2)},), strict=True)
    assert any("disagrees" in m for m in logs.messages)
    assert any("fxrec_fused" in n for n in ep.state_dict)
    x = _plain_batch(5, model, False)
    torch.testing.assert_close(ep.module()(*x), plain(*x), rtol=1e-5, atol=1e-6)


class JaggedBags(nn.Module):
    """Six ``nn.EmbeddingBag``s on one feature's 1-D ids with offsets (and per-sample weights
    when summed): the fused lookup over jagged ids, which is torch ops on every path."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(30, 4, mode=mode) for _ in range(6))
        self.weighted = mode == "sum"
        self.head = nn.Linear(24, 1)

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        psw = weights if self.weighted else None
        return self.head(torch.cat([b(ids, offsets, per_sample_weights=psw) for b in self.bags], 1))


def _jagged_batch(rows: int) -> tuple[torch.Tensor, ...]:
    lengths = torch.randint(1, 4, (rows,))
    ids = torch.randint(0, 30, (int(lengths.sum()),))
    return ids, torch.cumsum(lengths, 0) - lengths, torch.rand(ids.shape)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_export_of_fused_bags_on_jagged_ids(mode: str, strict: bool, tmp_path: Path) -> None:
    model = JaggedBags(mode).eval()
    plain = copy.deepcopy(model)
    example = _jagged_batch(4)
    opt = fxrec.optimize(model, example).eval()
    assert opt.fxrec_report.count("parallel_embedding") == 1
    n_ids = Dim("ids", min=2)
    shapes = ({0: n_ids}, {0: Dim("rows", min=2)}, {0: n_ids})
    ep = fxrec.export(opt, example, dynamic_shapes=shapes, strict=strict)
    loaded = _save_and_load(ep, tmp_path / "jagged.pt2")
    for rows in (2, 5, 9):
        x = _jagged_batch(rows)
        want = plain(*x)
        torch.testing.assert_close(ep.module()(*x), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loaded.module()(*x), want, rtol=1e-5, atol=1e-6)
