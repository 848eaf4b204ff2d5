"""Serving from several threads: first calls that build graphs at once, and calls of other
modules while a graph is traced.

A symbolic trace patches ``nn.Module.__call__``/``__getattr__`` (fx) and ``torch.randn`` &
co. and ``torch.utils.checkpoint`` (fxrec) for the whole process, saving and restoring what it
finds. Threads whose first calls each traced at once failed (NameError, fx's module-stack
assertion) and left those patches installed: every later module call in the process raised.
Builds now take one process-wide lock; a call that finds its graph built takes none. Calls
made on other threads while a trace runs run as written."""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import fxrec

ROWS = (2, 3, 5, 7)  # each thread's batch size: a signature of its own


class Towers(nn.Module):
    def __init__(self, d: int = 32, n: int = 6) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
            for _ in range(n)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(n))
        self.head = nn.Linear(8 * n, 1)
        self.during_trace: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.during_trace is not None and isinstance(x, torch.fx.Proxy):
            self.during_trace()
        outs = [torch.tanh(ln(t(x))) for t, ln in zip(self.towers, self.norms)]
        return self.head(torch.cat(outs, 1))


class Branchy(Towers):
    """Not symbolically traceable (a branch on the input's rank): captured with dynamo."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:
            x = x.flatten(1)
        return super().forward(x)


ORIGINAL = {
    "nn.Module.__call__": nn.Module.__call__,
    "nn.Module.__getattr__": nn.Module.__getattr__,
    "torch.randn": torch.randn,
    "torch.rand": torch.rand,
    "checkpoint generator": ckpt._checkpoint_without_reentrant_generator,
}


def _patched() -> list[str]:
    """What is not as torch had it before any trace."""
    now = {
        "nn.Module.__call__": nn.Module.__call__,
        "nn.Module.__getattr__": nn.Module.__getattr__,
        "torch.randn": torch.randn,
        "torch.rand": torch.rand,
        "checkpoint generator": ckpt._checkpoint_without_reentrant_generator,
    }
    left = [k for k, v in now.items() if v is not ORIGINAL[k]]
    if "apply" in ckpt.CheckpointFunction.__dict__:  # inherited from autograd.Function
        left.append("CheckpointFunction.apply")
    return left


def _torch_works_on_this_thread() -> None:
    torch.testing.assert_close(nn.Linear(2, 2)(torch.ones(1, 2)).shape, torch.Size([1, 2]))
    assert torch.randn(3).shape == (3,)
    for reentrant in (False, True):
        x = torch.randn(3, requires_grad=True)
        ckpt.checkpoint(torch.sin, x, use_reentrant=reentrant).sum().backward()
        torch.testing.assert_close(x.grad, torch.cos(x.detach()))


@pytest.fixture
def interleaved() -> Iterator[None]:
    """Thread switches every 10 µs, so that concurrent first calls overlap."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _at_once(fn: Callable[[int], Any], rows: tuple[int, ...] = ROWS) -> list[Any]:
    """``fn(rows)`` on a thread per batch size, started together; results in order."""
    barrier = threading.Barrier(len(rows))
    results: list[Any] = [None] * len(rows)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(rows[i])
        except BaseException as exc:  # handed to the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("cls", [Towers, Branchy], ids=lambda c: c.__name__)
def test_concurrent_first_eval_calls(cls: type[Towers], interleaved: None) -> None:
    for seed in range(3 if cls is Towers else 1):  # dynamo compiles each signature: slower
        _first_eval_calls_at_once(cls, seed)


def _first_eval_calls_at_once(cls: type[Towers], seed: int) -> None:
    torch.manual_seed(seed)
    model = cls()
    plain = copy.deepcopy(model).eval()
    opt = fxrec.optimize(model, (torch.randn(16, 32),))  # optimized in training mode
    opt.eval()  # served in eval mode: no eval graph yet
    inputs = {rows: torch.randn(rows, 32) for rows in ROWS}

    def serve(rows: int) -> torch.Tensor:
        grad_off = torch.inference_mode() if rows == ROWS[0] else torch.no_grad()
        with grad_off:
            return opt(inputs[rows])

    outs = _at_once(serve)
    assert _patched() == []
    _torch_works_on_this_thread()
    with torch.no_grad():
        for rows, out in zip(ROWS, outs):
            torch.testing.assert_close(out, plain(inputs[rows]))
    # one eval capture (inference mode keys as no_grad), one graph per batch size
    assert [m for m in opt._traced if m[0] is False] == [(False, (None, None), False)]
    assert sorted(k[1][1][1][0] for k in opt._runners if k[0] is False) == list(ROWS)


def test_concurrent_first_train_calls(interleaved: None) -> None:
    model = Towers()
    plain = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 32),))
    inputs = {rows: torch.randn(rows, 32) for rows in ROWS}

    def step(rows: int) -> torch.Tensor:
        out = opt(inputs[rows])
        out.sum().backward()
        return out.detach()

    outs = _at_once(step)
    assert _patched() == []
    _torch_works_on_this_thread()
    for rows, out in zip(ROWS, outs):  # train mode: batch statistics, whatever the order
        want = plain(inputs[rows])
        want.sum().backward()
        torch.testing.assert_close(out, want.detach())
    _assert_same_grads(opt, plain)

    # then training goes on: a few steps on fresh inputs, single-threaded
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(9, 32)
        for o, m in ((sgd, opt), (sgd_plain, plain)):
            o.zero_grad()
            m(x).square().mean().backward()
        _assert_same_grads(opt, plain)
        sgd.step()
        sgd_plain.step()
    for (name, p), q in zip(opt.state_dict().items(), plain.state_dict().values()):
        if "running" not in name and "num_batches" not in name:  # updated in thread order
            torch.testing.assert_close(p, q, msg=name)


def _assert_same_grads(opt: fxrec.OptimizedModule, plain: nn.Module) -> None:
    grads = opt.fxrec_fused.grads(opt.model)  # laid-out members': slices of the flat ones
    for name, q in plain.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=name)


def test_other_threads_run_modules_while_a_graph_is_traced() -> None:
    """Called from inside the trace, another thread calls a plain model, a submodule of the
    model being traced, ``torch.randn`` and ``torch.utils.checkpoint``: each as written."""
    model = Towers()
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    seen: list[Any] = []

    def elsewhere() -> None:
        try:
            seen.append(other(x))
            seen.append(model.towers[0][0](torch.ones(2, 32)))
            seen.append(torch.randn(2))
            y = torch.randn(3, requires_grad=True)
            seen.append(ckpt.checkpoint(torch.sin, y, use_reentrant=False))
        except BaseException as exc:
            seen.append(exc)

    def during_trace() -> None:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()

    model.during_trace = during_trace
    opt = fxrec.optimize(model, (torch.randn(8, 32),))
    assert opt.fxrec_report.capture == "symbolic_trace"
    assert len(seen) == 4, seen
    assert not any(isinstance(s, BaseException) for s in seen), seen
    assert all(type(s) is torch.Tensor for s in seen), seen
    torch.testing.assert_close(seen[0], other(x))
    model.during_trace = None
    torch.testing.assert_close(seen[1], model.towers[0][0](torch.ones(2, 32)))
    assert _patched() == []


def test_a_process_forked_during_a_build_builds_its_own_graphs() -> None:
    """A DataLoader worker forked while another thread is inside ``fxrec.optimize`` inherits
    ``capture_lock`` and dynamo's compile lock held, and fx's "tracing" flag set, by a
    thread that does not exist in it: its first call on a new input size waited forever."""
    from torch._dynamo.convert_frame import compile_lock

    torch.manual_seed(0)
    served = Branchy()
    plain = copy.deepcopy(served)
    opt = fxrec.optimize(served, (torch.randn(16, 32),))
    opt.eval()
    plain.eval()
    x = torch.randn(5, 32)  # a new signature in a new mode: the child builds
    inside, release = threading.Event(), threading.Event()

    def during_trace() -> None:
        with compile_lock:  # as a dynamo compile in progress on this thread
            inside.set()
            release.wait(120)

    building = Towers()
    building.during_trace = during_trace
    builder = threading.Thread(target=fxrec.optimize, args=(building, (torch.randn(8, 32),)))
    builder.start()
    try:
        assert inside.wait(120)
        got = _in_forked_child(lambda: opt(x).tolist())
    finally:
        release.set()
        builder.join(120)
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(got), plain(x))


def _in_forked_child(fn: Callable[[], Any], timeout: float = 90) -> Any:
    """``fn()`` run in a forked process, under no_grad; its exception's text if it raises."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def child() -> None:
        torch.set_num_threads(1)  # as DataLoader workers: OpenMP's pool does not survive fork
        try:
            with torch.no_grad():
                results.put(fn())
        except BaseException as exc:
            results.put(f"{type(exc).__name__}: {exc}")

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    try:
        got = results.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"the forked process gave no result in {timeout} s (waiting on a lock?)")
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    assert not isinstance(got, str), got
    return got


class Breaks(Towers):
    """A data-dependent branch: dynamo captures two graphs, and every call goes through its
    guards (no direct call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.sum().item() > -1e9:
            out = out * 2
        return out


def test_calls_through_dynamo_while_another_thread_traces() -> None:
    """Dynamo refuses to enter a compiled function while fx's (process-wide) tracing flag is
    set: a warmed-up model served through dynamo raised while another thread's
    ``fxrec.optimize`` traced. Such calls now wait for that build."""
    torch.manual_seed(0)
    served = Breaks().eval()
    plain = copy.deepcopy(served)
    opt = fxrec.optimize(served, (torch.randn(16, 32),))
    assert any("through dynamo's guards" in n for n in opt.fxrec_report.notes)
    x = torch.randn(16, 32)
    with torch.no_grad():
        for _ in range(2):
            opt(x)  # warmed up: its graphs built and compiled
    got: list[Any] = []

    def serve() -> None:
        try:
            with torch.no_grad():
                got.append(opt(x))
        except BaseException as exc:
            got.append(exc)

    def during_trace() -> None:  # the call is made while this trace runs
        t = threading.Thread(target=serve)
        t.start()
        t.join(1.0)  # a call that waits for the build finishes after it
        servers.append(t)

    servers: list[threading.Thread] = []
    building = Towers()
    building.during_trace = during_trace
    fxrec.optimize(building, (torch.randn(8, 32),))
    servers[0].join(120)
    assert len(got) == 1 and not isinstance(got[0], BaseException), got
    with torch.no_grad():
        torch.testing.assert_close(got[0], plain(x))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_eager_calls_while_another_thread_compiles(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """``torch.compiler.is_compiling()`` is one flag for the whole process, True while any
    thread compiles: a collection called eagerly meanwhile took the traced path (fbgemm's
    lookup recursed into its own op until RecursionError) and skipped the id check. fxrec asks
    whether this thread compiles. The flag is set here as another thread's compile sets it."""
    from fxrec.nn import EmbeddingBagCollection
    from fxrec.sparse import KeyedJaggedTensor
    from tests.nn.helpers import check_against_reference, mixed_tables, random_kjt

    ebc = EmbeddingBagCollection(mixed_tables(), backend=backend)  # type: ignore[arg-type]
    kjt = random_kjt(ebc, 6, torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    check_against_reference(ebc, kjt)
    ids = kjt.values().clone()
    ids[0] = 1000
    bad = KeyedJaggedTensor(kjt.keys(), ids, lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"id 1000 .* is outside table"):
        ebc(bad)


def test_optimized_module_called_while_another_thread_exports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch.compiler.is_exporting()`` is one flag for the process too: an optimized module
    called eagerly while another thread exported refused to run ("cannot export an optimized
    module whose parameters are laid out"). The flags are set here as an export sets them."""
    model = Towers()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 32)
    opt = fxrec.optimize(model, (x,))
    assert opt.fxrec_fused.member_ids()  # laid out: the export refusal applies
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
    torch.testing.assert_close(opt(x), ref(x))
    y = torch.randn(9, 32)  # a new signature builds on this thread as it would without them
    torch.testing.assert_close(opt(y), ref(y))
