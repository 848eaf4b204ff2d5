"""Table-wise sharding plans: which rank owns each embedding table.

The greedy plan places tables, largest first (by ``rows * dim``, the bytes a table costs in
memory and optimizer state), on the rank that owns the fewest so far. Ties go to the lower
rank, so every rank computes the same plan without talking to the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ShardingPlan", "TableSpec", "greedy_plan"]


@dataclass(frozen=True)
class TableSpec:
    """What the planner needs to know about one table."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]

    @property
    def cost(self) -> int:
        return self.num_embeddings * self.embedding_dim


@dataclass(frozen=True)
class ShardingPlan:
    """Table name -> owning rank, for ``world_size`` ranks."""

    owners: Mapping[str, int]
    world_size: int

    def validate(self, tables: Sequence[TableSpec]) -> None:
        names = {t.name for t in tables}
        missing = sorted(names - set(self.owners))
        extra = sorted(set(self.owners) - names)
        if missing or extra:
            raise ValueError(
                f"sharding plan does not match the collection: tables without an owner "
                f"{missing}, unknown tables {extra}."
            )
        bad = {t: r for t, r in self.owners.items() if not 0 <= r < self.world_size}
        if bad:
            raise ValueError(
                f"sharding plan places tables on ranks outside 0..{self.world_size - 1}: {bad}"
            )

    def tables_of(self, rank: int, tables: Sequence[TableSpec]) -> list[TableSpec]:
        """The tables ``rank`` owns, in the collection's order."""
        return [t for t in tables if self.owners[t.name] == rank]

    def load(self, tables: Sequence[TableSpec]) -> list[int]:
        """``rows * dim`` per rank."""
        out = [0] * self.world_size
        for t in tables:
            out[self.owners[t.name]] += t.cost
        return out


def greedy_plan(tables: Sequence[TableSpec], world_size: int) -> ShardingPlan:
    """Balance ``rows * dim`` across ranks, largest table first (deterministic)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners: dict[str, int] = {}
    for t in sorted(tables, key=lambda t: (-t.cost, t.name)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owners[t.name] = r
        load[r] += t.cost
    return ShardingPlan(owners, world_size)
