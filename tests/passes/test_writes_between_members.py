"""In-place writes between fused members that the driver did not see as such.

* ``t += y`` is ``operator.iadd`` in a dynamo graph: not seen as a write, so members around it
  fused at the last one's position and the first read the tensor after the write.
* A write to module state (a buffer, a ``get_attr``) was always let through, as BatchNorm's
  ``num_batches_tracked.add_(1)`` may be: a member that read the buffer before the write then
  read it after. Such writes stay allowed only while nothing between the members reads the
  state (BatchNorms still fuse in training).

Compared with the model on fresh inputs (outputs and gradients of inputs), through
``fxrec.optimize`` (``check=False``, zero example inputs: the check cannot see these),
``compile_backend`` and the Inductor pass.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxrec
from tests.compile.helpers import through_inductor_pass


class AugmentedWriteToTheBase(nn.Module):
    """Four tanh over pieces of ``h``; ``h += y`` lies between the first and the others."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        p = [h[:, i : i + 2] for i in range(0, 8, 2)]
        a = torch.tanh(p[0])
        h += y
        return torch.cat([a, torch.tanh(p[1]), torch.tanh(p[2]), torch.tanh(p[3])], 1) * 2


class BufferReadThenWritten(nn.Module):
    """A member reads a buffer that is written in place before the other members run."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.state.view_as(x))  # a view: a symbolic trace keeps it in the graph
        self.state.add_(y.detach())
        return torch.cat([a, torch.tanh(x), torch.tanh(x * y), torch.tanh(x + y)], 1)


@pytest.mark.parametrize(
    ("cls", "entry"),
    [
        # a symbolic trace records ``h += y`` as ``h + y``: only dynamo graphs keep the write
        (AugmentedWriteToTheBase, "compile_backend"),
        (AugmentedWriteToTheBase, "inductor_pass"),
        (BufferReadThenWritten, "optimize"),
        (BufferReadThenWritten, "compile_backend"),
        (BufferReadThenWritten, "inductor_pass"),
    ],
)
def test_members_see_the_write_where_the_model_does(cls: type[nn.Module], entry: str) -> None:
    model = cls()
    twin = copy.deepcopy(model)
    zeros = [torch.zeros(4, 8), torch.zeros(4, 8)]
    if entry == "optimize":
        run: Callable[..., torch.Tensor] = fxrec.optimize(twin, tuple(zeros), check=False)
    elif entry == "compile_backend":
        torch._dynamo.reset()
        run = torch.compile(twin, backend=fxrec.compile_backend())
    else:
        run = through_inductor_pass(twin, zeros)
    for buf in (*model.buffers(), *twin.buffers()):
        buf.zero_()  # example runs wrote the twin's: both start from zeros
    for _ in range(2):  # the second call reads the state the first one wrote
        xs = [torch.randn(4, 8), torch.randn(4, 8)]
        mine = [x.clone().requires_grad_() for x in xs]
        theirs = [x.clone().requires_grad_() for x in xs]
        got, want = run(*mine), model(*theirs)
        torch.testing.assert_close(got, want)
        weights = torch.linspace(0.5, 1.5, want.numel()).view(want.shape)
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        for m, t in zip(mine, theirs):
            torch.testing.assert_close(m.grad, t.grad)
    torch._dynamo.reset()
