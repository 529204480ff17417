"""The reference verifier's normalising sums follow one fixed order, the pairwise tree, so that the
Triton kernel can reproduce them bit for bit (verifiers/reference.py, ``pairwise_sum``)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from specdec.sampling import pairwise_sum
from verifiers.reference import draw_from, normalise


def recursive_pairwise(values: list[float]) -> float:
    """The definition: the list zero-padded to a power of two, then the sum of each half, added."""
    if len(values) == 1:
        return values[0]
    size = 1 << (len(values) - 1).bit_length()
    values = values + [0.0] * (size - len(values))
    return recursive_pairwise(values[: size // 2]) + recursive_pairwise(values[size // 2 :])


def sequential_sum(x: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B, 1], left to right
    sums = [[functools.reduce(operator.add, row)] for row in x.tolist()]
    return torch.tensor(sums, dtype=x.dtype, device=x.device)


def tiny_mass_row(vocab: int = 5000) -> torch.Tensor:  # [1, V]
    """Three large entries first, then thousands of tiny ones: left to right, each tiny entry is
    below half an ulp of the running total and vanishes; the tree adds them among themselves first,
    so the two sums differ by ~100 ulps, whatever else a particular order does."""
    x = torch.full((1, vocab), 2.4e-18, dtype=torch.float64)
    x[0, :3] = torch.tensor([0.21, 0.58, 0.21], dtype=torch.float64)
    return x


@pytest.mark.parametrize("length", [1, 2, 3, 5, 7, 37, 1000, 4097])
def test_pairwise_sum_is_the_recursive_definition(length):
    g = torch.Generator().manual_seed(length)
    # magnitudes over 16 decades and both signs, so that a different order would round differently
    x = torch.randn(3, length, generator=g, dtype=torch.float64)
    x = x * 10.0 ** torch.randint(-8, 8, (3, length), generator=g)
    expected = torch.tensor([[recursive_pairwise(row)] for row in x.tolist()], dtype=torch.float64)
    assert torch.equal(pairwise_sum(x), expected)


def test_normalise_divides_by_the_pairwise_sum():
    x = tiny_mass_row()
    assert not torch.equal(pairwise_sum(x), sequential_sum(x))  # the row tells the orders apart
    assert torch.equal(normalise(x), x / pairwise_sum(x))
    assert not torch.equal(normalise(x), x / sequential_sum(x))


def test_draw_from_inverts_the_cumulative_mass():
    """Away from the boundaries of the cumulative mass (where rounding could tip it), the draw is
    the token whose interval holds u * total, on padded and unpadded widths alike."""
    g = torch.Generator().manual_seed(0)
    for width in (1, 5, 8, 37, 64):
        weights = torch.rand(200, width, generator=g, dtype=torch.float64)
        weights[weights < 0.3] = 0.0
        weights[:, 0] += (weights.sum(-1) == 0).double()  # every row with some mass
        u = torch.rand(200, generator=g, dtype=torch.float64)
        cumulative = weights.cumsum(-1)
        want = torch.searchsorted(cumulative, (u * cumulative[:, -1])[:, None], right=True)[:, 0]
        clear = ((cumulative - (u * cumulative[:, -1])[:, None]).abs() > 1e-9).all(-1)
        got = draw_from(weights, u)
        assert torch.equal(got[clear], want[clear]), width
        assert (weights.gather(1, got[:, None]) > 0).all()  # never a token without mass


def test_draw_from_never_lands_on_a_token_without_mass():
    """Even a uniform at the very top of (0, 1), where u * total may round up to the total."""
    weights = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 1e-300, 0.0, 0.0]], dtype=torch.float64)
    u = torch.full((2,), 1 - 2.0**-53, dtype=torch.float64)
    assert draw_from(weights, u).tolist() == [2, 2]
    assert draw_from(weights, torch.full((2,), 2.0**-53, dtype=torch.float64)).tolist() == [0, 2]
