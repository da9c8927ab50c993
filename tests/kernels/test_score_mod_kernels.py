"""Traced ``score_mod`` / ``mask_mod`` in the tensor-core forward (kernels_cu/score_mods.cuh:
CUFLASH_USER_MOD, the ``mods`` forms of attention_fwd_mma.cu) on the CUDA simulator, held to the
project's tolerance rule against the float64 oracle with the same functions
(:func:`cuflash.reference.tolerance.compare`); new values of the captured arrays run the same
compiled variant. The default run compiles one variant; the others run under ``slow``."""

from __future__ import annotations

import numpy as np
import pytest

from support import score_mod_cases
from support.grads import assert_grads_within_twice_the_numpy_path

import cuflash
from cuflash import mods, sim
from cuflash.reference import tolerance
from cuflash.runtime import dtypes, score_mod
from cuflash.sim import launcher

B, HQ, HK, SQ, SK, D = 2, 4, 2, 37, 70, 64


def _qkv(rng, dtype, sq=SQ, sk=SK):
    return (rng.standard_normal((B, HQ, sq, D)).astype(dtype), rng.standard_normal((B, HK, sk, D)).astype(dtype),
            rng.standard_normal((B, HK, sk, D)).astype(dtype))


def _capped_alibi_documents(slopes, doc_q, doc_k):
    """A softcap and ALiBi (bottom-right) as one score_mod, a document mask over q's and k's own
    document ids as the mask_mod: three captured arrays (float32, int32, int32)."""
    off = SK - SQ

    def score_fn(score, b, h, q_idx, kv_idx):
        return 12.0 * mods.tanh(score / 12.0) - slopes[h] * abs(q_idx + off - kv_idx)

    def mask_fn(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_k[kv_idx]

    return score_fn, mask_fn


def _documents(rng):
    doc_k = np.sort(rng.integers(0, 4, SK)).astype(np.int32)
    doc_q = doc_k[SK - SQ:].copy()
    doc_q[5] = 9   # a query row in no key's document: 0 and lse -inf
    return doc_q, doc_k


def _run(q, k, v, **kw):
    with sim.options(arch=80):
        return cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)


def test_score_and_mask_mod_on_the_simulator_and_new_values_reuse_the_variant(rng):
    q, k, v = _qkv(rng, dtypes.float16)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    doc_q, doc_k = _documents(rng)
    score_fn, mask_fn = _capped_alibi_documents(slopes, doc_q, doc_k)
    plan = cuflash.explain(q, k, v, backend="sim", arch=80, score_mod=score_fn, mask_mod=mask_fn)
    assert plan["tier"] == "attention_fwd_mma" and "_mods_um" in plan["variant"], plan
    out, lse = _run(q, k, v, score_mod=score_fn, mask_mod=mask_fn)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn)
    assert ok, msg
    assert np.isneginf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()

    # new values of the same arrays' kinds: the same variant, no new module
    slopes2 = (slopes[::-1] * 1.7).astype(np.float32)
    doc_q2, doc_k2 = _documents(np.random.default_rng(11))
    score2, mask2 = _capped_alibi_documents(slopes2, doc_q2, doc_k2)
    assert cuflash.explain(q, k, v, backend="sim", arch=80, score_mod=score2, mask_mod=mask2)["variant"] == \
        plan["variant"]
    loaded = len(launcher._modules)
    out2, lse2 = _run(q, k, v, score_mod=score2, mask_mod=mask2)
    assert len(launcher._modules) == loaded
    ok, msg, _ = tolerance.compare(out2, q, k, v, lse=lse2, score_mod=score2, mask_mod=mask2)
    assert ok, msg
    assert not np.allclose(out2.astype(np.float32), out.astype(np.float32))


def test_the_kernel_tier_refuses_what_it_cannot_read(rng):
    q, k, v = _qkv(rng, dtypes.float16)
    wide = np.ones(HQ, np.float64)   # float64: the NumPy path reads it, the kernels do not
    with pytest.raises(NotImplementedError, match=r"captured array 'wide' is float64"):
        cuflash.explain(q, k, v, backend="sim", arch=80, score_mod=lambda s, b, h, i, j: s * wide[h])
    arrays = [np.ones(HQ, np.float32) for _ in range(5)]
    a0, a1, a2, a3, a4 = arrays
    with pytest.raises(NotImplementedError, match=r"score_mod with 5 captured arrays"):
        cuflash.explain(q, k, v, backend="sim", arch=80,
                        score_mod=lambda s, b, h, i, j: s + a0[h] + a1[h] + a2[h] + a3[h] + a4[h])
    bias = np.zeros((SQ, SK), np.float32)
    with pytest.raises(NotImplementedError, match=r"return_dbias with score_mod is not in the tensor-core backward"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros(q.shape[:-1], np.float32), backend="sim",
                                   score_mod=mods.softcap(2.0), attn_bias=bias, return_dbias=True)


def _emitted(fn, role="score_mod"):
    return score_mod.emit_c(score_mod.trace(fn, role))


def test_emitted_c_reads_arrays_by_slot_and_keeps_python_semantics():
    t = np.zeros((2, 3), np.float32)
    c = _emitted(lambda s, b, h, i, j: mods.where(i // 3 >= j % 2, s / 2, mods.minimum(s, t[h, j])))
    assert "cuflash_floordiv_ll(((long long)(q_idx)), 3LL)" in c and "cuflash_mod_ll(((long long)(kv_idx)), 2LL)" in c
    assert "static_cast<const float*>(A.p[0])[((long long)(h)) * A.s[0][0] + ((long long)(kv_idx)) * A.s[0][1]]" in c
    assert "cuflash_min_f(" in c and c.startswith("((float)")
    m = score_mod.emit_c(score_mod.trace(mods.document_mask(np.zeros(4, np.int32)), "mask_mod"), 2)
    assert "A.p[2]" in m and "A.p[0]" not in m and m.startswith("((bool)")
    assert _emitted(lambda s, b, h, i, j: mods.where(i > j, s, float("-inf"))).count("CUFLASH_NEG_INF") == 1


# ------------------------------------------------------------------------------------------ slow


_invented = score_mod_cases.invented


@pytest.mark.slow
@pytest.mark.parametrize("dtype_key,causal", [("bf16", True), ("f16", False)])
def test_invented_mods_on_the_simulator(rng, dtype_key, causal):
    dtype = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}[dtype_key]
    q, k, v = _qkv(rng, dtype, 70, 45)   # Sq > Sk: with causal, rows that see no key
    table = rng.uniform(-1.5, 1.5, (B, HQ)).astype(np.float32)
    keep = rng.random(45) > 0.3
    score_fn, mask_fn = _invented(table, keep)
    out, lse = _run(q, k, v, score_mod=score_fn, mask_mod=mask_fn, causal=causal)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn, causal=causal)
    assert ok, msg


@pytest.mark.slow
def test_checked_mode_is_clean_with_a_score_mod(rng):
    q, k, v = _qkv(rng, dtypes.bfloat16)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    doc_q, doc_k = _documents(rng)
    score_fn, mask_fn = _capped_alibi_documents(slopes, doc_q, doc_k)
    with sim.options(arch=80, checked=True):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", score_mod=score_fn, mask_mod=mask_fn)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn)
    assert ok, msg


@pytest.mark.slow
def test_backward_with_score_and_mask_mod_on_the_simulator(rng):
    """The tensor-core backward with the score_mod's derivative (CUFLASH_SCORE_MOD_GRAD) and the
    mask_mod: dq, dk, dv within twice the error of the same-dtype NumPy path plus the floor."""
    dtype = dtypes.float16
    q, k, v = _qkv(rng, dtype)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    doc_q, doc_k = _documents(rng)
    score_fn, mask_fn = _capped_alibi_documents(slopes, doc_q, doc_k)
    kw = dict(score_mod=score_fn, mask_mod=mask_fn)
    out, lse = _run(q, k, v, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    with sim.options(arch=80):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **kw)
    assert np.abs(np.asarray(grads[0], np.float64)[:, :, 5]).max() == 0   # the row with no key


def _example(name, rng):
    """The ready-made mods of cuflash.mods as (score_mod, mask_mod) for Sq = Sk = SK."""
    return score_mod_cases.ready_made(name, rng, SK, B, HQ)


@pytest.mark.slow
@pytest.mark.parametrize("name", score_mod_cases.READY_MADE)
def test_ready_made_mods_on_the_simulator(name, rng):
    q, k, v = _qkv(rng, dtypes.bfloat16, SK, SK)
    score_fn, mask_fn = _example(name, rng)
    out, lse = _run(q, k, v, score_mod=score_fn, mask_mod=mask_fn)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn)
    assert ok, msg


@pytest.mark.slow
def test_checked_mode_is_clean_in_the_backward(rng):
    q, k, v = _qkv(rng, dtypes.float16)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    doc_q, doc_k = _documents(rng)
    score_fn, mask_fn = _capped_alibi_documents(slopes, doc_q, doc_k)
    out, lse = _run(q, k, v, score_mod=score_fn, mask_mod=mask_fn)
    dout = rng.standard_normal(out.shape).astype(dtypes.float16)
    with sim.options(arch=80, checked=True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", score_mod=score_fn,
                                           mask_mod=mask_fn)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])   # (one variant each)
def test_score_and_mask_mod_at_head_dim_192_on_the_simulator(rng, causal):
    # The traced form at head dim 192 rolls its modifier loop over the 8-key blocks (rotating them)
    # and S's k-steps (attention_fwd_mma.cu: FWD_ROLL_MODS, FWD_UNROLL_S_K). The simulator ignores
    # unroll hints, but runs the rotation as written: a block modified at the wrong key, or left out
    # of place, fails here. Sk = 70: a full and a partial 64-key tile; Sq = 37: rows past the sequence.
    d = 192
    q = rng.standard_normal((B, HQ, SQ, d)).astype(dtypes.float16)
    k = rng.standard_normal((B, HK, SK, d)).astype(dtypes.float16)
    v = rng.standard_normal((B, HK, SK, d)).astype(dtypes.float16)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    doc_q, doc_k = _documents(rng)
    score_fn, mask_fn = _capped_alibi_documents(slopes, doc_q, doc_k)
    plan = cuflash.explain(q, k, v, backend="sim", arch=80, score_mod=score_fn, mask_mod=mask_fn, causal=causal)
    assert plan["tier"] == "attention_fwd_mma" and "_mods_um" in plan["variant"] and "192" in plan["variant"], plan
    out, lse = _run(q, k, v, score_mod=score_fn, mask_mod=mask_fn, causal=causal)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, score_mod=score_fn, mask_mod=mask_fn, causal=causal)
    assert ok, msg
    assert np.isneginf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()
