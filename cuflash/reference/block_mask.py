"""Building a block-sparse mask from a ``mask_mod``, in NumPy or on the device (CuPy).

:func:`create_block_mask` evaluates the function block row by block row (a chunk of query
blocks against every key at a time, vectorized with the array module's ufuncs), reduces each
``Q_BLOCK x KV_BLOCK`` block to "any kept" and "all kept", and keeps only those two block-level
tables: the ``(Sq, Sk)`` mask is never formed whole. The tables become the ordered index lists
of :class:`cuflash.runtime.block_mask.BlockMask` (FlexAttention's layout).

Imports: :mod:`cuflash.runtime` and :mod:`cuflash.reference.score_mods`.
"""

from __future__ import annotations

import numpy as np

from cuflash.reference.score_mods import evaluate
from cuflash.runtime import score_mod as tracing
from cuflash.runtime.block_mask import DEFAULT_BLOCK_SIZE, BlockMask, block_sizes

__all__ = ["create_block_mask", "CHUNK_ELEMENTS"]

#: pairs evaluated at once (one chunk of query blocks against every key, over every (b, h))
CHUNK_ELEMENTS = 1 << 22

_FUNC = "cuflash.create_block_mask"


def _module(traced, device):
    if device is None:
        device = "cuda" if any(type(a).__module__.split(".")[0] == "cupy" for a in traced.arrays) else "cpu"
    if device in ("cpu", "numpy"):
        return np
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda:")):
        try:
            import cupy
        except ImportError:
            raise RuntimeError(f"{_FUNC}: device={device!r} needs CuPy, which is not installed") from None
        return cupy
    raise ValueError(f"{_FUNC}: device must be None (the captured arrays' kind), 'cpu' or 'cuda', got {device!r}")


def _count(n, name: str, allow_none: bool) -> int:
    if n is None and allow_none:
        return 1
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        extra = " or None (the same for every one)" if allow_none else ""
        raise ValueError(f"{_FUNC}: {name} must be a positive int{extra}, got {n!r}")
    return int(n)


def _ordered(xp, member):
    """``(count, indices)`` int32 of a bool ``(..., n)`` table: per row, the members first in
    ascending order, then the others."""
    n = member.shape[-1]
    ar = xp.arange(n, dtype=np.int64)
    order = xp.argsort(xp.where(member, ar, ar + n), axis=-1)
    return member.sum(axis=-1).astype(np.int32), order.astype(np.int32)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=DEFAULT_BLOCK_SIZE) -> BlockMask:
    """A block-sparse mask of ``mask_mod`` over ``(Q_LEN, KV_LEN)`` (FlexAttention's
    ``create_block_mask``: Guessous et al., "FlexAttention", 2024; the names and argument order
    follow ``torch.nn.attention.flex_attention``).

    Parameters
    ----------
    mask_mod : callable ``(b, h, q_idx, kv_idx) -> bool``
        Traced as for :func:`cuflash.attention` (:mod:`cuflash.runtime.score_mod`); True = attend.
    B, H : int or None
        Batch entries (the row-major flattened batch index) and query heads; None builds one
        mask for all (evaluated at ``b = 0`` / ``h = 0``: for a function that does not read
        ``b`` / ``h``).
    Q_LEN, KV_LEN : int
        ``Sq`` and ``Sk`` of the calls it will serve.
    device : {None, "cpu", "cuda"}
        Where it is built and kept: None follows the captured arrays (CuPy arrays: the device;
        else NumPy); "cpu" gives NumPy arrays (for NumPy and simulator calls), "cuda" CuPy
        arrays (for device calls).
    BLOCK_SIZE : int or (int, int)
        ``(Q_BLOCK, KV_BLOCK)``, positive multiples of 64 (the tensor-core kernels' tiles of
        the modifier forms divide them; each block is run as whole tiles). Default 128, as
        FlexAttention's.

    Returns
    -------
    BlockMask
        Per (b, h, query block) the partial and full key blocks, and the transposed index.

    Raises
    ------
    TypeError
        ``mask_mod`` not traceable (the operation named), ``BLOCK_SIZE`` not an int or a pair.
    ValueError
        ``B``/``H`` not a positive int or None, ``Q_LEN``/``KV_LEN`` not positive ints,
        ``BLOCK_SIZE`` not positive multiples of 64, a captured array read out of range for
        these sizes, an unknown ``device``.

    Notes
    -----
    Cost: ``B x H x Q_LEN x KV_LEN`` evaluations of ``mask_mod`` in chunks of
    :data:`CHUNK_ELEMENTS` pairs (memory: a chunk, plus ``B x H`` block tables). A block is
    full when every pair inside ``(Q_LEN, KV_LEN)`` is kept, empty when none is (the last block
    row and column may be shorter than a block).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> doc = np.repeat(np.arange(4, dtype=np.int32), 128)        # 4 documents of 128 tokens
    >>> bm = cuflash.create_block_mask(cuflash.mods.document_mask(doc), None, None, 512, 512)
    >>> bm.to_dense()[0, 0]
    array([[2, 0, 0, 0],
           [0, 2, 0, 0],
           [0, 0, 2, 0],
           [0, 0, 0, 2]], dtype=int8)
    """
    traced = tracing.trace(mask_mod, "mask_mod", _FUNC)
    nb, nh = _count(B, "B", True), _count(H, "H", True)
    sq, sk = _count(Q_LEN, "Q_LEN", False), _count(KV_LEN, "KV_LEN", False)
    bq, bk = block_sizes(BLOCK_SIZE, _FUNC)
    xp = _module(traced, device)
    tracing.check_reads(traced, {"b": nb, "h": nh, "q_idx": sq, "kv_idx": sk}, _FUNC)
    arrays = tuple(xp.asarray(a) for a in traced.arrays)
    nqb, nkb = -(-sq // bq), -(-sk // bk)
    partial = xp.zeros((nb, nh, nqb, nkb), dtype=bool)
    full = xp.zeros((nb, nh, nqb, nkb), dtype=bool)
    b = xp.arange(nb, dtype=np.int64).reshape(nb, 1, 1, 1)
    h = xp.arange(nh, dtype=np.int64).reshape(1, nh, 1, 1)
    kv = xp.arange(sk, dtype=np.int64).reshape(1, 1, 1, sk)
    step = max(1, CHUNK_ELEMENTS // (nb * nh * bq * nkb * bk)) * bq   # rows per chunk, whole query blocks
    for r0 in range(0, sq, step):
        r1 = min(r0 + step, sq)
        rows = xp.arange(r0, r1, dtype=np.int64).reshape(1, 1, r1 - r0, 1)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            keep = evaluate(traced.expr, {"b": b, "h": h, "q_idx": rows, "kv_idx": kv}, arrays, xp=xp)
        keep = xp.broadcast_to(xp.asarray(keep, dtype=bool), (nb, nh, r1 - r0, sk))
        n_qb = -(-(r1 - r0) // bq)
        shape = (nb, nh, n_qb, bq, nkb, bk)
        # pairs past (Q_LEN, KV_LEN) count as kept for "all" and as hidden for "any"
        some = xp.zeros((nb, nh, n_qb * bq, nkb * bk), dtype=bool)
        some[:, :, : r1 - r0, :sk] = keep
        every = xp.ones((nb, nh, n_qb * bq, nkb * bk), dtype=bool)
        every[:, :, : r1 - r0, :sk] = keep
        any_kept = some.reshape(shape).any(axis=(3, 5))
        all_kept = every.reshape(shape).all(axis=(3, 5))
        qb0 = r0 // bq
        full[:, :, qb0 : qb0 + n_qb] = all_kept
        partial[:, :, qb0 : qb0 + n_qb] = any_kept & ~all_kept
    kv_num, kv_idx = _ordered(xp, partial)
    full_kv_num, full_kv_idx = _ordered(xp, full)
    q_num, q_idx = _ordered(xp, partial.swapaxes(-1, -2))
    full_q_num, full_q_idx = _ordered(xp, full.swapaxes(-1, -2))
    return BlockMask(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx,
                     (bq, bk), (sq, sk), traced)
