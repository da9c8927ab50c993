"""Score modifiers (softcap, alibi_slopes, attn_bias, attn_mask, sinks) on the NumPy path.

Expected values come from a dense float64 formula written here in plain torch operations (the
whole score matrix, the textbook softmax with the sink as one more column whose value is 0), and
its gradients from torch's autograd; the derivations of ``d attn_bias`` and ``d sinks`` are
also checked by central finite differences. Grids are pairwise (``allpairspy``) over the
modifier sets (each alone and every pair), shapes (odd lengths and head dims, GQA), masks
(causal, windows), layouts and the forms of the bias and the mask (broadcast, strided views of a
NaN-filled buffer, fully masked rows and fully masked key tiles).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from allpairspy import AllPairs
from support.options import check_attention

import cuflash
from cuflash import reference
from cuflash.reference import tolerance
from cuflash.runtime import dtypes, validation

# the float64 oracle of this module is written in torch: without torch the module reports as skipped
torch = pytest.importorskip("torch")

NAMES = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
COMBOS = [(n,) for n in NAMES] + list(itertools.combinations(NAMES, 2))


# --------------------------------------------------------------------------------------------
# the independent dense float64 formula (torch, differentiable)


def dense(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None, bias=None, mask=None,
          sinks=None):
    """``(out, lse)`` of attention on (B, H, S, D) float64 torch tensors, the textbook way."""
    b, hq, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, dtype=torch.float64)[:, None]
    j = torch.arange(sk, dtype=torch.float64)[None, :]
    if slopes is not None:
        s = s - slopes.expand(b, hq)[:, :, None, None] * (i + sk - sq - j).abs()
    if bias is not None:
        s = s + bias.expand(b, hq, sq, sk)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        vis &= j <= i + sk - sq + right
    if left >= 0:
        vis &= j >= i + sk - sq - left
    vis = vis.expand(b, hq, sq, sk)
    if mask is not None:
        vis = vis & mask.expand(b, hq, sq, sk)
    s = torch.where(vis, s, torch.tensor(-torch.inf, dtype=torch.float64))
    vals = v
    if sinks is not None:   # one more column: the sink's logit, with value 0
        s = torch.cat([s, sinks[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
        vals = torch.cat([v, torch.zeros(b, hq, 1, v.shape[-1], dtype=torch.float64)], dim=-2)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    lsum = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(lsum > 0, lsum, torch.ones_like(lsum))
    out = p @ vals
    with torch.no_grad():
        lse = torch.where(lsum[..., 0] > 0, m[..., 0] + torch.log(lsum[..., 0]), torch.tensor(-torch.inf,
                                                                                           dtype=torch.float64))
    return out, lse


def to_bhsd(x, layout):
    return x if layout == "bhsd" else np.swapaxes(x, 1, 2)


def t64(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float64)
                                                                         if x.dtype != np.bool_ else x))


def expected(q, k, v, layout, kw, dout=None, scale=None):
    """The dense formula's ``(out, lse)`` in cuflash's layout, and with ``dout`` the gradients
    ``{name: grad}`` of ``sum(out * dout)``."""
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(to_bhsd(x, layout)).astype(np.float64)).requires_grad_()
                  for x in (q, k, v))
    mods = {}
    for name, key in (("alibi_slopes", "slopes"), ("attn_bias", "bias"), ("attn_mask", "mask"), ("sinks", "sinks")):
        x = kw.get(name)
        if x is not None:
            mods[key] = t64(x)
            if name in ("attn_bias", "sinks"):
                mods[key].requires_grad_()
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = dense(qt, kt, vt, scale=scale, causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                     softcap=kw.get("softcap", 0.0), **mods)
    o = out.detach().numpy()
    res = {"out": o if layout == "bhsd" else np.swapaxes(o, 1, 2), "lse": lse.numpy()}
    if dout is not None:
        (out * torch.from_numpy(np.ascontiguousarray(to_bhsd(dout, layout)).astype(np.float64))).sum().backward()
        for name, t in (("dq", qt), ("dk", kt), ("dv", vt)):
            g = t.grad.numpy()
            res[name] = g if layout == "bhsd" else np.swapaxes(g, 1, 2)
        if "bias" in mods:
            res["dbias"] = mods["bias"].grad.numpy()
        if "sinks" in mods:
            res["dsinks"] = mods["sinks"].grad.numpy()
    return res


# --------------------------------------------------------------------------------------------
# inputs


def nan_strided(rng, shape, dtype=np.float64):
    """A non-contiguous view (every other element of a NaN-filled buffer) holding normal values."""
    buf = np.full(shape[:-1] + (2 * shape[-1] + 1,), np.nan, dtype=dtype)
    view = buf[..., 1::2][..., : shape[-1]]
    view[...] = rng.standard_normal(shape)
    return view


def make_bias(rng, form, b, hq, sq, sk, dtype=np.float64):
    if form == "full":
        return rng.standard_normal((b, hq, sq, sk)).astype(dtype)
    if form == "2d":
        return rng.standard_normal((sq, sk)).astype(dtype)
    if form == "heads":
        return rng.standard_normal((hq, 1, sk)).astype(dtype)   # 3-D, broadcast over batch and rows
    if form == "expanded":   # a stride-0 view of the full shape: its gradient is the full shape's
        return np.broadcast_to(rng.standard_normal((1, hq, 1, sk)).astype(dtype), (b, hq, sq, sk))
    return nan_strided(rng, (b, 1, sq, sk), dtype)   # "strided": broadcast over heads, non-contiguous


def make_mask(rng, form, b, hq, sq, sk):
    """Random keep-mask with fully masked rows; "tiles": key columns 8..15 hidden from every row
    (a whole key tile at block_n = 8) besides."""
    m = rng.random((b, hq, sq, sk)) < 0.7
    if sq > 2:
        m[:, :, ::3] = False   # every third row sees no key
    if form == "tiles":
        m[..., 8:16] = False
        return m
    return m[:, :1]   # broadcast over heads


SHAPES = [  # (B, Hq, Hk, Sq, Sk, D, Dv)
    (2, 4, 2, 13, 29, 16, 16),
    (1, 3, 3, 31, 17, 23, 9),
    (2, 2, 1, 1, 23, 37, 40),
]
WINDOWS = [dict(), dict(causal=True), dict(window_size=(5, 2))]


def build(rng, combo, shape, win, layout, bias_form, mask_form, dtype=np.float64):
    b, hq, hk, sq, sk, d, dv = shape
    if layout == "bhsd":
        q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv)))
    else:
        q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)))
    q *= 2.0   # large enough logits that the softcap bites
    kw = dict(win)
    for name in combo:
        if name == "softcap":
            kw["softcap"] = 1.5
        elif name == "alibi_slopes":
            sl = rng.random(hq) * 0.5
            kw["alibi_slopes"] = (sl if bias_form in ("full", "2d") else np.tile(sl, (b, 1))).astype(
                np.float64 if dtype == np.float64 else np.float32)
        elif name == "attn_bias":
            kw["attn_bias"] = make_bias(rng, bias_form, b, hq, sq, sk, dtype)
        elif name == "attn_mask":
            kw["attn_mask"] = make_mask(rng, mask_form, b, hq, sq, sk)
        else:
            kw["sinks"] = rng.standard_normal(hq).astype(np.float64 if dtype == np.float64 else np.float32)
    return q, k, v, kw


GRID = [tuple(c) for c in AllPairs([COMBOS, SHAPES, WINDOWS, ["bhsd", "bshd"], ["full", "2d", "heads", "strided", "expanded"],
                                    ["rows", "tiles"]])]


def close(a, b, what, tol=1e-9):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), what
    fin = np.isfinite(b)
    assert np.isfinite(a[fin]).all(), what
    np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=tol, err_msg=what)


# --------------------------------------------------------------------------------------------
# forward and backward against the dense formula


@pytest.mark.parametrize("combo, shape, win, layout, bias_form, mask_form", GRID)
def test_pairwise_forward_and_backward_match_the_dense_formula(combo, shape, win, layout, bias_form, mask_form):
    rng = np.random.default_rng(zlib.crc32(repr((combo, shape, win, layout, bias_form, mask_form)).encode()))
    q, k, v, kw = build(rng, combo, shape, win, layout, bias_form, mask_form)
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    want = expected(q, k, v, layout, kw, dout=dout)
    flags = dict(return_dbias="attn_bias" in combo, return_dsinks="sinks" in combo)
    runs = {
        "attention": cuflash.attention(q, k, v, layout=layout, return_lse=True, **kw),
        "naive": reference.naive_attention(q, k, v, layout=layout, return_lse=True, **kw),
        "tiled 5x8": reference.flash_attention(q, k, v, layout=layout, return_lse=True, block_m=5, block_n=8, **kw),
    }
    for name, (out, lse) in runs.items():
        close(out, want["out"], f"{name} out")
        close(lse, want["lse"], f"{name} lse")
    out, lse = runs["attention"]
    grads = {
        "attention_backward": cuflash.attention_backward(dout, q, k, v, out, lse, layout=layout, **kw, **flags),
        "naive": reference.attention_backward(dout, q, k, v, out, lse, layout=layout, **kw, **flags),
        "tiled 5x8": reference.flash_attention_backward(dout, q, k, v, out, lse, layout=layout, block_m=5, block_n=8,
                                                        **kw, **flags),
    }
    names = ["dq", "dk", "dv"] + ["dbias"] * flags["return_dbias"] + ["dsinks"] * flags["return_dsinks"]
    for name, g in grads.items():
        assert len(g) == len(names), name
        for gn, x in zip(names, g):
            close(x, want[gn], f"{name} {gn}", tol=1e-8)
        if flags["return_dbias"]:
            assert g[3].shape == kw["attn_bias"].shape


def test_rows_without_keys_give_zero_and_lse_minus_inf_or_the_sink():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    mask = np.ones((6, 6), bool)
    mask[2] = False
    out, lse = cuflash.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out[:, :, 2] == 0).all() and np.isneginf(lse[:, :, 2]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, [0, 1, 3, 4, 5]]).all()
    sinks = np.array([0.5, -1.25], np.float64)
    out, lse = cuflash.attention(q, k, v, attn_mask=mask, sinks=sinks, return_lse=True)
    assert (out[:, :, 2] == 0).all()
    np.testing.assert_array_equal(lse[0, :, 2], sinks)
    # a bias of -inf hides a pair as the mask does
    bias = np.where(mask, 0.0, -np.inf)
    o2, l2 = cuflash.attention(q, k, v, attn_bias=bias, return_lse=True)
    o1, l1 = cuflash.attention(q, k, v, attn_mask=mask, return_lse=True)
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(l1))


def test_nan_in_the_bias_reaches_its_row_only():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 7, 8)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((7, 7)).astype(np.float32)
    bias[3, 4] = np.nan
    out, lse = cuflash.attention(q, k, v, attn_bias=bias, return_lse=True)
    assert np.isnan(out[:, :, 3]).all() and np.isnan(lse[:, :, 3]).all()
    assert np.isfinite(np.delete(out, 3, axis=2)).all()
    # hidden by the mask, the NaN is not seen
    mask = np.ones((7, 7), bool)
    mask[3, 4] = False
    assert np.isfinite(cuflash.attention(q, k, v, attn_bias=bias, attn_mask=mask)).all()


def test_nan_sink_or_slope_reaches_its_head_only():
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((2, 3, 5, 8)) for _ in range(3))
    for name in ("sinks", "alibi_slopes"):
        x = rng.random(3)
        x[1] = np.nan
        out, lse = cuflash.attention(q, k, v, return_lse=True, **{name: x})
        assert np.isnan(out[:, 1]).all() and np.isnan(lse[:, 1]).all(), name
        assert np.isfinite(out[:, [0, 2]]).all() and np.isfinite(lse[:, [0, 2]]).all(), name


def test_low_precision_bias_and_modifiers_on_the_cpu_path():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 4, 19, 32)).astype(dtypes.bfloat16) for _ in range(3))
    bias = rng.standard_normal((1, 4, 19, 19)).astype(dtypes.bfloat16)
    sl = (rng.random(4) * 0.3).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    kw = dict(softcap=5.0, alibi_slopes=sl, attn_bias=bias, sinks=sinks, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtypes.bfloat16 and lse.dtype == np.float32
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, **kw)   # the project's rule: 2x a bf16 framework's error
    assert ok, msg
    want = expected(q, k, v, "bhsd", kw)
    np.testing.assert_allclose(lse, want["lse"], atol=1e-4)
    dout = rng.standard_normal(out.shape).astype(dtypes.bfloat16)
    g = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, return_dsinks=True, **kw)
    assert g[3].dtype == dtypes.bfloat16 and g[3].shape == bias.shape and g[4].dtype == np.float32


# --------------------------------------------------------------------------------------------
# finite differences (the derivations of d attn_bias and d sinks, in float64)


def test_dbias_and_dsinks_match_finite_differences():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 5, 8))
    k, v = (rng.standard_normal((2, 2, 7, 8)) for _ in range(2))
    bias = rng.standard_normal((4, 1, 7))           # broadcast over batch and rows
    sinks = rng.standard_normal(4)
    w = rng.standard_normal((2, 4, 5, 8))
    kw = dict(softcap=2.0, alibi_slopes=rng.random(4) * 0.5, causal=True)

    def loss(bias, sinks):
        return float((cuflash.attention(q, k, v, attn_bias=bias, sinks=sinks, **kw) * w).sum())

    out, lse = cuflash.attention(q, k, v, attn_bias=bias, sinks=sinks, return_lse=True, **kw)
    *_, dbias, dsinks = cuflash.attention_backward(w, q, k, v, out, lse, attn_bias=bias, sinks=sinks,
                                                   return_dbias=True, return_dsinks=True, **kw)
    eps = 1e-6
    for idx in np.ndindex(bias.shape):
        b1, b2 = bias.copy(), bias.copy()
        b1[idx] += eps
        b2[idx] -= eps
        assert abs((loss(b1, sinks) - loss(b2, sinks)) / (2 * eps) - dbias[idx]) < 1e-7, idx
    for h in range(4):
        s1, s2 = sinks.copy(), sinks.copy()
        s1[h] += eps
        s2[h] -= eps
        assert abs((loss(bias, s1) - loss(bias, s2)) / (2 * eps) - dsinks[h]) < 1e-7, h
    assert np.abs(dsinks).min() > 1e-4 and np.abs(dbias).min() > 1e-6   # the check is not vacuous


def test_dbias_is_bit_identical_run_to_run_and_for_any_thread_count(monkeypatch):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 64, 16)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, attn_bias=bias, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    runs = []
    for n in ("1", "2", "3"):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", n)
        runs.append(reference.flash_attention_backward(dout, q, k, v, out, lse, attn_bias=bias, return_dbias=True,
                                                       block_m=16, block_n=16)[3])
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


# --------------------------------------------------------------------------------------------
# varlen and KV cache


def test_varlen_softcap_and_alibi_alone_and_together():
    rng = np.random.default_rng(6)
    lq, lk = [5, 0, 9, 3], [7, 4, 6, 11]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    hq, hk = 4, 2
    q = rng.standard_normal((cq[-1], hq, 16)) * 2
    k = rng.standard_normal((ck[-1], hk, 16))
    v = rng.standard_normal((ck[-1], hk, 24))
    slopes = rng.random((4, hq)) * 0.5
    dout = rng.standard_normal((cq[-1], hq, 24))
    for kw in (dict(softcap=1.5), dict(alibi_slopes=slopes), dict(softcap=1.5, alibi_slopes=slopes[1]),
               dict(softcap=2.0, alibi_slopes=slopes, causal=True)):
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, 9, 11, return_lse=True, **kw)
        dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, 9, 11, **kw)
        for b in range(4):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if rq.stop == rq.start:
                continue
            sl = kw.get("alibi_slopes")
            one = dict(softcap=kw.get("softcap", 0.0), causal=kw.get("causal", False),
                       alibi_slopes=None if sl is None else (sl[b] if sl.ndim == 2 else sl))
            want = expected(q[None, rq], k[None, rk], v[None, rk], "bshd", one, dout=dout[None, rq])
            close(out[rq], want["out"][0], f"varlen out {kw.keys()} {b}")
            close(lse[:, rq], want["lse"][0], f"varlen lse {b}")
            close(dq[rq], want["dq"][0], "dq", 1e-8)
            close(dk[rk], want["dk"][0], "dk", 1e-8)
            close(dv[rk], want["dv"][0], "dv", 1e-8)


@pytest.mark.parametrize("combo", [("softcap",), ("alibi_slopes",), ("sinks",), ("softcap", "alibi_slopes"),
                                   ("softcap", "sinks"), ("alibi_slopes", "sinks")])
def test_kvcache_modifiers_match_the_dense_formula(combo):
    rng = np.random.default_rng(7)
    b, hq, hk, d, cap = 2, 4, 2, 16, 20
    k_cache, v_cache = (rng.standard_normal((b, cap, hk, d)) for _ in range(2))
    seqlens = np.array([6, 13], np.int32)
    q = rng.standard_normal((b, 3, hq, d)) * 2
    k_new, v_new = (rng.standard_normal((b, 3, hk, d)) for _ in range(2))
    kw = {}
    if "softcap" in combo:
        kw["softcap"] = 1.5
    if "alibi_slopes" in combo:
        kw["alibi_slopes"] = rng.random((b, hq)) * 0.5
    if "sinks" in combo:
        kw["sinks"] = rng.standard_normal(hq)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k_new, v=v_new, causal=True,
                                              return_lse=True, **kw)
    for i in range(b):
        n = seqlens[i] + 3
        one = dict(kw, causal=True)
        if "alibi_slopes" in kw:
            one["alibi_slopes"] = kw["alibi_slopes"][i]
        want = expected(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], "bshd", one)
        close(out[i:i + 1], want["out"], f"kvcache out {combo} {i}")
        close(lse[i:i + 1], want["lse"], f"kvcache lse {combo} {i}")


# --------------------------------------------------------------------------------------------
# the portable (SIMT) tier takes every modifier (float32, and what the tensor cores cannot take)


def _one(name, hq=4, sq=8, sk=8):
    return {"softcap": 1.0, "alibi_slopes": np.ones(hq, np.float32), "attn_bias": np.zeros((sq, sk), np.float32),
            "attn_mask": np.ones((sq, sk), bool), "sinks": np.zeros(hq, np.float32)}[name]


@pytest.mark.parametrize("name", NAMES)
def test_kernel_backends_take_each_modifier_on_float32(name):
    # float32 runs on the portable (SIMT) tier's modifier forms, forward and backward, as the NumPy
    # path computes it (the full grids: tests/kernels/test_modifiers_kernels.py); float16 with a head
    # dim the tensor cores cannot take (60) goes there too
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 4, 8, 64)).astype(np.float32) for _ in range(3))
    kw = {name: _one(name)}
    info = cuflash.explain(q, k, v, backend="sim", **kw)
    assert info["tier"] == "attention_fwd_simt" and info["variant"].endswith("_mods"), info
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
    want, want_lse = cuflash.attention(q, k, v, return_lse=True, **kw)   # the NumPy path
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    got = cuflash.attention_backward(out, q, k, v, out, lse, backend="sim", **kw)
    for g, w in zip(got, cuflash.attention_backward(out, q, k, v, want, want_lse, **kw)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    h = q.astype(np.float16)[..., :60]
    assert cuflash.explain(h, h, v.astype(np.float16), backend="sim", **kw)["tier"] == "attention_fwd_simt"


@pytest.mark.slow   # (its own simulator variant: the packed modifier form)
def test_varlen_kernel_backend_takes_softcap_and_alibi_on_float32():
    rng = np.random.default_rng(9)
    cu = np.array([0, 3, 8], np.int32)
    q, k, v = (rng.standard_normal((8, 4, 16)).astype(np.float32) for _ in range(3))
    kw = dict(softcap=1.5, alibi_slopes=rng.uniform(0.1, 0.5, (2, 4)).astype(np.float32))
    got = cuflash.attention_varlen(q, k, v, cu, cu, 5, 5, backend="sim", causal=True, **kw)
    want = cuflash.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softcap", "alibi_slopes", "sinks"])
def test_kvcache_kernel_backend_refuses_modifiers_and_appends_nothing(name):
    # the KV-cache kernel is the tensor-core tier's (float16/bfloat16): float32 with a modifier is
    # refused before the append, and the cache is left as it was
    rng = np.random.default_rng(10)
    k_cache, v_cache = (rng.standard_normal((2, 16, 2, 16)).astype(np.float32) for _ in range(2))
    before = k_cache.copy()
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    kn, vn = (rng.standard_normal((2, 1, 2, 16)).astype(np.float32) for _ in range(2))
    with pytest.raises(NotImplementedError, match=r"tensor-core tier only"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, np.array([3, 5], np.int32), k=kn, v=vn, backend="sim",
                                       **{name: _one(name)})
    np.testing.assert_array_equal(k_cache, before)


def test_problem_modifiers_is_none_without_modifiers_and_holds_broadcast_strides():
    q, k, v = (np.zeros((2, 4, 8, 16), np.float32) for _ in range(3))
    assert check_attention(q, k, v).modifiers is None
    assert check_attention(q, k, v, softcap=0.0).modifiers is None
    bias = np.zeros((4, 1, 8), np.float32)
    m = check_attention(q, k, v, attn_bias=bias, alibi_slopes=np.ones(4, np.float32)).modifiers
    assert m.present == ("alibi_slopes", "attn_bias")
    assert m.attn_bias.shape == (2, 4, 8, 8) and m.attn_bias.strides == (0, 8, 0, 1)
    assert m.alibi_slopes.shape == (2, 4) and m.alibi_slopes.strides == (0, 1)


# --------------------------------------------------------------------------------------------
# bad input


class FakeDLPack:
    def __init__(self, shape, dtype="float32", device=(2, 0)):
        self.shape, self.dtype, self._device = tuple(shape), dtype, device

    def __dlpack__(self, stream=None):  # pragma: no cover - validation reads metadata only
        raise AssertionError("validation must not export data")

    def __dlpack_device__(self):
        return self._device


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0 \(0 = off\), got -1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0 .*got inf"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0 .*got nan"),
    (dict(softcap=True), TypeError, r"softcap must be a real number >= 0 .*got True \(bool\)"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError,
     r"alibi_slopes.shape=\(3,\) must be \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\)"),
    (dict(alibi_slopes=np.ones((1, 4), np.float32)), ValueError, r"alibi_slopes.shape=\(1, 4\) must be"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, r"alibi_slopes must be float32, got alibi_slopes.dtype=float64"),
    (dict(sinks=np.ones((2, 4), np.float32)), ValueError, r"sinks.shape=\(2, 4\) must be \(Hq,\) = \(4,\)"),
    (dict(sinks=np.ones(4, np.float16)), TypeError, r"sinks must be float32, got sinks.dtype=float16"),
    (dict(attn_bias=np.zeros((3, 8, 9), np.float32)), ValueError,
     r"attn_bias.shape=\(3, 8, 9\) does not broadcast to \(B, Hq, Sq, Sk\)=\(2, 4, 8, 9\)"),
    (dict(attn_bias=np.zeros((2, 4, 8, 9), np.float16)), TypeError,
     r"attn_bias.dtype=float16 must be float32$"),
    (dict(attn_bias=np.zeros((8, 9), np.float32)[::-1]), ValueError, r"attn_bias has a negative stride on axis 0"),
    (dict(attn_mask=np.zeros((8, 9), np.float32)), TypeError, r"attn_mask must be a bool array .*got attn_mask.dtype=float32"),
    (dict(attn_mask=np.ones((1, 5, 1, 9), bool)), ValueError,
     r"attn_mask.shape=\(1, 5, 1, 9\) does not broadcast to \(B, Hq, Sq, Sk\)=\(2, 4, 8, 9\)"),
    (dict(attn_bias=FakeDLPack((8, 9))), TypeError, r"attn_bias is a .*FakeDLPack but q is a numpy.ndarray"),
])
def test_bad_modifiers_are_refused_before_any_work(kw, exc, pattern):
    q = np.zeros((2, 4, 8, 16), np.float32)
    k = v = np.zeros((2, 2, 9, 16), np.float32)
    with pytest.raises(exc, match=r"cuflash.attention: " + pattern):
        cuflash.attention(q, k, v, **kw)
    with pytest.raises(exc, match=pattern):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((2, 4, 8), np.float32), **kw)


def test_modifier_on_another_device_and_other_refusals():
    q = FakeDLPack((2, 4, 8, 16))
    k = v = FakeDLPack((2, 2, 9, 16))
    bias = FakeDLPack((8, 9), device=(2, 1))
    with pytest.raises(ValueError, match=r"attn_bias is on device \(2, 1\) but q is on device \(2, 0\)"):
        check_attention(q, k, v, attn_bias=bias)
    qn = np.zeros((2, 4, 8, 16), np.float32)
    kn = np.zeros((2, 2, 9, 16), np.float32)
    lse = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"return_dbias=True needs attn_bias .*got attn_bias=None"):
        cuflash.attention_backward(qn, qn, kn, kn, qn, lse, return_dbias=True)
    with pytest.raises(ValueError, match=r"return_dsinks=True needs sinks"):
        cuflash.attention_backward(qn, qn, kn, kn, qn, lse, return_dsinks=True)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match=r"cuflash.attention_varlen: softcap must be a finite number >= 0"):
        cuflash.attention_varlen(qn[0].swapaxes(0, 1), kn[0].swapaxes(0, 1), kn[0].swapaxes(0, 1), cu,
                                 np.array([0, 9], np.int32), 8, 9, softcap=-2.0)
    k_cache = np.zeros((2, 16, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"cuflash.attention_with_kvcache: sinks.shape=\(3,\) must be \(Hq,\) = \(4,\)"):
        cuflash.attention_with_kvcache(np.zeros((2, 1, 4, 16), np.float32), k_cache, k_cache.copy(), 3,
                                       sinks=np.zeros(3, np.float32))


# --------------------------------------------------------------------------------------------
# cuflash.torch.attention: autograd through attn_bias and sinks


def _torch_inputs(gen, b=2, hq=4, hk=2, sq=6, sk=9, d=8, dtype=torch.float64):
    q = torch.randn(b, hq, sq, d, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, sk, d, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, sk, d, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("combo", [("attn_bias", "sinks"), ("softcap", "attn_bias"), ("alibi_slopes", "sinks"),
                                   ("attn_mask", "attn_bias"), ("softcap", "sinks")])
def test_torch_gradcheck_float64(combo):
    import cuflash.torch as ct

    gen = torch.Generator().manual_seed(11)
    q, k, v = _torch_inputs(gen, b=1, hq=2, hk=1, sq=4, sk=5, d=4)
    bias = torch.randn(2, 1, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 4, 5, generator=gen) < 0.7
    mask[:, :, 1] = False   # a row without keys
    slopes = torch.rand(1, 2, generator=gen, dtype=torch.float64)
    kw = {"softcap": 1.5} if "softcap" in combo else {}
    if "alibi_slopes" in combo:
        kw["alibi_slopes"] = slopes
    if "attn_mask" in combo:
        kw["attn_mask"] = mask
    args = [q, k, v] + [bias] * ("attn_bias" in combo) + [sinks] * ("sinks" in combo)

    def fn(q, k, v, *rest):
        extra = dict(kw)
        rest = list(rest)
        if "attn_bias" in combo:
            extra["attn_bias"] = rest.pop(0)
        if "sinks" in combo:
            extra["sinks"] = rest.pop(0)
        return ct.attention(q, k, v, causal=True, **extra)

    assert torch.autograd.gradcheck(fn, tuple(args), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_gradients_match_the_plain_torch_reference():
    import cuflash.torch as ct

    gen = torch.Generator().manual_seed(12)
    q, k, v = _torch_inputs(gen, sq=11, sk=7)
    bias = torch.randn(11, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, generator=gen, dtype=torch.float64) * 0.5
    w = torch.randn(2, 4, 11, 8, generator=gen, dtype=torch.float64)
    kw = dict(softcap=2.0, alibi_slopes=slopes, window_size=(4, 1))
    (ct.attention(q, k, v, attn_bias=bias, sinks=sinks, **kw) * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v, bias, sinks)]
    for t in (q, k, v, bias, sinks):
        t.grad = None
    out, _ = dense(q, k, v, scale=1 / np.sqrt(8), window=(4, 1), softcap=2.0, slopes=slopes, bias=bias, sinks=sinks)
    (out * w).sum().backward()
    for name, g, t in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, (q, k, v, bias, sinks)):
        torch.testing.assert_close(g, t.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_torch_float32_bias_gradient_only_when_asked():
    import cuflash.torch as ct

    gen = torch.Generator().manual_seed(13)
    q, k, v = _torch_inputs(gen, dtype=torch.float32)
    bias = torch.randn(2, 4, 6, 9, generator=gen, requires_grad=True)
    sinks = torch.randn(4, generator=gen)   # no grad wanted
    ct.attention(q, k, v, attn_bias=bias, sinks=sinks).sum().backward()
    assert bias.grad is not None and bias.grad.dtype == torch.float32 and bias.grad.shape == bias.shape
    assert sinks.grad is None
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: attn_bias must be a torch.Tensor or None"):
        ct.attention(q, k, v, attn_bias=np.zeros((6, 9), np.float32))


def test_torch_opcheck_modifier_ops():
    import cuflash.torch  # noqa: F401  (registers the operators)

    gen = torch.Generator().manual_seed(14)
    q, k, v = (t.detach() for t in _torch_inputs(gen, b=1, hq=2, hk=1, sq=4, sk=5, d=8, dtype=torch.float32))
    bias = torch.randn(2, 1, 5, generator=gen, requires_grad=True)
    sinks = torch.randn(2, generator=gen, requires_grad=True)
    mask = torch.rand(4, 5, generator=gen) < 0.8
    slopes = torch.rand(2, generator=gen)
    args = (q.requires_grad_(), k, v, True, 0.3, -1, 0, "bhsd", False, 0.0, 0, 0, 1.5, slopes, bias, mask, sinks)
    # schema, fake against real, autograd registration (AOT dispatch is the plain ops' test's: slow)
    torch.library.opcheck(torch.ops.cuflash.attention_mod_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, lse = torch.ops.cuflash.attention_mod_fwd(*args)
    bargs = (torch.randn(out.shape, generator=gen), q.detach(), k, v, out.detach(), lse, True, 0.3, -1, 0, "bhsd",
             False, 0.0, 0, 0, 1.5, slopes, bias.detach(), mask, sinks.detach(), True, True)
    torch.library.opcheck(torch.ops.cuflash.attention_mod_bwd.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))
