"""count_kernels: exact counts, views skipped, forward and backward separate."""

from __future__ import annotations

import torch

import fxrec


def test_counts_kernels_and_skips_views() -> None:
    x = torch.randn(4, 6, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        v = t.view(6, 4).transpose(0, 1)  # views: not kernels
        return torch.tanh(v) * 2

    k = fxrec.count_kernels(f, x)
    assert k.forward == 2  # tanh, mul
    assert k.forward_ops == {"aten::tanh": 1, "aten::mul": 1}
    assert k.backward >= 2
    assert k.total == k.forward + k.backward


def test_backward_false_counts_forward_only() -> None:
    x = torch.randn(3, requires_grad=True)
    k = fxrec.count_kernels(torch.sigmoid, x, backward=False)
    assert (k.forward, k.backward) == (1, 0)


def test_works_under_torch_compile() -> None:
    """The counter must not make dynamo fall back to eager (FIELD_NOTES)."""
    torch._dynamo.reset()
    f = torch.compile(lambda t: torch.tanh(t) + 1, backend="eager")
    x = torch.randn(8)
    k = fxrec.count_kernels(f, x, backward=False)
    assert k.forward == 2
    torch._dynamo.reset()


def test_module_counts_a_fresh_step_and_keeps_its_grads() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    first = fxrec.count_kernels(model, x)
    assert all(p.grad is None for p in model.parameters())
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    again = fxrec.count_kernels(model, x)
    # No accumulation kernels for the gradients already there, and those are left as they were.
    assert again.backward_ops == first.backward_ops
    assert "aten::add_" not in again.backward_ops
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_metadata_only_views_after_a_copy_are_not_kernels() -> None:
    """``reshape`` of a tensor that cannot be viewed copies once (``clone``) and then views the
    copy with ``_unsafe_view`` (metadata only): one kernel."""
    x = torch.randn(8, 4)
    kc = fxrec.count_kernels(lambda t: t.t().reshape(-1), x, backward=False)
    assert kc.forward_ops == {"aten::clone": 1}
    assert kc.forward == 1
