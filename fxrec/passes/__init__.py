"""The built-in atomic rules, one family per module. Importing registers them."""

from __future__ import annotations

from fxrec.passes import dedup, embedding, linear, norms, overlap, pointwise, split_cat

__all__ = ["dedup", "embedding", "linear", "norms", "overlap", "pointwise", "split_cat"]
