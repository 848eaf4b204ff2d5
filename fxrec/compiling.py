"""Is *this thread* compiling or exporting?

``torch.compiler.is_compiling()`` reads one flag for the whole process: while one thread runs
``torch.compile`` (or ``torch.export``), code another thread runs eagerly reads True too, and
takes the path meant for tracing (a lookup recursing into its own op, id checks skipped).
fxrec's code asks :func:`is_compiling` instead: dynamo folds its first test; outside dynamo
the flag counts only where this thread holds a tracing context (AOTAutograd, ``make_fx``,
non-strict export all set one).
"""

from __future__ import annotations

import torch
from torch._guards import TracingContext

__all__ = ["is_compiling"]


def is_compiling() -> bool:
    """``torch.compiler.is_compiling()``, for the calling thread only."""
    if torch.compiler.is_dynamo_compiling():  # folded by dynamo: the rest is never traced
        return True
    return torch.compiler.is_compiling() and TracingContext.try_get() is not None
