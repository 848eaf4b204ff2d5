"""``grouped_embedding_bag``: N nn.EmbeddingBag-style lookups as one call, same outputs and
gradients as the N separate calls; plus a property test of the collection over random
table configs and bag lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fxrec.measure import count_kernels
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig, grouped_embedding_bag
from tests.nn.helpers import check_against_reference, random_kjt

pytestmark = pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")


def _members(gen: torch.Generator, rows: list[int], weighted: bool):  # type: ignore[no-untyped-def]
    """Member 0: 2-D ids; member 1: 1-D ids + offsets; member 2: 2-D with one id per bag."""
    ids = [
        torch.randint(0, rows[0], (4, 3), generator=gen),
        torch.randint(0, rows[1], (7,), generator=gen),
        torch.randint(0, rows[2], (4, 1), generator=gen),
    ]
    offsets = [None, torch.tensor([0, 2, 2, 5]), None]
    psw = [torch.rand(x.shape, generator=gen) for x in ids] if weighted else None
    return ids, offsets, psw


@pytest.mark.parametrize(
    ("mode", "weighted"),
    [("sum", False), ("mean", False), ("max", False), ("sum", True), ("mean", True)],
)
def test_grouped_equals_separate_lookups(mode: str, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [5, 9, 3]
    tables = [torch.randn(r, 4, generator=gen) for r in rows]
    grouped = torch.cat(tables).requires_grad_()
    separate = [t.clone().requires_grad_() for t in tables]
    ids, offsets, psw = _members(gen, rows, weighted)

    got = grouped_embedding_bag(grouped, ids, offsets, [0, 5, 14], mode, psw)
    expected = []
    for i, (x, o, w) in enumerate(zip(ids, offsets, psw or [None] * 3)):
        if w is not None and mode == "mean":  # the weighted-mean definition, spelled out
            flat_w = w.reshape(-1)
            sizes = (
                torch.full((x.numel(),), x.shape[1])
                if x.dim() == 2
                else torch.repeat_interleave(
                    torch.diff(torch.cat([o, torch.tensor([x.numel()])])),
                    torch.diff(torch.cat([o, torch.tensor([x.numel()])])),
                )
            )
            w = (flat_w / sizes).reshape(w.shape)
            expected.append(F.embedding_bag(x, separate[i], o, mode="sum", per_sample_weights=w))
        else:
            expected.append(F.embedding_bag(x, separate[i], o, mode=mode, per_sample_weights=w))
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    grads = [torch.randn(e.shape, generator=gen) for e in expected]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(expected, grads)
    torch.testing.assert_close(grouped.grad, torch.cat([s.grad for s in separate]))


def test_grouped_is_one_lookup_kernel() -> None:
    weight = torch.randn(30, 4, requires_grad=True)
    ids = [torch.randint(0, 10, (8, 2)) for _ in range(3)]
    counts = count_kernels(lambda: grouped_embedding_bag(weight, ids, None, [0, 10, 20]))
    assert counts.forward_ops["aten::_embedding_bag"] == 1
    assert counts.backward_ops["aten::_embedding_bag_backward"] == 1


def test_grouped_errors() -> None:
    w = torch.randn(4, 2)
    with pytest.raises(ValueError, match="row offsets"):
        grouped_embedding_bag(w, [torch.zeros(2, 1, dtype=torch.long)], None, [0, 1])
    with pytest.raises(ValueError, match="need offsets"):
        grouped_embedding_bag(w, [torch.zeros(2, dtype=torch.long)], None, [0])
    with pytest.raises(ValueError, match="undefined for max"):
        grouped_embedding_bag(
            w, [torch.zeros(2, 1, dtype=torch.long)], None, [0], "max", [torch.ones(2, 1)]
        )
    assert grouped_embedding_bag(w, [], None, []) == []


@st.composite
def _tables(draw: st.DrawFn) -> tuple[list[EmbeddingBagConfig], bool]:
    weighted = draw(st.booleans())
    poolings = ["sum", "mean"] if weighted else ["sum", "mean", "max"]
    features = ["f0", "f1", "f2", "f3"]
    n = draw(st.integers(1, 4))
    tables = []
    for i in range(n):
        feats = draw(st.lists(st.sampled_from(features), min_size=1, max_size=3, unique=True))
        tables.append(
            EmbeddingBagConfig(
                f"t{i}",
                draw(st.integers(1, 6)),
                draw(st.sampled_from([1, 2, 3])),
                feats,
                pooling=draw(st.sampled_from(poolings)),
            )
        )
    return tables, weighted


@given(
    spec=_tables(),
    batch=st.integers(0, 4),
    max_len=st.integers(0, 3),
    backend=st.sampled_from(["torch", "auto"]),
    cap=st.sampled_from([None, 8]),
    seed=st.integers(0, 2**16),
)
def test_collection_property(
    spec: tuple[list[EmbeddingBagConfig], bool],
    batch: int,
    max_len: int,
    backend: str,
    cap: int | None,
    seed: int,
) -> None:
    tables, weighted = spec
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables,
        is_weighted=weighted,
        backend=backend,
        max_group_bytes=cap,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(seed)
    kjt = random_kjt(ebc, batch, gen, max_len=max_len, weighted=weighted, extra_keys=("z",))
    check_against_reference(ebc, kjt, weights_grad=weighted)


class _TwoBags(torch.nn.Module):
    """Two lookups into one grouped weight, as the embedding rule writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(15, 4))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = grouped_embedding_bag(self.weight, [a, b], None, [0, 10], "mean")
        return out[0] + out[1]


def test_grouped_is_one_node_under_fx_and_traces_under_dynamo() -> None:
    model = _TwoBags()
    gm = torch.fx.symbolic_trace(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(grouped_embedding_bag) == 1
    a = torch.randint(0, 10, (3, 2))
    b = torch.randint(0, 5, (3, 4))
    torch.testing.assert_close(gm(a, b), model(a, b))
    retraced = torch.fx.symbolic_trace(gm)  # a rewritten graph re-traces to the same graph
    assert [n.target for n in retraced.graph.nodes if n.op == "call_function"] == targets
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(a, b), model(a, b))
