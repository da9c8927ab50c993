"""Block-sparse masks in the tensor-core forward and backward (the ``_bs`` forms of
attention_fwd_mma.cu / attention_bwd_mma.cu, CUFLASH_BLOCK_SPARSE) on the CUDA simulator.

The tiles a launch entered are counted by the kernels themselves when compiled for the simulator
(``cuflash.kernels.launch_args.counting_tiles``: each thread block writes how many partial and full
tiles its loop ran), and held to what the block mask lists; results are held to the project's
tolerance rule against the float64 oracle with the dense ``mask_mod``. Every test here compiles a
new variant, so all run under ``slow``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support.grads import assert_grads_within_twice_the_numpy_path

import cuflash
from cuflash import mods, sim
from cuflash.kernels import launch_args as la
from cuflash.reference import tolerance
from cuflash.runtime import dtypes

pytestmark = pytest.mark.slow

#: 8 packed documents, S = 768: with 64-row blocks some blocks lie inside one document (full below
#: the diagonal), some straddle two (partial), most see none (empty)
LENGTHS = (128, 64, 96, 160, 64, 96, 64, 96)


def test_a_document_mask_over_8_documents_runs_only_the_tiles_it_needs(rng):
    doc = np.repeat(np.arange(8, dtype=np.int32), LENGTHS)
    s, hq, hk, d = len(doc), 4, 2, 64
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)   # the kernels' 64 x 64 tiles
    codes = bm.to_dense()[0, 0]
    n = codes.shape[0]
    q = rng.standard_normal((1, hq, s, d)).astype(dtypes.float16)
    k, v = (rng.standard_normal((1, hk, s, d)).astype(dtypes.float16) for _ in range(2))
    plan = cuflash.explain(q, k, v, backend="sim", arch=80, block_mask=bm)
    assert plan["variant"].endswith("_bs") and plan["block_m"] == plan["block_n"] == 64, plan
    with sim.options(arch=80), la.counting_tiles() as counts:
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", block_mask=bm)
        dout = rng.standard_normal(out.shape).astype(dtypes.float16)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", block_mask=bm)
    fwd, bwd = counts
    # forward: block (tile, head) runs query tile n - 1 - tile (last first); partial tiles then full ones
    fwd = fwd.reshape(hq, n, 2)[:, ::-1]
    np.testing.assert_array_equal(fwd[..., 0], np.broadcast_to((codes == 1).sum(1), (hq, n)))
    np.testing.assert_array_equal(fwd[..., 1], np.broadcast_to((codes == 2).sum(1), (hq, n)))
    # backward: block (key tile, kv head) walks the query tiles of its group's 2 heads that see it
    bwd = bwd.reshape(hk, n, 2)
    np.testing.assert_array_equal(bwd[..., 0], np.broadcast_to(2 * (codes == 1).sum(0), (hk, n)))
    np.testing.assert_array_equal(bwd[..., 1], np.broadcast_to(2 * (codes == 2).sum(0), (hk, n)))
    entered, dense = int(fwd.sum()), hq * n * n
    assert entered == hq * int((codes > 0).sum()) and entered < dense // 6, (entered, dense)
    # results: the dense mask_mod's (the float64 oracle with it)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, mask_mod=bm.mask_mod)
    assert ok, msg
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtypes.float16, mask_mod=bm.mask_mod)

    # a full tile runs without mask_mod: a block mask that calls every block full, carrying the
    # document mask as its mask_mod (the same compiled variant), gives attention without the mask
    every = cuflash.create_block_mask(lambda b, h, i, j: j >= 0, None, None, 128, 128, BLOCK_SIZE=64)
    forged = dataclasses.replace(every, mask_mod=bm.mask_mod)
    q2, k2, v2 = q[:, :, :128], k[:, :, :128], v[:, :, :128]
    with sim.options(arch=80):
        out2, lse2 = cuflash.attention(q2, k2, v2, return_lse=True, backend="sim", block_mask=forged)
    ok, msg, _ = tolerance.compare(out2, q2, k2, v2, lse=lse2)
    assert ok, msg


def test_larger_blocks_per_head_and_batch_with_gqa_and_causal(rng):
    """128 x 128 blocks over 64-row tiles (each block as several tiles), a block mask per batch entry
    and head (it reads b and h), Sq = Sk = 300 (a ragged last block), causal on top, bfloat16."""
    b, hq, hk, s, d = 2, 4, 2, 300, 64
    doc = np.stack([np.repeat(np.arange(3, dtype=np.int32), (90, 150, 60)),
                    np.repeat(np.arange(2, dtype=np.int32), (200, 100))])
    prefix = np.array([40, 0], np.int32)

    def fn(bi, h, q_idx, kv_idx):   # odd heads also see their batch entry's prefix
        return (doc[bi, q_idx] == doc[bi, kv_idx]) | ((h % 2 == 1) & (kv_idx < prefix[bi]))

    bm = cuflash.create_block_mask(fn, b, hq, s, s, BLOCK_SIZE=128)
    q = rng.standard_normal((b, hq, s, d)).astype(dtypes.bfloat16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(dtypes.bfloat16) for _ in range(2))
    with sim.options(arch=80), la.counting_tiles() as counts:
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", causal=True, block_mask=bm)
        dout = rng.standard_normal(out.shape).astype(dtypes.bfloat16)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", causal=True, block_mask=bm)
    codes = bm.to_dense()   # (b, hq, 3, 3)
    per_row = np.where(codes > 0, 2, 0).sum(-1)   # each listed 128-key block is two 64-key tiles
    fwd = counts[0].reshape(b, hq, 5, 2)[:, :, ::-1].sum(-1)   # 5 query tiles of 64 rows
    np.testing.assert_array_equal(fwd, np.repeat(per_row, 2, axis=-1)[..., :5])
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=True, mask_mod=fn)
    assert ok, msg
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtypes.bfloat16, causal=True, mask_mod=fn)


def test_checked_mode_is_clean_with_a_block_mask(rng):
    doc = np.repeat(np.arange(3, dtype=np.int32), (70, 64, 58))
    bm = mods.document_block_mask(doc, BLOCK_SIZE=64)
    q, k, v = (rng.standard_normal((1, 2, 192, 64)).astype(dtypes.float16) for _ in range(3))
    with sim.options(arch=80):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", block_mask=bm)
    dout = rng.standard_normal(out.shape).astype(dtypes.float16)
    with sim.options(arch=80, checked=True), la.counting_tiles():
        out_c, lse_c = cuflash.attention(q, k, v, return_lse=True, backend="sim", block_mask=bm)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", block_mask=bm)
    np.testing.assert_array_equal(out_c, out)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, mask_mod=bm.mask_mod)
    assert ok, msg
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtypes.float16, mask_mod=bm.mask_mod)
