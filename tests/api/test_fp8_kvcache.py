"""The fp8 (float8_e4m3fn) KV cache on the kernel backends: the tensor-core KV-cache kernel's
fp8-cache form (``attention_fwd_mma.cu``, ``CUFLASH_CACHE_FP8``) and the append's fp8 store, on the
simulator, beside the NumPy path.

Each case runs the NumPy path and the simulator on copies of one cache and holds:

* both caches after the append to the bytes the tests compute on their own
  (:func:`support.kvcache.expected_cache`: ``x / descale`` in float32, clipped to +-448, cast to
  e4m3; NaN the canonical byte 0x7f), byte for byte, NaN bytes in every row no call may read
  included;
* each (sequence, kv head)'s output to the float64 oracle of the dequantized cache
  (``float64(x) * descale``) under the rule of :func:`support.kvcache.check_fp8_result`, and the
  LSE to the oracle's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from allpairspy import AllPairs
from support.kvcache import check_fp8_result, expected_cache

import cuflash
from cuflash.reference import kvcache as ref_kvcache
from cuflash.runtime import dtypes

E4M3 = ml_dtypes.float8_e4m3fn
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
BATCHES = {"one_empty": [0], "two": [1, 37], "three": [0, 5, 130], "five": [1, 0, 64, 17, 200]}
SQ = [1, 2, 7, 64]
SNEW = [0, 1, 3]
PAGES = [None, 1, 3, 16, 256]
HEADS = [(2, 2), (4, 2), (4, 1), (8, 1)]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}
HEAD_DIMS = [40, 64, 128, 200, 256]
SPLITS = [0, 1, 3]
#: descales: per (batch, kv head) in [0.25, 4); one per-tensor scale (a stride-0 view); none
#: (1); values near e4m3's max (stored |x| up to 448) with descales near 1/100
DESCALES = ["per_head", "stride0", "none", "near_max"]
EXTRAS = ["plain", "leftpad", "batch_idx"]   # batch_idx: contiguous caches only (else plain)
AXES = [list(BATCHES), SQ, SNEW, PAGES, HEADS, list(MASKS), HEAD_DIMS, SPLITS, DESCALES, EXTRAS, list(DTYPES)]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]
#: the default run: one variant, bf16 d64 (paged caches, pages smaller and larger than a tile,
#: split-KV, values near 448, per-head and per-tensor descales); f16 d128 in checked mode (a
#: contiguous cache with batch indices, GQA 8:1, a window) and the whole design under ``slow``
#: (the default run's checked-mode fp8 decode is the mutation suite's tensor-core probe,
#: tests/support/mutations.py)
DEFAULT = [
    (("three", 2, 3, 3, (4, 2), "causal", 64, 3, "near_max", "leftpad", "bf16"), False),
    pytest.param(("two", 7, 1, None, (8, 1), "window", 128, 1, "per_head", "batch_idx", "f16"), True,
                 marks=pytest.mark.slow),
    (("five", 1, 0, 16, (4, 1), "none", 64, 0, "stride0", "plain", "bf16"), False),
]


def make_case(rng, lengths, sq, snew, page, heads, d, dtype, descale, extra):
    """Inputs of one call: an fp8 cache holding NaN bytes wherever the call must not read."""
    hq, hk = heads
    b = len(lengths)
    lengths = np.array(lengths, np.int32)
    need = int((lengths + snew).max())
    big = descale == "near_max"
    kw = {}
    if descale in ("per_head", "near_max"):
        lo, hi = (0.005, 0.02) if big else (0.25, 4.0)
        kw["k_descale"] = rng.uniform(lo, hi, (b, hk)).astype(np.float32)
        kw["v_descale"] = rng.uniform(lo, hi, (b, hk)).astype(np.float32)
    elif descale == "stride0":
        kw["k_descale"] = np.broadcast_to(np.float32(0.5), (b, hk))
        kw["v_descale"] = np.broadcast_to(np.float32(2.0), (b, hk))
    leftpad = None
    if extra == "leftpad":
        leftpad = (lengths // 3).astype(np.int32)
        kw["cache_leftpad"] = leftpad

    def stored(n):   # fp8 values, near +-448 for "near_max"
        x = rng.standard_normal((n, hk, d)) * (150 if big else 3)
        x[..., 0] = np.where(rng.random((n, hk)) < 0.5, 448, -448) if big else x[..., 0]
        return np.clip(x, -448, 448).astype(E4M3)

    if page is None:
        nb = b + 1 if extra == "batch_idx" else b
        shape = (nb, need + 5, hk, d)
        order = rng.permutation(nb)[:b].astype(np.int32) if extra == "batch_idx" else np.arange(b, dtype=np.int32)
        if extra == "batch_idx":
            kw["cache_batch_idx"] = order
        rows = [(np.full(n, order[i]), np.arange(n)) for i, n in enumerate(lengths)]
    else:
        per_seq = [-(-int(n + snew) // page) for n in lengths]
        num_pages = sum(per_seq) + 2
        ids = rng.permutation(num_pages).astype(np.int32)
        bt = np.full((b, -(-need // page) + 1), -7, np.int32)
        at = 0
        for i, n in enumerate(per_seq):
            bt[i, :n] = ids[at:at + n]
            at += n
        kw["block_table"] = bt
        shape = (num_pages, page, hk, d)
        rows = [ref_kvcache.cache_rows(i, 0, int(n), page_size=page, block_table=bt) for i, n in enumerate(lengths)]
    kc, vc = np.full(shape, np.nan, E4M3), np.full(shape, np.nan, E4M3)
    for i, (i0, i1) in enumerate(rows):
        keep = slice(0 if leftpad is None else int(leftpad[i]), None)
        kc[i0[keep], i1[keep]] = stored(len(i0[keep]))
        vc[i0[keep], i1[keep]] = stored(len(i0[keep]))
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    if snew:
        kw["k"] = (rng.standard_normal((b, snew, hk, d)) * (3 if big else 1)).astype(dtype)
        kw["v"] = rng.standard_normal((b, snew, hk, d)).astype(dtype)
    return q, kc, vc, lengths, kw


def run_case(rng, batch, sq, snew, page, heads, mask, d, splits, descale, extra, dtype_key, *, checked=False):
    if extra == "batch_idx" and page is not None:
        extra = "plain"
    q, kc, vc, lengths, kw = make_case(rng, BATCHES[batch], sq, snew, page, heads, d, DTYPES[dtype_key], descale, extra)
    causal, window = MASKS[mask]
    want_k, want_v = expected_cache(kc, vc, lengths, kw, page)
    for backend in ("numpy", "sim"):
        k1, v1 = kc.copy(), vc.copy()
        with cuflash.sim.options(checked=checked, seed=3 if checked else 0):
            out, lse = cuflash.attention_with_kvcache(q, k1, v1, lengths, causal=causal, window_size=window,
                                                      num_splits=splits, return_lse=True, backend=backend, **kw)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert k1.view(np.uint8).tobytes() == want_k.view(np.uint8).tobytes(), backend
        assert v1.view(np.uint8).tobytes() == want_v.view(np.uint8).tobytes(), backend
        check_fp8_result(out, lse, q, want_k, want_v, lengths, kw, page, causal, window)


def _id(c):
    return "-".join(map(str, c))


def _default_id(p):
    case, checked = p.values if hasattr(p, "values") else p
    return _id(case) + "-checked" * checked


@pytest.mark.parametrize("case, checked", DEFAULT, ids=[_default_id(p) for p in DEFAULT])
def test_fp8_kvcache_sim_and_numpy(case, checked, rng):
    run_case(rng, *case, checked=checked)


@pytest.mark.slow
@pytest.mark.parametrize("case", PAIRWISE, ids=[_id(c) for c in PAIRWISE])
def test_fp8_kvcache_pairwise(case, rng):
    run_case(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", PAIRWISE[::6], ids=[_id(c) for c in PAIRWISE[::6]])
def test_fp8_kvcache_checked(case, rng):
    run_case(rng, *case, checked=True)


def test_fp8_kvcache_saturating_append_and_nan_read_on_the_simulator(rng):
    """New keys past e4m3's range are stored as +-448 and read back as 448 * descale; a NaN new key
    is stored as 0x7f and makes the rows that see it NaN, on both paths alike."""
    q = rng.standard_normal((1, 1, 2, 64)).astype(dtypes.bfloat16)
    kc = np.full((1, 8, 1, 64), np.nan, E4M3)
    vc = kc.copy()
    kc[0, :2] = vc[0, :2] = 1.0
    k = np.zeros((1, 1, 1, 64), dtypes.bfloat16)
    k[0, 0, 0, :4] = [480, np.inf, -1e4, 3.0]
    kw = dict(k=k, v=np.ones((1, 1, 1, 64), dtypes.bfloat16), k_descale=np.full((1, 1), 0.5, np.float32))
    outs = {}
    for backend in ("numpy", "sim"):
        k1, v1 = kc.copy(), vc.copy()
        outs[backend] = cuflash.attention_with_kvcache(q, k1, v1, 2, backend=backend, **kw)
        np.testing.assert_array_equal(k1[0, 2, 0, :4].astype(np.float32), [448, 448, -448, 6])
        assert (k1.view(np.uint8)[0, 3:] == 0x7F).all()
    np.testing.assert_array_equal(outs["sim"].astype(np.float32), outs["numpy"].astype(np.float32))
    k[0, 0, 0, 5] = np.nan
    for backend in ("numpy", "sim"):
        out = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), 2, backend=backend, **kw)
        assert np.isnan(out.astype(np.float32)).all(), backend


def test_fp8_kvcache_refusals_on_the_kernel_backends(rng):
    q, kc, vc, lengths, kw = make_case(rng, [3, 9], 1, 1, 16, (4, 2), 64, dtypes.bfloat16, "per_head", "plain")
    before = kc.view(np.uint8).copy()
    bt = kw["block_table"]
    with pytest.raises(NotImplementedError, match=r"cuflash.attention_with_kvcache: an fp8 \(float8_e4m3fn\) KV cache "
                                                  r"has no kernel for this call on sm_90: .*fp8-cache form takes no "
                                                  r"score modifiers \(softcap given\).*Nothing was appended"):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, backend="sim", softcap=5.0, **kw)
    with pytest.raises(NotImplementedError, match=r"explain_kvcache: .*fp8-cache form takes no score modifiers"):
        cuflash.explain_kvcache(q, kc, vc, lengths, arch=90, softcap=5.0, **kw)
    with pytest.raises(ValueError, match=r"k_descale.shape=\(2, 4\) must be \(2, 2\)"):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, backend="sim", block_table=bt,
                                       k_descale=np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match=r"v_descale must be float32, got v_descale.dtype=float16"):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, backend="sim", block_table=bt,
                                       v_descale=np.ones((2, 2), np.float16))
    for bad in (0.0, -1.0, np.inf, np.nan):
        d = np.ones((2, 2), np.float32)
        d[1, 0] = bad
        with pytest.raises(ValueError, match=r"k_descale\[1, 0\]=.* must be finite and > 0"):
            cuflash.attention_with_kvcache(q, kc, vc, lengths, backend="sim", block_table=bt, k_descale=d)
    with pytest.raises(NotImplementedError, match=r"q.dtype=float8_e4m3fn: with a KV cache q is float16"):
        cuflash.attention_with_kvcache(q.astype(E4M3), kc, vc, lengths, backend="sim", block_table=bt)
    np.testing.assert_array_equal(kc.view(np.uint8), before)   # nothing was appended


def test_fp8_kvcache_dropout_is_refused():
    """fp8 takes no dropout: the varlen entry with a block table (the KV-cache kernel's packed
    form) refuses fp8 caches, and cuflash.attention refuses fp8 with dropout by name."""
    q = np.zeros((1, 2, 4, 16), E4M3)
    with pytest.raises(NotImplementedError, match=r"float8_e4m3fn input takes no dropout"):
        cuflash.attention(q, q, q, dropout_p=0.1, dropout_seed=1, backend="sim")


def test_explain_kvcache_names_the_fp8_form(rng):
    q, kc, vc, lengths, kw = make_case(rng, [3, 9], 1, 1, 16, (4, 2), 64, dtypes.bfloat16, "per_head", "plain")
    for arch in (80, 90):
        info = cuflash.explain_kvcache(q, kc, vc, lengths, arch=arch, num_splits=1, **kw)
        assert info["entry"] == "cuflash_attn_fwd_mma_bf16_d64_m64_n64_kvcache_e4m3"
        assert f"sm_{arch}: tensor-core mma.sync tier, KV-cache form over an fp8 (float8_e4m3fn) paged cache" \
            in info["choice"]
        assert "fp8 (float8_e4m3fn) cache converted to bf16 in shared memory" in info["choice"]
    with pytest.raises(NotImplementedError, match=r"sm_75 \(Turing\) has no bfloat16 tensor-core mma"):
        cuflash.explain_kvcache(q, kc, vc, lengths, arch=75, num_splits=1, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in PAIRWISE[::5] if c[-1] == "f16"][:4],
                         ids=[_id(c) for c in [c for c in PAIRWISE[::5] if c[-1] == "f16"][:4]])
def test_fp8_kvcache_sm75(case, rng):
    # the fp8-cache form of the tensor-core tier's sm_75 (Turing) form (float16 q)
    with cuflash.sim.options(arch="sm_75"):
        run_case(rng, *case)
