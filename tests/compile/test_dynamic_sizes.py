"""``fxrec.compile_backend`` on graphs with symbolic sizes.

With ``torch.compile``'s default ``dynamic=None``, the smaller last batch of an epoch makes
dynamo compile a graph with a symbolic batch size that then serves every later batch. Each
concrete batch size must still run a fused copy (same kernels as before the small batch),
and training must match the plain model; so must ``dynamic=True`` (whose float attributes,
a LayerNorm's ``eps``, become inputs too), and the signatures past the cache, which run the
graph with symbolic sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec
import fxrec.compile.specialize as specialize
from tests.compile.helpers import GraphRecorder


class Towers(nn.Module):
    """Per-feature LayerNorm + tanh towers over slices of one input, then a head."""

    def __init__(self, n: int = 6, d: int = 4) -> None:
        super().__init__()
        self.d = d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.head = nn.Linear(n * d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.d, 1)
        return self.head(torch.cat([torch.tanh(n(p)) for p, n in zip(parts, self.norms)], 1))


def _step(model: nn.Module, fn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """One SGD step of ``fn`` (``model`` or its compiled form); the output and gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=True)
    out = fn(x)
    (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return out.detach(), grads


def _trains_like_plain(compiled: nn.Module, twin: nn.Module, plain: nn.Module, batches) -> None:  # type: ignore[no-untyped-def]
    for b in batches:
        x = torch.randn(b, 24)
        got, want = _step(twin, compiled, x), _step(plain, plain, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for p, q in zip(twin.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def _compiled(inner: str, dynamic: bool | None) -> tuple[nn.Module, nn.Module, nn.Module, object]:
    torch.manual_seed(0)
    plain = Towers()
    twin = copy.deepcopy(plain)
    backend = fxrec.compile_backend(inner)
    return torch.compile(twin, backend=backend, dynamic=dynamic), twin, plain, backend


def test_last_small_batch_keeps_later_full_batches_fused() -> None:
    compiled, twin, plain, backend = _compiled("eager", None)
    x = torch.randn(16, 24)
    _trains_like_plain(compiled, twin, plain, [16])
    before = fxrec.count_kernels(compiled, x)
    _trains_like_plain(compiled, twin, plain, [7, 16])  # the small batch: a symbolic graph
    after = fxrec.count_kernels(compiled, x)
    small = fxrec.count_kernels(compiled, torch.randn(7, 24))
    unfused = fxrec.count_kernels(plain, x)
    assert (after.forward, after.backward) == (before.forward, before.backward)
    assert (small.forward, small.backward) == (before.forward, before.backward)
    assert before.forward < unfused.forward and before.backward < unfused.backward
    _trains_like_plain(compiled, twin, plain, [16, 7, 3, 16])
    assert any("copy optimized for each" in n for n in backend.report.notes)
    assert not any("need static sizes" in n for n in backend.report.notes)


def _static_counts(inner: str, x: torch.Tensor) -> tuple[int, int]:
    compiled, *_ = _compiled(inner, False)
    k = fxrec.count_kernels(compiled, x)
    return k.forward, k.backward


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_dynamic_true_fuses_like_static_sizes(inner: str) -> None:
    x = torch.randn(16, 24)
    want = _static_counts(inner, x)
    torch._dynamo.reset()
    compiled, twin, plain, backend = _compiled(inner, True)
    _trains_like_plain(compiled, twin, plain, [16, 5, 16])  # aot_eager builds on a 2nd call
    k = fxrec.count_kernels(compiled, x)
    assert (k.forward, k.backward) == want
    _trains_like_plain(compiled, twin, plain, [5, 16, 9])
    built = {"eager": 3, "aot_eager": 2}[inner]  # a copy per size; compiled: seen twice
    assert backend.report.count("parallel_layer_norm") == built


def test_signatures_past_the_cache_run_symbolic_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(specialize, "MAX_SIGNATURES", 2)
    compiled, twin, plain, backend = _compiled("eager", True)
    x = torch.randn(16, 24)
    _trains_like_plain(compiled, twin, plain, [16, 7])
    fused = fxrec.count_kernels(compiled, x)
    _trains_like_plain(compiled, twin, plain, [5, 9, 16])  # 5 and 9: past the cache
    big = fxrec.count_kernels(compiled, torch.randn(9, 24))
    assert fxrec.count_kernels(compiled, x).forward == fused.forward
    assert big.forward == fxrec.count_kernels(plain, x).forward  # unfused, still right
    assert any("more than 2 sets of sizes" in n for n in backend.report.notes)


def test_sizes_seen_once_leave_room_for_a_size_seen_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiled copies are built on a size's second call: sizes seen once (the last batch, a
    jagged input's number of ids) build nothing and do not fill the cache."""
    monkeypatch.setattr(specialize, "MAX_SIGNATURES", 2)
    x = torch.randn(16, 24)
    want = _static_counts("aot_eager", x)
    torch._dynamo.reset()
    compiled, twin, plain, backend = _compiled("aot_eager", True)
    _trains_like_plain(compiled, twin, plain, [3, 4, 5, 6, 16, 16])
    k = fxrec.count_kernels(compiled, x)
    assert (k.forward, k.backward) == want
    assert backend.report.count("parallel_layer_norm") == 1


def test_a_copy_that_fails_to_build_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed build (a graph whose copies the inner backend cannot compile) means the
    graph runs with symbolic sizes from then on: no further build is tried per signature."""
    monkeypatch.setenv("FXREC_STRICT", "0")
    tried = []

    def fail(*args: object, **kwargs: object) -> None:
        tried.append(1)
        raise RuntimeError("cannot build")

    monkeypatch.setattr(specialize, "specialized_copy", fail)
    compiled, twin, plain, backend = _compiled("eager", True)
    _trains_like_plain(compiled, twin, plain, [16, 5, 7, 16, 9])
    assert len(tried) == 1
    assert any("specializing a graph failed" in n for n in backend.report.notes)


def test_other_inner_backends_see_the_symbolic_graph() -> None:
    rec = GraphRecorder()
    backend = fxrec.compile_backend(rec)
    torch.compile(Towers(), backend=backend, dynamic=True)(torch.randn(3, 24))
    assert len(rec.graphs) == 1 and any("need static sizes" in n for n in backend.report.notes)


def _counting_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the inner backend resolver so each graph the inner backend compiles is counted."""
    import fxrec.compile.backend as backend_mod

    real = backend_mod.inner_backend
    compiles: list[int] = []

    def counting(inner):  # type: ignore[no-untyped-def]
        fn = real(inner)

        def compile_one(gm, args):  # type: ignore[no-untyped-def]
            compiles.append(1)
            return fn(gm, args)

        return compile_one

    monkeypatch.setattr(backend_mod, "inner_backend", counting)
    return compiles


class Plain(nn.Module):
    """Nothing for a rule to fuse, whatever the sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def test_copies_that_fuse_nothing_more_are_not_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiling inner backend compiles a copy for concrete sizes only where the copy fuses
    more than the graph with symbolic sizes; otherwise that compiled graph runs the sizes."""
    compiles = _counting_compiles(monkeypatch)
    torch.manual_seed(0)
    plain = Plain()
    twin = copy.deepcopy(plain)
    backend = fxrec.compile_backend("aot_eager")
    compiled = torch.compile(twin, backend=backend, dynamic=True)
    first = 0
    for b in [16, 16, 5, 5, 9, 9]:
        x = torch.randn(b, 24)
        got, want = _step(twin, compiled, x), _step(plain, plain, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        first = first or len(compiles)
    assert first > 0 and len(compiles) == first  # sizes seen twice compiled nothing more
    assert any("are not compiled" in n for n in backend.report.notes)

    compiles.clear()
    torch._dynamo.reset()
    towers, twin, plain, backend = _compiled("aot_eager", True)
    _trains_like_plain(towers, twin, plain, [16])
    first = len(compiles)
    _trains_like_plain(towers, twin, plain, [16, 5, 5])
    assert len(compiles) == first + 2  # a fused copy for 16 and one for 5
