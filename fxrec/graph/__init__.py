"""Graph capture, the atomic-rule framework, the two-step search and ``fxrec.optimize``."""

from __future__ import annotations

from fxrec.graph.module import OptimizedModule, optimize
from fxrec.graph.report import Report
from fxrec.graph.rule import (
    HorizontalRule,
    LocalRule,
    RewriteContext,
    Rule,
    register,
    registered_rules,
)

__all__ = [
    "HorizontalRule",
    "LocalRule",
    "OptimizedModule",
    "Report",
    "RewriteContext",
    "Rule",
    "optimize",
    "register",
    "registered_rules",
]
