"""norms family: parallel LayerNorm and BatchNorm fusion, every spelling, refusals, state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxrec
from fxrec.graph import meta
from fxrec.graph.optimize_graph import optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters
from fxrec.passes.norms import choose_lowering


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _randomise(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _grads(opt: fxrec.OptimizedModule, model: nn.Module) -> dict[str, torch.Tensor | None]:
    where = opt.fxrec_fused.locate()
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        if id(p) not in where:
            out[name] = p.grad
            continue
        flat_name, how, m = where[id(p)]
        g = getattr(opt.fxrec_fused, flat_name).grad
        out[name] = (
            None
            if g is None
            else g[m.index]
            if how == "stack"
            else g.narrow(0, m.offset, p.shape[0])
        )
    return out


def check(
    model: nn.Module, *shapes: tuple[int, ...], rule: str, fired: int, **kw
) -> fxrec.OptimizedModule:  # type: ignore[no-untyped-def]
    """Optimize; the rule fired ``fired`` times; outputs, gradients and buffers match the model."""
    model = _randomise(model)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, tuple(torch.randn(s) for s in shapes), **kw)
    assert opt.fxrec_report.count(rule) == fired, str(opt.fxrec_report)
    opt.report = copy.deepcopy(opt.fxrec_report)  # this capture only (new batch sizes add more)
    for extra in (0, 3):  # the example's batch size and another one
        xs = [torch.randn((s[0] + extra, *s[1:])) for s in shapes]
        a = [x.clone().requires_grad_() for x in xs]
        b = [x.clone().requires_grad_() for x in xs]
        out, want = opt(*a), ref(*b)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        if model.training or any(p.requires_grad for p in model.parameters()):
            for p in opt.parameters():
                p.grad = None
            ref.zero_grad(set_to_none=True)
            g = torch.randn_like(want)
            out.backward(g)
            want.backward(g)
            for x, y in zip(a, b):
                torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)
            got = _grads(opt, model)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and v.shape == v2.shape
        torch.testing.assert_close(v, v2, atol=1e-6, rtol=1e-5, msg=k)
    return opt


# -- LayerNorm -----------------------------------------------------------------------------
class LNModules(nn.Module):
    def __init__(self, n: int = 4, d: int = 5, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.n, self.d = n, d
        self.norms = nn.ModuleList(nn.LayerNorm(d, **kw) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.split(x, self.d, -1)
        return sum(self.norms[i](p[i]) * (i + 1) for i in range(self.n))


class LNFunctional(nn.Module):
    """``F.layer_norm`` / ``torch.layer_norm`` with parameters read as attributes."""

    def __init__(self, n: int = 4, d: int = 5, fn=F.layer_norm, affine: bool = True) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.n, self.d, self.fn = n, d, fn
        self.w = nn.Parameter(torch.randn(n, d)) if affine else None
        self.b = nn.Parameter(torch.randn(n, d)) if affine else None
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(d)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x.chunk(self.n, 1)
        outs = []
        for i in range(self.n):
            w = self.ws[i] if self.w is not None else None
            outs.append(self.fn(p[i], (self.d,), w, None, 1e-5))
        return torch.cat(outs, 1)


def test_layer_norm_modules_over_pieces() -> None:
    opt = check(LNModules(), (3, 20), rule="parallel_layer_norm", fired=1)
    x = torch.randn(3, 20)
    ops = fxrec.count_kernels(opt, x).forward_ops
    assert ops["aten::native_layer_norm"] == 1 and ops["aten::addcmul"] == 1


def test_layer_norm_3d_input_and_no_affine_and_no_bias() -> None:
    check(LNModules(), (2, 3, 20), rule="parallel_layer_norm", fired=1)
    opt = check(LNModules(elementwise_affine=False), (2, 20), rule="parallel_layer_norm", fired=1)
    assert fxrec.count_kernels(opt, torch.randn(2, 20)).forward_ops.get("aten::addcmul") is None
    check(LNModules(bias=False), (2, 20), rule="parallel_layer_norm", fired=1)


@pytest.mark.parametrize("fn", [F.layer_norm, torch.layer_norm])
def test_layer_norm_functional_spellings(fn) -> None:  # type: ignore[no-untyped-def]
    check(LNFunctional(fn=fn), (3, 20), rule="parallel_layer_norm", fired=1)
    check(LNFunctional(fn=fn, affine=False), (3, 20), rule="parallel_layer_norm", fired=1)


@pytest.mark.parametrize("plugin", [False, True], ids=["optimize", "compile_backend"])
def test_layer_norm_of_bfloat16_input_with_float32_weights(plugin: bool) -> None:
    # F.layer_norm computes mixed dtypes in the weights' dtype and returns the input's
    model = _randomise(LNModules())
    x = torch.randn(6, 20, dtype=torch.bfloat16)
    if plugin:
        run = torch.compile(model, backend=fxrec.compile_backend(inner="eager"))
    else:
        run = fxrec.optimize(model, (x,))
        assert run.fxrec_report.count("parallel_layer_norm") == 1
        assert not any("check failed" in n for n in run.fxrec_report.notes)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = run(xo), model(xr)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)
    out.float().sum().backward()
    want.float().sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad)


def test_layer_norm_dynamo_path_and_public_backend() -> None:
    class Loop(LNModules):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([n(p) for p, n in zip(torch.split(x, self.d, 1), self.norms)], 1)

    opt = check(Loop(), (3, 20), rule="parallel_layer_norm", fired=1)
    assert opt.fxrec_report.capture == "dynamo"
    # The public backend passes parameters as graph inputs: stacked in-graph, still exact.
    model = _randomise(Loop())
    compiled = torch.compile(model, backend=fxrec.compile_backend(inner="eager"))
    x = torch.randn(4, 20)
    torch.testing.assert_close(compiled(x), model(x))


def test_layer_norm_separate_inputs_needs_enough_members() -> None:
    class Sep(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(n))

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return sum(n(x) for n, x in zip(self.norms, xs))

    class Sep2(Sep):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return self.norms[0](a) + self.norms[1](b)

    class Sep4(Sep):
        def forward(self, a, b, c, d):  # type: ignore[no-untyped-def,override]
            return self.norms[0](a) + self.norms[1](b) * 2 + self.norms[2](c) + self.norms[3](d)

    opt = check(Sep2(2), (3, 4), (3, 4), rule="parallel_layer_norm", fired=0)
    assert "separate tensors" in " ".join(r.reason for r in opt.fxrec_report.refusals)
    check(Sep4(4), *[(3, 4)] * 4, rule="parallel_layer_norm", fired=1)


def test_layer_norm_unbind_pieces() -> None:
    class Unbind(LNModules):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = x.unbind(1)
            return torch.stack([self.norms[i](p[i]) for i in range(self.n)], 1)

    opt = check(Unbind(), (3, 4, 5), rule="parallel_layer_norm", fired=1)
    # the stack of the fused result's unbind pieces cancels (either glue rule may take it)
    assert opt.report.count("cat_of_split") + opt.report.count("stack_of_pieces") == 1


def test_layer_norm_negative_cases() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.LayerNorm(5), nn.LayerNorm(5, eps=1e-3)  # eps differs
            self.c, self.d = nn.LayerNorm(5), nn.LayerNorm(5).double()  # dtype differs
            self.e, self.f = nn.LayerNorm(5), nn.LayerNorm(5)  # f depends on e

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 5, 1)
            y = self.a(p[0]) + self.b(p[1])
            y = y + self.c(p[2]) + self.d(p[3].double()).float()
            return y + self.f(self.e(p[4]))

    check(Mixed(), (3, 25), rule="parallel_layer_norm", fired=0)


def test_layer_norm_shared_module_and_shared_weight() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 5, 1)
            return torch.cat([self.norm(p[0]), self.norm(p[1]), self.norm(p[2])], 1)

    opt = check(Shared(), (3, 15), rule="parallel_layer_norm", fired=1)
    assert not list(opt.fxrec_fused.parameters())  # one shared weight broadcasts; nothing laid out


def test_group_norm_lowering_chosen_by_cost_model() -> None:
    assert choose_lowering("cpu", 2048 * 1024, 64) == "layer_norm"
    assert choose_lowering("cuda", 32 * 1024, 64) == "group_norm"
    assert choose_lowering("cuda", 1 << 30, 64) == "layer_norm"
    # Run the group_norm form on CPU by telling the rules the graph is for a GPU.
    model = _randomise(LNModules(4, 6))
    gm = fx.symbolic_trace(model)
    x = torch.randn(3, 24)
    meta.annotate(gm, x)
    owner = FusedParameters()
    optimize_graph(gm, resolve_rules(["parallel_layer_norm"]), owner=owner, device_type="cuda")
    assert any(n.target is F.group_norm for n in gm.graph.nodes)
    gm.add_submodule("fxrec_fused", owner)
    x2 = torch.randn(7, 24)
    torch.testing.assert_close(gm(x2), model(x2), atol=1e-5, rtol=1e-5)


def test_layer_norm_keep_params() -> None:
    opt = check(LNModules(), (3, 20), rule="parallel_layer_norm", fired=1, keep_params=True)
    assert not list(opt.fxrec_fused.parameters())


# -- BatchNorm -----------------------------------------------------------------------------
class BNs(nn.Module):
    def __init__(self, n: int = 3, d: int = 4, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.n, self.d = n, d
        self.bns = nn.ModuleList(nn.BatchNorm1d(d, **kw) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.split(x, self.d, 1)
        return torch.cat([self.bns[i](p[i]) for i in range(self.n)], 1)


class BNLoop(BNs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([bn(p) for p, bn in zip(x.chunk(self.n, 1), self.bns)], 1)


@pytest.mark.parametrize("cls", [BNs, BNLoop])
def test_batch_norm_train_statistics_exact(cls) -> None:  # type: ignore[no-untyped-def]
    model = cls()
    opt = check(model, (6, 12), rule="parallel_batch_norm", fired=1)
    for bn in model.bns:
        assert int(bn.num_batches_tracked) == 2  # two training steps in check()
    sd = {k: v.shape for k, v in model.state_dict().items()}
    assert sd == {k: v.shape for k, v in cls().state_dict().items()}
    x = torch.randn(5, 12)
    opt(x)  # capture for this batch size first: capturing runs the graph
    assert fxrec.count_kernels(opt, x).forward_ops["aten::native_batch_norm"] == 1


def test_batch_norm_eval_and_3d_and_no_tracking() -> None:
    check(BNs().eval(), (4, 12), rule="parallel_batch_norm", fired=1)
    check(BNs(), (4, 12, 3), rule="parallel_batch_norm", fired=1)
    check(BNs(track_running_stats=False), (4, 12), rule="parallel_batch_norm", fired=1)
    check(BNs(affine=False), (4, 12), rule="parallel_batch_norm", fired=1)


def test_batch_norm_load_state_dict_round_trip() -> None:
    model = BNs()
    opt = fxrec.optimize(model, (torch.randn(4, 12),))
    opt(torch.randn(4, 12))
    other = _randomise(BNs())
    other(torch.randn(4, 12))
    opt.load_state_dict(other.state_dict())
    opt.eval()
    other.eval()
    x = torch.randn(3, 12)
    torch.testing.assert_close(opt(x), other(x))
    fresh = BNs()
    fresh.load_state_dict(opt.state_dict())
    fresh.eval()
    torch.testing.assert_close(fresh(x), other(x))


@pytest.mark.parametrize(
    "second",
    [{"momentum": 0.3}, {"track_running_stats": False}, {"eps": 1e-3}, {"affine": False}],
)
def test_batch_norm_refused_when_settings_differ(second: dict) -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(4), nn.BatchNorm1d(4, **second)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 4, 1)
            return self.a(p[0]) * self.b(p[1])

    check(Pair(), (5, 8), rule="parallel_batch_norm", fired=0)


def test_batch_norm_cumulative_momentum_not_fused() -> None:
    check(BNs(momentum=None), (5, 12), rule="parallel_batch_norm", fired=0)


def test_batch_norm_shared_module_refused() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = torch.split(x, 4, 1)
            return self.bn(p[0]) + self.bn(p[1])

    opt = check(Shared(), (5, 8), rule="parallel_batch_norm", fired=0)
    assert any("share" in r.reason for r in opt.fxrec_report.refusals)


def test_batch_norm_keep_params_refused_in_training() -> None:
    opt = check(BNs(), (5, 12), rule="parallel_batch_norm", fired=0, keep_params=True)
    assert any("laid out" in r.reason for r in opt.fxrec_report.refusals)


def test_batch_norm_separate_inputs() -> None:
    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(3, 4 + i) for i in range(3))
            self.bns = nn.ModuleList(nn.BatchNorm1d(4 + i) for i in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.bns[i](self.lins[i](x)) for i in range(3)], 1)

    check(Towers(), (6, 3), rule="parallel_batch_norm", fired=1, rules=["parallel_batch_norm"])
