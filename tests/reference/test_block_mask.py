"""Block-sparse masks (cuflash.create_block_mask, BlockMask) and the NumPy path with one: the block
tables against a dense evaluation of the same function, the index lists and their transpose, the
NumPy path's results against the float64 oracle with the dense mask_mod, which blocks the NumPy
path evaluates the function on, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import mods
from cuflash.reference import block_mask as ref_block_mask
from cuflash.reference import score_mods


def _docs(lengths):
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


def _dense_codes(fn, b, h, sq, sk, bq, bk):
    """0 empty, 1 partial, 2 full per block, from the whole (b, h, Sq, Sk) mask evaluated by calling
    the Python function on NumPy index grids (not through the tracer)."""
    keep = np.broadcast_to(fn(np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None],
                              np.arange(sq)[None, None, :, None], np.arange(sk)[None, None, None, :]), (b, h, sq, sk))
    nq, nk = -(-sq // bq), -(-sk // bk)
    out = np.zeros((b, h, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = keep[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[:, :, i, j] = np.where(blk.all(axis=(2, 3)), 2, np.where(blk.any(axis=(2, 3)), 1, 0))
    return out


@pytest.mark.parametrize("chunk", [None, 1])
def test_blocks_match_a_dense_evaluation_and_the_index_is_ordered_and_transposed(monkeypatch, chunk):
    doc = _docs([70, 30, 130, 17, 90, 64, 40, 59])   # 8 documents, S = 500: a ragged last block
    prefix = np.array([3, 77], np.int32)

    def fn(b, h, q_idx, kv_idx):   # reads b and h: per-batch prefix, odd heads non-causal
        return (doc[q_idx] == doc[kv_idx]) & ((kv_idx <= q_idx) | (h % 2 == 1) | (kv_idx < prefix[b]))

    if chunk is not None:   # one query block per chunk: the same tables
        monkeypatch.setattr(ref_block_mask, "CHUNK_ELEMENTS", chunk)
    bm = cuflash.create_block_mask(fn, 2, 3, 500, 500, BLOCK_SIZE=(64, 128))
    want = _dense_codes(fn, 2, 3, 500, 500, 64, 128)
    assert bm.shape == (2, 3, 500, 500) and bm.num_blocks == (8, 4) and bm.BLOCK_SIZE == (64, 128)
    np.testing.assert_array_equal(bm.to_dense(), want)
    for code, num, idx, tnum, tidx in ((1, bm.kv_num_blocks, bm.kv_indices, bm.q_num_blocks, bm.q_indices),
                                       (2, bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_q_num_blocks,
                                        bm.full_q_indices)):
        assert num.dtype == idx.dtype == np.int32
        np.testing.assert_array_equal(num, (want == code).sum(-1))
        np.testing.assert_array_equal(tnum, (want == code).sum(-2))
        for b, h, r in np.ndindex(*num.shape):
            listed = idx[b, h, r, :num[b, h, r]]
            np.testing.assert_array_equal(listed, np.flatnonzero(want[b, h, r] == code))   # ascending
        for b, h, c in np.ndindex(*tnum.shape):
            np.testing.assert_array_equal(tidx[b, h, c, :tnum[b, h, c]], np.flatnonzero(want[b, h, :, c] == code))
    assert bm.sparsity() == pytest.approx(100 * (want == 0).mean())


def _qkv(rng, b=2, hq=4, hk=2, s=500, d=16):
    return (rng.standard_normal((b, hq, s, d)), rng.standard_normal((b, hk, s, d)), rng.standard_normal((b, hk, s, d)))


def test_numpy_path_equals_the_dense_mask_mod_forward_and_backward(rng):
    doc = _docs([45, 20, 83, 11, 57, 40, 25, 39])   # S = 320

    def fn(b, h, q_idx, kv_idx):   # per head: even heads causal
        return (doc[q_idx] == doc[kv_idx]) & ((kv_idx <= q_idx) | (h % 2 == 1))

    q, k, v = _qkv(rng, s=320)
    o0, l0 = cuflash.reference.naive_attention(q, k, v, mask_mod=fn, return_lse=True)
    dout = rng.standard_normal(o0.shape)
    want = cuflash.reference.attention_backward(dout, q, k, v, o0, l0, mask_mod=fn)
    for bm in (cuflash.create_block_mask(fn, None, 4, 320, 320, BLOCK_SIZE=64),
               cuflash.create_block_mask(fn, 2, 4, 320, 320, BLOCK_SIZE=(128, 64))):
        out, lse = cuflash.attention(q, k, v, block_mask=bm, return_lse=True)
        np.testing.assert_allclose(out, o0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, l0, rtol=0, atol=1e-12)
        got = cuflash.attention_backward(dout, q, k, v, out, lse, block_mask=bm, mask_mod=bm.mask_mod)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(a, w, rtol=0, atol=1e-11, err_msg=name)


def test_numpy_path_skips_empty_blocks_and_runs_full_ones_without_mask_mod(rng, monkeypatch):
    doc = _docs([128, 64, 96, 160, 64, 96, 64, 96])   # S = 768
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)
    codes = bm.to_dense()[0, 0]
    assert (codes == 2).any() and (codes == 1).any() and (codes == 0).any()
    seen = []
    keep = score_mods.ModTerms.keep

    def recording(self, index, shape):   # the (query block, key block) pairs mask_mod is evaluated on
        rows, cols = np.ravel(index["q_idx"]), np.ravel(index["kv_idx"])
        seen.extend((int(r) // 64, int(c) // 64) for r in np.unique(rows) for c in np.unique(cols))
        return keep(self, index, shape)

    monkeypatch.setattr(score_mods.ModTerms, "keep", recording)
    q, k, v = _qkv(rng, 1, 2, 1, 768)
    plan = cuflash.explain(q, k, v, block_mask=bm)
    assert (plan["backend"], plan["block_m"], plan["block_n"]) == ("numpy", 64, 64)   # a block is a tile
    out, lse = cuflash.attention(q, k, v, block_mask=bm, return_lse=True)
    cuflash.attention_backward(rng.standard_normal(out.shape), q, k, v, out, lse, block_mask=bm)
    assert set(seen) == {tuple(ij) for ij in np.argwhere(codes == 1)}   # partial blocks only, each of them
    monkeypatch.setattr(score_mods.ModTerms, "keep", keep)
    o0 = cuflash.reference.naive_attention(q, k, v, mask_mod=bm.mask_mod)
    np.testing.assert_allclose(out, o0, rtol=0, atol=1e-12)


def test_refusals_name_the_argument(rng):
    doc = _docs([100, 100])
    mm = mods.document_mask(doc)
    bm = cuflash.create_block_mask(mm, None, None, 200, 200, BLOCK_SIZE=64)
    q, k, v = _qkv(rng, 1, 2, 2, 200)
    with pytest.raises(ValueError, match=r"block_mask was built for \(Q_LEN, KV_LEN\) = \(200, 200\).*\(136, 200\)"):
        cuflash.attention(q[:, :, :136], k, v, block_mask=bm)
    with pytest.raises(ValueError, match=r"block_mask was built for \(B, H\) = \(1, 3\)"):
        cuflash.attention(q, k, v, block_mask=cuflash.create_block_mask(mm, None, 3, 200, 200, BLOCK_SIZE=64))
    with pytest.raises(ValueError, match="mask_mod must be the function block_mask was built from"):
        cuflash.attention(q, k, v, block_mask=bm, mask_mod=mods.document_mask(doc, causal=True))
    with pytest.raises(ValueError, match="mask_mod must be the function"):   # the same code over another array
        cuflash.attention(q, k, v, block_mask=bm, mask_mod=mods.document_mask(doc.copy()))
    with pytest.raises(ValueError, match=r"block_mask.kv_indices must be int32 of shape \(1, 1, 4, 4\)"):
        cuflash.attention(q, k, v, block_mask=dataclasses.replace(bm, kv_indices=bm.kv_indices.astype(np.int64)))
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        cuflash.attention(q, k, v, block_mask=bm.to_dense())
    with pytest.raises(ValueError, match=r"BLOCK_SIZE must be positive multiples of 64.*\(96, 64\)"):
        cuflash.create_block_mask(mm, None, None, 200, 200, BLOCK_SIZE=(96, 64))
    with pytest.raises(TypeError, match="BLOCK_SIZE must be an int or a pair"):
        cuflash.create_block_mask(mm, None, None, 200, 200, BLOCK_SIZE=64.0)
    with pytest.raises(ValueError, match="Q_LEN must be a positive int"):
        cuflash.create_block_mask(mm, None, None, 0, 200)
    with pytest.raises(ValueError, match="doc"):   # a captured array read past its end at these lengths
        cuflash.create_block_mask(mm, None, None, 300, 200)
    with pytest.raises(TypeError, match="not traceable"):
        cuflash.create_block_mask(lambda b, h, i, j: i if i > j else j, None, None, 200, 200)
    # the mask_mod it was built from is accepted (the same function object, or None)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, block_mask=bm, mask_mod=mm),
                                  cuflash.attention(q, k, v, block_mask=bm))


def test_the_device_build_keeps_to_device_arrays(monkeypatch):
    """``device="cuda"`` builds with the device's array module (CuPy's ufuncs and functions); here a
    stand-in module whose arrays refuse to meet a host NumPy array in a ufunc, as CuPy's do (the
    simulator's device arrays): the build never mixes the two, keeps its tables on the device, and
    gives the NumPy build's blocks."""
    from cuflash.sim import memory

    class DeviceModule:
        def __getattr__(self, name):
            f = getattr(np, name)
            return lambda *a, **k: memory.to_device(f(*a, **k))

    doc = _docs([45, 20, 83, 11, 57, 40, 25, 39])
    host = cuflash.create_block_mask(mods.document_mask(doc, causal=True), None, 2, 320, 320, BLOCK_SIZE=64)
    monkeypatch.setattr(ref_block_mask, "_module", lambda traced, device: DeviceModule())
    with pytest.raises(TypeError, match="mixes a simulated device array with a host"):   # the stand-in refuses mixing
        memory.to_device(np.arange(3)) + np.arange(3)
    dev = cuflash.create_block_mask(mods.document_mask(memory.to_device(doc), causal=True), None, 2, 320, 320,
                                    device="cuda", BLOCK_SIZE=64)
    assert all(memory.is_sim_array(a) for a in dev.arrays())
    np.testing.assert_array_equal(dev.to_dense(), host.to_dense())
