"""Parameter-sized sums of the engines and readings against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_callbacks.credit.engines.reductions import (
    BLOCK,
    cache_block,
    diff_sq64,
    dot64,
    gram64,
    inner64,
    inners64,
    sq64,
)


def _heavy(n: int, seed: int) -> torch.Tensor:
    """Float32 values over many orders of magnitude (an Adam-preconditioned gradient looks like this)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))


N = 3 * BLOCK + 1234  # several blocks and a short last one


@pytest.mark.parametrize("same", [True, False])
def test_inner64_is_float64_accurate_in_float32(same):
    a = _heavy(N, 0)
    b = a if same else _heavy(N, 1)
    ref = float(np.dot(a.numpy().astype(np.float64), b.numpy().astype(np.float64)))
    scale = float(np.linalg.norm(a.numpy().astype(np.float64)) * np.linalg.norm(b.numpy().astype(np.float64)))
    got = inner64(a, None if same else b)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(float(got) - ref) <= 1e-7 * scale
    assert float(dot64(a, b)) == pytest.approx(ref, rel=1e-12, abs=1e-12 * scale)  # every product in float64


def test_inner64_of_half_precision_takes_float32_products():
    a = _heavy(N, 2).bfloat16()
    ref = float(np.dot(a.float().numpy().astype(np.float64), a.float().numpy().astype(np.float64)))
    assert float(inner64(a)) == pytest.approx(ref, rel=1e-6)  # a bfloat16 sum would be off by ~1e-3
    assert float(sq64(a)) == float(inner64(a))


def test_inner64_in_float64_and_of_nothing():
    a = _heavy(1000, 3).double()
    assert float(inner64(a)) == pytest.approx(float(np.dot(a.numpy(), a.numpy())), rel=1e-14)
    assert float(inner64(torch.zeros(0))) == 0.0


def test_inners64_equals_inner64_pair_by_pair_and_checks_sizes():
    a, b, c = _heavy(N, 4), _heavy(N, 5), _heavy(N, 6).double()
    pairs = [(a, a), (a, b), (b, c)]
    got = inners64(pairs)
    for (x, y), g in zip(pairs, got):
        assert torch.equal(g, inner64(x, y))  # the same numbers, each operand read once
    with pytest.raises(ValueError, match="one size"):
        inners64([(a, b), (a[:-1], b[:-1])])
    with pytest.raises(ValueError, match="one size"):
        dot64(a, b[:-1])


@pytest.mark.parametrize("scratch", [False, True])
def test_diff_sq64_against_numpy(scratch):
    a, b = _heavy(N, 7), _heavy(N, 8)
    ref = float(np.sum((a - b).numpy().astype(np.float64) ** 2))  # the float32 differences, summed in float64
    exact = float(np.sum((a.numpy().astype(np.float64) - b.numpy().astype(np.float64)) ** 2))
    buf = torch.empty(16 * BLOCK) if scratch else None
    got = float(diff_sq64(a, b, buf))
    assert got == pytest.approx(ref, rel=1e-7) and got == pytest.approx(exact, rel=4 * 2**-24)
    small = float(diff_sq64(a[:100], b[:100].double()))  # the wider dtype: float64
    assert small == pytest.approx(float(np.sum((a[:100].double().numpy() - b[:100].double().numpy()) ** 2)), rel=1e-14)


def test_blocks_are_cache_sized_on_a_cpu_only():
    assert cache_block(torch.device("cpu")) == BLOCK  # in a core's cache while every operation runs on it
    assert cache_block(torch.device("cuda")) == 16 * BLOCK  # a GPU pays a launch per block and operation


@pytest.mark.parametrize("n", [5 * BLOCK // 4, 16 * BLOCK, 16 * BLOCK + 9])
def test_gram64_against_numpy(n):
    """``P Qᵀ`` of float32 blocks under and past the small-block size, with and without a short last block, against
    numpy's float64 products of the same values: each block's float32 product sums ``BLOCK`` columns, so the
    bound is ``√BLOCK`` unit roundoffs of the summed magnitudes (the float64 sum over blocks adds nothing)."""
    P, Q = _heavy(3 * n, 11).view(3, n), _heavy(5 * n, 12).view(5, n)
    P[:, -(n % BLOCK or BLOCK) :] *= 1e4  # the last block (or the short tail) weighs: a product left out shows
    P64, Q64 = P.numpy().astype(np.float64), Q.numpy().astype(np.float64)
    got = gram64(P, Q)
    assert got.dtype == torch.float64 and tuple(got.shape) == (3, 5)
    scale = np.abs(P64) @ np.abs(Q64).T
    assert np.max(np.abs(got.numpy() - P64 @ Q64.T) / scale) < BLOCK**0.5 * 2.0**-24
