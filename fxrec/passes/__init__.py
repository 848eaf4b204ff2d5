"""The built-in atomic rules, one family per module. Importing registers them."""

from __future__ import annotations

from fxrec.passes import pointwise

__all__ = ["pointwise"]
