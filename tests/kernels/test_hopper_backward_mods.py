"""The Hopper backward's traced forms (``kernels_cu/attention_bwd_sm90.cu`` with CUFLASH_USER_MOD:
``score_mod`` / ``mask_mod``, the block-sparse walk of a block mask's transposed index, the
captured arrays' gradients) on the CUDA simulator, and the dispatcher's routes for them.

The default run checks the routes on the host only (no kernel compile): which calls the Hopper
backward takes on sm_90 and why the others go to the tensor-core backward. ``slow`` runs the
kernels: the examples of :mod:`cuflash.mods` and two invented functions against the float64 oracle
under the gradient rule of every tier (:func:`support.grads.assert_grads_within_twice_the_numpy_path`),
block masks against the dense mask_mod with the tiles the kernel entered counted, the captured
arrays' gradients against finite differences of the float64 forward, checked mode, and
deterministic mode's bits across simulator thread counts and thread orders.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support.grads import assert_grads_within_twice_the_numpy_path, grad_floor, make_qkv
from support.score_mod_cases import ready_made

import cuflash
from cuflash import mods, sim
from cuflash.kernels import attention_bwd_mma, attention_bwd_sm90, dispatch
from cuflash.kernels import launch_args as la
from cuflash.reference import backward as ref_backward
from cuflash.runtime import dtypes
from cuflash.runtime.options import ModifierOptions, Options

HOPPER = "sm_90: backward on the Hopper wgmma tier, cuflash_attn_bwd_sm90_main_"
MMA = "sm_90: backward on the tensor-core mma.sync tier, cuflash_attn_bwd_mma_main_"


def _capped(slopes):
    def score_fn(score, b, h, q_idx, kv_idx):
        return 12.0 * mods.tanh(score / 12.0) - slopes[h] * abs(q_idx - kv_idx)

    return score_fn


def _problem(d=64, sq=9, sk=5, dtype=dtypes.float16, mod_kw=None, **opts):
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 1, 2, 1, sq, sk, d, d, dtype=dtype)
    out = np.zeros(q.shape, dtype)
    lse = np.zeros(q.shape[:-1], np.float32)
    return ref_backward.check_backward(out, q, k, v, out, lse, Options(modifiers=ModifierOptions(**(mod_kw or {})),
                                                                       **opts), func="test", max_head_dim=256)


# ----------------------------------------------------------------------------- default: host only


def test_the_hopper_backward_takes_traced_calls_at_its_head_dims():
    slopes = np.full(2, 0.25, np.float32)
    doc = np.repeat(np.arange(3, dtype=np.int32), (100, 100, 56))
    q = np.zeros((1, 2, 256, 64), np.float16)
    kw = dict(score_mod=_capped(slopes), mask_mod=mods.document_mask(doc, causal=True))
    line = cuflash.explain(q, q, q, arch=90, **kw)["backward"]
    assert line.startswith(HOPPER + "f16_d64_um") and not line.endswith("_bs"), line
    qd = np.zeros((1, 2, 256, 96), dtypes.bfloat16)
    assert cuflash.explain(qd, qd, qd, arch=90, **kw)["backward"].startswith(HOPPER + "bf16_d96_um")
    qe = np.zeros((1, 2, 256, 128), dtypes.bfloat16)
    assert cuflash.explain(qe, qe, qe, arch=90, **kw)["backward"].startswith(HOPPER + "bf16_d128_um")
    # the same texts, the same variant name as the traced forms of other tiers (a hash of the texts)
    p = _problem(64, mod_kw=kw)
    v = attention_bwd_sm90.main_variant(p)
    assert v.name == "main_f16_d64" + attention_bwd_mma.main_variant(p, 90)._user_suffix()
    assert attention_bwd_sm90.Sm90BackwardVariant("f16", 64).name == "main_f16_d64"   # the plain form's, unchanged
    # a block mask of 128-key blocks: the block-sparse form
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=(64, 128))
    assert cuflash.explain(q, q, q, arch=90, block_mask=bm)["backward"].startswith(HOPPER + "f16_d64_um")
    assert cuflash.explain(q, q, q, arch=90, block_mask=bm)["backward"].endswith("_bs")
    # captured-array gradients: the form with the atomics
    pg = _problem(64, mod_kw=dict(score_mod=_capped(slopes)), return_dscore_mod=True)
    assert dispatch.backward_tier(pg, 90) is attention_bwd_sm90
    assert "captured-array gradients (atomics)" in dispatch.describe_backward_choice(pg, 90)
    # deterministic mode with a traced score_mod / mask_mod: the ordered dQ adds, unchanged
    assert dispatch.backward_tier(_problem(64, mod_kw=kw, deterministic=True), 90) is attention_bwd_sm90


@pytest.mark.parametrize("case,words", [
    ("block64", "block_mask with key blocks of 64: the Hopper backward's key tile is 128 keys"),
    ("block_det", "block_mask with deterministic=True is not in the Hopper backward"),
    ("softcap", "softcap is not in the Hopper backward yet"),
    ("d192", "(D, Dv) = (192, 192)"),
])
def test_the_calls_it_does_not_take_run_on_the_tensor_cores_and_say_why(case, words):
    doc = np.repeat(np.arange(2, dtype=np.int32), (5, 4))
    kw, opts, d = dict(mask_mod=mods.document_mask(doc)), {}, 64
    if case == "block64":
        kw = dict(block_mask=mods.document_block_mask(doc, BLOCK_SIZE=64))
    elif case == "block_det":
        kw, opts = dict(block_mask=mods.document_block_mask(doc, BLOCK_SIZE=128)), dict(deterministic=True)
    elif case == "softcap":
        kw = dict(kw, softcap=20.0)
    elif case == "d192":
        d = 192
    p = _problem(d, sk=9, mod_kw=kw, **opts)
    why = attention_bwd_sm90.unsupported_reason(p, 90)
    assert why is not None and words in why, why
    line = dispatch.describe_backward_choice(p, 90)
    assert line.startswith("sm_90: tensor-core mma.sync tier") and "Hopper wgmma tier not used: " + words in line


def test_array_gradients_with_deterministic_mode_go_to_the_tensor_core_exact_form():
    """The Hopper form adds captured-array gradients with float atomics, so deterministic mode passes
    the call, by name, to the tensor-core backward, whose exact-sum form gives the same bits."""
    p = _problem(64, mod_kw=dict(score_mod=_capped(np.ones(2, np.float32))), return_dscore_mod=True,
                 deterministic=True)
    why = attention_bwd_sm90.unsupported_reason(p, 90)
    assert why.startswith("return_dscore_mod with deterministic=True is not in the Hopper backward"), why
    assert dispatch.backward_tier(p, 90) is attention_bwd_mma
    assert attention_bwd_mma.main_variant(p, 90).agrad_exact
    line = dispatch.describe_backward_choice(p, 90)
    assert "tensor-core" in line and "return_dscore_mod with deterministic=True" in line, line


def test_a_traced_form_is_fixed_shape_only():
    with pytest.raises(ValueError, match="fixed shapes only"):
        attention_bwd_sm90.Sm90BackwardVariant("f16", 64, varlen=True, mask_c="((bool)(1))")
    with pytest.raises(ValueError, match="block-sparse form has a traced mask_mod"):
        attention_bwd_sm90.Sm90BackwardVariant("f16", 64, block_sparse=True)


# -------------------------------------------------------------------------------------- slow


def _backward(rng, q, k, v, dtype, arch=90, checked=False, seed=0, workers=None, **kw):
    """The NumPy path's forward, then the backward on the simulator at ``arch``."""
    fwd = {n: x for n, x in kw.items() if n not in ("return_dscore_mod", "deterministic")}
    out, lse = cuflash.attention(q, k, v, return_lse=True, **fwd)
    dout = rng.standard_normal(out.shape).astype(dtype)
    opts = dict(arch=arch, checked=checked, seed=seed) | ({"workers": workers} if workers else {})
    with sim.options(**opts):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    return grads, dout


def _invented(table, keep):
    """Integer division and modulo, where, log, maximum, a (B, Hq) table read by b and h, a bool
    array read by kv_idx."""
    def score_fn(score, b, h, q_idx, kv_idx):
        far = score - table[b, h] * mods.log(1.0 + abs(kv_idx - q_idx))
        return mods.where(q_idx % 3 == 0, far, mods.maximum(score, -1.5))

    def mask_fn(b, h, q_idx, kv_idx):
        return keep[kv_idx] | (q_idx // 16 == kv_idx // 16)

    return score_fn, mask_fn


def _invented_2(rng):
    """A second invented pair: a min/exp bias by distance bucket and a strided mask of q and k."""
    bucket = rng.uniform(-1.0, 1.0, 8).astype(np.float32)

    def score_fn(score, b, h, q_idx, kv_idx):
        return mods.minimum(score, 4.0) + bucket[abs(q_idx - kv_idx) % 8] * mods.exp(-0.1 * h)

    def mask_fn(b, h, q_idx, kv_idx):
        return ((q_idx + kv_idx) % 7 != 3) | (q_idx == kv_idx)

    return score_fn, mask_fn


def _example(name, rng, b, hq, s):
    if name == "invented":
        return _invented(rng.uniform(-1.5, 1.5, (b, hq)).astype(np.float32), rng.random(s) > 0.3)
    if name == "invented_2":
        return _invented_2(rng)
    return ready_made(name, rng, s, b, hq)


#: (function, dtype, head dim, Sq = Sk, Hq/Hk, causal, window): each function once (a variant each)
GRID = [("alibi", "f16", 64, 150, (2, 1), True, (-1, -1)),
        ("alibi_per_batch", "bf16", 96, 130, (4, 2), False, (-1, -1)),
        ("softcap", "bf16", 96, 200, (2, 2), False, (40, 7)),
        ("relative_position_bias", "f16", 96, 140, (2, 1), True, (-1, -1)),
        ("document_mask", "bf16", 64, 190, (4, 2), False, (-1, -1)),
        ("prefix_lm", "f16", 96, 150, (2, 1), False, (-1, -1)),
        ("sliding_window", "f16", 64, 200, (2, 1), False, (-1, -1)),
        ("invented", "bf16", 96, 150, (4, 2), True, (-1, -1)),
        ("invented_2", "f16", 64, 170, (2, 1), False, (60, -1))]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_gradients_with_traced_functions(rng, case):
    name, dt, d, s, (hq, hk), causal, window = case
    dtype = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}[dt]
    b = 2 if name in ("alibi_per_batch", "prefix_lm", "invented") else 1
    sq = s - 23 if causal else s   # causal with Sq < Sk: bottom-right
    q, k, v = make_qkv(rng, b, hq, hk, sq, s, d, d, dtype=dtype)
    score_fn, mask_fn = _example(name, rng, b, hq, s)
    kw = dict(score_mod=score_fn, mask_mod=mask_fn, causal=causal, window_size=window)
    line = cuflash.explain(q, k, v, arch=90, **kw)["backward"]
    assert line.startswith(HOPPER + f"{dt}_d{d}_um"), line
    grads, dout = _backward(rng, q, k, v, dtype, **kw)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["um", "bs", "ag"])
def test_head_dim_128_forms(rng, form):
    """Head dim 128, whose traced forms roll their per-pair loop (four pairs a pass, the accumulators
    rotated) and recompute what they would hold: an invented score_mod / mask_mod pair (causal, Sq <
    Sk, GQA: the diagonal, the steady and the Sq-edge tiles), a causal document block mask of
    64 x 128 blocks (the block-sparse form, its producer at 32 registers) and captured-array
    gradients (atomics), each under the gradient rule against the float64 oracle; the first two in
    checked mode (races, bounds, proxies)."""
    if form == "um":
        dtype, hq, hk, sq, sk = dtypes.bfloat16, 4, 2, 147, 170
        score_fn, mask_fn = _invented(rng.uniform(-1.5, 1.5, (1, hq)).astype(np.float32), rng.random(sk) > 0.3)
        kw = dict(score_mod=score_fn, mask_mod=mask_fn, causal=True)
        check = kw
    elif form == "bs":
        doc = np.repeat(np.arange(3, dtype=np.int32), (100, 156, 128))
        dtype, hq, hk, sq = dtypes.float16, 4, 2, len(doc)
        sk = sq
        bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=(64, 128))
        kw, check = dict(block_mask=bm), dict(mask_mod=bm.mask_mod)
    else:
        dtype, hq, hk, sq, sk = dtypes.float16, 2, 1, 100, 170
        slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
        table = rng.standard_normal((hq, 2 * RADIUS + 1)).astype(np.float32)
        kw = dict(score_mod=_slopes_and_table(slopes, table), causal=True)
        check = kw
    q, k, v = make_qkv(rng, 1, hq, hk, sq, sk, 128, 128, dtype=dtype)
    line = cuflash.explain(q, k, v, arch=90, **kw)["backward"]
    assert line.startswith(HOPPER) and "_d128_um" in line and line.endswith("_bs") == (form == "bs"), line
    extra = dict(return_dscore_mod=True) if form == "ag" else {}
    grads, dout = _backward(rng, q, k, v, dtype, checked=form != "ag", **kw, **extra)
    if form == "ag":
        assert sorted(grads[-1]) == ["slopes", "table"]
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **check)


#: 8 packed documents, S = 768 (the tensor-core backward's block-sparse test's)
LENGTHS = (128, 64, 96, 160, 64, 96, 64, 96)


@pytest.mark.slow
def test_a_document_block_mask_walks_the_transposed_index_and_matches_the_dense_mask(rng):
    """8 packed documents, a causal document block mask of 64-row by 128-key blocks: each block
    (key tile, kv head) enters exactly the query tiles its key block's transposed lists name for
    its group's 2 heads (partial and full counted apart), and the gradients equal the dense
    mask_mod's under the gradient rule; the tensor-core backward's count on the same mask beside it."""
    doc = np.repeat(np.arange(8, dtype=np.int32), LENGTHS)
    s, hq, hk, d = len(doc), 4, 2, 64
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=(64, 128))
    codes = bm.to_dense()[0, 0]   # (12 query blocks, 6 key blocks): 0 empty, 1 partial, 2 full
    q, k, v = make_qkv(rng, 1, hq, hk, s, s, d, d, dtype=dtypes.float16)
    assert cuflash.explain(q, k, v, arch=90, block_mask=bm)["backward"].endswith("_bs")
    with la.counting_tiles() as counts:
        grads, dout = _backward(rng, q, k, v, dtypes.float16, block_mask=bm)
    got = counts[0].reshape(hk, 6, 2)   # grid (6 key tiles, Hk, 1)
    np.testing.assert_array_equal(got[..., 0], np.broadcast_to(2 * (codes == 1).sum(0), (hk, 6)))
    np.testing.assert_array_equal(got[..., 1], np.broadcast_to(2 * (codes == 2).sum(0), (hk, 6)))
    assert int(got.sum()) == hk * 2 * int((codes > 0).sum()) == 60 and 60 < 288 // 4   # dense: 288 tiles
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtypes.float16, mask_mod=bm.mask_mod)
    # the tensor-core backward on the same block mask: 64 x 64 tiles, each 128-key block twice
    out, lse = cuflash.attention(q, k, v, return_lse=True, block_mask=bm)
    with sim.options(arch=80), la.counting_tiles() as counts_mma:
        cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", block_mask=bm)
    assert int(counts_mma[0].sum()) == 2 * int(got.sum())


@pytest.mark.slow
def test_full_blocks_skip_mask_mod_and_the_causal_mask_applies_on_top(rng):
    """Blocks of 128 x 128 over documents of 100-256 rows, causal on top, GQA, bf16 d96: full tiles
    and partial ones both entered; a block mask that calls every block full but carries the
    document mask as its mask_mod (the same variant) gives the unmasked gradients."""
    doc = np.repeat(np.arange(3, dtype=np.int32), (256, 100, 228))
    s, hq, hk, d, dtype = len(doc), 4, 2, 96, dtypes.bfloat16
    bm = mods.document_block_mask(doc, BLOCK_SIZE=128)
    q, k, v = make_qkv(rng, 1, hq, hk, s, s, d, d, dtype=dtype)
    with la.counting_tiles() as counts:
        grads, dout = _backward(rng, q, k, v, dtype, block_mask=bm, causal=True)
    entered = counts[0].reshape(-1, 2).sum(0)
    assert entered[0] > 0 and entered[1] > 0, entered
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, mask_mod=bm.mask_mod, causal=True)
    every = cuflash.create_block_mask(lambda b, h, i, j: j >= 0, None, None, s, s, BLOCK_SIZE=128)
    forged = dataclasses.replace(every, mask_mod=bm.mask_mod)
    grads, dout = _backward(rng, q, k, v, dtype, block_mask=forged, causal=True)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, causal=True)


RADIUS = 6


def _slopes_and_table(slopes, table, cap=8.0):
    def score_fn(score, b, h, q_idx, kv_idx):
        rel = mods.minimum(mods.maximum(kv_idx - q_idx, -RADIUS), RADIUS) + RADIUS
        return cap * mods.tanh((score - slopes[h] * abs(q_idx - kv_idx)) / cap) + table[h, rel]

    return score_fn


@pytest.mark.slow
def test_captured_array_gradients_match_finite_differences(rng):
    """return_dscore_mod on the Hopper form (atomics, the per-head slopes summed per warp): the
    slopes' and the table's gradients against central differences of the float64 forward's
    sum(out * dout), within twice the same-dtype NumPy path's distance from them plus the floor;
    dq, dk, dv and the arrays under the gradient rule against the float64 oracle; new values of
    the arrays run the same module."""
    from cuflash.sim import launcher

    dtype, hq, sq, sk = dtypes.float16, 2, 100, 170
    q, k, v = make_qkv(rng, 1, hq, 1, sq, sk, 64, 64, dtype=dtype)
    slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
    table = rng.standard_normal((hq, 2 * RADIUS + 1)).astype(np.float32)
    kw = dict(score_mod=_slopes_and_table(slopes, table), causal=True)
    assert "_um" in cuflash.explain(q, k, v, arch=90, **kw)["backward"]
    grads, dout = _backward(rng, q, k, v, dtype, return_dscore_mod=True, **kw)
    assert sorted(grads[-1]) == ["slopes", "table"]
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **kw)

    f64 = [x.astype(np.float64) for x in (q, k, v, dout)]

    def loss(sl, tb):
        out = cuflash.attention(*f64[:3], score_mod=_slopes_and_table(sl, tb), causal=True)
        return float(np.sum(out * f64[3]))

    h = 1e-4
    same = cuflash.attention_backward(dout, q, k, v, *cuflash.attention(q, k, v, return_lse=True, **kw),
                                      return_dscore_mod=True, **kw)[-1]
    for name, arr in (("slopes", slopes.astype(np.float64)), ("table", table.astype(np.float64))):
        fd = np.zeros(arr.shape)
        for idx in np.ndindex(arr.shape):
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += h
            minus[idx] -= h
            args = {"slopes": (plus, table.astype(np.float64)), "table": (slopes.astype(np.float64), plus)}[name]
            args_m = {"slopes": (minus, table.astype(np.float64)), "table": (slopes.astype(np.float64), minus)}[name]
            fd[idx] = (loss(*args) - loss(*args_m)) / (2 * h)
        base = float(np.abs(same[name].astype(np.float64) - fd).max())
        err = np.abs(grads[-1][name].astype(np.float64) - fd)
        assert (err <= 2 * base + grad_floor(fd, dtype) + 1e-4).all(), (name, err.max(), base)

    loaded = len(launcher._modules)   # new values of the arrays: the same compiled module
    kw2 = dict(kw, score_mod=_slopes_and_table(slopes[::-1] * 1.5, table * 0.5))
    grads2, dout2 = _backward(rng, q, k, v, dtype, return_dscore_mod=True, **kw2)
    assert len(launcher._modules) == loaded
    assert_grads_within_twice_the_numpy_path(grads2, q, k, v, dout2, dtype, **kw2)


@pytest.mark.slow
@pytest.mark.checked
def test_checked_mode_is_clean(rng):
    """Checked mode (races, bounds, proxies, TMA and bulk reduce-adds in flight, uninitialized
    reads) on the dense form with score_mod and mask_mod (rows that see no key; Sq > Sk, causal)
    and on the block-sparse form."""
    dtype = dtypes.float16
    q, k, v = make_qkv(rng, 1, 2, 1, 150, 130, 64, 64, dtype=dtype)
    doc_k = np.sort(rng.integers(0, 3, 130)).astype(np.int32)
    doc_q = np.concatenate([np.full(20, 7, np.int32), doc_k])   # 20 rows in no key's document
    kw = dict(score_mod=_capped(rng.uniform(0.05, 0.5, 2).astype(np.float32)),
              mask_mod=lambda b, h, i, j: doc_q[i] == doc_k[j], causal=True)
    grads, dout = _backward(rng, q, k, v, dtype, checked=True, **kw)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **kw)
    doc = np.repeat(np.arange(3, dtype=np.int32), (70, 64, 58))
    bm = mods.document_block_mask(doc, BLOCK_SIZE=(64, 128))
    q, k, v = make_qkv(rng, 1, 2, 1, 192, 192, 64, 64, dtype=dtype)
    with la.counting_tiles():
        grads, dout = _backward(rng, q, k, v, dtype, checked=True, block_mask=bm)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, mask_mod=bm.mask_mod)


@pytest.mark.slow
@pytest.mark.checked
def test_deterministic_mode_gives_the_same_bits_across_thread_counts_and_orders(rng):
    """deterministic=True with a score_mod and a mask_mod: 3 key tiles add to each query tile in
    key-tile order, so dq (and dk, dv) are the same bits on 1 and 3 simulator threads and under
    two thread-order seeds (checked mode also watches the ordered adds)."""
    dtype = dtypes.bfloat16
    q, k, v = make_qkv(rng, 1, 4, 2, 130, 300, 64, 64, dtype=dtype)
    kw = dict(score_mod=_capped(rng.uniform(0.05, 0.5, 4).astype(np.float32)),
              mask_mod=mods.sliding_window(200, 20), deterministic=True)
    runs = []
    for workers, seed in ((1, 0), (3, 0), (3, 5)):
        grads, dout = _backward(np.random.default_rng(1), q, k, v, dtype, workers=workers, seed=seed,
                                checked=workers == 3 and seed == 5, **kw)
        runs.append([np.asarray(g).view(np.uint16) for g in grads])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    fwd = {n: x for n, x in kw.items() if n != "deterministic"}
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **fwd)
