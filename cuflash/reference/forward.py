"""Attention forward in NumPy: :func:`naive_attention` (the float64 oracle) and
:func:`flash_attention` (the tiled FlashAttention forward, the CPU path). Conventions in
:mod:`cuflash.reference`."""

from __future__ import annotations

import numpy as np

from cuflash.reference.masks import key_range, masked_matmul, problem_mask
from cuflash.reference.normalize import masked_exp
from cuflash.reference.views import canonical, check_numpy, kv_view, split_heads
from cuflash.runtime import dtypes
from cuflash.runtime.validation import AttentionProblem, check_attention, check_int

__all__ = ["naive_attention", "flash_attention", "naive_rows"]


def _empty_rows_lse(lse: np.ndarray, l: np.ndarray, m: np.ndarray) -> None:
    """``lse = m + log(l)`` where the row saw a key, ``-inf`` where it saw none (``l == 0``);
    a NaN ``l`` (non-finite input the row sees) gives NaN."""
    seen = l != 0
    with np.errstate(invalid="ignore"):
        np.copyto(lse, np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf))


# --------------------------------------------------------------------------------------------
# naive attention (float64 ground truth)


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd"):
    """Attention with S and P materialised, in float64: the ground truth.

    ``out = softmax(softmax_scale * q @ k^T + mask) @ v``, computed entirely in float64
    (Vaswani et al., 2017, eq. 1), with the conventions of the module docstring (bottom-right
    causal alignment, windows, GQA, empty rows -> 0 and ``lse = -inf``).

    Parameters
    ----------
    q : numpy.ndarray, shape ``(..., Sq, D)`` ("bhsd") or ``(B, Sq, Hq, D)`` ("bshd")
    k : numpy.ndarray, shape ``(..., Sk, D)`` or ``(B, Sk, Hk, D)``
    v : numpy.ndarray, shape ``(..., Sk, Dv)`` or ``(B, Sk, Hk, Dv)``
        One dtype among float16, bfloat16, float32, float64; any head dim.
    causal : bool
        Bottom-right aligned causal mask.
    softmax_scale : float, optional
        Scale of the scores; None means ``1/sqrt(D)``. ``0.0`` is valid (uniform weights).
    window_size : (int, int)
        ``(left, right)`` local-attention bounds, -1 = unbounded.
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's scaled scores.
    layout : {"bhsd", "bshd"}

    Returns
    -------
    out : numpy.ndarray, float64, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``
    lse : numpy.ndarray, float64, shape ``q.shape[:-1]`` or ``(B, Hq, Sq)``; only with ``return_lse``

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention` for malformed input.

    Notes
    -----
    Memory is O(batch * heads * Sq * Sk); use it on small problems.
    """
    p = check_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
        return_lse=return_lse, func="cuflash.reference.naive_attention", max_head_dim=None,
    )
    check_numpy(p)
    out = np.zeros(p.out_shape, dtype=np.float64)
    lse = np.full(p.lse_shape, -np.inf, dtype=np.float64)
    if not p.is_empty and p.num_heads_k:
        o, row_lse = naive_rows(p, q, k, v, np.arange(p.seqlen_q))
        split_heads(canonical(out, layout), p.num_heads_k)[...] = o
        lse_view = lse[..., None, :] if layout == "bhsd" and q.ndim == 2 else lse
        split_heads(lse_view[..., None], p.num_heads_k)[..., 0] = row_lse
    return (out, lse) if return_lse else out


def naive_rows(p: AttentionProblem, q, k, v, rows, round_to=None):
    """Naive attention of the query ``rows`` of the validated problem ``p``.

    The core of :func:`naive_attention` and of the tolerance rule's baseline
    (:func:`cuflash.reference.tolerance.attention_rows`). The mask keeps the whole problem's
    bottom-right alignment, whichever rows are computed.

    Parameters
    ----------
    p : AttentionProblem
        The validated call (layout, heads, lengths, scale, window).
    q, k, v : numpy.ndarray
        Its inputs.
    rows : numpy.ndarray of int
        Query indices to compute.
    round_to : numpy dtype, optional
        None: float64 throughout, ``out = (exp(S - m) @ V) / l`` (the oracle). A dtype: naive
        attention as a framework computes it in that dtype: float32 matmuls with the scores
        rounded to the dtype before and after scaling, softmax in float32, ``P`` rounded before
        ``P @ V``, the output rounded.

    Returns
    -------
    (out, lse) : arrays of shapes ``(*batch, Hk, G, R, Dv)`` and ``(*batch, Hk, G, R)`` (query
        head ``hk * G + g``; float64, or float32 holding the dtype's values); a row that sees no
        key gives 0 and ``lse = -inf``.
    """
    acc = np.float64 if round_to is None else np.float32

    def rnd(x):
        return x if round_to is None else x.astype(round_to).astype(np.float32)

    qv = split_heads(canonical(q, p.layout), p.num_heads_k)[..., rows, :].astype(acc)
    kv = kv_view(canonical(k, p.layout)).astype(acc)
    vv = kv_view(canonical(v, p.layout)).astype(acc)
    s = rnd(rnd(qv @ kv.swapaxes(-1, -2)) * acc(p.softmax_scale))
    mask = problem_mask(p, rows, np.arange(p.seqlen_k))
    e, l, shift = masked_exp(s, mask)
    seen = l != 0  # NaN l (non-finite input the row sees) counts as seen: its NaN comes out
    l_safe = np.where(seen, l, 1)[..., None]
    with np.errstate(invalid="ignore"):
        o = masked_matmul(e, vv, mask) / l_safe if round_to is None else rnd(rnd(e / l_safe) @ vv)
        lse = np.where(seen, shift + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


# --------------------------------------------------------------------------------------------
# tiled forward (the CPU path)


def flash_attention(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
    block_m=128, block_n=128, out=None,
):
    """The tiled FlashAttention forward in NumPy: the CPU path of :func:`cuflash.attention`.

    For each ``block_m``-row query tile, K/V tiles of ``block_n`` rows are streamed; each row
    keeps a running maximum ``m``, a running sum ``l`` and an accumulator ``acc`` (float32, or
    float64 for float64 input)::

        S     = softmax_scale * Q_i K_j^T          (masked entries -inf)
        m_new = max(m, rowmax(S))
        P     = exp(S - m_new)
        l     = exp(m - m_new) * l + rowsum(P)
        acc   = exp(m - m_new) * acc + P V_j

    and after the K/V loop ``out = acc / l`` (one division) and ``lse = m + log(l)``
    (FlashAttention-2, Dao 2023, Algorithm 1). Rows whose running maximum is still ``-inf``
    shift by 0 instead, so a tile in which a row sees no key adds nothing and makes no NaN.
    Non-finite input is never hidden: a NaN or inf in q row ``i`` or in a key or value that row
    ``i`` sees makes row ``i`` non-finite (as the float64 oracle's), and nothing else; values
    the row does not see are left out of ``P V`` rather than multiplied by 0.
    Key tiles that no row of the query tile can see (causal, windows) are skipped.

    Parameters
    ----------
    q, k, v, causal, softmax_scale, window_size, return_lse, layout
        As :func:`naive_attention`; head dims are not limited here.
    block_m, block_n : int
        Query rows (Br) and key rows (Bc) per tile, >= 1.
    out : numpy.ndarray, optional
        Output buffer of the result's shape and q's dtype; written in place and returned.

    Returns
    -------
    out : numpy.ndarray of q's dtype, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``
    lse : numpy.ndarray, float32 (float64 for float64 input), shape ``q.shape[:-1]`` or
        ``(B, Hq, Sq)``; natural log; only with ``return_lse``

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention` for malformed input; ``ValueError`` for tile sizes < 1.

    Notes
    -----
    Peak extra memory is O(batch * heads * (block_m * block_n + block_m * Dv)): the
    ``Sq x Sk`` matrices never exist.
    """
    func = "cuflash.reference.flash_attention"
    p = check_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
        out=out, return_lse=return_lse, func=func, max_head_dim=None,
    )
    check_numpy(p)
    block_m = check_int(block_m, "block_m", func)
    block_n = check_int(block_n, "block_n", func)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 1:
            raise ValueError(f"{func}: {name} must be >= 1, got {value}")
    return _flash_forward(p, q, k, v, block_m, block_n, out, return_lse)


def _flash_forward(p: AttentionProblem, q, k, v, block_m, block_n, out, return_lse):
    acc_t = dtypes.accumulator(p.dtype)
    if out is None:
        out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.full(p.lse_shape, -np.inf, dtype=acc_t)
    if p.is_empty:
        return (out, lse) if return_lse else out
    out_v = split_heads(canonical(out, p.layout), p.num_heads_k)
    lse_v = lse[None] if p.layout == "bhsd" and q.ndim == 2 else lse
    lse_v = split_heads(lse_v[..., None], p.num_heads_k)[..., 0]
    qv = split_heads(canonical(q, p.layout), p.num_heads_k)
    kv = kv_view(canonical(k, p.layout))
    vv = kv_view(canonical(v, p.layout))
    scale = acc_t.type(p.softmax_scale)
    for r0 in range(0, p.seqlen_q, block_m):
        r1 = min(r0 + block_m, p.seqlen_q)
        q_tile = qv[..., r0:r1, :].astype(acc_t)
        rows = np.arange(r0, r1)
        stat_shape = q_tile.shape[:-1]
        m = np.full(stat_shape, -np.inf, dtype=acc_t)
        l = np.zeros(stat_shape, dtype=acc_t)
        acc = np.zeros(stat_shape + (p.head_dim_v,), dtype=acc_t)
        lo, hi = key_range(p, r0, r1)
        for c0 in range(lo - lo % block_n, hi, block_n):
            c1 = min(c0 + block_n, hi)
            s = (q_tile @ kv[..., c0:c1, :].astype(acc_t).swapaxes(-1, -2)) * scale
            mask = problem_mask(p, rows, np.arange(c0, c1))
            if mask is not None:
                s = np.where(mask, s, acc_t.type(-np.inf))
            m_new = np.maximum(m, s.max(axis=-1))
            shift = np.where(np.isneginf(m_new), acc_t.type(0), m_new)
            with np.errstate(invalid="ignore"):  # non-finite input: inf - inf, 0 * inf stay NaN
                alpha = np.exp(m - shift)
                probs = np.exp(s - shift[..., None])
                l = alpha * l + probs.sum(axis=-1)
                acc = alpha[..., None] * acc + masked_matmul(probs, vv[..., c0:c1, :].astype(acc_t), mask)
            m = m_new
        seen = l != 0  # l == 0: no key; a NaN l (non-finite input the row sees) stays NaN
        out_v[..., r0:r1, :] = np.where(seen[..., None], acc / np.where(seen, l, 1)[..., None], 0).astype(p.dtype)
        _empty_rows_lse(lse_v[..., r0:r1], l, m)
    return (out, lse) if return_lse else out
