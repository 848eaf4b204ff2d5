"""``EmbeddingBagConfig``: one embedding table and the features that read it.

Field names follow ``torchrec.modules.embedding_configs.EmbeddingBagConfig`` so configs move
between the two libraries (``from_torchrec``/``to_torchrec``), but values are checked when
the config is built: a bad table is reported where it is written, not at the first batch.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["POOLINGS", "EmbeddingBagConfig"]

POOLINGS = ("sum", "mean", "max")


def _pooling_name(pooling: Any) -> str:
    """``"sum"``/``"mean"``/``"max"`` from a string or an enum such as TorchRec's PoolingType."""
    raw = getattr(pooling, "value", pooling)
    if not isinstance(raw, str) or raw.lower() not in POOLINGS:
        raise ValueError(
            f"pooling must be one of {POOLINGS} (or TorchRec's PoolingType.SUM/MEAN), "
            f"got {pooling!r}."
        )
    return raw.lower()


@dataclass
class EmbeddingBagConfig:
    """One table: ``num_embeddings`` rows of ``embedding_dim`` floats, pooled per bag.

    Args:
        name: table name; the table's weight appears as ``embedding_bags.<name>.weight`` in
            the collection's ``state_dict``, so it must be a valid module name (no ``.``).
        num_embeddings: rows of the table (ids must lie in ``[0, num_embeddings)``).
        embedding_dim: columns of the table (width of each pooled output).
        feature_names: features that read this table, in output order. Several features may
            share one table; a feature read by several tables appears once per table, as
            ``feature@table`` (TorchRec's naming). Empty means one feature named like the table.
        pooling: ``"sum"``, ``"mean"`` or ``"max"`` (TorchRec's ``PoolingType`` is accepted).
        weight_init_min / weight_init_max: uniform initialisation bounds; default
            ``+-sqrt(1 / num_embeddings)``, as in TorchRec.
        init_fn: optional in-place initialiser called on the table's weight instead.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: Sequence[str] = field(default_factory=list)
    pooling: str = "sum"
    weight_init_min: float | None = None
    weight_init_max: float | None = None
    init_fn: Callable[[torch.Tensor], Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(
                f"table name must be a non-empty str without '.', got {self.name!r} (it becomes "
                f"the state_dict key embedding_bags.<name>.weight)."
            )
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {v!r}.")
        if isinstance(self.feature_names, str):
            raise ValueError(
                f"table {self.name!r}: feature_names must be a list of str, got the str "
                f"{self.feature_names!r}; write [{self.feature_names!r}]."
            )
        names = list(self.feature_names) or [self.name]
        for f in names:
            if not isinstance(f, str) or not f:
                raise ValueError(
                    f"table {self.name!r}: feature names must be non-empty str, got {f!r}."
                )
        dup = sorted({f for f in names if names.count(f) > 1})
        if dup:
            raise ValueError(
                f"table {self.name!r} lists features {dup} twice; list each feature once."
            )
        self.feature_names = names
        self.pooling = _pooling_name(self.pooling)
        lo, hi = self.get_weight_init_min(), self.get_weight_init_max()
        for bound in (lo, hi):
            if not math.isfinite(bound):
                raise ValueError(f"table {self.name!r}: init bounds must be finite, got {bound}.")
        if lo > hi:
            raise ValueError(
                f"table {self.name!r}: weight_init_min ({lo}) is larger than weight_init_max "
                f"({hi})."
            )
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"table {self.name!r}: init_fn must be callable.")

    def get_weight_init_max(self) -> float:
        if self.weight_init_max is None:
            return math.sqrt(1.0 / self.num_embeddings)
        return float(self.weight_init_max)

    def get_weight_init_min(self) -> float:
        if self.weight_init_min is None:
            return -math.sqrt(1.0 / self.num_embeddings)
        return float(self.weight_init_min)

    def num_features(self) -> int:
        return len(self.feature_names)

    @torch.no_grad()
    def init_weight(self, weight: torch.Tensor) -> None:
        """Initialise this table's ``weight`` (a view into the grouped parameter) in place."""
        if weight.is_meta:
            return
        if self.init_fn is not None:
            self.init_fn(weight)
        else:
            weight.uniform_(self.get_weight_init_min(), self.get_weight_init_max())

    # ---- TorchRec interop ---------------------------------------------------------------
    @staticmethod
    def from_torchrec(config: Any) -> EmbeddingBagConfig:
        """The same table from a ``torchrec.EmbeddingBagConfig`` (FP32 tables only).

        Its ``init_fn`` comes along (TorchRec's default, uniform within the bounds, becomes
        ``None``, which initialises the same way). Fields fxrec's collection has no use for
        raise when set to a value that changes the table (``use_virtual_table``...), and are
        dropped with a warning when only TorchRec's sharded or inference modules read them
        (``need_pos``, ``num_embeddings_post_pruning``).
        """
        dtype = getattr(getattr(config, "data_type", None), "name", "FP32")
        if dtype != "FP32":
            raise ValueError(
                f"table {config.name!r}: only FP32 tables are supported, got data_type {dtype}."
            )
        _refuse_unsupported(config)
        return EmbeddingBagConfig(
            name=config.name,
            num_embeddings=int(config.num_embeddings),
            embedding_dim=int(config.embedding_dim),
            feature_names=list(config.feature_names),
            pooling=config.pooling,
            weight_init_min=config.weight_init_min,
            weight_init_max=config.weight_init_max,
            init_fn=_custom_init_fn(config),
        )

    def to_torchrec(self) -> Any:
        """The matching ``torchrec.EmbeddingBagConfig`` (TorchRec has no max pooling)."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig as TRConfig
        from torchrec.modules.embedding_configs import PoolingType

        if self.pooling == "max":
            raise ValueError(f"table {self.name!r}: TorchRec's collection has no max pooling.")
        return TRConfig(
            name=self.name,
            num_embeddings=self.num_embeddings,
            embedding_dim=self.embedding_dim,
            feature_names=list(self.feature_names),
            pooling=PoolingType[self.pooling.upper()],
            weight_init_min=self.weight_init_min,
            weight_init_max=self.weight_init_max,
            init_fn=self.init_fn,  # None: TorchRec's uniform within the same bounds
        )


# TorchRec fields with no counterpart here, and their defaults. Those that change the table
# itself (a virtual id space, ids bucketed for zero-collision hashing, tables updated by
# writes) raise; those read only by TorchRec's sharded or inference modules (a position-
# weighted table under row-wise sharding, a table pruned for inference, stashed weights)
# leave the trained table as it is, and are dropped with a warning.
_CHANGES_TABLE: dict[str, Any] = {
    "input_dim": None,
    "total_num_buckets": None,
    "use_virtual_table": False,
    "virtual_table_eviction_policy": None,
    "enable_embedding_update": False,
}
_SHARDED_OR_INFERENCE_ONLY: dict[str, Any] = {
    "num_embeddings_post_pruning": None,
    "need_pos": False,
    "stash_weights": False,
}


def _refuse_unsupported(config: Any) -> None:
    """Raise for a TorchRec field fxrec's collection cannot honour; warn for one it drops."""
    for attr, default in {**_CHANGES_TABLE, **_SHARDED_OR_INFERENCE_ONLY}.items():
        value = getattr(config, attr, default)
        if value == default:
            continue
        if attr in _CHANGES_TABLE:
            raise ValueError(
                f"table {config.name!r}: TorchRec's {attr}={value!r} has no counterpart in "
                f"fxrec's EmbeddingBagCollection; leave it at {default!r} to use this table "
                "here, or keep TorchRec's collection for it."
            )
        logger.warning(
            "table %r: TorchRec's %s=%r is not carried over (only TorchRec's sharded or "
            "inference modules read it; fxrec's collection trains the full table).",
            config.name,
            attr,
            value,
        )


def _custom_init_fn(config: Any) -> Callable[[torch.Tensor], Any] | None:
    """``config.init_fn``, or None where it is TorchRec's default (uniform in the bounds)."""
    fn = getattr(config, "init_fn", None)
    if (
        isinstance(fn, functools.partial)
        and fn.func is torch.nn.init.uniform_
        and not fn.args
        and fn.keywords == {"a": config.get_weight_init_min(), "b": config.get_weight_init_max()}
    ):
        return None
    return fn
