"""The NumPy oracle and CPU path against float64 and against math."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash.runtime import dtypes

DTYPES = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# ---------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("func", [ref.softmax, ref.online_softmax])
@pytest.mark.parametrize("n", [1, 7, 128, 1000, 4097])
def test_softmax_matches_float64_rounding(func, n, rng):
    x = randn(rng, (5, n), np.float64, scale=5.0)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    expected = e / e.sum(axis=-1, keepdims=True)
    y = func(x)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-300)


@pytest.mark.parametrize("block_size", [1, 3, 64, 10_000])
def test_online_softmax_rows_sum_to_one(block_size, rng):
    # The seed's pseudocode rescales only the running sum and scales the block's local sum twice;
    # its rows do not sum to 1. The correct recurrence gives rows summing to 1 for any blocking.
    x = randn(rng, (4, 3, 1000), np.float32, scale=10.0)
    y = ref.online_softmax(x, axis=-1, block_size=block_size)
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(y, ref.softmax(x), rtol=1e-5, atol=1e-12)


def test_online_softmax_other_axis_and_dtypes(rng):
    for dtype in DTYPES:
        x = randn(rng, (37, 6), dtype, scale=3.0)
        y = ref.online_softmax(x, axis=0, block_size=8)
        assert y.dtype == dtypes.accumulator(dtype)
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=0))
        tol = 1e-13 if dtype == dtypes.float64 else 1e-6
        np.testing.assert_allclose(y, e / e.sum(axis=0), rtol=tol, atol=1e-12)


@pytest.mark.parametrize("func", [ref.softmax, ref.online_softmax])
def test_softmax_with_neg_inf_and_huge_values(func):
    x = np.array(
        [
            [-np.inf, 0.0, 1.0, -np.inf],  # -inf entries get probability 0
            [-np.inf] * 4,  # all -inf: NaN, as SciPy and PyTorch
            [1e30, 1e30, -1e30, 0.0],  # huge values, no overflow
            [-np.inf, -np.inf, -np.inf, 5.0],  # a leading all -inf block (online: block 1)
        ],
        dtype=np.float64,
    )
    kw = {"block_size": 2} if func is ref.online_softmax else {}
    y = func(x, **kw)
    e = np.exp(1.0)
    np.testing.assert_allclose(y[0], [0, 1 / (1 + e), e / (1 + e), 0], rtol=1e-15)
    assert np.isnan(y[1]).all()
    np.testing.assert_allclose(y[2], [0.5, 0.5, 0, 0], rtol=1e-15)
    np.testing.assert_array_equal(y[3], [0, 0, 0, 1])


def test_softmax_validation():
    with pytest.raises(TypeError, match="x must be a numpy.ndarray"):
        ref.softmax([1.0, 2.0])
    with pytest.raises(TypeError, match=r"x.dtype=int64 is not supported"):
        ref.online_softmax(np.arange(4))
    with pytest.raises(ValueError, match=r"axis=2 is out of range for x.ndim=2"):
        ref.softmax(np.zeros((2, 2)), axis=2)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        ref.online_softmax(np.zeros((2, 2)), block_size=0)


# ---------------------------------------------------------------------------- attention: math


def test_naive_attention_equals_textbook_formula(rng):
    q, k, v = randn(rng, (3, 5, 8), np.float64), randn(rng, (3, 7, 8), np.float64), randn(rng, (3, 7, 4), np.float64)
    s = np.einsum("hqd,hkd->hqk", q, k) / np.sqrt(8)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    out, lse = ref.naive_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, p @ v, rtol=1e-12)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


@pytest.mark.parametrize("impl", ["naive", "flash", "api"])
def test_zero_scale_averages_visible_values(impl, rng):
    # softmax_scale=0 makes every visible score equal: each row averages the V rows it sees,
    # and lse = log(number of visible keys).
    sq, sk = 6, 9
    q, k, v = randn(rng, (2, sq, 4), np.float64), randn(rng, (2, sk, 4), np.float64), randn(rng, (2, sk, 3), np.float64)
    fn = {"naive": ref.naive_attention, "flash": lambda *a, **kw: ref.flash_attention(*a, block_m=4, block_n=4, **kw),
          "api": cuflash.attention}[impl]
    out, lse = fn(q, k, v, causal=True, softmax_scale=0.0, return_lse=True)
    for i in range(sq):
        n_visible = i + sk - sq + 1  # bottom-right causal: keys 0 .. i + Sk - Sq
        np.testing.assert_allclose(out[:, i], v[:, :n_visible].mean(axis=1), rtol=1e-12)
        np.testing.assert_allclose(lse[:, i], np.log(n_visible), rtol=1e-12)


@pytest.mark.parametrize("impl", ["naive", "flash"])
def test_rows_without_keys_give_zero_and_neg_inf(impl, rng):
    # causal with Sq > Sk: the first Sq - Sk rows see no key at all.
    sq, sk = 10, 4
    q, k, v = randn(rng, (3, sq, 8)), randn(rng, (3, sk, 8)), randn(rng, (3, sk, 8))
    fn = ref.naive_attention if impl == "naive" else lambda *a, **kw: ref.flash_attention(*a, block_m=3, block_n=2, **kw)
    out, lse = fn(q, k, v, causal=True, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, : sq - sk], 0)
    assert np.isneginf(lse[:, : sq - sk]).all()
    # the last row sees every key: it is plain attention of that row
    full = ref.naive_attention(q[:, -1:], k, v)
    np.testing.assert_allclose(out[:, -1:], full, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["naive", "flash"])
def test_single_key_returns_its_value(impl, rng):
    q, k, v = randn(rng, (2, 5, 16), np.float64), randn(rng, (2, 1, 16), np.float64), randn(rng, (2, 1, 8), np.float64)
    fn = ref.naive_attention if impl == "naive" else ref.flash_attention
    out, lse = fn(q, k, v, return_lse=True, softmax_scale=0.5)
    np.testing.assert_allclose(out, np.broadcast_to(v, out.shape), rtol=1e-14)
    np.testing.assert_allclose(lse, 0.5 * np.einsum("hqd,hkd->hq", q, k), rtol=1e-13)


def test_empty_key_set_and_empty_batch(rng):
    q = randn(rng, (2, 3, 5, 8))
    k = np.zeros((2, 3, 0, 8), np.float32)
    v = np.zeros((2, 3, 0, 4), np.float32)
    for fn in (ref.naive_attention, ref.flash_attention, cuflash.attention):
        out, lse = fn(q, k, v, return_lse=True)
        assert out.shape == (2, 3, 5, 4) and lse.shape == (2, 3, 5)
        np.testing.assert_array_equal(out, 0)
        assert np.isneginf(lse).all()
    q0, k0, v0 = (np.zeros((0, 3, 5, 8), np.float16) for _ in range(3))
    out, lse = cuflash.attention(q0, k0, v0, return_lse=True)
    assert out.shape == (0, 3, 5, 8) and out.dtype == np.float16 and lse.shape == (0, 3, 5)
    out = cuflash.attention(q[:, :, :0], randn(rng, (2, 3, 4, 8)), randn(rng, (2, 3, 4, 8)))
    assert out.shape == (2, 3, 0, 8)


# ---------------------------------------------------------------------------- attention: grid

# A covering design (every value of each axis appears; layouts, masks and dtypes pair up).
GRID = [
    # dtype, (B, Hq, Hk), Sq, Sk, D, Dv, causal, window, layout
    (dtypes.float32, (1, 1, 1), 1, 1, 1, 1, False, (-1, -1), "bhsd"),
    (dtypes.float16, (2, 7, 1), 17, 97, 40, 40, True, (-1, -1), "bhsd"),
    (dtypes.bfloat16, (1, 8, 2), 97, 17, 59, 111, True, (-1, -1), "bshd"),
    (dtypes.float64, (2, 7, 7), 128, 129, 64, 32, False, (16, 0), "bhsd"),
    (dtypes.float32, (1, 8, 2), 129, 128, 72, 72, False, (-1, 5), "bshd"),
    (dtypes.float16, (1, 1, 1), 255, 1, 96, 96, False, (-1, -1), "bshd"),
    (dtypes.bfloat16, (2, 1, 1), 1, 255, 111, 59, True, (3, -1), "bhsd"),
    (dtypes.float32, (1, 7, 1), 97, 255, 128, 160, True, (40, -1), "bhsd"),
    (dtypes.float16, (1, 8, 2), 128, 97, 160, 128, False, (7, 9), "bhsd"),
    (dtypes.float64, (1, 2, 1), 17, 129, 256, 256, True, (-1, -1), "bshd"),
    (dtypes.bfloat16, (1, 7, 7), 255, 128, 64, 64, False, (0, 0), "bhsd"),
]


@pytest.mark.parametrize("dtype,heads,sq,sk,d,dv,causal,window,layout", GRID)
def test_grid_cpu_path_matches_float64(dtype, heads, sq, sk, d, dv, causal, window, layout, rng):
    b, hq, hk = heads
    if layout == "bshd":
        q, k, v = randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hk, d), dtype), randn(rng, (b, sk, hk, dv), dtype)
    else:
        q, k, v = randn(rng, (b, hq, sq, d), dtype), randn(rng, (b, hk, sk, d), dtype), randn(rng, (b, hk, sk, dv), dtype)
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == dtypes.accumulator(dtype)
    check_close(out, q, k, v, **kw)
    _, lse_ref = ref.naive_attention(q, k, v, return_lse=True, **kw)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    tol = 1e-12 if dtype == dtypes.float64 else 1e-4
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (3, 5), (16, 64), (1000, 1000)])
def test_tiling_does_not_change_the_result(block_m, block_n, rng):
    q, k, v = randn(rng, (2, 4, 37, 24), np.float64), randn(rng, (2, 2, 53, 24), np.float64), randn(rng, (2, 2, 53, 16), np.float64)
    for kw in (dict(), dict(causal=True), dict(window_size=(5, 2))):
        out, lse = ref.flash_attention(q, k, v, block_m=block_m, block_n=block_n, return_lse=True, **kw)
        out_ref, lse_ref = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)


def test_large_logits_no_overflow(rng):
    # |s| up to ~1e4: the running maximum keeps every exponential <= 1.
    q = randn(rng, (2, 33, 64), np.float32, scale=50.0)
    k = randn(rng, (2, 65, 64), np.float32, scale=50.0)
    v = randn(rng, (2, 65, 64), np.float32)
    s = np.abs(np.einsum("hqd,hkd->hqk", q.astype(np.float64), k) / 8).max()
    assert s > 3e3
    out = ref.flash_attention(q, k, v, block_m=8, block_n=16)
    assert np.isfinite(out).all()
    check_close(out, q, k, v, large_logits=True)


def test_two_dim_and_extra_batch_dims(rng):
    q, k, v = randn(rng, (19, 32)), randn(rng, (23, 32)), randn(rng, (23, 16))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (19, 16) and lse.shape == (19,)
    check_close(out, q, k, v, causal=True)
    q5, k5, v5 = randn(rng, (2, 3, 4, 9, 8)), randn(rng, (2, 3, 2, 11, 8)), randn(rng, (2, 3, 2, 11, 8))
    out5 = cuflash.attention(q5, k5, v5)
    assert out5.shape == (2, 3, 4, 9, 8)
    check_close(out5, q5, k5, v5)


def test_strided_packed_and_broadcast_inputs(rng):
    # q, k, v as slices of one packed (B, S, 3, H, D) buffer, in the bshd layout
    qkv = randn(rng, (2, 50, 3, 4, 32), np.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = cuflash.attention(q, k, v, causal=True, layout="bshd")
    check_close(out, q, k, v, causal=True, layout="bshd")
    # transposed bhsd views of bshd storage, and K/V broadcast over the batch with stride 0
    kb = np.broadcast_to(randn(rng, (1, 2, 40, 32)), (3, 2, 40, 32))
    vb = np.broadcast_to(randn(rng, (1, 2, 40, 32)), (3, 2, 40, 32))
    qt = randn(rng, (3, 20, 6, 32)).transpose(0, 2, 1, 3)
    out = cuflash.attention(qt, kb, vb)
    check_close(out, qt, kb, vb)


def test_kv_cache_tail_garbage_is_never_read(rng):
    # K/V as views of a longer cache whose tail holds NaN give the same result as copies.
    cache_k = randn(rng, (1, 2, 64, 16))
    cache_v = randn(rng, (1, 2, 64, 16))
    cache_k[:, :, 40:] = np.nan
    cache_v[:, :, 40:] = np.nan
    q = randn(rng, (1, 4, 3, 16))
    out = cuflash.attention(q, cache_k[:, :, :40], cache_v[:, :, :40], causal=True)
    copy = cuflash.attention(q, cache_k[:, :, :40].copy(), cache_v[:, :, :40].copy(), causal=True)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out, copy)


def test_out_argument_is_written_in_place(rng):
    q, k, v = randn(rng, (2, 4, 9, 8)), randn(rng, (2, 4, 12, 8)), randn(rng, (2, 4, 12, 8))
    buf = np.full((2, 9, 4, 8), np.nan, np.float32)  # poisoned, and a transposed view as out
    out_view = buf.transpose(0, 2, 1, 3)
    result = cuflash.attention(q, k, v, out=out_view)
    assert result is out_view
    assert not np.isnan(buf).any()
    check_close(buf.transpose(0, 2, 1, 3), q, k, v)


def test_gqa_equals_repeated_heads(rng):
    q = randn(rng, (2, 6, 10, 8), np.float64)
    k, v = randn(rng, (2, 2, 14, 8), np.float64), randn(rng, (2, 2, 14, 8), np.float64)
    out = cuflash.attention(q, k, v, causal=True)
    rep = cuflash.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), causal=True)
    np.testing.assert_allclose(out, rep, rtol=1e-14)
    # query head h reads kv head h // 3
    single = ref.naive_attention(q[:, 4], k[:, 1], v[:, 1], causal=True)
    np.testing.assert_allclose(out[:, 4], single, rtol=1e-12)


def test_flash_attention_memory_is_tiled_not_quadratic(rng):
    # Sq x Sk = 128 x 2^23 float64 scores would need 8 GiB; the tiled path needs O(Br * Bc).
    sq, sk, d = 128, 2**23, 2
    q = randn(rng, (1, sq, d))
    k = randn(rng, (1, sk, d))
    v = randn(rng, (1, sk, d))
    naive_bytes = sq * sk * 8
    tracemalloc.start()
    try:
        out = ref.flash_attention(q, k, v, block_m=128, block_n=2**16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert naive_bytes >= 8 * 2**30
    assert peak < 300 * 2**20, f"peak {peak / 2**20:.0f} MiB"  # a few tiles of 128 x 65536 float32
    # spot-check a row against float64 computed row by row
    row = q[0, 5].astype(np.float64)
    s = (k[0].astype(np.float64) @ row) / np.sqrt(d)
    p = np.exp(s - s.max())
    np.testing.assert_allclose(out[0, 5], (p @ v[0]) / p.sum(), rtol=1e-4)
