"""Dense inputs past the signature cache: a graph serves only the sizes it was built for.

Rules bake dense sizes into graphs (a sequence's length unflattened back, a bag's number of
ids, a piece's width), all but a dense input's dim 0, the batch. Once the cache holds 8
signatures, a new one reuses a graph that differs from it in the batch alone, checked on its
first inputs; any other new size gets a graph of its own. Each rule family is run on new
batch sizes and sequence lengths past the cache, outputs and gradients against the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import fxrec
from fxrec.graph import module as module_mod
from fxrec.graph.module import MAX_CACHED_SIGNATURES, _signature, _structure
from tests.graph.test_sparse_signatures import assert_same_step

D, N, IDS = 8, 4, 30


class _SeparateLinears(nn.Module):
    """Linears on separate ``(B, L, D)`` inputs: one ``baddbmm`` over their rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))

    def forward(self, x0: Tensor, x1: Tensor, x2: Tensor, x3: Tensor) -> Tensor:
        xs = (x0, x1, x2, x3)
        return torch.stack([torch.relu(lin(x)).mean(1) for lin, x in zip(self.lins, xs)], 1)


class _Unbound(nn.Module):
    """Linear and LayerNorm per piece of ``x.unbind(2)`` of one ``(B, L, N, D)`` tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.unbind(2)  # (indexed: a symbolic trace cannot iterate it)
        outs = [torch.tanh(self.norms[i](self.lins[i](xs[i]))).mean(1) for i in range(N)]
        return torch.stack(outs, 1)


class _SplitCat(nn.Module):
    """The seed pattern over ``(B, L, N * D)``: split, LayerNorms, tanh, cat."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))
        self.head = nn.Linear(N * D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.split(D, -1)
        parts = [torch.tanh(self.norms[i](xs[i])) for i in range(N)]
        return self.head(torch.cat(parts, -1)).mean(1)


class _SeparateNorms(nn.Module):
    """LayerNorms on separate ``(B, L, D)`` inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))

    def forward(self, x0: Tensor, x1: Tensor, x2: Tensor, x3: Tensor) -> Tensor:
        xs = (x0, x1, x2, x3)
        return torch.stack([torch.sigmoid(n(x)).mean(1) for n, x in zip(self.norms, xs)], 1)


class _HandPooled(nn.Module):
    """``nn.Embedding`` lookups of ``(B, L)`` ids summed by hand: bags of ``L`` ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(IDS, D) for _ in range(N))

    def forward(self, i0: Tensor, i1: Tensor, i2: Tensor, i3: Tensor) -> Tensor:
        ids = (i0, i1, i2, i3)
        return torch.cat([e(i).sum(1) for e, i in zip(self.embs, ids)], 1)


class _SequenceFirst(nn.Module):
    """Linears on ``(L, B, D)`` views of the inputs: the batch is the rows' second dim."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(N))

    def forward(self, x0: Tensor, x1: Tensor, x2: Tensor, x3: Tensor) -> Tensor:
        xs = (x0, x1, x2, x3)
        outs = [torch.relu(lin(x.transpose(0, 1))).mean(0) for lin, x in zip(self.lins, xs)]
        return torch.stack(outs, 1)


def _separate(b: int, length: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, length, D) for _ in range(N))


# family -> (model class, inputs for a batch and a length, a rule the family fires)
_FAMILIES: dict[str, tuple[type[nn.Module], Callable[[int, int], tuple], str]] = {
    "linear_leading_dims": (_SeparateLinears, _separate, "parallel_linear_batched"),
    "unbind_pieces": (_Unbound, lambda b, n: (torch.randn(b, n, N, D),), "parallel_layer_norm"),
    "split_cat": (_SplitCat, lambda b, n: (torch.randn(b, n, N * D),), "cat_of_split"),
    "norms": (_SeparateNorms, _separate, "parallel_layer_norm"),
    "embedding": (
        _HandPooled,
        lambda b, n: tuple(torch.randint(0, IDS, (b, n)) for _ in range(N)),
        "parallel_embedding",
    ),
    "sequence_first": (_SequenceFirst, _separate, "parallel_linear_batched"),
}
_SERVED: dict[str, tuple[nn.Module, nn.Module, nn.Module]] = {}


def _served(family: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(plain model, optimized module, module holding its members), the cache full of
    signatures of length 2 (built once per family and shared by the examples)."""
    if family not in _SERVED:
        cls, make, rule = _FAMILIES[family]
        torch.manual_seed(0)
        model = cls()
        plain = copy.deepcopy(model)
        opt = fxrec.optimize(model, make(4, 2))
        assert opt.fxrec_report.capture == "symbolic_trace"  # (dynamo's graphs: one per size)
        assert rule in {f.rule for f in opt.fxrec_report.firings}
        for b in range(5, 5 + MAX_CACHED_SIGNATURES):
            opt(*make(b, 2))
        _SERVED[family] = plain, opt, model
    return _SERVED[family]


def _same_step(plain: nn.Module, opt: Any, members: nn.Module, args: tuple) -> None:
    """Outputs and gradients (by name, through the flat layouts) equal the plain model's."""
    assert_same_step(plain, opt, members, args, args)
    plain.zero_grad()
    opt.zero_grad()


@settings(max_examples=30)
@given(
    st.sampled_from(sorted(_FAMILIES)),
    st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=3),
)
def test_batch_sizes_and_lengths_past_the_cache_train_like_the_model(
    family: str, sizes: list[tuple[int, int]]
) -> None:
    plain, opt, members = _served(family)
    make = _FAMILIES[family][1]
    for b, length in sizes:
        _same_step(plain, opt, members, make(b, length))


def test_the_structure_keeps_every_dense_size_but_the_batch() -> None:
    def key(b: int, length: int) -> Any:
        return _structure(_signature((torch.randn(b, length, D), torch.randn(b, 3))))

    assert key(4, 2) == key(9, 2)  # the batch alone differs: one graph may serve both
    assert key(4, 2) != key(4, 3)  # a sequence's length: rules bake it
    assert key(4, 2) != _structure(_signature((torch.randn(4, 2, D + 1), torch.randn(4, 3))))


def test_lengths_past_the_cache_get_graphs_of_their_own_unchecked() -> None:
    """With ``check=False`` nothing checks a reused graph: the key alone keeps a graph built
    for bags of 2 ids from pooling bags of another length."""
    torch.manual_seed(0)
    _, make, _ = _FAMILIES["embedding"]
    model = _HandPooled()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, make(4, 2), check=False)
    for b in range(5, 5 + MAX_CACHED_SIGNATURES):
        opt(*make(b, 2))
    for b, length in ((3, 4), (2, 8), (5, 1)):
        _same_step(plain, opt, model, make(b, length))


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one on each graph built from a trace from now on."""
    builds: list[int] = []
    original = module_mod.OptimizedModule._optimize_traced

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(module_mod.OptimizedModule, "_optimize_traced", counted)
    return builds


@pytest.mark.parametrize("family", ["linear_leading_dims", "sequence_first"])
def test_new_batch_sizes_past_the_cache_reuse_a_graph(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new batch size of a length seen before, within the power of two of a cached one,
    builds nothing: the graph reads its leading dims at run time, wherever the batch sits
    among them."""
    torch.manual_seed(0)
    cls, make, _ = _FAMILIES[family]
    model = cls()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, make(4, 3))
    assert opt.fxrec_report.capture == "symbolic_trace"
    for b in range(5, 5 + MAX_CACHED_SIGNATURES):
        opt(*make(b, 3))
    builds = _count_builds(monkeypatch)
    for b in (13, 15, 14):
        _same_step(plain, opt, model, make(b, 3))
    assert builds == []


def test_a_batch_of_another_scale_past_the_cache_gets_a_graph_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU cost model fuses sets whose members are small enough for dispatch to matter:
    a graph built for batches of 2-13 fuses sets that batch 4096 runs faster as written.
    Past the cache, batch 4096 gets its graph (the kernels of a graph built for it first),
    once for its power of two; forced reuse aside, smaller batches keep theirs."""
    from fxrec.bench.models import ParallelTowers

    torch.manual_seed(0)
    model = ParallelTowers(8, 32, (32, 32, 16)).eval()
    plain = copy.deepcopy(model)
    fresh = fxrec.optimize(copy.deepcopy(model), (torch.randn(64, 32),)).eval()
    opt = fxrec.optimize(model, (torch.randn(64, 32),)).eval()
    big = torch.randn(4096, 32)
    assert opt.fxrec_report.capture == "symbolic_trace"
    with torch.no_grad():
        for b in range(2, 14):
            opt(torch.randn(b, 32))
        builds = _count_builds(monkeypatch)
        for x in (big, torch.randn(5000, 32), torch.randn(13, 32)):
            torch.testing.assert_close(opt(x), plain(x), rtol=1e-4, atol=1e-4)
    assert len(builds) == 1  # 4096's scale once; 5000 shares it, 13 is cached
    want = fxrec.count_kernels(fresh, big, backward=False).forward
    small = fxrec.count_kernels(opt, torch.randn(13, 32), backward=False).forward
    assert fxrec.count_kernels(opt, big, backward=False).forward == want > small


class _SequenceFirstIds(nn.Module):
    """Bags of ids given sequence first, ``(L, B)``: the input's dim 0 is not its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(IDS, D) for _ in range(N))

    def forward(self, i0: Tensor, i1: Tensor, i2: Tensor, i3: Tensor) -> Tensor:
        ids = (i0, i1, i2, i3)
        return torch.cat([e(i.t()).sum(1) for e, i in zip(self.embs, ids)], 1)


def test_a_graph_that_baked_a_first_dim_does_not_serve_another() -> None:
    """The bags' length is the ids' dim 0 here, which the reuse key leaves out; the check on
    a new signature's first inputs finds the graph wrong for it, and builds one."""
    torch.manual_seed(0)
    model = _SequenceFirstIds()
    plain = copy.deepcopy(model)

    def make(length: int, b: int = 4) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randint(0, IDS, (length, b)) for _ in range(N))

    opt = fxrec.optimize(model, make(2))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert "parallel_embedding" in {f.rule for f in opt.fxrec_report.firings}
    for length in range(3, 3 + MAX_CACHED_SIGNATURES):
        opt(*make(length))
    for length in (12, 1, 13):
        _same_step(plain, opt, model, make(length))
    assert any("another batch size disagrees" in n for n in opt.fxrec_report.notes)


@pytest.mark.parametrize("family", ["split_cat", "sequence_first"])
def test_more_structures_than_the_cache_taking_turns_build_each_once(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve lengths served in turn (more than the cache holds): a graph built past the cache
    is kept with the signatures past it, not in place of a cached one, so none is rebuilt;
    and it serves the other batch sizes of its length."""
    torch.manual_seed(0)
    cls, make, _ = _FAMILIES[family]
    model = cls()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, make(4, 1))
    assert opt.fxrec_report.capture == "symbolic_trace"
    lengths = range(1, 13)
    for length in lengths:
        opt(*make(4, length))
    builds = _count_builds(monkeypatch)
    for _ in range(2):
        for length in lengths:
            _same_step(plain, opt, model, make(4, length))
    assert builds == []
    for length in (10, 12):  # a new batch size of a length first seen past the cache
        _same_step(plain, opt, model, make(7, length))
    assert builds == []


class _TensorDictIds(nn.Module):
    """Bags of ids held by a TensorDict with a batch size: ``(B, L)`` dense entries."""

    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(IDS, D) for _ in range(N))

    def forward(self, td: Any) -> Tensor:
        return torch.cat([self.embs[i](td[f"f{i}"]).sum(1) for i in range(N)], 1)


class _Batch:
    """A user's batch class (not a dataclass) holding a list of ``(B, L)`` ids."""

    def __init__(self, ids: list[Tensor], step: int) -> None:
        self.ids = ids
        self.step = step  # read by nothing the graph bakes: not part of the signature


class _BatchIds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(IDS, D) for _ in range(N))

    def forward(self, batch: _Batch) -> Tensor:
        return torch.cat([self.embs[i](batch.ids[i]).sum(1) for i in range(N)], 1)


def _td_ids(b: int, length: int) -> tuple[Any, ...]:
    from tensordict import TensorDict

    ids = {f"f{i}": torch.randint(0, IDS, (b, length)) for i in range(N)}
    return (TensorDict(ids, batch_size=[b]),)


def _batch_ids(b: int, length: int) -> tuple[Any, ...]:
    return (_Batch([torch.randint(0, IDS, (b, length)) for _ in range(N)], step=b * length),)


@pytest.mark.parametrize(
    ("cls", "make"), [(_TensorDictIds, _td_ids), (_BatchIds, _batch_ids)], ids=["td", "object"]
)
def test_dense_sizes_inside_containers_key_graphs(cls: type[nn.Module], make: Callable) -> None:
    """A TensorDict's dense entries and a batch object's tensors key graphs by their sizes
    past the batch, as dense arguments do: bags of another length get a graph of their own
    (they pooled with the example's length, or raised a bare size error at length 1)."""
    pytest.importorskip("tensordict")
    torch.manual_seed(0)
    model = cls()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, make(4, 3))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert "parallel_embedding" in {f.rule for f in opt.fxrec_report.firings}
    for b, length in ((4, 3), (4, 5), (2, 7), (4, 1), (6, 3)):
        _same_step(plain, opt, model, make(b, length))


def test_a_batch_objects_scalars_do_not_key_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-batch counter on a batch object is read at run time: batches that differ in it
    alone share a graph (each would otherwise be a new signature, built past the cache)."""
    torch.manual_seed(0)
    opt = fxrec.optimize(_BatchIds(), _batch_ids(4, 3))
    builds = _count_builds(monkeypatch)
    for step in range(20):
        opt(_Batch([torch.randint(0, IDS, (4, 3)) for _ in range(N)], step=step))
    assert builds == []
