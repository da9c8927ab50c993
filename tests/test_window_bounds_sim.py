"""Window bounds up to INT32_MAX in every attention kernel (the range helpers of
kernels_cu/common.cuh), on the simulator against the float64 oracle.

flash-attn users pass 2**31 - 1 to mean "unbounded", and a window wider than the sequence is
valid; a kernel that adds such a bound to an index in 32 bits wraps and empties rows. Each case
runs the four attention kernels (SIMT and tensor-core, forward and backward) with bounds at and
just below INT32_MAX and compares with the NumPy oracle, which computes in Python integers.
"""

from __future__ import annotations

import numpy as np
import pytest
from _tolerance import check_close
from test_backward_reference import check_grads_close, make_qkv

import cuflash
from cuflash import reference as ref
from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
    dispatch,
)
from cuflash.runtime import validation

BIG = 2**31 - 1
#: (Sq, Sk, causal, window): the shapes where 32-bit sums wrapped
CASES = [
    (1, 1, False, (-1, BIG)),
    (120, 120, False, (-1, BIG - 50)),
    (120, 120, False, (BIG - 3, BIG - 100)),
    (200, 50, False, (BIG, -1)),
    (200, 50, True, (BIG, -1)),
    (37, 90, False, (BIG, 3)),
    # a left bound that cuts through key tiles while the right side is open: the tensor-core
    # forward must then mask a tile by its last row's bound, not its first row's
    (130, 300, False, (40, -1)),
    (200, 200, False, (70, BIG)),
]
#: (simulated arch, dtype, head dim, forward tier, backward tier)
TIERS = [
    ("sm_75", np.float32, 32, attention_fwd_simt, attention_bwd_simt),
    ("sm_80", np.float16, 64, attention_fwd_mma, attention_bwd_mma),
]


@pytest.mark.parametrize("arch,dtype,d,fwd_tier,bwd_tier", TIERS, ids=[t[0] for t in TIERS])
@pytest.mark.parametrize("sq,sk,causal,window", CASES, ids=[f"{c[0]}x{c[1]}-{'c' if c[2] else ''}{c[3]}" for c in CASES])
def test_bounds_near_int32_max(arch, dtype, d, fwd_tier, bwd_tier, sq, sk, causal, window, rng):
    q, k, v = make_qkv(rng, 1, 2, 1, sq, sk, d, d, dtype=dtype)
    kw = dict(causal=causal, window_size=window)
    problem = validation.check_attention(q, k, v, **kw)
    with cuflash.sim.options(arch=arch):
        a = cuflash.sim.current_options().arch
        assert dispatch.forward_tier(problem, a, (q, k, v)) is fwd_tier
        assert dispatch.backward_tier(problem, a, (q, k, v, q, q)) is bwd_tier
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
        check_close(out, q, k, v, **kw)
        _, lse64 = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))  # no row emptied by a wrap
        dout = rng.standard_normal(out.shape).astype(dtype)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
