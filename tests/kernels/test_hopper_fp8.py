"""The Hopper fp8 forward (``kernels_cu/attention_fwd_sm90.cu``, its ``_e4m3`` forms) on the
simulator as an sm_90 device runs it.

Every case is held to the fp8 rule (:mod:`cuflash.reference.tolerance`: the float64 attention of
the descaled fp8 values, twice the error of a float32 baseline that rounds P to e4m3, plus the
output type's floor; the lse against float64) and asserts the dispatcher chose the fp8 form.
Descales differ per (batch, kv head); values reach e4m3's largest, 448.

The default run compiles one variant (bf16 output, head-dim bucket 64, causal or windowed:
``cuflash_attn_fwd_sm90_bf16_d64_local_e4m3``) and runs it on a causal GQA case with Sq > Sk
(rows without keys), a window with Sq < Sk over five key tiles, a bshd layout with D != Dv, and a
strided V view (V is copied key-contiguous before the launch, so any view gives the same bits). The grid over head dims 64, 128, 256, masks, GQA and both output
types, and checked mode, run under ``slow``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support.tolerance import check_close

import cuflash

E4M3 = ml_dtypes.float8_e4m3fn


def fp8(rng, shape, scale=3.0):
    return np.clip(rng.standard_normal(shape) * scale, -448, 448).astype(E4M3)


def descales(rng, b, hk, lo=0.25, hi=4.0):
    return rng.uniform(lo, hi, (b, hk)).astype(np.float32)


def run(q, k, v, *, checked=False, seed=None, **kw):
    """The fp8 form on the simulator (sm_90): ``(out, lse)``, checked against the rule."""
    opts = dict(arch="sm_90", checked=checked) | ({} if seed is None else dict(seed=seed))
    with cuflash.sim.options(**opts):
        ex = cuflash.explain(q, k, v, backend="sim", **kw)
        assert ex["tier"] == "attention_fwd_sm90" and ex["entry"].endswith("_e4m3"), ex["choice"]
        out, lse = cuflash.attention(q, k, v, backend="sim", return_lse=True, **kw)
    assert out.dtype == np.dtype(kw.get("out_dtype") or ml_dtypes.bfloat16)
    check_close(out, q, k, v, lse=lse, **kw)
    return out, lse


def near_max_case(rng, b, hq, hk, sq, sk, d, dv=None):
    """q, k, v with values up to 448 (the first query row of every head at +-448, a tenth of the
    keys scaled by 100 and clipped) and per-(batch, kv head) descales small enough that the
    scores stay in a softmax's range."""
    q, k, v = fp8(rng, (b, hq, sq, d)), fp8(rng, (b, hk, sk, d)), fp8(rng, (b, hk, sk, dv or d), 60)
    q[:, :, 0] = np.where(np.arange(d) % 2, 448, -448).astype(E4M3)
    k[:, :, ::10] = np.clip(k[:, :, ::10].astype(np.float32) * 100, -448, 448).astype(E4M3)
    kw = dict(q_descale=descales(rng, b, hk, 0.02, 0.08), k_descale=descales(rng, b, hk, 0.02, 0.08),
              v_descale=descales(rng, b, hk))
    return q, k, v, kw


def test_fp8_forward_d64_causal_gqa_window_layouts():
    """One variant, four calls: causal GQA 4:2 with Sq > Sk (the first Sq - Sk rows see no key: 0,
    lse -inf), descales per (batch, kv head) and values at 448; a window with Sq < Sk (five key
    tiles through the 2-stage rings); bshd with D = 48, Dv = 32 (the bucket's zero fill); and V as
    a view with a row stride of two rows and an offset (strides a tensor map could not describe),
    which gives the same bits as the contiguous V: V reaches the kernel through its copy."""
    rng = np.random.default_rng(42)
    q, k, v, kw = near_max_case(rng, 2, 4, 2, 150, 100, 64)
    out, lse = run(q, k, v, causal=True, **kw)
    assert (out[:, :, :50].astype(np.float32) == 0).all() and np.isneginf(lse[:, :, :50]).all()
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse[:, :, 50:]).all()

    q, k, v, kw = near_max_case(rng, 1, 2, 1, 70, 600, 64)
    run(q, k, v, window_size=(200, 30), **kw)

    qb, kb, vb = fp8(rng, (2, 90, 4, 48)), fp8(rng, (2, 130, 2, 48)), fp8(rng, (2, 130, 2, 32))
    kwb = dict(q_descale=descales(rng, 2, 2), k_descale=descales(rng, 2, 2), v_descale=descales(rng, 2, 2))
    run(qb, kb, vb, layout="bshd", causal=True, window_size=(40, -1), **kwb)
    run(qb, kb, vb, layout="bshd", causal=True, window_size=(40, -1), v_descale=kwb["v_descale"])   # q's, k's absent: 1

    q, k, v, kw = near_max_case(rng, 1, 2, 2, 40, 77, 64)
    big = fp8(rng, (1, 2, 154, 80))
    big[:, :, ::2, 8:72] = v
    v_view = big[:, :, ::2, 8:72]   # every other row of a wider buffer: strides a TMA map could not take
    out, _ = run(q, k, v, causal=True, **kw)
    out_view, _ = run(q, k, v_view, causal=True, **kw)
    np.testing.assert_array_equal(out_view.view(np.uint16), out.view(np.uint16))


def test_fp8_value_copy_permutes_keys_in_32_key_blocks():
    """V's key-contiguous copy: key 16a + 8b + 2t + c of each 32-key block at position
    16a + 4t + 2b + c (ptx.cuh's P fragment), keys past Sk zero; from the formula, per key."""
    from cuflash.kernels.attention_fwd_sm90 import fp8_value_copy

    rng = np.random.default_rng(1)
    v = rng.integers(1, 255, (2, 3, 45, 5)).astype(np.uint8)
    vt = fp8_value_copy(v, np)
    assert vt.shape == (2, 3, 5, 64) and vt.dtype == np.uint8
    for key in range(64):
        blk, r = divmod(key, 32)
        pos = 32 * blk + 16 * (r // 16) + 4 * ((r % 8) // 2) + 2 * ((r // 8) % 2) + r % 2
        want = v[:, :, key, :] if key < 45 else 0
        np.testing.assert_array_equal(vt[:, :, :, pos], want, err_msg=f"key {key} -> position {pos}")


# the slow grid: every head-dim bucket and both output types; masks, GQA, Sq != Sk
GRID = [
    (64, "none", (4, 4), "float16", 200, 333),
    (64, "window", (8, 2), "bfloat16", 129, 64),
    (128, "none", (2, 1), "bfloat16", 140, 290),
    (128, "causal", (4, 2), "float16", 300, 130),
    (128, "window", (2, 2), "bfloat16", 64, 500),
    (128, "causal_left", (6, 2), "float16", 77, 131),
    (256, "none", (2, 1), "float16", 130, 200),
    (256, "causal", (4, 2), "bfloat16", 190, 260),
    (256, "window", (2, 2), "float16", 60, 300),
    (256, "causal_left", (2, 1), "bfloat16", 150, 150),
]
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(40, 25)),
         "causal_left": dict(causal=True, window_size=(70, -1))}


@pytest.mark.slow
@pytest.mark.parametrize("d, mask, heads, out_dtype, sq, sk", GRID)
def test_fp8_forward_grid(d, mask, heads, out_dtype, sq, sk):
    rng = np.random.default_rng(d + sq + sk)
    dh = d - 16 if d > 64 else d   # (128 and 256: a head dim below the bucket too)
    q, k, v, kw = near_max_case(rng, 2, heads[0], heads[1], sq, sk, dh)
    run(q, k, v, out_dtype=out_dtype, **MASKS[mask], **kw)


@pytest.mark.slow
@pytest.mark.checked
def test_fp8_forward_checked():
    """Checked mode (races, bounds, uninitialised reads, the async proxies): head dim 128, causal
    GQA, five key tiles (each ring slot refilled twice), stride-0 descales (one per tensor)."""
    rng = np.random.default_rng(5)
    q, k, v = fp8(rng, (1, 4, 200, 128)), fp8(rng, (1, 2, 600, 128)), fp8(rng, (1, 2, 600, 128))
    kw = dict(q_descale=np.broadcast_to(np.float32(0.1), (1, 2)), k_descale=np.broadcast_to(np.float32(0.2), (1, 2)),
              v_descale=np.broadcast_to(np.float32(2.0), (1, 2)))
    run(q, k, v, checked=True, causal=True, **kw)
