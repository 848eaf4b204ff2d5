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
