"""NumPy implementations of attention and softmax: the test oracle and the CPU path.

Every algorithm of the seed write-up (``shared/seed``) lives here, vectorised over batch and heads:

* :func:`naive_attention` materialises ``S = scale * Q K^T`` and ``P = softmax(S)`` in float64;
  it is the ground truth every kernel is checked against.
* :func:`softmax` is the three-pass softmax (max, sum of exponentials, normalise).
* :func:`online_softmax` is the block-wise online normaliser of Milakov & Gimelshein,
  "Online normalizer calculation for softmax" (2018), eq. (1)-(3): one pass keeps a running
  maximum ``m`` and a running sum ``l`` that is rescaled by ``exp(m_old - m_new)`` whenever the
  maximum grows; a second pass normalises.
* :func:`flash_attention` is the fused tiled forward of FlashAttention (Dao et al., 2022,
  Algorithm 1; FlashAttention-2, Dao 2023, Algorithm 1 for the single final division): Br x Bc
  tiles, running ``m`` and ``l`` per query row, a rescaled accumulator, one division after the
  K/V loop. Its extra memory is O(batch * heads * Br * Bc), never O(Sq * Sk). It is what
  :func:`cuflash.attention` runs on NumPy input.

Errata in the seed, corrected here: its standalone online softmax scales the block's local sum
twice and never rescales the values of earlier blocks (rows do not sum to 1); its fused forward
gives NaN for a tile in which a row sees no key (``exp(-inf - -inf)``) and writes O inside the
K/V loop. Here a row whose running maximum is still ``-inf`` uses 0 as its shift, so masked
entries contribute ``exp(-inf) = 0`` and nothing becomes NaN.

Conventions (shared with every cuflash backend)
-----------------------------------------------
* Layout ``"bhsd"``: q ``(..., Sq, D)``, k ``(..., Sk, D)``, v ``(..., Sk, Dv)``; the axis -3
  (when present) holds heads. Layout ``"bshd"``: q ``(B, Sq, H, D)``.
* GQA/MQA: ``Hq % Hk == 0`` and query head ``h`` reads kv head ``h // (Hq // Hk)``.
* Causal masks are aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
  ``window_size=(left, right)`` keeps keys with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
  (-1 = unbounded); ``causal=True`` sets ``right = 0``.
* ``lse`` is the natural-log log-sum-exp of the scaled scores of each query row.
* A query row that sees no key gets output 0 and ``lse = -inf``.
"""

from __future__ import annotations

import numpy as np

from cuflash import _dtypes
from cuflash._validate import AttentionProblem, check_attention, check_int

__all__ = ["naive_attention", "softmax", "online_softmax", "flash_attention"]


# --------------------------------------------------------------------------------------------
# softmax


def _check_softmax_input(x, axis, func):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{func}: x must be a numpy.ndarray, got {type(x).__module__}.{type(x).__qualname__}")
    if _dtypes.supported_or_none(x.dtype) is None:
        raise TypeError(
            f"{func}: x.dtype={x.dtype.name} is not supported; expected one of "
            f"{', '.join(dt.name for dt in _dtypes.SUPPORTED)}"
        )
    axis = check_int(axis, "axis", func)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{func}: axis={axis} is out of range for x.ndim={x.ndim}")
    return axis


def softmax(x, axis=-1):
    """Three-pass softmax: row maximum, sum of shifted exponentials, normalisation.

    Parameters
    ----------
    x : numpy.ndarray
        float16, bfloat16, float32 or float64, any shape.
    axis : int
        Axis along which the values sum to 1.

    Returns
    -------
    numpy.ndarray
        Same shape as ``x``; float64 for float64 input, float32 otherwise (the accumulation type).
        A slice that is entirely ``-inf`` gives NaN, as in SciPy and PyTorch (attention's
        empty-row rule, output 0, is attention's own).

    Raises
    ------
    TypeError
        If ``x`` is not a NumPy array of a supported dtype.
    ValueError
        If ``axis`` is out of range.
    """
    axis = _check_softmax_input(x, axis, "cuflash.reference.softmax")
    xa = x.astype(_dtypes.accumulator(x.dtype), copy=False)
    m = np.max(xa, axis=axis, keepdims=True)  # pass 1
    with np.errstate(invalid="ignore"):
        e = np.exp(xa - m)  # all -inf slice: -inf - -inf = NaN, as documented
    return e / np.sum(e, axis=axis, keepdims=True)  # passes 2 and 3


def online_softmax(x, axis=-1, *, block_size=128):
    """Online softmax: one pass for the running max and rescaled sum, one pass to normalise.

    The recurrence of Milakov & Gimelshein (2018), applied block-wise: for each block ``b`` of
    ``block_size`` values along ``axis``::

        m_new = max(m, max(x_b))
        l     = l * exp(m - m_new) + sum(exp(x_b - m_new))
        m     = m_new

    then ``y = exp(x - m) / l``. Reading ``x`` twice and writing ``y`` once is the minimum HBM
    traffic of a standalone softmax (the seed counts one read; see DESIGN.md §1, errata).

    Parameters
    ----------
    x : numpy.ndarray
        float16, bfloat16, float32 or float64.
    axis : int
        Axis to normalise.
    block_size : int
        Number of values per block of the first pass (>= 1).

    Returns
    -------
    numpy.ndarray
        As :func:`softmax`: float64 for float64 input, float32 otherwise; an all ``-inf`` slice
        gives NaN.

    Raises
    ------
    TypeError, ValueError
        As :func:`softmax`; ``ValueError`` for ``block_size < 1``.
    """
    func = "cuflash.reference.online_softmax"
    axis = _check_softmax_input(x, axis, func)
    block_size = check_int(block_size, "block_size", func)
    if block_size < 1:
        raise ValueError(f"{func}: block_size must be >= 1, got {block_size}")
    acc = _dtypes.accumulator(x.dtype)
    xa = np.moveaxis(x, axis, -1)
    n = xa.shape[-1]
    m = np.full(xa.shape[:-1], -np.inf, dtype=acc)
    l = np.zeros(xa.shape[:-1], dtype=acc)
    for start in range(0, n, block_size):
        block = xa[..., start : start + block_size].astype(acc)
        m_new = np.maximum(m, block.max(axis=-1))
        shift = np.where(np.isneginf(m_new), 0, m_new)  # no -inf - -inf while a row is all -inf
        l = l * np.exp(m - shift) + np.exp(block - shift[..., None]).sum(axis=-1)
        m = m_new
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.exp(xa.astype(acc, copy=False) - m[..., None]) / l[..., None]
    return np.moveaxis(y, -1, axis)


# --------------------------------------------------------------------------------------------
# attention: shared helpers


def _canonical(x: np.ndarray, layout: str) -> np.ndarray:
    """View of ``x`` as ``(*batch, H, S, D)`` (no copy)."""
    if layout == "bshd":
        return x.swapaxes(1, 2)
    if x.ndim == 2:
        return x[None]
    return x


def _split_heads(x: np.ndarray, num_heads_k: int) -> np.ndarray:
    """View ``(*batch, H, S, D)`` as ``(*batch, Hk, H // Hk, S, D)``; never copies."""
    *batch, h, s, d = x.shape
    *bs, sh, ss, sd = x.strides
    g = h // num_heads_k if num_heads_k else 0
    return np.lib.stride_tricks.as_strided(
        x, shape=(*batch, num_heads_k, g, s, d), strides=(*bs, g * sh, sh, ss, sd), writeable=x.flags.writeable
    )


def _kv_view(x: np.ndarray) -> np.ndarray:
    """View ``(*batch, Hk, S, D)`` as ``(*batch, Hk, 1, S, D)`` so it broadcasts over a group."""
    return x[..., None, :, :]


def visible_mask(rows, cols, seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1):
    """Which keys each query row sees: the masking convention of every cuflash backend.

    Query ``i`` sees key ``j`` iff ``i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right``
    (bottom-right alignment; -1 = unbounded side; causal is ``window_right = 0``).

    Parameters
    ----------
    rows, cols : array_like of int
        Query and key indices.
    seqlen_q, seqlen_k : int
        The problem's lengths (they set the diagonal's offset ``Sk - Sq``).
    window_left, window_right : int
        Effective window bounds, -1 for unbounded.

    Returns
    -------
    numpy.ndarray of bool, shape ``(len(rows), len(cols))``, or None when every key is visible.
    """
    diag = np.asarray(rows)[:, None] + (seqlen_k - seqlen_q)
    cols = np.asarray(cols)[None, :]
    mask = None
    if window_right >= 0:
        mask = cols <= diag + window_right
    if window_left >= 0:
        lower = cols >= diag - window_left
        mask = lower if mask is None else mask & lower
    return mask


def _visible(p: AttentionProblem, rows: np.ndarray, cols: np.ndarray) -> np.ndarray | None:
    """:func:`visible_mask` for a validated problem."""
    return visible_mask(rows, cols, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)


def _key_range(p: AttentionProblem, row_start: int, row_stop: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that any query row in ``[row_start, row_stop)`` can see."""
    offset = p.seqlen_k - p.seqlen_q
    lo, hi = 0, p.seqlen_k
    if p.window_left >= 0:
        lo = max(lo, row_start + offset - p.window_left)
    if p.window_right >= 0:
        hi = min(hi, row_stop - 1 + offset + p.window_right + 1)
    return lo, max(lo, hi)


def _check_numpy(problem: AttentionProblem) -> None:
    if problem.kind != "numpy":
        raise TypeError(
            f"{problem.func}: the NumPy reference takes numpy.ndarray inputs; got q of type "
            f"{problem.q.type_name}"
        )


def _empty_rows_lse(lse: np.ndarray, l: np.ndarray, m: np.ndarray) -> None:
    """``lse = m + log(l)`` where the row saw a key, ``-inf`` where it saw none."""
    seen = l > 0
    with np.errstate(divide="ignore"):
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
    _check_numpy(p)
    out = np.zeros(p.out_shape, dtype=np.float64)
    lse = np.full(p.lse_shape, -np.inf, dtype=np.float64)
    if not p.is_empty and p.num_heads_k:
        qv = _split_heads(_canonical(q, layout), p.num_heads_k).astype(np.float64)
        kv = _kv_view(_canonical(k, layout)).astype(np.float64)
        vv = _kv_view(_canonical(v, layout)).astype(np.float64)
        s = (qv @ kv.swapaxes(-1, -2)) * p.softmax_scale
        mask = _visible(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        m = s.max(axis=-1, initial=-np.inf)
        shift = np.where(np.isneginf(m), 0.0, m)
        e = np.exp(s - shift[..., None])
        l = e.sum(axis=-1)
        o = (e @ vv) / np.where(l > 0, l, 1.0)[..., None]
        _split_heads(_canonical(out, layout), p.num_heads_k)[...] = o
        lse_view = lse[..., None, :] if layout == "bhsd" and q.ndim == 2 else lse
        _empty_rows_lse(_split_heads(lse_view[..., None], p.num_heads_k)[..., 0], l, m)
    return (out, lse) if return_lse else out


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
    _check_numpy(p)
    block_m = check_int(block_m, "block_m", func)
    block_n = check_int(block_n, "block_n", func)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 1:
            raise ValueError(f"{func}: {name} must be >= 1, got {value}")
    return _flash_forward(p, q, k, v, block_m, block_n, out, return_lse)


def _flash_forward(p: AttentionProblem, q, k, v, block_m, block_n, out, return_lse):
    acc_t = _dtypes.accumulator(p.dtype)
    if out is None:
        out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.full(p.lse_shape, -np.inf, dtype=acc_t)
    if p.is_empty:
        return (out, lse) if return_lse else out
    out_v = _split_heads(_canonical(out, p.layout), p.num_heads_k)
    lse_v = lse[None] if p.layout == "bhsd" and q.ndim == 2 else lse
    lse_v = _split_heads(lse_v[..., None], p.num_heads_k)[..., 0]
    qv = _split_heads(_canonical(q, p.layout), p.num_heads_k)
    kv = _kv_view(_canonical(k, p.layout))
    vv = _kv_view(_canonical(v, p.layout))
    scale = acc_t.type(p.softmax_scale)
    for r0 in range(0, p.seqlen_q, block_m):
        r1 = min(r0 + block_m, p.seqlen_q)
        q_tile = qv[..., r0:r1, :].astype(acc_t)
        rows = np.arange(r0, r1)
        stat_shape = q_tile.shape[:-1]
        m = np.full(stat_shape, -np.inf, dtype=acc_t)
        l = np.zeros(stat_shape, dtype=acc_t)
        acc = np.zeros(stat_shape + (p.head_dim_v,), dtype=acc_t)
        lo, hi = _key_range(p, r0, r1)
        for c0 in range(lo - lo % block_n, hi, block_n):
            c1 = min(c0 + block_n, hi)
            s = (q_tile @ kv[..., c0:c1, :].astype(acc_t).swapaxes(-1, -2)) * scale
            mask = _visible(p, rows, np.arange(c0, c1))
            if mask is not None:
                s = np.where(mask, s, acc_t.type(-np.inf))
            m_new = np.maximum(m, s.max(axis=-1))
            shift = np.where(np.isneginf(m_new), acc_t.type(0), m_new)
            alpha = np.exp(m - shift)
            probs = np.exp(s - shift[..., None])
            l = alpha * l + probs.sum(axis=-1)
            acc = alpha[..., None] * acc + probs @ vv[..., c0:c1, :].astype(acc_t)
            m = m_new
        seen = l > 0
        out_v[..., r0:r1, :] = np.where(seen[..., None], acc / np.where(seen, l, 1)[..., None], 0).astype(p.dtype)
        _empty_rows_lse(lse_v[..., r0:r1], l, m)
    return (out, lse) if return_lse else out


# The backward lives in its own module; it uses the helpers above, so it is imported last.
from cuflash._reference_backward import attention_backward, flash_attention_backward  # noqa: E402

__all__ += ["attention_backward", "flash_attention_backward"]
