"""Regression tests of the calls the bad-input property test (test_bad_input.py) found, shrunk to
plain pytest. Each asserts the contract: a clear error (the function's name, a colon, the
argument named) or the float64 oracle's result. Those marked ``xfail(strict=True)`` need a fix
outside the validation modules; the reason names where."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from cuflash.reference import tolerance


def _rng():
    return np.random.default_rng(0)


# --------------------------------------------------------------------------------------------
# the float64 oracle


@pytest.mark.parametrize("shape, axis", [((3, 0), -1), ((0, 3), 0)])
def test_reference_softmax_of_an_empty_axis_is_empty(shape, axis):
    x = np.zeros(shape)
    assert cuflash.softmax(x, axis).shape == shape          # the public function returns it
    assert ref.online_softmax(x, axis).shape == shape
    assert ref.softmax(x, axis).shape == shape


# --------------------------------------------------------------------------------------------
# paged KV caches broadcast over the kv heads (stride 0 on the head axis)


def _paged_broadcast_over_heads():
    rng = _rng()
    q = rng.standard_normal((2, 2, 4)).astype(np.float32)                       # (total_q, Hq, D)
    k_cache = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)             # (pages, page_size, Hk, D)
    v_cache = np.broadcast_to(rng.standard_normal((3, 2, 1, 4)).astype(np.float32), (3, 2, 2, 4))
    block_table = np.array([[0, 1]], np.int32)
    return q, k_cache, v_cache, block_table


def _gathered(cache, n, block_table):
    page = cache.shape[1]
    rows = [cache[block_table[0, j // page], j % page] for j in range(n)]
    return np.ascontiguousarray(np.stack(rows)[None])                            # (1, n, Hk, D)


def test_varlen_paged_cache_broadcast_over_kv_heads_matches_the_oracle():
    q, k_cache, v_cache, block_table = _paged_broadcast_over_heads()
    cu_q, cu_k = np.array([0, 2], np.int32), np.array([0, 3], np.int32)
    out = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, 2, 3, block_table=block_table)
    kb, vb = _gathered(k_cache, 3, block_table), _gathered(v_cache, 3, block_table)
    ok, msg, _ = tolerance.compare(out[None], q[None], kb, vb, layout="bshd")
    assert ok, msg


def test_kvcache_paged_cache_broadcast_over_kv_heads_matches_the_oracle():
    q, k_cache, v_cache, block_table = _paged_broadcast_over_heads()
    out = cuflash.attention_with_kvcache(q[None], k_cache, v_cache, np.array([3], np.int32), block_table=block_table)
    kb, vb = _gathered(k_cache, 3, block_table), _gathered(v_cache, 3, block_table)
    ok, msg, _ = tolerance.compare(out, q[None], kb, vb, layout="bshd")
    assert ok, msg


def test_contiguous_cache_broadcast_over_kv_heads_matches_the_oracle():
    """The same cache without a block table works (the gather of a contiguous cache is a slice)."""
    q, k_cache, v_cache, _ = _paged_broadcast_over_heads()
    out = cuflash.attention_with_kvcache(q[None], k_cache, v_cache, np.array([2], np.int32))
    ok, msg, _ = tolerance.compare(out, q[None], k_cache[:1, :2], v_cache[:1, :2], layout="bshd")
    assert ok, msg


# --------------------------------------------------------------------------------------------
# KV cache: an int cache_seqlens with no sequence


@pytest.mark.parametrize("seqlens", [0, np.zeros(0, np.int32)])
def test_kvcache_without_sequences_takes_an_int_cache_seqlens_as_it_takes_an_empty_array(seqlens):
    """B = 0: no sequence, so no sequence's keys can overflow the cache; the int form is accepted
    as the (0,) array form is, and nothing is written."""
    rng = _rng()
    q = rng.standard_normal((0, 1, 2, 8))
    k_cache = rng.standard_normal((1, 1, 1, 8))
    v_cache = rng.standard_normal((1, 1, 1, 8))
    before = k_cache.copy(), v_cache.copy()
    k, v = np.zeros((0, 2, 1, 8)), np.zeros((0, 2, 1, 8))
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k, v=v,
                                              block_table=np.zeros((0, 1), np.int32), return_lse=True)
    assert out.shape == (0, 1, 2, 8) and lse.shape == (0, 2, 1)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def test_kvcache_int_cache_seqlens_still_must_fit_the_cache():
    rng = _rng()
    q = rng.standard_normal((1, 1, 2, 8))
    k_cache, v_cache = rng.standard_normal((1, 2, 1, 8)), rng.standard_normal((1, 2, 1, 8))
    k, v = np.zeros((1, 2, 1, 8)), np.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"^cuflash.attention_with_kvcache: cache_seqlens=1 plus Snew=2 new keys"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, 1, k=k, v=v)
    with pytest.raises(ValueError, match=r"^cuflash.attention_with_kvcache: cache_seqlens=-1 .* >= 0"):
        cuflash.attention_with_kvcache(q[:0], k_cache, v_cache, -1)


# --------------------------------------------------------------------------------------------
# working memory no machine has: a MemoryError that begins with the function's name

#: a leading axis of stride 0 that makes every result petabytes (the views cost nothing, and an
#: allocation this size fails at once)
HUGE = 2**44


def _huge(shape, dtype=np.float16):
    return np.broadcast_to(np.ones(shape, dtype), (HUGE,) + shape)


def test_softmax_memory_error_begins_with_the_public_name(monkeypatch):
    monkeypatch.setenv("CUFLASH_MEMORY_LIMIT", "1000")
    with pytest.raises(MemoryError, match=r"^cuflash\.softmax: .* bytes"):
        cuflash.softmax(np.ones((64, 64), np.float32))


def test_softmax_memory_error_names_its_argument(monkeypatch):
    monkeypatch.setenv("CUFLASH_MEMORY_LIMIT", "1000")
    with pytest.raises(MemoryError, match=r"^cuflash\.softmax: .*\bx\b"):
        cuflash.softmax(np.ones((64, 64), np.float32))


def test_merge_attention_memory_error_begins_with_the_public_name():
    outs, lses = [_huge((1, 2, 4), np.float32)], [_huge((1, 2), np.float32)]
    with pytest.raises(MemoryError, match=r"^cuflash\.merge_attention: "):
        cuflash.merge_attention(outs, lses)


def test_kvcache_memory_error_begins_with_the_public_name():
    q = np.broadcast_to(np.ones((1, 1, 1, 8), np.float16), (2, HUGE, 1, 8))
    k_cache = np.ones((2, 4, 1, 8), np.float16)
    with pytest.raises(MemoryError, match=r"^cuflash\.attention_with_kvcache: "):
        cuflash.attention_with_kvcache(q, k_cache, k_cache.copy(), 2)


@pytest.mark.parametrize("entry", ["attention", "softmax"])
def test_simulator_memory_error_begins_with_the_public_name(entry):
    q, k = _huge((2, 1, 8)), _huge((2, 4, 8))
    with pytest.raises(MemoryError, match=rf"^cuflash\.{entry}: "):
        if entry == "attention":
            cuflash.attention(q, k, k, backend="sim")
        else:
            cuflash.softmax(q, backend="sim")


def test_attention_refuses_working_memory_before_reading_any_value(monkeypatch):
    from cuflash.reference import forward

    def never(*args, **kwargs):
        raise AssertionError("v was read before the memory check")

    monkeypatch.setattr(forward, "all_finite", never)
    monkeypatch.setenv("CUFLASH_MEMORY_LIMIT", "1000")
    q = np.broadcast_to(np.ones((1, 1, 2, 8), np.float32), (64, 1, 2, 8))
    with pytest.raises(MemoryError, match=r"^cuflash\.attention: "):
        cuflash.attention(q, q, q)


def test_attention_and_backward_memory_errors_begin_with_the_public_name(monkeypatch):
    """What the fixes above are held to: the attention forward and backward's own check."""
    q = _huge((1, 2, 8))
    with pytest.raises(MemoryError, match=r"^cuflash\.attention_backward: .* bytes"):
        cuflash.attention_backward(q, q, q, q, q, _huge((1, 2), np.float32))
    monkeypatch.setenv("CUFLASH_MEMORY_LIMIT", "1000")
    q = np.ones((1, 64, 64), np.float32)
    with pytest.raises(MemoryError, match=r"^cuflash\.attention: .* bytes"):
        cuflash.attention(q, q, q)


# --------------------------------------------------------------------------------------------
# the kernels with a large finite softmax_scale


@pytest.mark.slow   # compiles the tensor-core variant on the simulator (seconds of g++)
@pytest.mark.xfail(strict=True, reason="kernels_cu/attention_fwd_mma.cu (the tensor-core tier, chosen here because "
                                       "stride-0 q rules out TMA): softmax_scale=1e30 gives lse = +-inf and NaN "
                                       "output from finite input; the Hopper tier and the NumPy path give the "
                                       "oracle's finite lse")
def test_tensor_core_forward_with_a_large_softmax_scale_gives_no_nan():
    from cuflash.runtime import dtypes

    rng = _rng()
    q = np.broadcast_to(rng.standard_normal((1, 1, 1, 8)).astype(dtypes.bfloat16), (2, 1, 1, 8))
    k = rng.standard_normal((2, 2, 1, 8)).astype(dtypes.bfloat16)
    assert cuflash.explain(q, k, k, layout="bshd", causal=True, backend="sim")["tier"] == "attention_fwd_mma"
    out, lse = cuflash.attention(q, k, k, softmax_scale=1e30, layout="bshd", causal=True, return_lse=True,
                                 backend="sim")
    ok, msg, _ = tolerance.compare(out, np.ascontiguousarray(q), k, k, softmax_scale=1e30, layout="bshd",
                                   causal=True, lse=lse)
    assert ok, msg


# --------------------------------------------------------------------------------------------
# the kernels' launch planning with several batch dims and no key


def test_simulator_with_two_batch_dims_and_no_key_gives_zero_rows():
    q = np.ones((1, 1, 1, 1, 8), np.float16)
    k = np.zeros((1, 1, 1, 0, 8), np.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True, backend="sim")
    assert (out == 0).all() and np.isneginf(lse).all()


# --------------------------------------------------------------------------------------------
# an unsupported dtype beside float64 q: NumPy reads None (cuflash's "unsupported") as its default
# float64, so a comparison with the ArrayInfo's None held and let the array through


def _f64_calls():
    q = np.zeros((1, 2, 1, 8))
    o, lse = cuflash.attention(q, q, q, return_lse=True)
    i32 = np.zeros((1, 2, 1, 8), np.int32)
    kc = np.zeros((1, 4, 1, 8))
    return {
        "attention out": (cuflash.attention, (q, q, q), {"out": i32}, "out.dtype=int32 must equal q.dtype=float64"),
        "kvcache out": (cuflash.attention_with_kvcache, (q, kc, kc.copy(), 1), {"out": i32},
                        "out.dtype=int32 must equal q.dtype=float64"),
        "kvcache k": (cuflash.attention_with_kvcache, (q, kc, kc.copy(), 1), {"k": i32[:, :1], "v": i32[:, :1]},
                      "k.dtype=int32 must equal q.dtype=float64"),
        "kvcache v_cache": (cuflash.attention_with_kvcache, (q, kc, np.zeros(kc.shape, np.int32), 1), {},
                            "v_cache.dtype=int32 must equal q.dtype=float64"),
        "backward out": (cuflash.attention_backward, (i32, q, q, q, i32, lse), {},
                         "out.dtype=int32 must equal q.dtype=float64"),
        "backward lse": (cuflash.attention_backward, (o, q, q, q, o, lse.astype(np.int32)), {},
                         "lse.dtype=int32 must be float32 or float64"),
    }


@pytest.mark.parametrize("case", ["attention out", "kvcache out", "kvcache k", "kvcache v_cache", "backward out",
                                  "backward lse"])
def test_an_int32_array_beside_float64_q_is_refused(case):
    fn, args, kwargs, msg = _f64_calls()[case]
    before = [np.array(a, copy=True) for a in args[1:3]]
    with pytest.raises(TypeError, match=rf"^cuflash\.{fn.__name__}: {msg}"):
        fn(*args, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(args[1:3], before))   # nothing appended
