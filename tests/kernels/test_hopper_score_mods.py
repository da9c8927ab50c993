"""Traced ``score_mod`` / ``mask_mod`` and block masks in the Hopper forward (the traced and
block-sparse forms of attention_fwd_sm90.cu: CUFLASH_USER_MOD, CUFLASH_BLOCK_SPARSE).

The default run checks the routes and the variants on the host (no kernel compile): which calls
the Hopper tier takes, the cache key it shares with the tensor-core tier, and the calls it passes
on with the reason. Under ``slow`` the forms run on the CUDA simulator against the float64 oracle
(the ready-made ``cuflash.mods`` examples and two invented functions), a block mask against the
dense mask_mod, the tiles the block-sparse form enters (its own count), and checked mode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support import score_mod_cases

import cuflash
from cuflash import mods, sim
from cuflash.kernels import attention_fwd_sm90 as hf
from cuflash.kernels import launch_args as la
from cuflash.reference import tolerance
from cuflash.runtime import dtypes
from cuflash.sim import launcher

B, HQ, HK, SQ, SK = 2, 4, 2, 150, 200


def _zeros(d=64, sq=SQ, sk=SK, dtype=np.float16, b=B):
    return np.zeros((b, HQ, sq, d), dtype), np.zeros((b, HK, sk, d), dtype), np.zeros((b, HK, sk, d), dtype)


def _doc_mask(sk=SK):
    doc = np.repeat(np.arange(4, dtype=np.int32), sk // 4 + 1)[:sk]
    return mods.document_mask(doc, causal=True)


def test_traced_functions_take_the_hopper_forward_with_the_tensor_core_cache_key():
    q, k, v = _zeros()
    slopes = np.full(HQ, 0.25, np.float32)
    kw = dict(score_mod=mods.alibi(slopes), mask_mod=_doc_mask())
    hopper = cuflash.explain(q, k, v, arch=90, causal=True, **kw)
    assert hopper["tier"] == "attention_fwd_sm90" and "_local_mods_um" in hopper["variant"], hopper
    assert hopper["block_m"] == 128 and hopper["block_n"] == 128
    tc = cuflash.explain(q, k, v, arch=80, causal=True, **kw)
    key = tc["variant"].split("_um")[1][:16]
    assert hopper["variant"].endswith("_um" + key)   # the same canonical text, the same hash
    # new captured values: the same variant (they are run-time arguments)
    again = cuflash.explain(q, k, v, arch=90, causal=True, score_mod=mods.alibi(slopes * 3), mask_mod=_doc_mask())
    assert again["variant"] == hopper["variant"]
    # head dim 256: 64 keys a tile (80, the modifier forms', spills with a traced function)
    q, k, v = _zeros(256)
    assert cuflash.explain(q, k, v, arch=90, **kw)["variant"].endswith("_n64")
    # a call without traced functions keeps its variant
    assert cuflash.explain(q, k, v, arch=90, softcap=5.0)["variant"] == "f16_d256_mods"


@pytest.mark.parametrize("block_size,d,bn", [(128, 64, 128), ((128, 64), 64, 64), (128, 96, 64), (128, 128, 64),
                                              ((256, 192), 96, 64), (128, 256, 64)])
def test_a_block_mask_takes_the_block_sparse_form_where_its_blocks_hold_whole_tiles(block_size, d, bn):
    q, k, v = _zeros(d, 256, 256, b=1)
    bm = cuflash.create_block_mask(_doc_mask(256), None, None, 256, 256, BLOCK_SIZE=block_size)
    e = cuflash.explain(q, k, v, arch=90, block_mask=bm)
    assert e["tier"] == "attention_fwd_sm90" and e["variant"].endswith(f"_n{bn}_bs") and e["block_n"] == bn, e
    assert "empty ones never loaded" in e["choice"]


def test_calls_the_hopper_forms_do_not_take_go_to_the_tensor_core_tier_with_the_reason():
    q, k, v = _zeros(64, 256, 256, b=1)
    bm = cuflash.create_block_mask(_doc_mask(256), None, None, 256, 256, BLOCK_SIZE=64)
    e = cuflash.explain(q, k, v, arch=90, block_mask=bm)
    assert e["tier"] == "attention_fwd_mma" and e["variant"].endswith("_bs"), e
    assert "Hopper wgmma tier not used: the block_mask's Q_BLOCK=64 is not a multiple of the Hopper kernel's 128" \
        in e["choice"]
    # a captured array the kernels cannot read: named for the Hopper tier as well
    wide = np.ones(HQ, np.float64)   # float64: the NumPy path reads it, the kernels do not
    with pytest.raises(NotImplementedError, match="Hopper wgmma tier not used: score_mod's captured array 'wide' is "
                                                  "float64 .* in the Hopper kernel"):
        cuflash.explain(q, k, v, arch=90, score_mod=lambda s, b, h, i, j: s * wide[h])
    # float32: no Hopper form, as without traced functions (nor any kernel: the NumPy path takes it)
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    with pytest.raises(NotImplementedError, match="Hopper wgmma tier not used: dtype float32"):
        cuflash.explain(q32, k32, v32, arch=90, score_mod=lambda s, b, h, i, j: s * 0.5)
    # packed batches: the built-in modifiers run on the Hopper packed form, a traced function on no
    # kernel (the NumPy path takes it), and the refusal names the Hopper tier's reason
    cu = np.array([0, 100, 256], np.int32)
    qp, kp, vp = (a[0].transpose(1, 0, 2) for a in (q, k, v))
    e = cuflash.explain_varlen(qp, kp, vp, cu, cu, 156, 156, arch=90, softcap=5.0)
    assert e["tier"] == "attention_fwd_sm90" and e["variant"].endswith("_mods_varlen"), e
    with pytest.raises(NotImplementedError, match="Hopper wgmma tier not used: score_mod/mask_mod on a packed batch"):
        cuflash.explain_varlen(qp, kp, vp, cu, cu, 156, 156, arch=90, score_mod=lambda s, b, h, i, j: s * 0.5)


def test_the_variant_refuses_forms_it_has_not():
    with pytest.raises(ValueError, match="axis of the modifier forms"):
        hf.Sm90ForwardVariant("f16", 64, 64, False, score_c="(s)")
    with pytest.raises(ValueError, match=r"tile_n in \(128, 64\)"):
        hf.Sm90ForwardVariant("f16", 64, 64, False, True, mask_c="(true)", block_sparse=True, tile_n=96)
    with pytest.raises(ValueError, match="a traced mask_mod"):
        hf.Sm90ForwardVariant("f16", 64, 64, False, True, score_c="(s)", block_sparse=True, tile_n=64)
    with pytest.raises(ValueError, match="tile_n=64 is an axis of the traced forms"):
        hf.Sm90ForwardVariant("f16", 64, 64, False, True, tile_n=64)
    v = hf.Sm90ForwardVariant("f16", 64, 64, False, True, mask_c="(true)", block_sparse=True, tile_n=64)
    assert dict(v.defines())["CUFLASH_BLOCK_SPARSE"] == "1" and dict(v.defines())["CUFLASH_USER_MOD"] == "2"
    assert "CUFLASH_USER_MOD" not in dict(hf.Sm90ForwardVariant("f16", 64, 64, False, True).defines())


# ------------------------------------------------------------------------------------------ slow


def _qkv(rng, dtype, sq=SQ, sk=SK, d=64, b=B, hq=HQ, hk=HK):
    return (rng.standard_normal((b, hq, sq, d)).astype(dtype), rng.standard_normal((b, hk, sk, d)).astype(dtype),
            rng.standard_normal((b, hk, sk, d)).astype(dtype))


def _hopper(q, k, v, checked=False, **kw):
    with sim.options(arch=90, checked=checked):
        assert cuflash.explain(q, k, v, backend="sim", **kw)["tier"] == "attention_fwd_sm90"
        return cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", score_mod_cases.READY_MADE)
def test_ready_made_mods_on_the_hopper_forward(name, rng):
    q, k, v = _qkv(rng, dtypes.bfloat16, SK, SK)   # two query tiles, two key tiles
    score_fn, mask_fn = score_mod_cases.ready_made(name, rng, SK, B, HQ)
    out, lse = _hopper(q, k, v, score_mod=score_fn, mask_mod=mask_fn)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn)
    assert ok, msg


def _invented_2(bias, lo):
    """exp, tanh, min, a float (Hq, Sk) table read at (h, kv_idx), a per-batch int bound in the mask."""
    def score_fn(score, b, h, q_idx, kv_idx):
        return mods.minimum(score, 4.0 * mods.tanh(score)) + mods.exp(-abs(bias[h, kv_idx]))

    def mask_fn(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[b]) | (q_idx % 7 == kv_idx % 7)

    return score_fn, mask_fn


@pytest.mark.slow
@pytest.mark.parametrize("dtype_key,window", [("bf16", (-1, 0)), ("f16", (40, 3))])
def test_invented_mods_with_causal_and_windows_on_the_hopper_forward(rng, dtype_key, window):
    """Sq > Sk (rows that see no key under bottom-right causal), a window narrower than a tile; new
    values of the captured arrays run the same compiled module."""
    dtype = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}[dtype_key]
    q, k, v = _qkv(rng, dtype, 200, 145)
    kw = dict(window_size=window) if window != (-1, 0) else dict(causal=True)
    for n in range(2):
        table = rng.uniform(-1.5, 1.5, (B, HQ)).astype(np.float32)
        score_fn, mask_fn = score_mod_cases.invented(table, rng.random(145) > 0.3)
        loaded = len(launcher._modules)
        out, lse = _hopper(q, k, v, score_mod=score_fn, mask_mod=mask_fn, **kw)
        assert n == 0 or len(launcher._modules) == loaded
        ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn, **kw)
        assert ok, msg
    score_fn, mask_fn = _invented_2(rng.standard_normal((HQ, 145)).astype(np.float32), np.array([20, 90], np.int32))
    out, lse = _hopper(q, k, v, score_mod=score_fn, mask_mod=mask_fn, **kw)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn, **kw)
    assert ok, msg


#: 8 packed documents, S = 768 (the tensor-core form's case: 80 of 576 tiles of 64 x 64)
LENGTHS = (128, 64, 96, 160, 64, 96, 64, 96)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [(128, 64), 128])
def test_a_document_mask_over_8_documents_on_the_hopper_form(rng, block_size):
    doc = np.repeat(np.arange(8, dtype=np.int32), LENGTHS)
    s, hq, hk, d = len(doc), 4, 2, 64
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=block_size)
    codes = bm.to_dense()[0, 0]
    q, k, v = _qkv(rng, dtypes.float16, s, s, d, 1, hq, hk)
    with sim.options(arch=90):
        plan = cuflash.explain(q, k, v, backend="sim", block_mask=bm)
    bn = 128 if block_size == 128 else 64
    assert plan["tier"] == "attention_fwd_sm90" and plan["variant"].endswith(f"_n{bn}_bs"), plan
    with la.counting_tiles() as counts:
        out, lse = _hopper(q, k, v, block_mask=bm)
    # block (query tile, head) runs query tile n - 1 - x (last first); each listed block is kv_block / bn tiles
    n, sub = codes.shape[0], bm.BLOCK_SIZE[1] // bn
    got = counts[0].reshape(hq, n, 2)[:, ::-1]
    np.testing.assert_array_equal(got[..., 0], np.broadcast_to(sub * (codes == 1).sum(1), (hq, n)))
    np.testing.assert_array_equal(got[..., 1], np.broadcast_to(sub * (codes == 2).sum(1), (hq, n)))
    dense = hq * n * -(-s // bn)
    assert int(got.sum()) == hq * sub * int((codes > 0).sum()) and int(got.sum()) < dense // 3, (got.sum(), dense)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, mask_mod=bm.mask_mod)
    assert ok, msg
    # the dense mask_mod on the same tier: the same result to rounding (another order of the key tiles)
    out_d, lse_d = _hopper(q, k, v, mask_mod=bm.mask_mod)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_d, np.float32), rtol=0, atol=2e-3)
    np.testing.assert_allclose(lse, lse_d, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_full_tiles_skip_mask_mod_and_a_per_head_mask_with_gqa_and_causal(rng):
    """A block mask that calls every block full, carrying a document mask as its mask_mod, gives
    attention without the mask (full tiles run without mask_mod); then 128-blocks per batch entry
    and head (the function reads b and h), Sq = Sk = 300 (a ragged last block), causal on top,
    bfloat16 at head dim 128 (64 keys a tile, two per block)."""
    doc = np.repeat(np.arange(2, dtype=np.int32), (100, 156))
    every = cuflash.create_block_mask(lambda b, h, i, j: j >= 0, None, None, 256, 256, BLOCK_SIZE=128)
    forged = dataclasses.replace(every, mask_mod=mods.document_block_mask(doc).mask_mod)
    q, k, v = _qkv(rng, dtypes.float16, 256, 256, 64, 1, 2, 1)
    out, lse = _hopper(q, k, v, block_mask=forged)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse)
    assert ok, msg

    b, hq, hk, s, d = 2, 4, 2, 300, 128
    docs = np.stack([np.repeat(np.arange(3, dtype=np.int32), (90, 150, 60)),
                     np.repeat(np.arange(2, dtype=np.int32), (200, 100))])
    prefix = np.array([40, 0], np.int32)

    def fn(bi, h, q_idx, kv_idx):   # odd heads also see their batch entry's prefix
        return (docs[bi, q_idx] == docs[bi, kv_idx]) | ((h % 2 == 1) & (kv_idx < prefix[bi]))

    bm = cuflash.create_block_mask(fn, b, hq, s, s, BLOCK_SIZE=128)
    q, k, v = _qkv(rng, dtypes.bfloat16, s, s, d, b, hq, hk)
    with la.counting_tiles() as counts:
        out, lse = _hopper(q, k, v, causal=True, block_mask=bm)
    per_row = np.where(bm.to_dense() > 0, 2, 0).sum(-1)   # (b, hq, 3): each listed block is two 64-key tiles
    np.testing.assert_array_equal(counts[0].reshape(b, hq, 3, 2)[:, :, ::-1].sum(-1), per_row)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=True, mask_mod=fn)
    assert ok, msg


@pytest.mark.slow
def test_checked_mode_is_clean_in_the_hopper_forms(rng):
    q, k, v = _qkv(rng, dtypes.float16, 200, 260, 64, 1, 2, 1)
    slopes = rng.uniform(0.05, 0.5, 2).astype(np.float32)
    score_fn, mask_fn = mods.alibi(slopes), _doc_mask(260)
    out, lse = _hopper(q, k, v, checked=True, causal=True, score_mod=score_fn, mask_mod=mask_fn)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=True, score_mod=score_fn, mask_mod=mask_fn)
    assert ok, msg
    doc = np.repeat(np.arange(3, dtype=np.int32), (70, 64, 122))
    bm = mods.document_block_mask(doc, BLOCK_SIZE=(128, 64))
    q, k, v = _qkv(rng, dtypes.float16, 256, 256, 64, 1, 2, 1)
    with la.counting_tiles():
        out, lse = _hopper(q, k, v, checked=True, block_mask=bm)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, mask_mod=bm.mask_mod)
    assert ok, msg
