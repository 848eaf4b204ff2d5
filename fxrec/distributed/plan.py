"""Sharding plans: which rank owns each embedding table, or which tables are split by rows.

Table-wise: a table lives on one rank. Row-wise (``row_wise``): a table's rows are cut into
one block per rank (:mod:`fxrec.distributed.row_wise`), for tables too large for one rank.
The greedy plan splits the row-wise tables first, then places the others, largest first (by
``rows * dim``, the bytes a table costs in memory and optimizer state), on the rank that
holds the fewest so far. Ties go to the lower rank, so every rank computes the same plan
without talking to the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ShardingPlan", "TableSpec", "greedy_plan", "row_bounds"]


def row_bounds(rows: int, world: int) -> tuple[int, ...]:
    """``world + 1`` boundaries of ``world`` row blocks whose sizes differ by at most one."""
    if rows < world:
        raise ValueError(
            f"a table of {rows} rows cannot be split row-wise over {world} ranks (one row "
            "block per rank); shard it table-wise instead."
        )
    return tuple(r * rows // world for r in range(world + 1))


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
    """Table name -> owning rank, for ``world_size`` ranks; ``row_wise`` tables are split
    by rows over every rank instead (they have no owner)."""

    owners: Mapping[str, int]
    world_size: int
    row_wise: tuple[str, ...] = ()

    def validate(self, tables: Sequence[TableSpec]) -> None:
        names = {t.name for t in tables}
        rw = set(self.row_wise)
        twice = sorted({n for n in self.row_wise if self.row_wise.count(n) > 1})
        if twice:
            raise ValueError(f"sharding plan lists tables {twice} in row_wise more than once.")
        both = sorted(rw & set(self.owners))
        if both:
            raise ValueError(
                f"sharding plan gives tables {both} an owner and splits them row-wise; choose one."
            )
        missing = sorted(names - set(self.owners) - rw)
        extra = sorted((set(self.owners) | rw) - names)
        if missing or extra:
            raise ValueError(
                f"sharding plan does not match the collection: tables without an owner "
                f"{missing}, unknown tables {extra}."
            )
        bad = {
            t: r
            for t, r in self.owners.items()
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size
        }
        if bad:
            raise ValueError(
                f"sharding plan places tables on ranks that are not integers in "
                f"0..{self.world_size - 1}: {bad}"
            )

    def tables_of(self, rank: int, tables: Sequence[TableSpec]) -> list[TableSpec]:
        """The (whole) tables ``rank`` owns, in the collection's order."""
        return [t for t in tables if self.owners.get(t.name) == rank]

    def load(self, tables: Sequence[TableSpec]) -> list[int]:
        """``rows * dim`` per rank (a row-wise table counts its block on every rank)."""
        out = [0] * self.world_size
        rw = set(self.row_wise)
        for t in tables:
            if t.name in rw:
                bounds = row_bounds(t.num_embeddings, self.world_size)
                for r in range(self.world_size):
                    out[r] += (bounds[r + 1] - bounds[r]) * t.embedding_dim
            else:
                out[self.owners[t.name]] += t.cost
        return out


def greedy_plan(
    tables: Sequence[TableSpec], world_size: int, row_wise: Sequence[str] = ()
) -> ShardingPlan:
    """Split ``row_wise`` tables by rows; balance the rest's ``rows * dim`` over the ranks,
    largest table first (deterministic)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = {t.name for t in tables}
    unknown = sorted(set(row_wise) - names)
    if unknown:
        raise ValueError(f"row_wise names tables the collection does not have: {unknown}")
    rw = tuple(t.name for t in tables if t.name in set(row_wise))  # the collection's order
    load = ShardingPlan({}, world_size, rw).load([t for t in tables if t.name in rw])
    owners: dict[str, int] = {}
    for t in sorted(tables, key=lambda t: (-t.cost, t.name)):
        if t.name in rw:
            continue
        r = min(range(world_size), key=lambda i: (load[i], i))
        owners[t.name] = r
        load[r] += t.cost
    return ShardingPlan(owners, world_size, rw)
