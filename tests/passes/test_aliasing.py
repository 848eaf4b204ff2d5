"""Rewrites keep what in-place writes, views and random draws see.

Each model writes in place into, views, or draws random numbers around the nodes a rule
would fuse or cancel. The optimized module (``check=False``: a rewrite must be right by
itself, not saved by the example-input check) must give the eager model's outputs, input
and parameter gradients, with the same random draws.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrec

D = 4


class Norms(nn.Module):
    """Four LayerNorms over the pieces of one input (fused by ``parallel_layer_norm``)."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(4))
        self.relu = nn.ReLU(inplace=True)
        self.after = after

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        parts = x.split(D, 1)
        y0 = self.norms[0](parts[0])
        extra = []
        if self.after == "write_between":  # a read of z, then z written, before the others
            extra.append(y0 + z)
            z.clamp_(max=0.5)
        elif self.after == "dropout_between":  # draws between the members
            extra.append(F.dropout(y0, 0.5, True))
            extra.append(F.dropout(z, 0.5, True))
        ys = [y0] + [n(p) for n, p in zip(self.norms[1:], parts[1:])] + extra
        if self.after == "relu_":
            y0.relu_()
        elif self.after == "module_inplace":
            y0 = self.relu(y0)
        elif self.after == "setitem":
            y0[:, :2] = 0
        elif self.after == "view":
            y0 = y0.view(-1).view(x.shape[0], D)
        return torch.cat([y0, *ys[1:], z], 1)


class Slices(nn.Module):
    """Disjoint slices of one tensor, one written in place (``slices_to_split``)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x * 2
        a, b = h[:, : 2 * D], h[:, 2 * D :]
        a.relu_()
        return torch.cat([a * 3, b * 5, z], 1)


class Cancel(nn.Module):
    """A cat (or stack) of a split's pieces (a copy), its base written in place afterwards."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if self.how == "cat_of_split":
            y = torch.cat(h.split(2, 1), 1)
        else:
            y = torch.stack([h[:, 0:2], h[:, 2:4], h[:, 4:6]], 1).flatten(1)
        h.clamp_(max=1)
        return torch.cat([y, h, z], 1)


class Draws(nn.Module):
    """Two random ops with equal arguments: two draws, never one (``dedup``)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.rrelu(x, training=True), F.rrelu(x, training=True), z], 1)


class OutWrite(nn.Module):
    """Equal products, one of them then written through ``out=`` (``dedup``)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = x.detach()  # ops writing through out= take no gradient
        a, b = x * 2, x * 2
        torch.where(z.sum(1, keepdim=True) > 0, z.sum(1, keepdim=True), a, out=a)
        return torch.cat([a, b], 1)


CASES = [
    *(
        pytest.param(lambda a=a: Norms(a), id=f"layer_norm-{a}")
        for a in ("relu_", "module_inplace", "setitem", "view", "write_between", "dropout_between")
    ),
    pytest.param(Slices, id="slices_written"),
    pytest.param(lambda: Cancel("cat_of_split"), id="cat_of_split-base_written"),
    pytest.param(lambda: Cancel("stack"), id="stack_of_pieces-base_written"),
    pytest.param(Draws, id="dedup-random"),
    pytest.param(OutWrite, id="dedup-out"),
]


def _run(model: nn.Module, x: torch.Tensor, z: torch.Tensor) -> tuple:
    xi, zi = x.clone().requires_grad_(), z.clone()
    torch.manual_seed(7)
    out = model(xi * 1, zi)
    if out.requires_grad:
        out.backward(torch.ones_like(out))
    return out.detach(), xi.grad


@pytest.mark.parametrize("make", CASES)
def test_writes_views_and_draws_are_kept(make) -> None:  # type: ignore[no-untyped-def]
    model = make()
    ref = copy.deepcopy(model)
    x, z = torch.randn(3, 4 * D), torch.randn(3, D)
    opt = fxrec.optimize(model, (x, z.clone()), check=False)
    for _ in range(2):
        x, z = torch.randn(3, 4 * D) * 3, torch.randn(3, D) * 3
        got, want = _run(opt, x, z), _run(ref, x, z)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    grads = opt.fxrec_fused.grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_cat_of_an_inputs_split_is_not_the_input() -> None:
    class Roundtrip(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat(x.split(2, 1), 1)

    x = torch.randn(3, 8)
    opt = fxrec.optimize(Roundtrip(), (x,), check=False)
    out = opt(x)
    assert out is not x and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, x)
