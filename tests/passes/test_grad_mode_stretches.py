"""Rewrites around the grad-mode switches dynamo keeps in its graphs (``with torch.no_grad()``).

* A fused node goes where its last member is and takes the readers of the other members
  after it: members on both sides of a ``no_grad`` block fused, a reader of the first member
  inside the block moved out of it and recorded a gradient the model cuts.
* A view taken under ``no_grad`` passes no gradient to its base (though it says
  ``requires_grad``): split/cat rules that take such pieces as their base (``cat(pieces) ->
  base``, ``split(cat(xs)) -> xs``, slices -> one split...), and fused members that read
  their pieces as one view of the base, passed it.
* Called under an outer ``no_grad``, code outside a ``torch.enable_grad()`` block records
  nothing: dedup merged a computation there with its twin inside the block.

Each model runs through ``fxrec.optimize`` (``check=False``: the output check compares values
only), ``compile_backend`` and the Inductor pass (on the graph dynamo hands Inductor), and is
compared with the model on fresh inputs: outputs, ``requires_grad`` and gradients of inputs
and parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxrec
from tests.compile.helpers import dynamo_graph, through_inductor_pass


class ReaderInsideTheBlock(nn.Module):
    """Three tanh fuse; the first one's result is read inside a no_grad block before the
    others run."""

    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        p0, p1, p2 = (x0 * x1).split(2, 1)[:3]
        a = torch.tanh(p0)
        with torch.no_grad():
            t = a * 3
        return (a - t).pow(2).sum() + (torch.tanh(p1) * x2[:, :2]).sum() + torch.tanh(p2).sum()


class NormReadInsideTheBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))

    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        a, b, c, d = torch.cat([x0, x1, x2, x2 * 2], 1).split(8, 1)
        h0 = self.lns[0](a)
        with torch.no_grad():
            target = h0 * 2
        rest = [ln(p) for ln, p in zip(self.lns[1:], (b, c, d))]
        return ((h0 - target) ** 2).sum() + sum((h * h).sum() for h in rest)


class CatUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        parts = h.split(4, 1)
        with torch.no_grad():
            target = torch.cat(parts, 1)
        return ((h - target * 0.5) ** 2).sum()


class SplitUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            parts = h.split(4, 1)
        target = torch.cat(parts, 1)
        return ((h - target * 0.5) ** 2).sum()


class CatRunUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            parts = h.split(4, 1)
        target = torch.cat([z, *parts], 1)
        return ((torch.cat([z, h], 1) - target * 0.5) ** 2).sum()


class SplitOfCatUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        a, b = x * w, x * 2 * w
        with torch.no_grad():
            c = torch.cat([a, b], 1)
        p, q = c.split(8, 1)
        return ((a - p * 0.5) ** 2).sum() + ((b - q * 0.5) ** 2).sum()


class SliceUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            a = h[:, :4]
        return (a * h[:, 4:]).sum() + (h**2).sum()


class SinglePieceUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            (a,) = h.split(8, 1)
        return ((h - a * 0.5) ** 2).sum()


class InnerSplitUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        left, right = h.split(4, 1)
        with torch.no_grad():
            p, q = left.split(2, 1)
        return (p * right[:, :2] + q * right[:, 2:]).sum() + (h**2).sum()


class StackUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            parts = h.unbind(1)
        return (h.t() * torch.stack(parts)).sum()


class TanhOfPiecesSplitUnderNoGrad(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            parts = h.split(2, 1)
        return sum((torch.tanh(p) * h[:, :2]).sum() for p in parts) + (h**2).sum()


class NormsOfPiecesSplitUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(2) for _ in range(4))

    def forward(self, x: torch.Tensor, w: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = x * w
        with torch.no_grad():
            parts = h.split(2, 1)
        return sum((ln(p) * h[:, :2]).sum() for ln, p in zip(self.lns, parts)) + (h**2).sum()


CASES = [
    ReaderInsideTheBlock,
    NormReadInsideTheBlock,
    CatUnderNoGrad,
    SplitUnderNoGrad,
    CatRunUnderNoGrad,
    SplitOfCatUnderNoGrad,
    SliceUnderNoGrad,
    SinglePieceUnderNoGrad,
    InnerSplitUnderNoGrad,
    StackUnderNoGrad,
    TanhOfPiecesSplitUnderNoGrad,
    NormsOfPiecesSplitUnderNoGrad,
]


def _model(cls: type[nn.Module]) -> nn.Module:
    model = cls()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # not LayerNorm's ones and zeros: gradients tell members apart
    return model


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(4, 8) for _ in range(3)]


def _outputs_and_grads(
    model: nn.Module,
    run: Callable[..., torch.Tensor],
    xs: list[torch.Tensor],
    params: Callable[[], dict[str, torch.Tensor | None]] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_() for x in xs]
    out = run(*leaves)
    assert out.requires_grad
    out.backward()
    by_name = params() if params is not None else {n: p.grad for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    return out.detach(), [x.grad for x in leaves] + [by_name[n] for n in names]


def _assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("cls", CASES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("entry", ["optimize", "compile_backend", "inductor_pass"])
def test_gradients_stay_cut_where_the_model_cuts_them(cls: type[nn.Module], entry: str) -> None:
    model = _model(cls)
    twin = copy.deepcopy(model)
    xs = _inputs()
    params = None
    if entry == "optimize":
        run: Callable[..., torch.Tensor] = fxrec.optimize(twin, tuple(_inputs()), check=False)
        params = lambda: run.fxrec_fused.grads(twin)  # type: ignore[attr-defined]  # noqa: E731
    elif entry == "compile_backend":
        torch._dynamo.reset()
        run = torch.compile(twin, backend=fxrec.compile_backend())
    else:
        run = through_inductor_pass(twin, _inputs(), params_only=True)
    got = _outputs_and_grads(twin, run, xs, params)
    _assert_same(got, _outputs_and_grads(model, model, xs))
    torch._dynamo.reset()


class EnableGradInside(nn.Module):
    """Run under an outer no_grad: ``a`` records nothing, its twin ``b`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        with torch.enable_grad():
            b = self.lin(x)
            return ((b - a) ** 2).sum() + b.sum()


@pytest.mark.parametrize("entry", ["compile_backend", "inductor_pass"])
def test_no_merging_with_a_twin_inside_enable_grad(entry: str) -> None:
    model = EnableGradInside()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    if entry == "compile_backend":
        torch._dynamo.reset()
        run: Callable[..., torch.Tensor] = torch.compile(twin, backend=fxrec.compile_backend())
    else:
        with torch.no_grad():
            run = through_inductor_pass(twin, [x], params_only=True)
    with torch.no_grad():
        got = _outputs_and_grads(twin, run, [x])
        want = _outputs_and_grads(model, model, [x])
    _assert_same(got, want)
    torch._dynamo.reset()


def test_members_in_one_stretch_still_fuse() -> None:
    """Pieces split with grad on, members on one side of a no_grad block: they fuse."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = x.split(4, 1)
            with torch.no_grad():
                t = x * 2
            return torch.cat([p.tanh() for p in parts], 1) * t

    x = torch.randn(4, 16)
    gm, inputs = dynamo_graph(M(), x)
    p = fxrec.inductor_pass()
    p(gm.graph)
    assert p.report.count("parallel_unary") == 1
    torch.testing.assert_close(gm(*inputs)[0], M()(x))
