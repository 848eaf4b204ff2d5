"""Same tables, same weights, same batch into TorchRec's EmbeddingBagCollection and ours:
same keys, outputs and per-table gradients; checkpoints move both ways."""

from __future__ import annotations

import pytest
import torch

from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import to_torchrec
from tests.nn.helpers import random_kjt
from tests.records import recorded

trec = pytest.importorskip("torchrec.modules.embedding_modules")
pytestmark = [
    pytest.mark.torchrec,
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered"),
]


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig("t0", 11, 4, ["a", "b"]),
        EmbeddingBagConfig("t1", 7, 8, ["c"], pooling="mean"),
        EmbeddingBagConfig("t2", 5, 4, ["d", "a"]),
        EmbeddingBagConfig("t3", 13, 4, ["e"]),
    ]


def _pair(weighted: bool, backend: str, tables: list[EmbeddingBagConfig] | None = None):  # type: ignore[no-untyped-def]
    tables = tables or _tables()
    ours = EmbeddingBagCollection(tables, is_weighted=weighted, backend=backend)  # type: ignore[arg-type]
    theirs = trec.EmbeddingBagCollection(
        tables=[t.to_torchrec() for t in tables], is_weighted=weighted
    )
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("weighted", [False, True])
def test_same_outputs_and_gradients(weighted: bool, backend: str) -> None:
    tables = _tables()
    if weighted:  # TorchRec refuses weighted mean pooling
        tables = [t for t in tables if t.pooling != "mean"]
    ours, theirs = _pair(weighted, backend, tables)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        kjt = random_kjt(ours, batch=5, gen=gen, weighted=weighted, extra_keys=("x",))
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        got = ours(kjt)
        expected = theirs(to_torchrec(kjt))
        assert got.keys() == expected.keys()
        assert got.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(got.values(), expected.values(), atol=1e-6, rtol=1e-5)
        grad = torch.randn(expected.values().shape, generator=gen)
        got.values().backward(grad)
        expected.values().backward(grad)
        mine = ours.table_grads()
        for name, bag in theirs.embedding_bags.items():
            torch.testing.assert_close(mine[name], bag.weight.grad, atol=1e-6, rtol=1e-5)


def test_takes_torchrec_kjt_and_configs() -> None:
    ours, theirs = _pair(False, "torch")
    kjt = random_kjt(ours, batch=3, gen=torch.Generator().manual_seed(5))
    assert torch.equal(ours(to_torchrec(kjt)).values(), ours(kjt).values())
    from_configs = EmbeddingBagCollection(theirs.embedding_bag_configs())
    assert from_configs.output_keys() == ours.output_keys()
    assert [c.pooling for c in from_configs.embedding_bag_configs()] == [
        "sum",
        "mean",
        "sum",
        "sum",
    ]


def test_checkpoints_move_both_ways() -> None:
    tables = _tables()
    theirs = trec.EmbeddingBagCollection(tables=[t.to_torchrec() for t in tables])
    ours = EmbeddingBagCollection(tables)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [v.shape for v in ours.state_dict().values()] == [
        v.shape for v in theirs.state_dict().values()
    ]
    ours.load_state_dict(theirs.state_dict())  # strict: same keys, same shapes
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(2.0)
    theirs.load_state_dict(ours.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v)


def _quarter_(w: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.constant_(w, 0.25)


def test_init_fn_moves_both_ways() -> None:
    """A table TorchRec initialises with its own ``init_fn`` starts the same here."""
    theirs = trec.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"], init_fn=_quarter_
    )
    from_config = EmbeddingBagCollection([EmbeddingBagConfig.from_torchrec(theirs)])
    from_raw = EmbeddingBagCollection([theirs])  # type: ignore[list-item]
    for ours in (from_config, from_raw):
        assert torch.equal(ours.embedding_bags["t"].weight, torch.full((10, 4), 0.25))
    back = trec.EmbeddingBagCollection(
        tables=[EmbeddingBagConfig("t", 10, 4, init_fn=_quarter_).to_torchrec()]
    )
    assert torch.equal(back.embedding_bags["t"].weight, torch.full((10, 4), 0.25))


def test_default_init_stays_uniform_within_bounds() -> None:
    """TorchRec's default ``init_fn`` (uniform in the bounds) is the default here too."""
    theirs = trec.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=9, weight_init_min=0.5, weight_init_max=0.75
    )
    ours = EmbeddingBagConfig.from_torchrec(theirs)
    assert ours.init_fn is None
    weight = EmbeddingBagCollection([ours]).embedding_bags["t"].weight
    assert weight.min() >= 0.5 and weight.max() <= 0.75
    assert EmbeddingBagConfig.from_torchrec(ours.to_torchrec()) == ours


def test_fields_without_counterpart_raise_or_warn() -> None:
    """A field that changes the table raises; one only sharded/inference modules read warns."""
    virtual = trec.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=9, use_virtual_table=True
    )
    with pytest.raises(ValueError, match="use_virtual_table"):
        EmbeddingBagConfig.from_torchrec(virtual)
    pruned = trec.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=9, num_embeddings_post_pruning=3
    )
    with recorded("fxrec.nn.config") as records:
        EmbeddingBagConfig.from_torchrec(pruned)
    assert any("num_embeddings_post_pruning=3 is not carried over" in m for m in records.messages)
