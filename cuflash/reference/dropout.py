"""Attention dropout that every backend draws identically: Philox 4x32-10 in NumPy.

The keep decision of pair (batch ``b``, query head ``h``, query row ``i``, key ``j``) is word
``j % 4`` of ``philox4x32_10(counter=(j // 4, i, h, b), key=(seed, offset))`` (Salmon, Moraes,
Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011, the Philox-4x32 bijection
with 10 rounds; the constants of Random123), kept iff it is below the integer threshold
:func:`keep_threshold` computes once on the host; survivors are scaled by ``1 / (1 - p)``. The
CUDA kernels (``kernels_cu/dropout.cuh``) compute the same bits, so the NumPy path, the simulator
and a GPU drop the same pairs; the generator is checked against Random123's known-answer vectors
in both. ``b`` is the flattened batch index (the leading dims in C order; the sequence index of a
packed batch), ``i`` and ``j`` are positions within the sequence, all modulo 2**32.

Dropout acts on P after the softmax (FlashAttention, Dao et al. 2022, Algorithm 2): the LSE is
the undropped softmax's, ``O = (P * Z / (1 - p)) V``, and the backward regenerates ``Z``:
``dV = (P * Z / (1 - p))^T dO``, ``dS = P * (dO V^T * Z / (1 - p) - rowsum(dO * O))``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["philox4x32_10", "keep_threshold", "keep_scale", "keep_mask", "dropout_mask"]

#: Philox 4x32 multipliers and Weyl key increments (Random123, philox.h)
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def philox4x32_10(counter, key):
    """Philox 4x32-10 of ``counter`` (four uint32 arrays, broadcast together) under ``key`` (two
    ints): the four uint32 output words, arrays of the counters' broadcast shape."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in np.broadcast_arrays(*counter))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    for _ in range(ROUNDS):
        p0 = c0.astype(np.uint64) * m0
        p1 = c2.astype(np.uint64) * m1
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0
        k0, k1 = (k0 + PHILOX_W0) & 0xFFFFFFFF, (k1 + PHILOX_W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


def keep_threshold(p: float) -> int:
    """The integer a 32-bit draw must be below to keep its pair: ``round((1 - p) * 2**32)``,
    clamped to ``[0, 2**32 - 1]`` (computed once, in Python, so no backend rounds differently)."""
    return min(2**32 - 1, max(0, int(round((1.0 - float(p)) * 2.0**32))))


def keep_scale(p: float) -> float:
    """The survivors' scale ``1 / (1 - p)``."""
    return 1.0 / (1.0 - float(p))


def keep_mask(seed: int, offset: int, threshold: int, batch, heads, rows, cols) -> np.ndarray:
    """The keep decisions of the pairs ``(batch, heads, rows, cols)`` (int arrays broadcast
    together; ``cols`` its own axis last): a bool array of their broadcast shape."""
    batch, heads, rows, cols = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (batch, heads, rows, cols)))
    u32 = [(x & 0xFFFFFFFF).astype(np.uint32) for x in (cols >> 2, rows, heads, batch)]
    words = np.stack(philox4x32_10(u32, (seed, offset)), axis=0)    # (4, ...)
    pick = (cols & 3).astype(np.intp)
    draw = np.take_along_axis(words, pick[None], axis=0)[0]
    return draw < np.uint64(threshold)


def dropout_mask(shape, dropout_p: float, dropout_seed: int, dropout_offset: int = 0, *, batch0: int = 0,
                 row0: int = 0, col0: int = 0) -> np.ndarray:
    """The keep mask cuflash applies for ``dropout_p``, ``dropout_seed`` and ``dropout_offset``.

    Parameters
    ----------
    shape : (B, H, Sq, Sk)
        Flattened batch, query heads, query rows and keys.
    dropout_p : float in [0, 1)
    dropout_seed, dropout_offset : int in [0, 2**32)
    batch0, row0, col0 : int
        Index of the first batch, row and key (a window into a larger mask).

    Returns
    -------
    numpy.ndarray of bool, ``shape``: True where the pair is kept (its P scaled by ``1 / (1 - p)``);
    all True for ``dropout_p = 0``.

    Raises
    ------
    TypeError
        A non-number ``dropout_p``, a non-int seed, offset or extent.
    ValueError
        ``dropout_p`` outside ``[0, 1)``, a seed or offset outside ``[0, 2**32)`` or a missing seed,
        a shape that is not four non-negative ints.

    Examples
    --------
    >>> import cuflash
    >>> m = cuflash.reference.dropout_mask((1, 2, 3, 8), 0.5, dropout_seed=7)
    >>> m.shape, m.dtype
    ((1, 2, 3, 8), dtype('bool'))
    """
    from cuflash.runtime import validation

    func = "cuflash.reference.dropout_mask"
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 4:
        raise ValueError(f"{func}: shape must be (B, H, Sq, Sk), got {shape!r}")
    b, h, sq, sk = (validation.check_int(n, f"shape[{i}]", func) for i, n in enumerate(shape))
    if min(b, h, sq, sk) < 0:
        raise ValueError(f"{func}: shape={tuple(shape)} must be non-negative")
    if dropout_seed is None:
        raise ValueError(f"{func}: dropout_seed must be an int in [0, 2**32), got None")
    from cuflash.runtime.options import DropoutOptions

    if validation.check_dropout(DropoutOptions(dropout_p, dropout_seed, dropout_offset), func) is None:
        return np.ones((b, h, sq, sk), dtype=bool)   # p = 0: nothing is dropped (the plain kernels run)
    thr = keep_threshold(dropout_p)
    return keep_mask(dropout_seed, dropout_offset, thr,
                     (batch0 + np.arange(b))[:, None, None, None], np.arange(h)[None, :, None, None],
                     (row0 + np.arange(sq))[None, None, :, None], (col0 + np.arange(sk))[None, None, None, :])


def problem_keep(problem, rows, cols, head_index=None, scaled: bool = True):
    """The keep mask of a validated problem with dropout (None without), in the reference's
    grouped layout: ``(*batch, Hk, G, R, C)`` over query ``rows`` and key ``cols`` (int arrays),
    or ``(R, G, C)`` for one kv head ``head_index`` (a tuple ``(*batch, hk)``). With ``scaled``
    the values are ``Z / (1 - p)`` in float64 (0 where dropped), else bool."""
    d = getattr(problem, "dropout", None)
    if d is None:
        return None
    g, hk = problem.group_size, problem.num_heads_k
    batch_shape = tuple(problem.batch_shape)
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    if head_index is None:
        nb = len(batch_shape)
        flat = d.batch0 + (np.arange(int(np.prod(batch_shape, dtype=np.int64))).reshape(batch_shape + (1,) * 4) if nb
                           else np.zeros((1,) * 4, np.int64))
        heads = (np.arange(hk)[:, None] * g + np.arange(g)[None, :])[..., None, None]
        keep = keep_mask(d.seed, d.offset, d.threshold, flat, heads, rows[:, None], cols[None, :])
    else:
        *bidx, h = head_index
        flat = d.batch0 + (int(np.ravel_multi_index(tuple(bidx), batch_shape)) if batch_shape else 0)
        heads = (h * g + np.arange(g))[None, :, None]
        keep = keep_mask(d.seed, d.offset, d.threshold, flat, heads, rows[:, None, None], cols[None, None, :])
    return keep * d.scale if scaled else keep
