"""The KV-cache checks shared by the KV-cache tests and the sweep of every variant: the caches
after an append, computed independently of the code under test, and each sequence's output and
LSE against the float64 oracle over the keys that cache holds."""

from __future__ import annotations

import numpy as np
from support.tolerance import check_close

from cuflash import reference as ref
from cuflash.reference import kvcache as ref_kvcache


def expected_cache(kc, vc, lengths, kw, page):
    """The caches after the append, computed independently of the code under test (but for the
    rotation, :func:`cuflash.reference.kvcache.apply_rotary`, itself checked in float64 below)."""
    kc, vc = kc.copy(), vc.copy()
    if "k" not in kw:
        return kc, vc
    k_new = kw["k"]
    if "rotary_cos" in kw:
        pos = lengths[:, None] + np.arange(k_new.shape[1])[None]
        k_new = ref_kvcache.apply_rotary(k_new, kw["rotary_cos"], kw["rotary_sin"], pos,
                                         interleaved=kw["rotary_interleaved"])
    for b in range(len(lengths)):
        for t in range(k_new.shape[1]):
            p = int(lengths[b]) + t
            if page is None:
                cb = kw.get("cache_batch_idx", np.arange(len(lengths)))[b]
                kc[cb, p], vc[cb, p] = k_new[b, t], kw["v"][b, t]
            else:
                pg = kw["block_table"][b, p // page]
                kc[pg, p % page], vc[pg, p % page] = k_new[b, t], kw["v"][b, t]
    return kc, vc


def check_result(out, lse, q, kc, vc, lengths, kw, page, causal, window):
    """Each sequence against the float64 oracle over the keys the (expected) cache holds."""
    b_count, sq = q.shape[:2]
    snew = kw["k"].shape[1] if "k" in kw else 0
    q_use = q
    if "rotary_cos" in kw:
        per_row = causal or tuple(window) != (-1, -1)
        pos = lengths[:, None] + (np.arange(sq)[None] if per_row else 0)
        q_use = ref_kvcache.apply_rotary(q, kw["rotary_cos"], kw["rotary_sin"], pos,
                                         interleaved=kw["rotary_interleaved"])
    leftpad = kw.get("cache_leftpad", np.zeros(b_count, np.int32))
    for b in range(b_count):
        lo, hi = int(leftpad[b]), int(lengths[b]) + snew
        where = dict(page_size=page, block_table=kw.get("block_table"), cache_batch_idx=kw.get("cache_batch_idx"))
        kb = ref_kvcache.gather(kc, b, lo, hi, **where)[None]
        vb = ref_kvcache.gather(vc, b, lo, hi, **where)[None]
        qb = q_use[b:b + 1]
        check_close(out[b:b + 1], qb, kb, vb, layout="bshd", causal=causal, window_size=window)
        _, lse64 = ref.naive_attention(qb.astype(np.float64), kb.astype(np.float64), vb.astype(np.float64),
                                       layout="bshd", return_lse=True, causal=causal, window_size=window)
        got = lse[b]
        assert np.array_equal(np.isneginf(got), np.isneginf(lse64[0])), "rows without keys differ"
        fin = np.isfinite(lse64[0])
        assert np.isfinite(got[fin]).all()
        np.testing.assert_allclose(got[fin], lse64[0][fin], rtol=2e-3, atol=2e-3)
