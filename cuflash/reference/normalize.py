"""Softmax in NumPy: the three-pass form and the online normaliser (Milakov & Gimelshein 2018)."""

from __future__ import annotations

import numpy as np

from cuflash.reference.memory import check_memory, nbytes
from cuflash.runtime import dtypes
from cuflash.runtime.validation import check_int

__all__ = ["softmax", "online_softmax", "masked_exp", "run_online_softmax", "online_softmax_memory"]


def _check_softmax_input(x, axis, func):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{func}: x must be a numpy.ndarray, got {type(x).__module__}.{type(x).__qualname__}")
    if dtypes.supported_or_none(x.dtype) is None:
        raise TypeError(
            f"{func}: x.dtype={x.dtype.name} is not supported; expected one of "
            f"{', '.join(dt.name for dt in dtypes.SUPPORTED)}"
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
    xa = x.astype(dtypes.accumulator(x.dtype), copy=False)
    if xa.size == 0:   # no slice, or slices of no element: nothing to normalise (np.max has no identity)
        return xa.copy()
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
    traffic of a standalone softmax (one read is not enough: the maximum must be known before the
    sum is final; see docs/kernels.md, "Corrections to the textbook algorithm").

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
    MemoryError
        When the result and the blocks (:func:`online_softmax_memory`) exceed the available
        memory (:func:`cuflash.reference.memory.available_bytes`), before anything is allocated.
    """
    func = "cuflash.reference.online_softmax"
    axis = _check_softmax_input(x, axis, func)
    block_size = check_int(block_size, "block_size", func)
    if block_size < 1:
        raise ValueError(f"{func}: block_size must be >= 1, got {block_size}")
    return run_online_softmax(x, axis, block_size, func)


def online_softmax_memory(shape, dtype, block_size: int) -> dict:
    """Bytes :func:`run_online_softmax` allocates for ``x`` of ``shape`` and ``dtype``, by array:
    the result (the accumulation type), the running ``m``, ``l`` and shift of each slice, and the
    converted block with its exponentials."""
    acc = dtypes.accumulator(dtype)
    slices = nbytes(shape[:-1], acc) if shape else acc.itemsize
    return {"the result (x's shape, float32 or float64)": nbytes(shape, acc), "x's row statistics": 3 * slices,
            "x's blocks": 3 * slices * min(block_size, shape[-1] if shape else 1)}


def run_online_softmax(x: np.ndarray, axis: int, block_size: int, func: str) -> np.ndarray:
    """:func:`online_softmax` of validated input (``axis`` in range, ``block_size >= 1``), after
    checking its working memory (:func:`online_softmax_memory`) against
    :func:`cuflash.reference.memory.available_bytes`; ``func`` names the public function in a
    ``MemoryError``. The normalising pass writes the result in place (one array of ``x``'s size).

    Raises
    ------
    MemoryError
        When the working memory exceeds the available memory.
    """
    acc = dtypes.accumulator(x.dtype)
    xa = np.moveaxis(x, axis, -1)
    check_memory(func, online_softmax_memory(xa.shape, x.dtype, block_size))
    if xa.size == 0:   # no slice, or empty slices: nothing to loop over, however long the axis
        return np.moveaxis(np.empty(xa.shape, dtype=acc), -1, axis)
    n = xa.shape[-1]
    m = np.full(xa.shape[:-1], -np.inf, dtype=acc)
    l = np.zeros(xa.shape[:-1], dtype=acc)
    for start in range(0, n, block_size):
        block = xa[..., start : start + block_size].astype(acc)
        m_new = np.maximum(m, block.max(axis=-1))
        shift = np.where(np.isneginf(m_new), 0, m_new)  # no -inf - -inf while a row is all -inf
        with np.errstate(invalid="ignore"):  # a NaN or +inf element: inf - inf, kept as NaN
            l = l * np.exp(m - shift) + np.exp(block - shift[..., None]).sum(axis=-1)
        m = m_new
    y = np.empty(xa.shape, dtype=acc)
    y[...] = xa
    with np.errstate(invalid="ignore", divide="ignore"):
        y -= m[..., None]
        np.exp(y, out=y)
        y /= l[..., None]
    return np.moveaxis(y, -1, axis)


def masked_exp(s: np.ndarray, mask: np.ndarray | None):
    """The unnormalised softmax of attention scores along the last axis: ``(e, l, shift)``.

    Entries where ``mask`` is False become ``-inf``; ``shift`` is each row's maximum, or 0 for a
    row that sees no key (so no ``-inf - -inf`` is formed); ``e = exp(s - shift)`` and ``l`` is
    its row sum, 0 exactly for a row without keys. Then ``P = e / l`` and ``lse = shift + log(l)``.

    Non-finite scores are kept, silently: a NaN or a ``+inf`` among a row's visible scores makes
    ``shift`` or ``e`` NaN there, so ``l`` is NaN (not 0) and the row's ``P`` and ``lse`` come out
    NaN; masked entries are ``-inf`` whatever score they held, so they never spread one.
    """
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    shift = np.where(np.isneginf(m), 0, m)
    with np.errstate(invalid="ignore"):  # inf - inf = NaN where a score is +inf: kept
        e = np.exp(s - shift[..., None])
    return e, e.sum(axis=-1), shift
