"""The tensor-core backward (kernels_cu/attention_bwd_mma.cu) on the CUDA simulator.

dq, dk, dv against the float64 gradients with the gradient tolerance rule of
tests/test_backward_reference.py over a pairwise covering design (odd lengths, head dims 40 to
128 with Dv != D, GQA, causal and windows, both layouts, a non-contiguous dout, fp16/bf16, default
and deterministic modes); the dispatcher's choice and its fallbacks to the SIMT backward;
bit-identical deterministic results under different thread orders.
"""

from __future__ import annotations

import numpy as np
import pytest
from allpairspy import AllPairs
from test_backward_reference import check_grads_close, make_qkv

import cuflash
from cuflash.kernels import attention_bwd_mma, attention_bwd_simt, dispatch
from cuflash.reference import backward as ref_backward
from cuflash.runtime import dtypes

LENGTHS = [1, 17, 97, 128]
HEAD_DIMS = [40, 64, 96, 128]
DV = ["same", "other"]
HEADS = [(1, 1), (7, 1), (8, 2)]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)), "causal_win": (True, (20, -1)),
         "win_2_31": (False, (2**31 + 3, 2**31 - 1))}
FORMS = ["bhsd", "bshd", "dout_transposed"]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
MODES = ["atomic", "deterministic"]

AXES = [LENGTHS, LENGTHS, HEAD_DIMS, DV, HEADS, list(MASKS), FORMS, list(DTYPES), MODES]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


def _problem(dout, q, k, v, out, lse, **kw):
    return ref_backward.check_backward(dout, q, k, v, out, lse, softmax_scale=None, func="test", max_head_dim=256, **kw)


def run_case(rng, sq, sk, d, dv_kind, heads, mask, form, dtype_key, mode, seed=0):
    hq, hk = heads
    dv = d if dv_kind == "same" else HEAD_DIMS[(HEAD_DIMS.index(d) + 2) % len(HEAD_DIMS)]
    dtype = DTYPES[dtype_key]
    layout = "bshd" if form == "bshd" else "bhsd"
    q, k, v = make_qkv(rng, 1, hq, hk, sq, sk, d, dv, layout=layout, dtype=dtype)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)  # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(dtype)
    if form == "dout_transposed":  # a non-contiguous dout: a bhsd view of bshd storage
        dout = np.ascontiguousarray(dout.swapaxes(1, 2)).swapaxes(1, 2)
    tier = dispatch.backward_tier(_problem(dout, q, k, v, out, lse, **kw), 90, (q, k, v, out, dout))
    assert tier is attention_bwd_mma
    with cuflash.sim.options(seed=seed):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim",
                                           deterministic=mode == "deterministic", **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return grads


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,mode", PAIRWISE)
def test_pairwise_grid(sq, sk, d, dv, heads, mask, form, dtype, mode, rng):
    run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, mode)


@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_bits_across_thread_orders(d, monkeypatch):
    # two key tiles per split (the partial read-modify-write path) and GQA
    monkeypatch.setattr(attention_bwd_simt, "MAX_DETERMINISTIC_SPLITS", 2)
    a = run_case(np.random.default_rng(5), 45, 250, d, "same", (4, 2), "causal", "bhsd", "bf16", "deterministic", seed=1)
    b = run_case(np.random.default_rng(5), 45, 250, d, "same", (4, 2), "causal", "bhsd", "bf16", "deterministic", seed=31337)
    for x, y in zip(a, b):
        assert np.array_equal(np.ascontiguousarray(x).view(np.uint16), np.ascontiguousarray(y).view(np.uint16))


def test_rows_without_keys_have_zero_dq(rng):
    grads = run_case(rng, 40, 9, 64, "same", (7, 1), "causal", "bhsd", "f16", "atomic")
    assert (grads[0][:, :, :31] == 0).all() and all(not np.isnan(g).any() for g in grads)


def test_fallbacks_to_simt(rng):
    def tier(d, dv, dtype=dtypes.float16, arch=90, offset=False):
        q, k, v = make_qkv(rng, 1, 2, 1, 9, 11, d, dv, dtype=dtype)
        if offset:  # a view one element into its buffer: not 16-byte aligned
            q = np.concatenate([np.zeros(1, q.dtype), q.ravel()])[1:].reshape(q.shape)
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        p = _problem(out, q, k, v, out, lse)
        return dispatch.backward_tier(p, arch, (q, k, v, out, out))

    assert tier(64, 64) is attention_bwd_mma and tier(128, 40) is attention_bwd_mma
    assert tier(60, 64) is attention_bwd_simt  # D not a multiple of 8
    assert tier(192, 192) is attention_bwd_simt  # above the largest backward bucket
    assert tier(64, 64, dtype=dtypes.float32) is attention_bwd_simt
    assert tier(64, 64, arch=75) is attention_bwd_simt
    assert tier(64, 64, offset=True) is attention_bwd_simt


def test_simt_backward_still_serves_fp16_where_the_mma_cannot(rng):
    # sm_75 has no tensor-core backward: the portable kernel's fp16/bf16 main stage runs
    with cuflash.sim.options(arch="sm_75"):
        for dt in ("f16", "bf16"):
            q, k, v = make_qkv(rng, 1, 2, 1, 19, 37, 64, 64, dtype=DTYPES[dt])
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            dout = rng.standard_normal(out.shape).astype(DTYPES[dt])
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="sim")
            check_grads_close(grads, dout, q, k, v, out, lse, causal=True)


def test_variants():
    assert attention_bwd_mma.all_variants(75) == ()
    for arch in attention_bwd_mma.ARCHES:
        for var in attention_bwd_mma.all_variants(arch):
            assert var.smem_bytes <= 99 * 1024  # sm_86/89's opt-in limit


@pytest.mark.parametrize("mode", MODES)
def test_checked_mode(mode, rng, monkeypatch):
    # the simulator's checked mode: out-of-view global accesses, reads of unwritten shared memory
    # and shared-memory races (e.g. dS between its writers and the dQ pass) raise SimCheckError
    monkeypatch.setattr(attention_bwd_simt, "MAX_DETERMINISTIC_SPLITS", 2)
    with cuflash.sim.options(checked=True):
        run_case(rng, 37, 150, 64, "other", (4, 2), "causal_win", "bshd", "f16", mode)
        run_case(rng, 20, 70, 128, "same", (2, 1), "window", "dout_transposed", "bf16", mode)
