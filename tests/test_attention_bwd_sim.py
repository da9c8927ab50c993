"""The portable backward kernel (kernels_cu/attention_bwd_simt.cu) on the CUDA simulator.

dq, dk, dv against the float64 gradients with the gradient tolerance rule of
tests/test_backward_reference.py, over a pairwise covering design: odd lengths, head dims 40 to
256 with Dv != D, GQA 7:1 and 8:2, causal and windows (rows without keys), both layouts and a
non-contiguous dout. Fresh gradients are NaN-poisoned before the launches.
"""

from __future__ import annotations

import numpy as np
import pytest
from allpairspy import AllPairs
from test_backward_reference import check_grads_close, make_qkv

import cuflash
from cuflash.kernels import attention_bwd_simt
from cuflash.runtime import dtypes

LENGTHS = [1, 17, 97, 128]
HEAD_DIMS = [40, 64, 96, 128, 256]
DV = ["same", "other"]
HEADS = [(1, 1), (7, 1), (8, 2)]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)), "causal_win": (True, (20, -1)),
         "win_2_31": (False, (2**31 + 3, 2**31 - 1))}
FORMS = ["bhsd", "bshd", "dout_transposed"]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}

AXES = [LENGTHS, LENGTHS, HEAD_DIMS, DV, HEADS, list(MASKS), FORMS, list(DTYPES)]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


@pytest.fixture(autouse=True)
def _portable_tier():
    """Run as an sm_75 device would: the portable backward is its only tier there, so every dtype
    of this grid exercises it. (On the default sm_90, aligned fp16/bf16 views go to the
    tensor-core backward, whose grid is tests/test_attention_bwd_mma_sim.py.)"""
    with cuflash.sim.options(arch="sm_75"):
        yield


def test_grid_runs_the_portable_backward():
    from cuflash.kernels import dispatch
    from cuflash.runtime import validation

    q = np.zeros((1, 2, 16, 64), np.float16)
    problem = validation.check_attention(q, q, q)
    assert dispatch.backward_tier(problem, cuflash.sim.current_options().arch) is attention_bwd_simt


def run_backward_case(rng, sq, sk, d, dv_kind, heads, mask, form, dtype_key, scale=1.0):
    hq, hk = heads
    dv = d if dv_kind == "same" else HEAD_DIMS[(HEAD_DIMS.index(d) + 2) % len(HEAD_DIMS)]
    dtype = DTYPES[dtype_key]
    layout = "bshd" if form == "bshd" else "bhsd"
    q, k, v = make_qkv(rng, 1, hq, hk, sq, sk, d, dv, layout=layout, dtype=dtype, scale=scale)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)  # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(dtype)
    if form == "dout_transposed":  # a non-contiguous dout: a bhsd view of bshd storage
        dout = np.ascontiguousarray(dout.swapaxes(1, 2)).swapaxes(1, 2)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return grads, lse


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype", PAIRWISE)
def test_pairwise_grid(sq, sk, d, dv, heads, mask, form, dtype, rng):
    run_backward_case(rng, sq, sk, d, dv, heads, mask, form, dtype)


def test_rows_without_keys_have_zero_dq_and_no_nan(rng):
    # causal with Sq > Sk: the first Sq - Sk rows see nothing
    grads, lse = run_backward_case(rng, 40, 9, 64, "same", (7, 1), "causal", "bhsd", "f16")
    dq = grads[0]
    assert np.isneginf(lse[:, :, :31]).all()
    assert (dq[:, :, :31] == 0).all()
    assert all(not np.isnan(g).any() for g in grads)


def test_large_logits(rng):
    # |s| ~ 1e3: P recomputed from the saved LSE stays finite; gradients within the rule (whose
    # recompute term accounts for the rounding of large scores)
    run_backward_case(rng, 33, 70, 64, "same", (2, 1), "causal", "bhsd", "f32", scale=6.0)


def test_no_keys_and_no_queries(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 5, 0, 32, 16, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="sim")
    assert (dq == 0).all() and dk.shape == (1, 1, 0, 32) and dv.shape == (1, 1, 0, 16)
    q, k, v = make_qkv(rng, 1, 2, 1, 0, 7, 32, 16, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="sim")
    assert dq.shape == (1, 2, 0, 32) and (dk == 0).all() and (dv == 0).all()


def test_gqa_dk_dv_sum_over_the_group(rng):
    # dK of a kv head equals the sum of the per-query-head gradients with K repeated (MHA)
    q, k, v = make_qkv(rng, 1, 6, 2, 19, 23, 32, 32, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="sim")
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    dq_r, dk_r, dv_r = cuflash.attention_backward(dout, q, kr, vr, out, lse, causal=True, backend="sim")
    np.testing.assert_allclose(dq, dq_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk, dk_r.reshape(1, 2, 3, 23, 32).sum(axis=2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, dv_r.reshape(1, 2, 3, 23, 32).sum(axis=2), rtol=1e-5, atol=1e-5)


def test_variants_and_float64():
    for arch in attention_bwd_simt.ARCHES:
        for v in attention_bwd_simt.all_variants(arch):
            assert v.smem_bytes <= 64 * 1024  # sm_75's opt-in limit, the smallest
    x = np.zeros((1, 1, 4, 8))
    with pytest.raises(NotImplementedError, match=r"float64 runs on the NumPy path only"):
        cuflash.attention_backward(x, x, x, x, x, np.zeros((1, 1, 4)), backend="sim")
