"""Window bounds up to INT32_MAX and beyond, on every backend, against the float64 oracle.

flash-attn users pass 2**31 - 1 to mean "unbounded", and a window wider than the sequence is
valid; a kernel that adds such a bound to an index in 32 bits wraps and empties rows, and a
bound >= 2**31 does not even fit the kernels' int arguments. Two defences, each tested:

* the host normalises once (:func:`cuflash.runtime.validation.normalize_window`): a bound of
  Sq + Sk or more excludes nothing and becomes -1, so any int >= -1 works on every backend;
* the kernels' range helpers (kernels_cu/common.cuh) are overflow-free for every bound an int
  holds: the four attention kernels (SIMT and tensor-core, forward and backward) are also run
  with the raw, un-normalised bounds at and just below INT32_MAX.

The NumPy oracle computes the mask in Python integers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.device import on_device, sim_call
from support.grads import check_grads_close, make_qkv
from support.options import check_attention
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
    backward_run,
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
    problem = check_attention(q, k, v, **kw)
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


def test_host_normalises_bounds_that_reach_past_both_sequences():
    q = np.zeros((1, 1, 7, 8), np.float32)
    k = np.zeros((1, 1, 5, 8), np.float32)
    for window, want in [((12, 11), (-1, 11)), ((11, 12), (11, -1)), ((2**31 - 1, 2**70), (-1, -1)),
                         ((0, 0), (0, 0)), ((-1, 2**31), (-1, -1))]:
        p = check_attention(q, k, k, window_size=window)
        assert (p.window_left, p.window_right) == want, window
    assert check_attention(q, k, k, causal=True, window_size=(2**40, 3)).window_right == 0


@pytest.mark.parametrize("backend", ["numpy", "sim_simt", "sim_mma"])
@pytest.mark.parametrize("window", [(-1, 2**31), (2**31, 2**31 + 1), (2**63, 3), (40, 2**64)],
                         ids=["r2^31", "both", "l2^63", "r2^64"])
def test_bounds_at_and_past_2_31_on_every_backend(backend, window, rng):
    dtype = np.float32 if backend != "sim_mma" else np.float16
    q, k, v = make_qkv(rng, 1, 2, 1, 90, 70, 64, 64, dtype=dtype)
    kw = dict(window_size=window)
    arch = {"sim_simt": "sm_75", "sim_mma": "sm_80"}.get(backend)
    with cuflash.sim.options(**({"arch": arch} if arch else {})):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend.split("_")[0], **kw)
        grads = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend=backend.split("_")[0], **kw)
    check_close(out, q, k, v, **kw)
    check_grads_close(grads, np.ones_like(out), q, k, v, out, lse, **kw)


@pytest.mark.parametrize("arch,dtype,d,fwd_tier,bwd_tier", TIERS, ids=[t[0] for t in TIERS])
@pytest.mark.parametrize("sq,sk,causal,window", CASES[:4], ids=[f"{c[0]}x{c[1]}-{c[3]}" for c in CASES[:4]])
def test_kernels_with_raw_bounds_near_int32_max(arch, dtype, d, fwd_tier, bwd_tier, sq, sk, causal, window, rng):
    """The kernels' own index math, bypassing the host's normalisation: the problem is handed to
    the tiers with the bounds exactly as given."""
    q, k, v = make_qkv(rng, 1, 2, 1, sq, sk, d, d, dtype=dtype)
    kw = dict(causal=causal, window_size=window)
    problem = check_attention(q, k, v, return_lse=True, **kw)
    left, right = validation.check_window_size(window, causal, "test")
    raw = dataclasses.replace(problem, window_left=left, window_right=right)
    assert (raw.window_left, raw.window_right) != (problem.window_left, problem.window_right)
    with cuflash.sim.options(arch=arch), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, raw, q, k, v)
        out, lse = fwd_tier.forward(p, qd, kd, vd, None, call)
        out, lse = call.export(out), call.export(lse)
        check_close(out, q, k, v, **kw)
        _, lse64 = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))
        dout = rng.standard_normal(out.shape).astype(dtype)
        main = bwd_tier.main_variant(p, call.arch)
        grads = backward_run.backward(p, *(call.import_array(x) for x in (dout, q, k, v, out, lse)), main, call)
        grads = tuple(call.export(g) for g in grads)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
