"""Split and cat cancel out: the glue around horizontally fused ops disappears.

Horizontal rules hand back their results as pieces of one tensor (``getitem(split(y), i)``);
the model then often concatenates those pieces again. These local rules remove such glue,
each one step, and never change a value:

==================  ==============================================================  =========
rule                rewrite                                                         kernels
==================  ==============================================================  =========
slices_to_split     disjoint slices ``x[:, a:b]`` / ``x.narrow(d, a, n)`` of one       0 -> 0
                    tensor -> pieces of one ``torch.split`` (so the other rules see
                    pieces of one base; unused gaps become unused pieces)
drop_single_split   a split (chunk) into one piece -> its input                      0 -> 0
merge_splits        split of a split's piece -> one split of the outer input          0 -> 0
cat_of_split        ``cat`` of a split's pieces in order -> the input (a ``narrow``    1 -> 0
                    view for a sub-range); ``stack`` of ``unbind`` pieces likewise
cat_run_of_pieces   inside a longer ``cat``, a run of in-order pieces of one        1 -> 1
                    tensor -> one view of it (one autograd input instead of k)
split_of_cat        ``split(cat([a, b, c]))`` with matching sizes -> ``a, b, c``      1 -> 0
stack_of_pieces     ``stack`` of consecutive equal pieces of one tensor -> an           1 -> 0
                    ``unflatten`` (+ ``movedim``) view of it
==================  ==============================================================  =========

``chunk`` and ``unbind`` need no normalisation: :mod:`fxrec.graph.pieces` reads every split
form. Splits along dim 0 (usually the batch) are never rewritten into literal sizes: a graph is
reused across batch sizes. A split whose pieces have other users keeps them; a cat (split)
whose result is written in place keeps its own memory (the rewrite would alias).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxrec.graph import meta
from fxrec.graph.effects import mutates_input, records_grad, view_bases, written_in_place
from fxrec.graph.pieces import SPLIT_LIKE, Piece, piece_of, split_sizes
from fxrec.graph.rule import LocalRule, RewriteContext, register

__all__ = [
    "SlicesToSplit",
    "DropSingleSplit",
    "MergeSplits",
    "CatOfSplit",
    "CatRunOfPieces",
    "SplitOfCat",
    "StackOfPieces",
    "cat_args",
    "slice_of",
]

CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}
STACK_FUNCTIONS = {torch.stack}


def cat_args(node: fx.Node) -> tuple[str, list[Any] | fx.Node, int] | None:
    """("cat"|"stack", inputs, dim) for any spelling of ``torch.cat``/``torch.stack``.

    ``inputs`` is a node when the whole tuple comes from one node (``torch.cat(torch.split(x))``
    in a symbolic trace).
    """
    if node.op != "call_function":
        return None
    if node.target in CAT_FUNCTIONS:
        kind = "cat"
    elif node.target in STACK_FUNCTIONS:
        kind = "stack"
    else:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("axis", 0))
    if not isinstance(dim, int) or node.kwargs.get("out") is not None:
        return None
    if isinstance(tensors, fx.Node):
        return kind, tensors, dim
    if not isinstance(tensors, (list, tuple)):
        return None
    return kind, list(tensors), dim


def _static_dim(node: fx.Node, dim: int) -> tuple[meta.TensorInfo, int] | None:
    ti = meta.info(node)
    if not isinstance(ti, meta.TensorInfo) or ti.ndim == 0:
        return None
    d = dim % ti.ndim
    if not isinstance(ti.shape[d], int):
        return None
    return ti, d


def _repoint(item: fx.Node, src: fx.Node, i: int) -> None:
    """Make ``item`` read piece ``i`` of ``src`` (keeping its users), with metadata."""
    item.args = (src, i)
    ti = meta.info(src)
    if isinstance(ti, (list, tuple)) and i < len(ti):
        meta.set_info(item, ti[i])


def _getitem(ctx: RewriteContext, src: fx.Node, i: int) -> fx.Node:
    item = ctx.graph.call_function(operator.getitem, (src, i))
    ti = meta.info(src)
    if isinstance(ti, (list, tuple)) and i < len(ti):
        meta.set_info(item, ti[i])
    return item


# -- slices ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slice:
    """``node`` equals ``base.narrow(dim, start, length)``."""

    node: fx.Node
    base: fx.Node
    dim: int
    start: int
    length: int


def slice_of(node: fx.Node) -> Slice | None:
    """Recognise ``x[:, a:b]`` (unit step, one sliced dim) and ``x.narrow(d, a, n)``."""
    if node.op == "call_function" and node.target is operator.getitem:
        base, idx = node.args
        if not isinstance(base, fx.Node) or not isinstance(meta.info(base), meta.TensorInfo):
            return None
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not all(isinstance(s, slice) for s in idx):
            return None
        full = slice(None, None, None)
        cut = [i for i, s in enumerate(idx) if s != full]
        if len(cut) != 1:
            return None
        d = cut[0]
        s = idx[d]
        sd = _static_dim(base, d)
        if sd is None or s.step not in (None, 1) or sd[0].ndim <= d:
            return None
        size = sd[0].shape[d]
        if not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
            return None
        start, stop, _ = s.indices(size)
        return Slice(node, base, d, start, max(0, stop - start))
    is_narrow = (node.op == "call_method" and node.target == "narrow") or (
        node.op == "call_function" and node.target in (torch.narrow, torch.Tensor.narrow)
    )
    if not is_narrow or len(node.args) != 4 or node.kwargs:
        return None
    base, d, start, length = node.args
    if not isinstance(base, fx.Node) or not all(isinstance(v, int) for v in (d, start, length)):
        return None
    sd = _static_dim(base, d)
    if sd is None:
        return None
    ti, d = sd
    if start < 0:
        start += ti.shape[d]
    if start < 0 or length < 0 or start + length > ti.shape[d]:
        return None
    return Slice(node, base, d, start, length)


def _aliasing_changes(result: fx.Node, base: Any) -> bool:
    """Would making ``result`` (a copy in the model) a view of ``base`` change what any code
    sees? It does if either is written in place (the write would reach the other), or if
    ``result`` is returned while ``base`` is the caller's own tensor (an input or a
    parameter): the caller would get that tensor itself back."""
    if written_in_place(result):
        return True
    if not isinstance(base, fx.Node):
        return False
    if _written_through(base):
        return True
    returned = any(u.op == "output" for u in result.users)
    return returned and view_bases(base)[-1].op in ("placeholder", "get_attr")


def _written_through(node: fx.Node) -> bool:
    """Is ``node``, or a tensor it is a view of (``t[:, :8]``: ``t`` too), written in place
    (directly or through any view)?"""
    return any(written_in_place(n) for n in view_bases(node))


def _recorded(node: fx.Node, pieces: list[Any]) -> bool:
    """Did autograd record ``node`` and the splits of its ``pieces``? Taken as their base (or
    a view of it made at ``node``), a chain with a step under ``no_grad`` would pass the
    gradient it cuts (views taken under ``no_grad`` still say ``requires_grad``)."""
    return records_grad(node) and all(records_grad(p.source) for p in pieces)


@register
class SlicesToSplit(LocalRule):
    """Disjoint slices of one tensor along one dim become the pieces of one split."""

    name = "slices_to_split"
    family = "split_cat"

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        if len(node.users) < 2 or not isinstance(meta.info(node), meta.TensorInfo):
            return None
        by_dim: dict[int, list[Slice]] = {}
        for user in node.users:
            s = slice_of(user)
            # a slice written in place stays a slice (a split's pieces refuse in-place writes)
            if (
                s is not None
                and s.base is node
                and s.dim != 0
                and s.length > 0
                and not written_in_place(user)
                and records_grad(user)  # a slice under no_grad passes no gradient
            ):
                by_dim.setdefault(s.dim, []).append(s)
        for dim, slices in sorted(by_dim.items()):
            spans = sorted({(s.start, s.length) for s in slices})
            if len(spans) < 2:
                continue
            if all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans)):
                # autograd refuses to read a split's piece once its base was written in
                # place (a slice is a single view: it may)
                return None if _written_through(node) else (dim, slices, spans)
        return None

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        dim, slices, spans = match
        total = meta.info(node).shape[dim]
        sizes, index, pos = [], {}, 0
        for start, length in spans:
            if start > pos:
                sizes.append(start - pos)
            index[(start, length)] = len(sizes)
            sizes.append(length)
            pos = start + length
        if pos < total:
            sizes.append(total - pos)
        order = {n: i for i, n in enumerate(ctx.graph.nodes)}
        first = min((s.node for s in slices), key=order.__getitem__)
        with ctx.graph.inserting_before(first):
            split = ctx.call(torch.split, (node, sizes, dim))
            items = {
                span: _getitem(ctx, split, i)
                for span, i in sorted(index.items(), key=lambda t: t[1])
            }
        for s in slices:
            ctx.replace(s.node, items[(s.start, s.length)])
        ctx.erase_if_dead([s.node for s in slices])
        self.fired(ctx, [s.node for s in slices], f"{len(slices)} slices -> split {sizes}")


# -- splits ------------------------------------------------------------------------------------
def _items(split: fx.Node) -> list[fx.Node] | None:
    """The getitem users of a split node, or None if it has any other kind of user."""
    out = []
    for u in split.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        if not isinstance(u.args[1], int):
            return None
        out.append(u)
    return out


@register
class DropSingleSplit(LocalRule):
    """A split or chunk into one piece is its input."""

    name = "drop_single_split"
    family = "split_cat"
    candidates = SPLIT_LIKE

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        s = split_sizes(node)
        if s is None or s[3] or len(s[2]) != 1:
            return None
        items = _items(node)
        if not items or not records_grad(node):
            return None
        return s[0], items

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        base, items = match
        for item in items:
            ctx.replace(item, base)
        ctx.erase_if_dead(items)
        self.fired(ctx, [node], "split into one piece")


@register
class MergeSplits(LocalRule):
    """``split(split(x)[i])`` along the same dim -> one split of ``x`` with finer sizes."""

    name = "merge_splits"
    family = "split_cat"
    candidates = SPLIT_LIKE

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        if _inner_split(node) is None:
            return None
        outer_piece = piece_of(node.args[0])  # type: ignore[arg-type]
        assert outer_piece is not None
        outer_items = _items(outer_piece.source)
        if outer_items is None:
            return None
        return outer_piece.source, outer_items

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        """Merge every inner split of this outer split at once: each item is re-pointed once.

        Merged one inner split at a time, a split into N pieces whose pieces are split again
        would rebuild its N items N times.
        """
        source, outer_items = match
        base, dim, outer_sizes, _ = split_sizes(source)  # type: ignore[misc]
        inner: dict[int, tuple[fx.Node, list[int], list[fx.Node]]] = {}
        for item in outer_items:
            k = item.args[1] % len(outer_sizes)
            for u in item.users:
                found = _inner_split(u)
                if found is not None and k not in inner and found[0] == dim:
                    inner[k] = (u, found[1], found[2])
        sizes: list[int] = []
        first: dict[int, int] = {}  # outer piece -> index of its first piece in ``sizes``
        for k, n in enumerate(outer_sizes):
            first[k] = len(sizes)
            sizes.extend(inner[k][1] if k in inner else [n])
        with ctx.graph.inserting_after(source):  # before every piece of either split
            split = ctx.call(torch.split, (base, sizes, dim))
        for k, (_, inner_sizes, items) in inner.items():
            for item in items:
                _repoint(item, split, first[k] + item.args[1] % len(inner_sizes))
        for item in outer_items:
            k = item.args[1] % len(outer_sizes)
            if k not in inner:
                _repoint(item, split, first[k])
        ctx.erase_if_dead([u for u, _, _ in inner.values()] + [source])
        self.fired(ctx, [source, *(u for u, _, _ in inner.values())], f"{len(inner)} inner splits")


def _inner_split(node: fx.Node) -> tuple[int, list[int], list[fx.Node]] | None:
    """(dim, sizes, items) if ``node`` splits a piece of another split along the same dim."""
    inner = split_sizes(node)
    if inner is None or inner[3]:
        return None
    outer_piece = piece_of(inner[0])
    if outer_piece is None or outer_piece.squeezed or outer_piece.dim != inner[1]:
        return None
    items = _items(node)
    if items is None or split_sizes(outer_piece.source) is None:
        return None
    if not records_grad(node):
        return None
    return inner[1], list(inner[2]), items


# -- cat / split cancellation ------------------------------------------------------------------
@register
class CatOfSplit(LocalRule):
    """A cat of a split's pieces, in order, is the split's input (or a narrow view of it).

    Also ``stack(unbind(x, d), d) -> x`` and ``cat(unbind(x, d), d) -> x.flatten(d, d + 1)``.
    """

    name = "cat_of_split"
    family = "split_cat"
    candidates = {"call_function": CAT_FUNCTIONS | STACK_FUNCTIONS}

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        c = cat_args(node)
        if c is None or not c[1]:
            return None
        kind, inputs, dim = c
        if isinstance(inputs, fx.Node):  # every piece of a split, as one tuple
            s = split_sizes(inputs)
            if s is None:
                return None
            base, sdim, sizes, squeezed = s
            pieces = [
                Piece(inputs, base, sdim, sum(sizes[:i]), n, i, inputs, squeezed)
                for i, n in enumerate(sizes)
            ]
        else:
            pieces = [piece_of(x) if isinstance(x, fx.Node) else None for x in inputs]
        if any(p is None for p in pieces):
            return None
        first = pieces[0]
        pos = first.start
        for p in pieces:
            if p.base is not first.base or p.dim != first.dim or p.squeezed != first.squeezed:
                return None
            if p.start != pos:
                return None
            pos += p.length
        bi = meta.info(first.base)
        if not isinstance(bi, meta.TensorInfo) or not isinstance(bi.shape[first.dim], int):
            return None
        whole = first.start == 0 and pos == bi.shape[first.dim]
        if first.squeezed:
            if kind == "stack":
                d = dim % bi.ndim
            else:
                d = dim % (bi.ndim - 1)
                if not whole or d + 1 >= bi.ndim:
                    return None
        else:
            if kind != "cat":
                return None
            d = dim % bi.ndim
        if d != first.dim or _aliasing_changes(node, first.base) or not _recorded(node, pieces):
            return None
        return kind, first, pos - first.start, whole

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        kind, first, total, whole = match
        base, dim = first.base, first.dim
        with ctx.graph.inserting_before(node):
            if first.squeezed and kind == "cat":
                new = ctx.call_method("flatten", (base, dim, dim + 1))
            elif whole:
                new = base
            else:
                new = ctx.call_method("narrow", (base, dim, first.start, total))
        inputs = list(node.all_input_nodes)
        ctx.replace(node, new)
        ctx.erase_if_dead([node, *inputs])
        self.fired(ctx, [node], f"{kind} of {'all' if whole else total} pieces")


@register
class CatRunOfPieces(LocalRule):
    """Inside a longer ``cat``, all pieces of one tensor in order are one view of it.

    ``cat([d, p0, p1, ..., pk], 1)`` with ``p_i`` every piece of ``t`` in order (split along
    the cat dim, or ``unbind`` along the dim before it) -> ``cat([d, view], 1)``: the cat still
    copies the same bytes, but autograd keeps one input instead of k (its backward splits the
    gradient into 2 slices, not k + 1, and the unbind's backward no longer re-stacks them).
    A cat made only of pieces is :class:`CatOfSplit`'s.
    """

    name = "cat_run_of_pieces"
    family = "split_cat"
    candidates = {"call_function": CAT_FUNCTIONS}

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        c = cat_args(node)
        if c is None or c[0] != "cat" or not isinstance(c[1], list) or len(c[1]) < 3:
            return None
        inputs, dim = c[1], c[2]
        oi = ctx.info(node)
        if oi is None or written_in_place(node):
            return None
        d = dim % oi.ndim
        runs = [
            r
            for r in _piece_runs(inputs, d)
            if r[1] - r[0] >= 2 and _whole(inputs, r) and not _cuts_grad(inputs[r[0] : r[1]])
        ]
        if not runs or (len(runs) == 1 and runs[0][1] - runs[0][0] == len(inputs)):
            return None
        return d, runs

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        d, runs = match
        inputs = list(cat_args(node)[1])  # type: ignore[index]
        new_inputs: list[Any] = []
        pos = 0
        with ctx.graph.inserting_before(node):
            for lo, hi in runs:
                new_inputs.extend(inputs[pos:lo])
                new_inputs.append(_run_view(ctx, [piece_of(x) for x in inputs[lo:hi]]))  # type: ignore[misc]
                pos = hi
            new_inputs.extend(inputs[pos:])
            new = ctx.call(torch.cat, (new_inputs, d))
        ctx.replace(node, new)
        ctx.erase_if_dead([node, *inputs])
        self.fired(ctx, [node], f"{sum(hi - lo for lo, hi in runs)} pieces -> {len(runs)} view(s)")


def _piece_runs(inputs: list[Any], d: int) -> list[tuple[int, int]]:
    """Maximal [lo, hi) runs of consecutive in-order pieces of one base that a cat on ``d`` joins."""
    runs: list[tuple[int, int]] = []
    lo, prev = 0, None
    for i, x in enumerate([*inputs, None]):
        p = piece_of(x) if isinstance(x, fx.Node) else None
        if p is not None and not _joinable(p, d):
            p = None
        follows = (
            p is not None
            and prev is not None
            and p.base is prev.base
            and p.dim == prev.dim
            and p.squeezed == prev.squeezed
            and p.start == prev.start + prev.length
        )
        if not follows:
            if prev is not None:
                runs.append((lo, i))
            lo = i
        prev = p
    return runs


def _whole(inputs: list[Any], run: tuple[int, int]) -> bool:
    """Does the run hold every piece of its base? A part of it would leave the other pieces
    reading the split while the run reads a view: backward then pays zeros for the pieces
    each side does not use, and a sum of the two."""
    first, last = piece_of(inputs[run[0]]), piece_of(inputs[run[1] - 1])
    bi = meta.info(first.base)  # type: ignore[union-attr]
    return first.start == 0 and last.start + last.length == bi.shape[first.dim]  # type: ignore[union-attr]


def _cuts_grad(run: list[Any]) -> bool:
    """Were the run's pieces taken under ``no_grad`` (a view of their base taken at the cat
    would pass the gradient they cut)?"""
    return not all(records_grad(piece_of(x).source) for x in run)  # type: ignore[union-attr]


def _joinable(p: Piece, d: int) -> bool:
    """Can a cat along ``d`` of consecutive pieces like ``p`` be written as a view of the base?"""
    bi = meta.info(p.base)
    if not isinstance(bi, meta.TensorInfo) or not isinstance(bi.shape[p.dim], int):
        return False
    if p.squeezed:  # unbind pieces along u: cat on u joins base dims u and u + 1
        return d == p.dim and p.dim + 1 < bi.ndim
    return d == p.dim


def _run_view(ctx: RewriteContext, pieces: list[Piece]) -> fx.Node:
    first, total = pieces[0], sum(p.length for p in pieces)
    base, dim = first.base, first.dim
    bi = meta.info(base)
    x = base
    if first.start != 0 or total != bi.shape[dim]:  # type: ignore[union-attr]
        x = ctx.call_method("narrow", (x, dim, first.start, total))
    if first.squeezed:
        x = ctx.call_method("flatten", (x, dim, dim + 1))
    return x


@register
class SplitOfCat(LocalRule):
    """``split(cat([a, b, c], d), sizes, d)`` with sizes of a, b, c -> a, b, c (and unbind(stack))."""

    name = "split_of_cat"
    family = "split_cat"
    candidates = SPLIT_LIKE

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        s = split_sizes(node)
        if s is None:
            return None
        base, dim, sizes, squeezed = s
        c = cat_args(base) if isinstance(base, fx.Node) else None
        if c is None:
            return None
        kind, inputs, cdim = c
        if not isinstance(inputs, list) or len(inputs) != len(sizes):
            return None
        if kind != ("stack" if squeezed else "cat"):
            return None
        if not all(isinstance(x, fx.Node) for x in inputs):
            return None
        bi = meta.info(base)
        if not isinstance(bi, meta.TensorInfo) or cdim % bi.ndim != dim:
            return None
        if not squeezed:
            for x, n in zip(inputs, sizes):
                xi = meta.info(x)
                if not isinstance(xi, meta.TensorInfo) or xi.ndim != bi.ndim or xi.shape[dim] != n:
                    return None
        items = _items(node)
        if not items or any(mutates_input(u) for it in items for u in it.users):
            return None
        if any(_aliasing_changes(it, x) for it, x in zip(items, inputs)):
            return None
        if not (records_grad(node) and records_grad(base)):  # see _recorded
            return None
        return inputs, items

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        inputs, items = match
        cat = node.args[0] if node.args else None
        for item in items:
            ctx.replace(item, inputs[item.args[1] % len(inputs)])
        ctx.erase_if_dead([*items, node])
        self.fired(ctx, [n for n in (cat, node) if isinstance(n, fx.Node)], f"{len(inputs)} pieces")


# -- a stack of equal pieces is a view ---------------------------------------------------------
@register
class StackOfPieces(LocalRule):
    """``stack`` of consecutive equal pieces of one tensor -> a view of that tensor.

    Batched matmuls fused before their inputs were fused stack separate tensors; once those
    inputs become pieces of one fused result (``unbind`` along any dim, or equal ``split``
    pieces), the stack is ``base.unflatten(d, (N, L)).movedim(d, k)``: no copy. A stack whose
    result is written in place keeps its own memory.
    """

    name = "stack_of_pieces"
    family = "split_cat"
    candidates = {"call_function": {torch.stack}}

    def match(self, node: fx.Node, ctx: RewriteContext) -> Any:
        if node.op != "call_function" or node.target is not torch.stack or node.kwargs:
            return None
        if not node.args or not isinstance(node.args[0], (list, tuple)):
            return None
        xs = list(node.args[0])
        k = node.args[1] if len(node.args) > 1 else 0
        if len(xs) < 2 or not isinstance(k, int) or not all(isinstance(x, fx.Node) for x in xs):
            return None
        pieces = [piece_of(x) for x in xs]
        first = pieces[0]
        if first is None or any(
            p is None
            or p.base is not first.base
            or p.dim != first.dim
            or p.squeezed != first.squeezed
            or p.length != first.length
            for p in pieces
        ):
            return None
        if any(b.start - a.start != first.length for a, b in itertools.pairwise(pieces)):  # type: ignore[union-attr]
            return None
        bi, oi = meta.info(first.base), ctx.info(node)
        if not isinstance(bi, meta.TensorInfo) or oi is None or not bi.static:
            return None
        if _aliasing_changes(node, first.base) or not _recorded(node, pieces):
            return None
        return first, len(xs), k % oi.ndim

    def rewrite(self, node: fx.Node, match: Any, ctx: RewriteContext) -> None:
        first, n, k = match
        base, d = first.base, first.dim
        bi = meta.info(base)
        with ctx.graph.inserting_before(node):
            x = base
            if first.start != 0 or first.length * n != bi.shape[d]:
                x = ctx.call_method("narrow", (x, d, first.start, first.length * n))
            if not first.squeezed:
                x = ctx.call_method("unflatten", (x, d, (n, -1)))  # no size baked in
            if d != k:
                x = ctx.call_method("movedim", (x, d, k))
        inputs = list(node.all_input_nodes)
        ctx.replace(node, x)
        ctx.erase_if_dead([node, *inputs])
        self.fired(ctx, [node], f"stack of {n} pieces")
