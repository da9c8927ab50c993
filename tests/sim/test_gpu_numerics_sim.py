"""The simulator's GPU-numerics option (``cuflash.sim.options(gpu_numerics=True)``, issue 16
class 9): the kernels' tolerance tests under it. The
tolerance rule (:mod:`cuflash.reference.tolerance`) must hold with the GPU's flush-to-zero, FMA
contraction, approximate exp2f/expf/logf and truncating tensor-core sums, not only with exact
arithmetic. (The rules one by one: tests/sim/test_sim_hazards.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from support.tolerance import check_close
from support.grads import check_grads_close

import cuflash
from cuflash import sim
from cuflash.runtime import dtypes
from cuflash.sim import launcher

pytestmark = pytest.mark.skipif(
    launcher.platform.machine().lower() not in ("x86_64", "amd64"), reason="gpu_numerics needs x86-64 with FMA")


TIERS = [
    ("simt_f32", "sm_75", dtypes.float32, 64),
    ("mma_f16", "sm_80", dtypes.float16, 64),
    ("mma_bf16_d128", "sm_90", dtypes.bfloat16, 128),
]


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("tier", [pytest.param(t, id=t[0], marks=() if t[0] == "mma_bf16_d128" else (pytest.mark.slow,))
                                  for t in TIERS])
def test_kernels_meet_the_tolerance_with_gpu_numerics(tier, causal, rng):
    _, arch, dtype, d = tier
    q = rng.standard_normal((1, 2, 130, d)).astype(dtype)
    k = rng.standard_normal((1, 2, 97, d)).astype(dtype)
    v = rng.standard_normal((1, 2, 97, d)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    res = {}
    for gpu in (False, True):
        with sim.options(arch=arch, gpu_numerics=gpu):
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, backend="sim")
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="sim")
        res[gpu] = (out, lse, grads)
    out, lse, grads = res[True]
    check_close(out, q, k, v, causal=causal)
    check_grads_close(grads, dout, q, k, v, out, lse, causal=causal)
    # the option took effect: the GPU rounding changed the float32 statistics
    assert not np.array_equal(res[False][1], lse)
