"""The NumPy backward (float64 oracle and tiled FlashAttention-2 backward) against finite
differences of the forward, against float64 math, and the public ``attention_backward``."""

from __future__ import annotations

import numpy as np
import pytest

from support.grads import (
    LOW,
    check_grads_close,
    exact_grads,
    finite_difference_grads,
    make_qkv,
    randn,
    recompute_sensitivity,
)

from cuflash import reference as ref
from cuflash.api.backward import attention_backward as api_backward
from cuflash.reference.backward import attention_backward, flash_attention_backward
from cuflash.runtime import dtypes

# ---------------------------------------------------------------------------- float64 oracle vs calculus

# (B, Hq, Hk), Sq, Sk, D, Dv, options, layout
FD_CASES = [
    ((1, 2, 2), 3, 4, 3, 2, dict(), "bhsd"),
    ((1, 4, 2), 3, 5, 2, 3, dict(causal=True), "bhsd"),  # GQA, causal, Sq < Sk
    ((2, 2, 1), 5, 3, 2, 2, dict(causal=True), "bhsd"),  # MQA, causal, Sq > Sk: two empty rows
    ((1, 2, 1), 4, 6, 3, 2, dict(window_size=(1, 1), softmax_scale=0.7), "bhsd"),
    ((1, 2, 1), 5, 4, 2, 3, dict(window_size=(0, 0)), "bshd"),  # bshd, GQA, the first row sees no key
    ((None, None, None), 4, 3, 3, 2, dict(causal=True, window_size=(1, -1)), "bhsd"),  # 2-D input
]


@pytest.mark.parametrize("heads,sq,sk,d,dv,kw,layout", FD_CASES)
def test_oracle_matches_finite_differences(heads, sq, sk, d, dv, kw, layout, rng):
    if heads[0] is None:
        q, k, v = randn(rng, (sq, d)), randn(rng, (sk, d)), randn(rng, (sk, dv))
    else:
        q, k, v = make_qkv(rng, *heads, sq, sk, d, dv, layout)
    kw = dict(kw, layout=layout)
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
    dout = randn(rng, out.shape)
    grads = attention_backward(dout, q, k, v, out, lse, **kw)
    fd = finite_difference_grads(dout, q, k, v, **kw)
    for name, g, f, x in zip(("dq", "dk", "dv"), grads, fd, (q, k, v)):
        assert g.dtype == np.float64 and g.shape == x.shape, name
        np.testing.assert_allclose(g, f, rtol=1e-6, atol=1e-8, err_msg=name)
    # the tiled backward in float64 agrees with both
    tiled = flash_attention_backward(dout, q, k, v, out, lse, block_m=2, block_n=3, **kw)
    for name, t, f in zip(("dq", "dk", "dv"), tiled, fd):
        assert t.dtype == np.float64
        np.testing.assert_allclose(t, f, rtol=1e-6, atol=1e-8, err_msg=name)


def test_zero_scale_gradients_in_closed_form(rng):
    # softmax_scale=0: P is uniform over the visible keys, so dq = dk = 0 exactly and
    # dv[j] = sum over rows i that see j of dout[i] / n_visible(i).
    sq, sk = 5, 7
    q, k, v = randn(rng, (2, sq, 4)), randn(rng, (2, sk, 4)), randn(rng, (2, sk, 3))
    out, lse = ref.naive_attention(q, k, v, causal=True, softmax_scale=0.0, return_lse=True)
    dout = randn(rng, out.shape)
    expected_dv = np.zeros_like(v)
    for i in range(sq):
        n_visible = i + sk - sq + 1
        expected_dv[:, :n_visible] += dout[:, i : i + 1] / n_visible
    for fn in (attention_backward, flash_attention_backward):
        dq, dk, dv = fn(dout, q, k, v, out, lse, causal=True, softmax_scale=0.0)
        np.testing.assert_array_equal(dq, 0)
        np.testing.assert_array_equal(dk, 0)
        np.testing.assert_allclose(dv, expected_dv, rtol=1e-13, atol=1e-15)


def test_gqa_gradients_sum_over_the_group(rng):
    # dk, dv of a kv head are the sums of the gradients of its repeated copies (query head h
    # reads kv head h // group).
    q, k, v = make_qkv(rng, 2, 6, 2, 7, 9, 4, 5)
    kw = dict(causal=True)
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
    dout = randn(rng, out.shape)
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    dq_r, dk_r, dv_r = attention_backward(dout, q, kr, vr, out, lse, **kw)
    for fn in (attention_backward, flash_attention_backward):
        dq, dk, dv = fn(dout, q, k, v, out, lse, **kw)
        np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 9, 4).sum(axis=2), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 9, 5).sum(axis=2), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- tiled vs naive


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (3, 5), (16, 8), (1000, 1000)])
def test_tiling_does_not_change_the_gradients(block_m, block_n, rng):
    q, k, v = make_qkv(rng, 2, 4, 2, 21, 27, 12, 8)
    for kw in (dict(), dict(causal=True), dict(window_size=(5, 2)), dict(causal=True, window_size=(3, -1))):
        out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
        dout = randn(rng, out.shape)
        expected = attention_backward(dout, q, k, v, out, lse, **kw)
        tiled = flash_attention_backward(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n, **kw)
        for name, t, e in zip(("dq", "dk", "dv"), tiled, expected):
            np.testing.assert_allclose(t, e, rtol=1e-11, atol=1e-13, err_msg=f"{name} {kw}")


# dtype, (B, Hq, Hk), Sq, Sk, D, Dv, options, layout, (block_m, block_n)
LOW_CASES = [
    (dtypes.float16, (2, 4, 2), 33, 47, 32, 16, dict(causal=True), "bhsd", (16, 16)),
    (dtypes.bfloat16, (1, 6, 1), 47, 33, 24, 40, dict(causal=True), "bshd", (8, 32)),
    (dtypes.float32, (2, 3, 3), 40, 40, 64, 64, dict(window_size=(7, 3)), "bhsd", (1, 1000)),
    (dtypes.float16, (1, 2, 2), 17, 65, 40, 40, dict(softmax_scale=0.3), "bshd", (1000, 7)),
    (dtypes.bfloat16, (2, 4, 4), 30, 30, 16, 16, dict(window_size=(-1, 4)), "bhsd", (64, 128)),
    (dtypes.float32, (1, 8, 2), 19, 51, 8, 24, dict(causal=True), "bshd", (5, 3)),
]


@pytest.mark.parametrize("dtype,heads,sq,sk,d,dv,kw,layout,blocks", LOW_CASES)
def test_tiled_low_precision_within_tolerance_rule(dtype, heads, sq, sk, d, dv, kw, layout, blocks, rng):
    q, k, v = make_qkv(rng, *heads, sq, sk, d, dv, layout, dtype)
    kw = dict(kw, layout=layout)
    out, lse = ref.flash_attention(q, k, v, return_lse=True, **kw)  # the forward as it would run
    dout = randn(rng, out.shape, dtype)
    dq, dk, dv_ = flash_attention_backward(dout, q, k, v, out, lse, block_m=blocks[0], block_n=blocks[1], **kw)
    for x, g in zip((q, k, v), (dq, dk, dv_)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close((dq, dk, dv_), dout, q, k, v, out, lse, **kw)


def test_large_logits_no_overflow(rng):
    # |s| up to ~1e4: P = exp(s - lse) <= 1 always and nothing overflows. Recomputing P from a
    # float32 lse is ill-conditioned at such logits (the exponent is known to ~1e-2 only), which
    # the rule's recompute term accounts for; it stays a few percent of P, not vacuous.
    q, k, v = make_qkv(rng, 1, 2, 2, 33, 65, 64, 32, dtype=np.float32)
    q, k = q * np.float32(50), k * np.float32(50)
    assert np.abs(np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / 8).max() > 3e3
    out, lse = ref.flash_attention(q, k, v, return_lse=True, causal=True)
    dout = randn(rng, out.shape, np.float32)
    grads = flash_attention_backward(dout, q, k, v, out, lse, causal=True, block_m=8, block_n=16)
    assert all(np.isfinite(g).all() for g in grads)
    e, _ = recompute_sensitivity(dout, q, k, v, lse, causal=True)
    assert e < 0.05
    check_grads_close(grads, dout, q, k, v, out, lse, causal=True)


# ---------------------------------------------------------------------------- empty rows


@pytest.mark.parametrize("dtype", [dtypes.float64, dtypes.float32, dtypes.float16])
def test_empty_rows_give_zero_dq_and_no_nan(dtype, rng):
    # causal with Sq > Sk: the first Sq - Sk rows see no key (lse = -inf).
    sq, sk = 9, 4
    q, k, v = make_qkv(rng, 2, 2, 1, sq, sk, 8, 8, dtype=dtype)
    out, lse = ref.flash_attention(q, k, v, causal=True, return_lse=True, block_m=4, block_n=2)
    assert np.isneginf(lse[:, :, : sq - sk]).all()
    dout = randn(rng, out.shape, dtype)
    expected = exact_grads(dout, q, k, v, causal=True)
    with np.errstate(invalid="raise", over="raise"):  # not even an intermediate inf - inf
        naive = attention_backward(dout, q, k, v, out, lse, causal=True)
        tiled = flash_attention_backward(dout, q, k, v, out, lse, causal=True, block_m=3, block_n=2)
    for grads in (naive, tiled):
        assert not any(np.isnan(g).any() for g in grads)
        np.testing.assert_array_equal(grads[0][:, :, : sq - sk], 0)
    # whatever flows into the empty rows changes nothing
    dout_big = dout.copy()
    dout_big[:, :, : sq - sk] = 1000
    again = flash_attention_backward(dout_big, q, k, v, out, lse, causal=True, block_m=3, block_n=2)
    for a, t in zip(again, tiled):
        np.testing.assert_array_equal(a, t)
    if dtype == dtypes.float64:
        for t, e in zip(tiled, expected):
            np.testing.assert_allclose(t, e, rtol=1e-12, atol=1e-14)
    else:
        check_grads_close(tiled, dout, q, k, v, out, lse, causal=True)


def test_no_keys_at_all_and_empty_batch(rng):
    q = randn(rng, (2, 3, 5, 8), np.float32)
    k = np.zeros((2, 3, 0, 8), np.float32)
    v = np.zeros((2, 3, 0, 4), np.float32)
    out, lse = ref.flash_attention(q, k, v, return_lse=True)
    dout = randn(rng, out.shape, np.float32)
    for fn in (attention_backward, flash_attention_backward, api_backward):
        dq, dk, dv = fn(dout, q, k, v, out, lse)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        np.testing.assert_array_equal(dq, 0)
    # Sq = 0: no row, so dk and dv are zero
    q0 = q[:, :, :0]
    k1, v1 = randn(rng, (2, 3, 4, 8), np.float32), randn(rng, (2, 3, 4, 4), np.float32)
    out0, lse0 = ref.flash_attention(q0, k1, v1, return_lse=True)
    dq, dk, dv = api_backward(out0, q0, k1, v1, out0, lse0)
    assert dq.shape == (2, 3, 0, 8) and dq.dtype == np.float32
    np.testing.assert_array_equal(dk, 0)
    np.testing.assert_array_equal(dv, 0)


# ---------------------------------------------------------------------------- strides


def test_non_contiguous_dout_and_inputs(rng):
    # dout as a transposed view of bshd storage; q a transposed view; K/V broadcast over the batch.
    b, h, sq, sk, d = 2, 4, 11, 13, 8
    q = randn(rng, (b, sq, h, d)).transpose(0, 2, 1, 3)
    k = np.broadcast_to(randn(rng, (1, h, sk, d)), (b, h, sk, d))
    v = np.broadcast_to(randn(rng, (1, h, sk, d)), (b, h, sk, d))
    out, lse = ref.naive_attention(q, k, v, causal=True, return_lse=True)
    dout = randn(rng, (b, sq, h, d)).transpose(0, 2, 1, 3)
    assert not dout.flags.c_contiguous
    expected = exact_grads(np.ascontiguousarray(dout), np.ascontiguousarray(q), k.copy(), v.copy(), causal=True)
    for fn in (attention_backward, flash_attention_backward, api_backward):
        grads = fn(dout, q, k, v, out, lse, causal=True)
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            assert g.flags.c_contiguous
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14, err_msg=f"{fn.__name__} {name}")


# ---------------------------------------------------------------------------- public entry point


@pytest.mark.parametrize("dtype", LOW + [dtypes.float64])
def test_public_backward_on_numpy(dtype, rng):
    q, k, v = make_qkv(rng, 1, 4, 2, 37, 29, 16, 24, dtype=dtype)
    out, lse = ref.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = randn(rng, out.shape, dtype)
    grads = api_backward(dout, q, k, v, out, lse, causal=True, backend="numpy", deterministic=True)
    for x, g in zip((q, k, v), grads):
        assert g.dtype == dtype and g.shape == x.shape
    if dtype == dtypes.float64:
        for g, e in zip(grads, exact_grads(dout, q, k, v, causal=True)):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)
    else:
        check_grads_close(grads, dout, q, k, v, out, lse, causal=True)


def test_public_backward_backends(rng, monkeypatch):
    q, k, v = make_qkv(rng, 1, 2, 2, 5, 6, 4, 4, dtype=np.float32)
    out, lse = ref.flash_attention(q, k, v, return_lse=True)
    dout = randn(rng, out.shape, np.float32)
    sim_grads = api_backward(dout, q, k, v, out, lse, backend="sim")  # the portable kernel, simulated
    with pytest.raises(ValueError, match=r"backend='cuda' needs GPU arrays"):
        api_backward(dout, q, k, v, out, lse, backend="cuda")
    with pytest.raises(ValueError, match=r"backend must be one of .* got 'gpu'"):
        api_backward(dout, q, k, v, out, lse, backend="gpu")
    with pytest.raises(TypeError, match=r"deterministic must be a bool, got 1"):
        api_backward(dout, q, k, v, out, lse, deterministic=1)
    expected = exact_grads(dout, q, k, v)
    monkeypatch.setenv("CUFLASH_BACKEND", "sim")  # overrides "auto"
    for a, b, x in zip(api_backward(dout, q, k, v, out, lse), sim_grads, expected):
        np.testing.assert_array_equal(a, b)
        assert np.max(np.abs(a - x)) < 1e-5
    monkeypatch.setenv("CUFLASH_BACKEND", "numpy")
    dq, _, _ = api_backward(dout, q, k, v, out, lse)
    assert np.max(np.abs(dq - expected[0])) < 1e-5


def test_public_backward_head_dim_limit(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 2, 2, 257, 4, dtype=np.float32)
    out, lse = ref.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match=r"q.shape\[-1\]=257 exceeds the largest supported head dim 256"):
        api_backward(out, q, k, v, out, lse)
    grads = flash_attention_backward(out, q, k, v, out, lse)  # the oracle has no limit
    assert grads[0].shape == q.shape


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("fn", [attention_backward, flash_attention_backward, api_backward])
def test_validation_errors(fn, rng):
    q, k, v = make_qkv(rng, 2, 4, 2, 5, 7, 8, 6, dtype=np.float32)
    out, lse = ref.flash_attention(q, k, v, return_lse=True)
    dout = randn(rng, out.shape, np.float32)
    name = {attention_backward: "reference.attention_backward", flash_attention_backward: "flash_attention_backward",
            api_backward: "cuflash.attention_backward"}[fn]
    cases = [
        (TypeError, r"dout must be an array .* got builtins.list", dict(dout=dout.tolist())),
        (TypeError, r"dout.dtype=float16 must equal out.dtype=float32", dict(dout=dout.astype(np.float16))),
        (ValueError, r"dout.shape=\(2, 4, 5, 5\) must equal out.shape=\(2, 4, 5, 6\)", dict(dout=dout[..., :5])),
        (TypeError, r"out.dtype=float64 must equal q.dtype=float32", dict(out=out.astype(np.float64))),
        (ValueError, r"out.shape=\(2, 4, 6, 6\) must be \(2, 4, 5, 6\)", dict(out=np.zeros((2, 4, 6, 6), np.float32))),
        (TypeError, r"lse.dtype=float16 must be float32 or float64", dict(lse=lse.astype(np.float16))),
        (TypeError, r"lse must be an array .* got builtins.float", dict(lse=1.0)),
        (ValueError, r"lse.shape=\(2, 4, 5, 1\) must be \(2, 4, 5\) \(q.shape\[:-1\]\)", dict(lse=lse[..., None])),
        (ValueError, r"dout must have unit stride on its last axis", dict(dout=np.asfortranarray(dout))),
        (ValueError, r"k.shape\[-1\]=4 must equal q.shape\[-1\]=8", dict(k=k[..., :4])),
        (ValueError, r"q.shape\[-3\]=3 query heads must be a multiple of k.shape\[-3\]=2", dict(q=q[:, :3])),
        (TypeError, r"causal must be a bool, got 1", dict(causal=1)),
        (ValueError, r"layout must be one of .* got 'sbhd'", dict(layout="sbhd")),
    ]
    base = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    for exc, match, change in cases:
        args = dict(base, **change)
        opts = {key: args.pop(key) for key in ("causal", "layout") if key in args}
        with pytest.raises(exc, match=match) as info:
            fn(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **opts)
        assert name in str(info.value), str(info.value)


def test_validation_bshd_lse_shape_and_block_sizes(rng):
    q, k, v = make_qkv(rng, 2, 4, 2, 5, 7, 8, 8, layout="bshd", dtype=np.float32)
    out, lse = ref.flash_attention(q, k, v, return_lse=True, layout="bshd")
    assert lse.shape == (2, 4, 5)
    match = r"lse.shape=\(2, 5, 4\) must be \(2, 4, 5\) \(\(B, Hq, Sq\) for layout='bshd'\)"
    with pytest.raises(ValueError, match=match):
        flash_attention_backward(out, q, k, v, out, np.ascontiguousarray(lse.swapaxes(1, 2)), layout="bshd")
    with pytest.raises(ValueError, match=r"block_m must be >= 1 \(or None\), got 0"):
        flash_attention_backward(out, q, k, v, out, lse, layout="bshd", block_m=0)
    with pytest.raises(TypeError, match=r"block_n must be an int, got 2.0"):
        flash_attention_backward(out, q, k, v, out, lse, layout="bshd", block_n=2.0)
    # the valid call works and matches float64
    grads = flash_attention_backward(out, q, k, v, out, lse, layout="bshd", block_m=2, block_n=3)
    check_grads_close(grads, out, q, k, v, out, lse, layout="bshd")
