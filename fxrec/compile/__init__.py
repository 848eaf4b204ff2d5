"""fxrec inside ``torch.compile``: a backend and an Inductor pre-grad pass."""

from __future__ import annotations

from fxrec.compile.backend import compile_backend

__all__ = ["compile_backend"]
