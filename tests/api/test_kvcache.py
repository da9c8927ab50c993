"""KV-cache attention: ``cuflash.attention_with_kvcache`` and ``cuflash.merge_attention`` (issue 22).

Every case runs the NumPy path and the simulator (the tensor-core KV-cache kernel, its append and
split-KV combine) on copies of one cache, and holds each sequence's output to the float64 oracle
over the keys the cache holds after the append (the tolerance rule of tests/support/tolerance.py),
the LSE to float64, and the two caches to each other byte for byte (and to the original outside
the appended rows). Unused cache rows, rows before the left padding and unused pages hold NaN, so
a read of any of them shows. The grid is a pairwise covering design over batches with mixed cache
lengths (0 and 1 included), query lengths, appends, page sizes (contiguous, 1, 3, 16, 256), GQA
groups 1..8, masks, head dims 40..256, split counts, rotary, left padding, cache batch indices and
both 16-bit dtypes; a share of it in checked mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from unittest import mock

import numpy as np
import pytest
from allpairspy import AllPairs
from support.grids import default_share
from support.device import on_device, sim_call, sim_kvcache_forward
from support.options import check_kvcache as check_attention_with_kvcache
from support.kvcache import check_prefill, check_result, expected_cache, make_case, make_prefill
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash.kernels import attention_fwd_sm90, dispatch
from cuflash.reference import kvcache as ref_kvcache
from cuflash.runtime import dtypes

#: cache lengths before the append, one per sequence
BATCHES = {"one_empty": [0], "two": [1, 37], "three": [0, 5, 130], "five": [1, 0, 64, 17, 200]}
SQ = [1, 2, 7, 64, 130]
SNEW = [0, 1, 3]
PAGES = [None, 1, 3, 16, 256]          # None: a contiguous cache
HEADS = [(2, 2), (4, 2), (4, 1), (8, 1)]   # GQA groups 1, 2, 4, 8
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}
HEAD_DIMS = [40, 64, 96, 128, 200, 256]
SPLITS = [0, 1, 3, 8]
ROTARY = ["none", "interleaved", "neox"]
EXTRAS = ["plain", "leftpad", "batch_idx"]   # batch_idx: contiguous caches only (else plain)
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
AXES = [list(BATCHES), SQ, SNEW, PAGES, HEADS, list(MASKS), HEAD_DIMS, SPLITS, ROTARY, EXTRAS, list(DTYPES)]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


def tensor_core_only():
    """The KV-cache path on the tensor-core form whatever Sq (the Hopper form's threshold out of
    reach): the grid above holds that form; tests/kernels/test_hopper_kvcache.py the Hopper one."""
    return mock.patch.object(attention_fwd_sm90, "KVCACHE_MIN_ROWS", 2**31)


def run_case(rng, batch, sq, snew, page, heads, mask, d, splits, rotary, extra, dtype_key, *, checked=False, seed=0,
             hopper=False):
    """One case on both backends (``hopper``: the simulator runs the Hopper KV-cache form, which the
    dispatcher must choose; else the tensor-core one)."""
    if extra == "batch_idx" and page is not None:
        extra = "plain"
    dt = DTYPES[dtype_key]
    lengths = BATCHES[batch]
    q, kc, vc, lengths, kw = make_case(rng, lengths, sq, snew, page, heads, d, dt, rotary, extra)
    causal, window = MASKS[mask]
    want_k, want_v = expected_cache(kc, vc, lengths, kw, page)
    caches = {}
    if hopper:
        problem = check_attention_with_kvcache(q, kc, vc, lengths, causal=causal, window_size=window, num_splits=splits,
                                               **kw)
        info = dispatch.explain_forward(problem, 90, (q, kc, vc), sm_count=cuflash.sim.sm_count(90))
        assert info["tier"] == "attention_fwd_sm90", info["choice"]
    for backend in ("numpy", "sim"):
        k1, v1 = kc.copy(), vc.copy()
        with cuflash.sim.options(checked=checked, seed=seed), \
                (contextlib.nullcontext() if hopper else tensor_core_only()):
            out, lse = cuflash.attention_with_kvcache(q, k1, v1, lengths, causal=causal, window_size=window,
                                                      num_splits=splits, return_lse=True, backend=backend, **kw)
        assert out.shape == q.shape and out.dtype == dt and lse.shape == (q.shape[0], q.shape[2], sq)
        check_result(out, lse, q, want_k, want_v, lengths, kw, page, causal, window)
        caches[backend] = (k1, v1)
    for backend, (k1, v1) in caches.items():   # byte for byte (NaN in unused rows included)
        assert k1.tobytes() == want_k.tobytes() and v1.tobytes() == want_v.tobytes(), backend


@pytest.mark.parametrize("case", default_share(PAIRWISE, ["-".join(map(str, c)) for c in PAIRWISE]))
def test_kvcache_pairwise(case, rng):
    run_case(rng, *case)


#: a share of the grid in checked mode (races, bounds, uninitialized reads), with other thread
#: orders: every fifth case, a quarter of them in the default run
CHECKED = [pytest.param(c, id="-".join(map(str, c)), marks=() if i % 4 == 0 else (pytest.mark.slow,))
           for i, c in enumerate(PAIRWISE[::5])]


@pytest.mark.checked
@pytest.mark.parametrize("case", CHECKED)
def test_kvcache_checked(case, rng):
    run_case(rng, *case, checked=True, seed=3)


def test_apply_rotary_matches_float64_rotation(rng):
    """The rotation is a complex multiplication by exp(i * angle) of each dimension pair: float64
    oracle, both pairings, and the dims past rotary_dim untouched."""
    x = rng.standard_normal((2, 5, 3, 24)).astype(np.float32)
    angle = rng.uniform(-4, 4, (40, 8))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    pos = rng.integers(0, 40, (2, 5))
    for interleaved in (True, False):
        got = ref_kvcache.apply_rotary(x, cos, sin, pos, interleaved=interleaved)
        xd = x.astype(np.float64)
        i1 = np.arange(0, 16, 2) if interleaved else np.arange(8)
        i2 = i1 + 1 if interleaved else i1 + 8
        z = (xd[..., i1] + 1j * xd[..., i2]) * np.exp(1j * angle[pos][:, :, None, :])
        np.testing.assert_allclose(got[..., i1], z.real, atol=2e-6)
        np.testing.assert_allclose(got[..., i2], z.imag, atol=2e-6)
        assert np.array_equal(got[..., 16:], x[..., 16:])


#: the grid again on the Hopper KV-cache form (compute capability 9.0, Sq from 64 on): the same axes
#: but query lengths that fill its tiles; a paged case (f16, head-dim bucket 64) in the default run,
#: in checked mode, and a contiguous one (the form with TMA over the cache) under slow with the
#: rest (each dtype and head-dim bucket is a variant)
SQ_HOPPER = [64, 70, 130]
HOPPER = [tuple(c) for c in AllPairs([list(BATCHES), SQ_HOPPER, SNEW, PAGES, HEADS, list(MASKS), HEAD_DIMS, SPLITS,
                                      ROTARY, EXTRAS, list(DTYPES)])]
HOPPER_DEFAULT = [("three", 64, 1, 3, (2, 1), "causal_win", 64, 3, "none", "leftpad", "f16"),
                  ("five", 70, 0, None, (8, 1), "window", 40, 0, "none", "batch_idx", "f16")]


@pytest.mark.parametrize("case", [pytest.param(HOPPER_DEFAULT[0], id="-".join(map(str, HOPPER_DEFAULT[0])))]
                         + [pytest.param(c, id="-".join(map(str, c)), marks=pytest.mark.slow) for c in HOPPER_DEFAULT[1:]]
                         + [pytest.param(c, id="-".join(map(str, c)), marks=pytest.mark.slow) for c in HOPPER])
def test_kvcache_hopper_pairwise(case, rng):
    run_case(rng, *case, hopper=True, checked=case == HOPPER_DEFAULT[0], seed=5)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", HOPPER_DEFAULT[1:] + HOPPER[::6],
                         ids=["-".join(map(str, c)) for c in HOPPER_DEFAULT[1:] + HOPPER[::6]])
def test_kvcache_hopper_checked(case, rng):
    run_case(rng, *case, checked=True, seed=5, hopper=True)


@pytest.mark.parametrize("sq, hq, hk, page", [(64, 1, 1, 16), (8, 8, 1, None),
                                              pytest.param(64, 2, 1, 128, marks=pytest.mark.slow),
                                              pytest.param(64, 1, 1, None, marks=pytest.mark.slow)],
                         ids=["unpacked_gather", "gqa_packed_tma", "paged_tma", "contiguous_tma"])
def test_hopper_replay_with_new_lengths_keeps_its_plan(rng, sq, hq, hk, page):
    """A CUDA-graph replay on the Hopper KV-cache form: the launches are planned once (num_splits=0:
    the split count from the capacity and the shapes) and run again, as a captured graph is, after
    new lengths are written into the device cache_seqlens the plan points at: the lengths at
    capture, longer ones (up to the capacity) and shorter ones (1 and 0). Every run holds to the
    float64 oracle over the keys its lengths give; rows past them hold NaN, which must never be read.
    Both the unpacked form and GQA packing (8 positions x 8 query heads of one kv head). The
    contiguous cache (``page`` None) and pages of 128 rows run the forms with TMA over the cache
    (whole tiles by TMA, the tile across each new length gathered); pages of 16 rows (the same
    cache seen as pages) the form that gathers every key tile by cp.async."""
    from cuflash.kernels import attention_combine, kvcache_run

    d, cap = 64, 512
    q = rng.standard_normal((2, sq, hq, d)).astype(dtypes.float16)
    kc = rng.standard_normal((2, cap, hk, d)).astype(dtypes.float16)
    vc = rng.standard_normal((2, cap, hk, d)).astype(dtypes.float16)
    seqlens = np.array([300, 40], np.int32)
    kw = {}
    kcall, vcall = kc, vc
    if page:   # (views of the same memory: the first half of the pages sequence 0's, the rest sequence 1's)
        kcall, vcall = kc.reshape(-1, page, hk, d), vc.reshape(-1, page, hk, d)
        kw["block_table"] = np.arange(2 * cap // page, dtype=np.int32).reshape(2, -1)
    plans_for = {}
    for lengths in ([300, 40], [512, 500], [1, 0]):   # the plan never depends on the lengths
        p = check_attention_with_kvcache(q, kcall, vcall, np.array(lengths, np.int32), causal=True, **kw)
        plans_for[tuple(lengths)] = kvcache_run.choose(p, 90, (q, kcall, vcall), cuflash.sim.sm_count(90))
    assert len(set(plans_for.values())) == 1, plans_for
    variant, splits = plans_for[(300, 40)]
    assert isinstance(variant, attention_fwd_sm90.Sm90ForwardVariant) and splits == 2   # 4 tiles of capacity
    assert variant.gqa == (hq > hk) and variant.kv_tma == (page != 16)
    problem = check_attention_with_kvcache(q, kcall, vcall, seqlens, causal=True, **kw)
    with cuflash.sim.options(arch="sm_90", checked=True), sim_call(q) as call:
        p, qd = on_device(call, problem, q)
        out, lse = call.empty(p.out_shape, p.dtype), call.empty(p.lse_shape, np.float32)
        o_part = call.empty((splits, 2 * hq * sq, d), np.float32)
        lse_part = call.empty((splits, 2 * hq * sq), np.float32)
        plans = [attention_fwd_sm90.plan_kvcache(p, qd, out, lse, variant, (o_part, lse_part), call),
                 attention_combine.plan_combine(o_part, lse_part, out, lse, num_heads_q=hq, seqlen_q=sq)]
        for lengths in ([300, 40], [512, 500], [1, 0]):
            seqlens[...] = lengths   # (the device array is a view of it, as a graph's input buffer)
            k_run, v_run = kc.copy(), vc.copy()
            for b, n in enumerate(lengths):
                kc[b, n:], vc[b, n:] = np.nan, np.nan   # (the device views see them)
            for launch_plan in plans:
                call.launch(launch_plan)
            got, got_lse = np.asarray(out.view(np.ndarray)), np.asarray(lse.view(np.ndarray))
            check_result(got, got_lse, q, k_run, v_run, np.array(lengths, np.int32), {}, None, True, (-1, -1))
            kc[...], vc[...] = k_run, v_run


@pytest.mark.parametrize("backend", ["numpy", "sim"])
def test_split_counts_agree(rng, backend):
    """Every split count gives the unsplit result up to float32 rounding of the merge."""
    q, kc, vc, lengths, kw = make_case(rng, [150, 3, 90], 1, 0, 16, (8, 2), 64, dtypes.bfloat16, "none", "plain")
    outs = [cuflash.attention_with_kvcache(q, kc, vc, lengths, num_splits=n, return_lse=True, backend=backend, **kw)
            for n in (1, 2, 3, 10)]
    for o, lse in outs[1:]:
        np.testing.assert_allclose(o.astype(np.float32), outs[0][0].astype(np.float32), atol=1e-2)
        np.testing.assert_allclose(lse, outs[0][1], atol=1e-4)


def test_num_splits_heuristic():
    """num_splits=0: a batch that fills the device runs unsplit; a single long sequence splits,
    keeping at least two key tiles per split."""
    from cuflash.kernels import attention_fwd_mma

    def splits(b, cache, hq=32, hk=8):
        q = np.zeros((b, 1, hq, 128), dtypes.bfloat16)
        kc = np.zeros((b, cache, hk, 128), dtypes.bfloat16)
        p = check_attention_with_kvcache(q, kc, kc, cache)
        v = attention_fwd_mma.choose_variant(p.dtype, 128, 128, 90, kvcache=True)
        return attention_fwd_mma.kvcache_splits(p, v, 90, 132)

    assert splits(64, 8192) == 1
    assert 1 < splits(1, 8192) <= 8192 // 64 // 2
    assert splits(1, 64) == 1


def test_scalar_cache_seqlens_and_contiguous_decode(rng):
    """An int cache_seqlens (every sequence the same length), no append, on both backends."""
    q = rng.standard_normal((2, 1, 4, 64)).astype(dtypes.float16)
    kc = rng.standard_normal((2, 50, 2, 64)).astype(dtypes.float16)
    vc = rng.standard_normal((2, 50, 2, 64)).astype(dtypes.float16)
    kc[:, 33:] = np.nan
    for backend in ("numpy", "sim"):
        out = cuflash.attention_with_kvcache(q, kc, vc, 33, backend=backend)
        check_close(out, q, kc[:, :33], vc[:, :33], layout="bshd")


@pytest.mark.parametrize("sq, heads", [(2, (4, 2)), pytest.param(128, (6, 2), marks=pytest.mark.slow),
                                       pytest.param(32, (8, 2), marks=pytest.mark.slow),
                                       pytest.param(32, (6, 2), marks=pytest.mark.slow)],
                         ids=["tensor_core", "hopper", "hopper_gqa_packed", "hopper_gqa_packed_g3"])
def test_hostile_device_indices_give_nan_rows_and_stay_inside(rng, sq, heads):
    """Device-resident indices are not read by the host: whatever they hold, the kernels clamp
    every index into the cache (checked mode reports any access outside an array) and a sequence
    whose index was out of range comes out NaN, while the others are exact; appends that would
    land outside the cache or on a bad page are not written. (Sq=2: the tensor-core KV-cache form;
    128 with GQA 3: the Hopper one unpacked, whose producer finds the bad page; 32 with GQA 4 and
    GQA 3: the Hopper one GQA-packed, 128 and 126 rows a tile: every head of a bad sequence NaN.)"""
    q, kc, vc, lengths, kw = make_case(rng, [5, 20, 9], sq, 1, 4, heads, 64, dtypes.float16, "none", "plain")
    problem = check_attention_with_kvcache(q, kc, vc, lengths, **kw)
    info = dispatch.explain_forward(problem, 90, (q, kc, vc), sm_count=132)
    assert info["tier"] == ("attention_fwd_mma" if sq == 2 else "attention_fwd_sm90")
    assert info["variant"].endswith("_gqa") == (sq == 32), info["variant"]
    bt = kw["block_table"].copy()
    bt[1, 1] = 10**6            # sequence 1's second page: out of range
    seqlens = lengths.copy()
    seqlens[2] = 2**31 - 5      # sequence 2: far past the cache
    hostile = dataclasses.replace(problem, kvcache=dataclasses.replace(problem.kvcache, block_table=bt,
                                                                       cache_seqlens=seqlens, checked=False))
    k1, v1 = kc.copy(), vc.copy()
    hostile = dataclasses.replace(hostile, kvcache=dataclasses.replace(hostile.kvcache, k_cache=k1, v_cache=v1))
    for splits in (1, 3):
        out, lse = sim_kvcache_forward(hostile, q, splits)
        assert np.isnan(out[1:].astype(np.float32)).all() and np.isnan(lse[1:]).all()
        good_k, good_v = expected_cache(kc, vc, lengths[:1], dict(kw, block_table=kw["block_table"][:1],
                                                                   k=kw["k"][:1], v=kw["v"][:1]), 4)
        check_result(out[:1], lse[:1], q[:1], good_k, good_v, lengths[:1],
                     dict(kw, block_table=kw["block_table"][:1], k=kw["k"][:1], v=kw["v"][:1]), 4, False, (-1, -1))
    # nothing of sequence 2 was written anywhere; sequence 1's token went to its own valid page
    changed = np.flatnonzero(~np.all((k1 == kc) | (np.isnan(k1) & np.isnan(kc)), axis=(2, 3)).ravel())
    pages_written = {int(i) // 4 for i in changed}
    assert pages_written <= {int(kw["block_table"][0, 5 // 4]), int(kw["block_table"][1, 20 // 4])}


# --------------------------------------------------------------------------------------------
# merge_attention


def test_merge_attention_equals_attention_over_the_union(rng):
    """Attention over disjoint key sets, merged, is attention over their union (float64 oracle);
    an empty part adds nothing; every part empty gives 0 and -inf."""
    q = rng.standard_normal((2, 3, 6, 32))
    k = rng.standard_normal((2, 3, 20, 32))
    v = rng.standard_normal((2, 3, 20, 16))
    parts = [(0, 7), (7, 7), (7, 20)]
    outs, lses = zip(*(ref.naive_attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True) for a, b in parts))
    out, lse = cuflash.merge_attention(outs, lses)
    want, want_lse = ref.naive_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    empty_o, empty_l = np.zeros((2, 4)), np.full((2,), -np.inf)
    o, s = cuflash.merge_attention([empty_o, empty_o], [empty_l, empty_l])
    assert (o == 0).all() and np.isneginf(s).all()
    nan_l = lses[0].copy()
    nan_l[0, 0, 1] = np.nan
    o, s = cuflash.merge_attention([outs[0], outs[2]], [nan_l, lses[2]])
    assert np.isnan(s[0, 0, 1]) and np.isnan(o[0, 0, 1]).all()
    assert np.isfinite(np.delete(s.ravel(), 1)).all()


def _hostile_parts(rng, dv=8):
    """Three parts of (B=1, H=2, Sq=5, Dv) rows, each row a case of the rule for empty and NaN parts:
    row 0 plain; row 1 part 0 never written (lse -inf, out NaN); row 2 a NaN in the out of part 2,
    whose finite lse is so far below the others that its weight rounds to 0 in float32; row 3 every
    part never written; row 4 a NaN lse in part 1."""
    outs = [rng.standard_normal((1, 2, 5, dv)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((1, 2, 5)).astype(np.float32) for _ in range(3)]
    outs[0][:, :, 1] = np.nan
    lses[0][:, :, 1] = -np.inf
    outs[2][:, :, 2, 3] = np.nan
    lses[2][:, :, 2] = -200.0
    for i in range(3):
        outs[i][:, :, 3] = np.nan if i != 1 else 1e4
        lses[i][:, :, 3] = -np.inf
    lses[1][:, :, 4] = np.nan
    return outs, lses


def _merge_f64(outs, lses):
    """The merge from its definition, in float64, row by row over the parts whose lse is not -inf."""
    o_all, l_all = np.stack(outs).astype(np.float64), np.stack(lses).astype(np.float64)
    out = np.zeros(o_all.shape[1:])
    lse = np.full(l_all.shape[1:], -np.inf)
    for idx in np.ndindex(*l_all.shape[1:]):
        keep = [i for i in range(len(outs)) if not np.isneginf(l_all[(i, *idx)])]
        if not keep:
            continue
        ls = np.array([l_all[(i, *idx)] for i in keep])
        lse[idx] = np.log(np.sum(np.exp(ls)))
        out[idx] = sum(np.exp(l - lse[idx]) * o_all[(i, *idx)] for i, l in zip(keep, ls))
    return out, lse


@pytest.mark.parametrize("backend", ["numpy", "sim"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_merge_attention_ignores_empty_parts_and_keeps_nan_of_the_others(monkeypatch, rng, backend, dtype):
    """A part with lse = -inf adds nothing even when its out is NaN or garbage; a NaN lse, or a NaN
    in the out of a part with finite lse (weight rounding to 0 included), reaches its row; on the
    NumPy path and on the simulator alike."""
    from cuflash.sim import device as sim_device

    outs, lses = _hostile_parts(rng)
    want, want_lse = _merge_f64(outs, lses)
    assert np.isnan(want[0, :, 2, 3]).all() and np.isfinite(np.delete(want[0, :, 2], 3, axis=-1)).all()
    made = []
    monkeypatch.setattr(sim_device.SimDevice, "launch", lambda self, plan: made.append(plan))   # no kernel expected
    init = sim_device.SimDevice.__init__
    monkeypatch.setattr(sim_device.SimDevice, "__init__", lambda self, *a: made.append("device") or init(self, *a))
    monkeypatch.setenv("CUFLASH_BACKEND", backend)
    out, lse = cuflash.merge_attention([o.astype(dtype) for o in outs], lses)
    assert made == ([] if backend == "numpy" else ["device"])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(np.nan_to_num(out.astype(np.float64)), np.nan_to_num(want), rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
    assert (out[0, :, 3] == 0).all() and np.isneginf(lse[0, :, 3]).all()


def test_the_split_kv_combine_kernel_follows_the_merge_rule(rng):
    """The combine kernel (kernels_cu/attention_combine.cu) on the simulator, on the partials of
    _hostile_parts laid out as the KV-cache forward writes them: the rule of merge_attention."""
    from cuflash.kernels import attention_combine
    from cuflash.sim import launcher

    outs, lses = _hostile_parts(rng, dv=40)
    want, want_lse = _merge_f64(outs, lses)
    rows = 2 * 5
    o_part = np.ascontiguousarray(np.stack(outs).reshape(3, rows, 40))   # rows (batch, head, query row)
    l_part = np.ascontiguousarray(np.stack(lses).reshape(3, rows))
    out = np.full((1, 5, 2, 40), 7.0, np.float16)   # (B, Sq, Hq, Dv)
    lse = np.full((1, 2, 5), 7.0, np.float32)
    plan = attention_combine.plan_combine(o_part, l_part, out, lse, num_heads_q=2, seqlen_q=5)
    launcher.load_variant(plan.variant).launch(plan)
    got = out.swapaxes(1, 2).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_merge_attention_checks_its_working_memory_first(monkeypatch):
    """A merge of broadcast parts too large to hold is refused by name with the bytes, before NumPy
    allocates anything; an injected limit refuses a normal merge likewise."""
    outs = [np.broadcast_to(np.ones((1, 2, 4), np.float32), (2**44, 1, 2, 4))] * 2
    lses = [np.broadcast_to(np.zeros((1, 2), np.float32), (2**44, 1, 2))] * 2
    with pytest.raises(MemoryError, match=r"^cuflash\.merge_attention: .* bytes .*are available"):
        cuflash.merge_attention(outs, lses)
    monkeypatch.setenv("CUFLASH_MEMORY_LIMIT", "100")
    with pytest.raises(MemoryError, match=r"^cuflash\.merge_attention: .*lse and weights: 1536 bytes"):
        cuflash.merge_attention([np.ones((4, 8, 3), np.float32)] * 2, [np.zeros((4, 8), np.float32)] * 2)


def test_merge_attention_float32(rng):
    q = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    a = cuflash.attention(q, k[..., :4, :], v[..., :4, :], return_lse=True)
    b = cuflash.attention(q, k[..., 4:, :], v[..., 4:, :], return_lse=True)
    out, lse = cuflash.merge_attention([a[0], b[0]], [a[1], b[1]])
    assert out.dtype == np.float32 and lse.dtype == np.float32
    check_close(out, q, k, v)


MERGE_BAD = [
    (lambda o, s: ([], []), ValueError, "at least one part"),
    (lambda o, s: (o, s[:1]), ValueError, "2 outs but 1 lses"),
    (lambda o, s: (o, [s[0], s[1][..., :-1]]), ValueError, "lses[1].shape"),
    (lambda o, s: ([o[0], o[1].astype(np.float16)], s), TypeError, "outs[1].dtype"),
    (lambda o, s: (o, [s[0], s[1].astype(np.int32)]), TypeError, "lses[1].dtype=int32"),
    (lambda o, s: ("ab", s), TypeError, "outs must be a list or tuple of arrays"),
    (lambda o, s: (np.stack(o), s), TypeError, "outs must be a list or tuple of arrays"),
]


@pytest.mark.parametrize("mutate,exc,match", MERGE_BAD)
def test_merge_attention_bad_input(mutate, exc, match):
    o = [np.zeros((2, 3, 4), np.float32)] * 2
    s = [np.zeros((2, 3), np.float32)] * 2
    with pytest.raises(exc, match=re.escape(match)):
        cuflash.merge_attention(*mutate(o, s))


# --------------------------------------------------------------------------------------------
# validation


def _valid(rng):
    q, kc, vc, lengths, kw = make_case(rng, [3, 7], 1, 2, 4, (4, 2), 64, np.float32, "neox", "plain")
    return dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lengths, **kw)


BAD = [
    (lambda a: dict(a, block_table=a["block_table"].astype(np.int64)), TypeError, "block_table must be int32"),
    (lambda a: dict(a, block_table=np.where(a["block_table"] == a["block_table"][1, 0], 99, a["block_table"])),
     ValueError, r"block_table\[1, 0\]=99 must be in \[0, "),
    (lambda a: dict(a, cache_seqlens=np.array([3, 100], np.int32)), ValueError, r"cache_seqlens\[1\]=100 plus Snew=2"),
    (lambda a: dict(a, cache_seqlens=np.array([3, -1], np.int32)), ValueError, r"cache_seqlens\[1\]=-1"),
    (lambda a: dict(a, cache_seqlens=np.array([3], np.int32)), ValueError, r"cache_seqlens.shape=\(1,\) must be \(2,\)"),
    (lambda a: dict(a, cache_seqlens=np.array([3, 7], np.int64)), TypeError, "cache_seqlens must be int32"),
    (lambda a: dict(a, rotary_cos=a["rotary_cos"][:, :-1]), ValueError, "rotary_sin.shape"),
    (lambda a: dict(a, rotary_cos=a["rotary_cos"][:4], rotary_sin=a["rotary_sin"][:4]), ValueError,
     r"rotary_cos.shape\[0\]=4 positions"),
    (lambda a: dict(a, rotary_cos=np.zeros((30, 40), np.float32), rotary_sin=np.zeros((30, 40), np.float32)),
     ValueError, "rotary_dim = 2 \\* rotary_cos.shape\\[1\\] = 80"),
    (lambda a: {k: v for k, v in a.items() if k not in ("k", "v")}, ValueError, "pass k and v too"),
    (lambda a: {k: v for k, v in a.items() if k != "v"}, ValueError, "got only k"),
    (lambda a: dict(a, k=a["k"][:, :, :1]), ValueError, r"k.shape=\(2, 2, 1, 64\) must be"),
    (lambda a: dict(a, cache_batch_idx=np.array([0, 1], np.int32)), ValueError, "with a block_table"),
    (lambda a: dict(a, cache_leftpad=np.array([0, 9], np.int32)), ValueError, r"cache_leftpad\[1\]=9 must be in"),
    (lambda a: dict(a, v_cache=a["v_cache"][:, :2]), ValueError, "v_cache.shape"),
    (lambda a: dict(a, k_cache=a["k_cache"].astype(np.float16)), TypeError, "k_cache.dtype=float16"),
    (lambda a: dict(a, num_splits=-1), ValueError, "num_splits must be in"),
    (lambda a: dict(a, num_splits=2.0), TypeError, "num_splits must be an int"),
    (lambda a: dict(a, q=a["q"][0]), ValueError, r"q.ndim must be 4 \(B, Sq, Hq, D\)"),
    (lambda a: dict(a, cache_seqlens=None), TypeError, "cache_seqlens must be an int"),
    (lambda a: dict(a, v_cache=a["k_cache"]), ValueError, "k_cache and v_cache share memory"),
    (lambda a: dict(a, k=a["k_cache"][:2, :1]), ValueError, "k overlaps k_cache in memory"),
    (lambda a: dict(a, rotary_cos=a["rotary_cos"].astype(np.float64), rotary_sin=a["rotary_sin"].astype(np.float64)),
     TypeError, "rotary_cos.dtype=float64 must be float32$"),
    (lambda a: dict(a, cache_seqlens=3.0), TypeError, "cache_seqlens must be an int or an int32 array"),
    (lambda a: dict(a, cache_seqlens=True), TypeError, "cache_seqlens must be an int or an int32 array .*got True"),
    # the kernels index it densely: a strided view would be misread on the GPU
    (lambda a: dict(a, block_table=np.repeat(a["block_table"], 2, axis=1)[:, ::2]), ValueError,
     "block_table must have unit stride on its last axis"),
]


@pytest.mark.parametrize("mutate,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_refused_before_any_write(mutate, exc, match, rng):
    a = mutate(_valid(rng))
    before = a["k_cache"].tobytes(), a["v_cache"].tobytes()
    with pytest.raises(exc, match=match):
        cuflash.attention_with_kvcache(**a)
    assert (a["k_cache"].tobytes(), a["v_cache"].tobytes()) == before


@pytest.mark.parametrize("backend", ["numpy", "sim"])
def test_more_sequences_than_cache_batches_is_refused(backend):
    """A contiguous cache serves sequence b from cache batch b: more sequences than cache batches
    (and no cache_batch_idx) is an error before anything is written, on every backend."""
    q = np.zeros((3, 1, 4, 64), dtypes.float16)
    kc = np.zeros((2, 16, 2, 64), dtypes.float16)
    vc, k = kc.copy(), np.ones((3, 1, 2, 64), dtypes.float16)
    with pytest.raises(ValueError, match=r"q.shape\[0\]=3 sequences but k_cache.shape\[0\]=2 cache batches"):
        cuflash.attention_with_kvcache(q, kc, vc, 3, k=k, v=k, backend=backend)
    assert not kc.any() and not vc.any()


def test_shape_messages_name_the_caches():
    q = np.zeros((2, 1, 4, 32), np.float32)
    kc = np.zeros((2, 16, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"k_cache.shape\[-1\]=64 must equal q.shape\[-1\]=32"):
        cuflash.attention_with_kvcache(q, kc, kc.copy(), 3)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1 must be >= 0"):
        cuflash.attention_with_kvcache(np.zeros((1, 1, 4, 64), np.float32), kc[:1], kc[:1].copy(),
                                       np.array([-1], np.int32))


def test_merge_attention_takes_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    o = [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)]
    s = [torch.zeros(2, 3), torch.zeros(2, 3)]
    out, lse = cuflash.merge_attention(o, s)
    assert isinstance(out, torch.Tensor) and torch.allclose(out, torch.full((2, 3, 4), 0.5))
    assert torch.allclose(lse, torch.full((2, 3), float(np.log(2))))


def test_contiguous_batch_idx_out_of_range(rng):
    q, kc, vc, lengths, kw = make_case(rng, [3, 7], 1, 0, None, (2, 2), 64, np.float32, "none", "batch_idx")
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\]=3 must be in \[0, 3\)"):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, cache_batch_idx=np.array([0, 3], np.int32))


def test_float32_has_no_kernel_and_says_why(rng):
    q, kc, vc, lengths, kw = make_case(rng, [3], 1, 0, 4, (2, 2), 64, np.float32, "none", "plain")
    with pytest.raises(NotImplementedError, match="tensor-core tier only.*float32"):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, backend="sim", **kw)


def test_torch_cpu_tensors_append_in_place(rng):
    torch = pytest.importorskip("torch")
    q, kc, vc, lengths, kw = make_case(rng, [3, 0], 2, 1, 3, (4, 2), 64, np.float32, "none", "plain")
    want_k, _ = expected_cache(kc, vc, lengths, kw, 3)
    t = {n: torch.from_numpy(x) for n, x in dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lengths, **kw).items()}
    out = cuflash.attention_with_kvcache(**t)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 2, 4, 64)
    assert t["k_cache"].numpy().tobytes() == want_k.tobytes()


# --------------------------------------------------------------------------------------------
# chunked prefill: attention_varlen over a paged cache

#: (query chunk, keys in the cache including the chunk) per sequence
CHUNKS = {"single": [(3, 10)], "mixed": [(5, 5), (0, 4), (17, 60)], "decode_mix": [(1, 33), (64, 64), (2, 130)]}
PREFILL_AXES = [list(CHUNKS), [1, 3, 16, 256], HEADS, list(MASKS), [40, 128, 256], ["all", "some"], list(DTYPES)]
PREFILL = [tuple(c) for c in AllPairs(PREFILL_AXES)]


def run_prefill(rng, chunks, page, heads, mask, d, used, dtype_key, *, checked=False):
    q, kc, vc, cq, ck, mq, mk, seqused, bt = make_prefill(rng, CHUNKS[chunks], page, heads, d, DTYPES[dtype_key], used)
    causal, window = MASKS[mask]
    for backend in ("numpy", "sim"):
        with cuflash.sim.options(checked=checked):
            out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, causal=causal, window_size=window,
                                                seqused_k=seqused, block_table=bt, return_lse=True, backend=backend)
        check_prefill(out, lse, q, kc, vc, cq, ck, seqused, bt, page, causal, window)


@pytest.mark.parametrize("case", default_share(PREFILL, ["-".join(map(str, c)) for c in PREFILL]))
def test_chunked_prefill_pairwise(case, rng):
    run_prefill(rng, *case)


@pytest.mark.checked
@pytest.mark.parametrize("case", PREFILL[::4], ids=["-".join(map(str, c)) for c in PREFILL[::4]])
def test_chunked_prefill_checked(case, rng):
    run_prefill(rng, *case, checked=True)


def test_chunked_prefill_refuses_pages_outside_the_cache(rng):
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, CHUNKS["mixed"], 16, (2, 2), 64, np.float32, "all")
    bad = bt.copy()
    bad[2, 1] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[2, 1\]=\d+ must be in \[0, "):
        cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, block_table=bad)
    with pytest.raises(ValueError, match="sequence 2 has 60 keys but its block_table row addresses 48"):
        cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, block_table=bt[:, :3])
    with pytest.raises(ValueError, match="k is a paged cache"):
        cuflash.attention_varlen(q, kc[:, 0], vc, cq, ck, mq, mk, block_table=bt)


def test_docstring_and_readme_examples_run():
    """The docstring's example (doctest) and the README's KV-cache example run as written."""
    import doctest
    from pathlib import Path

    import cuflash.api.kvcache

    assert doctest.testmod(cuflash.api.kvcache).failed == 0
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = "import numpy as np, cuflash\nk_cache" + text.split("```python\nimport numpy as np, cuflash\nk_cache")[1]
    scope: dict = {}
    exec(block.split("```")[0], scope)   # noqa: S102 - the README's own example
    assert scope["out"].shape == (2, 1, 8, 64) and np.isfinite(scope["out"]).all()
    assert (scope["k_cache"][scope["block_table"][1, 40 // 16], 40 % 16] == scope["k"][1, 0]).all()


#: the tensor-core tier's sm_75 (Turing) form of the KV-cache kernel: a share of the design in
#: float16 (slow: a simulator build per variant)
SM75_CASES = sorted({c[:-1] + ("f16",) for c in PAIRWISE[::4]})


@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_CASES, ids=["-".join(map(str, c)) for c in SM75_CASES])
def test_kvcache_sm75(case, rng):
    with cuflash.sim.options(arch="sm_75"):
        run_case(rng, *case)
