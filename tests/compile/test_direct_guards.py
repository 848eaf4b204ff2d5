"""Direct calls of a dynamo capture (``fxrec.optimize`` without ``guards=True``) keep what
dynamo's guards would catch: Python values the graph baked in from the arguments (a KJT's
per-key counts), the arguments' strides, and, for graphs compiled further, which parameters
take gradients. Each call that would need another graph goes through dynamo, which
recompiles; outputs and gradients equal the model's. A forward whose module is not named
``self`` is captured the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec
from fxrec.sparse import KeyedJaggedTensor

KEYS = ["f0", "f1", "f2"]


class PerKeySums(nn.Module):
    """Reads each feature's ids by the KJT's per-key counts (a loop dynamo captures); two
    Linears on one input to fuse (a graph nothing fused would run the model instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pieces = torch.split(kjt.values().float(), kjt.length_per_key())
        sums = torch.stack([p.sum() for p in pieces])  # symbolic tracing cannot iterate
        return self.lin(dense) * torch.sigmoid(self.gate(dense)) * sums


def _kjt(lengths: list[int]) -> KeyedJaggedTensor:
    n = sum(lengths)
    kjt = KeyedJaggedTensor(KEYS, torch.arange(n) * 7 % 10, lengths=torch.tensor(lengths))
    kjt.length_per_key()  # computed (and kept) before the call, as a loader's checks do
    return kjt


def test_per_key_counts_baked_into_the_graph_are_checked() -> None:
    torch.manual_seed(0)
    model = PerKeySums()
    ref = copy.deepcopy(model)
    dense = torch.randn(3, 3)
    opt = fxrec.optimize(model, (dense, _kjt([1] * 9)))
    assert opt.fxrec_report.capture == "dynamo"
    assert opt.fxrec_report.count("parallel_linear_same_input") == 1
    assert any("skip dynamo's guards" in n for n in opt.fxrec_report.notes)
    # nine ids in every batch, split otherwise: [3, 3, 3], then [2, 3, 4], [4, 4, 1], ...
    for lengths in ([1] * 9, [0, 1, 1, 1, 1, 1, 1, 1, 2], [2, 1, 1, 2, 1, 1, 0, 1, 0]):
        x = torch.randn(3, 3)
        got, want = opt(x, _kjt(lengths)), ref(x, _kjt(lengths))
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        grads = opt.fxrec_fused.grads(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)
        opt.zero_grad()
        ref.zero_grad()
    torch._dynamo.reset()


class Seed(nn.Module):
    """The seed pattern behind a branch on the input's rank (dynamo captures it)."""

    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.head = nn.Linear(n * d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.flatten(1)
        parts = torch.split(x, self.d, dim=1)
        return self.head(torch.cat([torch.tanh(n(p)) for n, p in zip(self.norms, parts)], 1))


def test_inputs_of_other_strides_are_checked() -> None:
    """Inductor's code asserts the strides it was compiled for; a column slice of a wider
    batch (same shape) crashed it."""
    torch.manual_seed(0)
    model = Seed()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 32),), backend="inductor")
    opt(torch.randn(8, 32))
    wide = torch.randn(8, 40)
    for x in (wide[:, 4:36], torch.randn(32, 8).t(), torch.randn(8, 32)):
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_parameter_unfrozen_after_optimize_gets_its_gradient(backend: str) -> None:
    torch.manual_seed(0)
    model = Seed()
    model.head.requires_grad_(False)  # frozen for a warm-up
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 32),), backend=backend)
    opt(torch.randn(8, 32)).sum().backward()
    opt.zero_grad()
    for m in (model, ref):
        m.head.requires_grad_(True)
    for _ in range(2):
        x = torch.randn(8, 32)
        opt(x).square().sum().backward()
        ref(x).square().sum().backward()
        grads = opt.fxrec_fused.grads(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
        opt.zero_grad()
        ref.zero_grad()
    torch._dynamo.reset()


class SeedNamedM(Seed):
    def forward(m, x: torch.Tensor) -> torch.Tensor:  # any name works
        if x.dim() == 3:
            x = x.flatten(1)
        parts = torch.split(x, m.d, dim=1)
        return m.head(torch.cat([torch.tanh(n(p)) for n, p in zip(m.norms, parts)], 1))


def test_a_forward_whose_module_is_not_named_self_is_optimized_alike() -> None:
    reports = []
    for cls in (Seed, SeedNamedM):
        torch.manual_seed(0)
        opt = fxrec.optimize(cls(), (torch.randn(8, 32),))
        assert opt.fxrec_report.capture == "dynamo"
        assert len(opt.fxrec_fused.member_ids()) == 8  # the four norms' weights and biases
        reports.append((opt.fxrec_report.kernels_after, opt.fxrec_report.count()))
    assert reports[0] == reports[1]
    torch._dynamo.reset()
