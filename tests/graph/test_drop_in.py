"""fxrec.optimize used as users use a module: training at other shapes, reused and tied modules,
submodules in their own mode, frozen parameters, copies, optional and keyword arguments.

Every test trains or differentiates the optimized module next to an untouched copy of the
model and compares outputs, gradients (by the original parameter names) and parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxrec

D = 8
TOL = 1e-4  # fused and separate LayerNorms sum in different orders; gradients add 5000 rows


class Norms(nn.Module):
    """The seed pattern: slices -> LayerNorm -> tanh -> cat (fused at small batches)."""

    def __init__(self, n: int = 4, untraceable: bool = False) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(n))
        self.untraceable = untraceable
        with torch.no_grad():
            for m in self.norms:
                m.weight.normal_()
                m.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.untraceable and x.dim() > 1:  # a branch on a shape: dynamo captures it
            x = x + 0
        n = len(self.norms)
        return torch.cat([torch.tanh(self.norms[i](x[:, D * i : D * i + D])) for i in range(n)], 1)


class Reused(Norms):
    """One fused LayerNorm is called again on another input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.tanh(norm(x[:, D * i : D * i + D])) for i, norm in enumerate(self.norms)]
        return torch.cat([*outs, self.norms[1](outs[0] + outs[3])], 1)


class TiedHead(nn.Module):
    """Parallel Linears, the first one's weight shared with a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, D)
        self.head.weight = self.lins[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.relu(lin(x[:, D * i : D * i + D])) for i, lin in enumerate(self.lins)]
        return torch.cat([*outs, self.head(outs[1])], 1)


def _grads(opt: fxrec.OptimizedModule, model: nn.Module) -> dict[str, torch.Tensor | None]:
    return opt.fxrec_fused.grads(model)


def _step(module: nn.Module, params: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> None:
    sgd = torch.optim.SGD(params, lr=0.1)
    sgd.zero_grad()
    (module(x) * w).sum().backward()
    sgd.step()


def _same_training(
    model: nn.Module, ref: nn.Module, opt: fxrec.OptimizedModule, batches: list[int], width: int
) -> None:
    """Per batch: same output, same gradient per original parameter, same parameters after an
    SGD step over ``opt.parameters()``."""
    trainable = list(opt.parameters())
    for b in batches:
        x = torch.randn(b, width)
        w = torch.randn_like(ref(x))
        for p in [*ref.parameters(), *trainable]:
            p.grad = None
        out, expected = opt(x), ref(x)
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        got = _grads(opt, model)
        for name, p in ref.named_parameters():
            assert got[name] is not None, name
            torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)
        _step(opt, trainable, x, w)
        _step(ref, list(ref.parameters()), x, w)
        for (name, a), b_ in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b_, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_training_at_a_size_where_fusion_is_refused(untraceable: bool) -> None:
    """Optimized at batch 8 (fused, laid out), then trained at 5000, where the CPU cost model
    leaves the LayerNorms as written: their gradients must still reach the flat parameters."""
    model = Norms(untraceable=untraceable)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    assert next(n for n, _ in opt.named_parameters()).startswith("fxrec_fused.")
    _same_training(model, ref, opt, [5000, 8, 5000], 4 * D)


@pytest.mark.parametrize("cls", [Reused, TiedHead])
def test_fused_module_used_again_elsewhere(cls: type[nn.Module]) -> None:
    model = cls()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(6, 4 * D),))
    assert any(n.startswith("fxrec_fused.") for n, _ in opt.named_parameters())
    _same_training(model, ref, opt, [6, 6], 4 * D)


def test_layouts_are_made_once() -> None:
    """Graphs built after the first never lay parameters out again: ``parameters()`` stays
    what the optimizer was built on, in whatever order shapes arrive."""
    model = Norms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, keep_params=False)  # laid out at the first call
    opt(torch.randn(5000, 4 * D))  # not fused at this size: nothing laid out
    before = [id(p) for p in opt.parameters()]
    _same_training(model, ref, opt, [8, 5000, 8], 4 * D)
    assert [id(p) for p in opt.parameters()] == before


def test_lazy_optimize_keeps_the_parameters_an_optimizer_holds() -> None:
    """Without example inputs the optimizer usually exists before the first call: the
    parameters stay the model's own (``keep_params`` defaults to True there)."""
    model = Norms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model)
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]
    _same_training(model, ref, opt, [8, 8], 4 * D)
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]


class BatchNormTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bns = nn.ModuleList(nn.BatchNorm1d(D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([bn(x[:, D * i : D * i + D]) for i, bn in enumerate(self.bns)], 1)


@pytest.mark.parametrize("guards", [False, True])
def test_submodules_put_in_eval_mode_alone(guards: bool) -> None:
    """Freezing BatchNorm statistics (``bn.eval()`` inside a training model) is honoured."""
    model = BatchNormTowers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 3 * D),), guards=guards)
    for m in (model, ref):
        m.train()
        m.bns[1].eval()
    for _ in range(2):
        x = torch.randn(16, 3 * D)
        torch.testing.assert_close(opt(x), ref(x))
    for a, b in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)
    assert int(model.bns[1].num_batches_tracked) == 0


class LinearBatchNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(2 * D, D) for _ in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm1d(D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([bn(lin(x)) for lin, bn in zip(self.lin, self.bns)], 1)


def test_an_ema_of_parameters_and_buffers_moves_each_value_once() -> None:
    """``AveragedModel(opt, use_buffers=True)`` (the EMA recipe) averages what
    ``parameters()`` and ``buffers()`` list: fused running statistics must appear once."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = LinearBatchNorms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(32, 2 * D),))
    assert len(list(opt.fxrec_fused.buffers())) > 0  # the running statistics are laid out
    assert len(list(opt.buffers())) < len(list(ref.buffers()))
    emas = []
    for m in (ref, opt):
        ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        torch.manual_seed(1)
        for _ in range(3):
            m(torch.randn(32, 2 * D))  # a training forward moves the running statistics
            ema.update_parameters(m)
        emas.append(ema.module.state_dict())
    want, got = emas
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_freezing_laid_out_parameters_after_optimize() -> None:
    model = Norms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    for m in (model, ref):
        for norm in m.norms:
            norm.weight.requires_grad_(False)
    x = torch.randn(8, 4 * D)
    before = [n.weight.detach().clone() for n in model.norms]
    _step(opt, [p for p in opt.parameters() if p.requires_grad], x, torch.randn(8, 4 * D))
    _step(ref, [p for p in ref.parameters() if p.requires_grad], x, torch.randn(8, 4 * D))
    assert all(torch.equal(b, n.weight) for b, n in zip(before, model.norms))
    assert _grads(opt, model)["norms.0.weight"] is None
    # Freezing only some of the parameters laid out together cannot be expressed: refused.
    model.norms[0].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad=False and others True"):
        opt(x)


class NormsHead(Norms):
    def __init__(self, untraceable: bool) -> None:
        super().__init__(untraceable=untraceable)
        self.head = nn.Linear(4 * D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_parameters_replaced_after_optimize(untraceable: bool) -> None:
    model = NormsHead(untraceable)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    x = torch.randn(8, 4 * D)
    opt(x)
    w = torch.randn(2, 4 * D)
    for m in (model, ref):  # not laid out: graphs are rebuilt on the new parameter
        m.head.weight = nn.Parameter(w.clone())
    out, want = opt(x), ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model.head.weight.grad, ref.head.weight.grad)
    model.norms[0].weight = nn.Parameter(torch.ones(D))  # laid out: cannot follow
    with pytest.raises(
        RuntimeError, match=r"'norms\.0\.weight' was replaced after fxrec\.optimize"
    ):
        opt(x)


def test_pruning_a_laid_out_parameter_after_optimize_says_to_prune_first() -> None:
    model = Norms()
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    from torch.nn.utils import prune

    prune.l1_unstructured(model.norms[1], "weight", amount=0.5)
    with pytest.raises(RuntimeError, match=r"'norms\.1\.weight' was reparametrized .* first"):
        opt(torch.randn(8, 4 * D))


class ScaledNorms(Norms):
    """Reads a Python attribute that changes every call: dynamo (with its guards) recompiles."""

    def __init__(self) -> None:
        super().__init__(untraceable=True)
        self.scale = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_past_dynamos_recompile_limit_gradients_still_reach_the_flat_parameters() -> None:
    model = ScaledNorms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),), guards=True)
    sgd_o = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(12):  # dynamo's limit is 8 compiles per code object
        model.scale = ref.scale = step + 2
        x, w = torch.randn(8, 4 * D), torch.randn(8, 4 * D)
        for m, sgd in ((opt, sgd_o), (ref, sgd_r)):
            sgd.zero_grad()
            (m(x) * w).sum().backward()
            sgd.step()
        for a, b_ in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b_, rtol=TOL, atol=TOL)
    assert any("recompile limit" in n for n in opt.fxrec_report.notes)
    torch._dynamo.reset()


def test_new_data_given_to_a_laid_out_member_goes_into_the_flat_parameter() -> None:
    model = Norms()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    x = torch.randn(8, 4 * D)
    for m in (model, ref):
        m.norms[0].weight.data = torch.full((D,), 2.0)
    torch.testing.assert_close(opt(x), ref(x))
    _step(opt, list(opt.parameters()), x, torch.ones(8, 4 * D))
    _step(ref, list(ref.parameters()), x, torch.ones(8, 4 * D))
    torch.testing.assert_close(model.norms[0].weight, ref.norms[0].weight)  # still trained
    model.double()  # the model converted, not the optimized module: its flat tensors are not
    with pytest.raises(RuntimeError, match=r"Convert the optimized module \(opt.to"):
        opt(x.double())
    opt.double()
    torch.testing.assert_close(opt(x.double()), ref.double()(x.double()), rtol=TOL, atol=TOL)


def test_conversions_that_replace_parameter_objects_are_refused() -> None:
    model = Norms()
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    x = torch.randn(8, 4 * D)
    want = opt(x)
    with pytest.raises(ValueError, match="replaces parameter objects"):
        opt.to("meta")
    torch.testing.assert_close(opt(x), want)  # nothing changed
    assert all(p.device.type == "cpu" for p in opt.parameters())
    opt.double()  # a conversion of the data: allowed
    torch.testing.assert_close(opt(x.double()), model(x.double()))


def test_checkpoints_of_a_module_holding_an_optimized_one() -> None:
    """Saved and loaded as another module's child: the original model's keys, both ways."""

    class Wrapper(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net, self.head = net, nn.Linear(4 * D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.net(x))

    wrapped = Wrapper(fxrec.optimize(Norms(), (torch.randn(8, 4 * D),)))
    plain = Wrapper(Norms())
    for norm in plain.net.norms:  # other values than the optimized copy's
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(8, 4 * D)
    torch.testing.assert_close(wrapped(x), plain(x))
    plain.load_state_dict(wrapped.state_dict())
    partial = {k: v for k, v in plain.state_dict().items() if k != "net.norms.1.bias"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"net.norms.1.bias"):
        wrapped.load_state_dict(partial)
    with pytest.raises(ValueError, match="assign=True"):
        wrapped.load_state_dict(plain.state_dict(), assign=True)


def test_nested_checkpoint_of_a_model_with_a_child_named_model() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.model = nn.Module()
            self.model.norm = nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model.norm(self.norm(x))

    class Outer(nn.Module):
        def __init__(self, body: nn.Module) -> None:
            super().__init__()
            self.body = body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    source = Outer(Inner())
    for p in source.parameters():
        nn.init.normal_(p)
    wrapped = Outer(fxrec.optimize(Inner(), (torch.randn(2, 4),)))
    result = wrapped.load_state_dict(
        {**source.state_dict(), "body.stale": torch.zeros(1)}, strict=False
    )
    assert result.unexpected_keys == ["body.stale"] and not result.missing_keys
    x = torch.randn(2, 4)
    torch.testing.assert_close(wrapped(x), source(x))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_freezing_and_unfreezing_the_whole_optimized_module(untraceable: bool) -> None:
    # requires_grad_ on the optimized module reaches the flat parameters, not the members:
    # the next call must not undo it from the members' flags (nor the reverse).
    model = Norms(untraceable=untraceable)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    x = torch.randn(8, 4 * D)
    opt.requires_grad_(False)
    assert not opt(x).requires_grad
    assert not any(p.requires_grad for p in [*opt.parameters(), *model.parameters()])
    for norm in model.norms:  # frozen through the model: the flat parameters follow
        norm.requires_grad_(True)
    assert opt(x).requires_grad
    model.norms.requires_grad_(False)
    opt(x)
    opt.requires_grad_(True)  # the whole module again: the members follow
    out = opt(x)
    assert all(p.requires_grad for p in model.parameters())
    out.sum().backward()
    assert all(g is not None for g in _grads(opt, model).values())
    model.requires_grad_(False)  # two changes without a call between: the last one wins
    opt.requires_grad_(True)
    assert opt(x).requires_grad and all(p.requires_grad for p in opt.parameters())
    opt.requires_grad_(False)
    frozen = copy.deepcopy(opt)  # a copy keeps the freeze
    assert not frozen(x).requires_grad


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_deepcopy_trains_independently(untraceable: bool) -> None:
    model = Norms(untraceable=untraceable)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    twin = copy.deepcopy(opt)
    ref = copy.deepcopy(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    _same_training(twin.model, ref, twin, [8, 8], 4 * D)
    assert all(torch.equal(original[k], v) for k, v in model.state_dict().items())
    assert {id(p) for p in twin.parameters()}.isdisjoint(id(p) for p in opt.parameters())


class Optional(Norms):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(x)
        if y is not None:
            out = out + y
        return out


class TypeBranch(Norms):
    """Optional per-row weights told apart by type: a proxy is not a Tensor, so a symbolic
    trace keeps the unweighted branch whatever the input."""

    def forward(self, x: torch.Tensor, w: object) -> torch.Tensor:
        out = super().forward(x)
        if isinstance(w, torch.Tensor):
            out = out * w[:, None]
        return out


def test_a_branch_the_trace_takes_otherwise_is_captured_by_dynamo() -> None:
    model = TypeBranch()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D), torch.rand(8) + 1.0))
    report = opt.fxrec_report
    assert report.capture == "dynamo" and report.count() > 0
    assert any("outputs differ from the model's" in n for n in report.notes)
    for w in (torch.rand(6) + 1.0, None):
        x = torch.randn(6, 4 * D)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = opt(xa, w), ref(xb, w)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=TOL, atol=TOL)


class KeywordOnly(Norms):
    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x) * scale


class VarKeyword(Norms):
    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + extra.get("bias", 0.0)


class AfterDefault(Norms):
    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, *, z: torch.Tensor
    ) -> torch.Tensor:
        out = super().forward(x) * z
        return out if y is None else out + y


@pytest.mark.parametrize(
    ("cls", "example", "calls"),
    [
        (Optional, ("x",), [("x",), ("x", "y")]),
        (Optional, ("x", "y"), [("x",), ("x", "y"), ("x", {"y": "y"})]),
        (KeywordOnly, ("x",), [("x",), ("x", {"scale": 2.0})]),
        (VarKeyword, ("x",), [("x",), ("x", {"bias": "y"})]),
        (AfterDefault, None, [("x", {"z": "z"}), ("x", "y", {"z": "z"})]),
    ],
)
def test_optional_and_keyword_arguments(cls: type[nn.Module], example, calls) -> None:  # type: ignore[no-untyped-def]
    model = cls()
    ref = copy.deepcopy(model)
    tensors = {"x": torch.randn(6, 4 * D), "y": torch.randn(6, 4 * D), "z": torch.randn(4 * D)}

    def resolve(spec: tuple) -> tuple[tuple, dict]:
        kwargs = spec[-1] if isinstance(spec[-1], dict) else {}
        args = spec[:-1] if kwargs else spec
        pick = lambda v: tensors[v] if isinstance(v, str) else v  # noqa: E731
        return tuple(map(pick, args)), {k: pick(v) for k, v in kwargs.items()}

    opt = fxrec.optimize(model, None if example is None else resolve(example)[0])
    for spec in calls:
        args, kwargs = resolve(spec)
        torch.testing.assert_close(opt(*args, **kwargs), ref(*args, **kwargs))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_model_errors_come_from_the_model(untraceable: bool) -> None:
    """Inputs the model itself rejects raise the model's error, not a graph's or dynamo's."""
    model = Norms(untraceable=untraceable)
    opt = fxrec.optimize(model, (torch.randn(4, 4 * D),))
    for bad in (torch.randn(4, 3), torch.ones(4, 4 * D, dtype=torch.long)):
        with pytest.raises(Exception) as theirs:
            model(bad)
        with pytest.raises(type(theirs.value)) as ours:
            opt(bad)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'y'"):
        opt(torch.randn(4, 4 * D), y=1)


class WithHead(Norms):
    def __init__(self, untraceable: bool = False) -> None:
        super().__init__(untraceable=untraceable)
        self.head = nn.Linear(4 * D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


def _hooked(model: Norms, calls: list[str]) -> None:
    """A counting hook, a hook that detaches a feature, and a backward hook scaling one."""
    model.norms[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model.norms[3].register_forward_hook(lambda m, i, o: o.detach())
    model.norms[1].register_full_backward_hook(lambda m, gi, go: tuple(3 * g for g in gi))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_on_submodules_run_as_in_the_model(untraceable: bool, when: str) -> None:
    """Hooks keep their effect on outputs and gradients, and run once per call."""
    model = Norms(untraceable=untraceable)
    ref = copy.deepcopy(model)
    ours: list[str] = []
    theirs: list[str] = []
    _hooked(ref, theirs)
    if when == "before":
        _hooked(model, ours)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    if when == "after":
        _hooked(model, ours)
    for b in (8, 8, 5):
        x = torch.randn(b, 4 * D)
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        del ours[:], theirs[:]
        out, expected = opt(xo), ref(xr)
        assert ours == theirs == ["fwd"]
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        torch.testing.assert_close(xo.grad, xr.grad, rtol=TOL, atol=TOL)
        got = _grads(opt, model)
        for name, p in ref.named_parameters():
            if p.grad is None:  # the detached feature's LayerNorm
                assert got[name] is None or not got[name].any(), name
            else:
                torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)
        for p in [*ref.parameters(), *opt.parameters()]:
            p.grad = None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("hook", ["item", "full_backward"])
def test_hooks_dynamo_cannot_compile_still_train_the_flat_parameters(hook: str) -> None:
    """A hook registered after optimize that dynamo runs outside its graphs (``.item()``
    breaks the graph; full backward hooks are not compiled): the code around the break
    reads the members, whose gradients the optimizer would never see."""
    model = Norms(untraceable=True)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    logged: dict[str, list[float]] = {"ours": [], "theirs": []}
    for m, log in ((model, logged["ours"]), (ref, logged["theirs"])):
        if hook == "item":
            m.norms[1].register_forward_hook(lambda _m, i, o, log=log: log.append(o.sum().item()))
        else:
            m.norms[1].register_full_backward_hook(
                lambda _m, gi, go: tuple(None if g is None else 2 * g for g in gi)
            )
    _same_training(model, ref, opt, [8, 8, 5], 4 * D)
    assert any("graph break" in n for n in opt.fxrec_report.notes), opt.fxrec_report.notes
    assert hook != "item" or logged["ours"]


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("optimized_in", [False, True], ids=["outside", "inside"])
def test_autocast_regions_are_followed(untraceable: bool, backend: str, optimized_in: bool) -> None:
    model = WithHead(untraceable=untraceable)  # the Linear runs in bf16 under autocast
    ref = copy.deepcopy(model)
    x = torch.randn(8, 4 * D)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=optimized_in):
        opt = fxrec.optimize(model, (x,), backend=backend)
    for region in (not optimized_in, optimized_in, not optimized_in):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
            out, expected = opt(x), ref(x)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_torch_compile_of_an_optimized_module_trains_its_parameters() -> None:
    """``torch.compile(fxrec.optimize(m))`` on a model dynamo captures: at every batch size,
    the gradients reach the parameters the optimizer holds."""
    model = Norms(untraceable=True)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(16, 4 * D),))
    compiled = torch.compile(opt, backend="eager")
    for b in (16, 9):
        x, w = torch.randn(b, 4 * D), torch.randn(b, 4 * D)
        for p in [*ref.parameters(), *opt.parameters()]:
            p.grad = None
        (compiled(x) * w).sum().backward()
        (ref(x) * w).sum().backward()
        assert all(p.grad is not None for p in opt.parameters())
        got = _grads(opt, model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
def test_whole_module_save_and_load(untraceable: bool) -> None:
    """``torch.save(opt)`` after use; the loaded module rebuilds its graphs and trains as the
    model (its parameters still laid out once)."""
    import io

    model = Norms(untraceable=untraceable)
    opt = fxrec.optimize(model, (torch.randn(8, 4 * D),))
    opt(torch.randn(8, 4 * D))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in opt.named_parameters()]
    ref = copy.deepcopy(model)
    _same_training(loaded.model, ref, loaded, [8, 8], 4 * D)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = Norms()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def _saved_bytes(fn: nn.Module, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return total


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_kept(reentrant: bool) -> None:
    """A checkpointed region still saves only its inputs (symbolic tracing would trace
    through it and keep every activation: such models are captured by dynamo)."""
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    x = torch.randn(256, 4 * D, requires_grad=True)
    opt = fxrec.optimize(model, (x,))
    assert _saved_bytes(opt, x) <= 1.1 * _saved_bytes(ref, x) < _saved_bytes(ref.block, x)
    # (reentrant checkpointing gives gradients only when an input requires them)
    xo, xr = x.detach().requires_grad_(), x.detach().requires_grad_()
    out, expected = opt(xo), ref(xr)
    torch.testing.assert_close(out, expected)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (expected * w).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad)
    got = _grads(opt, model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


def test_the_models_attributes_and_distributed_state_dict_helpers() -> None:
    """``opt.head`` is the model's head, and ``torch.distributed.checkpoint``'s state-dict
    helpers (which resolve ``state_dict()``'s keys as attributes) read and write through."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    model = NormsHead(untraceable=False)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(4, 4 * D),))
    assert opt.head is model.head and opt.norms is model.norms
    with pytest.raises(AttributeError):
        opt.no_such_layer  # noqa: B018
    got = get_model_state_dict(opt)
    assert list(got) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)
    torch.manual_seed(1)
    other = NormsHead(untraceable=False)
    set_model_state_dict(opt, other.state_dict())
    x = torch.randn(4, 4 * D)
    torch.testing.assert_close(opt(x), other(x))


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("names", ["optimized", "model"])
def test_functional_call_reads_the_tensors_it_is_given(untraceable: bool, names: str) -> None:
    """``torch.func.functional_call`` swaps parameters for one call (per-sample gradients,
    meta-learning): the call computes with them, and their gradients are theirs."""
    torch.manual_seed(0)
    model = NormsHead(untraceable)
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, (torch.randn(4, 4 * D),))
    assert opt.fxrec_report.count("parallel_layer_norm") == 1
    x = torch.randn(4, 4 * D)
    opt(x)  # a call before: the one under functional_call is not the first
    module = opt if names == "optimized" else model
    given = {n: (p.detach() * 0.5).requires_grad_() for n, p in module.named_parameters()}
    want_given = {n: (p.detach() * 0.5).requires_grad_() for n, p in ref.named_parameters()}
    got = torch.func.functional_call(opt, given, (x,))
    want = torch.func.functional_call(ref, want_given, (x,))
    torch.testing.assert_close(got, want)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    if names == "model":
        for n, t in given.items():
            torch.testing.assert_close(t.grad, want_given[n].grad, msg=n)
    else:  # the flat tensors given: their members' gradients are slices of theirs
        assert all(t.grad is not None for t in given.values())
    assert all(p.grad is None for p in opt.parameters())  # the module's own were not used
    torch.testing.assert_close(opt(x), ref(x))  # and afterwards, the module's own again


def test_copies_report_their_rules_once() -> None:
    import io

    opt = fxrec.optimize(Norms(), (torch.randn(8, 4 * D),))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(opt), torch.load(buf, weights_only=False)):
        copied(torch.randn(8, 4 * D))  # graphs rebuilt: their rules reported again
        assert copied.fxrec_report.count("parallel_layer_norm") == 1
        assert copied.fxrec_report.kernels_after == opt.fxrec_report.kernels_after
