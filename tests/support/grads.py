"""The gradient helpers of the backward tests: inputs, the float64 gradients, finite differences,
the naive same-dtype backward, and the tolerance rule for gradients (:func:`check_grads_close`)."""

from __future__ import annotations

import numpy as np

from cuflash import reference as ref
from cuflash.reference import masks, views
from cuflash.reference.backward import attention_backward
from cuflash.reference.dropout import problem_keep
from cuflash.runtime import dtypes
from support.options import check_attention

LOW = [dtypes.float16, dtypes.bfloat16, dtypes.float32]


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def make_qkv(rng, b, hq, hk, sq, sk, d, dv, layout="bhsd", dtype=np.float64, scale=1.0):
    if layout == "bshd":
        shapes = (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    else:
        shapes = (b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv)
    return tuple(randn(rng, s, dtype, scale) for s in shapes)


def exact_grads(dout, q, k, v, **kw):
    """The float64 gradients of the float64 values of the inputs (out and lse from the float64 forward)."""
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    out, lse = ref.naive_attention(q64, k64, v64, return_lse=True, **kw)
    return attention_backward(do64, q64, k64, v64, out, lse, **kw)


def finite_difference_grads(dout, q, k, v, h=1e-6, **kw):
    """Central differences of ``sum(naive_attention(q, k, v) * dout)`` for every input element."""
    args = [q.copy(), k.copy(), v.copy()]
    grads = []
    for x in args:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + h
            f_plus = np.sum(ref.naive_attention(*args, **kw) * dout)
            x[idx] = orig - h
            f_minus = np.sum(ref.naive_attention(*args, **kw) * dout)
            x[idx] = orig
            g[idx] = (f_plus - f_minus) / (2 * h)
        grads.append(g)
    return grads


def naive_backward_same_dtype(dout, q, k, v, out, *, layout="bhsd", **kw):
    """The backward as a same-dtype framework computes it (autograd through naive attention):
    float32-accumulated matmuls whose results are rounded to the input dtype, P and dS rounded to
    the input dtype before they enter a matmul. Returns float64 values of dq, dk, dv."""
    dtype = q.dtype
    p = check_attention(q, k, v, layout=layout, max_head_dim=None, **kw)
    rnd = lambda x: x.astype(dtype).astype(np.float32)  # noqa: E731
    f32 = np.float32
    qv = views.split_heads(views.canonical(q, layout), p.num_heads_k).astype(f32)
    dov = views.split_heads(views.canonical(dout, layout), p.num_heads_k).astype(f32)
    ov = views.split_heads(views.canonical(out, layout), p.num_heads_k).astype(f32)
    kv = views.kv_view(views.canonical(k, layout)).astype(f32)
    vv = views.kv_view(views.canonical(v, layout)).astype(f32)
    s = rnd(rnd(qv @ kv.swapaxes(-1, -2)) * f32(p.softmax_scale))
    mask = masks.problem_mask(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    e = np.exp(s - np.where(np.isneginf(m), 0, m)[..., None])
    l = e.sum(axis=-1)
    probs = rnd(e / np.where(l > 0, l, 1)[..., None])
    dp = rnd(dov @ vv.swapaxes(-1, -2))
    keep = problem_keep(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))   # dropout: Z / (1 - p)
    if keep is not None:
        dp = rnd(dp * keep.astype(f32))
    ds = rnd(probs * (dp - rnd(np.sum(dov * ov, axis=-1))[..., None]))
    if keep is not None:
        probs = rnd(probs * keep.astype(f32))   # dV takes the dropped P
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    views.split_heads(views.canonical(dq, layout), p.num_heads_k)[...] = rnd(rnd(ds @ kv) * f32(p.softmax_scale))
    views.canonical(dk, layout)[...] = rnd(rnd(ds.swapaxes(-1, -2) @ qv).sum(axis=-3) * f32(p.softmax_scale))
    views.canonical(dv, layout)[...] = rnd(rnd(probs.swapaxes(-1, -2) @ dov).sum(axis=-3))
    return dq, dk, dv


def grad_floor(expected, dtype) -> float:
    """The absolute floor of the gradient rule (flash-attn's FlashAttention-3 tests: twice the
    rounding error of ``x + 0.3 - 0.3`` in the input dtype): a couple of units in the last place at
    the gradient's magnitude, since gradients are not bounded by 1 like attention outputs."""
    one = np.dtype(dtype).type
    x = expected.astype(dtype)
    rounded = ((x + one(0.3)).astype(dtype) - one(0.3)).astype(dtype)
    return 2 * float(np.max(np.abs(rounded.astype(np.float64) - x.astype(np.float64)), initial=0.0))


def recompute_sensitivity(dout, q, k, v, lse, *, layout="bhsd", **kw):
    """First-order effect on (dq, dk, dv) of recomputing P = exp(S - lse) with an exponent error.

    The backward recomputes P from a stored lse (float32 for low-precision input), an error path
    the naive same-dtype backward does not have. An error ``e`` in the exponent (float32 rounding
    of S, once in the forward and once in the backward, probabilistic bound ``sqrt(D) u`` times
    ``max(scale |q| |k|)`` each, plus the rounding of lse itself) scales P by ``exp(e) ~ 1 + e``;
    to first order the gradients move by ``e * sens`` elementwise, with ``sens`` =
    ``scale (|P| * |dP - D|) |K|`` for dq, its transpose times ``|Q|`` for dk and ``|P|^T |dO|``
    for dv. Returns ``(e, (sens_q, sens_k, sens_v))`` in the shapes of q, k, v."""
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    out64, lse64 = ref.naive_attention(q64, k64, v64, return_lse=True, layout=layout, **kw)
    p = check_attention(q, k, v, layout=layout, max_head_dim=None, **kw)
    split = lambda x: views.split_heads(views.canonical(x, layout), p.num_heads_k)  # noqa: E731
    kv, vv = views.kv_view(views.canonical(k64, layout)), views.kv_view(views.canonical(v64, layout))
    qv, dov, ov = split(q64), split(do64), split(out64)
    lse_in = lse64[None] if layout == "bhsd" and q.ndim == 2 else lse64
    lse_v = views.split_heads(lse_in[..., None], p.num_heads_k)[..., 0]
    scale = p.softmax_scale
    s = qv @ kv.swapaxes(-1, -2) * scale
    mask = masks.problem_mask(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    empty = np.isneginf(lse_v)[..., None]
    probs = np.where(empty, 0, np.exp(s - np.where(empty, 0, lse_v[..., None])))
    keep = problem_keep(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
    keep = 1.0 if keep is None else keep
    a = probs * np.abs((dov @ vv.swapaxes(-1, -2)) * keep - np.sum(dov * ov, axis=-1)[..., None])
    sens = [np.zeros(x.shape) for x in (q, k, v)]
    split(sens[0])[...] = abs(scale) * (a @ np.abs(kv))
    views.canonical(sens[1], layout)[...] = abs(scale) * (a.swapaxes(-1, -2) @ np.abs(qv)).sum(axis=-3)
    views.canonical(sens[2], layout)[...] = ((probs * keep).swapaxes(-1, -2) @ np.abs(dov)).sum(axis=-3)
    u = 2.0**-53 if q.dtype == dtypes.float64 else 2.0**-24  # unit roundoff of the accumulator
    s_abs = abs(scale) * np.max(np.abs(qv) @ np.abs(kv).swapaxes(-1, -2), initial=0.0)
    finite = np.isfinite(lse)
    e = 2 * np.sqrt(p.head_dim) * u * s_abs + 2 * u * np.max(np.abs(lse[finite]), initial=0.0)
    return e, sens


def cancellation_term(dout, q, k, v, *, layout="bhsd", **kw):
    """Elementwise effect on (dq, dk, dv) of the float32 rounding of ``dP - D``.

    ``dP_ij = dO_i . V_j`` and ``D_i = dO_i . O_i`` are summed in float32 in different orders (a
    kernel's D comes from its own pre-pass), so their difference carries an absolute error up to
    about ``c_i = 2 sqrt(Dv) u max(|dO_i| . |V_j|)`` even where it is exactly 0 in exact
    arithmetic (a single visible key: O = V). It reaches ``dq_i`` as ``scale sum_j P_ij c_i |K_j|``
    and ``dk_j`` as ``scale sum_i P_ij c_i |Q_i|``; dv does not see it."""
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    p = check_attention(q, k, v, layout=layout, max_head_dim=None, **kw)
    split = lambda x: views.split_heads(views.canonical(x, layout), p.num_heads_k)  # noqa: E731
    kv, vv = views.kv_view(views.canonical(k64, layout)), views.kv_view(views.canonical(v64, layout))
    qv, dov = split(q64), split(do64)
    _, lse64 = ref.naive_attention(q64, k64, v64, return_lse=True, layout=layout, **kw)
    lse_in = lse64[None] if layout == "bhsd" and q.ndim == 2 else lse64
    lse_v = views.split_heads(lse_in[..., None], p.num_heads_k)[..., 0]
    s = qv @ kv.swapaxes(-1, -2) * p.softmax_scale
    mask = masks.problem_mask(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    empty = np.isneginf(lse_v)[..., None]
    probs = np.where(empty, 0, np.exp(s - np.where(empty, 0, lse_v[..., None])))
    u = 2.0**-53 if q.dtype == dtypes.float64 else 2.0**-24
    c = 2 * np.sqrt(p.head_dim_v) * u * np.max(np.abs(dov) @ np.abs(vv).swapaxes(-1, -2), axis=-1, initial=0.0)
    keep = problem_keep(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))   # dP's rounding scaled by Z / (1 - p)
    if keep is not None:
        # With dropout, D = dO . O uses the stored O, rounded to the dtype, while dP Z / (1 - p)
        # uses V: they no longer cancel exactly even with one visible key (O = V / (1 - p) is not
        # representable; without dropout O = V is), an error the same-dtype baseline can dodge
        # when its rounded dP and D round alike. Its size: |dO_i| . |O_i| times the dtype's unit.
        out64 = ref.naive_attention(q64, k64, v64, layout=layout, **kw)
        unit = {np.dtype(dtypes.float16): 2.0**-11, np.dtype(dtypes.bfloat16): 2.0**-8}.get(np.dtype(q.dtype), u)
        c = c + unit * np.sum(np.abs(dov) * np.abs(split(out64)), axis=-1)
    pc = probs * c[..., None] * (1.0 if keep is None else 1.0 + keep)
    terms = [np.zeros(x.shape) for x in (q, k, v)]
    split(terms[0])[...] = abs(p.softmax_scale) * (pc @ np.abs(kv))
    views.canonical(terms[1], layout)[...] = abs(p.softmax_scale) * (pc.swapaxes(-1, -2) @ np.abs(qv)).sum(axis=-3)
    return terms


def check_grads_close(actual, dout, q, k, v, out, lse, **kw):
    """Tolerance rule of DESIGN.md §5 for gradients: elementwise, the error of each of dq, dk, dv
    against the float64 gradients is at most twice the (max) error of the same-dtype naive
    backward, plus a floor (:func:`grad_floor`, flash-attn's), plus the first-order effect of
    recomputing P from the stored lse (:func:`recompute_sensitivity`; it matters for float32 and
    for large logits, and is negligible against fp16/bf16 rounding), plus the float32 rounding of
    dP - D (:func:`cancellation_term`). Returns the three max errors."""
    expected = exact_grads(dout, q, k, v, **kw)
    baseline = naive_backward_same_dtype(dout, q, k, v, out, **kw)
    e, sens = recompute_sensitivity(dout, q, k, v, lse, **kw)
    cancel = cancellation_term(dout, q, k, v, **kw)
    errs = []
    for name, a, x, b, sn, cn in zip(("dq", "dk", "dv"), actual, expected, baseline, sens, cancel):
        assert a.shape == x.shape, (name, a.shape, x.shape)
        a = np.asarray(a, dtype=np.float64)
        assert not np.isnan(a).any(), f"NaN in {name} of finite input"
        base_err = np.max(np.abs(b - x), initial=0.0)
        excess = np.abs(a - x) - (2 * base_err + grad_floor(x, q.dtype) + e * sn + cn)
        assert (excess <= 0).all(), (
            f"{name}: error exceeds 2 * same-dtype naive error {base_err:.3g} + floor + recompute term "
            f"by {excess.max():.3g}"
        )
        errs.append(np.max(np.abs(a - x), initial=0.0))
    return errs


def assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, **kw):
    """dq, dk, dv of a kernel (``grads``) within twice the error of the same-dtype NumPy path plus
    :func:`grad_floor`, against the float64 path (``kw``: the call's options, e.g. a traced
    ``score_mod``/``mask_mod``, which the same-dtype path takes where the naive one does not).
    When ``grads`` ends with a dict (``return_dscore_mod``), each captured array's gradient is
    held to the same rule (the same arrays named)."""
    import cuflash

    arrays = isinstance(grads[-1], dict)
    kw = dict(kw, return_dscore_mod=True) if arrays else kw
    fwd = {n: x for n, x in kw.items() if n != "return_dscore_mod"}
    f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
    o64, l64 = cuflash.attention(*f64[:3], return_lse=True, **fwd)
    exact = cuflash.attention_backward(f64[3], *f64[:3], o64, l64, **kw)
    o16, l16 = cuflash.attention(q, k, v, return_lse=True, **fwd)
    same = cuflash.attention_backward(dout, q, k, v, o16, l16, **kw)
    named = list(zip(("dq", "dk", "dv"), grads, exact, same))
    if arrays:
        assert sorted(grads[-1]) == sorted(exact[-1]), (sorted(grads[-1]), sorted(exact[-1]))
        named += [(f"d {n}", grads[-1][n], exact[-1][n], same[-1][n]) for n in sorted(exact[-1])]
    for name, a, x, base in named:
        a = np.asarray(a, np.float64)
        assert not np.isnan(a).any(), name
        base_err = float(np.max(np.abs(np.asarray(base, np.float64) - x)))
        excess = np.abs(a - x) - (2 * base_err + grad_floor(x, dtype) + 1e-6)
        assert (excess <= 0).all(), f"{name}: error exceeds the rule by {excess.max():.3g}"
