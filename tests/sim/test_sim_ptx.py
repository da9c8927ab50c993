"""Every wrapper of kernels_cu/ptx.cuh against NumPy, with inputs and expectations built from the
PTX ISA's fragment formulas (sections "Warp-level matrix load instruction: ldmatrix" and
"Matrix Fragments for mma.m16n8k16 with floating point type"). Exact equality for ldmatrix and
for mma on small integers; tolerances otherwise."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.sim import launcher

LANE = np.arange(32)
G, T = LANE // 4, LANE % 4


def _s(r, c):
    """Value the probe stores at shared s[r][c]."""
    return r * 16 + c + 1


def _expected_ldmatrix(x: int, trans: bool) -> np.ndarray:
    """(32, x) registers: matrix j is the 8x8 block at rows (j % 2) * 8, columns (j // 2) * 8."""
    out = np.zeros((32, x), np.uint32)
    for j in range(x):
        r0, c0 = (j % 2) * 8, (j // 2) * 8
        if not trans:  # row g, columns 2t, 2t+1
            lo, hi = _s(r0 + G, c0 + 2 * T), _s(r0 + G, c0 + 2 * T + 1)
        else:  # transposed: rows 2t, 2t+1 of column g
            lo, hi = _s(r0 + 2 * T, c0 + G), _s(r0 + 2 * T + 1, c0 + G)
        out[:, j] = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    return out


def test_ldmatrix_layouts_exact(modules):
    out = np.zeros((32, 14), np.uint32)
    modules["ptx"].launch(plan("ldmatrix_probe", 1, 32, P(out), i32(0)))
    cols = {(1, False): [0], (2, False): [1, 2], (4, False): [3, 4, 5, 6],
            (1, True): [7], (2, True): [8, 9], (4, True): [10, 11, 12, 13]}
    for (x, trans), idx in cols.items():
        np.testing.assert_array_equal(out[:, idx], _expected_ldmatrix(x, trans), err_msg=f"x{x} trans={trans}")


def test_ldmatrix_requires_16_byte_alignment(modules):
    out = np.zeros((32, 14), np.uint32)
    with pytest.raises(launcher.SimError, match="ldmatrix.x1: shared address .* not 16-byte aligned"):
        modules["ptx"].launch(plan("ldmatrix_probe", 1, 32, P(out), i32(4)))


def _bits(a: np.ndarray, bf16: bool) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16 if bf16 else np.float16).view(np.uint16)


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_mma_m16n8k16_small_integers_exact(modules, bf16):
    rng = np.random.default_rng(7 + bf16)
    A = rng.integers(-8, 9, (16, 16)).astype(np.float32)
    B = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    C = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    D = np.full((16, 8), np.nan, np.float32)
    modules["ptx"].launch(plan("mma_direct", 1, 32, P(_bits(A, bf16)), P(_bits(B, bf16)), P(C), P(D), i32(bf16)))
    np.testing.assert_array_equal(D, A @ B + C)


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_mma_m16n8k16_random(modules, bf16):
    rng = np.random.default_rng(11 + bf16)
    dt = ml_dtypes.bfloat16 if bf16 else np.float16
    A = rng.standard_normal((16, 16)).astype(dt)
    B = rng.standard_normal((16, 8)).astype(dt)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.full((16, 8), np.nan, np.float32)
    modules["ptx"].launch(plan("mma_direct", 1, 32, P(A.view(np.uint16)), P(B.view(np.uint16)), P(C), P(D), i32(bf16)))
    ref = A.astype(np.float64) @ B.astype(np.float64) + C
    np.testing.assert_allclose(D, ref, rtol=1e-6, atol=1e-6)


def test_mma_pipeline_cp_async_ldmatrix(modules):
    rng = np.random.default_rng(3)
    A = rng.integers(-4, 5, (16, 16)).astype(np.float16)
    B = rng.integers(-4, 5, (16, 8)).astype(np.float16)
    Bt = np.ascontiguousarray(B.T)  # B column-major = B^T row-major, as ldmatrix (non-trans) wants it
    D = np.full((16, 8), np.nan, np.float32)
    modules["ptx"].launch(plan("mma_pipeline", 1, 32, P(A), P(Bt), P(D), i32(0)))
    np.testing.assert_array_equal(D, A.astype(np.float32) @ B.astype(np.float32))


def test_missing_cp_async_wait_is_detected(modules):
    A = np.ones((16, 16), np.float16)
    Bt = np.ones((8, 16), np.float16)
    for seed in range(4):
        D = np.zeros((16, 8), np.float32)
        with sim.options(seed=seed):
            modules["ptx"].launch(plan("mma_pipeline", 1, 32, P(A), P(Bt), P(D), i32(1)))
        # each of the 48 copies lands at once or at its wait, by the seed; with the wait missing,
        # some copy has not landed and ldmatrix reads the poisoned shared memory
        assert np.isnan(D).any(), seed


@pytest.mark.parametrize("zfill", [16, 8, 0])
def test_cp_async_groups_land_by_their_wait(modules, zfill):
    src = np.arange(1, 13, dtype=np.float32)
    expect = src.copy()
    expect[8 + zfill // 4 :] = 0  # zero-filled beyond src-size
    early = set()
    for seed in range(16):
        out = np.zeros(20, np.float32)
        with sim.options(seed=seed):
            modules["ptx"].launch(plan("cp_async_groups", 1, 32, P(src), P(out), i32(zfill)))
        np.testing.assert_array_equal(out[:4], src[:4])  # group 0 landed by wait_group 2, always
        landed = bool((out[4:8] == src[4:8]).all())
        assert landed or np.isnan(out[4:8]).all(), out[4:8]  # group 1: landed at issue, or in flight
        early.add(landed)
        np.testing.assert_array_equal(out[8:], expect)
    assert early == {True, False}  # the seed draws both ends of the copy's window


def test_cp_async_requires_16_byte_alignment(modules):
    src = np.zeros(16, np.float32)
    out = np.zeros(32, np.float32)
    modules["ptx"].launch(plan("cp_async_misaligned", 1, 32, P(src), P(out), i32(0)))
    with pytest.raises(launcher.SimError, match="cp.async: .* must be 16-byte aligned"):
        modules["ptx"].launch(plan("cp_async_misaligned", 1, 32, P(src), P(out), i32(8)))


def test_cvt_packs_round_to_nearest_even(modules):
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 100,
                        np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65520, -1e-8], np.float32)])
    x = x[: x.size // 2 * 2]
    n = x.size // 2
    out = np.zeros(2 * n, np.uint32)
    modules["ptx"].launch(plan("cvt_pack", -(-n // 128), 128, P(x), P(out), i32(n)))
    with np.errstate(over="ignore"):
        h = x.astype(np.float16).view(np.uint16).astype(np.uint32)
        b = x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(out[0::2], h[0::2] | (h[1::2] << 16))  # lo = first, hi = second
    np.testing.assert_array_equal(out[1::2], b[0::2] | (b[1::2] << 16))


def test_mma_is_computed_once_per_warp(modules):
    """The emulation runs by the last lane to arrive; every lane reads its own D fragment."""
    A = np.eye(16, dtype=np.float16)
    B = np.arange(128, dtype=np.float16).reshape(16, 8)
    C = np.zeros((16, 8), np.float32)
    D = np.full((16, 8), np.nan, np.float32)
    stats = modules["ptx"].launch(plan("mma_direct", 1, 32, P(A.view(np.uint16)), P(B.view(np.uint16)), P(C), P(D), i32(0)))
    np.testing.assert_array_equal(D, B.astype(np.float32))
    # 32 first switches + 31 lanes resumed after the collective
    assert stats.context_switches == 63
