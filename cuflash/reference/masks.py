"""The masking rule of every cuflash backend, and the tile ranges it implies."""

from __future__ import annotations

import numpy as np

from cuflash.runtime.validation import AttentionProblem

__all__ = ["visible_mask", "problem_mask", "key_range", "query_range", "masked_matmul"]


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


def problem_mask(p: AttentionProblem, rows: np.ndarray, cols: np.ndarray) -> np.ndarray | None:
    """:func:`visible_mask` for a validated problem."""
    return visible_mask(rows, cols, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)


def key_range(p: AttentionProblem, row_start: int, row_stop: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that any query row in ``[row_start, row_stop)`` can see."""
    offset = p.seqlen_k - p.seqlen_q
    lo, hi = 0, p.seqlen_k
    if p.window_left >= 0:
        lo = max(lo, row_start + offset - p.window_left)
    if p.window_right >= 0:
        hi = min(hi, row_stop - 1 + offset + p.window_right + 1)
    return lo, max(lo, hi)


def query_range(p: AttentionProblem, col_start: int, col_stop: int) -> tuple[int, int]:
    """Query rows ``[lo, hi)`` that see at least one key of ``[col_start, col_stop)`` under the
    window bounds (the transpose of :func:`key_range`)."""
    offset = p.seqlen_k - p.seqlen_q
    lo, hi = 0, p.seqlen_q
    if p.window_right >= 0:  # j <= i + offset + right  <=>  i >= j - offset - right
        lo = max(lo, col_start - offset - p.window_right)
    if p.window_left >= 0:  # j >= i + offset - left  <=>  i <= j - offset + left
        hi = min(hi, col_stop - 1 - offset + p.window_left + 1)
    return lo, max(lo, hi)


def masked_matmul(a: np.ndarray, b: np.ndarray, visible: np.ndarray | None) -> np.ndarray:
    """``a @ b`` summing only the pairs ``(i, j)`` where ``visible[..., i, j]`` is true.

    ``a`` holds attention weights (or their gradients) and is 0 where a pair is not visible; a
    plain matmul would still form ``0 * b[j]`` there, which is NaN when row ``j`` of ``b`` holds
    a NaN or an inf. The rule of docs/conventions.md is that non-finite input reaches a row only along
    the pairs it sees, so here such products are left out: for the (few) rows of ``b`` with a
    non-finite entry the products are formed one by one and the invisible ones dropped; the rest
    is one matmul. ``visible=None`` means every pair is visible.

    Parameters
    ----------
    a : numpy.ndarray, shape ``(..., M, K)``
    b : numpy.ndarray, shape ``(..., K, N)`` (broadcasting as ``a @ b``)
    visible : numpy.ndarray of bool broadcastable to ``a``, or None

    Returns
    -------
    numpy.ndarray, shape of ``a @ b``
    """
    bad = ~np.isfinite(b)
    if visible is None or not bad.any():
        return a @ b
    ks = np.flatnonzero(bad.any(axis=tuple(range(b.ndim - 2)) + (b.ndim - 1,)))
    out = a @ np.where(bad, 0, b)
    vis = np.broadcast_to(visible, a.shape)[..., ks]
    with np.errstate(invalid="ignore"):  # the invisible 0 * inf formed here are dropped next
        terms = a[..., ks, None] * np.where(bad, b, 0)[..., ks, :][..., None, :, :]   # (..., M, J, N)
        return out + np.where(vis[..., None], terms, 0).sum(axis=-2)
