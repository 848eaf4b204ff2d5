"""Bad inputs raise ValueError naming the feature and the problem; the switch turns it off."""

from __future__ import annotations

import pytest
import torch

import fxrec.sparse as S
from fxrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def _kjt(**kw):  # type: ignore[no-untyped-def]
    args = dict(
        keys=["user", "item"],
        values=torch.arange(5),
        lengths=torch.tensor([1, 1, 2, 1]),
    )
    args.update(kw)
    return KeyedJaggedTensor(**args)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"lengths": torch.tensor([1, 1, 2, 2])}, "sum to 6 but there are 5 values"),
        (
            {"lengths": torch.tensor([1, 1, 4, -1])},
            "feature 'item': negative length -1 at batch row 1",
        ),
        ({"lengths": torch.tensor([3, -1, 2, 1])}, "feature 'user': negative length"),
        ({"values": torch.arange(5.0)}, "ids .* must be integers"),
        ({"weights": torch.ones(4)}, "one weight per id"),
        ({"weights": torch.ones(5, dtype=torch.long)}, "weights must be floating point"),
        ({"lengths": torch.tensor([1.0, 1, 2, 1])}, "integer dtype"),
        ({"lengths": torch.tensor([1, 1, 3])}, "can't be split evenly over 2 keys"),
        ({"stride": 3}, "stride=3 with 2 keys needs 6 lengths"),
        ({"stride_per_key": [1, 2]}, "stride_per_key sums to 3 rows but lengths has 4"),
        ({"stride_per_key": [4]}, "1 entries for 2 keys"),
        ({"length_per_key": [3, 2]}, "disagrees with the lengths"),
        ({"keys": ["user", 3]}, "keys must be str"),
        ({"keys": "ui"}, r"got the str 'ui'; use \['ui'\]"),
    ],
)
def test_bad_kjt_inputs(kw: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _kjt(**kw)


def test_bad_offsets() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="must start at 0"):
        KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="end at 2 but there are 3 values"):
        KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="disagree"):
        KeyedJaggedTensor(
            ["a"], torch.arange(3), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3])
        )
    with pytest.raises(ValueError, match="lengths or offsets"):
        KeyedJaggedTensor(["a"], torch.arange(3))


def test_variable_batch_error_names_the_key() -> None:
    with pytest.raises(ValueError, match="feature 'c': negative length -2 at batch row 0"):
        KeyedJaggedTensor(
            ["a", "b", "c"],
            torch.arange(3),
            lengths=torch.tensor([1, 2, 2, -2]),
            stride_per_key=[1, 2, 1],
        )


def test_jagged_tensor_validation() -> None:
    with pytest.raises(ValueError, match="sum to 4 but there are 3 values"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="one weight per id"):
        JaggedTensor(torch.arange(3), weights=torch.ones(2), lengths=torch.tensor([1, 2]))
    # Non-integer values are fine in a JaggedTensor (e.g. sequence embeddings).
    JaggedTensor(torch.randn(3, 4), lengths=torch.tensor([1, 2]))


def test_keyed_tensor_validation() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 lengths"):
        KeyedTensor(["a", "b"], [3], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="key 'b' has a negative width"):
        KeyedTensor(["a", "b"], [4, -1], torch.zeros(2, 3))  # the widths sum right
    with pytest.raises(ValueError, match="got the str 'ab'"):
        KeyedTensor("ab", [1, 2], torch.zeros(2, 3))


def test_switch_and_context_manager_skip_checks() -> None:
    bad = {"lengths": torch.tensor([1, 1, 2, 2])}
    with S.validation_disabled():
        assert not S.validation_enabled()
        _kjt(**bad)  # accepted: the caller vouches for the data
    assert S.validation_enabled()
    S.set_validation(False)
    try:
        _kjt(**bad)
    finally:
        S.set_validation(True)
    with pytest.raises(ValueError):
        _kjt(**bad)


def test_validation_skipped_while_fx_tracing() -> None:
    def f(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return KeyedJaggedTensor(["a"], values, lengths=lengths).values() + 1

    gm = torch.fx.symbolic_trace(f)
    ctor = [n for n in gm.graph.nodes if n.target is KeyedJaggedTensor]
    assert len(ctor) == 1  # construction from proxies is one node
    assert gm(torch.arange(3), torch.tensor([1, 2])).tolist() == [1, 2, 3]


def test_validation_is_vectorised_kernel_count_independent_of_batch() -> None:
    from fxrec.measure import count_kernels

    def build(b: int) -> KeyedJaggedTensor:
        lengths = torch.ones(3 * b, dtype=torch.long)
        return KeyedJaggedTensor(["a", "b", "c"], torch.arange(3 * b), lengths=lengths)

    small = count_kernels(build, 4, backward=False).forward
    large = count_kernels(build, 400, backward=False).forward
    assert small == large
