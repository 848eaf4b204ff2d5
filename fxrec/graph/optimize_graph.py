"""Optimize one captured graph: the part every entry point shares.

``fxrec.optimize`` (symbolic traces), ``fxrec.compile_backend`` (dynamo graphs) and the
Inductor pre-grad pass all end up here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence

import torch.fx as fx

from fxrec.graph.driver import run_rules
from fxrec.graph.params import FusedParameters, ParamStore
from fxrec.graph.report import Report
from fxrec.graph.rule import RewriteContext, Rule, registered_rules

logger = logging.getLogger(__name__)

__all__ = ["resolve_rules", "optimize_graph", "strict_mode"]

RuleSpec = Iterable["str | Rule | type[Rule]"] | None


def strict_mode() -> bool:
    """In strict mode (``FXREC_STRICT=1``, used by the tests) a failing rule raises."""
    return os.environ.get("FXREC_STRICT", "0") not in ("", "0")


def resolve_rules(rules: RuleSpec = None, exclude: Iterable[str] = ()) -> list[Rule]:
    """Rule instances from names, classes or instances (default: every registered rule)."""
    registry = registered_rules()
    if rules is None:
        chosen: list[str | Rule | type[Rule]] = [
            r for r in registry.values() if not getattr(r, "opt_in", False)
        ]
    else:
        chosen = list(rules)
    out: list[Rule] = []
    for r in chosen:
        if isinstance(r, str):
            if r not in registry:
                raise ValueError(f"unknown rule {r!r}; known rules: {', '.join(sorted(registry))}")
            r = registry[r]
        inst = r() if isinstance(r, type) else r
        if inst.name not in exclude:
            out.append(inst)
    return out


def optimize_graph(
    gm: fx.GraphModule,
    rules: Sequence[Rule],
    *,
    owner: FusedParameters | None = None,
    report: Report | None = None,
    device_type: str = "cpu",
) -> Report:
    """Run ``rules`` on ``gm`` in place to a fixed point; return the report.

    On an unexpected error the graph is left as it was captured (unless strict mode is on),
    and the report says what failed: optimizing never crashes a model it does not understand.
    """
    report = report if report is not None else Report()
    t0 = time.perf_counter()
    before = len(gm.graph.nodes)
    backup = fx.Graph()
    out_map = backup.graph_copy(gm.graph, {})
    backup.output(out_map)
    params = ParamStore(gm, owner)
    ctx = RewriteContext(gm, report, params, device_type)
    try:
        run_rules(ctx, rules)
        params.rebind()
        gm.graph.lint()
        gm.recompile()
    except Exception as exc:
        if strict_mode():
            raise
        logger.warning(
            "fxrec: a rule failed (%s: %s); keeping this graph unoptimized", type(exc).__name__, exc
        )
        report.notes.append(f"graph left unoptimized: {type(exc).__name__}: {exc}")
        gm.graph = backup
        params.rebind()
        gm.recompile()
    report.nodes_before += before
    report.nodes_after += len(gm.graph.nodes)
    report.seconds += time.perf_counter() - t0
    return report
