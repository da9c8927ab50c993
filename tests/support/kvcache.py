"""The KV-cache checks shared by the KV-cache tests and the sweep of every variant: the caches
after an append, computed independently of the code under test, and each sequence's output and
LSE against the float64 oracle over the keys that cache holds (for an fp8 cache, over its
dequantized keys and values: :func:`check_fp8_result`)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from support.tolerance import check_close

from cuflash import reference as ref
from cuflash.reference import kvcache as ref_kvcache


def quantize(x, descale):
    """float8_e4m3fn bytes of ``x / descale`` (in float32), saturating at +-448 as the GPU's
    ``cvt.rn.satfinite`` does; NaN the canonical byte 0x7f."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = np.asarray(x, np.float32) / np.asarray(descale, np.float32)
    out = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    out.view(np.uint8)[np.isnan(y)] = 0x7F
    return out


def random_block_table(rng, lengths, snew, page):
    """``(block_table, num_pages)``: each sequence's pages (enough for its ``lengths[b] + snew``
    keys) drawn at random from ``num_pages``, two of which nobody uses; entries past a sequence's
    pages hold -7 (never read)."""
    need = int((np.asarray(lengths) + snew).max())
    per_seq = [-(-int(n + snew) // page) for n in lengths]
    num_pages = sum(per_seq) + 2
    ids = rng.permutation(num_pages).astype(np.int32)
    bt = np.full((len(lengths), -(-need // page) + 1), -7, np.int32)
    at = 0
    for i, n in enumerate(per_seq):
        bt[i, :n] = ids[at:at + n]
        at += n
    return bt, num_pages


def random_paged_cache(rng, lengths, snew, page, hk, d, dtype, leftpad=None):
    """``(k_cache, v_cache, block_table)``: a paged cache (:func:`random_block_table`) with each
    sequence's rows ``leftpad[b]:lengths[b]`` drawn from ``rng`` (K then V, sequence by sequence)
    and NaN in every other row, which a call must never read."""
    bt, num_pages = random_block_table(rng, lengths, snew, page)
    kc = np.full((num_pages, page, hk, d), np.nan, dtype)
    vc = np.full((num_pages, page, hk, d), np.nan, dtype)
    for i in range(len(lengths)):
        lo = 0 if leftpad is None else int(leftpad[i])
        i0, i1 = ref_kvcache.cache_rows(i, lo, int(lengths[i]), page_size=page, block_table=bt)
        kc[i0, i1] = rng.standard_normal((len(i0), hk, d))
        vc[i0, i1] = rng.standard_normal((len(i0), hk, d))
    return kc, vc, bt


def make_case(rng, lengths, sq, snew, page, heads, d, dtype, rotary, extra):
    """Inputs of one call, with NaN wherever the call must not read."""
    hq, hk = heads
    b = len(lengths)
    lengths = np.array(lengths, np.int32)
    need = int((lengths + snew).max())
    kw = {}
    leftpad = None
    if extra == "leftpad":
        leftpad = (lengths // 3).astype(np.int32)
        kw["cache_leftpad"] = leftpad
    if page is None:
        s_cache = need + 5
        nb = b + 1 if extra == "batch_idx" else b
        kc = np.full((nb, s_cache, hk, d), np.nan, dtype)
        order = rng.permutation(nb)[:b].astype(np.int32) if extra == "batch_idx" else np.arange(b, dtype=np.int32)
        if extra == "batch_idx":
            kw["cache_batch_idx"] = order
        vc = np.full((nb, s_cache, hk, d), np.nan, dtype)
        for i in range(b):
            lo = 0 if leftpad is None else leftpad[i]
            kc[order[i], lo:lengths[i]] = rng.standard_normal((lengths[i] - lo, hk, d))
            vc[order[i], lo:lengths[i]] = rng.standard_normal((lengths[i] - lo, hk, d))
    else:
        kc, vc, kw["block_table"] = random_paged_cache(rng, lengths, snew, page, hk, d, dtype, leftpad)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    if snew:
        kw["k"] = rng.standard_normal((b, snew, hk, d)).astype(dtype)
        kw["v"] = rng.standard_normal((b, snew, hk, d)).astype(dtype)
        if rotary != "none":
            ro = need + sq + 2
            angle = np.outer(np.arange(ro), 1.0 / 10000 ** (np.arange(0, d // 2, 2) / (d // 2)))
            kw["rotary_cos"] = np.cos(angle).astype(np.float32 if d % 3 else dtype)
            kw["rotary_sin"] = np.sin(angle).astype(kw["rotary_cos"].dtype)
            kw["rotary_interleaved"] = rotary == "interleaved"
    return q, kc, vc, lengths, kw


def expected_cache(kc, vc, lengths, kw, page):
    """The caches after the append, computed independently of the code under test (but for the
    rotation, :func:`cuflash.reference.kvcache.apply_rotary`, itself checked in float64 below);
    into an fp8 cache each new row (rotated and rounded to its dtype) is quantized (:func:`quantize`) with
    its sequence's ``k_descale`` / ``v_descale`` from ``kw``."""
    if kc.dtype == ml_dtypes.float8_e4m3fn:
        return _expected_fp8_cache(kc, vc, lengths, kw, page)
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


def _expected_fp8_cache(kc, vc, lengths, kw, page):
    plain = {n: x for n, x in kw.items() if n not in ("k_descale", "v_descale")}
    kf, vf = expected_cache(kc.astype(np.float64), vc.astype(np.float64), lengths, plain, page)   # (rows placed)
    kc, vc = kc.copy(), vc.copy()
    if "k" not in kw:
        return kc, vc
    b_count, snew = kw["k"].shape[:2]
    for name, cache, full in (("k_descale", kc, kf), ("v_descale", vc, vf)):
        d = kw.get(name)
        for b in range(b_count):
            for t in range(snew):
                p = int(lengths[b]) + t
                where = (kw.get("cache_batch_idx", np.arange(b_count))[b], p) if page is None else \
                    (kw["block_table"][b, p // page], p % page)
                row = full[where].astype(kw["k"].dtype)   # the new row, rotated and rounded to its dtype
                cache[where] = quantize(row, 1.0 if d is None else np.asarray(d)[b][:, None])
    return kc, vc


def check_fp8_result(out, lse, q, kc, vc, lengths, kw, page, causal, window):
    """Each (sequence, kv head) of a call over an fp8 cache against the float64 oracle of its
    dequantized keys and values (``float64(x) * descale``), and the LSE.

    The bound, the rule's form (twice a naive same-dtype implementation's error plus the floor)
    with the floor taken at the result's scale, as ``python -m cuflash check`` takes it: attention
    over ``k * kd`` and ``v * vd`` is exactly ``vd * attention(q, k, v, softmax_scale * kd)``, and
    every e4m3 value is a float16 and a bfloat16 value, so the naive baseline is ``vd`` times the
    naive q-dtype attention of that problem (:func:`cuflash.reference.tolerance.naive_same_dtype`);
    the floor (one unit roundoff of q's dtype) is scaled by ``max(1, max|reference|)``, since with
    values near e4m3's 448 the output's own rounding exceeds an absolute floor."""
    from cuflash.reference import tolerance

    b_count, sq, hq, d = q.shape
    hk = kc.shape[2]
    g = hq // hk
    snew = kw["k"].shape[1] if "k" in kw else 0
    leftpad = kw.get("cache_leftpad", np.zeros(b_count, np.int32))
    ones = np.ones((b_count, hk))
    kd, vd = (np.asarray(kw[n], np.float64) if kw.get(n) is not None else ones for n in ("k_descale", "v_descale"))
    scale = 1.0 / math.sqrt(d)
    if "rotary_cos" in kw:   # the queries the kernel attends with (as check_result rotates them)
        per_row = causal or tuple(window) != (-1, -1)
        pos = lengths[:, None] + (np.arange(sq)[None] if per_row else 0)
        q = ref_kvcache.apply_rotary(q, kw["rotary_cos"], kw["rotary_sin"], pos, interleaved=kw["rotary_interleaved"])
    for b in range(b_count):
        lo, hi = int(leftpad[b]), int(lengths[b]) + snew
        where = dict(page_size=page, block_table=kw.get("block_table"), cache_batch_idx=kw.get("cache_batch_idx"))
        kb8 = ref_kvcache.gather(kc, b, lo, hi, **where)   # (S, Hk, D) e4m3
        vb8 = ref_kvcache.gather(vc, b, lo, hi, **where)
        for h in range(hk):
            heads = slice(h * g, (h + 1) * g)
            qb = q[b:b + 1, :, heads]
            kb = kb8[None, :, h:h + 1].astype(np.float32).astype(q.dtype)   # exact
            vb = vb8[None, :, h:h + 1].astype(np.float32).astype(q.dtype)
            got = out[b:b + 1, :, heads].astype(np.float64)
            o64, lse64 = ref.naive_attention(qb.astype(np.float64), kb8[None, :, h:h + 1].astype(np.float64) * kd[b, h],
                                             vb8[None, :, h:h + 1].astype(np.float64) * vd[b, h], layout="bshd",
                                             return_lse=True, causal=causal, window_size=window)
            naive = vd[b, h] * tolerance.naive_same_dtype(qb, kb, vb, layout="bshd", causal=causal, window_size=window,
                                                          softmax_scale=scale * kd[b, h])
            assert np.isfinite(got).all(), "NaN or inf in the output of finite input"
            err = float(np.abs(got - o64).max(initial=0.0))
            bound = 2 * float(np.abs(naive - o64).max(initial=0.0)) + \
                tolerance.floor_for(q.dtype) * max(1.0, float(np.abs(o64).max(initial=0.0)))
            assert err <= bound, f"sequence {b}, kv head {h}: max error {err:.3g} > bound {bound:.3g}"
            got_lse = lse[b, heads]
            assert np.array_equal(np.isneginf(got_lse), np.isneginf(lse64[0])), "rows without keys differ"
            fin = np.isfinite(lse64[0])
            np.testing.assert_allclose(got_lse[fin], lse64[0][fin], rtol=2e-3, atol=2e-3)


def check_result(out, lse, q, kc, vc, lengths, kw, page, causal, window, **mods):
    """Each sequence against the float64 oracle over the keys the (expected) cache holds (``mods``:
    the score modifiers, applied by oracle and baseline alike; ALiBi slopes (B, Hq) per sequence)."""
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
        mb = dict(mods)
        if mb.get("alibi_slopes") is not None and mb["alibi_slopes"].ndim == 2:
            mb["alibi_slopes"] = mb["alibi_slopes"][b]
        check_close(out[b:b + 1], qb, kb, vb, layout="bshd", causal=causal, window_size=window, **mb)
        _, lse64 = ref.naive_attention(qb.astype(np.float64), kb.astype(np.float64), vb.astype(np.float64),
                                       layout="bshd", return_lse=True, causal=causal, window_size=window, **mb)
        got = lse[b]
        assert np.array_equal(np.isneginf(got), np.isneginf(lse64[0])), "rows without keys differ"
        fin = np.isfinite(lse64[0])
        assert np.isfinite(got[fin]).all()
        np.testing.assert_allclose(got[fin], lse64[0][fin], rtol=2e-3, atol=2e-3)


def make_prefill(rng, chunks, page, heads, d, dtype, used, dv=None):
    """Chunked prefill's inputs (``attention_varlen`` with a ``block_table``): ``chunks`` is
    ``(query rows, keys in the cache)`` per sequence; pages drawn at random, NaN in every cache
    row no sequence uses (unused pages, rows past ``seqused_k`` with ``used="some"``), and block
    table entries past a sequence's pages out of range (never read). Returns ``q, k_cache,
    v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table``
    (``dv``: the values' head dim, ``d`` when None)."""
    hq, hk = heads
    dv = d if dv is None else dv
    lq = np.array([a for a, _ in chunks], np.int64)
    lk = np.array([b for _, b in chunks], np.int64)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    seqused = None if used == "all" else np.array([n - n // 3 for n in lk], np.int32)
    per_seq = [-(-int(n) // page) for n in lk]
    num_pages = sum(per_seq) + 1
    ids = rng.permutation(num_pages).astype(np.int32)
    bt = np.full((len(chunks), max(per_seq) + 1), 2**30, np.int32)   # unused entries: never read
    at = 0
    for i, n in enumerate(per_seq):
        bt[i, :n], at = ids[at:at + n], at + n
    kc = np.full((num_pages, page, hk, d), np.nan, dtype)
    vc = np.full((num_pages, page, hk, dv), np.nan, dtype)
    for i, n in enumerate(lk):
        i0, i1 = ref_kvcache.cache_rows(i, 0, int(n if seqused is None else seqused[i]), page_size=page, block_table=bt)
        kc[i0, i1] = rng.standard_normal((len(i0), hk, d))
        vc[i0, i1] = rng.standard_normal((len(i0), hk, dv))
    q = rng.standard_normal((int(cq[-1]), hq, d)).astype(dtype)
    return q, kc, vc, cq, ck, int(lq.max()), int(lk.max()), seqused, bt


def check_prefill(out, lse, q, kc, vc, cq, ck, seqused, bt, page, causal, window, **mods):
    """Each sequence of a chunked prefill against the float64 oracle over its ``n_k`` cache keys
    (``seqused_k[b]``, else its ``cu_seqlens_k`` length), output and LSE (``mods``: softcap,
    ALiBi slopes ``(Hq,)`` or ``(B, Hq)``, applied by oracle and baseline alike)."""
    for b in range(len(cq) - 1):
        rq = slice(cq[b], cq[b + 1])
        if rq.stop == rq.start:
            continue
        n = int(ck[b + 1] - ck[b]) if seqused is None else int(seqused[b])
        kb = ref_kvcache.gather(kc, b, 0, n, page_size=page, block_table=bt)[None]
        vb = ref_kvcache.gather(vc, b, 0, n, page_size=page, block_table=bt)[None]
        mb = dict(mods)
        if mb.get("alibi_slopes") is not None and mb["alibi_slopes"].ndim == 2:
            mb["alibi_slopes"] = mb["alibi_slopes"][b]
        check_close(out[None, rq], q[None, rq], kb, vb, layout="bshd", causal=causal, window_size=window, **mb)
        _, lse64 = ref.naive_attention(q[None, rq].astype(np.float64), kb.astype(np.float64),
                                       vb.astype(np.float64), layout="bshd", return_lse=True, causal=causal,
                                       window_size=window, **mb)
        fin = np.isfinite(lse64[0])
        assert np.array_equal(np.isneginf(lse[:, rq]), np.isneginf(lse64[0])), f"sequence {b}: rows without keys differ"
        assert np.isfinite(lse[:, rq][fin]).all(), f"sequence {b}: a NaN LSE where the oracle's is finite"
        np.testing.assert_allclose(lse[:, rq][fin], lse64[0][fin], rtol=2e-3, atol=2e-3)
