"""The built-in atomic rules, one family per module. Importing registers them."""

from __future__ import annotations

from fxrec.passes import dedup, embedding, linear, norms, overlap, pointwise, split_cat

# The order the default rule set runs the families in, whatever order they are imported in.
# Rules chain to a fixed point, but which of two overlapping fusions comes first shapes the
# result: Linear and norm rules before pointwise ones fuse towers layer by layer (one
# activation on the fused layer) rather than first gathering the activations across towers.
FAMILY_ORDER = ("dedup", "embedding", "linear", "norms", "overlap", "pointwise", "split_cat")

__all__ = [
    "FAMILY_ORDER",
    "dedup",
    "embedding",
    "linear",
    "norms",
    "overlap",
    "pointwise",
    "split_cat",
]
