"""TMA over the cache on the Hopper KV-cache forward (``attention_fwd_sm90``'s ``kv_tma`` forms) on
the simulator.

Where a paged cache's pages hold whole key tiles, and for contiguous caches, the producer loads
each key tile that lies wholly in a page and below the sequence's end by TMA, and gathers the
others (the tile across the end, tiles across a page's end after left padding) by cp.async. Each
case asserts the dispatcher's choice and ``explain``'s line, runs ``cuflash.attention_with_kvcache``
(or chunked prefill through ``cuflash.attention_varlen``) on the simulator, holds the output and
LSE to the float64 oracle, and the caches to what the append must leave, byte for byte. Every
cache row that must not be read holds NaN (rows past each sequence's keys, before its left
padding, unused pages), so a tile that read one would poison its output.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.device import sim_kvcache_forward
from support.grids import case_id
from support.kvcache import check_prefill, check_result, expected_cache, make_case, make_prefill
from support.options import check_kvcache

import cuflash
from cuflash.kernels import attention_fwd_sm90, dispatch
from cuflash.runtime import dtypes

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (150, 40)),
         "causal_win": (True, (200, -1))}


def make_mods(rng, names, b, hq):
    """softcap 4; ALiBi slopes (Hq,) or per sequence (B, Hq) ("alibi_b"); sinks, one head's far
    above its scores and one -inf (adds nothing)."""
    mods = {}
    if "softcap" in names:
        mods["softcap"] = 4.0
    if "alibi" in names:
        mods["alibi_slopes"] = rng.uniform(0.02, 0.4, (b, hq) if "alibi_b" in names else (hq,)).astype(np.float32)
    if "sinks" in names:
        s = rng.standard_normal(hq).astype(np.float32)
        s[0], s[-1] = 6.0, -np.inf
        mods["sinks"] = s
    return mods


def run_case(rng, lengths, sq, snew, page, heads, mask, d, splits, extra, dtype_key, names=(), *, checked=False):
    """One attention_with_kvcache call on a TMA form (``names``: score modifiers, the ``mods`` forms)."""
    dt = DTYPES[dtype_key]
    q, kc, vc, lengths, kw = make_case(rng, lengths, sq, snew, page, heads, d, dt, "none", extra)
    causal, window = MASKS[mask]
    mods = make_mods(rng, names, len(lengths), heads[0])
    kw = {**kw, **mods}
    problem = check_kvcache(q, kc, vc, lengths, causal=causal, window_size=window, num_splits=splits, **kw)
    info = dispatch.explain_forward(problem, 90, (q, kc, vc), sm_count=cuflash.sim.sm_count(90))
    assert info["tier"] == "attention_fwd_sm90" and info["variant"].endswith("_tma"), info["choice"]
    assert ("_mods_" in info["variant"]) == bool(mods), info["variant"]
    assert (f"pages of {page} rows load by TMA, the others (across a sequence's end or a page's) by cp.async gather"
            if page else "of the contiguous cache load by TMA, the one across a sequence's end by cp.async gather"
            ) in info["choice"], info["choice"]
    want_k, want_v = expected_cache(kc, vc, lengths, kw, page)
    k1, v1 = kc.copy(), vc.copy()
    with cuflash.sim.options(arch=90, checked=checked, seed=5):
        out, lse = cuflash.attention_with_kvcache(q, k1, v1, lengths, causal=causal, window_size=window,
                                                  num_splits=splits, return_lse=True, backend="sim", **kw)
    assert k1.tobytes() == want_k.tobytes() and v1.tobytes() == want_v.tobytes()
    check_result(out, lse, q, want_k, want_v, lengths, kw, page, causal, window, **mods)


#: (cache lengths, Sq, new rows, page size (None: contiguous), (Hq, Hk), mask, D, splits, extra, dtype)
DEFAULT = [
    # pages of 128 (d64: 128-key tiles): sequence 0's 301 keys are 2 TMA tiles and the edge tile,
    # sequence 2's 129 one TMA tile and a 2-key edge; GQA 8:2 packed, causal, 2 splits
    ([300, 0, 128], 16, 1, 128, (8, 2), "causal", 64, 2, "plain", "f16"),
]
SLOW = [
    ([500, 3, 255], 130, 1, 256, (6, 2), "none", 128, 1, "plain", "bf16"),   # unpacked (G 3), pages of 256
    ([400, 130], 70, 0, 128, (4, 2), "window", 64, 3, "leftpad", "f16"),   # left padding: tiles across pages gathered
    ([384, 20], 130, 1, 256, (3, 1), "causal_win", 96, 3, "plain", "bf16"),
    ([600, 1], 64, 1, 256, (8, 1), "causal", 128, 1, "plain", "f16"),   # GQA 8 packed
    ([300, 90], 128, 2, 112 * 2, (4, 4), "causal", 192, 3, "plain", "bf16"),   # d192: 112-key tiles, pages of 224
    ([300, 77, 0], 130, 1, None, (6, 2), "causal", 64, 3, "plain", "bf16"),   # contiguous
    ([300, 77], 64, 0, None, (8, 2), "window", 128, 2, "batch_idx", "f16"),   # contiguous, batch_idx, packed
    ([260, 200], 70, 1, None, (4, 4), "none", 64, 1, "leftpad", "bf16"),   # contiguous, left padding
]
#: the score-modifier forms with TMA over the cache (the same fields, then the modifiers)
MODS = [
    # contiguous, left padding (tiles from rows that are not multiples of the tile), unpacked (G 3)
    ([300, 77, 0], 130, 1, None, (6, 2), "causal", 64, 3, "leftpad", "bf16", ("softcap", "alibi", "sinks")),
    # pages of 128, GQA 4 packed, per-sequence ALiBi and sinks, 2 splits
    ([500, 3], 16, 1, 128, (8, 2), "window", 128, 2, "plain", "f16", ("alibi", "alibi_b", "sinks")),
    # d192 (the modifier form: 96-key tiles), pages of 192
    ([300, 90], 128, 0, 192, (4, 4), "causal_win", 192, 3, "plain", "bf16", ("softcap",)),
    # contiguous with batch indices, GQA 8 packed
    ([260, 200], 8, 0, None, (16, 2), "none", 96, 1, "batch_idx", "f16", ("softcap", "alibi", "sinks")),
]


def run_prefill(rng, chunks, page, heads, mask, d, used, dtype_key, names=(), *, checked=False):
    """One chunked prefill (attention_varlen with a block_table) on the TMA form (``names``:
    softcap, ALiBi)."""
    q, kc, vc, cq, ck, mq, mk, seqused, bt = make_prefill(rng, chunks, page, heads, d, DTYPES[dtype_key], used)
    causal, window = MASKS[mask]
    mods = make_mods(rng, names, len(cq) - 1, heads[0])
    kw = dict(causal=causal, window_size=window, seqused_k=seqused, block_table=bt, **mods)
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, backend="sim", arch=90, **kw)
    assert info["variant"].endswith("_varlen_kvcache_tma") and f"pages of {page} rows load by TMA" in info["choice"]
    with cuflash.sim.options(arch=90, checked=checked):
        out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, return_lse=True, backend="sim", **kw)
    check_prefill(out, lse, q, kc, vc, cq, ck, seqused, bt, page, causal, window, **mods)


#: (query rows, keys) per sequence, page size, (Hq, Hk), mask, D, keys used ("some": seqused_k), dtype
PREFILL = [([(70, 300), (0, 5), (1, 129), (3, 0)], 128, (4, 2), "causal", 64, "some", "f16"),
           ([(130, 600), (64, 256)], 256, (8, 1), "window", 128, "all", "bf16"),
           ([(100, 500), (5, 5)], 256, (2, 2), "causal_win", 96, "some", "bf16"),
           ([(70, 300), (3, 129)], 128, (4, 2), "causal", 64, "some", "f16", ("softcap", "alibi"))]   # modifiers


@pytest.mark.slow
@pytest.mark.parametrize("case", PREFILL, ids=[case_id(c) for c in PREFILL])
def test_chunked_prefill_tma(case, rng):
    run_prefill(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
def test_chunked_prefill_tma_checked(rng):
    run_prefill(rng, *PREFILL[0], checked=True)


def test_kvcache_tma_default(rng):
    run_case(rng, *DEFAULT[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[case_id(c) for c in SLOW])
def test_kvcache_tma_grid(case, rng):
    run_case(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", [DEFAULT[0], SLOW[1], SLOW[7], MODS[0]], ids=case_id)
def test_kvcache_tma_checked(case, rng):
    run_case(rng, *case, checked=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", MODS, ids=[case_id(c) for c in MODS])
def test_kvcache_tma_mods_grid(case, rng):
    run_case(rng, *case)


def test_kvcache_tma_routing():
    """Which calls load by TMA, and explain's words for those that gather."""
    def problem(page, d=64, **kw):
        q = np.zeros((1, 64, 8, d), dtypes.float16)
        if page is None:
            kc = np.zeros((1, 512, 1, d), dtypes.float16)
            return check_kvcache(q, kc, kc, np.array([70], np.int32), **kw)
        n = -(-512 // page)
        kc = np.zeros((n, page, 1, d), dtypes.float16)
        bt = np.arange(n, dtype=np.int32).reshape(1, n)
        return check_kvcache(q, kc, kc, np.array([70], np.int32), block_table=bt, **kw)
    for page, d, tma in ((128, 64, True), (256, 128, True), (64, 64, False), (16, 64, False), (None, 64, True),
                         (None, 192, True), (224, 192, True), (256, 192, False), (160, 256, False), (None, 256, False)):
        p = problem(page, d)
        v = attention_fwd_sm90.kvcache_variant(p)
        assert v.kv_tma == tma, (page, d)
        line = dispatch.explain_forward(p, 90, sm_count=132)["choice"]
        assert ("load by TMA" in line) == tma, line
        if d == 256:
            assert "keys and values gathered by cp.async: head dim bucket 256 (TMA over the cache takes" in line, line
        elif not tma:
            assert f"keys and values gathered by cp.async: pages of {page} rows do not hold whole {v.block_n}-key tiles" \
                in line, line
        elif page is None:
            assert (f"{v.block_n}-key tiles of the contiguous cache load by TMA, the one across a sequence's end by "
                    "cp.async gather") in line, line
    # a contiguous cache of 0 rows (a tensor map's extents are 1 or more) gathers
    q0, k0 = np.zeros((1, 64, 8, 64), dtypes.float16), np.zeros((1, 0, 1, 64), dtypes.float16)
    p = check_kvcache(q0, k0, k0, np.array([0], np.int32))
    assert not attention_fwd_sm90.kvcache_variant(p).kv_tma
    assert "a contiguous cache of 0 rows per sequence holds no key tile" in dispatch.explain_forward(
        p, 90, sm_count=132)["choice"]
    for page in (128, None):   # the modifier forms too
        p = problem(page, softcap=3.0)
        v = attention_fwd_sm90.kvcache_variant(p)
        assert v.kv_tma and v.mods and v.entry.endswith("_mods_kvcache_gqa_tma"), v.entry   # (G 8 packed)
        assert "load by TMA" in dispatch.explain_forward(p, 90, sm_count=132)["choice"]
    p = problem(16, softcap=3.0)
    assert not attention_fwd_sm90.kvcache_variant(p).kv_tma
    assert "pages of 16 rows do not hold whole" in dispatch.explain_forward(p, 90, sm_count=132)["choice"]
    forms = attention_fwd_sm90.all_variants(kvcache=True, kv_tma=True)
    assert forms and all(v.entry.endswith("_kvcache_tma") for v in forms)
    forms = attention_fwd_sm90.all_variants(kvcache=True, mods=True, kv_tma=True)
    assert forms and all(v.entry.endswith("_mods_kvcache_tma") for v in forms)
    with pytest.raises(ValueError, match="kv_tma"):
        attention_fwd_sm90.Sm90ForwardVariant("f16", 256, 256, True, True, kvcache=True, kv_tma=True)


@pytest.mark.slow
@pytest.mark.checked
def test_kvcache_tma_hostile_device_indices(rng):
    """A block-table entry out of range on a page the TMA path loads (sequence 1's first page: a
    whole 128-key tile; clamped onto a page of finite rows) and a length far past the cache
    (sequence 2): the producer clamps the page (checked mode reports any access outside an
    array), both sequences come out NaN, sequence 0 is exact, and nothing is written outside the
    sequences' own valid pages."""
    q, kc, vc, lengths, kw = make_case(rng, [300, 200, 9], 16, 1, 128, (8, 2), 64, dtypes.float16, "none", "plain")
    # (page 0 made sequence 0's first page, all finite: the bad entry below clamps onto it, so only
    # the producer's report of the bad index, not NaN rows read, can make sequence 1 NaN)
    bt0, u = kw["block_table"], int(kw["block_table"][0, 0])
    for a in (kc, vc):
        a[[0, u]] = a[[u, 0]]
    kw["block_table"] = np.where(bt0 == u, 0, np.where(bt0 == 0, u, bt0)).astype(np.int32)
    problem = check_kvcache(q, kc, vc, lengths, **kw)
    assert attention_fwd_sm90.kvcache_variant(problem).kv_tma
    bt = kw["block_table"].copy()
    bt[1, 0] = -7
    seqlens = lengths.copy()
    seqlens[2] = 2**31 - 5
    k1, v1 = kc.copy(), vc.copy()
    hostile = dataclasses.replace(problem, kvcache=dataclasses.replace(
        problem.kvcache, block_table=bt, cache_seqlens=seqlens, checked=False, k_cache=k1, v_cache=v1))
    for splits in (1, 2):
        out, lse = sim_kvcache_forward(hostile, q, splits)
        assert np.isnan(out[1:].astype(np.float32)).all() and np.isnan(lse[1:]).all()
        one = dict(kw, block_table=kw["block_table"][:1], k=kw["k"][:1], v=kw["v"][:1])
        good_k, good_v = expected_cache(kc, vc, lengths[:1], one, 128)
        check_result(out[:1], lse[:1], q[:1], good_k, good_v, lengths[:1], one, 128, False, (-1, -1))
    changed = np.flatnonzero(~np.all((k1 == kc) | (np.isnan(k1) & np.isnan(kc)), axis=(2, 3)).ravel())
    assert {int(i) // 128 for i in changed} <= {int(kw["block_table"][0, 300 // 128]),
                                               int(kw["block_table"][1, 200 // 128])}


@pytest.mark.slow
@pytest.mark.checked
def test_kvcache_tma_contiguous_hostile_device_indices(rng):
    """A contiguous cache read by TMA: a cache_batch_idx out of range (sequence 1, clamped onto
    sequence 0's cache batch, whose rows it reads are finite), a length far past the cache (sequence 2) and
    a left padding past the sequence's end (sequence 3). The producer clamps them (checked mode
    reports any access outside an array), and those three sequences come out NaN, only through its
    report of the bad index; sequence 0, whose left padding of 61 rows puts its TMA tile at row 61
    of its batch (not tile-aligned) and its gathered edge tile at row 189, is exact; nothing is
    written outside the sequences' own rows."""
    q, kc, vc, lengths, kw = make_case(rng, [300, 200, 9, 150], 16, 1, None, (8, 2), 64, dtypes.float16, "none",
                                       "batch_idx")
    order, u = kw["cache_batch_idx"], int(kw["cache_batch_idx"][0])
    for a in (kc, vc):   # (sequence 0's rows into cache batch 0: the bad index below clamps onto it)
        a[[0, u]] = a[[u, 0]]
    kw["cache_batch_idx"] = np.where(order == u, 0, np.where(order == 0, u, order)).astype(np.int32)
    # (sequences 0 and 1 start at row 61; the rows before are never read: NaN. Sequence 1's 140 keys
    # on the clamped batch are then rows 61..200, finite)
    kw["cache_leftpad"] = np.array([61, 61, 0, 0], np.int32)
    for i in kw["cache_batch_idx"][:2]:
        kc[i, :61], vc[i, :61] = np.nan, np.nan
    problem = check_kvcache(q, kc, vc, lengths, **kw)
    assert attention_fwd_sm90.kvcache_variant(problem).kv_tma
    idx, seqlens, leftpad = kw["cache_batch_idx"].copy(), lengths.copy(), kw["cache_leftpad"].copy()
    idx[1] = -7
    seqlens[2] = 2**31 - 5
    leftpad[3] = 151 + 40   # (past its 151 keys)
    k1, v1 = kc.copy(), vc.copy()
    hostile = dataclasses.replace(problem, kvcache=dataclasses.replace(
        problem.kvcache, cache_batch_idx=idx, cache_seqlens=seqlens, cache_leftpad=leftpad, checked=False,
        k_cache=k1, v_cache=v1))
    for splits in (1, 2):
        out, lse = sim_kvcache_forward(hostile, q, splits)
        assert np.isnan(out[1:].astype(np.float32)).all() and np.isnan(lse[1:]).all()
        one = dict(kw, cache_batch_idx=kw["cache_batch_idx"][:1], cache_leftpad=kw["cache_leftpad"][:1],
                   k=kw["k"][:1], v=kw["v"][:1])
        good_k, good_v = expected_cache(kc, vc, lengths[:1], one, None)
        check_result(out[:1], lse[:1], q[:1], good_k, good_v, lengths[:1], one, None, False, (-1, -1))
    changed = np.argwhere(~np.all((k1 == kc) | (np.isnan(k1) & np.isnan(kc)), axis=(2, 3)))
    assert {tuple(int(x) for x in r) for r in changed} <= {(0, 300), (int(idx[3]), 150)}, changed
