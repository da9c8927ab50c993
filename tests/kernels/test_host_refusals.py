"""The kernel hosts' own refusals: a variant that cannot exist, a plan the kernel cannot take, a
call no tier takes. The public functions validate first, so these are what a wrong internal call
(a new dispatcher rule, a new planner) would meet; each names what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from support.options import check_attention, check_kvcache, check_varlen

import cuflash
from cuflash.kernels import (
    attention_bwd_mma,
    attention_combine,
    attention_fwd_mma,
    attention_fwd_sm90,
    dispatch,
    kvcache_append,
    softmax,
)
from cuflash.runtime import dtypes

BAD_VARIANTS = [
    (lambda: attention_fwd_sm90.Sm90ForwardVariant("f32", 64, 64, False), r"dtype='f32' must be one of"),
    (lambda: attention_fwd_sm90.Sm90ForwardVariant("f16", 80, 80, False), r"head_dim=80 must be one of"),
    (lambda: attention_fwd_sm90.Sm90ForwardVariant("f16", 64, 128, False), r"head_dim_v=128 must not exceed"),
    (lambda: attention_bwd_mma.AttentionBwdMma("f16", 64, 48, 64), r"must be a multiple of 32 rows"),
    (lambda: attention_fwd_mma.AttentionFwdMma("f16", 64, 100, 64), r"AttentionFwdMma: tile \(100, 64\)"),
    (lambda: softmax.SoftmaxVariant("f64", "warp"), r"SoftmaxVariant: dtype='f64'"),
    (lambda: softmax.SoftmaxVariant("f16", "grid"), r"mode='grid' must be 'warp' or 'block'"),
    (lambda: attention_combine.AttentionCombine("i8"), r"AttentionCombine: dtype='i8'"),
    (lambda: kvcache_append.KVCacheAppend("f16", "f64"), r"KVCacheAppend: rot_dtype='f64'"),
    (lambda: attention_fwd_sm90.bucket(264), r"head dim 264 is above 256"),
]


@pytest.mark.parametrize("make,match", BAD_VARIANTS)
def test_a_variant_that_cannot_exist_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _huge(shape, dtype=np.float32):
    """An array of ``shape`` over one element (stride 0): sizes no test could allocate."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))


def test_softmax_plans_refuse_what_the_kernel_cannot_index():
    with pytest.raises(ValueError, match=r"rows of 2147483648 elements exceed the kernel's int32 column index"):
        softmax.plan_softmax(_huge((1, 2**31)), _huge((1, 2**31)))
    rows = 2**31 * softmax.SOFTMAX_ROWS_PER_BLOCK
    with pytest.raises(ValueError, match=rf"{rows} rows exceed the kernel's grid limit"):
        softmax.plan_softmax(_huge((rows, 8)), _huge((rows, 8)))


def _bhsd(b, h, s, d, dtype=np.float16):
    return np.zeros((b, h, s, d), dtype)


@pytest.mark.parametrize("q,k,v,out,lse,match", [
    (_bhsd(1, 2, 8, 64, np.float32), _bhsd(1, 1, 8, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 2, 8, 64),
     np.zeros((1, 2, 8), np.float32), r"q must be float16 or bfloat16, got float32"),
    (_bhsd(1, 2, 8, 64), _bhsd(1, 1, 9, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 2, 8, 64),
     np.zeros((1, 2, 8), np.float32), r"must be \(B, Hq, Sq, D\)"),
    (_bhsd(1, 3, 8, 64), _bhsd(1, 2, 8, 64), _bhsd(1, 2, 8, 64), _bhsd(1, 3, 8, 64),
     np.zeros((1, 3, 8), np.float32), r"Hq=3 must be a multiple of Hk=2"),
    (_bhsd(1, 2, 8, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 2, 8, 64),
     np.zeros((1, 2, 8), np.float64), r"lse must be a C-contiguous float32"),
    (_bhsd(1, 2, 0, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 1, 8, 64), _bhsd(1, 2, 0, 64),
     np.zeros((1, 2, 0), np.float32), r"Sq=0 and Sk=8 must be at least 1"),
])
def test_the_hopper_plan_refuses_arrays_it_cannot_take(q, k, v, out, lse, match):
    with pytest.raises((TypeError, ValueError), match=match):
        attention_fwd_sm90.plan_forward(q, k, v, out, lse, softmax_scale=0.125)


def test_the_hopper_tier_says_why_it_passes_a_view_over():
    q = np.zeros((1, 2, 16, 64), np.float16)
    k = np.zeros((1, 1, 16, 64), np.float16)
    p = check_attention(q, k, k)
    broadcast = np.broadcast_to(k, (1, 2, 16, 64))
    assert "broadcast (stride-0) view" in attention_fwd_sm90.unsupported_reason(p, 90, (q, broadcast, k))
    split = np.zeros((1, 1, 16, 128), np.float16)[..., ::2]
    assert "head dim is not contiguous" in attention_fwd_sm90.unsupported_reason(p, 90, (q, split, k))
    assert attention_fwd_sm90.unsupported_reason(p, 90, (q, None, k)) is None


def test_the_plain_hopper_forms_pass_a_negative_scale_over_and_take_zero_as_flt_min():
    # their row maximum is taken on the unscaled scores, which a negative scale would reverse
    q = np.zeros((1, 2, 64, 64), np.float16)
    cache = np.zeros((1, 128, 2, 64), np.float16)
    seqlens = np.array([100], np.int32)
    packed = np.zeros((64, 2, 64), np.float16)
    cu = np.array([0, 64], np.int32)
    for p in (check_attention(q, q, q, softmax_scale=-0.5), check_attention(q, q, q, softmax_scale=-0.5, causal=True),
              check_varlen(packed, packed, packed, cu, cu, 64, 64, softmax_scale=-0.5),
              check_kvcache(q.transpose(0, 2, 1, 3), cache, cache, seqlens, softmax_scale=-0.5)):
        assert "softmax_scale=-0.5 is negative" in attention_fwd_sm90.unsupported_reason(p, 90), p
    for p in (check_attention(q, q, q, softmax_scale=0.0), check_attention(q, q, q, softmax_scale=-0.5, softcap=5.0)):
        assert attention_fwd_sm90.unsupported_reason(p, 90) is None   # (the modifier forms scale first)
    tiny = float(np.finfo(np.float32).tiny)
    for scale, prescale, want in ((0.0, False, tiny), (-0.0, False, tiny), (1e-40, False, tiny), (0.0, True, 0.0),
                                  (0.125, False, np.float32(0.125 * np.log2(np.e)))):
        assert attention_fwd_sm90.scale_arg(scale, prescale).value == want, (scale, prescale)


def test_no_tier_for_a_call_names_every_reason(monkeypatch):
    q = np.zeros((1, 1, 4, 32), np.float32)
    p = check_attention(q, q, q)
    monkeypatch.setattr(dispatch, "TIERS", (("tensor-core mma.sync", attention_fwd_mma),))
    with pytest.raises(NotImplementedError, match=r"no kernel takes this call on sm_80: tensor-core mma.sync tier not "
                                                  r"used: dtype float32"):
        dispatch.forward_tier(p, 80)


def test_dropout_with_a_modifier_is_passed_to_the_next_tier_with_the_reason():
    q = np.zeros((1, 1, 4, 64), np.float16)
    p = check_attention(q, q, q, dropout_p=0.1, dropout_seed=1, softcap=5.0)
    assert "dropout with softcap is not in the tensor-core kernel yet" in attention_fwd_mma.unsupported_reason(p, 80)


def test_explain_refuses_an_arch_the_simulator_does_not_emulate():
    q = np.zeros((1, 1, 4, 64), np.float16)
    for bad in ("hopper", "sm_9x", 60):
        with pytest.raises(ValueError, match=r"cuflash.explain: arch=.* must be one of 'sm_70', 'sm_75', 'sm_80'"):
            cuflash.explain(q, q, q, arch=bad)
    assert cuflash.explain(q.astype(dtypes.bfloat16), q.astype(dtypes.bfloat16), q.astype(dtypes.bfloat16),
                           arch="sm_90")["tier"] == "attention_fwd_sm90"
