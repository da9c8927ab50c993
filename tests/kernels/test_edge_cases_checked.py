"""Edge cases of every attention kernel under the simulator's checked mode (races, bounds,
uninitialised shared reads raise :class:`cuflash.sim.SimCheckError`).

* Tiles with an empty key range (a query tile that sees no key: causal with Sq > Sk, a window
  that misses every key) and key tiles with an empty query range (the backward's outer loop).
  The tensor-core forward once wrote O into rows of its Q buffer that other warps' ``cp.async``
  copies were still filling when no K/V tile ran (no barrier orders them): checked mode reports
  such a race, and on a GPU it can put Q data into rows that must be 0.
* Window bounds at and past 2**31 (normalised on the host; the kernels' own range helpers are
  tested with raw bounds in tests/kernels/test_window_bounds_sim.py).
* NaN input (the non-finite rule's patterns are tests/kernels/test_nonfinite.py; here the point is
  that the kernels stay inside their views and barriers whatever the data).

Results are held to the float64 oracle (tolerance rule; -inf/NaN patterns of lse exactly).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.options import check_attention
from support.tolerance import check_close
from support.grads import check_grads_close

import cuflash
from cuflash import reference as ref
from cuflash import sim
from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_sm90,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
    attention_fwd_sm90,
    dispatch,
)
from cuflash.runtime import dtypes, validation

pytestmark = pytest.mark.checked

#: (name, simulated arch, dtype, head dim, forward tier, backward tier)
TIERS = [
    ("simt_f32", "sm_75", dtypes.float32, 32, attention_fwd_simt, attention_bwd_simt),
    ("simt_bf16", "sm_75", dtypes.bfloat16, 64, attention_fwd_simt, attention_bwd_simt),
    ("mma_f16", "sm_80", dtypes.float16, 64, attention_fwd_mma, attention_bwd_mma),
    ("mma_bf16_d128", "sm_80", dtypes.bfloat16, 128, attention_fwd_mma, attention_bwd_mma),
    ("mma_f16_d128_sm90", "sm_90", dtypes.float16, 128, attention_fwd_mma, attention_bwd_mma),   # 64 x 128 keys
    ("mma_bf16_d256_sm90", "sm_90", dtypes.bfloat16, 256, attention_fwd_mma, attention_bwd_mma),
    # the Hopper forward (its LSE into the Hopper backward, and at d256 into the tensor-core one)
    ("sm90_f16_d128", "sm_90", dtypes.float16, 128, attention_fwd_sm90, attention_bwd_sm90),
    ("sm90_bf16_d256", "sm_90", dtypes.bfloat16, 256, attention_fwd_sm90, attention_bwd_mma),
]
#: (name, Sq, Sk, causal, window_size)
CASES = [
    ("causal_sq146_sk1", 146, 1, True, (-1, -1)),         # every row but the last sees no key
    ("window_empties_tiles", 256, 64, False, (-1, 0)),   # rows 0..191 see no key: whole empty tiles
    ("keys_nobody_sees", 64, 256, False, (5, 0)),        # key tiles 0..186 have no query row
    ("window_past_2_31", 40, 70, False, (2**31 + 5, 2**40)),
    ("int32_max_right", 70, 40, True, (2**31 - 1, -1)),
]


@pytest.fixture(autouse=True)
def _checked():
    with sim.options(checked=True):
        yield


def _expect_tier(problem, arch, arrays, fwd, bwd):
    a = sim.parse_arch(arch)
    assert dispatch.forward_tier(problem, a, arrays[:3]) is fwd
    assert dispatch.backward_tier(problem, a, arrays) is bwd


def _tier_cases():
    """Every tier with every case; the default run takes a diagonal (each tier once, each case at
    least once) and the rest runs under ``slow``."""
    return [pytest.param(t, c, id=f"{t[0]}-{c[0]}", marks=() if j % len(CASES) == i else (pytest.mark.slow,))
            for j, t in enumerate(TIERS) for i, c in enumerate(CASES)]


@pytest.mark.parametrize("tier,case", _tier_cases())
def test_forward_and_backward_clean(tier, case, rng, request):
    if tier[1] == "sm_90" and tier[4] is attention_fwd_mma:   # the tensor-core tier's own sm_90 rows
        request.getfixturevalue("without_hopper_tier")
    _, arch, dtype, d, fwd, bwd = tier
    _, sq, sk, causal, window = case
    q = rng.standard_normal((1, 2, sq, d)).astype(dtype)
    k = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    v = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    kw = dict(causal=causal, window_size=window)
    _expect_tier(check_attention(q, k, v, **kw), arch, (q, k, v, q, q), fwd, bwd)
    with sim.options(arch=arch):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
        check_close(out, q, k, v, **kw)
        _, lse64 = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))
        empty = np.isneginf(lse64)
        assert (np.asarray(out)[empty] == 0).all()  # rows without keys are exactly 0, no Q data
        dout = rng.standard_normal(out.shape).astype(dtype)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("tier", TIERS, ids=[t[0] for t in TIERS])
def test_nan_input_stays_in_bounds(tier, rng):
    _, arch, dtype, d, _, _ = tier
    q = rng.standard_normal((1, 2, 97, d)).astype(dtype)
    k = rng.standard_normal((1, 1, 80, d)).astype(dtype)
    v = rng.standard_normal((1, 1, 80, d)).astype(dtype)
    q[0, 1, 40, 3] = np.nan
    k[0, 0, 30, 1] = np.nan
    v[0, 0, 70, 2] = np.inf
    with sim.options(arch=arch):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
        grads = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, backend="sim")
    o64, l64 = ref.naive_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(l64))
    assert (~np.isfinite(out).all(-1) >= ~np.isfinite(o64).all(-1)).all()
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))
