"""The KV cache in NumPy: rotary embedding, the in-place append, the gather of a sequence's
keys from a contiguous or paged cache, and the merge of partial attention results.

These are the NumPy path of :func:`cuflash.attention_with_kvcache` and
:func:`cuflash.merge_attention`, and the tests' expectations for the kernels.

Conventions (flash-attn's ``flash_attn_with_kvcache``)
------------------------------------------------------
* Sequence ``b`` keeps its keys at cache indices ``[leftpad[b], seqlens[b])`` (``leftpad = 0``
  without ``cache_leftpad``); the ``Snew`` new keys go to ``[seqlens[b], seqlens[b] + Snew)``.
  Contiguous cache ``(B_cache, S_cache, Hk, D)``: index ``p`` of sequence ``b`` is row ``p`` of
  cache batch ``cache_batch_idx[b]`` (``b`` without it). Paged cache ``(num_pages, page_size, Hk,
  D)``: index ``p`` is row ``p % page_size`` of page ``block_table[b, p // page_size]``.
* Rotary embedding (Su et al. 2021, "RoFormer", eq. 34) at absolute cache positions: new key
  ``t`` at position ``seqlens[b] + t``; query row ``i`` at ``seqlens[b] + i`` with causal or local
  masks, else every query row at ``seqlens[b]``. Non-interleaved (GPT-NeoX) pairs dimension
  ``i`` with ``i + rotary_dim / 2``; interleaved pairs ``2 i`` with ``2 i + 1``. Dimensions past
  ``rotary_dim`` pass unchanged. The arithmetic is float32, each product and sum rounded
  (``x1 c - x2 s``, ``x2 c + x1 s``; no fused multiply-add), so the kernels write the same bits.
* An fp8 (float8_e4m3fn) cache with descales ``k_descale``/``v_descale`` (float32 ``(B, Hk)``:
  sequence ``b``'s rows of kv head ``h`` stand for ``x * descale[b, h]``): the append stores
  :func:`cuflash.reference.fp8.quantize_e4m3` of each new row (rotated first and rounded to its
  own dtype), saturating at +-448 as the GPU's ``satfinite`` conversion does; a read dequantizes
  (:func:`gather` with ``descale``).
"""

from __future__ import annotations

import math

import numpy as np

from cuflash.reference.fp8 import quantize_e4m3
from cuflash.runtime import dtypes

__all__ = ["apply_rotary", "rotary_positions", "cache_rows", "append", "gather", "dequantized", "merge_attention",
           "merge_memory"]


def rotary_positions(seqlens: np.ndarray, length: int, *, per_row: bool = True) -> np.ndarray:
    """Positions ``(B, length)`` of rows starting at ``seqlens[b]``: ``seqlens[b] + i`` when
    ``per_row``, else ``seqlens[b]`` for every row (flash-attn's non-causal query rotation)."""
    base = np.asarray(seqlens, dtype=np.int64)[:, None]
    return base + (np.arange(length)[None, :] if per_row else 0)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, *,
                 interleaved: bool) -> np.ndarray:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` dims of ``x`` ``(B, S, H, D)`` at
    ``positions`` ``(B, S)`` (rows of ``cos``/``sin``, shape ``(seqlen_ro, rotary_dim / 2)``).

    Returns a new array of ``x``'s dtype (float64 input is computed in float64, everything else in
    float32, rounded once per operation as the module docstring says).
    """
    acc = np.float64 if x.dtype == np.float64 else np.float32
    half = cos.shape[1]
    c = cos.astype(acc)[positions][:, :, None, :]   # (B, S, 1, half)
    s = sin.astype(acc)[positions][:, :, None, :]
    xf = x.astype(acc)
    if interleaved:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    out = xf.copy()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = r1, r2
    else:
        out[..., :half], out[..., half:2 * half] = r1, r2
    return out.astype(x.dtype)


def cache_rows(b: int, start: int, stop: int, *, page_size: int | None, block_table=None,
               cache_batch_idx=None) -> tuple[np.ndarray, np.ndarray]:
    """``(first index, second index)`` arrays addressing cache indices ``[start, stop)`` of
    sequence ``b``: ``cache[first, second]`` are its rows (pages and in-page rows for a paged
    cache, the cache batch and rows for a contiguous one)."""
    p = np.arange(start, stop)
    if block_table is not None:
        return np.asarray(block_table)[b, p // page_size].astype(np.int64), p % page_size
    cb = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return np.full(p.shape, cb, np.int64), p


def append(k_cache: np.ndarray, v_cache: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, seqlens: np.ndarray, *,
           page_size=None, block_table=None, cache_batch_idx=None, k_descale=None, v_descale=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, Snew, Hk, D|Dv)`` into the caches in place at cache indices
    ``[seqlens[b], seqlens[b] + Snew)`` of each sequence (rotate ``k_new`` first if wanted). Into
    an fp8 cache each row is quantized with its descale (``(B, Hk)``; None: 1), saturating
    (:func:`cuflash.reference.fp8.quantize_e4m3`: clipped to +-448 before the cast, since
    ``ml_dtypes`` turns an overflow into NaN; NaN stays NaN)."""
    snew = k_new.shape[1]
    for b in range(k_new.shape[0]):
        i0, i1 = cache_rows(b, int(seqlens[b]), int(seqlens[b]) + snew, page_size=page_size, block_table=block_table,
                            cache_batch_idx=cache_batch_idx)
        k_cache[i0, i1] = _stored(k_cache, k_new[b], k_descale, b)
        v_cache[i0, i1] = _stored(v_cache, v_new[b], v_descale, b)


def _stored(cache, rows, descale, b):
    """New rows ``(Snew, Hk, D)`` of sequence ``b`` as the cache stores them."""
    if not dtypes.is_fp8(cache.dtype):
        return rows
    return quantize_e4m3(rows, 1.0 if descale is None else np.asarray(descale, np.float32)[b][:, None])


def dequantized(rows: np.ndarray, descale, b: int, acc=np.float32) -> np.ndarray:
    """Sequence ``b``'s fp8 cache rows ``(S, Hk, D)`` as ``acc`` values: ``acc(x) * descale[b, h]``
    (descale None: 1)."""
    x = rows.astype(acc)
    if descale is not None:
        x *= np.asarray(descale, acc)[b][:, None]
    return x


def gather(cache: np.ndarray, b: int, start: int, stop: int, *, page_size=None, block_table=None,
           cache_batch_idx=None) -> np.ndarray:
    """Sequence ``b``'s cache rows ``[start, stop)`` as one ``(stop - start, Hk, D)`` array (a copy
    for a paged cache, a view for a contiguous one)."""
    if block_table is None:
        cb = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return cache[cb, start:stop]
    i0, i1 = cache_rows(b, start, stop, page_size=page_size, block_table=block_table)
    # the gather copies; NumPy lays the copy out after the source's strides, so a cache broadcast
    # over its kv heads (stride 0) would come back without a unit-stride last axis
    return np.ascontiguousarray(cache[i0, i1])


def merge_memory(outs, lses) -> dict:
    """Bytes :func:`merge_attention` allocates on NumPy arrays, by array: the stacked ``lse`` with
    the weights and row statistics, and the output with its accumulation-type temporaries."""
    acc = 8 if any(np.dtype(o.dtype) == np.float64 or np.dtype(s.dtype) == np.float64 for o, s in zip(outs, lses)) else 4
    rows = math.prod(lses[0].shape) if lses else 0
    elems = rows * (outs[0].shape[-1] if outs and outs[0].ndim else 0)
    return {"lse and weights": (3 * len(lses) + 6) * rows * acc,
            "out and its accumulators": 6 * elems * acc + elems * (np.dtype(outs[0].dtype).itemsize if outs else 0)}


def merge_attention(outs, lses, *, xp=np):
    """Combine attention results over disjoint key sets by their log-sum-exp.

    With parts ``o_i = softmax(s_i) v_i`` and ``lse_i = log sum exp(s_i)`` (natural log) over key
    sets ``K_i``, attention over their union is ``lse = log sum_i exp(lse_i)`` and ``o = sum_i
    exp(lse_i - lse) o_i`` (the split-KV combine of flash-decoding, Dao et al. 2023; the same
    identity as the online softmax, Milakov & Gimelshein 2018).

    Empty and non-finite parts: a part with ``lse_i = -inf`` (no key, or a partial never
    written) adds nothing, whatever its ``o_i`` holds (NaN or garbage included); when every part
    of a row has ``-inf`` the row is 0 with ``lse = -inf``. Any other part counts: a NaN (or
    ``+inf``) ``lse_i``, or a NaN in the ``o_i`` of a part whose ``lse_i`` is not ``-inf``, makes
    the row's result NaN, even where the part's weight ``exp(lse_i - lse)`` rounds to 0.

    Parameters
    ----------
    outs : sequence of arrays ``(..., Sq, Dv)``, one dtype
    lses : sequence of arrays ``(..., Sq)``, float32 or float64
    xp : module
        The array namespace (NumPy or CuPy).

    Returns
    -------
    out : array ``(..., Sq, Dv)`` of the parts' dtype; lse : array ``(..., Sq)`` (float64 if any
    input is float64, else float32)
    """
    acc = np.float64 if any(np.dtype(o.dtype) == np.float64 or np.dtype(s.dtype) == np.float64
                            for o, s in zip(outs, lses)) else np.float32
    lse = xp.stack([xp.asarray(s, dtype=acc) for s in lses])                 # (n, ..., Sq)
    m = lse.max(axis=0)                                                       # NaN if any lse is NaN
    m_safe = xp.where(xp.isneginf(m), acc(0), m)                              # every part empty: shift 0
    w = xp.exp(lse - m_safe)                                                  # (n, ..., Sq); 0 for -inf parts
    total = w.sum(axis=0)
    empty = total == 0
    total_safe = xp.where(empty, acc(1), total)
    lse_out = xp.where(empty, acc(-np.inf), m_safe + xp.log(total_safe))
    o = 0
    for i in range(len(outs)):   # an empty part's o_i is never read into the sum (0 * NaN would be NaN)
        part = w[i][..., None] * xp.asarray(outs[i], dtype=acc)
        o = o + xp.where(xp.isneginf(lse[i])[..., None], acc(0), part)
    out = (o / total_safe[..., None]).astype(outs[0].dtype)
    return out, lse_out
