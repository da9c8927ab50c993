"""``score_mod`` / ``mask_mod`` on the NumPy path and in the float64 oracle: the ready-made mods
of cuflash.mods equal the built-in modifiers they mirror, two invented mods equal a float64
formula written out by hand, the backward matches finite differences, and the refusals of a
call (kind, index range, kernel backends) are named."""

from __future__ import annotations

import numpy as np
import pytest
from support.grads import finite_difference_grads, make_qkv, randn

import cuflash
from cuflash import mods
from cuflash import reference as ref
from cuflash.reference.backward import attention_backward, flash_attention_backward

B, HQ, HK, SQ, SK, D = 2, 4, 2, 7, 9, 8


def _qkv(rng, sq=SQ, sk=SK, dtype=np.float64):
    return make_qkv(rng, B, HQ, HK, sq, sk, D, D, dtype=dtype)


def _all_paths(q, k, v, **kw):
    """(oracle out, oracle lse), and the NumPy path's (out, lse) with small tiles."""
    o, l = ref.naive_attention(q, k, v, return_lse=True, **kw)
    t, tl = ref.flash_attention(q, k, v, return_lse=True, block_m=3, block_n=4, **kw)
    return (o, l), (t, tl)


def _same(a, b, tol=1e-13):
    for x, y in zip(a, b):
        assert np.array_equal(np.isneginf(x), np.isneginf(y))
        fin = np.isfinite(y)
        np.testing.assert_allclose(x[fin], y[fin], rtol=tol, atol=tol)


def _grads(q, k, v, dout, **kw):
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
    naive = attention_backward(dout, q, k, v, out, lse, **kw)
    tiled = flash_attention_backward(dout, q, k, v, out, lse, block_m=3, block_n=4, **kw)
    return naive, tiled


# ------------------------------------------------------------------------------------------ = the built-ins

BUILTIN_CASES = {
    "softcap": (lambda rng: dict(score_mod=mods.softcap(2.5)), lambda rng: dict(softcap=2.5)),
    "alibi": (lambda rng: dict(score_mod=mods.alibi(_slopes(rng), SQ, SK)),
              lambda rng: dict(alibi_slopes=_slopes(rng))),
    "alibi_per_batch": (lambda rng: dict(score_mod=mods.alibi(_slopes(rng, (B, HQ)), SQ, SK)),
                        lambda rng: dict(alibi_slopes=_slopes(rng, (B, HQ)))),
    "sliding_window": (lambda rng: dict(mask_mod=mods.sliding_window(3, 1, SQ, SK)),
                       lambda rng: dict(window_size=(3, 1))),
    "causal_window": (lambda rng: dict(mask_mod=mods.sliding_window(2, 0, SQ, SK)),
                      lambda rng: dict(causal=True, window_size=(2, -1))),
    "relative_position_bias": (lambda rng: dict(score_mod=mods.relative_position_bias(_table(rng), 3)),
                               lambda rng: dict(attn_bias=_rel_bias(_table(rng), 3))),
    "document_mask": (lambda rng: dict(mask_mod=mods.document_mask(_docs(), causal=True)),
                      lambda rng: dict(attn_mask=_doc_mask(_docs(), True))),
    "prefix_lm": (lambda rng: dict(mask_mod=mods.prefix_lm(3)),
                  lambda rng: dict(attn_mask=np.tril(np.ones((SQ, SQ), bool)) | (np.arange(SQ) < 3))),
    "prefix_lm_per_batch": (lambda rng: dict(mask_mod=mods.prefix_lm(np.array([2, 5], np.int32))),
                            lambda rng: dict(attn_mask=np.tril(np.ones((SQ, SQ), bool))
                                             | (np.arange(SQ) < np.array([2, 5])[:, None, None, None]))),
}


def _slopes(rng, shape=(HQ,)):
    return np.random.default_rng(7).uniform(0.05, 0.6, shape)


def _table(rng):
    return np.random.default_rng(8).standard_normal((HQ, 7))


def _rel_bias(table, m):
    dist = np.clip(np.arange(SK)[None, :] - np.arange(SQ)[:, None], -m, m) + m
    return table[:, dist]   # (Hq, Sq, Sk)


def _docs():
    return np.array([0, 0, 0, 1, 1, 2, 2, 2, 2], np.int64)[:SQ]


def _doc_mask(doc, causal):
    m = doc[:, None] == doc[None, :]
    return m & np.tril(np.ones_like(m)) if causal else m


@pytest.mark.parametrize("name", list(BUILTIN_CASES))
def test_ready_made_mods_equal_the_builtins(name, rng):
    mod_kw, builtin_kw = (f(rng) for f in BUILTIN_CASES[name])
    sq = sk = SQ if name in ("document_mask", "prefix_lm", "prefix_lm_per_batch") else None
    q, k, v = _qkv(rng) if sq is None else _qkv(rng, sq, sk)
    (o1, l1), (t1, tl1) = _all_paths(q, k, v, **mod_kw)
    (o2, l2), (t2, tl2) = _all_paths(q, k, v, **builtin_kw)
    _same((o1, l1), (o2, l2))
    _same((t1, tl1), (t2, tl2))
    _same((t1, tl1), (o2, l2), 1e-12)
    dout = randn(rng, o1.shape)
    for a, b in zip(_grads(q, k, v, dout, **mod_kw), _grads(q, k, v, dout, **builtin_kw)):
        _same(a, b, 1e-12)


def test_public_attention_and_backward_take_mods(rng):
    q, k, v = _qkv(rng)
    slopes = _slopes(rng)
    kw = dict(score_mod=mods.alibi(slopes, SQ, SK), mask_mod=mods.sliding_window(3, 1, SQ, SK))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    exp_out, exp_lse = cuflash.attention(q, k, v, return_lse=True, alibi_slopes=slopes, window_size=(3, 1))
    _same((out, lse), (exp_out, exp_lse), 1e-12)
    dout = randn(rng, out.shape)
    _same(cuflash.attention_backward(dout, q, k, v, out, lse, **kw),
          cuflash.attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, window_size=(3, 1)), 1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_numpy_path_is_close(dtype, rng):
    from cuflash.runtime import dtypes

    dt = getattr(dtypes, dtype)
    q, k, v = _qkv(rng, dtype=dt)
    slopes = _slopes(rng).astype(np.float32)
    got = cuflash.attention(q, k, v, score_mod=mods.alibi(slopes, SQ, SK))
    expected = cuflash.attention(q, k, v, alibi_slopes=slopes)
    assert got.dtype == dt
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ invented mods


WEIGHTS = np.array([0.5, 1.5, -0.75, 2.0])


def _invented_a(score, b, h, q_idx, kv_idx):
    return mods.where(kv_idx % 2 == 0, score * WEIGHTS[h], score - 0.3 * mods.log(1.0 + abs(q_idx - kv_idx)))


def _formula_a(s, h, i, j):
    return np.where(j % 2 == 0, s * WEIGHTS[h], s - 0.3 * np.log(1.0 + np.abs(i - j)))


def _invented_b_score(score, b, h, q_idx, kv_idx):
    return 8.0 * mods.tanh(score / 8.0) + 0.5 * mods.exp(-abs(q_idx - kv_idx) / 4.0) + b


def _invented_b_mask(b, h, q_idx, kv_idx):
    # row 2 sees no key at all (0, lse -inf); elsewhere a checkerboard-ish pattern with key 0 always seen
    return (q_idx != 2) & (((q_idx + kv_idx + h) % 3 != 1) | (kv_idx == 0))


def _formula_b(s, b, h, i, j):
    return 8.0 * np.tanh(s / 8.0) + 0.5 * np.exp(-np.abs(i - j) / 4.0) + b


def _mask_b(h, i, j):
    return (i != 2) & (((i + j + h) % 3 != 1) | (j == 0))


def _by_hand(q, k, v, score_fn, mask_fn=None):
    """Attention in float64 written out: S, the mod at every (b, h, i, j), the mask, softmax."""
    g = HQ // HK
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ kk.swapaxes(-1, -2) / np.sqrt(D)
    b, h = np.arange(B)[:, None, None, None], np.arange(HQ)[None, :, None, None]
    i, j = np.arange(SQ)[:, None], np.arange(SK)[None, :]
    s = score_fn(s, b, h, i, j)
    if mask_fn is not None:
        s = np.where(np.broadcast_to(mask_fn(h, i, j), s.shape), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(s - m)
    lsum = e.sum(axis=-1, keepdims=True)
    out = np.where(lsum > 0, (e @ vv) / np.where(lsum > 0, lsum, 1), 0)
    lse = np.where(lsum[..., 0] > 0, m[..., 0] + np.log(np.where(lsum[..., 0] > 0, lsum[..., 0], 1)), -np.inf)
    return out, lse


def test_invented_score_mod_equals_the_formula(rng):
    q, k, v = _qkv(rng)
    expected = _by_hand(q, k, v, lambda s, b, h, i, j: _formula_a(s, h, i, j))
    oracle, tiled = _all_paths(q, k, v, score_mod=_invented_a)
    _same(oracle, expected, 1e-12)
    _same(tiled, expected, 1e-12)


def test_invented_score_and_mask_mod_equal_the_formula(rng):
    q, k, v = _qkv(rng)
    expected = _by_hand(q, k, v, _formula_b, _mask_b)
    assert np.isneginf(expected[1][:, :, 2]).all() and (expected[0][:, :, 2] == 0).all()
    oracle, tiled = _all_paths(q, k, v, score_mod=_invented_b_score, mask_mod=_invented_b_mask)
    _same(oracle, expected, 1e-12)
    _same(tiled, expected, 1e-12)


def test_order_builtins_then_score_mod_then_masks(rng):
    # score_mod receives the score after softcap and the bias; mask_mod joins the causal mask
    q, k, v = _qkv(rng, SQ, SQ)
    bias = randn(rng, (HQ, SQ, SQ))
    kw = dict(softcap=3.0, attn_bias=bias, causal=True)
    got = ref.naive_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2.0,
                              mask_mod=lambda b, h, i, j: j != 1, **kw)
    g = HQ // HK
    s = q @ np.repeat(k, g, axis=1).swapaxes(-1, -2) / np.sqrt(D)
    s = (3.0 * np.tanh(s / 3.0) + bias) * 2.0
    keep = np.tril(np.ones((SQ, SQ), bool)) & (np.arange(SQ) != 1)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    expected = (p / p.sum(axis=-1, keepdims=True)) @ np.repeat(v, g, axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------------ backward


FD_MODS = {
    "invented_a": dict(score_mod=_invented_a),
    "invented_b": dict(score_mod=_invented_b_score, mask_mod=_invented_b_mask),
    "softcap_alibi": dict(score_mod=lambda s, b, h, i, j: mods.softcap(2.0)(s, b, h, i, j) - WEIGHTS[h] * abs(i - j)),
    "kinks": dict(score_mod=lambda s, b, h, i, j: mods.maximum(s, -0.2) + abs(s - 0.1) * mods.minimum(s, 0.3)),
}


@pytest.mark.parametrize("name", list(FD_MODS))
def test_backward_matches_finite_differences(name, rng):
    kw = FD_MODS[name]
    q, k, v = make_qkv(rng, 1, 4, 2, 4, 5, 2, 2)   # GQA; small: 2 * 56 forwards per case
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
    dout = randn(rng, out.shape)
    fd = finite_difference_grads(dout, q, k, v, **kw)
    naive = attention_backward(dout, q, k, v, out, lse, **kw)
    tiled = flash_attention_backward(dout, q, k, v, out, lse, block_m=2, block_n=3, **kw)
    public = cuflash.attention_backward(dout, q, k, v, out, lse, **kw)
    for label, grads in (("naive", naive), ("tiled", tiled), ("public", public)):
        for gname, g, f in zip(("dq", "dk", "dv"), grads, fd):
            np.testing.assert_allclose(g, f, rtol=1e-6, atol=1e-8, err_msg=f"{label} {gname}")


# ------------------------------------------------------------------------------------------ refusals


def test_refusals_of_a_call(rng):
    q, k, v = _qkv(rng)
    short = np.ones(HQ - 1)
    with pytest.raises(ValueError, match=r"cuflash.attention: score_mod reads short\[\.\.\.\] with index h on axis 0, "
                                         r"which may take values in \[0, 3\].*short.shape\[0\]=3"):
        cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + short[h])
    with pytest.raises(TypeError, match=r"cuflash.attention_backward: mask_mod is not traceable: `if`"):
        cuflash.attention_backward(q, q, k, v, q, q[..., 0], mask_mod=lambda b, h, i, j: 1 if i > j else 0)
    with pytest.raises(TypeError, match=r"cuflash.reference.naive_attention: score_mod must take 5 positional"):
        ref.naive_attention(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(NotImplementedError, match=r"score_mod is not in the portable kernel yet"):   # float32
        cuflash.explain(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), backend="sim",
                        score_mod=mods.softcap(3.0))


def test_captured_torch_cpu_tensors_are_read_as_numpy_views_and_other_kinds_refused(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    slopes = torch.linspace(0.1, 0.4, HQ, dtype=torch.float64)
    got = cuflash.attention(q, k, v, score_mod=mods.alibi(slopes, SQ, SK))
    _same((got,), (cuflash.attention(q, k, v, alibi_slopes=slopes.numpy()),), 1e-13)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))   # torch CPU input: the NumPy path, torch out
    got_t = cuflash.attention(tq, tk, tv, score_mod=mods.alibi(slopes, SQ, SK))
    assert isinstance(got_t, torch.Tensor)
    _same((got_t.numpy(),), (got,), 0)

    class Elsewhere:   # a DLPack array on another device than q's
        shape, dtype, ndim = (HQ,), np.dtype(np.float32), 1

        def __dlpack__(self, stream=None):
            raise AssertionError("never imported")

        def __dlpack_device__(self):
            return (2, 0)

    far = Elsewhere()
    with pytest.raises((TypeError, ValueError), match=r"score_mod's captured array 'far'"):
        cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + far[h])


# ------------------------------------------------------------------------------------------ captured arrays' gradients


def _learned(rng):
    """An invented score_mod with two learned float arrays (a relative-position table read at two
    indices, per-head slopes inside a tanh) and an int array it reads without a gradient."""
    table = rng.standard_normal((HQ, 2 * 5 - 1))
    slopes = rng.uniform(0.2, 0.8, HQ)
    shift = np.array([1, 0, 2, 1], np.int32)

    def score_mod(s, b, h, i, j):
        rel = mods.clamp(j - i + 4, 0, 8)
        return mods.tanh(s * slopes[h]) * 2.0 + table[h, rel] - 0.5 * table[h, mods.clamp(shift[h], 0, 8)] * s
    return score_mod, {"table": table, "slopes": slopes}


def test_captured_array_gradients_match_finite_differences(rng):
    score_mod, learned = _learned(rng)
    q, k, v = make_qkv(rng, 1, HQ, HK, 4, 5, 2, 2)
    kw = dict(score_mod=score_mod, mask_mod=lambda b, h, i, j: j != i + 1, causal=True)
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw)
    dout = randn(rng, out.shape)
    naive = attention_backward(dout, q, k, v, out, lse, return_dscore_mod=True, **kw)[3]
    tiled = flash_attention_backward(dout, q, k, v, out, lse, block_m=2, block_n=3, return_dscore_mod=True, **kw)[3]
    public = cuflash.attention_backward(dout, q, k, v, out, lse, return_dscore_mod=True, **kw)[3]
    assert sorted(naive) == ["slopes", "table"]   # the int array gets none
    for name, arr in learned.items():   # central differences of sum(out * dout), the array perturbed in place
        fd = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            orig = arr[idx]
            arr[idx] = orig + 1e-6
            plus = np.sum(ref.naive_attention(q, k, v, **kw) * dout)
            arr[idx] = orig - 1e-6
            minus = np.sum(ref.naive_attention(q, k, v, **kw) * dout)
            arr[idx] = orig
            fd[idx] = (plus - minus) / 2e-6
        assert np.abs(fd).max() > 0.1   # the perturbation reaches the loss
        for label, got in (("naive", naive), ("tiled", tiled), ("public", public)):
            assert got[name].shape == arr.shape and got[name].dtype == arr.dtype
            np.testing.assert_allclose(got[name], fd, rtol=1e-6, atol=1e-8, err_msg=f"{label} d{name}")


def test_captured_array_gradients_are_bit_identical_for_any_thread_count(rng, monkeypatch):
    score_mod, learned = _learned(rng)
    table32 = learned["table"].astype(np.float32)
    q, k, v = make_qkv(rng, 2, HQ, HK, 5, 5, 8, 8, dtype=np.float32)

    def sm(s, b, h, i, j):   # float32 table: float32 gradient (float32 accumulation across blocks)
        return s + table32[h, mods.clamp(j - i + 4, 0, 8)]
    out, lse = cuflash.attention(q, k, v, score_mod=sm, return_lse=True)
    runs = []
    for n in ("1", "2", "3"):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", n)
        runs.append(flash_attention_backward(out, q, k, v, out, lse, block_m=2, block_n=2, score_mod=sm,
                                             return_dscore_mod=True)[3]["table32"])
    assert runs[0].dtype == np.float32
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])
    want = attention_backward(out, q, k, v, out, lse, score_mod=sm, return_dscore_mod=True)[3]["table32"]
    np.testing.assert_allclose(runs[0], want, rtol=1e-4, atol=1e-5)


def test_captured_array_gradient_refusals(rng, monkeypatch):
    q, k, v = _qkv(rng)
    out, lse = ref.naive_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"return_dscore_mod=True needs score_mod"):
        cuflash.attention_backward(out, q, k, v, out, lse, return_dscore_mod=True)
    t = np.ones(HQ, np.float32)
    h16 = tuple(x.astype(np.float16) for x in (q, k, v, out))
    from cuflash.kernels import attention_bwd_mma

    # deterministic=True sums exactly in int64 limbs: refused (before any device work) where one element could
    # take too many terms to stay exact (the bound lowered here to this problem's size)
    monkeypatch.setattr(attention_bwd_mma, "EXACT_GRAD_MAX_TERMS", B * HQ * SQ * SK)
    with pytest.raises(NotImplementedError, match=rf"return_dscore_mod with deterministic=True: the exact sums of "
                                                  rf"the captured arrays' gradients take fewer than 2\^39 terms per "
                                                  rf"element \(captured-array reads per pair x query-key pairs: 1 x "
                                                  rf"{B * HQ * SQ * SK} here\)"):
        cuflash.attention_backward(h16[3], *h16, lse.astype(np.float32), score_mod=lambda s, b, h, i, j: s * t[h],
                                   return_dscore_mod=True, deterministic=True, backend="sim")


# ------------------------------------------------------------------------------------------ packed batches


def test_varlen_mods_are_per_sequence_with_b_the_sequence_index(rng):
    """attention_varlen with score_mod/mask_mod equals each sequence run alone through the float64
    oracle with ``b`` fixed to its index and positions counted from the sequence's start; the
    backward's dq and the learned table's gradient (summed over sequences) too. Kernel tiers
    refuse the pair by name."""
    cu = np.array([0, 3, 3, 8], np.int32)   # lengths 3, 0, 5
    q, k, v = (rng.standard_normal((8, 2, 8)) for _ in range(3))
    table = rng.standard_normal((3, 2, 9))

    def sm(s, b, h, i, j):
        return s + table[b, h, j - i + 4]

    def mm(b, h, i, j):
        return j != i + 1

    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, 5, 5, score_mod=sm, mask_mod=mm, causal=True,
                                        return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, 5, 5, score_mod=sm, mask_mod=mm,
                                              causal=True, return_dscore_mod=True)
    dtable = np.zeros_like(table)
    for b, (s0, s1) in enumerate(zip(cu[:-1], cu[1:])):
        if s1 == s0:
            continue
        qs, ks, vs, ds = (x[s0:s1].transpose(1, 0, 2)[None] for x in (q, k, v, dout))
        kw = dict(score_mod=lambda s, _b, h, i, j, b=b: s + table[b, h, j - i + 4], mask_mod=mm, causal=True)
        o, l = ref.naive_attention(qs, ks, vs, return_lse=True, **kw)
        np.testing.assert_allclose(out[s0:s1], o[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-13)
        g = attention_backward(ds, qs, ks, vs, o, l, return_dscore_mod=True, **kw)
        np.testing.assert_allclose(grads[0][s0:s1], g[0][0].transpose(1, 0, 2), rtol=1e-11, atol=1e-12)
        dtable += g[3]["table"]
    assert np.abs(dtable).max() > 0.1
    np.testing.assert_allclose(grads[3]["table"], dtable, rtol=1e-12, atol=1e-13)
    h16 = tuple(x.astype(np.float16) for x in (q, k, v))
    t32 = table.astype(np.float32)
    with pytest.raises(NotImplementedError, match=r"tensor-core mma.sync tier not used: score_mod/mask_mod on a "
                                                  r"packed batch \(attention_varlen\) is not in this kernel's"):
        cuflash.attention_varlen(*h16, cu, cu, 5, 5, score_mod=lambda s, b, h, i, j: s + t32[b, h, 0], backend="sim")
