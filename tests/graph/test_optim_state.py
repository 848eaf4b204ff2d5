"""Optimizer state across fxrec and plain jobs: a plain job's optimizer state resumes with
fxrec, fxrec's resumes without it, and a resume over another layout (the example's features
in another order) continues exactly through ``fxrec.optim_state_dict`` and
``fxrec.load_optim_state_dict``, or raises where it would silently mix members' state."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxrec

FEATURES = "abcd"


class Rec(nn.Module):
    """Per-feature tables and LayerNorms, looped over in the input's key order."""

    def __init__(self, d: int = 8, rows: int = 30) -> None:
        super().__init__()
        self.emb = nn.ModuleDict({k: nn.EmbeddingBag(rows, d, mode="sum") for k in FEATURES})
        self.norm = nn.ModuleDict({k: nn.LayerNorm(d) for k in FEATURES})
        self.head = nn.Linear(d, 1)

    def forward(self, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        pooled = [torch.tanh(self.norm[k](self.emb[k](v))) for k, v in sparse.items()]
        return self.head(torch.stack(pooled, 0).sum(0))


def _batch(i: int, order: str = FEATURES) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = {k: torch.randint(0, 30, (16, 2), generator=g) for k in FEATURES}
    return {k: ids[k] for k in order}, torch.rand(16, 1, generator=g)


def _groups(model: Rec) -> list[dict]:
    named = list(model.named_parameters())
    emb = [p for n, p in named if n.startswith("emb.")]
    norms = [p for n, p in named if n.startswith("norm.") or n.endswith("bias")]
    rest = [p for n, p in named if not n.startswith(("emb.", "norm.")) and n != "head.bias"]
    return [
        {"params": rest},
        {"params": norms, "weight_decay": 0.0},
        {"params": emb, "lr": 0.1, "weight_decay": 0.0},
    ]


def _reversed_groups(model: Rec) -> list[dict]:
    """The same groups, each listing its parameters against ``named_parameters()`` order."""
    return [{**g, "params": g["params"][::-1]} for g in _groups(model)]


OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "adam": lambda g: torch.optim.Adam(g, lr=0.02, weight_decay=1e-3),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "sgd_momentum": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=1e-3),
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, order: str) -> None:
    for i in steps:
        x, y = _batch(i, order)
        optimizer.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        optimizer.step()


def _reloaded(obj: object) -> object:
    """``obj`` through torch.save/torch.load, as a checkpoint file would give it back."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _fxrec(
    model_state: dict, make: Callable, order: str = FEATURES, groups: Callable = _groups
) -> tuple:
    model = Rec()
    model.load_state_dict(model_state)
    opt = fxrec.optimize(model, (_batch(0, order)[0],))
    assert opt.fxrec_fused.member_ids()  # tables and norms laid out
    return model, opt, make(fxrec.param_groups(opt, groups(model)))


def _assert_same_params(got: nn.Module, want: nn.Module) -> None:
    ref = want.state_dict()
    for k, v in got.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-5, msg=k)


def _plain_run(
    make: Callable, groups: Callable = _groups
) -> tuple[Rec, torch.optim.Optimizer, dict]:
    """A plain job: 3 steps, a checkpoint, 3 more steps (the continuous reference)."""
    torch.manual_seed(0)
    plain = Rec()
    o = make(groups(plain))
    _train(plain, o, range(3), FEATURES)
    ckpt = _reloaded({"model": plain.state_dict(), "optim": o.state_dict()})
    _train(plain, o, range(3, 6), FEATURES)
    return plain, o, ckpt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_plain_jobs_optimizer_state_resumes_with_fxrec(name: str) -> None:
    make = OPTIMIZERS[name]
    plain, _, ckpt = _plain_run(make)
    model, opt, o = _fxrec(ckpt["model"], make)
    fxrec.load_optim_state_dict(opt, o, ckpt["optim"])
    _train(opt, o, range(3, 6), FEATURES)
    _assert_same_params(model, plain)


@pytest.mark.parametrize("groups", ["as_given", "copied"])
def test_a_plain_job_listing_its_groups_in_its_own_order_resumes_with_fxrec_and_back(
    groups: str,
) -> None:
    """A plain optimizer saves each group's state in the order its groups list parameters;
    ``fxrec.param_groups`` was given that order, so the state is matched through it, both
    ways, whatever copies of the group dicts the optimizer (or a wrapper) makes."""
    make = OPTIMIZERS["adam"]
    plain, o_plain, ckpt = _plain_run(make, _reversed_groups)
    copied = lambda given: make([dict(g) for g in given])  # noqa: E731
    model, opt, o = _fxrec(
        ckpt["model"], copied if groups == "copied" else make, groups=_reversed_groups
    )
    fxrec.load_optim_state_dict(opt, o, ckpt["optim"])
    _train(opt, o, range(3, 6), FEATURES)
    _assert_same_params(model, plain)
    state, want = fxrec.optim_state_dict(opt, o), o_plain.state_dict()
    assert state["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(state["state"][i][k], v, rtol=1e-5, atol=1e-5)


class ManyGroups(Rec):
    """Rec and 70 small parameters of a group each (per-table learning rates and the like)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ParameterList(nn.Parameter(torch.full((8,), 0.01 * i)) for i in range(70))

    def forward(self, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().forward(sparse) + torch.stack(list(self.extra)).sum()


def _many_groups(model: ManyGroups) -> list[dict]:
    extra = {id(p) for p in model.extra}
    rec = [
        {**g, "params": [p for p in g["params"] if id(p) not in extra]}
        for g in _reversed_groups(model)
    ]
    return rec + [{"params": [p]} for p in model.extra]


def test_the_order_of_every_group_is_kept_however_many_groups() -> None:
    torch.manual_seed(0)
    plain = ManyGroups()
    model = copy.deepcopy(plain)
    o_plain = torch.optim.Adam(_many_groups(plain), lr=0.02)
    opt = fxrec.optimize(model, (_batch(0)[0],))
    o = torch.optim.Adam(fxrec.param_groups(opt, _many_groups(model)), lr=0.02)
    for module, optimizer in ((plain, o_plain), (opt, o)):
        _train(module, optimizer, range(3), FEATURES)
    state, want = fxrec.optim_state_dict(opt, o), o_plain.state_dict()
    for i, st in want["state"].items():
        torch.testing.assert_close(state["state"][i]["exp_avg"], st["exp_avg"], msg=str(i))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fxrec_optimizer_state_resumes_in_a_plain_job(name: str) -> None:
    make = OPTIMIZERS[name]
    plain, o_plain, ckpt = _plain_run(make)
    _, opt, o = _fxrec(ckpt["model"], make)
    fxrec.load_optim_state_dict(opt, o, ckpt["optim"])
    _train(opt, o, range(3, 6), FEATURES)
    state = _reloaded(fxrec.optim_state_dict(opt, o))
    want = o_plain.state_dict()
    assert state["param_groups"] == want["param_groups"]
    assert state["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert state["state"][i].keys() == st.keys()
        for k, v in st.items():
            torch.testing.assert_close(state["state"][i][k], v, rtol=1e-5, atol=1e-5)
    back = Rec()
    back.load_state_dict(opt.state_dict())
    o_back = make(_groups(back))
    o_back.load_state_dict(state)
    _train(back, o_back, range(6, 9), FEATURES)
    _train(plain, o_plain, range(6, 9), FEATURES)
    _assert_same_params(back, plain)


def _fxrec_checkpoint() -> tuple[Rec, dict]:
    """An fxrec job over the features in FEATURES order: 3 steps, a checkpoint (both state
    dicts), 3 more steps (the continuous reference)."""
    torch.manual_seed(0)
    init = Rec()
    model, opt, o = _fxrec(init.state_dict(), OPTIMIZERS["adam"])
    _train(opt, o, range(3), FEATURES)
    ckpt = _reloaded(
        {
            "model": opt.state_dict(),
            "optim": o.state_dict(),
            "plain_optim": fxrec.optim_state_dict(opt, o),
        }
    )
    _train(opt, o, range(3, 6), FEATURES)
    return model, ckpt


def test_a_resume_over_another_layout_continues_through_the_helpers() -> None:
    model, ckpt = _fxrec_checkpoint()
    order = FEATURES[::-1]  # the resumed job's example lists the features reversed
    resumed, opt, o = _fxrec(ckpt["model"], OPTIMIZERS["adam"], order)
    fxrec.load_optim_state_dict(opt, o, ckpt["plain_optim"])
    _train(opt, o, range(3, 6), order)
    _assert_same_params(resumed, model)


def test_a_resume_over_another_layout_from_the_optimizers_own_state_raises() -> None:
    model, ckpt = _fxrec_checkpoint()
    resumed, opt, o = _fxrec(ckpt["model"], OPTIMIZERS["adam"])  # same layout: fine
    o.load_state_dict(copy.deepcopy(ckpt["optim"]))
    _train(opt, o, range(3, 6), FEATURES)
    _assert_same_params(resumed, model)
    order = FEATURES[::-1]
    _, opt, o = _fxrec(ckpt["model"], OPTIMIZERS["adam"], order)
    o.load_state_dict(copy.deepcopy(ckpt["optim"]))  # the flat parameters' shapes match
    with pytest.raises(RuntimeError, match=r"another order.*fxrec.load_optim_state_dict"):
        _train(opt, o, range(3, 4), order)


@pytest.mark.parametrize("how", ["flats_added_later", "deepcopy", "pickled"])
def test_layouts_are_recorded_however_the_optimizer_or_module_came(how: str) -> None:
    """Flat parameters given to an optimizer after its first step, and optimizers over a
    copy of the optimized module, record the layout too: a resume over another layout
    raises instead of giving each member another member's state."""
    torch.manual_seed(0)
    _, opt, _ = _fxrec(Rec().state_dict(), OPTIMIZERS["adam"])
    if how == "deepcopy":
        opt = copy.deepcopy(opt)
    elif how == "pickled":
        opt = _reloaded_module(opt)
    flats = [p for n, p in opt.named_parameters() if n.startswith("fxrec_fused.")]
    others = [p for n, p in opt.named_parameters() if not n.startswith("fxrec_fused.")]
    o = torch.optim.Adam(others if how == "flats_added_later" else flats + others, lr=0.02)
    if how == "flats_added_later":
        _train(opt, o, range(1), FEATURES)
        o.add_param_group({"params": flats})
    _train(opt, o, range(1, 3), FEATURES)
    saved = o.state_dict()
    assert any("fxrec_layout" in st for st in saved["state"].values())
    order = FEATURES[::-1]
    _, other, _ = _fxrec(opt.state_dict(), OPTIMIZERS["adam"], order)
    flats = [p for n, p in other.named_parameters() if n.startswith("fxrec_fused.")]
    others = [p for n, p in other.named_parameters() if not n.startswith("fxrec_fused.")]
    o = torch.optim.Adam(others, lr=0.02) if how == "flats_added_later" else None
    if o is None:
        o = torch.optim.Adam(flats + others, lr=0.02)
    else:
        o.add_param_group({"params": flats})
    o.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="another order"):
        _train(other, o, range(3, 4), order)


def _reloaded_module(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_states_one_flat_parameter_cannot_hold_raise() -> None:
    _, ckpt = _fxrec_checkpoint()
    _, opt, o = _fxrec(ckpt["model"], OPTIMIZERS["adam"])
    state = copy.deepcopy(ckpt["plain_optim"])
    emb = state["param_groups"][2]["params"]
    state["state"][emb[1]]["step"] = torch.tensor(7.0)  # one table trained more steps
    with pytest.raises(ValueError, match=r"differ in 'step'.*emb.b.weight: 7.0"):
        fxrec.load_optim_state_dict(opt, o, state)
    with pytest.raises(ValueError, match=r"groups of .* fxrec.optim_state_dict"):
        fxrec.load_optim_state_dict(opt, o, ckpt["optim"])  # the flat parameters' own state


def _assert_equal_params(got: nn.Module, want: nn.Module) -> None:
    ref = want.state_dict()
    differ = [k for k, v in got.state_dict().items() if not torch.equal(v, ref[k])]
    assert not differ, f"resumed parameters differ from the continuing run's: {differ}"


def _fxrec_job(name: str) -> tuple[Rec, nn.Module, torch.optim.Optimizer]:
    """An fxrec job over a fresh model, trained 3 steps."""
    torch.manual_seed(0)
    model, opt, o = _fxrec(Rec().state_dict(), OPTIMIZERS[name])
    _train(opt, o, range(3), FEATURES)
    return model, opt, o


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_one_checkpoint_resumes_into_several_optimizers_each_continuing_exactly(name: str) -> None:
    """A checkpoint loaded by an fxrec resume and a plain one in one process: each
    optimizer trains its own state, neither moves the other's (nor the checkpoint's)."""
    model, opt, o = _fxrec_job(name)
    ckpt = _reloaded({"model": opt.state_dict(), "optim": fxrec.optim_state_dict(opt, o)})
    _train(opt, o, range(3, 6), FEATURES)
    resumed, opt2, o2 = _fxrec(ckpt["model"], OPTIMIZERS[name])
    fxrec.load_optim_state_dict(opt2, o2, ckpt["optim"])
    plain = Rec()
    plain.load_state_dict(ckpt["model"])
    o_plain = OPTIMIZERS[name](_groups(plain))
    o_plain.load_state_dict(ckpt["optim"])
    for i in range(3, 6):
        _train(opt2, o2, range(i, i + 1), FEATURES)
        _train(plain, o_plain, range(i, i + 1), FEATURES)
    _assert_equal_params(resumed, model)
    _assert_same_params(plain, model)


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_a_state_kept_in_memory_is_the_state_when_it_was_taken(name: str) -> None:
    """``optim_state_dict`` is a snapshot: steps after it change neither it nor, once it is
    loaded, the optimizer that took it."""
    model, opt, o = _fxrec_job(name)
    ckpt = {
        "model": {k: v.clone() for k, v in opt.state_dict().items()},
        "optim": fxrec.optim_state_dict(opt, o),
    }
    _train(opt, o, range(3, 6), FEATURES)
    resumed, opt2, o2 = _fxrec(ckpt["model"], OPTIMIZERS[name])
    fxrec.load_optim_state_dict(opt2, o2, ckpt["optim"])
    _train(opt2, o2, range(3, 6), FEATURES)
    _assert_equal_params(resumed, model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _train(opt2, o2, range(6, 7), FEATURES)  # the resumed job's step leaves the first alone
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
