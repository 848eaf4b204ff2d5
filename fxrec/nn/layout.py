"""How a collection's tables are grouped and where each lookup's output goes.

A *member* is one (table, feature) lookup: one output key and ``embedding_dim`` output
columns, in table order then feature order (TorchRec's output layout). A *group* is a set of
tables with the same dim and pooling whose rows live in one weight, looked up by one call.

Grouping is greedy in table order, and a group's weight is capped (``max_group_bytes``):
with dense gradients every step allocates a fresh gradient as large as the group's weight,
and on glibc an allocation of 32 MiB or more is a fresh ``mmap`` whose pages all fault in
again (measured here: zero-filling 32 MiB costs ~1.3 ms/MiB against ~0.02 ms/MiB at 24 MiB;
26 tables x 100,000 rows x dim 16 in ONE group trained at 0.6-0.9x TorchRec's speed). Below
the cap the allocator reuses freed memory, so a grouped gradient costs no more per byte than
per-table ones. Sparse gradients and caching device allocators do not pay that price, so the
cap is off there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxrec.nn.config import EmbeddingBagConfig

__all__ = ["DEFAULT_MAX_GROUP_BYTES", "Group", "Layout", "Member", "plan_layout"]

# Half of glibc's largest mmap threshold (32 MiB on 64-bit), to leave room for alignment
# and allocator bookkeeping.
DEFAULT_MAX_GROUP_BYTES = 16 << 20


@dataclass(frozen=True)
class Member:
    """One (table, feature) lookup."""

    key: str  # output key: the feature, or ``feature@table`` when several tables read it
    feature: str
    table: int  # index into the collection's tables
    table_name: str
    group: int
    row_offset: int  # first row of the table in its group's weight
    num_embeddings: int
    dim: int


@dataclass(frozen=True)
class Group:
    """Tables sharing one weight ``[num_rows, dim]`` and one lookup call."""

    dim: int
    pooling: str
    tables: tuple[int, ...]
    table_row_offsets: tuple[int, ...]
    num_rows: int
    members: tuple[int, ...]  # indices into Layout.members, in output order


@dataclass(frozen=True)
class Layout:
    members: tuple[Member, ...]
    groups: tuple[Group, ...]
    features: tuple[str, ...]  # distinct input features read, first use first

    def keys(self) -> list[str]:
        return [m.key for m in self.members]

    def dims(self) -> list[int]:
        return [m.dim for m in self.members]

    def group_major(self) -> list[int]:
        """Member indices, group by group (the order ids are laid out in for lookup)."""
        return [i for g in self.groups for i in g.members]


def plan_layout(
    tables: Sequence[EmbeddingBagConfig],
    max_group_bytes: int | None,
    element_size: int = 4,
) -> Layout:
    """Group ``tables`` (same dim and pooling, greedily, under ``max_group_bytes``)."""
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"table names must be unique; {dup} appear twice.")
    if max_group_bytes is not None and max_group_bytes <= 0:
        raise ValueError(f"max_group_bytes must be positive or None, got {max_group_bytes}.")
    readers: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            readers[f] = readers.get(f, 0) + 1

    # Greedy: each (dim, pooling) has one open group; a table that would push it over the
    # cap closes it and opens a new one.
    open_group: dict[tuple[int, str], int] = {}
    group_tables: list[list[int]] = []
    group_rows: list[int] = []
    group_key: list[tuple[int, str]] = []
    table_group: list[int] = []
    table_offset: list[int] = []
    for ti, t in enumerate(tables):
        key = (t.embedding_dim, t.pooling)
        gi = open_group.get(key)
        if gi is not None and max_group_bytes is not None:
            new_bytes = (group_rows[gi] + t.num_embeddings) * t.embedding_dim * element_size
            if new_bytes > max_group_bytes:
                gi = None
        if gi is None:
            gi = len(group_tables)
            open_group[key] = gi
            group_tables.append([])
            group_rows.append(0)
            group_key.append(key)
        table_group.append(gi)
        table_offset.append(group_rows[gi])
        group_tables[gi].append(ti)
        group_rows[gi] += t.num_embeddings

    members: list[Member] = []
    group_members: list[list[int]] = [[] for _ in group_tables]
    features: list[str] = []
    for ti, t in enumerate(tables):
        for f in t.feature_names:
            key = f if readers[f] == 1 else f"{f}@{t.name}"
            group_members[table_group[ti]].append(len(members))
            members.append(
                Member(
                    key,
                    f,
                    ti,
                    t.name,
                    table_group[ti],
                    table_offset[ti],
                    t.num_embeddings,
                    t.embedding_dim,
                )
            )
            if f not in features:
                features.append(f)
    groups = tuple(
        Group(
            dim=group_key[gi][0],
            pooling=group_key[gi][1],
            tables=tuple(group_tables[gi]),
            table_row_offsets=tuple(table_offset[ti] for ti in group_tables[gi]),
            num_rows=group_rows[gi],
            members=tuple(group_members[gi]),
        )
        for gi in range(len(group_tables))
    )
    return Layout(tuple(members), groups, tuple(features))
