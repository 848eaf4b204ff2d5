"""A small ranking model and batch generators shared by the pipeline tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from fxrec.sparse import KeyedJaggedTensor, kjt_from_tensordict, kjt_to_tensordict
from fxrec.train import Batch

NUM_EMB = 23
DIM = 4
DENSE = 3


@torch.fx.wrap
def as_kjt(sparse: Any) -> KeyedJaggedTensor:
    return sparse if isinstance(sparse, KeyedJaggedTensor) else kjt_from_tensordict(sparse)


class TinyRanker(nn.Module):
    """Per-feature EmbeddingBags + dense arch + over arch, reading KJT or TensorDict input.

    ``vbe=True``: features may have their own batch size (variable batch per key); each
    feature's pooled rows are then averaged and broadcast to the dense rows.
    """

    def __init__(self, keys: list[str], weighted: bool = False, vbe: bool = False) -> None:
        super().__init__()
        self.keys = list(keys)
        self.vbe = vbe
        self.bags = nn.ModuleDict(
            {k: nn.EmbeddingBag(NUM_EMB, DIM, mode="sum", include_last_offset=True) for k in keys}
        )
        self.dense_arch = nn.Sequential(nn.Linear(DENSE, 8), nn.ReLU())
        self.over = nn.Linear(8 + DIM * len(keys), 1)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        kjt = as_kjt(sparse)
        d = self.dense_arch(dense)
        parts = [d]
        for k in self.keys:
            jt = kjt[k]
            pooled = self.bags[k](
                jt.values(), jt.offsets(), per_sample_weights=jt.weights_or_none()
            )
            if self.vbe:
                pooled = pooled.mean(0, keepdim=True).expand(d.shape[0], -1)
            parts.append(pooled)
        return self.over(torch.cat(parts, 1))


def make_kjt(
    keys: list[str], batch: int, g: torch.Generator, weighted: bool, vbe: bool
) -> KeyedJaggedTensor:
    strides = [int(torch.randint(1, batch + 2, (1,), generator=g)) if vbe else batch for _ in keys]
    lens = [torch.poisson(torch.full((s,), 2.0), generator=g).long() for s in strides]
    lengths = torch.cat(lens)
    values = torch.randint(0, NUM_EMB, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(
        keys,
        values,
        weights,
        lengths=lengths,
        stride_per_key=strides if vbe else None,
    )


def make_batches(
    keys: list[str],
    n: int,
    *,
    input_type: str = "kjt",
    weighted: bool = False,
    vbe: bool = False,
    seed: int = 0,
    vary_batch: bool = True,
) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = 4 + (i % 3) if vary_batch else 4
        kjt = make_kjt(keys, b, g, weighted, vbe)
        sparse: Any = kjt_to_tensordict(kjt) if input_type == "td" else kjt
        out.append(
            Batch(
                torch.randn(b, DENSE, generator=g),
                sparse,
                torch.randint(0, 2, (b,), generator=g).float(),
            )
        )
    return out


def fresh(keys: list[str], seed: int = 0, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyRanker(keys, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
