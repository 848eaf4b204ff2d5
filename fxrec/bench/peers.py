"""Benchmark section "peers": fxrec next to PyTorch's own pre-grad batch fusions, same graphs.

Three tables, all in ONE process:

1. **Shapes.** Small graphs exercising every split/cat and batch rule (plus the safety
   cases Inductor's fusions get wrong) and the reference models, captured once by dynamo.
   The same graph goes through fxrec's rules and through every Inductor pre-grad fusion
   (:func:`fxrec.compile.run_inductor_fusions`): compute ops before/after, pass time, and
   the max error of each rewritten graph against the captured one (or the exception).
   "fxrec ops" is the graph as ``fxrec.optimize`` rewrites it (parameters laid out once);
   "plug-in ops" as ``compile_backend``/``inductor_pass`` do, where parameters are graph
   inputs and fxrec refuses to re-stack weights in the graph every step (Inductor does).
2. **Pass time at scale.** Synthetic graphs of 1k-16k nodes: fxrec's pass vs Inductor's,
   both without the lint and recompile after them (medians of 5 runs up to 4k nodes).
   Goal: fxrec at most 1/10 of Inductor's.
3. **Training step.** eager; ``fxrec.optimize`` (eager); ``torch.compile``; ``torch.compile``
   with all of Inductor's pre-grad fusions; ``torch.compile`` with ``fxrec.inductor_pass()``;
   ``fxrec.optimize(backend="inductor")`` (fxrec's graphs under Inductor, parameters laid
   out once, which a pre-grad pass cannot do). Kernels forward/backward (eager modes),
   compile time (fresh Inductor cache), median step time (interleaved), max output and
   gradient error against eager. Goal: torch.compile + fxrec (the better of the two
   fxrec+Inductor modes) at least 1.1x faster per step than ``torch.compile`` alone on the
   ranking model.

"ops" counts call nodes that compute (views and tuple indexing are free); "nodes" is the raw
node count. Run alone: ``python -m fxrec.bench.peers [--quick]``; normally
``python -m fxrec bench --peers``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import fxrec
from fxrec.bench.common import interleaved_samples, print_table, write_json
from fxrec.compile import inductor_fusion_options, run_inductor_fusions
from fxrec.graph.capture import lift_params_to_attrs
from fxrec.graph.optimize_graph import optimize_graph, resolve_rules
from fxrec.graph.params import FusedParameters

logger = logging.getLogger("fxrec.bench")

__all__ = ["run", "shapes", "op_count"]

_VIEWS = {"split", "chunk", "unbind", "narrow", "view", "reshape", "getitem", "split_with_sizes"}


# -- small shapes: one per rule and per safety case ---------------------------------------------
class _Fn(nn.Module):
    """Wraps a function of tensors plus its example-input maker as a benchmark model."""

    def __init__(self, fn: Callable[..., Any], example: Callable[[int], tuple]) -> None:
        super().__init__()
        self.fn, self._example = fn, example

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

    def example(self, batch: int) -> tuple:
        return self._example(batch)


def _x(width: int, dtype: torch.dtype = torch.float32) -> Callable[[int], tuple]:
    return lambda b: (torch.randn(b, width, dtype=dtype),)


def _spellings(x: torch.Tensor) -> torch.Tensor:
    p = torch.split(x, 8, 1)
    t = [p[0].tanh(), torch.tanh(p[1]), F.tanh(p[2]), p[3].tanh(), torch.tanh(p[4]), p[5].tanh()]
    s = [F.sigmoid(q) if i % 2 else q.sigmoid() for i, q in enumerate(p[6:12])]
    r = [torch.relu(q) if i % 2 else q.relu() for i, q in enumerate(p[12:18])]
    return torch.cat(t + s + r, 1)


def _same_spelling(x: torch.Tensor) -> torch.Tensor:
    p = torch.split(x, 8, 1)
    return torch.cat([torch.tanh(q) for q in p[:6]] + [torch.sigmoid(q) for q in p[6:]], 1)


def _mixed_dtype(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    pairs = zip(torch.split(x, 8, 1), torch.split(y, 8, 1))
    return [torch.tanh(t) for pair in pairs for t in pair]


def _inplace_relu(x: torch.Tensor) -> list[torch.Tensor]:
    hs = [p * 2 for p in torch.split(x, 8, 1)]
    for h in hs:
        F.relu(h, inplace=True)
    return hs


def _clamp(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.clamp(p, -0.5, 0.5) for p in torch.split(x, 8, 1)], 1)


def _cat_of_split(x: torch.Tensor) -> torch.Tensor:
    a = torch.split(x, 8, 1)
    return torch.cat(list(a), 1) * 2


def _split_of_split(x: torch.Tensor) -> torch.Tensor:
    a, b = torch.split(x, 32, 1)
    return torch.cat([*torch.split(a, 8, 1)[::-1], *torch.split(b, 16, 1)], 1) + 1


def _split_of_cat(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    u, v = torch.split(torch.cat([x, y], 1), [x.shape[1], y.shape[1]], 1)
    return u * v


def _slices(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tanh(x[:, 8 * i : 8 * i + 8]) for i in range(6)], 1)


def _layer_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.layer_norm(p, (8,)) for p in torch.split(x, 8, 1)], 1)


class _Linears(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared = shared
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x] * 6 if self.shared else list(torch.split(x, 16, 1))
        return torch.cat([torch.relu(lin(p)) for lin, p in zip(self.lins, parts)], 1)

    def example(self, batch: int) -> tuple:
        return (torch.randn(batch, 16 if self.shared else 96),)


def shapes(quick: bool = False) -> dict[str, nn.Module]:
    """Every small shape of the side-by-side table, plus the reference models."""
    from fxrec.bench import models as M

    out: dict[str, nn.Module] = {
        "tanh/sigmoid/relu, mixed spellings": _Fn(_spellings, _x(144)),
        "tanh/sigmoid, one spelling": _Fn(_same_spelling, _x(96)),
        "mixed fp32/bf16 tanh": _Fn(
            _mixed_dtype, lambda b: (torch.randn(b, 48), torch.randn(b, 48, dtype=torch.bfloat16))
        ),
        "relu(inplace=True)": _Fn(_inplace_relu, _x(48)),
        "clamp(x, lo, hi)": _Fn(_clamp, _x(48)),
        "cat of split": _Fn(_cat_of_split, _x(48)),
        "split of split": _Fn(_split_of_split, _x(64)),
        "split of cat": _Fn(_split_of_cat, lambda b: (torch.randn(b, 8), torch.randn(b, 8))),
        "slices -> tanh -> cat": _Fn(_slices, _x(48)),
        "parallel layer_norm": _Fn(_layer_norms, _x(48)),
        "linears, shared input": _Linears(shared=True),
        "linears, split input": _Linears(shared=False),
        "seed pattern (16)": M.SeedPattern(16),
        "parallel towers": M.ParallelTowers(),
    }
    if not quick:
        out["mmoe"] = M.MultiGateMoE()
        out["ranking model"] = M.RankingModel()
    return out


# -- helpers --------------------------------------------------------------------------------------
def op_count(gm: fx.GraphModule) -> int:
    """Call nodes that compute something (views and tuple indexing are free)."""
    n = 0
    for node in gm.graph.nodes:
        if not node.op.startswith("call"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        n += name not in _VIEWS
    return n


def _capture(model: nn.Module, args: tuple) -> tuple[fx.GraphModule, list[Any]]:
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def keep(gm: fx.GraphModule, ex: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, list(ex)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep)(*args)
    torch._dynamo.reset()
    gm, ex = max(graphs, key=lambda g: len(g[0].graph.nodes))  # the biggest graph
    return gm, ex


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _max_err(got: Any, want: Any) -> float:
    a = [t for t in tree_leaves(got) if isinstance(t, torch.Tensor)]
    b = [t for t in tree_leaves(want) if isinstance(t, torch.Tensor)]
    if len(a) != len(b):
        return float("inf")
    err = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")  # a dtype change (bf16 -> fp32) is an error, whatever the values
        if x.numel():
            err = max(err, (x.double() - y.double()).abs().max().item())
    return err


def _run_graph(gm: fx.GraphModule, ex: list[Any]) -> Any:
    inputs = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in ex]
    with torch.no_grad():
        return gm(*inputs)


def _shape_row(name: str, model: nn.Module, device: str) -> dict[str, Any]:
    args = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, model.example(8))
    model = model.to(device)
    gm, ex = _capture(model, args)
    want = _run_graph(gm, ex)
    row: dict[str, Any] = {"shape": name, "nodes": len(gm.graph.nodes), "ops": op_count(gm)}
    ours = _copy(gm)
    row_device = torch.device(device).type
    t0 = time.perf_counter()
    rep = optimize_graph(ours, resolve_rules(), device_type=row_device)
    row["fxrec_total_s"] = time.perf_counter() - t0
    row["fxrec_s"] = rep.seconds  # the rule passes: Inductor's time excludes lint + recompile too
    row["plugin_ops"] = op_count(ours)  # parameters stay graph inputs: no in-graph re-stacking
    row["fxrec_err"] = _max_err(_run_graph(ours, ex), want)
    row["fxrec_ops"] = row["plugin_ops"]
    if next(model.parameters(), None) is not None:  # as fxrec.optimize runs: laid out once
        laid, keep = lift_params_to_attrs(_copy(gm), ex, model)
        optimize_graph(laid, resolve_rules(), owner=FusedParameters(), device_type=row_device)
        row["fxrec_ops"] = op_count(laid)
        kept = [ex[i] for i in keep]
        row["fxrec_err"] = max(row["fxrec_err"], _max_err(_run_graph(laid, kept), want))
    theirs = _copy(gm)
    try:
        row["inductor_s"] = run_inductor_fusions(theirs)
        row["inductor_ops"] = op_count(theirs)
        row["inductor_err"] = _max_err(_run_graph(theirs, ex), want)
    except Exception as exc:  # Inductor's fusions crash on some shapes: that is a result
        row["inductor_s"] = float("nan")
        row["inductor_ops"] = op_count(theirs)
        row["inductor_err"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:50]}"
    return row


# -- pass time at scale ---------------------------------------------------------------------------
def _scaling_row(target: int, repeats: int = 1) -> dict[str, Any]:
    """Pass times on one synthetic graph: medians of ``repeats`` runs on fresh copies."""
    from fxrec.bench.models import synthetic_for_nodes

    model = synthetic_for_nodes(target)
    t0 = time.perf_counter()
    gm, _ = _capture(model, model.example(4))
    capture_s = time.perf_counter() - t0
    fx_s, total, ind_s = [], [], []
    for _ in range(repeats):
        ours, theirs = _copy(gm), _copy(gm)
        t0 = time.perf_counter()
        rep = optimize_graph(ours, resolve_rules())
        total.append(time.perf_counter() - t0)
        fx_s.append(rep.seconds)  # like Inductor's figure: the passes, no lint and recompile
        ind_s.append(run_inductor_fusions(theirs))
    fxrec_s, inductor_s = statistics.median(fx_s), statistics.median(ind_s)
    return {
        "nodes": len(gm.graph.nodes),
        "repeats": repeats,
        "capture_s": capture_s,
        "fxrec_s": fxrec_s,
        "fxrec_total_s": statistics.median(total),
        "inductor_s": inductor_s,
        "ratio": fxrec_s / inductor_s if inductor_s else float("nan"),
        "fxrec_ops": f"{op_count(gm)}->{op_count(ours)}",
        "inductor_ops": f"{op_count(gm)}->{op_count(theirs)}",
    }


# -- training step, six modes ---------------------------------------------------------------------
def _loss(out: Any) -> torch.Tensor:
    return sum(t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor))  # type: ignore[return-value]


def _grads(model: nn.Module, opt: Any = None) -> dict[str, torch.Tensor | None]:
    """Each of ``model``'s parameter gradients, read through fxrec's fused layouts if any."""
    if opt is None:
        return {name: p.grad for name, p in model.named_parameters()}
    return opt.fxrec_fused.grads(model)


def _inductor(mode: str) -> Callable[..., Any]:
    """Inductor with this mode's configuration, applied while (and only while) it compiles.

    A distinct backend object per mode also keeps dynamo from reusing another mode's
    compiled code for a model of the same class.
    """
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    patch: dict[str, Any] = {}
    if mode == "compile+inductor fusions":
        patch["pre_grad_fusion_options"] = inductor_fusion_options()
    elif mode == "compile+fxrec":
        patch["pre_grad_custom_pass"] = fxrec.inductor_pass()

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        with config.patch(patch):
            return compile_fx(gm, example_inputs)

    return backend


_MODES = (
    "eager",
    "fxrec eager",
    "compile",
    "compile+inductor fusions",
    "compile+fxrec",
    "fxrec+inductor",
)
_FXREC_INDUCTOR = ("compile+fxrec", "fxrec+inductor")  # the two ways to run fxrec with Inductor


def _prepare(mode: str, twin: nn.Module, args: tuple) -> tuple[Any, Any]:
    """This mode's step function and, for fxrec modes, the :class:`fxrec.OptimizedModule`."""
    if mode == "eager":
        return twin, None
    if mode == "fxrec eager":
        opt = fxrec.optimize(twin, args)
        return opt, opt
    if mode == "fxrec+inductor":
        opt = fxrec.optimize(twin, args, backend="inductor")  # compiles (dynamo capture)
        return opt, opt
    return torch.compile(twin, backend=_inductor(mode)), None


def _step_rows(
    name: str, model: nn.Module, device: str, quick: bool, batch: int
) -> list[dict[str, Any]]:
    from torch._inductor.utils import fresh_cache

    model = model.to(device)
    args = tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, model.example(batch)
    )
    model.zero_grad(set_to_none=True)
    want = model(*args)
    _loss(want).backward()
    want_grads = _grads(model)
    steps: dict[str, Callable[[], None]] = {}
    rows: list[dict[str, Any]] = []
    for mode in _MODES:
        twin = copy.deepcopy(model)
        row: dict[str, Any] = {"model": name, "mode": mode}
        t0 = time.perf_counter()
        twin.zero_grad(set_to_none=True)
        with fresh_cache():
            fn, opt = _prepare(mode, twin, args)
            got = fn(*args)  # compiles, with this mode's configuration
            _loss(got).backward()
        row["compile_s"] = time.perf_counter() - t0 if mode != "eager" else 0.0
        row["out_err"] = _max_err(got, want)
        g = _grads(twin, opt)
        row["grad_err"] = max(
            (
                float("inf")
                if (g[k] is None) != (w is None)
                else 0.0
                if w is None
                else (g[k] - w).abs().max().item()
            )
            for k, w in want_grads.items()
        )
        if mode in ("eager", "fxrec eager"):
            kc = fxrec.count_kernels(fn, *args)
            row["kernels"] = f"{kc.forward}/{kc.backward}"
        else:
            row["kernels"] = "-"

        def step(fn: Any = fn, twin: nn.Module = twin, opt: Any = opt) -> None:
            (opt or twin).zero_grad(set_to_none=True)
            _loss(fn(*args)).backward()

        steps[mode] = step
        rows.append(row)
    n = 10 if quick else 40
    samples = interleaved_samples(steps, n, warmup=2, device=device)
    base = statistics.median(samples["compile"])
    for row in rows:
        med = statistics.median(samples[row["mode"]])
        row["step_ms"] = med * 1e3
        row["vs_compile"] = base / med
    return rows


def _best_fxrec_inductor(step_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The faster of the fxrec+Inductor modes on the ranking model (None if not measured)."""
    rows = [
        r for r in step_rows if r["model"].startswith("ranking") and r["mode"] in _FXREC_INDUCTOR
    ]
    return max(rows, key=lambda r: r["vs_compile"], default=None)


# -- the section ----------------------------------------------------------------------------------
def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Print the three tables, write ``peers.json``, return the figures."""
    from fxrec.bench import models as M

    torch.manual_seed(0)
    shape_rows = [_shape_row(name, m, device) for name, m in shapes(quick).items()]
    print_table(
        f"peers: the same dynamo graph through fxrec and through every Inductor pre-grad fusion ({device})",
        [
            "shape",
            "nodes",
            "ops",
            "fxrec ops",
            "plug-in ops",
            "inductor ops",
            "fxrec ms",
            "inductor ms",
            "fxrec err",
            "inductor err",
        ],
        [
            [
                r["shape"],
                r["nodes"],
                r["ops"],
                r["fxrec_ops"],
                r["plugin_ops"],
                r["inductor_ops"],
                r["fxrec_s"] * 1e3,
                r["inductor_s"] * 1e3,
                r["fxrec_err"],
                r["inductor_err"],
            ]
            for r in shape_rows
        ],
    )
    sizes = (1000, 4000) if quick else (1000, 2000, 4000, 8000, 16000)
    # Small graphs take well under a second per run: the median of 5 runs steadies them.
    scale_rows = [_scaling_row(n, repeats=5 if n <= 4000 else 1) for n in sizes]
    print_table(
        "peers: pass time on synthetic graphs (goal: fxrec <= 0.1x Inductor's batch fusions; "
        "both without lint + recompile, which fxrec's total adds)",
        [
            "nodes",
            "capture s",
            "fxrec total s",
            "fxrec s",
            "inductor s",
            "fxrec/inductor",
            "fxrec ops",
            "inductor ops",
        ],
        [
            [
                r["nodes"],
                r["capture_s"],
                r["fxrec_total_s"],
                r["fxrec_s"],
                r["inductor_s"],
                r["ratio"],
                r["fxrec_ops"],
                r["inductor_ops"],
            ]
            for r in scale_rows
        ],
    )
    models: dict[str, tuple[nn.Module, int]] = {"seed pattern (16)": (M.SeedPattern(16), 256)}
    if quick:
        models["ranking model (small)"] = (M.RankingModel(num_sparse=16, tasks=("a", "b")), 256)
    else:
        models["parallel towers"] = (M.ParallelTowers(), 256)
        models["ranking model"] = (M.RankingModel(), 256)
    step_rows = [
        r for name, (m, b) in models.items() for r in _step_rows(name, m, device, quick, b)
    ]
    print_table(
        "peers: training step (kernels fwd/bwd in eager modes; errors vs eager)",
        ["model", "mode", "kernels", "compile s", "step ms", "x vs compile", "out err", "grad err"],
        [
            [
                r["model"],
                r["mode"],
                r["kernels"],
                r["compile_s"],
                r["step_ms"],
                r["vs_compile"],
                r["out_err"],
                r["grad_err"],
            ]
            for r in step_rows
        ],
    )
    worse = [r["shape"] for r in shape_rows if r["fxrec_ops"] > r["inductor_ops"]]
    ratios = [r["ratio"] for r in scale_rows]
    best = _best_fxrec_inductor(step_rows)
    goals = {
        "fxrec removes at least as many ops on every shape": not worse,
        "shapes where Inductor removes more": worse,
        "max pass-time ratio fxrec/inductor (goal <= 0.1)": max(ratios),
        "ranking torch.compile+fxrec speed-up vs compile (goal >= 1.1)": best["vs_compile"]
        if best
        else None,
        "ranking torch.compile+fxrec mode": best["mode"] if best else None,
    }
    for k, v in goals.items():
        print(f"  {k}: {v}")
    payload = {
        "quick": quick,
        "device": device,
        "shapes": shape_rows,
        "scaling": scale_rows,
        "steps": step_rows,
        "goals": goals,
    }
    write_json("peers", payload)
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    a = parser.parse_args()
    run(quick=a.quick, device=a.device)


if __name__ == "__main__":
    main()
