"""The accuracy rule every cuflash backend is held to (docs/testing.md; flash-attn's test rule).

An implementation's error against the float64 reference may be at most twice the error of a
naive implementation computed in the input's dtype, plus a small floor::

    max|actual - reference| <= 2 * max|naive_same_dtype - reference| + floor(dtype)

The same functions serve the test suite (``tests/``) and the GPU self-check
(``python -m cuflash check``), so both apply one rule. The float64 reference here is the
naive float64 attention of :func:`cuflash.reference.naive_attention`, computed for a subset of
query rows when asked (the GPU check samples rows of long sequences).

fp8 (``float8_e4m3fn``) input, derived the same way. The reference is the float64 attention of
the descaled fp8 values (``float64(x) * descale``: the input the caller gave, without error).
The baseline is a naive implementation that makes exactly the roundings an fp8 forward cannot
avoid, and no others: its inputs are the fp8 values (exact), descaled in float32; the products
of two e4m3 values are exact in float32 and the scores accumulate in float32 (S is not rounded:
FA3 keeps it in float32 registers); the softmax runs in float32; ``P`` is rounded to e4m3
before ``P @ V``, because the second fp8 GEMM takes it as an e4m3 operand (3 mantissa bits:
relative error up to 2**-4 per weight, the dominant term); ``P @ V`` accumulates in float32 and
the output is rounded to ``out_dtype``. The bound is twice that baseline's error plus the floor
of ``out_dtype`` (the result's type, not e4m3: the output is never fp8). An implementation
that keeps P in float32 (the NumPy path) meets it with a wide margin; a kernel that rounds P to
e4m3 is held to twice what rounding P costs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from cuflash.reference.forward import naive_rows
from cuflash.runtime import dtypes
from cuflash.runtime.options import DropoutOptions, Fp8Options, ModifierOptions, Options
from cuflash.runtime.validation import check_attention
from cuflash.runtime.validation_fp8 import check_out_dtype

__all__ = ["attention_rows", "naive_same_dtype", "floor_for", "result_dtype", "score_rounding_bound", "bound",
           "rule_bound", "Verdict", "judge", "compare"]

_FUNC = "cuflash.reference.tolerance"


def attention_rows(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
                   rows=None, same_dtype=False, dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
                   alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None, q_descale=None, k_descale=None,
                   v_descale=None, out_dtype=None):
    """Naive attention of the query ``rows`` (default: all), float64 or as a same-dtype framework.

    ``same_dtype=False``: float64 throughout, the reference. ``same_dtype=True``: the baseline of
    the rule, naive attention as a framework computes it in q's dtype: ``S = q k^T`` from float32
    matmuls rounded to the dtype, scaled and rounded again, softmax in float32, ``P`` rounded to
    the dtype before ``P @ V`` (float32 accumulation), the output rounded to the dtype. float64
    input has no separate baseline: both forms are the float64 reference.

    Parameters
    ----------
    q, k, v : numpy.ndarray
        As :func:`cuflash.reference.naive_attention` takes them (any layout, GQA, any head dim).
    causal, softmax_scale, window_size, layout
        As for :func:`cuflash.attention`.
    rows : array_like of int, optional
        Query indices to compute (the mask keeps the full problem's bottom-right alignment).
    dropout_p, dropout_seed, dropout_offset
        Dropout with :func:`cuflash.reference.dropout_mask`'s mask (the framework baseline drops
        the rounded P and rounds again).
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod
        The score modifiers, as :func:`cuflash.attention` takes them (the framework baseline
        applies them in float32 to the rounded scores and rounds the result to the dtype again).
    q_descale, k_descale, v_descale, out_dtype
        fp8 input, as :func:`cuflash.attention` takes it: the reference descales in float64, the
        baseline is the fp8 one of the module docstring.

    Returns
    -------
    (out, lse) : float64 arrays of shapes ``(*batch, Hq, R, Dv)`` and ``(*batch, Hq, R)`` (the
        canonical "bhsd" layout, R rows); a row that sees no key gives 0 and ``-inf``.
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    return _rows(q, k, v, options, rows, same_dtype)


def _rows(q, k, v, options: Options, rows, same_dtype: bool):
    """:func:`attention_rows` of the call's ``options``."""
    p = check_attention(q, k, v, options, func=_FUNC, max_head_dim=None, fp8=True)
    rows = np.arange(p.seqlen_q) if rows is None else np.asarray(rows)
    if p.fp8 is not None:   # the fp8 rule of the module docstring
        from cuflash.reference.fp8 import dequantize

        pd, qd, kd, vd = dequantize(p, q, k, v, np.float32 if same_dtype else np.float64)
        o, lse = naive_rows(pd, qd, kd, vd, rows, round_to=p.out_dtype if same_dtype else None,
                            p_round_to=dtypes.float8_e4m3fn if same_dtype else None)
    else:
        lowp = same_dtype and p.dtype != dtypes.float64
        o, lse = naive_rows(p, q, k, v, rows, round_to=p.dtype if lowp else None)
    *batch, hk, g, r, dv = o.shape
    return (o.astype(np.float64).reshape(*batch, hk * g, r, dv),
            lse.astype(np.float64).reshape(*batch, hk * g, r))


def _in_layout(x, layout: str, q_ndim: int, *, lse: bool = False):
    """A canonical ``(*batch, Hq, Sq, ...)`` result of :func:`attention_rows` in the caller's
    layout (the "bshd" LSE is ``(B, Hq, Sq)``, canonical already)."""
    if layout == "bshd":
        return x if lse else x.swapaxes(1, 2)
    return x[0] if q_ndim == 2 else x


def naive_same_dtype(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
                     dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0, alibi_slopes=None, attn_bias=None,
                     attn_mask=None, sinks=None, score_mod=None, mask_mod=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """The baseline of the rule for all rows, as float64 values in the output's own shape
    (``q.shape[:-1] + (Dv,)`` for "bhsd", ``(B, Sq, Hq, Dv)`` for "bshd"); see
    :func:`attention_rows` (``same_dtype=True``) for how it is computed and what the keywords
    are."""
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    o, _ = _rows(q, k, v, options, None, True)
    return _in_layout(o, layout, np.ndim(q))


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


def result_dtype(q, options: Options) -> np.dtype:
    """The dtype the rule's floor is taken for: q's, or for fp8 q the call's ``out_dtype``."""
    if dtypes.is_fp8(getattr(q, "dtype", None)):
        return check_out_dtype(options.fp8.out_dtype, _FUNC)
    return np.dtype(q.dtype)


def score_rounding_bound(q, k, v, *, softmax_scale=None) -> float:
    """Error any float32-accumulating implementation may make when scores are large.

    A score s = scale * q.k computed in float32 carries an absolute error up to about
    |s|max * sqrt(D) * 2**-24 (summation order differs between implementations), and an error
    ds in a score moves the output by at most ds * max|v|. With |s| ~ 1e4 this dominates every
    other error and is random in sign, so "twice the naive error" is not a stable bound there.
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qmax = float(np.abs(np.asarray(q, np.float64)).max(initial=0))
    kmax = float(np.abs(np.asarray(k, np.float64)).max(initial=0))
    vmax = float(np.abs(np.asarray(v, np.float64)).max(initial=0))
    smax = abs(scale) * qmax * kmax * d
    return 4.0 * smax * math.sqrt(d) * 2.0**-24 * vmax


def bound(dtype, naive_error: float, *, q=None, k=None, v=None, softmax_scale=None, large_logits=False) -> float:
    """The rule: ``2 * naive_error + floor_for(dtype)``; with ``large_logits`` (q, k, v given),
    at least :func:`score_rounding_bound`."""
    b = 2.0 * naive_error + floor_for(dtype)
    if large_logits:
        b = max(b, score_rounding_bound(q, k, v, softmax_scale=softmax_scale))
    return b


def _reference_and_bound(q, k, v, options: Options, rows, large_logits: bool):
    """``(reference, reference lse, bound, naive error)`` of the rule for these inputs; with
    ``rows=None`` in the caller's layout, else canonical rows."""
    ref, ref_lse = _rows(q, k, v, options, rows, False)
    naive, _ = _rows(q, k, v, options, rows, True)
    if rows is None:
        layout = options.layout
        ref, naive = _in_layout(ref, layout, np.ndim(q)), _in_layout(naive, layout, np.ndim(q))
        ref_lse = _in_layout(ref_lse, layout, np.ndim(q), lse=True)
    base = float(np.max(np.abs(naive - ref), initial=0.0))
    tol = bound(result_dtype(q, options), base, q=q, k=k, v=v, softmax_scale=options.softmax_scale,
                large_logits=large_logits)
    return ref, ref_lse, tol, base


def rule_bound(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd", rows=None,
               large_logits=False, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
               q_descale=None, k_descale=None, v_descale=None, out_dtype=None) -> float:
    """The largest max-abs error the rule allows an implementation of attention(q, k, v, ...):
    ``2 * max|naive_same_dtype - reference| + floor_for(q.dtype)`` (see :func:`bound`); the
    keywords are :func:`compare`'s."""
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    return _reference_and_bound(q, k, v, options, rows, large_logits)[2]


class Verdict(NamedTuple):
    """:func:`judge`'s result: the verdict, a one-line account, the max abs error of the output
    under test, and the rule's bound for that call (the reference computed once for both)."""
    ok: bool
    message: str
    error: float
    bound: float


def compare(actual, q, k, v, **options) -> tuple[bool, str, float]:
    """Hold ``actual`` (and optionally its ``lse``) to the rule: :func:`judge`'s first three fields
    ``(ok, message, error)``; the keywords are :func:`judge`'s."""
    return tuple(judge(actual, q, k, v, **options)[:3])


def judge(actual, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
          rows=None, lse=None, large_logits=False, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
          softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
          q_descale=None, k_descale=None, v_descale=None, out_dtype=None) -> Verdict:
    """Hold ``actual`` (and optionally its ``lse``) to the rule.

    Parameters
    ----------
    actual : array_like
        The output rows under test in the canonical layout of :func:`attention_rows`
        (``(*batch, Hq, R, Dv)``), or the whole output in the caller's layout when ``rows`` is None.
    q, k, v, causal, softmax_scale, window_size, layout
        The call's inputs and options, as :func:`cuflash.attention` takes them.
    rows : array_like of int, optional
        The query rows ``actual`` holds (default: all).
    lse : array_like, optional
        Its log-sum-exp (canonical ``(*batch, Hq, R)``, or the caller's LSE shape when ``rows`` is
        None): the ``-inf`` pattern (rows without keys) must match the reference's exactly and
        finite values agree within ``1e-3 + 1e-4 |lse|``.
    large_logits : bool
        Allow at least :func:`score_rounding_bound` (scores of magnitude ~1e4).
    dropout_p, dropout_seed, dropout_offset
        The call's dropout (reference and baseline apply the same mask).
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod
        The call's score modifiers, applied by reference and baseline alike (a traced
        score_mod in the baseline's float32, as a framework would).
    q_descale, k_descale, v_descale, out_dtype
        fp8 input (the module docstring's fp8 rule).

    Returns
    -------
    Verdict
        ``(ok, message, error, bound)``: the verdict, a one-line account, the max abs error of
        ``actual`` and the bound it is held to. A shape mismatch or NaN anywhere in ``actual`` fails
        (the inputs are assumed finite).
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    ref, ref_lse, tol, base = _reference_and_bound(q, k, v, options, rows, large_logits)
    a = np.asarray(actual, np.float64)
    if a.shape != ref.shape:
        return Verdict(False, f"shape {a.shape} != expected {ref.shape}", math.inf, tol)
    if np.isnan(a).any():
        return Verdict(False, f"{int(np.isnan(a).sum())} NaN in the output of finite input", math.inf, tol)
    err = float(np.max(np.abs(a - ref), initial=0.0))
    if err > tol:
        return Verdict(False, f"max error {err:.3g} > bound {tol:.3g} (naive same-dtype error {base:.3g})", err, tol)
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        fin = np.isfinite(ref_lse)
        if not np.array_equal(np.isneginf(lse), ~fin) or np.isnan(lse).any():
            return Verdict(False, "lse: -inf/NaN pattern differs from the reference (empty rows)", err, tol)
        lerr = float(np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0.0))
        ltol = 1e-3 + 1e-4 * float(np.abs(ref_lse[fin]).max(initial=0.0))
        if lerr > ltol:
            return Verdict(False, f"lse error {lerr:.3g} > {ltol:.3g}", err, tol)
    return Verdict(True, f"max error {err:.2e} (bound {tol:.2e})", err, tol)
