"""Score modifiers (softcap, ALiBi, sinks) on the Hopper KV-cache form (``attention_fwd_sm90``'s
``kvcache`` + ``mods`` forms) on the simulator.

Each case runs ``cuflash.attention_with_kvcache`` on the simulator (compute capability 9.0, Sq from
64 on: the dispatcher must choose the Hopper form, and ``explain`` name it), holds each sequence's
output to the float64 oracle over the keys the cache holds after the append (the tolerance rule,
modifiers applied by oracle and baseline alike; ALiBi bottom-right per sequence) and its LSE to the
oracle's, and the caches to what the append must leave, byte for byte. Unused cache rows, rows
before the left padding and unused pages hold NaN, so a read of any of them shows. Split-KV with
sinks: the sink joins one split's rows only (split 0), so the combine counts it once a row.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.grids import case_id
from support.kvcache import expected_cache, random_paged_cache
from support.options import check_kvcache
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash.kernels import attention_fwd_sm90, dispatch
from cuflash.reference import kvcache as ref_kvcache
from cuflash.runtime import dtypes

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}


def make_case(rng, lengths, snew, page, heads, d, dtype, leftpad):
    """q, caches with NaN wherever the call must not read, and the call's cache keywords."""
    hq, hk = heads
    b = len(lengths)
    lengths = np.array(lengths, np.int32)
    need = int((lengths + snew).max())
    kw = {}
    lp = (lengths // 3).astype(np.int32) if leftpad else np.zeros(b, np.int32)
    if leftpad:
        kw["cache_leftpad"] = lp
    if page is None:
        kc = np.full((b, need + 5, hk, d), np.nan, dtype)
        vc = np.full((b, need + 5, hk, d), np.nan, dtype)
        for i in range(b):
            kc[i, lp[i]:lengths[i]] = rng.standard_normal((lengths[i] - lp[i], hk, d))
            vc[i, lp[i]:lengths[i]] = rng.standard_normal((lengths[i] - lp[i], hk, d))
    else:
        kc, vc, kw["block_table"] = random_paged_cache(rng, lengths, snew, page, hk, d, dtype, lp)
    if snew:
        kw["k"] = rng.standard_normal((b, snew, hk, d)).astype(dtype)
        kw["v"] = rng.standard_normal((b, snew, hk, d)).astype(dtype)
    return kc, vc, lengths, kw


def make_mods(rng, names, b, hq):
    mods = {}
    if "softcap" in names:
        mods["softcap"] = 4.0
    if "alibi" in names:   # (Hq,) or per sequence (B, Hq)
        mods["alibi_slopes"] = rng.uniform(0.02, 0.4, (b, hq) if "alibi_b" in names else (hq,)).astype(np.float32)
    if "sinks" in names:   # one head's sink far above its scores, one -inf (adds nothing)
        s = rng.standard_normal(hq).astype(np.float32)
        s[0], s[-1] = 6.0, -np.inf
        mods["sinks"] = s
    return mods


def run_case(rng, lengths, sq, snew, page, heads, mask, d, splits, names, leftpad, dtype_key, *, checked=False):
    dt = DTYPES[dtype_key]
    hq = heads[0]
    kc, vc, lengths, kw = make_case(rng, lengths, snew, page, heads, d, dt, leftpad)
    b = len(lengths)
    q = rng.standard_normal((b, sq, hq, d)).astype(dt)
    mods = make_mods(rng, names, b, hq)
    causal, window = MASKS[mask]
    problem = check_kvcache(q, kc, vc, lengths, causal=causal, window_size=window, num_splits=splits, **kw, **mods)
    info = dispatch.explain_forward(problem, 90, (q, kc, vc), sm_count=cuflash.sim.sm_count(90))
    assert info["tier"] == "attention_fwd_sm90", info["choice"]
    assert "_mods" in info["variant"] and "_kvcache" in info["variant"], info["variant"]
    want_k, want_v = expected_cache(kc, vc, lengths, kw, page)
    k1, v1 = kc.copy(), vc.copy()
    with cuflash.sim.options(arch=90, checked=checked, seed=7):
        out, lse = cuflash.attention_with_kvcache(q, k1, v1, lengths, causal=causal, window_size=window,
                                                  num_splits=splits, return_lse=True, backend="sim", **kw, **mods)
    assert k1.tobytes() == want_k.tobytes() and v1.tobytes() == want_v.tobytes()
    assert out.shape == q.shape and out.dtype == dt
    for i in range(b):
        lo, hi = int(kw.get("cache_leftpad", np.zeros(b, np.int32))[i]), int(lengths[i]) + snew
        where = dict(page_size=page, block_table=kw.get("block_table"))
        kb = ref_kvcache.gather(want_k, i, lo, hi, **where)[None]
        vb = ref_kvcache.gather(want_v, i, lo, hi, **where)[None]
        mb = dict(mods)
        if "alibi_slopes" in mb and mb["alibi_slopes"].ndim == 2:
            mb["alibi_slopes"] = mb["alibi_slopes"][i]
        qb = q[i:i + 1]
        check_close(out[i:i + 1], qb, kb, vb, layout="bshd", causal=causal, window_size=window, **mb)
        _, lse64 = ref.naive_attention(qb.astype(np.float64), kb.astype(np.float64), vb.astype(np.float64),
                                       layout="bshd", return_lse=True, causal=causal, window_size=window, **mb)
        got = lse[i]
        assert np.array_equal(np.isneginf(got), np.isneginf(lse64[0])), "rows without keys (or sink) differ"
        fin = np.isfinite(lse64[0])
        assert np.isfinite(got[fin]).all()
        np.testing.assert_allclose(got[fin], lse64[0][fin], rtol=2e-3, atol=2e-3)


#: (lengths, Sq, new rows, page size (None: contiguous), (Hq, Hk), mask, D, splits, modifiers, left padding, dtype)
DEFAULT = ([0, 5, 130], 64, 1, 3, (2, 1), "causal_win", 64, 3, ("softcap", "alibi", "sinks"), True, "f16")
SLOW = [
    ([1, 200], 70, 0, None, (4, 2), "causal", 64, 1, ("softcap", "alibi"), False, "f16"),
    ([0, 1, 37], 64, 3, 16, (8, 1), "window", 64, 3, ("alibi_b", "alibi", "sinks"), False, "f16"),
    ([130, 64], 130, 1, 256, (2, 2), "none", 64, 1, ("sinks",), True, "f16"),
    ([250, 17], 64, 0, 1, (4, 1), "causal", 128, 3, ("softcap", "alibi", "sinks"), False, "bf16"),
    ([1, 0, 300], 64, 1, None, (2, 1), "causal_win", 128, 3, ("softcap",), True, "bf16"),
    ([0], 64, 0, None, (2, 1), "causal", 64, 1, ("alibi", "sinks"), False, "f16"),
    ([0, 1], 64, 1, 3, (4, 2), "none", 64, 3, ("softcap", "sinks"), False, "f16"),
]


def test_kvcache_mods_hopper_default(rng):
    run_case(rng, *DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[case_id(c) for c in SLOW])
def test_kvcache_mods_hopper_grid(case, rng):
    run_case(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
def test_kvcache_mods_hopper_checked(rng):
    run_case(rng, *DEFAULT, checked=True)


def test_kvcache_modifier_forms_are_listed_and_chosen():
    """The variant and the reason: softcap, ALiBi and sinks take the Hopper KV-cache form's ``mods``
    variant; the catalog lists those forms beside the plain ones."""
    forms = attention_fwd_sm90.all_variants(kvcache=True, mods=True)
    assert forms and all(v.kvcache and v.mods and v.local for v in forms)
    assert not set(forms) & set(attention_fwd_sm90.all_variants(kvcache=True))
    q = np.zeros((1, 64, 2, 64), dtypes.float16)
    kc = np.zeros((1, 80, 1, 64), dtypes.float16)
    p = check_kvcache(q, kc, kc, np.array([70], np.int32), softcap=3.0)
    assert attention_fwd_sm90.kvcache_reason(p, 90) is None
    assert attention_fwd_sm90.kvcache_variant(p).mods
