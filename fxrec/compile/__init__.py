"""fxrec inside ``torch.compile``: a backend and an Inductor pre-grad pass."""

from __future__ import annotations

from fxrec.compile.backend import compile_backend, fill_example_values
from fxrec.compile.inductor import (
    FxrecInductorPass,
    inductor_fusion_options,
    inductor_pass,
    run_inductor_fusions,
)

__all__ = [
    "FxrecInductorPass",
    "compile_backend",
    "fill_example_values",
    "inductor_fusion_options",
    "inductor_pass",
    "run_inductor_fusions",
]
