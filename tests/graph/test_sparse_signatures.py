"""Sparse inputs key graphs by their rows per key, not only by their keys.

Rules bake sizes derived from a sparse input's rows per key into a graph (each feature's
lengths, fused, split or stacked with fixed sizes), so a graph built for one batch must not
serve another with other rows: a sparse-only model's last, smaller batch, or a variable batch
per key. The number of ids changes every batch and stays out of the key. Past the cache, new
rows per key run the model eagerly rather than building a graph on every batch. Each new
signature's build also serves sparse inputs made outside ``inference_mode`` under it, and
dynamo's captures, one per signature, share no compiled frame up to dynamo's recompile limit.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

import fxrec
from fxrec.graph import module as module_mod
from fxrec.graph.module import MAX_CACHED_SIGNATURES, _signature, _structure
from fxrec.passes.combine_inputs import combine_inputs
from fxrec.sparse import KeyedJaggedTensor, kjt_from_tensordict, kjt_to_tensordict, pack_features

NF, ROWS, D = 8, 20, 4
KEYS = [f"f{i}" for i in range(NF)]


@torch.fx.wrap
def _as_kjt(sparse: Any) -> KeyedJaggedTensor:
    """A TensorDict, or a plain dict of jagged nested tensors, read as a KJT."""
    return kjt_from_tensordict(sparse) if isinstance(sparse, (TensorDictBase, dict)) else sparse


class _Tower(nn.Module):
    """A sparse-only tower: per feature, a bag over offsets computed from the lengths, a
    LayerNorm and a ReLU (fused across features, their rows stacked); ``per_key``: each
    feature's rows averaged on their own, so features may have different batch sizes."""

    def __init__(self, per_key: bool) -> None:
        super().__init__()
        self.per_key = per_key
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, D, mode="sum") for _ in KEYS)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in KEYS)
        self.out = nn.Linear(NF * D, 3)

    def forward(self, sparse: Any) -> torch.Tensor:
        kjt = _as_kjt(sparse)
        parts = []
        for bag, norm, k in zip(self.bags, self.norms, KEYS):
            jt = kjt[k]
            lens = jt.lengths()
            pooled = torch.relu(norm(bag(jt.values(), torch.cumsum(lens, 0) - lens)))
            parts.append(pooled.mean(0, keepdim=True) if self.per_key else pooled)
        return self.out(torch.cat(parts, 1))


def _kjt(rows: list[int], seed: int) -> KeyedJaggedTensor:
    """Random ids, ``rows[i]`` bags for key i (a uniform KJT when they are all equal)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (sum(rows),), generator=g)
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    if len(set(rows)) == 1:
        return KeyedJaggedTensor(KEYS, ids, lengths=lengths, stride=rows[0])
    return KeyedJaggedTensor(KEYS, ids, lengths=lengths, stride_per_key=rows)


def assert_same_step(
    plain: nn.Module, opt: Any, members: nn.Module, plain_args: tuple, opt_args: tuple
) -> None:
    """Outputs and gradients (by name, through the flat layouts) of one call equal the plain
    model's; ``members``: the module whose parameters ``opt`` laid out."""
    want, got = plain(*plain_args), opt(*opt_args)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    grads = opt.fxrec_fused.grads(members)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def _train_alike(
    plain: nn.Module,
    opt: nn.Module,
    members: nn.Module,
    batches: Iterable[KeyedJaggedTensor],
    feed: Callable[[KeyedJaggedTensor], tuple],
) -> None:
    """Outputs, gradients (by name, through the flat layouts) and parameters after each SGD
    step equal the plain model's; ``members``: the module whose parameters ``opt`` laid out."""
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    for kjt in batches:
        assert_same_step(plain, opt, members, (kjt,), feed(kjt))
        sgd_plain.step()
        sgd_opt.step()
        sgd_plain.zero_grad()
        sgd_opt.zero_grad()
    got_state = members.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got_state[name], value, msg=name)


def _optimized(plain: nn.Module, example: KeyedJaggedTensor, kind: str) -> tuple:
    """(optimized module, module holding its members, batch -> its call's arguments)."""
    model = copy.deepcopy(plain)
    if kind == "combined":
        model, packer = combine_inputs(model, (example,))
        return fxrec.optimize(model, packer(example)), model, lambda kjt: packer(kjt)
    feed = (lambda kjt: (kjt_to_tensordict(kjt),)) if kind == "td" else (lambda kjt: (kjt,))
    return fxrec.optimize(model, feed(example)), model, feed


@pytest.mark.parametrize("kind", ["kjt", "td", "combined"])
def test_sparse_only_model_trains_at_a_smaller_last_batch(kind: str) -> None:
    torch.manual_seed(0)
    plain = _Tower(per_key=False)
    opt, members, feed = _optimized(plain, _kjt([8] * NF, 0), kind)
    batches = [_kjt([b] * NF, seed) for seed, b in enumerate((8, 5, 5), 1)]
    _train_alike(plain, opt, members, batches, feed)


@pytest.mark.parametrize("kind", ["kjt", "td"])
def test_variable_batch_per_key_trains_like_the_model(kind: str) -> None:
    torch.manual_seed(0)
    plain = _Tower(per_key=True)
    opt, members, feed = _optimized(plain, _kjt([6] * NF, 0), kind)
    spks = ([3, 9] + [6] * (NF - 2), [2, 10] * (NF // 2), [6] * NF)
    batches = [_kjt(spk, seed) for seed, spk in enumerate(spks, 1)]
    _train_alike(plain, opt, members, batches, feed)


def _count_calls(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """A list that grows by one on each call of ``OptimizedModule.<method>`` from now on."""
    calls: list[int] = []
    original = getattr(module_mod.OptimizedModule, method)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(module_mod.OptimizedModule, method, counted)
    return calls


@pytest.mark.parametrize("kind", ["kjt", "td"])
def test_rows_per_key_past_the_cache_stay_right_without_a_build_per_batch(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = _count_calls(monkeypatch, "_optimize_traced")
    torch.manual_seed(0)
    plain = _Tower(per_key=True)
    opt, members, feed = _optimized(plain, _kjt([6] * NF, 0), kind)
    rng = random.Random(0)
    spks = [[rng.randint(1, 10) for _ in KEYS] for _ in range(3 * MAX_CACHED_SIGNATURES)]
    _train_alike(plain, opt, members, [_kjt(spk, i) for i, spk in enumerate(spks, 1)], feed)
    assert len(builds) <= MAX_CACHED_SIGNATURES
    assert any("sets of rows per key" in note for note in opt.fxrec_report.notes)


def _torchrec_kjt(rows: list[int], seed: int) -> TorchrecKJT:
    kjt = _kjt(rows, seed)
    variable = len(set(rows)) > 1
    return TorchrecKJT(
        keys=KEYS,
        values=kjt.values(),
        lengths=kjt.lengths(),
        stride_per_key_per_rank=[[r] for r in rows] if variable else None,
    )


def _combined(rows: list[int], seed: int) -> Any:
    return pack_features(_kjt(rows, seed))


@pytest.mark.parametrize(
    "make",
    [_kjt, _torchrec_kjt, _combined, lambda rows, seed: kjt_to_tensordict(_kjt(rows, seed))],
    ids=["kjt", "torchrec_kjt", "combined", "tensordict"],
)
def test_signature_keys_rows_per_key_not_the_number_of_ids(make: Callable) -> None:
    uniform, other_ids = make([4] * NF, 1), make([4] * NF, 2)
    assert other_ids is not uniform and _signature(other_ids) == _signature(uniform)
    for rows in ([5] * NF, [3, 5] * (NF // 2), [5, 3] * (NF // 2)):
        other = _signature(make(rows, 1))
        assert other != _signature(uniform)
        assert _structure(other) != _structure(_signature(uniform))  # no graph serves both
        assert _structure(other, False) == _structure(_signature(uniform), False)


@dataclasses.dataclass
class _Batch:
    """A batch type holding the KJT, as TorchRec's ``Batch`` does for ``DLRMTrain``."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor


class _BatchTower(nn.Module):
    """The tower on a batch's KJT (its dense part rides along)."""

    def __init__(self, per_key: bool) -> None:
        super().__init__()
        self.tower = _Tower(per_key)

    def forward(self, batch: _Batch) -> torch.Tensor:
        return self.tower(batch.sparse)


def _njts(kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """``{feature: jagged nested tensor}``, a feature's rows as its bags."""
    out = {}
    for k, jt in kjt.to_dict().items():
        rows = torch.split(jt.values(), jt.lengths().tolist())
        out[k] = torch.nested.nested_tensor(list(rows), layout=torch.jagged)
    return out


@pytest.mark.parametrize("per_key", [False, True], ids=["smaller_batch", "variable_per_key"])
def test_a_kjt_inside_a_dataclass_keys_by_its_rows(per_key: bool) -> None:
    torch.manual_seed(0)
    model = _BatchTower(per_key)
    plain = copy.deepcopy(model.tower)
    dense = torch.randn(2)
    opt = fxrec.optimize(model, (_Batch(dense, _kjt([8] * NF, 0)),))
    spks = ([3, 9] + [8] * (NF - 2), [8] * NF) if per_key else ([5] * NF, [8] * NF)
    batches = [_kjt(spk, seed) for seed, spk in enumerate(spks, 1)]
    _train_alike(plain, opt, model.tower, batches, lambda kjt: (_Batch(dense, kjt),))


def test_a_dict_of_njts_keys_by_its_rows_past_the_cache() -> None:
    """Rows of jagged nested tensors stay in the structure: no cached graph built for other
    rows serves them once the cache is full."""
    torch.manual_seed(0)
    plain = _Tower(per_key=True)  # (rows averaged: the loss does not grow with the batch)
    model = copy.deepcopy(plain)
    opt = fxrec.optimize(model, (_njts(_kjt([2] * NF, 0)),))
    sizes = range(3, 3 + MAX_CACHED_SIGNATURES + 3)
    _train_alike(plain, opt, model, [_kjt([b] * NF, b) for b in sizes], lambda k: (_njts(k),))
    first, other = _signature(_njts(_kjt([4] * NF, 1))), _signature(_njts(_kjt([4] * NF, 2)))
    assert first == other  # the ids' count stays out
    assert _structure(_signature(_njts(_kjt([5] * NF, 1)))) != _structure(first)


def test_signatures_past_the_cache_build_nothing_on_later_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A serving loop over many batch sizes: each size past the cache finds its shared
    runner at once on its later calls, with no build path taken."""
    torch.manual_seed(0)
    plain = _Tower(per_key=False).eval()
    opt = fxrec.optimize(copy.deepcopy(plain), (_kjt([2] * NF, 0),))
    sizes = list(range(3, 3 + 2 * MAX_CACHED_SIGNATURES))
    with torch.no_grad():
        for b in sizes:
            opt(_kjt([b] * NF, b))
        builds = _count_calls(monkeypatch, "_build_locked")
        for b in sizes:
            kjt = _kjt([b] * NF, b + 100)
            torch.testing.assert_close(opt(kjt), plain(kjt))
    assert builds == []


def _feed(kind: str) -> Callable[[KeyedJaggedTensor], tuple]:
    """A batch as the model's argument: the KJT, a TensorDict, or a dict of jagged nested
    tensors."""
    if kind == "td":
        return lambda kjt: (kjt_to_tensordict(kjt),)
    if kind == "njts":
        return lambda kjt: (_njts(kjt),)
    return lambda kjt: (kjt,)


@pytest.mark.parametrize("kind", ["kjt", "td", "njts"])
def test_inputs_made_outside_inference_mode_serve_under_it(kind: str) -> None:
    """A request built outside ``inference_mode`` (by a loader, a parser) and served under
    it: each new signature's build runs the model on copies of what it may change, and
    the jagged tensors made outside the mode are copied inside it."""
    torch.manual_seed(0)
    plain = _Tower(per_key=False).eval()
    feed = _feed(kind)
    opt = fxrec.optimize(copy.deepcopy(plain), feed(_kjt([8] * NF, 0))).eval()
    for b in range(2, 4 + MAX_CACHED_SIGNATURES):  # new batch sizes, into and past the cache
        kjt = _kjt([b] * NF, b)
        args = feed(kjt)
        with torch.inference_mode():
            got, want = opt(*args), plain(kjt)
        torch.testing.assert_close(got, want)


class _ShapeChecked(nn.Module):
    """Two features' bags, each averaged over its own rows, behind a check on the output's
    shape: no symbolic trace (dynamo captures each signature, fxrec's conversion of the
    TensorDict inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, D, mode="sum") for _ in range(2))

    def forward(self, sparse: Any) -> torch.Tensor:
        kjt = _as_kjt(sparse)
        parts = []
        for bag, k in zip(self.bags, KEYS):
            jt = kjt[k]
            lens = jt.lengths()
            parts.append(bag(jt.values(), torch.cumsum(lens, 0) - lens).mean(0, keepdim=True))
        out = torch.cat(parts, 1)
        return out * 0.5 if out.shape[0] > 0 else out


def _steps_between_eval_calls(
    opt: nn.Module, plain: nn.Module, members: nn.Module, feed: Callable, steps: int = 10
) -> None:
    """Training steps on a variable batch per key, each followed by a ``no_grad`` call: every
    signature's capture compiles in both grad modes."""
    rng = random.Random(0)
    for i in range(steps):
        spk = [rng.randint(1, 9) for _ in KEYS]
        _train_alike(plain, opt, members, [_kjt(spk, i)], feed)
        kjt = _kjt(spk, i + 100)
        with torch.no_grad():
            torch.testing.assert_close(opt(*feed(kjt)), plain(kjt))


def test_conversions_compile_no_frame_shared_by_signatures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fxrec's TensorDict conversion, which every signature's capture runs, runs as written
    under dynamo: no frame of its own whose compiled entries add up over signatures to
    dynamo's recompile limit (even with recompiles shared by every capture, as before torch
    2.13)."""
    monkeypatch.setattr(module_mod, "_ISOLATED_RECOMPILES", {})
    torch.manual_seed(0)
    plain = _ShapeChecked()
    model = copy.deepcopy(plain)
    feed = _feed("td")
    opt = fxrec.optimize(model, feed(_kjt([6] * NF, 0)))
    assert opt.fxrec_report.capture == "dynamo"
    _steps_between_eval_calls(opt, plain, model, feed)
    assert not [n for n in opt.fxrec_report.notes if "recompile limit" in n]


def _scaled(x: torch.Tensor, tag: str) -> torch.Tensor:
    """A helper dynamo compiles as a frame of its own (it breaks the graph), one entry per
    ``tag`` (each signature's batch size), which it reads before the break."""
    y = x * (0.5 if tag else 1.0)
    torch._dynamo.graph_break()
    return y


class _Helped(nn.Module):
    """Parallel LayerNorms, then the helper (no symbolic trace: dynamo captures them)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:
            x = x + 1.0
        parts = x.split(4, 1)
        return _scaled(torch.cat([self.norms[i](parts[i]) for i in range(3)], 1), str(len(x)))


def _helped_steps(*, isolated: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Training calls and no_grad calls on 6 batch sizes; the optimized module."""
    if not isolated:
        monkeypatch.setattr(module_mod, "_ISOLATED_RECOMPILES", {})
    torch.manual_seed(0)
    plain = _Helped()
    opt = fxrec.optimize(copy.deepcopy(plain), (torch.randn(2, 12),))
    assert opt.fxrec_report.capture == "dynamo"
    for b in range(3, 9):
        x = torch.randn(b, 12)
        torch.testing.assert_close(opt(x), plain(x))
        with torch.no_grad():
            torch.testing.assert_close(opt(x), plain(x))
    return opt


@pytest.mark.skipif(
    not module_mod._ISOLATED_RECOMPILES, reason="torch.compile has no isolate_recompiles"
)
def test_a_function_every_signature_calls_reaches_no_recompile_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each signature's capture counts the recompiles of the functions it calls on its own:
    a helper shared by all of them (and by every model) is no reason to run them eagerly."""
    opt = _helped_steps(isolated=True, monkeypatch=monkeypatch)
    assert not [n for n in opt.fxrec_report.notes if "recompile limit" in n]


def test_a_recompile_limit_reached_in_a_called_function_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a function the forward calls reaches dynamo's recompile limit (recompiles
    shared by every capture, as before torch 2.13), the report names that function rather
    than blaming a value the forward reads."""
    opt = _helped_steps(isolated=False, monkeypatch=monkeypatch)
    notes = [n for n in opt.fxrec_report.notes if "recompile limit" in n]
    assert notes
    assert all("in _scaled (" in n and "a Python value" not in n for n in notes), notes
