"""The tensor-core backward (kernels_cu/attention_bwd_mma.cu) on the CUDA simulator.

dq, dk, dv against the float64 gradients with the gradient tolerance rule of
tests/test_backward_reference.py over a pairwise covering design (odd lengths, 300 for several
query tiles per key tile and unmasked interior tiles, head dims 40 to 256 with Dv != D, GQA,
causal and windows, both layouts, a non-contiguous dout, fp16/bf16, default and deterministic
modes); the one-stage and 64 x 64 tiles of smaller shared memories (sm_80, sm_86); checked mode;
the dispatcher's choice and its fallbacks to the SIMT backward; bit-identical deterministic
results under different thread orders.
"""

from __future__ import annotations

import numpy as np
import pytest
from allpairspy import AllPairs
from test_backward_reference import check_grads_close, make_qkv

import cuflash
from cuflash.kernels import attention_bwd_mma, attention_bwd_simt, dispatch
from cuflash.reference import backward as ref_backward
from cuflash.runtime import dtypes, plan

LENGTHS = [1, 17, 97, 128, 300]
HEAD_DIMS = [40, 64, 96, 128, 176, 256]
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


def run_case(rng, sq, sk, d, dv_kind, heads, mask, form, dtype_key, mode, seed=0, arch=90, dv=None):
    hq, hk = heads
    if dv is None:
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
    tier = dispatch.backward_tier(_problem(dout, q, k, v, out, lse, **kw), arch, (q, k, v, out, dout))
    assert tier is attention_bwd_mma
    with cuflash.sim.options(seed=seed, arch=f"sm_{arch}"):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim",
                                           deterministic=mode == "deterministic", **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return grads


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,mode", PAIRWISE)
def test_pairwise_grid(sq, sk, d, dv, heads, mask, form, dtype, mode, rng):
    run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, mode)


@pytest.mark.parametrize("d", [64, 128, 256])
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
    assert tier(192, 192) is attention_bwd_mma and tier(256, 64) is attention_bwd_mma
    assert tier(128, 128, arch=86) is attention_bwd_mma  # 64 x 64, one stage, in 99 KB
    assert tier(192, 192, arch=86) is attention_bwd_simt  # no 192 tile fits 99 KB
    assert tier(60, 64) is attention_bwd_simt  # D not a multiple of 8
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
    buckets = {arch: sorted({v.head_dim_max for v in attention_bwd_mma.all_variants(arch)}) for arch in (80, 86, 90)}
    assert buckets == {80: [64, 128, 192, 256], 86: [64, 128], 90: [64, 128, 192, 256]}
    for arch in (80, 86, 89, 90):
        for var in attention_bwd_mma.all_variants(arch):
            assert var.smem_bytes <= plan.max_dynamic_smem(arch) and var.threads == 256
    # the preferred tiles (FA2's: 64 x 128 up to head dim 128, 64 x 64 above; two stages on sm_90)
    tile = lambda d, arch: (lambda v: (v.block_m, v.block_n, v.stages))(  # noqa: E731
        attention_bwd_mma.choose_variant(dtypes.bfloat16, d, d, arch))
    assert [tile(d, 90) for d in (64, 128, 192, 256)] == [(64, 128, 2), (64, 128, 2), (64, 64, 2), (64, 64, 2)]
    assert [tile(d, 80) for d in (64, 128, 192, 256)] == [(64, 128, 2), (64, 64, 2), (64, 64, 1), (64, 64, 1)]
    assert tile(128, 86) == (64, 64, 1)
    with pytest.raises(NotImplementedError, match="no tensor-core backward tile fits sm_86"):
        attention_bwd_mma.choose_variant(dtypes.bfloat16, 256, 256, 86)


@pytest.mark.parametrize("arch,d,dv,sq,sk", [(80, 192, 176, 150, 130), (80, 256, 256, 70, 200), (80, 128, 96, 200, 75),
                                            (86, 128, 128, 150, 130)])
def test_smaller_shared_memories(arch, d, dv, sq, sk, rng):
    # the one-stage pipeline (its refill barrier) and the 64 x 64 tile at head dim 128
    for mode, mask in (("atomic", "causal"), ("deterministic", "window")):
        run_case(rng, sq, sk, d, "other", (4, 2), mask, "bhsd", "bf16", mode, arch=arch, dv=dv)


@pytest.mark.parametrize("mode", MODES)
def test_checked_mode(mode, rng, monkeypatch):
    # the simulator's checked mode: out-of-view global accesses, reads of unwritten shared memory
    # and shared-memory races (e.g. dS between its writers and the dQ pass) raise SimCheckError
    monkeypatch.setattr(attention_bwd_simt, "MAX_DETERMINISTIC_SPLITS", 2)
    with cuflash.sim.options(checked=True):
        run_case(rng, 37, 150, 64, "other", (4, 2), "causal_win", "bshd", "f16", mode)
        run_case(rng, 20, 70, 128, "same", (2, 1), "window", "dout_transposed", "bf16", mode)
        # four query tiles per key tile and query head: both stages refilled while others read
        run_case(rng, 250, 140, 128, "same", (2, 1), "causal", "bhsd", "bf16", mode)
        run_case(rng, 130, 70, 256, "same", (2, 1), "none", "bhsd", "bf16", mode, arch=80)   # one stage


@pytest.mark.parametrize("d,dv,causal", [(96, 96, False), (176, 128, True)])
def test_strided_views_in_nan_filled_buffers(d, dv, causal, rng):
    # q, k, v, dout are views into NaN-filled buffers (a head sliced off, 24 extra columns, a
    # 16-byte offset): the kernel may read only the views' elements, zero-filling the columns up
    # to its bucket; NaN anywhere in the result, or a checked-mode report, means it read outside
    def view(b, h, s, c, dtype):
        buf = np.full((b, h + 1, s, c + 24), np.nan, dtype)
        x = buf[:, 1:, :, 8:8 + c]
        x[...] = rng.standard_normal(x.shape).astype(dtype)
        return x

    dt = dtypes.bfloat16
    q, k, v = view(2, 4, 150, d, dt), view(2, 2, 130, d, dt), view(2, 2, 130, dv, dt)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = view(2, 4, 150, dv, dt)
    assert dispatch.backward_tier(_problem(dout, q, k, v, out, lse, causal=causal), 90,
                                  (q, k, v, out, dout)) is attention_bwd_mma
    with cuflash.sim.options(checked=True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="sim")
    assert not any(np.isnan(g.astype(np.float32)).any() for g in grads)
    check_grads_close(grads, dout, q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,mode", PAIRWISE)
def test_pairwise_grid_checked(sq, sk, d, dv, heads, mask, form, dtype, mode, rng, monkeypatch):
    # the whole grid again in checked mode (races, bounds, uninitialised shared reads, cp.async in
    # flight; about 40 s), deterministic mode with two splits so partials are read back
    monkeypatch.setattr(attention_bwd_simt, "MAX_DETERMINISTIC_SPLITS", 2)
    with cuflash.sim.options(checked=True):
        run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, mode)
