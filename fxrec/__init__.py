"""fxrec: graph transformations that make PyTorch recommendation models faster.

Same outputs, same gradients, same ``state_dict``: fxrec rewrites the graph, never the
model's code or parameters. Public names are loaded lazily so ``import fxrec`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # graph optimizer
    "optimize": "fxrec.graph.module",
    "OptimizedModule": "fxrec.graph.module",
    "param_groups": "fxrec.graph.param_groups",
    "optim_state_dict": "fxrec.graph.optim_state",
    "load_optim_state_dict": "fxrec.graph.optim_state",
    "export": "fxrec.graph.exporting",
    "Report": "fxrec.graph.report",
    "count_kernels": "fxrec.measure",
    "KernelCount": "fxrec.measure",
    "compile_backend": "fxrec.compile.backend",
    "inductor_pass": "fxrec.compile.inductor",
    "combine_inputs": "fxrec.passes.combine_inputs",
    # sparse types
    "JaggedTensor": "fxrec.sparse",
    "KeyedJaggedTensor": "fxrec.sparse",
    "KeyedTensor": "fxrec.sparse",
    # modules
    "EmbeddingBagConfig": "fxrec.nn",
    "EmbeddingBagCollection": "fxrec.nn",
}

# Subpackages, reachable as attributes once ``import fxrec`` ran (``fxrec.distributed.shard``).
_SUBPACKAGES = ("bench", "compile", "distributed", "graph", "nn", "passes", "sparse", "train")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"fxrec.{name}")  # (sets the attribute itself)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fxrec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
