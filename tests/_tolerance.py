"""The tolerance rule of DESIGN.md §5 (flash-attn's): an implementation's error against the
float64 reference may be at most twice the error of a naive implementation computed in the
same dtype, plus a small floor."""

from __future__ import annotations

import numpy as np

from cuflash import _dtypes, _validate
from cuflash import reference as ref


def naive_same_dtype(q, k, v, *, layout="bhsd", **kw):
    """Naive attention as a same-dtype framework computes it: S = q k^T and the output rounded
    to the input dtype after float32-accumulated matmuls, softmax in float32, P rounded to the
    input dtype before P @ V. Returns float64 values of that result."""
    dtype = q.dtype
    if dtype == _dtypes.float64:
        return ref.naive_attention(q, k, v, layout=layout, **kw)
    p = _validate.check_attention(q, k, v, layout=layout, max_head_dim=None, **kw)
    rnd = lambda x: x.astype(dtype).astype(np.float32)  # noqa: E731
    qv = ref._split_heads(ref._canonical(q, layout), p.num_heads_k).astype(np.float32)
    kv = ref._kv_view(ref._canonical(k, layout)).astype(np.float32)
    vv = ref._kv_view(ref._canonical(v, layout)).astype(np.float32)
    s = rnd(rnd(qv @ kv.swapaxes(-1, -2)) * np.float32(p.softmax_scale))
    mask = ref._visible(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    e = np.exp(s - np.where(np.isneginf(m), 0, m)[..., None])
    l = e.sum(axis=-1)
    probs = rnd(e / np.where(l > 0, l, 1)[..., None])
    o = rnd(probs @ vv)
    out = np.zeros(p.out_shape, np.float64)
    ref._split_heads(ref._canonical(out, layout), p.num_heads_k)[...] = o
    return out


def floor_for(dtype) -> float:
    """The small absolute floor of the rule.

    One unit roundoff for the 16-bit types. For float32 it is 2**-18 (64 unit roundoffs): a
    kernel accumulates its dot products and its P V sums sequentially, in float32, over up to
    256 head-dim terms and hundreds of keys, and folds softmax_scale * log2(e) into the exp2
    argument; that costs tens of ulps that a float32 NumPy baseline (blocked BLAS sums, exact
    exp of the unscaled difference) does not pay. Real bugs (a mask off by one, a missed
    rescale) cost 1e-3 and more. float64 has no kernel; its baseline is the reference itself, so
    its floor is 2**-40.
    """
    return {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-18, "float64": 2.0**-40}[np.dtype(dtype).name]


def score_rounding_bound(q, k, v, *, softmax_scale=None, **_):
    """Error any float32-accumulating implementation may make when scores are large.

    A score s = scale * q.k computed in float32 carries an absolute error up to about
    |s|max * sqrt(D) * 2**-24 (summation order differs between implementations), and an error
    ds in a score moves the output by at most ds * max|v|. With |s| ~ 1e4 this dominates every
    other error and is random in sign, so "twice the naive error" is not a stable bound there.
    """
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    qf = np.asarray(q, np.float64)
    kf = np.asarray(k, np.float64)
    smax = abs(scale) * np.abs(qf).max(initial=0) * np.abs(kf).max(initial=0) * d
    return 4.0 * smax * np.sqrt(d) * 2.0**-24 * float(np.abs(np.asarray(v, np.float64)).max(initial=0))


def check_close(actual, q, k, v, *, layout="bhsd", large_logits=False, **kw):
    """Assert ``actual`` is within the tolerance rule for attention(q, k, v, **kw); return its error.

    With ``large_logits`` the bound is the larger of the rule and :func:`score_rounding_bound`.
    """
    expected = ref.naive_attention(q, k, v, layout=layout, **kw)
    baseline = naive_same_dtype(q, k, v, layout=layout, **kw)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = np.asarray(actual, dtype=np.float64)
    assert not np.isnan(a).any(), "NaN in the output of finite input"
    err = np.max(np.abs(a - expected), initial=0.0)
    base_err = np.max(np.abs(baseline - expected), initial=0.0)
    bound = 2 * base_err + floor_for(q.dtype)
    if large_logits:
        bound = max(bound, score_rounding_bound(q, k, v, **kw))
    assert err <= bound, f"max error {err:.3g} exceeds the bound {bound:.3g} (same-dtype naive error {base_err:.3g})"
    return err
