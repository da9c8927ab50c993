"""The portable attention kernel (kernels_cu/attention_fwd_simt.cu) on the CUDA simulator.

A pairwise covering design (allpairspy) over a grid chosen to break kernels: every value of
every axis appears and every pair of axes' values is covered. Outputs are checked against the
float64 oracle with the tolerance rule of DESIGN.md §5; fresh outputs are NaN-poisoned before
the launch, and the memory around every strided view is NaN so a read outside a view shows.
The full cross-product of the main axes runs under the ``slow`` marker.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _tolerance import check_close
from allpairspy import AllPairs

import cuflash
from cuflash import reference as ref
from cuflash.kernels import attention_fwd_simt
from cuflash.runtime import dtypes, plan

LENGTHS = [1, 17, 97, 128, 129, 255]
HEAD_DIMS = [40, 59, 64, 72, 96, 111, 128, 160, 256]
DV = ["same", "other"]
HEADS = [(1, 1), (7, 7), (7, 1), (8, 2)]  # (Hq, Hk): MHA, MHA, MQA 7:1, GQA 8:2
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "causal_win": (True, (16, -1)),
    "win_lr": (False, (7, 9)),
    "win_r": (False, (-1, 5)),
    "win_2_31": (False, (2**31 - 1, 2**33)),  # flash-attn's "unbounded" and past it: normalised on the host
}
FORMS = ["bhsd", "bshd", "strided", "transposed", "broadcast"]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}
LOGITS = ["normal", "large"]

AXES = [LENGTHS, LENGTHS, HEAD_DIMS, DV, HEADS, list(MASKS), FORMS, list(DTYPES), LOGITS]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


@pytest.fixture(autouse=True)
def _portable_tier():
    """Run as an sm_75 device would: the portable kernel is its only tier there, so every dtype of
    this grid exercises it. (On the default sm_90, aligned fp16/bf16 views go to the tensor-core
    kernel, whose grid is tests/test_attention_mma_sim.py.)"""
    with cuflash.sim.options(arch="sm_75"):
        yield


def test_grid_runs_the_portable_kernel():
    q = np.zeros((1, 2, 16, 64), np.float16)
    assert cuflash.explain(q, q, q, backend="sim")["tier"] == "attention_fwd_simt"


def _other_dv(d: int) -> int:
    """A value head dim different from ``d`` (the next one in the list, cyclically)."""
    return HEAD_DIMS[(HEAD_DIMS.index(d) + 3) % len(HEAD_DIMS)]


def _nan_padded(rng, shape, dtype, scale, pad_axes):
    """A view of ``shape`` inside a larger NaN-filled buffer (padding on ``pad_axes``)."""
    big = list(shape)
    for ax in pad_axes:
        big[ax] += 3
    buf = np.full(big, np.nan, dtype=dtype)
    view = buf[tuple(slice(0, n) for n in shape)]
    view[...] = (rng.standard_normal(shape) * scale).astype(dtype)
    return view


def make_inputs(rng, form, dtype, b, hq, hk, sq, sk, d, dv, scale):
    """q, k, v and the layout for one input form."""
    if form == "bshd":
        shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv))
        return (*(np.asarray(rng.standard_normal(s) * scale).astype(dtype) for s in shapes[:2]),
                rng.standard_normal(shapes[2]).astype(dtype), "bshd")
    shapes = ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv))
    if form == "bhsd":
        q, k = (np.asarray(rng.standard_normal(s) * scale).astype(dtype) for s in shapes[:2])
        return q, k, rng.standard_normal(shapes[2]).astype(dtype), "bhsd"
    if form == "strided":
        # every view sits in a NaN-filled buffer padded on the row, head and sequence axes, so
        # K/V are also views of a longer cache whose tail is NaN
        q = _nan_padded(rng, shapes[0], dtype, scale, (1, 2, 3))
        k = _nan_padded(rng, shapes[1], dtype, scale, (1, 2, 3))
        v = _nan_padded(rng, shapes[2], dtype, 1.0, (1, 2, 3))
        return q, k, v, "bhsd"
    if form == "transposed":
        # bhsd views of bshd storage
        q, k = (np.asarray(rng.standard_normal((s[0], s[2], s[1], s[3])) * scale).astype(dtype).swapaxes(1, 2)
                for s in shapes[:2])
        v = rng.standard_normal((b, sk, hk, dv)).astype(dtype).swapaxes(1, 2)
        return q, k, v, "bhsd"
    if form == "broadcast":
        # K/V shared by the whole batch: stride 0 on the batch axis
        q = np.asarray(rng.standard_normal(shapes[0]) * scale).astype(dtype)
        k = np.broadcast_to(np.asarray(rng.standard_normal((1,) + shapes[1][1:]) * scale).astype(dtype), shapes[1])
        v = np.broadcast_to(rng.standard_normal((1,) + shapes[2][1:]).astype(dtype), shapes[2])
        return q, k, v, "bhsd"
    raise ValueError(form)


def run_case(rng, sq, sk, d, dv_kind, heads, mask, form, dtype_key, logits, batch=None):
    hq, hk = heads
    dv = d if dv_kind == "same" else _other_dv(d)
    dtype = DTYPES[dtype_key]
    b = batch or (2 if form == "broadcast" else 1)
    # "large": scores |s| ~ 1e4 (q, k ~ N(0, 100^2) / d^(1/4) each; s = q.k / sqrt(d))
    scale = 100.0 / d**0.25 if logits == "large" else 1.0
    q, k, v, layout = make_inputs(rng, form, dtype, b, hq, hk, sq, sk, d, dv, scale)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
    assert out.dtype == dtype and lse.dtype == np.float32
    err = check_close(out, q, k, v, large_logits=logits == "large", **kw)
    _, lse_ref = ref.naive_attention(q, k, v, return_lse=True, **kw)
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty), "rows without a visible key must have lse = -inf"
    if empty.any():
        rows = out.swapaxes(1, 2) if layout == "bshd" else out
        assert (rows[empty] == 0).all(), "rows without a visible key must be 0"
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], rtol=2e-5, atol=2e-5 * max(1.0, np.abs(lse_ref[~empty]).max(initial=0)))
    return err


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,logits", PAIRWISE)
def test_pairwise_grid(sq, sk, d, dv, heads, mask, form, dtype, logits, rng):
    run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, logits)


def test_covering_design_covers_every_value_and_pair():
    # every value of each axis appears, and every pair of values of two axes appears together
    for i, axis in enumerate(AXES):
        assert {c[i] for c in PAIRWISE} == set(map(lambda x: x if not isinstance(x, list) else tuple(x), axis))
    for i, j in itertools.combinations(range(len(AXES)), 2):
        seen = {(c[i], c[j]) for c in PAIRWISE}
        assert len(seen) == len(AXES[i]) * len(AXES[j]), (i, j)


def test_rows_without_keys_and_no_keys_at_all(rng):
    # causal with Sq > Sk: the first Sq - Sk rows see nothing; Sk = 0: no row sees anything
    q = rng.standard_normal((1, 3, 40, 64)).astype(np.float16)
    k = rng.standard_normal((1, 3, 9, 64)).astype(np.float16)
    v = rng.standard_normal((1, 3, 9, 64)).astype(np.float16)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
    assert (out[:, :, :31] == 0).all() and np.isneginf(lse[:, :, :31]).all()
    check_close(out, q, k, v, causal=True)
    out, lse = cuflash.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, backend="sim")
    assert (out == 0).all() and np.isneginf(lse).all()


def test_zero_scale_averages_values(rng):
    q = rng.standard_normal((2, 5, 33, 72)).astype(np.float32)
    k = rng.standard_normal((2, 5, 70, 72)).astype(np.float32)
    v = rng.standard_normal((2, 5, 70, 40)).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, softmax_scale=0.0, return_lse=True, backend="sim")
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.log(70), rtol=1e-6)


def test_two_dim_extra_batch_dims_and_out_argument(rng):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((19, 32), (23, 32), (23, 16)))
    out = cuflash.attention(q, k, v, causal=True, backend="sim")
    check_close(out, q, k, v, causal=True)
    # leading batch dims that do not merge into one stride: launched per outer index
    base = rng.standard_normal((3, 4, 2, 9, 8)).astype(np.float16)
    q5 = base[:, ::2]
    k5, v5 = (rng.standard_normal((3, 2, 2, 11, 8)).astype(np.float16) for _ in range(2))
    buf = np.full((3, 2, 2, 9, 8), np.nan, np.float16)
    res = cuflash.attention(q5, k5, v5, out=buf, backend="sim")
    assert res is buf
    check_close(buf, q5, k5, v5)


def test_head_dims_one_to_256(rng):
    # every head dim works, not only the grid's: a sweep of odd ones, D != Dv both ways
    for d, dv in ((1, 1), (3, 200), (33, 8), (200, 3), (256, 255)):
        q = rng.standard_normal((1, 2, 21, d)).astype(np.float32)
        k = rng.standard_normal((1, 1, 30, d)).astype(np.float32)
        v = rng.standard_normal((1, 1, 30, dv)).astype(np.float32)
        out = cuflash.attention(q, k, v, causal=True, backend="sim")
        check_close(out, q, k, v, causal=True)


def test_variant_choice_respects_shared_memory():
    for arch in attention_fwd_simt.ARCHES:
        for v in attention_fwd_simt.all_variants(arch):
            assert v.smem_bytes <= plan.max_dynamic_smem(arch)
    v = attention_fwd_simt.choose_variant(np.float16, 40, 72, 90)
    assert (v.head_dim_max, v.dtype) == (128, "f16")
    assert v.entry == f"cuflash_attn_fwd_simt_f16_d128_m{v.block_m}_n{v.block_n}"
    with pytest.raises(NotImplementedError, match="head dim 300 exceeds the largest bucket 256"):
        attention_fwd_simt.AttentionFwdSimt.bucket(300, 8)


def test_float64_has_no_kernel():
    x = np.zeros((1, 1, 4, 8))
    with pytest.raises(NotImplementedError, match=r"float64 runs on the NumPy path only .*backend='sim'"):
        cuflash.attention(x, x, x, backend="sim")


SLOW_GRID = list(itertools.product(LENGTHS, LENGTHS, HEAD_DIMS, list(MASKS), list(DTYPES)))


@pytest.mark.slow
@pytest.mark.parametrize("sq,sk,d,mask,dtype", SLOW_GRID)
def test_full_grid(sq, sk, d, mask, dtype, rng):
    # the cross-product of lengths, head dims, masks and dtypes; the other axes rotate
    i = SLOW_GRID.index((sq, sk, d, mask, dtype))
    run_case(rng, sq, sk, d, DV[i % 2], HEADS[i % 4], mask, FORMS[i % 5], dtype, LOGITS[i % 2])
