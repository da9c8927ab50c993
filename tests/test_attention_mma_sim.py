"""The tensor-core attention kernel (kernels_cu/attention_fwd_mma.cu) on the CUDA simulator.

The breaking grid of tests/test_attention_sim.py (its input forms and checks), as a pairwise
covering design (allpairspy) at simulator-friendly sizes (S <= 129, B * Hq <= 8): odd lengths,
every head-dim bucket (64, 96, 128, 192, 256) plus multiples of 8 that run in the next bucket
(40, 80, 160) and one that must fall back (59), D != Dv, MHA/MQA/GQA, causal and windows,
strided views inside NaN-filled buffers, transposed and broadcast (stride-0) views, views at an
odd offset or with strides that are not multiples of 8 (both must fall back to the SIMT
kernel), large logits. Every case also checks which tier the dispatcher chose, so a silent
fallback cannot pass as a tensor-core result. The simulator emulates sm_90 by default; a few
cases run the sm_80 variants (other tiles for 256).

On sm_90 the Hopper tier (kernels_cu/attention_fwd_sm90.cu) now comes first; this module takes it
out of the dispatcher's list (the autouse fixture below), so the tensor-core tier keeps its own
sm_90 grid: it is what serves sm_90 calls the Hopper tier refuses (dropout, packed batches, KV
caches, views a tensor map cannot describe) and Blackwell. tests/test_attention_sm90_sim.py runs
the same grid on the Hopper tier.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from _tolerance import check_close
from allpairspy import AllPairs
from test_attention_sim import MASKS, _nan_padded, make_inputs

import cuflash
from cuflash import reference as ref
from cuflash.kernels import attention_fwd_mma, attention_fwd_simt, dispatch
from cuflash.runtime import dtypes, plan, validation

LENGTHS = [1, 17, 97, 128, 129]
HEAD_DIMS = [40, 59, 64, 80, 96, 128, 160, 192, 256]
#: the value head dim of the "other" case: a different multiple of 8 (59 keeps a non-multiple)
OTHER_DV = {40: 96, 59: 64, 64: 32, 80: 128, 96: 40, 128: 64, 160: 256, 192: 120, 256: 200}
DV = ["same", "other"]
HEADS = [(1, 1), (2, 2), (4, 1), (4, 2)]  # (Hq, Hk): MHA, MHA, MQA 4:1, GQA 4:2
#: input forms; the last two must fall back to the SIMT kernel
FORMS = ["bhsd", "bshd", "strided8", "transposed", "broadcast", "strided3", "offset"]
FALLBACK_FORMS = {"strided3", "offset"}
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
LOGITS = ["normal", "large"]

AXES = [LENGTHS, LENGTHS, HEAD_DIMS, DV, HEADS, list(MASKS), FORMS, list(DTYPES), LOGITS]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


pytestmark = pytest.mark.usefixtures("without_hopper_tier")   # (see the module docstring; tests/conftest.py)


def _inputs(rng, form, dtype, b, hq, hk, sq, sk, d, dv, scale):
    shapes = ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv))
    if form == "strided8":
        # views inside NaN-filled buffers padded by 8 on the row, head and sequence axes: the
        # strides stay multiples of 8 elements (16-byte rows) and K/V's tail is NaN
        q, k = (_pad(rng, s, dtype, scale, 8) for s in shapes[:2])
        return q, k, _pad(rng, shapes[2], dtype, 1.0, 8), "bhsd"
    if form == "strided3":
        # padded by 3: rows are not 16-byte aligned (the first grid's strided form)
        return (*(_nan_padded(rng, s, dtype, sc, (1, 2, 3)) for s, sc in zip(shapes, (scale, scale, 1.0))), "bhsd")
    if form == "offset":
        # views one element into their buffers: 16-byte aligned strides, misaligned start
        def shifted(shape, sc):
            buf = np.full((int(np.prod(shape)) + 1,), np.nan, dtype=dtype)
            view = buf[1:].reshape(shape)
            view[...] = (rng.standard_normal(shape) * sc).astype(dtype)
            return view
        return shifted(shapes[0], scale), shifted(shapes[1], scale), shifted(shapes[2], 1.0), "bhsd"
    return make_inputs(rng, form, dtype, b, hq, hk, sq, sk, d, dv, scale)


def _pad(rng, shape, dtype, scale, pad):
    big = list(shape)
    for ax in (1, 2, 3):
        big[ax] += pad
    buf = np.full(big, np.nan, dtype=dtype)
    view = buf[tuple(slice(0, n) for n in shape)]
    view[...] = (rng.standard_normal(shape) * scale).astype(dtype)
    return view


def expects_mma(d: int, dv: int, form: str, arrays=None) -> bool:
    """Whether the tensor-core tier serves the case (kernels_cu/attention_fwd_mma.cu: D, Dv and
    every stride of an axis longer than 1 multiples of 8 elements, 16-byte aligned bases). The
    fallback forms misalign something, unless the arrays show that only axes of length 1 (whose
    stride is never used) are affected."""
    if d % 8 or dv % 8:
        return False
    if form not in FALLBACK_FORMS or arrays is None:
        return form not in FALLBACK_FORMS
    return all(x.ctypes.data % 16 == 0 and all(st % 16 == 0 for st, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
               for x in arrays)


def run_case(rng, sq, sk, d, dv_kind, heads, mask, form, dtype_key, logits, *, arch=90, tier_module=attention_fwd_mma,
             expects=expects_mma):
    hq, hk = heads
    dv = d if dv_kind == "same" else OTHER_DV[d]
    dtype = DTYPES[dtype_key]
    b = 2 if form == "broadcast" else 1
    scale = 100.0 / d**0.25 if logits == "large" else 1.0
    q, k, v, layout = _inputs(rng, form, dtype, b, hq, hk, sq, sk, d, dv, scale)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    problem = validation.check_attention(q, k, v, **kw)
    tier = dispatch.forward_tier(problem, arch, (q, k, v, None))
    assert (tier is tier_module) == expects(d, dv, form, (q, k, v)), \
        dispatch.describe_choice(problem, arch, (q, k, v))
    with cuflash.sim.options(arch=f"sm_{arch}"):
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
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], rtol=2e-5,
                               atol=2e-5 * max(1.0, np.abs(lse_ref[~empty]).max(initial=0)))
    return err


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,logits", PAIRWISE)
def test_pairwise_grid(sq, sk, d, dv, heads, mask, form, dtype, logits, rng):
    run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, logits)


def test_covering_design_covers_every_value_and_pair():
    for i, axis in enumerate(AXES):
        assert {c[i] for c in PAIRWISE} == {tuple(x) if isinstance(x, list) else x for x in axis}
    for i, j in itertools.combinations(range(len(AXES)), 2):
        assert len({(c[i], c[j]) for c in PAIRWISE}) == len(AXES[i]) * len(AXES[j]), (i, j)
    # the grid exercises every tensor-core variant of sm_90 (both dtypes, every bucket)
    seen = {attention_fwd_mma.choose_variant(DTYPES[c[7]], c[2], c[2] if c[3] == "same" else OTHER_DV[c[2]], 90)
            for c in PAIRWISE if expects_mma(c[2], c[2] if c[3] == "same" else OTHER_DV[c[2]], c[6])}
    assert seen == set(attention_fwd_mma.all_variants(90))


@pytest.mark.parametrize("case", [
    (129, 129, 256, "same", (2, 1), "none", "bhsd", "bf16", "normal"),
    (97, 129, 256, "same", (1, 1), "causal", "strided8", "f16", "large"),
    (129, 97, 128, "other", (2, 2), "win_lr", "bshd", "f16", "normal"),
    (17, 129, 192, "same", (1, 1), "causal_win", "transposed", "bf16", "normal"),
], ids=["d256", "d256-causal", "d128", "d192"])
def test_sm80_variants(case, rng):
    # sm_80 has less shared memory than sm_90: other tiles (Bc = 32 for 256)
    run_case(rng, *case, arch=80)


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


def test_zero_scale_and_window_rows_empty_mid_tile(rng):
    q = rng.standard_normal((1, 2, 33, 96)).astype(dtypes.bfloat16)
    k = rng.standard_normal((1, 2, 70, 96)).astype(dtypes.bfloat16)
    v = rng.standard_normal((1, 2, 70, 96)).astype(dtypes.bfloat16)
    out, lse = cuflash.attention(q, k, v, softmax_scale=0.0, return_lse=True, backend="sim")
    mean = v.astype(np.float64).mean(axis=2, keepdims=True)
    np.testing.assert_allclose(out.astype(np.float64), np.broadcast_to(mean, out.shape), atol=2.0**-7)
    np.testing.assert_allclose(lse, np.log(70), rtol=1e-6)
    # a window that misses Sk entirely for some rows (left of the first key)
    kw = dict(window_size=(2, 0))
    out = cuflash.attention(q[:, :, :, :], k[:, :, :20], v[:, :, :20], backend="sim", **kw)
    check_close(out, q, k[:, :, :20], v[:, :, :20], **kw)


def test_odd_offset_falls_back_visibly(rng, caplog):
    buf = rng.standard_normal(1 + 2 * 33 * 64).astype(np.float16)
    q = buf[1:].reshape(1, 2, 33, 64)
    k = rng.standard_normal((1, 2, 33, 64)).astype(np.float16)
    problem = validation.check_attention(q, k, k)
    line = dispatch.describe_choice(problem, 90, (q, k, k))
    assert "portable SIMT tier" in line and "q starts at an address that is not 16-byte aligned" in line
    with caplog.at_level(logging.DEBUG, logger="cuflash.dispatch"):
        out = cuflash.attention(q, k, k, backend="sim")
    assert "cuflash_attn_fwd_simt_f16" in caplog.text
    check_close(out, q, k, k)
    with caplog.at_level(logging.DEBUG, logger="cuflash.dispatch"):
        cuflash.attention(q.copy(), k, k, backend="sim")
    assert "cuflash_attn_fwd_mma_f16_d64" in caplog.text


def test_describe_choice_names_tier_variant_and_reason():
    def prob(dtype, d, dv=None, s=16):
        dv = dv or d
        return validation.check_attention(np.zeros((1, 1, s, d), dtype), np.zeros((1, 1, s, d), dtype),
                                         np.zeros((1, 1, s, dv), dtype))

    line = dispatch.describe_choice(prob(dtypes.bfloat16, 128), 90)
    assert line.startswith("sm_90: tensor-core mma.sync tier, cuflash_attn_fwd_mma_bf16_d128_m128_n64: 4 warps of 32 query rows, Br=128 x Bc=64")
    assert "portable SIMT" in dispatch.describe_choice(prob(dtypes.float32, 64), 90)
    assert "float32" in dispatch.describe_choice(prob(dtypes.float32, 64), 90)
    assert "needs sm_80+" in dispatch.describe_choice(prob(dtypes.float16, 64), 75)
    assert "D=72" not in dispatch.describe_choice(prob(dtypes.float16, 72), 90)  # 72 runs in bucket 96
    assert "D=59 is not a multiple of 8" in dispatch.describe_choice(prob(dtypes.float16, 59), 90)
    assert "Dv=20 is not a multiple of 8" in dispatch.describe_choice(prob(dtypes.float16, 64, 20), 90)
    assert dispatch.forward_tier(prob(dtypes.float16, 256), 90) is attention_fwd_mma
    assert dispatch.forward_tier(prob(dtypes.float16, 64), 75) is attention_fwd_simt
    # a stride that is not a multiple of 8 elements (a slice of a packed buffer)
    big = np.zeros((1, 1, 16, 68), np.float16)
    p = validation.check_attention(big[..., :64], big[..., :64], big[..., :64])
    assert dispatch.forward_tier(p, 90, (big[..., :64],) * 3) is attention_fwd_simt
    assert "stride of 68 elements" in dispatch.describe_choice(p, 90, (big[..., :64],) * 3)


def test_variants_fit_and_are_named():
    for arch in attention_fwd_mma.ARCHES:
        vs = attention_fwd_mma.all_variants(arch)
        assert {v.head_dim_max for v in vs} == set(attention_fwd_mma.HEAD_DIM_BUCKETS)
        for v in vs:
            assert v.smem_bytes <= plan.max_dynamic_smem(arch)
    for arch in (86, 89):  # 99 KB parts still get a tile for every bucket
        assert {v.head_dim_max for v in attention_fwd_mma.all_variants(arch)} == set(attention_fwd_mma.HEAD_DIM_BUCKETS)
    assert attention_fwd_mma.all_variants(75) == ()
    v = attention_fwd_mma.choose_variant(dtypes.float16, 80, 40, 90)
    assert v.head_dim_max == 96 and v.entry.startswith("cuflash_attn_fwd_mma_f16_d96_")
    with pytest.raises(NotImplementedError, match="float32"):
        attention_fwd_mma.choose_variant(np.float32, 64, 64, 90)
    with pytest.raises(ValueError):
        attention_fwd_mma.AttentionFwdMma("f16", 72, 64, 64)


SLOW_GRID = list(itertools.product(LENGTHS, LENGTHS, [64, 96, 128, 192, 256], list(MASKS), list(DTYPES)))


@pytest.mark.slow
@pytest.mark.parametrize("sq,sk,d,mask,dtype", SLOW_GRID)
def test_full_grid(sq, sk, d, mask, dtype, rng):
    i = SLOW_GRID.index((sq, sk, d, mask, dtype))
    run_case(rng, sq, sk, d, DV[i % 2], HEADS[i % 4], mask, FORMS[i % 5], dtype, LOGITS[i % 2])


def test_catalog_lists_the_tensor_core_variants_on_sm80_and_sm90_only():
    from cuflash.kernels import catalog

    targets = catalog.compile_targets()
    for arch in attention_fwd_mma.ARCHES:
        assert set(attention_fwd_mma.all_variants(arch)) <= {v for a, v in targets if a == arch}
    assert not any(v.family == "attn_fwd_mma" for a, v in targets if a < attention_fwd_mma.MIN_ARCH)
