"""Row-wise sharding: one table's rows spread over every rank.

A table too large for one rank is cut into ``world`` row blocks (sizes differ by at most
one), block ``r`` on rank ``r``. Each block is handled by the table-wise machinery as a
table of its own, a *row shard* named ``<table>#rw<r>`` read by the features
``<feature>#rw<r>``:

1. :func:`split_rows` (on the source rank, before the ids all-to-all): each id of a
   row-wise feature goes to the shard holding its row, shifted into that block; per
   (shard, row of the batch) lengths come from one ``bincount``. Ids keep their order
   within a bag, weights travel with their ids;
2. every shard is looked up by its owner with **sum** pooling and sent back like any table;
3. :func:`merge_row_shards` (on the source rank, after the pooled all-to-all): a feature's
   pooled embedding is the sum of its shards' partial sums; mean pooling divides by the
   bag's size there (the partial means of the shards would be wrong).

Max pooling is refused: an empty partial bag pools to 0, which is not neutral for a max.
Sums over a bag are associated differently (per shard, then across shards), so outputs match
the unsharded table up to float rounding, not bit for bit; gradients per row are the same
sums of the same terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from fxrec.distributed.dist_ops import key_index
from fxrec.distributed.plan import row_bounds
from fxrec.sparse import KeyedJaggedTensor, KeyedTensor

__all__ = [
    "SEP",
    "RowShards",
    "check_row_wise",
    "merge_row_shards",
    "shard_features",
    "shard_name",
    "split_rows",
]

SEP = "#rw"


def shard_name(name: str, rank: int) -> str:
    """The name of ``name``'s row shard on ``rank`` (a table or a feature)."""
    return f"{name}{SEP}{rank}"


@dataclass(frozen=True)
class RowShards:
    """Static description of a collection's row-wise features (hashable: sits in a graph).

    ``features``: the row-wise features; ``bounds``/``mean``: each one's row boundaries and
    whether its table pools by mean. ``keys``/``dims``: the collection's output keys and
    widths, in order (the wire carries each row-wise key as ``world`` adjacent shard keys).
    """

    features: tuple[str, ...]
    bounds: tuple[tuple[int, ...], ...]
    mean: tuple[bool, ...]
    keys: tuple[str, ...]
    dims: tuple[int, ...]
    world: int

    def route(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with its row-wise features' ids sent to their row blocks (:func:`split_rows`)."""
        return split_rows(kjt, self)

    def wire_keys(self) -> tuple[list[str], list[int]]:
        """Output keys with each row-wise key replaced by its adjacent shard keys."""
        rw = set(self.features)
        keys: list[str] = []
        dims: list[int] = []
        for k, d in zip(self.keys, self.dims):
            if k in rw:
                keys += [shard_name(k, r) for r in range(self.world)]
                dims += [d] * self.world
            else:
                keys.append(k)
                dims.append(d)
        return keys, dims


@torch.fx.wrap
def split_rows(kjt: KeyedJaggedTensor, shards: RowShards) -> KeyedJaggedTensor:
    """``kjt`` with each row-wise feature replaced by its ``world`` shard features.

    Other keys are kept as they are (first, in their order). Shard ``r`` of feature ``f``
    holds, for every row of the batch, the ids of the bag that fall in row block ``r``,
    shifted to start at 0, in their original order. Ids must lie in their tables (the
    collection's id-count request checks them first, for every feature).
    """
    index = key_index(kjt, shards.features)
    batch = kjt.stride()
    rw = set(shards.features)
    keep = [i for i, k in enumerate(kjt.keys()) if k not in rw]
    lpk = kjt.length_per_key()
    starts = [0]
    for n in lpk:
        starts.append(starts[-1] + n)
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    keys: list[str] = []
    vals: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    wts: list[torch.Tensor] = []
    if keep:
        base = kjt.permute(keep)
        keys += base.keys()
        vals.append(base.values())
        lens.append(base.lengths())
        if weights is not None:
            wts.append(base.weights())
    world = shards.world
    rows_of = torch.arange(batch, device=values.device)
    for f, bounds in zip(shards.features, shards.bounds):
        i = index[f]
        ids = values[starts[i] : starts[i + 1]]
        bag = lengths[i * batch : (i + 1) * batch]
        edges = torch.tensor(bounds[1:-1], dtype=ids.dtype, device=ids.device)
        shard = torch.bucketize(ids, edges, right=True)  # the rank holding each id's row
        row = torch.repeat_interleave(rows_of, bag.long(), output_size=ids.numel())
        code = shard * batch + row  # (shard, row of the batch): the new bag of each id
        order = torch.argsort(code, stable=True)  # stable: ids keep their order in a bag
        first = torch.tensor(bounds[:-1], dtype=ids.dtype, device=ids.device)
        picked = shard.index_select(0, order)
        vals.append(ids.index_select(0, order) - first.index_select(0, picked))
        lens.append(torch.bincount(code, minlength=world * batch).to(bag.dtype))
        if weights is not None:
            wts.append(weights[starts[i] : starts[i + 1]].index_select(0, order))
        keys += [shard_name(f, r) for r in range(world)]
    return KeyedJaggedTensor(
        keys,
        torch.cat(vals) if len(vals) > 1 else vals[0],
        None if weights is None else (torch.cat(wts) if len(wts) > 1 else wts[0]),
        lengths=torch.cat(lens) if len(lens) > 1 else lens[0],
        stride=batch,
    )


@torch.fx.wrap
def merge_row_shards(kt: KeyedTensor, kjt: KeyedJaggedTensor, shards: RowShards) -> KeyedTensor:
    """The collection's output from the wire's: each row-wise key's shards summed.

    ``kt`` carries the keys of :meth:`RowShards.wire_keys`; ``kjt`` is the source rank's
    input (its bag sizes divide mean-pooled keys).
    """
    wide = kt.values()
    b = wide.shape[0]
    rw = {f: j for j, f in enumerate(shards.features)}
    pieces: list[torch.Tensor] = []
    pos, run = 0, 0  # run: width of table-wise columns not yet taken
    for k, d in zip(shards.keys, shards.dims):
        if k not in rw:
            run += d
            continue
        if run:
            pieces.append(wide[:, pos : pos + run])
            pos += run
            run = 0
        width = shards.world * d
        total = wide[:, pos : pos + width].reshape(b, shards.world, d).sum(1)
        if shards.mean[rw[k]]:
            total = total / _bag_sizes(kjt, k, b).clamp(min=1).unsqueeze(1).to(total.dtype)
        pieces.append(total)
        pos += width
    if run:
        pieces.append(wide[:, pos : pos + run])
    values = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    return KeyedTensor(list(shards.keys), list(shards.dims), values)


def _bag_sizes(kjt: KeyedJaggedTensor, key: str, batch: int) -> torch.Tensor:
    i = kjt.keys().index(key)
    return kjt.lengths()[i * batch : (i + 1) * batch]


def check_row_wise(name: str, pooling: str, rows: int, world: int) -> tuple[int, ...]:
    """Row boundaries of table ``name``, or a ``ValueError`` saying why it cannot be split."""
    if pooling == "max":
        raise ValueError(
            f"table {name!r} pools by max, which row-wise sharding cannot split (an empty "
            "partial bag pools to 0); shard it table-wise or pool by sum or mean."
        )
    return row_bounds(rows, world)


def shard_features(features: Sequence[str], rank: int) -> list[str]:
    """The features of a table's row shard on ``rank``."""
    return [shard_name(f, rank) for f in features]
