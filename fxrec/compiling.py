"""Is *this thread* compiling or exporting?

``torch.compiler.is_compiling()`` and ``is_exporting()`` read one flag each for the whole
process: while one thread runs ``torch.compile`` (or ``torch.export``), code another thread
runs eagerly reads True too, and takes the path meant for tracing (a lookup recursing into its
own op, id checks skipped, an optimized module refusing to run as if it were exported).
fxrec's code asks :func:`is_compiling` and :func:`is_exporting` instead: dynamo folds their
dynamo test; outside dynamo a flag counts only where this thread holds a tracing context
(AOTAutograd, ``make_fx``, non-strict export all set one).
"""

from __future__ import annotations

import torch
from torch._guards import TracingContext

__all__ = ["is_compiling", "is_exporting"]


def is_compiling() -> bool:
    """``torch.compiler.is_compiling()``, for the calling thread only."""
    if torch.compiler.is_dynamo_compiling():  # folded by dynamo: the rest is never traced
        return True
    return torch.compiler.is_compiling() and TracingContext.try_get() is not None


def is_exporting() -> bool:
    """``torch.compiler.is_exporting()``, for the calling thread only."""
    if not torch.compiler.is_exporting():
        return False
    return torch.compiler.is_dynamo_compiling() or TracingContext.try_get() is not None
