"""parallel_unary over pieces of a few tensors: one op per tensor, as a view, no gathering cat.

Per-feature LayerNorms of several dims, interleaved by feature, fuse into one set per dim; the
activations after them take their inputs from those few tensors. Copying the pieces back
together in feature order (a ``cat`` before the activation, cut into chunks on a CPU) costs
more than one activation per tensor, and the model's own ``cat`` copies them anyway.
"""

from __future__ import annotations

import torch
from torch import nn

import fxrec
from tests.passes.test_linear import check_equivalent

DIMS = (16, 32, 64)


class Interleaved(nn.Module):
    """Feature i (of dim ``DIMS[i % 3]``): LayerNorm -> tanh, all features joined by one cat."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.dims = [DIMS[i % len(DIMS)] for i in range(n)]
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in self.dims)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tanh(norm(x)) for norm, x in zip(self.norms, xs)], 1)


class InterleavedBags(nn.Module):
    """The same after per-feature EmbeddingBags (their lookups fuse per dim too)."""

    def __init__(self, n: int, rows: int = 50) -> None:
        super().__init__()
        self.dims = [DIMS[i % len(DIMS)] for i in range(n)]
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum") for d in self.dims)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in self.dims)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outs = [
            torch.tanh(norm(bag(ids[:, i])))
            for i, (bag, norm) in enumerate(zip(self.bags, self.norms))
        ]
        return torch.cat(outs, 1)


def _inputs(n: int):  # type: ignore[no-untyped-def]
    dims = [DIMS[i % len(DIMS)] for i in range(n)]
    return lambda b: tuple(torch.randn(b, d, requires_grad=True) for d in dims)


def _ids(n: int, rows: int = 50):  # type: ignore[no-untyped-def]
    return lambda b: (torch.randint(0, rows, (b, n, 2)),)


def _fired_details(opt: fxrec.OptimizedModule, rule: str) -> list[str]:
    return [f.detail for f in opt.first_report.firings if f.rule == rule]  # type: ignore[attr-defined]


def test_one_tanh_per_layer_norm_output_and_no_gathering_cat() -> None:
    n, batch = 12, 128  # each dim's run holds enough elements to pay for a launch of its own
    opt = check_equivalent(lambda: Interleaved(n), _inputs(n), batches=(batch, 96))
    assert _fired_details(opt, "parallel_unary") == ["tanh x4"] * 3
    xs = _inputs(n)(batch)
    kc = fxrec.count_kernels(opt, *xs)
    plain = fxrec.count_kernels(Interleaved(n), *xs)
    assert (plain.forward, plain.backward) == (2 * n + 1, 3 * n + 1)
    # per dim: stack, layer_norm, addcmul, tanh; then the model's cat
    assert kc.forward_ops == {
        "aten::stack": 3,
        "aten::native_layer_norm": 3,
        "aten::addcmul": 3,
        "aten::tanh": 3,
        "aten::cat": 1,
    }
    assert kc.forward == 13
    assert kc.backward_ops["aten::tanh_backward"] == 3
    assert "aten::cat" not in kc.backward_ops  # each tanh's gradient is already one tensor
    assert kc.backward == 52  # 24 of them: the separate inputs' gradients (stack backward)


def test_small_runs_are_still_gathered_by_one_cat() -> None:
    n, batch = 12, 4  # each run far below what pays for a launch of its own
    opt = check_equivalent(lambda: Interleaved(n), _inputs(n), batches=(batch, 7))
    assert _fired_details(opt, "parallel_unary") == [f"tanh x{n} (cat)"]
    assert fxrec.count_kernels(opt, *_inputs(n)(batch)).forward_ops["aten::tanh"] == 1


def test_embedding_bags_of_interleaved_dims_take_one_tanh_per_tensor() -> None:
    n, batch = 12, 128
    opt = check_equivalent(lambda: InterleavedBags(n), _ids(n), batches=(batch, 96))
    details = _fired_details(opt, "parallel_unary")
    assert details and not any("(cat)" in d for d in details), details
    kc = fxrec.count_kernels(opt, *_ids(n)(batch))
    assert kc.forward_ops["aten::tanh"] == kc.forward_ops["aten::native_layer_norm"] == 3
    assert kc.backward_ops["aten::tanh_backward"] == 3
