"""fxrec.optimize as a drop-in module: state, parameters laid out once, modes, fallbacks."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxrec
from fxrec.graph.rule import HorizontalRule, RewriteContext


class StackedScale(HorizontalRule):
    """Test rule: N ``x_i * w_i`` (w_i parameters of one shape) -> one mul over stacked tensors."""

    name = "test_stacked_scale"
    family = "test"

    def key(self, node: fx.Node, ctx: RewriteContext):  # type: ignore[override]
        if node.op != "call_function" or node.target is not torch.mul or len(node.args) != 2:
            return None
        x, w = node.args
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            return None
        xi, wi = ctx.info(x), ctx.info(w)
        return None if xi is None or wi is None else (xi.shape, wi.shape)

    def fuse(self, group, ctx):  # type: ignore[override]
        xs = ctx.call(torch.stack, ([n.args[0] for n in group],))
        ws = ctx.call_method(
            "unsqueeze", (ctx.params.combined([n.args[1] for n in group], "stack"), 1)
        )
        out = ctx.call(torch.unbind, (ctx.call(torch.mul, (xs, ws)),))
        for i, n in enumerate(group):
            item = ctx.graph.call_function(operator.getitem, (out, i))
            ctx.replace(n, item)
        ctx.erase_if_dead(group)
        self.fired(ctx, group)


class Scales(nn.Module):
    def __init__(self, n: int = 3, d: int = 5) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(d)) for _ in range(n)])
        self.proj = nn.Linear(d, 1)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        # Written out so that symbolic tracing captures it (the dynamo path is tested below).
        w = self.w
        return (
            self.proj(torch.mul(x0, w[0]))
            + self.proj(torch.mul(x1, w[1]))
            + self.proj(torch.mul(x2, w[2]))
        )


class _Scales4(Scales):
    def __init__(self) -> None:
        super().__init__(n=4)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w = self.w
        y0, y1 = torch.mul(xs[0], w[0]), torch.mul(xs[1], w[1])
        y2, y3 = torch.mul(xs[2], w[2]), torch.mul(xs[3], w[3])
        return self.proj(y0) + self.proj(y1) + self.proj(y2) + self.proj(y3)


def _inputs(n: int = 3, b: int = 4, d: int = 5) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, d) for _ in range(n))


def test_parameters_laid_out_once_and_state_dict_unchanged() -> None:
    model = Scales()
    ref = copy.deepcopy(model)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    opt = fxrec.optimize(model, _inputs(), rules=[StackedScale])
    assert opt.fxrec_report.count("test_stacked_scale") == 1
    flat = [p for n, p in opt.named_parameters() if "fxrec_fused" in n]
    assert len(flat) == 1 and flat[0].shape == (3, 5)
    # Members now share storage with the flat parameter; values unchanged.
    for i, w in enumerate(model.w):
        assert w.data_ptr() == flat[0][i].data_ptr()
        torch.testing.assert_close(w, ref.w[i])
    assert {k: v.shape for k, v in opt.state_dict().items()} == keys
    # The members are not handed to the optimizer twice.
    assert not any(p is w for _, p in opt.named_parameters() for w in model.w)


def test_training_matches_the_original_model() -> None:
    model = Scales()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, _inputs(), rules=[StackedScale])
    sgd_a = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        xs = _inputs(b=7)  # another batch size than the example
        for m, o in ((opt, sgd_a), (ref, sgd_b)):
            o.zero_grad()
            m(*xs).pow(2).sum().backward()
            o.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[k], v, rtol=1e-4, atol=1e-4)


def test_load_state_dict_writes_through_to_the_fused_parameter() -> None:
    model = Scales()
    opt = fxrec.optimize(model, _inputs(), rules=[StackedScale])
    other = Scales()
    opt.load_state_dict(other.state_dict())
    xs = _inputs()
    torch.testing.assert_close(opt(*xs), other(*xs))
    # And the other way: a checkpoint of the optimized module loads into a plain model.
    plain = Scales()
    plain.load_state_dict(opt.state_dict())
    torch.testing.assert_close(plain(*xs), opt(*xs))


def test_keep_params_gathers_in_graph() -> None:
    model = Scales()
    opt = fxrec.optimize(model, _inputs(), rules=[StackedScale], keep_params=True)
    assert not [n for n, _ in opt.named_parameters() if "fxrec_fused" in n]
    xs = _inputs()
    opt(*xs).sum().backward()
    assert all(w.grad is not None for w in model.w)


def test_gradients_match() -> None:
    model = Scales()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, _inputs(), rules=[StackedScale])
    xs = [x.requires_grad_() for x in _inputs()]
    xr = [x.detach().clone().requires_grad_() for x in xs]
    opt(*xs).sum().backward()
    ref(*xr).sum().backward()
    flat = next(p for n, p in opt.named_parameters() if "fxrec_fused" in n)
    for i, w in enumerate(ref.w):
        torch.testing.assert_close(flat.grad[i], w.grad)
    for a, b in zip(xs, xr):
        torch.testing.assert_close(a.grad, b.grad)


def test_train_and_eval_are_captured_separately() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(x, 0.5, self.training) + self.drop(x)

    opt = fxrec.optimize(Drop())
    x = torch.ones(64)
    opt.eval()
    torch.testing.assert_close(opt(x), 2 * x)
    opt.train()
    assert not torch.equal(opt(x), 2 * x)


def test_failing_rule_raises_in_strict_mode_and_falls_back_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken(StackedScale):
        name = "test_broken"

        def fuse(self, group, ctx):  # type: ignore[override]
            raise RuntimeError("boom")

    class BrokenLater(StackedScale):
        """Fires, then breaks on a later set: the graph with its first rewrite is dropped."""

        name = "test_broken_later"

        def fuse(self, group, ctx):  # type: ignore[override]
            if ctx.report.count(self.name):
                raise RuntimeError("boom")
            super().fuse(group, ctx)

        def partition(self, group, ctx):  # type: ignore[override]
            return [list(pair) for pair in zip(group[::2], group[1::2])]

    with pytest.raises(RuntimeError, match="boom"):
        fxrec.optimize(Scales(), _inputs(), rules=[Broken])
    monkeypatch.setenv("FXREC_STRICT", "0")
    model = Scales()
    opt = fxrec.optimize(model, _inputs(), rules=[Broken])
    assert any("boom" in n for n in opt.fxrec_report.notes)
    xs = _inputs()
    torch.testing.assert_close(opt(*xs), model(*xs))
    model = _Scales4()
    opt = fxrec.optimize(model, _inputs(n=4), rules=[BrokenLater])
    report = opt.fxrec_report
    assert any("boom" in n and "(1 rewrites undone)" in n for n in report.notes)
    assert report.count() == 0
    xs = _inputs(n=4)
    torch.testing.assert_close(opt(*xs), model(*xs))


def test_wrong_rewrite_is_caught_by_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrong(StackedScale):
        name = "test_wrong"

        def fuse(self, group, ctx):  # type: ignore[override]
            for n in group:
                ctx.replace(n, n.args[0])  # drops the multiplication
            ctx.erase_if_dead(group)
            self.fired(ctx, group)

    monkeypatch.setenv("FXREC_STRICT", "0")
    model = Scales()
    opt = fxrec.optimize(model, _inputs(), rules=[Wrong])
    report = opt.fxrec_report
    assert any("check failed" in n and "(1 rewrites undone)" in n for n in report.notes)
    # The report lists no rewrite the model does not run.
    assert report.count() == 0 and report.nodes_after == report.nodes_before
    xs = _inputs()
    torch.testing.assert_close(opt(*xs), model(*xs))


def test_a_rewrite_raising_on_the_example_is_caught_by_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rewritten graph that raises on the example inputs (a lowering those inputs break)
    is a failed check: the captured graph runs, as for wrong outputs."""

    class Raising(StackedScale):
        name = "test_raising"

        def fuse(self, group, ctx):  # type: ignore[override]
            for n in group:  # a matmul of mismatched shapes, which raises when run
                with ctx.graph.inserting_before(n):
                    bad = ctx.graph.call_function(torch.mm, (n.args[0], n.args[0]))
                ctx.replace(n, bad)
            ctx.erase_if_dead(group)

    monkeypatch.setenv("FXREC_STRICT", "0")
    model = Scales()
    opt = fxrec.optimize(model, _inputs(), rules=[Raising])
    assert any("check failed" in n and "it raised" in n for n in opt.fxrec_report.notes)
    xs = _inputs()
    torch.testing.assert_close(opt(*xs), model(*xs))


class _Branchy(Scales):
    """Scales that symbolic tracing cannot follow (a branch on the input): dynamo captures it."""

    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if x0.dim() > 1:
            x0 = x0 * 1.0
        return super().forward(x0, x1, x2)


@pytest.mark.parametrize("capture", ["symbolic_trace", "dynamo"])
def test_graphs_built_for_later_signatures_are_checked_too(
    monkeypatch: pytest.MonkeyPatch, capture: str
) -> None:
    class WrongAtFive(StackedScale):
        name = "test_wrong_at_five"

        def fuse(self, group, ctx):  # type: ignore[override]
            if ctx.info(group[0].args[0]).shape[0] != 5:
                return super().fuse(group, ctx)
            for n in group:
                ctx.replace(n, n.args[0])  # drops the multiplication
            ctx.erase_if_dead(group)

    monkeypatch.setenv("FXREC_STRICT", "0")
    model = Scales() if capture == "symbolic_trace" else _Branchy()
    opt = fxrec.optimize(model, _inputs(b=4), rules=[WrongAtFive])
    assert opt.fxrec_report.capture == capture
    assert not any("check failed" in n for n in opt.fxrec_report.notes)
    fired = opt.fxrec_report.count("test_wrong_at_five")
    assert fired >= 1
    for b in (5, 5, 4):
        xs = _inputs(b=b)
        torch.testing.assert_close(opt(*xs), model(*xs))
    assert any("check failed" in n for n in opt.fxrec_report.notes)
    # The graphs of batch 5 were dropped: the report lists only batch 4's rewrites.
    assert opt.fxrec_report.count("test_wrong_at_five") == fired
    torch._dynamo.reset()


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.calls += 1  # assigns the attribute, which a symbolic trace cannot record
        return self.lin(x) * self.inner.calls


def test_a_forward_that_writes_a_buffer_goes_to_dynamo() -> None:
    model = _Counting()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(2, 4),))
    assert int(model.inner.calls) == 0  # the trace's write was undone
    assert opt.fxrec_report.capture == "dynamo"
    assert any("assigns buffer 'inner.calls'" in n for n in opt.fxrec_report.notes)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(opt(x), ref(x))
    assert int(model.inner.calls) == int(ref.inner.calls) == 3
    torch._dynamo.reset()


def test_unknown_rule_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        fxrec.optimize(Scales(), rules=["nope"])


def test_optimizing_a_model_twice_is_reported() -> None:
    from tests.graph.test_dense_outputs import Towers

    model = Towers([4, 4, 4])
    first = fxrec.optimize(model, (torch.randn(8, 16),))
    assert first.fxrec_fused.member_ids()
    assert not any("laid out already" in n for n in first.fxrec_report.notes)
    second = fxrec.optimize(model, (torch.randn(8, 16),))
    assert any("laid out already" in n for n in second.fxrec_report.notes)
    x = torch.randn(8, 16)
    for opt in (first, second):  # both still compute what the model computes
        for k, v in model(x).items():
            torch.testing.assert_close(opt(x)[k], v)


def test_bad_model_or_example_inputs_are_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"takes an nn\.Module, got function"):
        fxrec.optimize(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"forward\(x0, x1, x2\) takes 3 arguments; pass them"):
        fxrec.optimize(Scales(), list(_inputs()))  # type: ignore[arg-type]

    class DenseSparse(nn.Module):
        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return dense + sparse

    from fxrec.train import Batch

    batch = Batch(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2))
    with pytest.raises(TypeError, match=r"a train Batch: \(batch\.dense, batch\.sparse\)"):
        fxrec.optimize(DenseSparse(), batch)  # type: ignore[arg-type]

    class OneList(nn.Module):
        def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(xs).tanh()

    xs = [torch.randn(3), torch.randn(3)]
    opt = fxrec.optimize(OneList(), xs)  # type: ignore[arg-type]  # the one argument
    torch.testing.assert_close(opt(xs), OneList()(xs))


def test_untraceable_model_goes_through_dynamo() -> None:
    class Loop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() > 1:  # data-independent, but symbolic tracing cannot take it
                x = x * 1.0
            return torch.cat([p.tanh() for p in torch.split(x, 2, 1)], 1)

    model = Loop()
    x = torch.randn(3, 8)
    opt = fxrec.optimize(model, (x,))
    assert opt.fxrec_report.capture == "dynamo"
    assert opt.fxrec_report.count("parallel_unary") == 1
    torch.testing.assert_close(opt(x), model(x))
    torch._dynamo.reset()


def test_report_prints() -> None:
    opt = fxrec.optimize(Scales(), _inputs(), rules=[StackedScale])
    text = str(opt.fxrec_report)
    assert "test_stacked_scale" in text and "nodes" in text
    assert repr(opt.fxrec_report) == text  # a REPL shows the summary, not every node name


class _DynamoOnly(nn.Module):
    """Iterates over a split: symbolic tracing fails, dynamo captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([n(p) for p, n in zip(torch.split(x, 4, 1), self.norms)], 1)


def test_many_instances_and_signatures_never_fall_back_to_eager_silently() -> None:
    """Dynamo caches per code object and runs a frame eagerly past 8 entries; run eagerly,
    laid-out parameters would lose their gradients. Each capture has a cache of its own."""
    for i in range(12):  # instances of one class, each on two batch sizes
        torch.manual_seed(i)
        model = _DynamoOnly()
        ref = copy.deepcopy(model)
        opt = fxrec.optimize(model, (torch.randn(2, 12),))
        assert opt.fxrec_report.capture == "dynamo"
        assert opt.fxrec_report.count("parallel_layer_norm") == 1
        sgd = torch.optim.SGD(opt.parameters(), lr=0.5)
        sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
        for batch in (2, 5, 2):
            x = torch.randn(batch, 12)
            for m, o in ((opt, sgd), (ref, sgd_ref)):
                o.zero_grad()
                (m(x) * torch.arange(12.0)).sum().backward()
                o.step()
            for (k, v), (k2, v2) in zip(opt.state_dict().items(), ref.state_dict().items()):
                assert k == k2
                torch.testing.assert_close(v, v2, msg=f"instance {i}, {k}")


def test_forward_hooks_of_a_dynamo_captured_model_still_run() -> None:
    model = _DynamoOnly()
    calls: list[int] = []
    model.register_forward_hook(lambda m, args, out: calls.append(1))
    opt = fxrec.optimize(model, (torch.randn(2, 12),))
    calls.clear()
    x = torch.randn(3, 12)
    got = opt(x)
    assert calls == [1]  # the hook ran once, inside the optimized call
    calls.clear()
    torch.testing.assert_close(got, model(x))


def test_report_counts_kernels_without_side_effects() -> None:
    model = _DynamoOnly()
    x = torch.randn(2, 12, requires_grad=True)
    opt = fxrec.optimize(model, (x,))
    rep = opt.fxrec_report
    # forward: 3 layer_norms + the cat; backward: the loss's ones_like, 3 layer_norm
    # backwards, the split's cat
    assert rep.kernels_before == (4, 5)
    assert rep.kernels_after is not None and rep.kernels_after[0] < rep.kernels_before[0]
    assert "kernels forward 4 -> " in str(rep)
    assert x.grad is None and all(p.grad is None for p in opt.parameters())
    assert all(p.grad is None for p in model.parameters())


class OffsetsByOut(nn.Module):
    """``cumsum(..., out=view)``: the op's result is unused; only its write matters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, lengths: torch.Tensor) -> torch.Tensor:
        offsets = lengths.new_zeros(lengths.shape[0] + 1)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return offsets * self.scale


@pytest.mark.parametrize("how", ["optimize", "compile_backend"])
def test_writes_through_out_are_kept(how: str) -> None:
    # Dead-code elimination must not drop an op whose work is its out= write (a sharded
    # collection builds its offsets this way).
    model = OffsetsByOut()
    lengths = torch.randint(0, 5, (6,)).float()
    if how == "optimize":
        run = fxrec.optimize(model, (lengths,), check=False)  # no fallback to hide a drop
    else:
        run = torch.compile(model, backend=fxrec.compile_backend("aot_eager"))
    for _ in range(2):
        lengths = torch.randint(0, 5, (6,)).float()
        want = model(lengths)
        got = run(lengths)
        torch.testing.assert_close(got, want)
        assert got[-1] == lengths.sum()


class _NormTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = torch.split(x, 8, 1)
        return torch.cat(
            [torch.tanh(lin(n(p))) for n, lin, p in zip(self.norms, self.lins, (a, b, c, d))], 1
        )


def test_a_bfloat16_model_passes_the_check_within_a_few_ulps() -> None:
    """A fused bf16 chain rounds in another order, a few bf16 ulps (0.0078 near 1.0) off."""
    torch.manual_seed(0)
    model = _NormTowers().bfloat16()
    for p in model.parameters():
        p.data.normal_()
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    opt = fxrec.optimize(model, (x,))
    assert not [n for n in opt.fxrec_report.notes if "check failed" in n]
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    y = torch.randn(16, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(opt(y).float(), ref(y).float(), rtol=4e-2, atol=4e-2)
