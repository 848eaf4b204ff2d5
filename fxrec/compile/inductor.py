"""fxrec's rules as an Inductor pre-grad pass, and Inductor's own batch fusions to compare.

``torch._inductor.config.pre_grad_custom_pass = fxrec.inductor_pass()`` runs every rule on
each graph Inductor compiles, before AOTAutograd: the rewritten forward is differentiated,
so the backward is fused too. The pass is a real ``CustomGraphPass`` whose ``uuid()`` names
the rule set, the options and the source of the code that runs, so Inductor's FX graph
cache never serves a graph compiled under another rule set (and keeps serving ones compiled
under this one).

Pre-grad graphs carry dynamo's ``example_value`` (or ``val``) on each node; a node without
either is no candidate for any rule, and the report says how many were skipped so.

:func:`inductor_fusion_options` and :func:`run_inductor_fusions` run PyTorch's built-in
pre-grad batch and split/cat fusions (``torch/_inductor/fx_passes``) on a graph, alone, so
benchmarks and tests can compare them with fxrec on the very same graph.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import fxrec
from fxrec.graph.optimize_graph import RuleSpec, optimize_graph, resolve_rules, strict_mode
from fxrec.graph.report import Report
from fxrec.graph.rule import Rule

logger = logging.getLogger(__name__)

__all__ = [
    "FxrecInductorPass",
    "inductor_pass",
    "inductor_fusion_options",
    "run_inductor_fusions",
]

_FRAMEWORK_DIRS = ("graph",)  # fxrec/graph/*.py: driver, search, metadata, parameters


def _source_files(rules: Iterable[Rule]) -> list[Path]:
    root = Path(fxrec.__file__).parent
    files = {p for d in _FRAMEWORK_DIRS for p in (root / d).glob("*.py")}
    files.add(Path(__file__))
    for r in rules:
        mod = sys.modules.get(type(r).__module__)
        path = inspect.getsourcefile(mod) if mod is not None else None
        if path:
            files.add(Path(path))
    return sorted(files)


def _device_type(graph: fx.Graph) -> str:
    """The device of the graph's first tensor input, from the metadata dynamo left on it."""
    for node in graph.find_nodes(op="placeholder"):
        v = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


class FxrecInductorPass(CustomGraphPass):
    """fxrec's rules as ``torch._inductor.config.pre_grad_custom_pass``.

    Parameters reach pre-grad graphs as inputs, so fused weights would be gathered in the
    graph; on a CPU, where Inductor's own code leaves little launch cost to save, the cost
    model refuses every set that would copy weights or separate inputs together
    (:func:`fxrec.graph.cost.copy_reason`). The pass edits the graph it is given in place
    (its identity never changes): on an unexpected rule error the graph stays exactly as it
    came (strict mode raises).
    """

    def __init__(self, rules: RuleSpec = None, *, exclude: Iterable[str] = ()) -> None:
        self.exclude = tuple(sorted(exclude))
        self.rules = resolve_rules(rules, exclude=self.exclude)
        self.report = Report(capture="inductor pre-grad")
        self._uuid: str | None = None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, fx.GraphModule):
            self.report.notes.append("graph without an owning GraphModule: left alone")
            return
        bare = [
            n.name
            for n in graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and "example_value" not in n.meta
            and "val" not in n.meta
        ]
        if bare:
            self.report.notes.append(
                f"{len(bare)} node(s) without example_value/val are no candidates "
                f"(first: {', '.join(bare[:3])})"
            )
        t0 = time.perf_counter()
        work = fx.GraphModule(gm, _copy(graph), type(gm).__name__)
        copied, fired = work.graph, len(self.report.firings)
        optimize_graph(
            work,
            self.rules,
            report=self.report,
            device_type=_device_type(graph),
            for_inductor=True,
        )
        if work.graph is not copied or len(self.report.firings) == fired:
            return  # nothing fired, or a rule failed (and said why): the graph stays as is
        _replace_contents(gm, graph, work)
        from fxrec.compile.backend import fill_example_values

        fill_example_values(gm)
        logger.debug("fxrec pre-grad pass: %.1f ms", (time.perf_counter() - t0) * 1e3)

    def uuid(self) -> str:
        """Identifies the rule set, options and code: changes whenever any of them does."""
        if self._uuid is None:
            h = hashlib.sha256()
            h.update(f"fxrec {fxrec.__version__} torch {torch.__version__}\n".encode())
            for r in self.rules:
                h.update(f"rule {r.name} {type(r).__module__}.{type(r).__qualname__}\n".encode())
                h.update(repr(sorted(vars(r).items())).encode())
            h.update(f"exclude {self.exclude} strict {strict_mode()}\n".encode())
            for path in _source_files(self.rules):
                h.update(path.name.encode())
                h.update(path.read_bytes())
            self._uuid = h.hexdigest()
        return self._uuid

    def __repr__(self) -> str:
        return f"FxrecInductorPass(rules={[r.name for r in self.rules]})"


def inductor_pass(rules: RuleSpec = None, *, exclude: Iterable[str] = ()) -> FxrecInductorPass:
    """An object for ``torch._inductor.config.pre_grad_custom_pass``.

    Example::

        torch._inductor.config.pre_grad_custom_pass = fxrec.inductor_pass()
        compiled = torch.compile(model)

    The pass runs when Inductor compiles, on the first call (and on recompiles): a
    ``config.patch`` context around ``torch.compile`` alone is gone by then; put the
    first call inside it, or set the config as above.

    ``rules`` picks rules by name, class or instance (default: every registered rule);
    ``exclude`` drops rules by name. ``.report`` accumulates what each graph got.

    Set it before the process compiles the model's class (or ``torch._dynamo.reset()`` after):
    dynamo reuses code compiled for another instance of the class, which never ran the pass.
    """
    return FxrecInductorPass(rules, exclude=exclude)


def _copy(graph: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    return out


def _replace_contents(gm: fx.GraphModule, graph: fx.Graph, new: fx.GraphModule) -> None:
    """Make ``graph`` (the object Inductor holds) a copy of ``new.graph``, in place."""
    for node in reversed(list(graph.nodes)):  # users first, so each is unused when erased
        graph.erase_node(node)
    graph.output(graph.graph_copy(new.graph, {}))
    for name, value in new.named_children():
        if not hasattr(gm, name):
            gm.add_submodule(name, value)
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_attr(gm, node.target):
            _set_attr(gm, node.target, _get_attr(new, node.target))
    graph.lint()
    gm.recompile()


def _get_attr(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _has_attr(obj: Any, target: str) -> bool:
    try:
        _get_attr(obj, target)
    except AttributeError:
        return False
    return True


def _set_attr(gm: fx.GraphModule, target: str, value: Any) -> None:
    *path, last = target.split(".")
    owner: Any = gm
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, last, value)


# -- PyTorch's own pre-grad fusions, for side-by-side comparisons ----------------------------


def inductor_fusion_options() -> dict[str, dict[str, Any]]:
    """Every pre-grad batch and split/cat fusion Inductor has, enabled (all are off by default).

    Usable as ``torch._inductor.config.pre_grad_fusion_options``. Names come from Inductor's
    own registries, so the set follows the installed torch.
    """
    from torch._inductor.fx_passes.group_batch_fusion import PRE_GRAD_FUSIONS
    from torch._inductor.fx_passes.split_cat import PRE_GRAD_PATTERNS

    names = set(PRE_GRAD_FUSIONS) | set(PRE_GRAD_PATTERNS)
    return {name: {} for name in sorted(names)}


def run_inductor_fusions(
    gm: fx.GraphModule, options: dict[str, dict[str, Any]] | None = None
) -> float:
    """Run Inductor's pre-grad fusions on ``gm`` in place, as ``pre_grad_passes`` orders them.

    Only the fusion passes, without the rest of Inductor's pre-grad pipeline, so their time
    compares with fxrec's. Returns the seconds spent. ``options`` defaults to every fusion.
    """
    from torch._inductor import config
    from torch._inductor.fx_passes.group_batch_fusion import (
        PRE_GRAD_FUSIONS,
        group_batch_fusion_passes,
    )
    from torch._inductor.fx_passes.pre_grad import lazy_init
    from torch._inductor.fx_passes.split_cat import PRE_GRAD_PATTERNS
    from torch._inductor.pattern_matcher import stable_topological_sort

    opts = inductor_fusion_options() if options is None else options
    lazy_init()
    with config.patch(pre_grad_fusion_options=opts, pattern_matcher=True):
        t0 = time.perf_counter()
        if "normalization_pass" in opts:
            PRE_GRAD_PATTERNS["normalization_pass"].apply(gm.graph)
        group_batch_fusion_passes(gm.graph, pre_grad=True)
        for name, o in opts.items():
            if name in PRE_GRAD_FUSIONS or name == "normalization_pass":
                continue
            for _ in range(o.get("counter", 1)):
                PRE_GRAD_PATTERNS[name].apply(gm.graph)
        stable_topological_sort(gm.graph)  # as pre_grad_passes does: fusions leave it unsorted
        seconds = time.perf_counter() - t0
    gm.graph.lint()
    gm.recompile()
    return seconds
