"""Reference data for the sparse tests: features as plain Python lists of bags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from fxrec.sparse import KeyedJaggedTensor


@dataclass
class RefFeatures:
    """``bags[key][row]`` is a list of ids; ``wbags`` the matching weights (or None)."""

    keys: list[str]
    bags: dict[str, list[list[int]]]
    wbags: dict[str, list[list[float]]] | None
    variable: bool

    def stride_per_key(self) -> list[int]:
        return [len(self.bags[k]) for k in self.keys]

    def values(self) -> torch.Tensor:
        return torch.tensor(
            [i for k in self.keys for bag in self.bags[k] for i in bag], dtype=torch.long
        )

    def weights(self) -> torch.Tensor | None:
        if self.wbags is None:
            return None
        return torch.tensor(
            [w for k in self.keys for bag in self.wbags[k] for w in bag], dtype=torch.float32
        )

    def lengths(self) -> torch.Tensor:
        return torch.tensor(
            [len(bag) for k in self.keys for bag in self.bags[k]], dtype=torch.int64
        )

    def kjt(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self.keys,
            self.values(),
            self.weights(),
            lengths=self.lengths(),
            stride_per_key=self.stride_per_key() if self.variable else None,
        )

    def select(self, order: list[int]) -> RefFeatures:
        """Reference permute (a gather of keys)."""
        keys = [self.keys[i] for i in order]
        return RefFeatures(
            keys,
            {k: self.bags[k] for k in keys},
            None if self.wbags is None else {k: self.wbags[k] for k in keys},
            self.variable,
        )


def kjt_bags(kjt: KeyedJaggedTensor) -> list[tuple[str, list[list[int]], list[list[float]] | None]]:
    """Read a KJT back as (key, bags, weight bags), walking it row by row (slow, for checks)."""
    vals = kjt.values().tolist()
    w = kjt.weights_or_none()
    wl = w.tolist() if w is not None else None
    lens = kjt.lengths().tolist()
    out = []
    pos = row = 0
    for key, stride in zip(kjt.keys(), kjt.stride_per_key()):
        bags, wbags = [], []
        for _ in range(stride):
            n = lens[row]
            bags.append(vals[pos : pos + n])
            if wl is not None:
                wbags.append(wl[pos : pos + n])
            pos += n
            row += 1
        out.append((key, bags, wbags if wl is not None else None))
    assert pos == len(vals) and row == len(lens)
    return out


def ref_bags(ref: RefFeatures) -> list[tuple[str, list[list[int]], list[list[float]] | None]]:
    return [(k, ref.bags[k], None if ref.wbags is None else ref.wbags[k]) for k in ref.keys]


@st.composite
def ref_features(
    draw: st.DrawFn,
    max_keys: int = 5,
    max_batch: int = 4,
    max_bag: int = 3,
    min_keys: int = 1,
    weighted: bool | None = None,
    variable: bool | None = None,
) -> RefFeatures:
    n_keys = draw(st.integers(min_keys, max_keys))
    keys = [f"f{i}" for i in range(n_keys)]
    is_var = draw(st.booleans()) if variable is None else variable
    is_w = draw(st.booleans()) if weighted is None else weighted
    batch = draw(st.integers(0, max_batch))
    bags: dict[str, list[list[int]]] = {}
    wbags: dict[str, list[list[float]]] = {}
    for k in keys:
        b = draw(st.integers(0, max_batch)) if is_var else batch
        rows = [draw(st.lists(st.integers(0, 99), min_size=0, max_size=max_bag)) for _ in range(b)]
        bags[k] = rows
        wbags[k] = [[round(0.5 + 0.25 * (i % 7), 2) for i in r] for r in rows]
    return RefFeatures(keys, bags, wbags if is_w else None, is_var)


def td_parts(td: Any, keys: list[str]) -> tuple[list, list, list | None]:
    """Each feature's ids, offsets and weights (or None) of a TensorDict."""
    ids, offs, wts = [], [], []
    for k in keys:
        e = td[k]
        njt = e["values"] if isinstance(e, TensorDict) else e
        ids.append(njt.values())
        offs.append(njt.offsets())
        wts.append(e["weights"].values() if isinstance(e, TensorDict) else None)
    return ids, offs, (wts if wts and wts[0] is not None else None)


def separate_buffers(td: Any, keys: list[str]) -> TensorDict:
    """The same features with every tensor in its own buffer, via the public constructors."""
    ids, offs, wts = td_parts(td, keys)
    out: dict[str, Any] = {}
    for i, k in enumerate(keys):
        o = offs[i].clone()
        njt = torch.nested.nested_tensor_from_jagged(ids[i].clone(), offsets=o)
        if wts is None:
            out[k] = njt
        else:
            w = torch.nested.nested_tensor_from_jagged(wts[i].clone(), offsets=o)
            out[k] = TensorDict({"values": njt, "weights": w}, batch_size=[o.numel() - 1])
    return TensorDict(out, batch_size=td.batch_size)
