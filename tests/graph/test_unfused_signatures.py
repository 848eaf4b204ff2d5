"""Signatures no rule rewrote run the model as written.

A graph nothing fused computes what the model computes, yet running it costs dynamo's guards
and graph breaks (2x a small model's call) or the graph module's parameter reads. Those calls
go to the model itself, unless parameters are laid out, which only the graph reads right.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

import fxrec
from fxrec.graph.module import MAX_CACHED_SIGNATURES, _DynamoRunner, _Unfused

NOTE = "a signature no rule rewrote: its calls run the model as written"


class _Mlp(nn.Module):
    """Nothing to fuse: one chain of layers. ``branch``: a data-dependent ``if`` (no symbolic
    trace; dynamo breaks the graph there); ``dim``: an ``if`` on the rank (one dynamo graph)."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.how = how
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "branch" and x.sum() > 0:
            x = x * 2.0
        elif self.how == "dim" and x.dim() == 2:
            x = x - 1.0
        return self.l2(torch.relu(self.norm(self.l1(x))))


class _Towers(nn.Module):
    """Parallel LayerNorms (fused, laid out) on ``x`` alone; given ``rest``, all of them in a
    chain on ``x`` (nothing to fuse; each member still gets a gradient, as in the plain model).
    ``flag``: the branch is picked by a bool (no symbolic trace: dynamo captures both)."""

    def __init__(self, flag: bool) -> None:
        super().__init__()
        self.flag = flag
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:
        if (rest.dim() == 0) if self.flag else (rest is None):
            parts = torch.split(x, 4, dim=1)
            return self.head(torch.cat([n(p) for n, p in zip(self.norms, parts)], 1))
        for norm in self.norms:
            x = norm(x)
        return self.head(torch.cat([x, rest], 1))


@contextmanager
def _linear_calls() -> Iterator[list[int]]:
    """Counts ``nn.Linear.forward`` calls: the model's code runs them, a captured graph not."""
    calls = [0]
    original = nn.Linear.forward

    def counted(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return original(self, x)

    nn.Linear.forward = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        nn.Linear.forward = original  # type: ignore[method-assign]


def _train_like_plain(model: nn.Module, opt: nn.Module, batches: list[tuple]) -> None:
    """Three SGD steps on each; losses and parameters (by name) stay equal."""
    sgd_plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1, momentum=0.9)
    for args in batches:
        for m, sgd in ((model, sgd_plain), (opt, sgd_opt)):
            sgd.zero_grad()
            loss = m(*args).square().mean()
            loss.backward()
            sgd.step()
            if m is model:
                want = loss.detach()
            else:
                torch.testing.assert_close(loss.detach(), want, rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(opt.get_parameter(name), p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["plain", "branch", "dim"])
def test_unfused_calls_run_the_model(how: str) -> None:
    torch.manual_seed(0)
    model = _Mlp(how)
    opt = fxrec.optimize(copy.deepcopy(model), torch.randn(5, 6))
    assert NOTE in opt.fxrec_report.notes
    assert opt.fxrec_report.count() == 0
    runner = next(iter(opt._runners.values()))
    assert isinstance(runner, _Unfused if how == "plain" else _DynamoRunner)
    with _linear_calls() as calls:
        for _ in range(3):
            x = torch.randn(5, 6)
            torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    assert calls[0] == 2 * 3 * 2  # two Linears, three calls, the model and opt
    _train_like_plain(model, opt, [(torch.randn(5, 6),) for _ in range(3)])
    model.eval(), opt.eval()
    with torch.no_grad():
        x = torch.randn(9, 6)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("flag", [False, True], ids=["symbolic", "dynamo"])
def test_unfused_signature_reads_laid_out_parameters_through_the_graph(flag: bool) -> None:
    """Another signature fused the LayerNorms: this one reads their members, whose gradients
    must reach the flat parameter the optimizer holds, as only the captured graph makes it."""
    torch.manual_seed(0)
    model = _Towers(flag)
    fused = (torch.randn(5, 12), torch.tensor(0.0)) if flag else (torch.randn(5, 12),)
    opt = fxrec.optimize(copy.deepcopy(model), fused)
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    assert opt.fxrec_fused.laid_out()
    chain = (torch.randn(5, 4), torch.randn(5, 8))
    batches = [fused, chain, (torch.randn(5, 4), torch.randn(5, 8)), chain]
    _train_like_plain(model, opt, batches)
    key = next(k for k in opt._runners if len(k[1]) == 3 and k[1][1][1] == (5, 4))
    runner = opt._runners[key]
    assert isinstance(runner, _Unfused) or runner.unfused


def test_fused_signatures_do_not_run_the_model() -> None:
    torch.manual_seed(0)
    model = _Towers(False)
    opt = fxrec.optimize(copy.deepcopy(model), torch.randn(5, 12))
    assert NOTE not in opt.fxrec_report.notes
    assert not any(isinstance(r, _Unfused) for r in opt._runners.values())
    x = torch.randn(5, 12)
    with _linear_calls() as calls:
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=1e-6)
    assert calls[0] == 1  # the model's head; the graph calls no module


def test_without_autograd_unfused_calls_run_the_model_over_laid_out_parameters() -> None:
    """No gradient to route: the members read the flat tensors' data, and the model runs."""
    torch.manual_seed(0)
    model = _Towers(True)
    opt = fxrec.optimize(copy.deepcopy(model), (torch.randn(5, 12), torch.tensor(0.0)))
    assert opt.fxrec_fused.laid_out()
    sgd = torch.optim.SGD(opt.parameters(), lr=0.5)
    opt(torch.randn(5, 12), torch.tensor(0.0)).sum().backward()
    sgd.step()  # the flat tensors move: the model must read them, not stale copies
    model.load_state_dict(opt.state_dict())
    opt.eval(), model.eval()
    with torch.no_grad():
        opt(torch.randn(5, 4), torch.randn(5, 8))  # builds (and checks) the signature
    with torch.no_grad(), _linear_calls() as calls:
        for _ in range(3):
            x, rest = torch.randn(5, 4), torch.randn(5, 8)
            torch.testing.assert_close(opt(x, rest), model(x, rest), rtol=0, atol=1e-6)
    assert calls[0] == 3 * 2  # the head, in opt's calls and the model's


def test_signatures_past_the_cache_of_a_dynamo_capture_run_the_model() -> None:
    """The capture with symbolic sizes that serves batch sizes past the cache fuses nothing
    (rules need static sizes): its calls run the model too."""
    torch.manual_seed(0)
    model = _Mlp("dim").eval()
    opt = fxrec.optimize(copy.deepcopy(model), torch.randn(2, 6))
    sizes = range(3, 3 + MAX_CACHED_SIGNATURES + 4)
    with torch.no_grad():
        for b in sizes:
            opt(torch.randn(b, 6))
        (overflow,) = opt._overflow.values()
        assert overflow.unfused
        with _linear_calls() as calls:
            for b in sizes:
                x = torch.randn(b, 6)
                torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    assert calls[0] == 2 * 2 * len(sizes)
