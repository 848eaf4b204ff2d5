"""Bad configs and bad batches: a ValueError naming the key and the problem, raised before
any lookup runs; the id check can be switched off with the sparse package's switch."""

from __future__ import annotations

import re

import pytest
import torch

from fxrec.measure import count_kernels
from fxrec.nn import EmbeddingBagCollection, EmbeddingBagConfig
from fxrec.sparse import (
    JaggedTensor,
    KeyedJaggedTensor,
    kjt_to_tensordict,
    set_validation,
    validation_disabled,
)
from tests.nn.helpers import mixed_tables

pytestmark = pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "", "num_embeddings": 3, "embedding_dim": 2}, "non-empty"),
        ({"name": "a.b", "num_embeddings": 3, "embedding_dim": 2}, "without '.'"),
        ({"name": "t", "num_embeddings": 0, "embedding_dim": 2}, "num_embeddings must be"),
        ({"name": "t", "num_embeddings": 3, "embedding_dim": -1}, "embedding_dim must be"),
        ({"name": "t", "num_embeddings": 3.0, "embedding_dim": 2}, "num_embeddings must be"),
        ({"name": "t", "num_embeddings": 3, "embedding_dim": 2, "pooling": "avg"}, "pooling"),
        ({"name": "t", "num_embeddings": 3, "embedding_dim": 2, "feature_names": "f"}, "list"),
        (
            {"name": "t", "num_embeddings": 3, "embedding_dim": 2, "feature_names": ["f", "f"]},
            "twice",
        ),
        (
            {
                "name": "t",
                "num_embeddings": 3,
                "embedding_dim": 2,
                "weight_init_min": 1.0,
                "weight_init_max": 0.0,
            },
            "larger",
        ),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EmbeddingBagConfig(**kwargs)


def test_config_defaults_follow_torchrec() -> None:
    c = EmbeddingBagConfig("user", 100, 8)
    assert c.feature_names == ["user"]
    assert c.get_weight_init_max() == pytest.approx(0.1)
    assert c.get_weight_init_min() == pytest.approx(-0.1)
    w = torch.empty(100, 8)
    c.init_weight(w)
    assert float(w.abs().max()) <= 0.1


def test_bad_collections() -> None:
    t = EmbeddingBagConfig("t", 3, 2, ["f"])
    with pytest.raises(ValueError, match="unique"):
        EmbeddingBagCollection([t, EmbeddingBagConfig("t", 4, 2, ["g"])])
    with pytest.raises(ValueError, match="at least one table"):
        EmbeddingBagCollection([])
    with pytest.raises(ValueError, match="max pooling cannot use per-sample weights"):
        EmbeddingBagCollection([EmbeddingBagConfig("m", 3, 2, ["f"], "max")], is_weighted=True)
    with pytest.raises(ValueError, match="sparse gradients are not available for max"):
        EmbeddingBagCollection([EmbeddingBagConfig("m", 3, 2, ["f"], "max")], sparse=True)
    with pytest.raises(ValueError, match="backend"):
        EmbeddingBagCollection([t], backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EmbeddingBagConfig"):
        EmbeddingBagCollection([{"name": "t"}])  # type: ignore[list-item]


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(mixed_tables(), backend="torch")


def _kjt(ebc: EmbeddingBagCollection, batch: int = 2) -> dict[str, torch.Tensor]:
    keys = ebc.feature_names()
    return {
        "keys": keys,
        "values": torch.zeros(batch * len(keys), dtype=torch.long),
        "lengths": torch.ones(batch * len(keys), dtype=torch.long),
    }


def _raises_before_lookup(ebc: EmbeddingBagCollection, features: object, match: str) -> None:
    """The error names the problem, and no embedding lookup ran before it."""
    errors: list[str] = []

    def call() -> None:
        try:
            ebc(features)
        except ValueError as e:
            errors.append(str(e))

    counts = count_kernels(call, backward=False)
    assert len(errors) == 1, "no ValueError raised"
    assert re.search(match, errors[0]), f"{match!r} not in {errors[0]!r}"
    assert not any("embedding" in op for op in counts.forward_ops), counts.forward_ops


def test_id_outside_its_table_names_feature_and_table() -> None:
    ebc = _ebc()
    parts = _kjt(ebc)
    keys = parts["keys"]
    # feature "c" reads t1 (7 rows): id 7 is one past the end, and still inside the group
    values = parts["values"].clone()
    pos = keys.index("c") * 2 + 1
    values[pos] = 7
    kjt = KeyedJaggedTensor(keys, values, lengths=parts["lengths"])
    _raises_before_lookup(ebc, kjt, r"feature 'c': id 7 .*table 't1', which has 7 rows")
    values[pos] = -1
    kjt = KeyedJaggedTensor(keys, values, lengths=parts["lengths"])
    _raises_before_lookup(ebc, kjt, r"feature 'c': id -1")


def test_shared_feature_is_checked_against_the_smaller_table() -> None:
    ebc = _ebc()  # "a" reads t0 (11 rows) and t2 (5 rows)
    parts = _kjt(ebc)
    values = parts["values"].clone()
    values[parts["keys"].index("a") * 2] = 8
    kjt = KeyedJaggedTensor(parts["keys"], values, lengths=parts["lengths"])
    _raises_before_lookup(ebc, kjt, r"feature 'a': id 8 .*table 't2'")


def test_missing_feature() -> None:
    ebc = _ebc()
    parts = _kjt(ebc)
    keys = parts["keys"]
    drop = keys.index("e")
    kjt = KeyedJaggedTensor(
        [k for k in keys if k != "e"],
        torch.zeros(2 * (len(keys) - 1), dtype=torch.long),
        lengths=torch.ones(2 * (len(keys) - 1), dtype=torch.long),
    )
    _raises_before_lookup(ebc, kjt, r"missing features \['e'\]")
    as_dict = {
        k: JaggedTensor(torch.zeros(1, dtype=torch.long), lengths=torch.ones(1, dtype=torch.long))
        for k in keys
        if k != keys[drop]
    }
    _raises_before_lookup(ebc, as_dict, r"missing features \['e'\]")
    _raises_before_lookup(ebc, kjt_to_tensordict(kjt), r"\['e'\] are not in the TensorDict")


def test_mismatched_batch_sizes() -> None:
    ebc = _ebc()
    keys = ebc.feature_names()
    spk = [3] * len(keys)
    spk[keys.index("d")] = 2
    kjt = KeyedJaggedTensor(
        keys,
        torch.zeros(sum(spk), dtype=torch.long),
        lengths=torch.ones(sum(spk), dtype=torch.long),
        stride_per_key=spk,
    )
    _raises_before_lookup(ebc, kjt, r"different batch sizes \(.*'d': 2")
    as_dict = kjt.to_dict()
    _raises_before_lookup(ebc, as_dict, r"different batch sizes")


def test_wrong_dtypes_and_missing_weights() -> None:
    ebc = _ebc()
    parts = _kjt(ebc)
    with validation_disabled():  # build the bad KJT without the sparse package's own check
        floats = KeyedJaggedTensor(parts["keys"], parts["values"].float(), lengths=parts["lengths"])
    _raises_before_lookup(ebc, floats, r"dtype torch.float32.*integer ids")
    weighted = EmbeddingBagCollection(
        [t for t in mixed_tables() if t.pooling != "max"], is_weighted=True
    )
    parts = _kjt(weighted)
    plain = KeyedJaggedTensor(parts["keys"], parts["values"], lengths=parts["lengths"])
    _raises_before_lookup(weighted, plain, r"is_weighted=True.*no weights")
    with validation_disabled():
        int_w = KeyedJaggedTensor(
            parts["keys"], parts["values"], parts["values"].clone(), lengths=parts["lengths"]
        )
    _raises_before_lookup(weighted, int_w, r"weights .* must be floating point")
    _raises_before_lookup(weighted, "not features", r"takes a KeyedJaggedTensor")


def test_id_check_follows_the_validation_switch() -> None:
    ebc = _ebc()
    parts = _kjt(ebc)
    values = parts["values"].clone()
    values[parts["keys"].index("c") * 2] = 7  # past t1, but inside its group's rows
    kjt = KeyedJaggedTensor(parts["keys"], values, lengths=parts["lengths"])
    with pytest.raises(ValueError, match="outside"):
        ebc(kjt)
    with validation_disabled():
        ebc(kjt)  # trusted hot path: no check (the id reads the next table's row)
    set_validation(False)
    try:
        ebc(kjt)
    finally:
        set_validation(True)
    with pytest.raises(ValueError, match="outside"):
        ebc(kjt)
