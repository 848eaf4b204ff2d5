"""Recognising the pieces of one tensor: split, chunk, unbind and their getitems.

Horizontal rules are cheapest when their members read consecutive pieces of one tensor:
then the fused op reads that tensor directly (no cat, no copy) and its result is split again
into views. These helpers answer "is this node a piece of some base tensor, which one, and do
these pieces form one contiguous range?".
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxrec.graph import meta

__all__ = [
    "Piece",
    "piece_of",
    "Column",
    "column_of",
    "columns_of",
    "contiguous_range",
    "piece_runs",
    "SPLIT_FUNCTIONS",
    "CHUNK_FUNCTIONS",
    "UNBIND_FUNCTIONS",
    "SPLIT_LIKE",
]

SPLIT_FUNCTIONS = {torch.split, torch.functional.split, torch.Tensor.split}
CHUNK_FUNCTIONS = {torch.chunk, torch.Tensor.chunk}
UNBIND_FUNCTIONS = {torch.unbind, torch.Tensor.unbind}
# Every node :func:`split_sizes` can read, as a rule's ``candidates``.
SPLIT_LIKE = {
    "call_function": SPLIT_FUNCTIONS | CHUNK_FUNCTIONS | UNBIND_FUNCTIONS,
    "call_method": {"split", "chunk", "unbind"},
}


@dataclass(frozen=True)
class Piece:
    """``node`` equals ``base.narrow(dim, start, length)`` (``squeezed``: ``select`` instead)."""

    node: fx.Node
    base: fx.Node
    dim: int
    start: int
    length: int
    index: int
    source: fx.Node  # the split/chunk/unbind node
    squeezed: bool = False


def _arg(node: fx.Node, pos: int, name: str, default: object = None) -> object:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


@dataclass(frozen=True)
class _SplitLayout:
    """A split node's pieces, with each piece's start precomputed."""

    base: fx.Node
    dim: int
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    squeezed: bool


# A split of N pieces has N getitem users: reading its layout once instead of once per piece
# keeps ``piece_of`` O(1) rather than O(N). The layout is kept on the split node itself, as
# (args, kwargs, target, base metadata, layout) at the time it was read, so it lives and dies
# with its graph.
_LAYOUT_ATTR = "_fxrec_split_layout"


def _base_info(node: fx.Node) -> Any:
    """The metadata object a split's layout was derived from (identity marks a change)."""
    base = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("tensor"))
    return meta.info(base) if isinstance(base, fx.Node) else None


def _layout(node: fx.Node) -> _SplitLayout | None:
    """:func:`split_sizes` as a cached :class:`_SplitLayout`; recomputed when the node changes."""
    args, kwargs, target = node.args, node.kwargs, node.target
    cached = node.__dict__.get(_LAYOUT_ATTR)
    info = _base_info(node)
    if (
        cached is not None
        and cached[0] is args
        and cached[1] is kwargs
        and cached[2] is target
        and cached[3] is info
    ):
        return cached[4]
    s = _split_sizes(node)
    layout = None
    if s is not None:
        base, dim, sizes, squeezed = s
        starts, pos = [], 0
        for n in sizes:
            starts.append(pos)
            pos += n
        layout = _SplitLayout(base, dim, tuple(sizes), tuple(starts), squeezed)
    # Set in the instance dict directly: Node.__setattr__ re-indexes the node on every set.
    node.__dict__[_LAYOUT_ATTR] = (args, kwargs, target, info, layout)
    return layout


def split_sizes(node: fx.Node) -> tuple[fx.Node, int, list[int], bool] | None:
    """(base, dim, piece sizes, squeezed) for a split/chunk/unbind node with static sizes."""
    if not _is_split(node):
        return None
    lay = _layout(node)
    if lay is None:
        return None
    return lay.base, lay.dim, list(lay.sizes), lay.squeezed


def _is_split(node: fx.Node) -> bool:
    """Cheap test that ``node`` is some spelling of split, chunk or unbind."""
    if node.op == "call_function":
        t = node.target
        return t in SPLIT_FUNCTIONS or t in CHUNK_FUNCTIONS or t in UNBIND_FUNCTIONS
    return node.op == "call_method" and node.target in ("split", "chunk", "unbind")


def _split_sizes(node: fx.Node) -> tuple[fx.Node, int, list[int], bool] | None:
    """:func:`split_sizes`, computed from scratch."""
    kind = None
    if node.op == "call_function":
        if node.target in SPLIT_FUNCTIONS:
            kind = "split"
        elif node.target in CHUNK_FUNCTIONS:
            kind = "chunk"
        elif node.target in UNBIND_FUNCTIONS:
            kind = "unbind"
    elif node.op == "call_method" and node.target in ("split", "chunk", "unbind"):
        kind = node.target
    if kind is None:
        return None
    base = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("tensor"))
    if not isinstance(base, fx.Node):
        return None
    ti = meta.info(base)
    if not isinstance(ti, meta.TensorInfo):
        return None
    if kind == "unbind":
        dim = _arg(node, 1, "dim", 0)
    else:
        dim = _arg(node, 2, "dim", 0)
    if not isinstance(dim, int):
        return None
    dim = dim % ti.ndim if ti.ndim else 0
    total = ti.shape[dim] if ti.ndim else None
    if not isinstance(total, int):
        return None
    if kind == "unbind":
        return base, dim, [1] * total, True
    size_arg = _arg(node, 1, "split_size_or_sections" if kind == "split" else "chunks")
    if kind == "split" and size_arg is None:
        size_arg = node.kwargs.get("split_size")
    if kind == "chunk":
        if not isinstance(size_arg, int) or size_arg <= 0:
            return None
        step = -(-total // size_arg)
        sizes = [min(step, total - i) for i in range(0, total, step)] if total else [0]
        return base, dim, sizes, False
    if isinstance(size_arg, int):
        if size_arg <= 0:
            return None
        sizes = [min(size_arg, total - i) for i in range(0, total, size_arg)] if total else [0]
        return base, dim, sizes, False
    if isinstance(size_arg, (list, tuple)) and all(isinstance(s, int) for s in size_arg):
        if sum(size_arg) != total:
            return None
        return base, dim, list(size_arg), False
    return None


def piece_of(node: fx.Node) -> Piece | None:
    """The :class:`Piece` a ``getitem(split(...), i)`` node denotes, or None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, idx = node.args
    if not isinstance(src, fx.Node) or not isinstance(idx, int) or not _is_split(src):
        return None
    lay = _layout(src)
    if lay is None:
        return None
    n = len(lay.sizes)
    if not -n <= idx < n:
        return None
    idx %= n
    return Piece(node, lay.base, lay.dim, lay.starts[idx], lay.sizes[idx], idx, src, lay.squeezed)


def contiguous_range(
    nodes: Sequence[fx.Node],
) -> tuple[fx.Node, int, int, int, list[int], bool] | None:
    """If ``nodes`` are consecutive pieces of one base, in order: (base, dim, start, total, sizes, squeezed)."""
    pieces = [piece_of(n) for n in nodes]
    if not pieces or any(p is None for p in pieces):
        return None
    first = pieces[0]
    assert first is not None
    pos = first.start
    for p in pieces:
        assert p is not None
        if (
            p.base is not first.base
            or p.dim != first.dim
            or p.start != pos
            or p.squeezed != first.squeezed
        ):
            return None
        pos += p.length
    sizes = [p.length for p in pieces]  # type: ignore[union-attr]
    return first.base, first.dim, first.start, pos - first.start, sizes, first.squeezed


def piece_runs(nodes: Sequence[fx.Node]) -> list[list[int]]:
    """Positions of ``nodes`` in maximal runs of consecutive pieces of one base, each run in
    the order of its pieces; a node that is no piece is a run of its own.

    Members cut from a few tensors (each of N LayerNorms fused per dim) can be fused run by
    run, each as a view of its tensor, instead of copied together with a ``cat``.
    """
    runs: list[list[int]] = []
    by_base: dict[tuple[fx.Node, int, bool], list[tuple[int, Piece]]] = {}
    for i, n in enumerate(nodes):
        p = piece_of(n)
        if p is None:
            runs.append([i])
        else:
            by_base.setdefault((p.base, p.dim, p.squeezed), []).append((i, p))
    for members in by_base.values():
        members.sort(key=lambda ip: ip[1].start)
        end = None
        for i, p in members:
            if p.start != end:
                runs.append([])
            runs[-1].append(i)
            end = p.start + p.length
    return sorted(runs, key=lambda run: run[0])


# -- columns: ``x[:, i]``, ``x.select(d, i)`` and unbind pieces ----------------------------


@dataclass(frozen=True)
class Column:
    """A node equal to ``base.select(dim, index)`` (``ids[:, i]``, ``unbind(ids, 1)[i]``)."""

    base: fx.Node
    dim: int
    index: int


FULL = slice(None, None, None)  # ``x[:, i]``'s full slices


def column_of(node: fx.Node) -> Column | None:
    """``node`` as a :class:`Column` of a tensor of static size along the selected dim."""
    p = piece_of(node)
    if p is not None:
        return Column(p.base, p.dim, p.start) if p.squeezed else None
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        base, idx = node.args
        found = _selected_dim(idx if isinstance(idx, tuple) else (idx,))
    elif (node.op, node.target) in (("call_method", "select"), ("call_function", torch.select)):
        base = _arg(node, 0, "input")
        dim, index = _arg(node, 1, "dim"), _arg(node, 2, "index")
        found = (dim, index) if isinstance(dim, int) and isinstance(index, int) else None
    else:
        return None
    bi = meta.info(base) if isinstance(base, fx.Node) else None
    if found is None or not isinstance(bi, meta.TensorInfo) or not bi.ndim:
        return None
    dim, index = found
    if not -bi.ndim <= dim < bi.ndim:
        return None
    dim %= bi.ndim
    size = bi.shape[dim]
    if not isinstance(size, int) or not -size <= index < size:
        return None
    return Column(base, dim, index % size)  # type: ignore[arg-type]


def _selected_dim(idx: tuple) -> tuple[int, int] | None:
    """(dim, index) of an index tuple that selects one int after full slices, else None."""
    ints = [k for k, i in enumerate(idx) if type(i) is int]
    if len(ints) != 1 or any(i != FULL for k, i in enumerate(idx) if k != ints[0]):
        return None
    return ints[0], idx[ints[0]]


def columns_of(xs: Sequence[Any]) -> list[Column] | None:
    """Each of ``xs`` as a column of one tensor along one dim, else None."""
    cols = [column_of(x) if isinstance(x, fx.Node) else None for x in xs]
    first = cols[0]
    if first is None or any(
        c is None or c.base is not first.base or c.dim != first.dim for c in cols
    ):
        return None
    return cols  # type: ignore[return-value]
