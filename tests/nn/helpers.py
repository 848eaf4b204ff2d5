"""Reference for the collection tests: one ``nn.EmbeddingBag`` per table, same weights."""

from __future__ import annotations

import torch
from torch import nn

from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import KeyedJaggedTensor


class PerTableReference(nn.Module):
    """What a collection computes, written the plain way: one lookup per (table, feature).

    Weighted mean is spelled out bag by bag (``sum(w * e) / bag_size``), independently of the
    implementation's weight scaling.
    """

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.configs = ebc.embedding_bag_configs()
        self.weighted = ebc.is_weighted()
        self.bags = nn.ModuleDict(
            {
                c.name: nn.EmbeddingBag(
                    c.num_embeddings,
                    c.embedding_dim,
                    mode=c.pooling,
                    include_last_offset=True,
                    _weight=ebc.embedding_bags[c.name].weight.detach().clone(),
                )
                for c in self.configs
            }
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        d = kjt.to_dict()
        outs = []
        for c in self.configs:
            bag = self.bags[c.name]
            for f in c.feature_names:
                jt = d[f]
                ids, offs = jt.values().long(), jt.offsets().long()
                w = jt.weights_or_none() if self.weighted else None
                if w is not None and c.pooling == "mean":
                    outs.append(_weighted_mean(bag.weight, ids, jt.lengths().tolist(), w))
                else:
                    outs.append(bag(ids, offs, per_sample_weights=w))
        return torch.cat(outs, dim=1)

    def table_grads(self) -> dict[str, torch.Tensor]:
        return {n: _dense(b.weight.grad, b.weight) for n, b in self.bags.items()}


def _weighted_mean(
    weight: torch.Tensor, ids: torch.Tensor, lengths: list[int], w: torch.Tensor
) -> torch.Tensor:
    rows = []
    start = 0
    for n in lengths:
        e = weight[ids[start : start + n]]
        s = (w[start : start + n, None] * e).sum(0)
        rows.append(s / n if n else s * 0.0)  # an empty bag pools to zeros
        start += n
    if not rows:
        return weight.narrow(0, 0, 0) * w.sum()  # [0, dim], still on the autograd graph
    return torch.stack(rows)


def _dense(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if grad is None:
        return torch.zeros_like(like)
    return grad.to_dense() if grad.is_sparse else grad


def table_grads(ebc: EmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Each table's rows of its group weight's gradient (zeros where no gradient)."""
    out = {}
    for name, view in ebc.embedding_bags.items():
        group = view._group
        g = _dense(group.weight.grad, group.weight)
        out[name] = g.narrow(0, view.row_offset, view.num_embeddings)
    return out


def random_kjt(
    ebc: EmbeddingBagCollection,
    batch: int,
    gen: torch.Generator,
    max_len: int = 4,
    weighted: bool = False,
    extra_keys: tuple[str, ...] = (),
    shuffle: bool = True,
    dtype: torch.dtype = torch.int64,
) -> KeyedJaggedTensor:
    """Random bags (empty ones included) for every feature the collection reads, plus extras."""
    rows: dict[str, int] = {}
    for c in ebc.embedding_bag_configs():
        for f in c.feature_names:
            rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
    for k in extra_keys:
        rows[k] = 1000
    keys = list(rows)
    if shuffle:
        keys = [keys[i] for i in torch.randperm(len(keys), generator=gen).tolist()]
    lengths = [torch.randint(0, max_len + 1, (batch,), generator=gen) for _ in keys]
    values = [
        torch.randint(0, rows[k], (int(ln.sum()),), generator=gen, dtype=dtype)
        for k, ln in zip(keys, lengths)
    ]
    flat = torch.cat(values) if values else torch.zeros(0, dtype=dtype)
    weights = torch.rand(flat.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys, flat, weights, lengths=torch.cat(lengths))


def mixed_tables() -> list[EmbeddingBagConfig]:
    """Two dims, all poolings, a table read by two features, a feature read by two tables."""
    return [
        EmbeddingBagConfig("t0", 11, 4, ["a", "b"]),
        EmbeddingBagConfig("t1", 7, 8, ["c"], pooling="mean"),
        EmbeddingBagConfig("t2", 5, 4, ["d", "a"]),
        EmbeddingBagConfig("t3", 9, 8, ["e"], pooling="mean"),
        EmbeddingBagConfig("t4", 6, 4, ["f"], pooling="max"),
        EmbeddingBagConfig("t5", 13, 4, ["g"]),
    ]


def check_against_reference(
    ebc: EmbeddingBagCollection,
    kjt: KeyedJaggedTensor,
    *,
    weights_grad: bool = False,
    atol: float = 1e-5,
) -> None:
    """Outputs, weight gradients (and per-sample weight gradients) equal the reference's."""
    ref = PerTableReference(ebc)
    if weights_grad:
        w = kjt.weights().detach().clone().requires_grad_()
        w_ref = w.detach().clone().requires_grad_()
        kjt_ours = KeyedJaggedTensor(kjt.keys(), kjt.values(), w, lengths=kjt.lengths())
        kjt_ref = KeyedJaggedTensor(kjt.keys(), kjt.values(), w_ref, lengths=kjt.lengths())
    else:
        kjt_ours = kjt_ref = kjt
    ebc.zero_grad(set_to_none=True)
    out = ebc(kjt_ours)
    expected = ref(kjt_ref)
    assert out.keys() == ebc.output_keys()
    assert out.values().shape == expected.shape
    torch.testing.assert_close(out.values(), expected, atol=atol, rtol=1e-5)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    out.values().backward(grad)
    expected.backward(grad)
    ours, theirs = table_grads(ebc), ref.table_grads()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=atol, rtol=1e-5)
    if weights_grad:
        torch.testing.assert_close(
            _dense(w.grad, w), _dense(w_ref.grad, w_ref), atol=atol, rtol=1e-5
        )
