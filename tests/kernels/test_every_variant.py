"""One simulator run of every kernel variant the dispatcher can choose (``-m variants``).

The catalog (:mod:`cuflash.kernels.catalog`) lists every variant a device of sm_75, sm_80 or
sm_90 may run; the compile gate compiles them all. Here each one runs once on the simulator, at
the first of those arches that lists it, through the public function whose call the dispatcher
maps to it: a call of the variant's dtype, head-dim bucket and form (packed, KV cache, score
modifiers, dropout, a window). The test records the entries the simulator launched, asserts the
variant's own entry is among them (so a call that fell back to another tier cannot pass), and
holds the result to the float64 oracle with the tolerance rule.

The default run covers every family and tier on its grids; this sweep is what nobody needs to
wait for, so it is deselected by default and ``.ci/run`` runs it after the test command.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.grads import check_grads_close
from support.kvcache import check_fp8_result, check_prefill, check_result, expected_cache, make_prefill, quantize
from support.tolerance import check_close, check_lse, check_packed_backward, check_packed_forward

import cuflash
from cuflash import reference as ref
from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_bwd_sm90,
    attention_combine,
    attention_fwd_mma,
    attention_fwd_simt,
    attention_fwd_sm90,
    catalog,
    dispatch,
    dropout_mask,
    kvcache_append,
    softmax,
)
from cuflash.reference import dropout as rd
from cuflash.reference import kvcache as ref_kvcache
from cuflash.runtime import dtypes
from cuflash.sim import launcher
from cuflash.sim.memory import to_device

pytestmark = pytest.mark.variants

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}
ARCHES = (75, 80, 90)
DROPOUT = dict(dropout_p=0.25, dropout_seed=11)
SOFTCAP = dict(softcap=6.0)


#: kernels only the KV-cache path launches, which runs on the tensor-core tier (sm_80+)
KVCACHE_ONLY = (kvcache_append.KVCacheAppend, attention_combine.AttentionCombine)


def _first_arch() -> dict:
    """``entry -> (arch, variant)``: each variant at the first arch whose list has it (the
    KV-cache path's own kernels at the first arch the path runs on)."""
    found: dict = {}
    for arch in ARCHES:
        for v in catalog.variants_for_arch(arch):
            if arch >= attention_fwd_mma.MIN_ARCH or not isinstance(v, KVCACHE_ONLY):
                found.setdefault(v.entry, (arch, v))
    return found


CATALOG = _first_arch()


@pytest.fixture
def launched(monkeypatch):
    """The entries the simulator launches during the test, in order."""
    seen: list = []
    real = launcher.run

    def record(plan, options=None):
        seen.append(plan.entry)
        return real(plan, options)

    monkeypatch.setattr(launcher, "run", record)
    return seen


def _qkv(rng, dtype, d, *, sq=37, sk=70, hq=1, hk=1, packed=None):
    """q, k, v of one call: (1, H, S, D) or, with ``packed=(total_q, total_k)``, (T, H, D)."""
    if packed is not None:
        sq, sk = packed
        shapes = ((sq, hq, d), (sk, hk, d), (sk, hk, d))
    else:
        shapes = ((1, hq, sq, d), (1, hk, sk, d), (1, hk, sk, d))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def _flags(v) -> dict:
    """The public keywords of a variant's form: dropout, score modifiers."""
    kw = {}
    if getattr(v, "dropout", False):
        kw.update(DROPOUT)
    if getattr(v, "mods", False):
        kw.update(SOFTCAP)
    return kw


def _backward_flags(v) -> dict:
    """The backward's own keywords of a variant's form: deterministic mode (the tensor-core
    backward's ``_det`` forms)."""
    return {"deterministic": True} if getattr(v, "deterministic_dq", False) else {}


def _fixed(rng, v, d, backward, causal=True, **kw):
    dt = DTYPES[v.dtype]
    q, k, vv = _qkv(rng, dt, d)
    kw = {**_flags(v), "causal": causal, **kw}
    out, lse = cuflash.attention(q, k, vv, return_lse=True, backend="sim", **kw)
    check_close(out, q, k, vv, **kw)
    if not kw.get("dropout_p"):
        check_lse(lse, q, k, vv, **{n: x for n, x in kw.items() if n in ("causal", "window_size", "softcap")})
    if backward:
        dout = rng.standard_normal(out.shape).astype(dt)
        grads = cuflash.attention_backward(dout, q, k, vv, out, lse, backend="sim", **kw, **_backward_flags(v))
        check_grads_close(grads, dout, q, k, vv, out, lse, **kw)


def _packed(rng, v, d, backward):
    """Two sequences (one with dropout, whose mask is indexed by the sequence)."""
    dt = DTYPES[v.dtype]
    kw = _flags(v)
    lq, lk = ((37,), (70,)) if kw.get("dropout_p") else ((21, 16), (30, 45))
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, vv = _qkv(rng, dt, d, packed=(int(cq[-1]), int(ck[-1])))
    out, lse = cuflash.attention_varlen(q, k, vv, cq, ck, max(lq), max(lk), causal=True, return_lse=True,
                                        backend="sim", **kw)
    check_packed_forward(out, lse, q, k, vv, cq, ck, None, causal=True, **kw)
    if backward:
        dout = rng.standard_normal(out.shape).astype(dt)
        grads = cuflash.attention_varlen_backward(dout, q, k, vv, out, lse, cq, ck, max(lq), max(lk), causal=True,
                                                  backend="sim", **kw, **_backward_flags(v))
        check_packed_backward(grads, dout, q, k, vv, out, lse, cq, ck, None, causal=True, **kw)


def _kvcache(rng, dtype_key, d, *, mods=False, append=None, num_splits=1, fp8=False):
    """A decode-and-append step on a contiguous cache of two sequences (``append``: the rotary
    tables' dtype, for an append of two new keys with rotary; ``fp8``: float8_e4m3fn caches with
    per-head descales)."""
    dt = DTYPES[dtype_key]
    lengths = np.array([200, 17], np.int32)   # the first: several key tiles, for the splits
    q = rng.standard_normal((2, 3, 2, d)).astype(dt)
    cache_dt = dtypes.float8_e4m3fn if fp8 else dt
    kc = np.full((2, 224, 1, d), np.nan, cache_dt)
    vc = np.full((2, 224, 1, d), np.nan, cache_dt)
    descales = dict(k_descale=rng.uniform(0.25, 4, (2, 1)).astype(np.float32),
                    v_descale=rng.uniform(0.25, 4, (2, 1)).astype(np.float32)) if fp8 else {}
    for b, n in enumerate(lengths):
        rows = rng.standard_normal((2, n, 1, d))
        kc[b, :n], vc[b, :n] = (quantize(rows, 0.5) if fp8 else rows)
    kw = dict(SOFTCAP) if mods else dict(descales)
    page_kw = {}
    if append is not None:
        rot = DTYPES[append]
        angle = rng.uniform(0, 3, (224, d // 2))
        page_kw = dict(k=rng.standard_normal((2, 2, 1, d)).astype(dt), v=rng.standard_normal((2, 2, 1, d)).astype(dt),
                       rotary_cos=np.cos(angle).astype(rot), rotary_sin=np.sin(angle).astype(rot),
                       rotary_interleaved=False)
    want_k, want_v = expected_cache(kc, vc, lengths, {**page_kw, **descales}, None)
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, causal=True, return_lse=True, backend="sim",
                                              num_splits=num_splits, **page_kw, **kw)
    if append is not None:
        np.testing.assert_array_equal(kc.view(np.uint8), want_k.view(np.uint8))
        np.testing.assert_array_equal(vc.view(np.uint8), want_v.view(np.uint8))
    if fp8:
        check_fp8_result(out, lse, q, kc, vc, lengths, {**page_kw, **descales}, None, True, (-1, -1))
    elif mods:   # check_result holds plain attention; with softcap, each sequence against the rule
        for b, n in enumerate(lengths):
            check_close(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], layout="bshd", causal=True, **kw)
    else:
        check_result(out, lse, q, kc, vc, lengths, page_kw, None, True, (-1, -1))


def _chunked_prefill(rng, v, d):
    """Packed queries over a paged cache (the KV-cache form with packed q)."""
    dt = DTYPES[v.dtype]
    page, lq, lk = 16, (5, 9), (40, 23)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    pages = [-(-n // page) for n in lk]
    bt = np.zeros((2, max(pages)), np.int32)
    bt[0, :pages[0]] = np.arange(pages[0])
    bt[1, :pages[1]] = pages[0] + np.arange(pages[1])
    kc = rng.standard_normal((sum(pages), page, 1, d)).astype(dt)
    vc = rng.standard_normal((sum(pages), page, 1, d)).astype(dt)
    q = rng.standard_normal((int(cq[-1]), 2, d)).astype(dt)
    kw = _flags(v)
    out = cuflash.attention_varlen(q, kc, vc, cq, ck, max(lq), max(lk), causal=True, block_table=bt, backend="sim",
                                   **kw)
    for b, n in enumerate(lk):
        kb = ref_kvcache.gather(kc, b, 0, n, page_size=page, block_table=bt)[None]
        vb = ref_kvcache.gather(vc, b, 0, n, page_size=page, block_table=bt)[None]
        rq = slice(cq[b], cq[b + 1])
        check_close(out[None, rq], q[None, rq], kb, vb, layout="bshd", causal=True, **kw)


def _hopper_kvcache(rng, v):
    """The Hopper KV-cache form: 130 query rows (a second query tile of 2 rows), GQA 2 (unpacked), two
    sequences (200 and 17 keys) in a paged cache of 16-row pages, two key splits, causal; NaN in every
    cache row not to be read.
    GQA packing (the ``gqa`` forms): 11 positions of a group of 7 query heads (77 rows; 9 positions,
    63 rows, a consumer: one dead row each). TMA over the cache (the ``kv_tma`` forms): pages of two
    key tiles (a whole tile by TMA, the edge gathered); the unpacked ones over a contiguous cache
    instead (:func:`_hopper_kvcache_contiguous`)."""
    dt = DTYPES[v.dtype]
    sq, hq = (11, 7) if v.gqa else (130, 2)
    # (the modifier form: softcap, ALiBi and sinks, the ones a KV-cache call takes; packed: each row its head's)
    mods = dict(softcap=4.0, alibi_slopes=rng.uniform(0.02, 0.4, hq).astype(np.float32),
                sinks=rng.standard_normal(hq).astype(np.float32)) if v.mods else {}
    if v.kv_tma and not v.gqa:
        return _hopper_kvcache_contiguous(rng, v, dt, sq, hq, mods)
    page, lengths = (2 * v.block_n if v.kv_tma else 16), np.array([200, 17], np.int32)
    n0, n1 = -(-200 // page), -(-17 // page)
    bt = np.full((2, 13), -1, np.int32)
    bt[0, :n0], bt[1, :n1] = np.arange(n0), n0 + np.arange(n1)   # (16-row pages: 13 and 2)
    kc = np.full((n0 + n1 + 1, page, 1, v.head_dim), np.nan, dt)
    vc = np.full((n0 + n1 + 1, page, 1, v.head_dim_v), np.nan, dt)
    for b, n in enumerate(lengths):
        i0, i1 = ref_kvcache.cache_rows(b, 0, int(n), page_size=page, block_table=bt)
        kc[i0, i1] = rng.standard_normal((len(i0), 1, v.head_dim))
        vc[i0, i1] = rng.standard_normal((len(i0), 1, v.head_dim_v))
    q = rng.standard_normal((2, sq, hq, v.head_dim)).astype(dt)
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, causal=True, num_splits=2, block_table=bt,
                                              return_lse=True, backend="sim", **mods)
    for b, n in enumerate(lengths):
        kb = ref_kvcache.gather(kc, b, 0, int(n), page_size=page, block_table=bt)[None]
        vb = ref_kvcache.gather(vc, b, 0, int(n), page_size=page, block_table=bt)[None]
        check_close(out[b:b + 1], q[b:b + 1], kb, vb, layout="bshd", causal=True, **mods)


def _hopper_kvcache_contiguous(rng, v, dt, sq, hq, mods):
    """The unpacked form with TMA over a contiguous cache (``mods``: the modifier form's): sequences of 200 and 17 keys in cache
    batches 2 and 0 of 3, the first from row 13 (left padding: its whole tile by TMA at a row that
    is not a multiple of the tile, the edge gathered), two splits, causal; NaN in every row not to
    be read."""
    lengths, leftpad, idx = np.array([200, 17], np.int32), np.array([13, 0], np.int32), np.array([2, 0], np.int32)
    kc = np.full((3, 208, 1, v.head_dim), np.nan, dt)
    vc = np.full((3, 208, 1, v.head_dim_v), np.nan, dt)
    for b, n in enumerate(lengths):
        kc[idx[b], leftpad[b]:n] = rng.standard_normal((n - leftpad[b], 1, v.head_dim))
        vc[idx[b], leftpad[b]:n] = rng.standard_normal((n - leftpad[b], 1, v.head_dim_v))
    q = rng.standard_normal((2, sq, hq, v.head_dim)).astype(dt)
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, causal=True, num_splits=2, cache_leftpad=leftpad,
                                              cache_batch_idx=idx, return_lse=True, backend="sim", **mods)
    for b, n in enumerate(lengths):
        kb, vb = kc[idx[b], leftpad[b]:n][None], vc[idx[b], leftpad[b]:n][None]
        check_close(out[b:b + 1], q[b:b + 1], kb, vb, layout="bshd", causal=True, **mods)


def _hopper_chunked_prefill(rng, v):
    """The Hopper chunked-prefill form: two packed sequences (70 query rows over 200 keys, 3 over
    17), GQA 2, a paged cache of 16-row pages (TMA over the cache: pages of two key tiles) with NaN in
    every row not to be read, causal, two key splits (d256: unsplit)."""
    page = 2 * v.block_n if v.kv_tma else 16
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, [(70, 200), (3, 17)], page, (2, 1), v.head_dim,
                                                    DTYPES[v.dtype], "all", dv=v.head_dim_v)
    mods = dict(softcap=4.0, alibi_slopes=rng.uniform(0.02, 0.4, 2).astype(np.float32)) if v.mods else {}
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, causal=True, block_table=bt, backend="sim", arch=90,
                                  num_splits=2, **mods)
    assert info["entry"] == v.entry and info["splits"] == (1 if v.head_dim == 256 else 2), info["choice"]
    out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, causal=True, block_table=bt, return_lse=True,
                                        backend="sim", num_splits=2, **mods)
    check_prefill(out, lse, q, kc, vc, cq, ck, None, bt, page, True, (-1, -1), **mods)


def _without_hopper(monkeypatch):
    monkeypatch.setattr(dispatch, "TIERS", tuple(t for t in dispatch.TIERS if t[1] is not attention_fwd_sm90))
    monkeypatch.setattr(dispatch, "BACKWARD_TIERS",
                        tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_sm90))


def _run(v, rng, monkeypatch):
    """The public call the dispatcher maps to ``v`` on the simulated arch, checked against float64."""
    if isinstance(v, attention_fwd_simt.AttentionFwdSimt):
        d = v.head_dim_max - 1   # an odd head dim: no tensor-core tier takes it
        return _packed(rng, v, d, False) if v.varlen else _fixed(rng, v, d, False)
    if isinstance(v, attention_bwd_simt.AttentionBwdSimt):   # main, or the dot / convert stages of any backward
        d = v.head_dim_max - 1
        return _packed(rng, v, d, True) if v.varlen else _fixed(rng, v, d, True)
    if isinstance(v, attention_fwd_mma.AttentionFwdMma):
        _without_hopper(monkeypatch)
        if v.kvcache:
            return _chunked_prefill(rng, v, v.head_dim_max) if v.varlen else _kvcache(rng, v.dtype, v.head_dim_max,
                                                                                    mods=v.mods, fp8=v.cache_fp8)
        return _packed(rng, v, v.head_dim_max, False) if v.varlen else _fixed(rng, v, v.head_dim_max, False)
    if isinstance(v, attention_bwd_mma.AttentionBwdMma):
        _without_hopper(monkeypatch)
        return _packed(rng, v, v.head_dim_max, True) if v.varlen else _fixed(rng, v, v.head_dim_max, True)
    if isinstance(v, attention_fwd_sm90.Sm90ForwardVariant):
        dt = DTYPES[v.dtype]
        if v.kvcache and v.varlen:   # chunked prefill: packed queries over a paged cache
            return _hopper_chunked_prefill(rng, v)
        if v.kvcache:   # over a paged cache of 16-row pages (gathered; kv_tma: pages of two tiles, or contiguous)
            return _hopper_kvcache(rng, v)
        if v.varlen and v.fp8:   # two e4m3 sequences (the second over two query and key tiles), descales per sequence
            e4m3 = dtypes.float8_e4m3fn
            lq, lk = (21, 150), (30, 170)
            cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
            ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
            q, k, vv = ((rng.standard_normal(s) * 3).astype(e4m3) for s in ((int(cq[-1]), 2, v.head_dim),
                                                                             (int(ck[-1]), 1, v.head_dim),
                                                                             (int(ck[-1]), 1, v.head_dim_v)))
            kw = dict(causal=v.local, out_dtype={"bf16": "bfloat16", "f16": "float16"}[v.dtype],
                      **{n: rng.uniform(0.1, 0.5, (2, 1)).astype(np.float32) for n in ("q_descale", "k_descale", "v_descale")})
            out, lse = cuflash.attention_varlen(q, k, vv, cq, ck, max(lq), max(lk), return_lse=True, backend="sim", **kw)
            return check_packed_forward(out, lse, q, k, vv, cq, ck, None, **kw)
        if v.varlen:   # two sequences, the second over two query tiles and two key tiles
            lq, lk = (21, 150), (30, 170)
            cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
            ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
            q = rng.standard_normal((int(cq[-1]), 2, v.head_dim)).astype(dt)
            k = rng.standard_normal((int(ck[-1]), 1, v.head_dim)).astype(dt)
            vv = rng.standard_normal((int(ck[-1]), 1, v.head_dim_v)).astype(dt)
            mods = dict(softcap=4.0, alibi_slopes=rng.uniform(0.02, 0.4, 2).astype(np.float32)) if v.mods else {}
            out, lse = cuflash.attention_varlen(q, k, vv, cq, ck, max(lq), max(lk), causal=v.local, return_lse=True,
                                                backend="sim", **mods)
            return check_packed_forward(out, lse, q, k, vv, cq, ck, None, causal=v.local, **mods)
        if v.fp8:   # e4m3 q, k, v with descales per (batch, kv head), the variant's output type
            e4m3 = dtypes.float8_e4m3fn
            q, k, vv = ((rng.standard_normal(s) * 3).astype(e4m3) for s in ((1, 2, 150, v.head_dim),
                                                                             (1, 1, 170, v.head_dim), (1, 1, 170, v.head_dim_v)))
            kw = dict(causal=v.local, out_dtype={"bf16": "bfloat16", "f16": "float16"}[v.dtype],
                      **{n: rng.uniform(0.1, 0.5, (1, 1)).astype(np.float32) for n in ("q_descale", "k_descale", "v_descale")})
            out, lse = cuflash.attention(q, k, vv, return_lse=True, backend="sim", **kw)
            return check_close(out, q, k, vv, lse=lse, **kw)
        # two 128-row query tiles; GQA packing: 9 positions of a group of 6 query heads (54 rows; 10
        # positions, 60 rows, a consumer: 4 dead rows each)
        q = rng.standard_normal((1, 6, 9, v.head_dim) if v.gqa else (1, 2, 150, v.head_dim)).astype(dt)
        k = rng.standard_normal((1, 1, 170, v.head_dim)).astype(dt)
        vv = rng.standard_normal((1, 1, 170, v.head_dim_v)).astype(dt)
        kw = {**_flags(v), "causal": v.local}
        out, lse = cuflash.attention(q, k, vv, return_lse=True, backend="sim", **kw)
        check_close(out, q, k, vv, **kw)
        return check_lse(lse, q, k, vv, **kw)
    if isinstance(v, attention_bwd_sm90.Sm90BackwardVariant):   # its main stage, through the public backward
        dt = DTYPES[v.dtype]
        q = rng.standard_normal((1, 2, 150, v.head_dim)).astype(dt)   # 3 query tiles, 2 key tiles, GQA
        k = rng.standard_normal((1, 1, 170, v.head_dim)).astype(dt)
        vv = rng.standard_normal((1, 1, 170, v.head_dim)).astype(dt)
        out, lse = cuflash.attention(q, k, vv, causal=True, return_lse=True)   # the NumPy forward
        dout = rng.standard_normal(out.shape).astype(dt)
        grads = cuflash.attention_backward(dout, q, k, vv, out, lse, causal=True, backend="sim")
        return check_grads_close(grads, dout, q, k, vv, out, lse, causal=True)
    if isinstance(v, softmax.SoftmaxVariant):
        x = rng.standard_normal((3, 3000 if v.mode == "block" else 100)).astype(DTYPES[v.dtype])
        y = cuflash.softmax(x, backend="sim")
        want = ref.softmax(x.astype(np.float64))
        tol = {"f32": 1e-6, "f16": 2e-3, "bf16": 1.6e-2}[v.dtype]
        return np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol * want.max())
    if isinstance(v, kvcache_append.KVCacheAppend):
        return _kvcache(rng, v.dtype, 64, append=v.rot_dtype, fp8=v.cache == "e4m3")
    if isinstance(v, attention_combine.AttentionCombine):
        return _kvcache(rng, v.dtype, 64, num_splits=3)
    if isinstance(v, dropout_mask.DropoutMaskVariant):   # the mask export's kernels (python -m cuflash check)
        if v.mode == "mask":
            got = to_device(np.full((2, 3, 17, 45), 7, np.uint8))
            launcher.run(dropout_mask.plan_mask(got, 5, 99, 3, rd.keep_threshold(0.3)))
            return np.testing.assert_array_equal(got.view(np.ndarray).astype(bool),
                                                 rd.dropout_mask(got.shape, 0.3, 99, 3, batch0=5))
        counters = to_device(np.array([(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)], np.uint32))
        words = to_device(np.zeros((1, 4), np.uint32))
        launcher.run(dropout_mask.plan_raw(counters, words, (0xA4093822, 0x299F31D0)))   # Random123's answer
        return np.testing.assert_array_equal(words.view(np.ndarray)[0], np.array([0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
                                                                 np.uint32))
    raise AssertionError(f"no recipe for the variant family {type(v).__name__}")


@pytest.mark.parametrize("entry", sorted(CATALOG))
def test_variant_runs_on_the_simulator(entry, launched, monkeypatch):
    arch, v = CATALOG[entry]
    rng = np.random.default_rng(sum(map(ord, entry)))
    with cuflash.sim.options(arch=f"sm_{arch}"):
        _run(v, rng, monkeypatch)
    assert entry in launched, f"the call for {entry} on sm_{arch} launched {sorted(set(launched))}"


def test_the_sweep_covers_every_family_and_arch():
    families = {type(v).__name__ for _, v in CATALOG.values()}
    assert families == {"SoftmaxVariant", "AttentionFwdSimt", "AttentionBwdSimt", "AttentionFwdMma", "AttentionBwdMma",
                        "Sm90ForwardVariant", "Sm90BackwardVariant", "DropoutMaskVariant", "KVCacheAppend", "AttentionCombine"}
    assert {arch for arch, _ in CATALOG.values()} == set(ARCHES)
    assert len(CATALOG) == len({v for arch in ARCHES for v in catalog.variants_for_arch(arch)})
    assert all(arch >= 80 for arch, v in CATALOG.values() if isinstance(v, KVCACHE_ONLY))

