"""Embedding modules: ``EmbeddingBagCollection`` with grouped (table-batched) lookups.

Also the functional entry points a graph rewrite calls (:func:`grouped_embedding_bag`).
"""

from __future__ import annotations

from fxrec.nn.config import POOLINGS, EmbeddingBagConfig
from fxrec.nn.embedding_bag_collection import EmbeddingBagCollection
from fxrec.nn.functional import (
    embedding_bag_grouped,
    grouped_embedding_bag,
    offsets_from_lengths,
    shift_ids,
)
from fxrec.nn.layout import DEFAULT_MAX_GROUP_BYTES, Layout, plan_layout

__all__ = [
    "DEFAULT_MAX_GROUP_BYTES",
    "POOLINGS",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "Layout",
    "embedding_bag_grouped",
    "grouped_embedding_bag",
    "offsets_from_lengths",
    "plan_layout",
    "shift_ids",
]
