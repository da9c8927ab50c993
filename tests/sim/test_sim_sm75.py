"""The sm_75 (Turing) form of kernels_cu/ptx.cuh on the simulator built for sm_75: mma.m16n8k8
against NumPy with fragments placed by the PTX ISA's formulas (9.7.14.5.7 "Matrix Fragments for
mma.m16n8k8"), planted faults in that layout, m16n8k16 as two m16n8k8, the copy wrappers as
synchronous register-staged copies, and the instructions sm_75 lacks (cp.async, bf16 mma) as
errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_probe
from support.simtools import P, i32, plan

from cuflash.sim import launcher

pytestmark = pytest.mark.xdist_group("sm75_probes")


@pytest.fixture(scope="module")
def sm75(_sim_cache):
    return load_probe("sm75_probes.cu", arch="sm_75")


def _ints(rng, shape, lim):
    return rng.integers(-lim, lim + 1, shape).astype(np.float32)


def _k8(mod, A, B, C, fault=0):
    D = np.full((16, 8), np.nan, np.float32)
    mod.launch(plan("mma_k8_direct", 1, 32, P(A.astype(np.float16).view(np.uint16)),
                    P(B.astype(np.float16).view(np.uint16)), P(C), P(D), i32(fault)))
    return D


def test_mma_m16n8k8_layout_exact_and_planted_faults_show(sm75):
    rng = np.random.default_rng(75)
    A, B, C = _ints(rng, (16, 8), 8), _ints(rng, (8, 8), 8), _ints(rng, (16, 8), 50)
    np.testing.assert_array_equal(_k8(sm75, A, B, C), A @ B + C)   # small integers: exact
    for fault in (1, 2, 3):   # rows g / g + 8 swapped; B's pair swapped; B read as a row
        assert not np.array_equal(_k8(sm75, A, B, C, fault), A @ B + C), fault


def test_m16n8k16_is_two_m16n8k8_and_bf16_has_no_sm75_form(sm75):
    rng = np.random.default_rng(76)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.full((16, 8), np.nan, np.float32)
    args = (P(A.view(np.uint16)), P(B.view(np.uint16)), P(C), P(D))
    sm75.launch(plan("mma_direct", 1, 32, *args, i32(0)))
    # two k8 steps, each rounded to float32 once: k 0..7 onto C, then k 8..15 onto that
    a, b = A.astype(np.float64), B.astype(np.float64)
    t = (a[:, :8] @ b[:8] + C).astype(np.float32)
    np.testing.assert_array_equal(D, (a[:, 8:] @ b[8:] + t).astype(np.float32))
    with pytest.raises(launcher.SimError, match=r"mma\.m16n8k16\.bf16 does not exist on sm_75"):
        sm75.launch(plan("mma_direct", 1, 32, *args, i32(1)))


def test_copies_are_synchronous_and_cp_async_does_not_exist(sm75):
    src = np.arange(1, 129, dtype=np.float32)
    for src_bytes, expect in ((16, np.roll(src, -4)), (0, np.zeros(128, np.float32))):
        out = np.full(128, np.nan, np.float32)
        sm75.launch(plan("sm75_copy", 1, 32, P(src), P(out), i32(src_bytes), i32(0)))
        np.testing.assert_array_equal(out, expect)
    out = np.zeros(128, np.float32)
    with pytest.raises(launcher.SimError, match="src_bytes 8 must be 0 or the copy size 16"):
        sm75.launch(plan("sm75_copy", 1, 32, P(src), P(out), i32(8), i32(0)))
    with pytest.raises(launcher.SimError, match="cp.async does not exist on sm_75"):
        sm75.launch(plan("sm75_copy", 1, 32, P(src), P(out), i32(16), i32(1)))
