"""Functions for ``score_mod`` / ``mask_mod``, and ready-made ones.

A ``score_mod(score, b, h, q_idx, kv_idx)`` returns the new score of query row ``q_idx`` and key
``kv_idx`` (batch ``b``, query head ``h``); a ``mask_mod(b, h, q_idx, kv_idx)`` returns True
where the pair is attended. :func:`cuflash.attention` and :func:`cuflash.attention_backward`
take them (``score_mod=``, ``mask_mod=``) and trace them once with symbolic arguments, so
they are written with a fixed set of operations: Python's operators (``+ - * / // %``,
comparisons, ``&``, ``|``, ``~``, ``abs``), the functions here (:func:`where`, :func:`exp`,
:func:`log`, :func:`tanh`, :func:`minimum`, :func:`maximum`, :func:`clamp`), the same
functions spelled the NumPy way (``np.where``, ``np.tanh``, ``np.clip``, ...) or the torch way
(``torch.where``, ``torch.tanh``, ``torch.clamp``, ...: FlexAttention's spelling), and reads of
arrays the function captures (``slopes[h]``, ``doc_id[q_idx]``). Python ``if``, ``and``,
``or``, ``min()``, ``max()`` and ``math.*`` on the arguments are refused with a ``TypeError``
naming the operation (they would need the value, which tracing does not have);
:mod:`cuflash.runtime.score_mod` has the complete rules.

Where they apply: after the scale and the built-in modifiers (softcap, ALiBi, ``attn_bias``),
before the masks (causal, window, ``attn_mask`` and ``mask_mod``; a pair a mask hides is
``-inf``, a row left with no key gives 0 and ``lse = -inf``). The indices are those of the
arrays: ``q_idx`` counts from 0 in q and ``kv_idx`` in k; a bottom-right alignment (flash-attn's
causal convention) is ``q_idx + Sk - Sq``, which the ready-made functions below take as
``seqlen_q``/``seqlen_k``.

Examples
--------
>>> import numpy as np, cuflash
>>> from cuflash import mods
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 6, 8))
>>> def capped(score, b, h, q_idx, kv_idx):
...     return 30.0 * mods.tanh(score / 30.0)
>>> out = cuflash.attention(q, k, v, score_mod=capped)
>>> np.allclose(out, cuflash.attention(q, k, v, softcap=30.0))
True
"""

from __future__ import annotations

import numpy as np

from cuflash.reference.block_mask import create_block_mask
from cuflash.runtime.score_mod import absolute, clamp, exp, log, maximum, minimum, tanh, where

__all__ = ["where", "exp", "log", "tanh", "absolute", "minimum", "maximum", "clamp", "alibi", "softcap",
           "relative_position_bias", "document_mask", "document_block_mask", "prefix_lm", "sliding_window"]


def _offset(seqlen_q, seqlen_k) -> int:
    if (seqlen_q is None) != (seqlen_k is None):
        raise ValueError(f"cuflash.mods: give both seqlen_q and seqlen_k (bottom-right alignment) or neither "
                         f"(top-left), got seqlen_q={seqlen_q!r}, seqlen_k={seqlen_k!r}")
    return 0 if seqlen_q is None else int(seqlen_k) - int(seqlen_q)


def alibi(slopes, seqlen_q=None, seqlen_k=None):
    """ALiBi (Press et al., "Train Short, Test Long", 2022) as a ``score_mod``: adds ``-slopes[h]
    * |q_idx + Sk - Sq - kv_idx|``, as ``alibi_slopes=`` does.

    Parameters
    ----------
    slopes : array, float32 ``(Hq,)`` or ``(B, Hq)`` (float64 on the NumPy path)
        Captured: new values need no new compile.
    seqlen_q, seqlen_k : int, optional
        Both or neither: the bottom-right offset ``Sk - Sq`` (0 without them).
    """
    off = _offset(seqlen_q, seqlen_k)
    if getattr(slopes, "ndim", 1) == 2:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * abs(q_idx + off - kv_idx)
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * abs(q_idx + off - kv_idx)
    return score_mod


def softcap(cap: float):
    """Logit soft-capping (Gemma 2) as a ``score_mod``: ``cap * tanh(score / cap)``, as
    ``softcap=`` does (``cap > 0``)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"cuflash.mods.softcap: cap must be > 0, got {cap!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)
    return score_mod


def relative_position_bias(table, max_distance: int):
    """A learned relative position bias (T5-style, without buckets) as a ``score_mod``: adds
    ``table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance]``.

    Parameters
    ----------
    table : array, float32 ``(Hq, 2 * max_distance + 1)``
        Captured (new values need no new compile).
    max_distance : int
        Distances beyond it share the last entry.
    """
    max_distance = int(max_distance)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance]
    return score_mod


def document_mask(doc_ids, causal: bool = False):
    """Document masking over a packed sequence as a ``mask_mod``: query ``i`` sees key ``j``
    iff ``doc_ids[i] == doc_ids[j]`` (and ``j <= i`` with ``causal``). For self-attention over
    one packed sequence (``Sq == Sk``, top-left indices).

    Parameters
    ----------
    doc_ids : int32 array ``(S,)`` (int64 on the NumPy path)
        The document of each position; captured.
    """
    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
    return mask_mod


def document_block_mask(doc_ids, causal: bool = False, BLOCK_SIZE=128, device=None):
    """:func:`document_mask` as a block-sparse mask (:func:`cuflash.create_block_mask` over
    ``(S, S)``, one for every batch entry and head): blocks between two documents are never
    visited, blocks inside one document (below the diagonal, with ``causal``) run without
    evaluating the mask.

    Parameters
    ----------
    doc_ids : int32 array ``(S,)``
        As :func:`document_mask` (sorted ids: packed documents).
    causal : bool
    BLOCK_SIZE, device
        As :func:`cuflash.create_block_mask`.

    Returns
    -------
    BlockMask
        Pass it as ``block_mask=`` (its ``mask_mod`` is the document mask).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> from cuflash import mods
    >>> doc = np.repeat(np.arange(8, dtype=np.int32), 64)            # 8 documents of 64 tokens
    >>> bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 512, 32))
    >>> out = cuflash.attention(q, k, v, block_mask=bm)
    >>> bool(np.allclose(out, cuflash.attention(q, k, v, mask_mod=bm.mask_mod)))
    True
    >>> round(bm.sparsity(), 1)                                      # 8 of 64 blocks visited
    87.5
    """
    s = int(doc_ids.shape[0])
    return create_block_mask(document_mask(doc_ids, causal), None, None, s, s, device=device, BLOCK_SIZE=BLOCK_SIZE)


def prefix_lm(prefix_length):
    """Prefix-LM masking as a ``mask_mod``: every query sees the first ``prefix_length`` keys,
    and the rest causally (``kv_idx <= q_idx``, top-left).

    Parameters
    ----------
    prefix_length : int, or int32 array ``(B,)``
        One prefix for every batch entry (a constant of the compiled code), or one per batch
        entry (captured: new values need no new compile).
    """
    if isinstance(prefix_length, (int, np.integer)):
        n = int(prefix_length)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < n)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix_length[b])
    return mask_mod


def sliding_window(left: int, right: int = 0, seqlen_q=None, seqlen_k=None):
    """Local attention as a ``mask_mod``: query ``i`` sees keys ``i + Sk - Sq - left <= j <= i +
    Sk - Sq + right``, as ``window_size=(left, right)``; -1 leaves a side unbounded.

    Parameters
    ----------
    left, right : int
        The bounds (constants of the compiled code).
    seqlen_q, seqlen_k : int, optional
        Both or neither: the bottom-right offset ``Sk - Sq`` (0 without them).
    """
    off = _offset(seqlen_q, seqlen_k)
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"cuflash.mods.sliding_window: left and right must be >= -1 (-1 = unbounded), got "
                         f"left={left}, right={right}")

    def mask_mod(b, h, q_idx, kv_idx):
        lo = True if left < 0 else kv_idx >= q_idx + off - left
        hi = True if right < 0 else kv_idx <= q_idx + off + right
        return lo & hi
    return mask_mod
