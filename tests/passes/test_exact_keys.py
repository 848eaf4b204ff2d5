"""Keys of dedup and the pointwise rules tell apart numbers that compare equal but compute
differently: ``0.0`` and ``-0.0`` (``x / -0.0``), ``1`` and ``1.0`` (an int clamp bound keeps
an int result), ``1`` and ``True``; NaNs are one number (the same computation)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxrec
from fxrec.graph.rule import exact
from fxrec.passes.dedup import _freeze

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.booleans(),
    st.sampled_from([0.0, -0.0, 1.0, 1, True, 0, False, math.nan, -math.nan]),
)


def _same_number(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    return a == b


@given(NUMBERS, NUMBERS)
def test_keys_equal_exactly_for_the_same_number(a: object, b: object) -> None:
    assert (_freeze(a) == _freeze(b)) == _same_number(a, b)
    assert (exact(a) == exact(b)) == _same_number(a, b)
    assert (_freeze((a, [b])) == _freeze((b, [a]))) == _same_number(a, b)


def test_complex_zeros_differ() -> None:
    assert _freeze(complex(0.0, -0.0)) != _freeze(complex(0.0, 0.0))


class Scaled(nn.Module):
    def __init__(self, c: tuple) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple:
        c0, c1, c2 = self.c
        return x / c0, y / c1, z / c2, x / c1, x.clamp(min=c0), y.clamp(min=c1), z.clamp(min=c2)


@settings(max_examples=15)
@given(st.tuples(*[st.sampled_from([0.0, -0.0, 1, 1.0, math.nan, -2])] * 3), st.booleans())
def test_scalars_that_compare_equal_stay_apart(c: tuple, ints: bool) -> None:
    model = Scaled(c)
    dtype = torch.long if ints else torch.float32
    zeros = tuple(torch.zeros(4, 8, dtype=dtype) for _ in range(3))
    opt = fxrec.optimize(model, zeros, check=False)
    xs = tuple(torch.randint(-3, 4, (4, 8)).to(dtype) for _ in range(3))
    for got, want in zip(opt(*xs), model(*xs), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, equal_nan=True)
