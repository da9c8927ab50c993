"""The NumPy path's working memory: the estimate and refusal before any large allocation, and
broadcast (stride-0) inputs that are never expanded (cuflash.reference.memory).

Every limit here is injected (``CUFLASH_MEMORY_LIMIT``): no test depends on the machine's memory.
"""

from __future__ import annotations

import re
import tracemalloc

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from cuflash.reference import forward, memory
from cuflash.runtime import dtypes


def _limit(monkeypatch, n):
    monkeypatch.setenv(memory.ENV_LIMIT, str(n))


def test_available_bytes_takes_the_injected_limit_and_refuses_a_bad_one(monkeypatch):
    _limit(monkeypatch, 12345)
    assert memory.available_bytes() == (12345, "CUFLASH_MEMORY_LIMIT")
    _limit(monkeypatch, "-3")
    with pytest.raises(ValueError, match="CUFLASH_MEMORY_LIMIT must be a non-negative int"):
        memory.available_bytes()
    monkeypatch.delenv(memory.ENV_LIMIT)
    avail, source = memory.available_bytes()   # the machine's: only its form is checked
    assert avail is None or (isinstance(avail, int) and avail > 0 and source)


def test_an_injected_limit_refuses_a_normal_forward_with_the_bytes(monkeypatch, rng):
    q = rng.standard_normal((2, 3, 40, 16)).astype(np.float32)
    k = rng.standard_normal((2, 3, 50, 16)).astype(np.float32)
    v = rng.standard_normal((2, 3, 50, 8)).astype(np.float32)
    _limit(monkeypatch, 1000)
    with pytest.raises(MemoryError) as e:
        cuflash.attention(q, k, v, backend="numpy")
    msg = str(e.value)
    assert msg.startswith("cuflash.attention: ")
    assert f"out: {2 * 3 * 40 * 8 * 4} bytes" in msg and f"lse: {2 * 3 * 40 * 4} bytes" in msg
    assert "1000 bytes" in msg and "CUFLASH_MEMORY_LIMIT" in msg
    total = int(re.search(r"needs about (\d+) bytes", msg).group(1))
    assert total > 2 * 3 * 40 * (8 + 1) * 4   # out and lse, plus the tiles
    # a preallocated out is not counted; the same call under a large enough limit runs unchanged
    _limit(monkeypatch, total)
    got = cuflash.attention(q, k, v, backend="numpy")
    np.testing.assert_allclose(got, ref.naive_attention(q, k, v), rtol=2e-5, atol=2e-6)


def test_an_injected_limit_refuses_the_backward_and_softmax_by_their_names(monkeypatch, rng):
    q = rng.standard_normal((1, 2, 30, 16)).astype(np.float16)
    k = rng.standard_normal((1, 2, 30, 16)).astype(np.float16)
    v = rng.standard_normal((1, 2, 30, 16)).astype(np.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
    _limit(monkeypatch, 5000)
    with pytest.raises(MemoryError, match=r"^cuflash\.attention_backward: .*dq, dk, dv: 5760 bytes"):
        cuflash.attention_backward(out, q, k, v, out, lse, backend="numpy")
    x = rng.standard_normal((64, 100)).astype(np.float32)
    with pytest.raises(MemoryError, match=r"^cuflash\.reference\.online_softmax: .*the result \(x's shape, float32 or float64\): 25600 bytes"):
        ref.online_softmax(x)
    # the varlen path checks each sequence under its public name
    cu = np.array([0, 30], np.int32)
    with pytest.raises(MemoryError, match=r"^cuflash\.attention_varlen: "):
        cuflash.attention_varlen(q[0].swapaxes(0, 1), k[0].swapaxes(0, 1), v[0].swapaxes(0, 1), cu, cu, 30, 30,
                                 backend="numpy")


def test_a_broadcast_key_of_2_28_rows_is_estimated_small_and_refused_cleanly(monkeypatch):
    """A stride-0 K of 2**28 keys (16 GiB if expanded): the estimate is megabytes, and under a
    smaller injected limit the refusal is this MemoryError, not NumPy's."""
    row = np.ones(16, np.float32)
    k = np.broadcast_to(row, (1, 1, 2**28, 16))
    q = np.ones((1, 1, 1, 16), np.float32)
    p = cuflash.runtime.validation.check_attention(q, k, k, cuflash.runtime.options.Options(), func="t")
    bm, bn = forward.cpu_tiles(p)
    need = sum(forward.forward_memory(p, bm, bn, new_out=True, kv_copies=0).values())
    assert need < 64 * 2**20, need
    _limit(monkeypatch, 4096)
    with pytest.raises(MemoryError, match=r"^cuflash\.attention: the NumPy path needs about \d+ bytes"):
        cuflash.attention(q, k, k, backend="numpy")
    kh = np.broadcast_to(np.ones(64, np.float16), (1, 1, 2**31, 64))   # 512 GiB as float32
    with pytest.raises(MemoryError, match=r"^cuflash\.attention: .*tiles"):
        cuflash.attention(np.ones((1, 1, 1, 64), np.float16), kh, kh, backend="numpy")


def test_the_forward_is_refused_before_it_lists_heads_or_reads_a_value(monkeypatch):
    """A batch of 2**44 broadcast rows: refused at once, no head listed and no value scanned."""
    def never(*args, **kwargs):
        raise AssertionError("v was read before the memory check")

    monkeypatch.setattr(forward, "all_finite", never)
    q = np.broadcast_to(np.ones((1, 2, 8), np.float32), (2**44, 1, 2, 8))
    with pytest.raises(MemoryError, match=rf"^cuflash\.attention: .*out: {2**44 * 2 * 8 * 4} bytes"):
        cuflash.attention(q, q, q, backend="numpy")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_broadcast_key_runs_without_expanding_it(dtype):
    """2**22 identical keys and values (Sq = 1): every weight is equal, so out is the value row and
    lse = q.k * scale + log(Sk); the peak traced memory stays far below one expanded copy."""
    sk, d = 2**22, 4
    k = np.broadcast_to(np.full(d, 0.5, dtype), (1, 1, sk, d))
    v = np.broadcast_to(np.arange(1, d + 1, dtype=dtype) / 4, (1, 1, sk, d))
    q = np.full((1, 1, 1, d), 0.25, dtype)
    tracemalloc.start()
    try:
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    expanded = sk * d * np.dtype(dtype).itemsize
    assert peak < expanded / 8, f"peak {peak / 2**20:.1f} MiB"
    np.testing.assert_array_equal(out[0, 0, 0].astype(np.float64), np.arange(1, d + 1) / 4)
    np.testing.assert_allclose(lse[0, 0, 0], d * 0.125 / np.sqrt(d) + np.log(sk), rtol=1e-6)


@pytest.mark.slow
def test_a_broadcast_key_of_2_28_rows_runs_in_little_memory():
    row = np.ones(16, np.float32)
    k = np.broadcast_to(row, (1, 1, 2**28, 16))
    tracemalloc.start()
    try:
        out, lse = cuflash.attention(np.ones((1, 1, 1, 16), np.float32), k, k, return_lse=True, backend="numpy")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    np.testing.assert_array_equal(out, 1.0)
    np.testing.assert_allclose(lse[0, 0, 0], 16 / 4 + np.log(2.0**28), rtol=1e-6)


def test_converting_k_and_v_tile_by_tile_gives_the_bits_of_the_whole_copy(monkeypatch, rng):
    """fp16/bf16 K and V converted per head or per tile: the same exact float32 values, the same
    result bit for bit (and a NaN value is still confined to the rows that see it)."""
    for dt in (dtypes.float16, dtypes.bfloat16):
        q = rng.standard_normal((1, 4, 70, 32)).astype(dt)
        k = rng.standard_normal((1, 2, 90, 32)).astype(dt)
        v = rng.standard_normal((1, 2, 90, 32)).astype(dt)
        v[0, 1, 80, 3] = np.nan
        kw = dict(causal=True, return_lse=True, block_m=16, block_n=32)
        whole = ref.flash_attention(q, k, v, **kw)
        monkeypatch.setattr(forward, "_KV_COPY_BYTES", 0)
        tiled = ref.flash_attention(q, k, v, **kw)
        monkeypatch.undo()
        for a, b in zip(whole, tiled):
            np.testing.assert_array_equal(a.view(np.uint16 if a.itemsize == 2 else np.uint32),
                                          b.view(np.uint16 if b.itemsize == 2 else np.uint32))
        bad = np.zeros(whole[0].shape, bool)
        bad[0, 2:, -10:, 3] = True   # heads 2, 3 read kv head 1; rows 60.. see key 80 (causal, Sk - Sq = 20)
        np.testing.assert_array_equal(np.isnan(whole[0]), bad)


def test_all_finite_reads_the_distinct_elements_of_a_broadcast_view():
    row = np.ones(8, np.float32)
    huge = np.broadcast_to(row, (2**40, 8))   # 32 TiB if expanded
    assert memory.distinct(huge).shape == (1, 8)
    assert memory.all_finite(huge)
    row[5] = np.inf
    assert not memory.all_finite(huge)
    x = np.ones((3000, 700), np.float32)[:, ::2]   # strided, more than one chunk
    assert memory.all_finite(x)
    x[2999, 349] = np.nan
    assert not memory.all_finite(x)


def test_an_empty_softmax_over_a_huge_axis_returns_at_once():
    """Empty slices along a 2**44-long broadcast axis: the empty result, without looping over the
    axis's blocks."""
    x = np.broadcast_to(np.ones((3, 0), np.float16), (2**44, 3, 0))
    y = ref.online_softmax(x, axis=0)
    assert y.shape == x.shape and y.dtype == np.float32
