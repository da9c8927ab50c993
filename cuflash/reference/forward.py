"""Attention forward in NumPy: :func:`naive_attention` (the float64 oracle) and
:func:`flash_attention` (the tiled FlashAttention forward, the CPU path). Conventions in
:mod:`cuflash.reference`."""

from __future__ import annotations

import math

import numpy as np

from cuflash.reference.dropout import problem_keep
from cuflash.reference.masks import key_range, masked_matmul, problem_mask
from cuflash.reference.memory import all_finite, check_memory, nbytes
from cuflash.reference.modifiers import HeadTerms, join_sinks
from cuflash.reference.normalize import masked_exp
from cuflash.reference.views import (
    canonical,
    check_numpy,
    in_dtype,
    kv_view,
    split_heads,
)
from cuflash.runtime import dtypes, threads
from cuflash.runtime.options import DropoutOptions, ModifierOptions, Options
from cuflash.runtime.validation import (
    AttentionProblem,
    check_attention,
    check_block_sizes,
)

__all__ = ["naive_attention", "flash_attention", "naive_rows", "cpu_tiles", "forward_memory", "run_forward"]


# --------------------------------------------------------------------------------------------
# naive attention (float64 ground truth)


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
                    dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0, alibi_slopes=None, attn_bias=None,
                    attn_mask=None, sinks=None, score_mod=None, mask_mod=None):
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
    dropout_p, dropout_seed, dropout_offset
        Attention dropout with the mask of :func:`cuflash.reference.dropout_mask` (P after the
        softmax times ``Z / (1 - p)``; the LSE is the undropped softmax's).
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod
        The score modifiers, as :func:`cuflash.attention` takes them (scale, softcap, ALiBi and
        bias, score_mod, the masks with mask_mod, softmax with the sink in the denominator; the
        lse includes the sink). score_mod and mask_mod are evaluated over the whole ``(Sq,
        Sk)`` grid of every head, in float64 (:mod:`cuflash.reference.score_mods`).

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
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout, return_lse=return_lse,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod))
    p = check_attention(q, k, v, options, func="cuflash.reference.naive_attention", max_head_dim=None)
    check_numpy(p)
    out = np.zeros(p.out_shape, dtype=np.float64)
    lse = np.full(p.lse_shape, -np.inf, dtype=np.float64)
    if not p.is_empty and p.num_heads_k:
        o, row_lse = naive_rows(p, q, k, v, np.arange(p.seqlen_q))
        split_heads(canonical(out, layout), p.num_heads_k)[...] = o
        lse_view = lse[..., None, :] if layout == "bhsd" and q.ndim == 2 else lse
        split_heads(lse_view[..., None], p.num_heads_k)[..., 0] = row_lse
    return (out, lse) if return_lse else out


def naive_rows(p: AttentionProblem, q, k, v, rows, round_to=None, *, p_round_to=None):
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
    p_round_to : numpy dtype, optional
        With ``round_to``: the baseline of an fp8 forward (:mod:`cuflash.reference.tolerance`):
        the scores stay float32 (an fp8 GEMM accumulates in float32 and FA3 keeps S in float32
        registers), ``P`` is rounded to this dtype (e4m3, the second GEMM's operand) before ``P @
        V``, and the output to ``round_to`` (the call's ``out_dtype``). q, k, v are then the
        descaled float32 values (:func:`cuflash.reference.fp8.dequantize`).

    Returns
    -------
    (out, lse) : arrays of shapes ``(*batch, Hk, G, R, Dv)`` and ``(*batch, Hk, G, R)`` (query
        head ``hk * G + g``; float64, or float32 holding the dtype's values); a row that sees no
        key gives 0 and ``lse = -inf``.
    """
    acc = np.float64 if round_to is None else np.float32

    def rnd(x):
        return x if round_to is None else x.astype(round_to).astype(np.float32)

    def rnd_s(x):   # the scores: the dtype's rounding, none for the fp8 baseline
        return x if p_round_to is not None else rnd(x)

    def rnd_p(x):   # P before P @ V: the dtype's, or e4m3's for the fp8 baseline
        return rnd(x) if p_round_to is None else x.astype(p_round_to).astype(np.float32)

    qv = split_heads(canonical(q, p.layout), p.num_heads_k)[..., rows, :].astype(acc)
    kv = kv_view(canonical(k, p.layout)).astype(acc)
    vv = kv_view(canonical(v, p.layout)).astype(acc)
    s = rnd_s(rnd_s(qv @ kv.swapaxes(-1, -2)) * acc(p.softmax_scale))
    mask = problem_mask(p, rows, np.arange(p.seqlen_k))
    terms = None if p.modifiers is None else HeadTerms(p, None, acc)
    if terms is not None:   # softcap, ALiBi, bias; then attn_mask joins the causal/window mask
        with np.errstate(invalid="ignore", over="ignore"):
            terms.modify(s, rows, np.arange(p.seqlen_k))
        s = rnd_s(s)   # a framework in the dtype rounds the modified scores again
        keep = terms.keep(rows, np.arange(p.seqlen_k))
        if keep is not None:
            mask = keep if mask is None else mask & keep
    e, l, shift = masked_exp(s, mask)
    if terms is not None and terms.sinks is not None:   # the sink joins the denominator, adds no value
        sinks = terms.sinks[..., None].astype(acc)
        m = np.where(l == 0, -np.inf, shift)
        new = np.maximum(m, sinks)
        new_shift = np.where(np.isneginf(new), 0, new)
        with np.errstate(invalid="ignore", over="ignore"):
            e = e * np.exp(shift - new_shift)[..., None]
            l = e.sum(axis=-1) + np.exp(sinks - new_shift)
        shift = new_shift
    seen = l != 0  # NaN l (non-finite input the row sees) counts as seen: its NaN comes out
    l_safe = np.where(seen, l, 1)[..., None]
    keep = problem_keep(p, rows, np.arange(p.seqlen_k))   # dropout: Z / (1 - p) on P, after the softmax
    with np.errstate(invalid="ignore"):
        if keep is not None:
            o = masked_matmul(e * keep, vv, mask) / l_safe if round_to is None else \
                rnd(rnd(rnd(e / l_safe) * keep.astype(acc)) @ vv)
        else:
            o = masked_matmul(e, vv, mask) / l_safe if round_to is None else rnd(rnd_p(e / l_safe) @ vv)
        lse = np.where(seen, shift + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


# --------------------------------------------------------------------------------------------
# tiled forward (the CPU path)


def flash_attention(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
    block_m=None, block_n=None, out=None, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
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

    The work is spread over (kv head, query tile) items on a thread pool of the machine's size
    (``CUFLASH_NUM_THREADS``; :mod:`cuflash.runtime.threads`), with the BLAS library held to one
    thread meanwhile so a busy machine is not oversubscribed; the ``G`` query heads of a kv head
    (GQA) share one ``(G * Br) x Bc`` score tile, every buffer of a tile is preallocated and
    updated in place, and fp16/bf16 K/V are converted to float32 once per head when the copies
    are small (:data:`_KV_COPY_BYTES`), else one tile at a time as the loop reads them.

    Parameters
    ----------
    q, k, v, causal, softmax_scale, window_size, return_lse, layout
        As :func:`naive_attention`; head dims are not limited here.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod
        The score modifiers, as :func:`cuflash.attention` takes them; a bias or mask is read one
        ``(G * Br) x Bc`` block at a time from its (stride-0 broadcast) view, score_mod and
        mask_mod are evaluated on the same blocks, and a key tile that attn_mask or mask_mod
        hides from every row of the query tile is skipped.
    block_m, block_n : int, optional
        Query rows (Br) and key rows (Bc) per tile, >= 1; None (default) picks them for the
        cache (:func:`cpu_tiles`: Bc = 512, or 256 above head dim 128, more keys when the
        query rows are few, and a score tile of about 256 Ki elements).
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
    MemoryError
        When the working memory (:func:`forward_memory`) exceeds the available memory
        (:func:`cuflash.reference.memory.available_bytes`, ``CUFLASH_MEMORY_LIMIT``), before
        anything is allocated.

    Notes
    -----
    Peak extra memory is O(threads * G * block_m * (block_n + D + Dv)) for the tiles, plus the
    output and lse, plus float32 copies of K and V for fp16/bf16 input only while they take at most
    :data:`_KV_COPY_BYTES`: the ``Sq x Sk`` matrices never exist, and a broadcast (stride-0) K or
    V is never expanded.
    """
    func = "cuflash.reference.flash_attention"
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout, return_lse=return_lse,
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod))
    p = check_attention(q, k, v, options, func=func, out=out, max_head_dim=None)
    check_numpy(p)
    block_m, block_n = check_block_sizes(block_m, block_n, func)
    out, lse = run_forward(p, q, k, v, out, block_m, block_n)
    return (out, lse) if return_lse else out


#: the NumPy path's tile budget: a score tile of (group * Br) x Bc accumulator elements (1 MiB in
#: float32, about a core's L2). Measured on 2 EPYC cores (B=1, H=8, D=64, fp32; tiles Br x Bc):
#: S=8192 takes 1.71 s at 64 x 256, 0.85 s at 128 x 512, 0.78 s at 512 x 512 and 0.74 s at
#: 1024 x 1024; past 512 x 512 the gain is small and causal masks waste more of each tile.
_SCORE_TILE_ELEMS = 512 * 512

#: fp16/bf16 K and V are converted to float32 once per head (every query tile then reads the
#: copy) while the copies of all heads together take at most this many bytes; past it, and when a
#: head has one query tile only, each K/V tile is converted as the loop reads it (the same values:
#: the conversion is exact), so no copy of all of K exists
_KV_COPY_BYTES = 256 << 20


def cpu_tiles(p: AttentionProblem, block_m=None, block_n=None) -> tuple[int, int]:
    """The NumPy path's ``(Br, Bc)``: given sizes are kept; ``None`` picks them for the cache.

    Bc = 512 keys (256 for head dims above 128), and Br such that the (group * Br) x Bc score
    tile holds about :data:`_SCORE_TILE_ELEMS` elements (at least 16 rows); neither more than
    the problem has. When all the query rows of a head stack to fewer rows than that (decoding:
    Sq = 1), Bc grows until the score tile holds :data:`_SCORE_TILE_ELEMS` elements or a K tile
    holds as many, so a long key sequence takes few iterations. With a block mask, its block
    sizes (each block is one tile)."""
    if p.modifiers is not None and p.modifiers.block_mask is not None:
        return tuple(p.modifiers.block_mask.BLOCK_SIZE)
    g = max(1, p.group_size)
    if block_n is None:
        block_n = 512 if max(p.head_dim, p.head_dim_v) <= 128 else 256
        if block_m is None:
            wide = min(_SCORE_TILE_ELEMS // (g * max(1, p.seqlen_q)), _SCORE_TILE_ELEMS // max(1, p.head_dim, p.head_dim_v))
            block_n = max(block_n, wide)
        block_n = max(1, min(block_n, p.seqlen_k))
    if block_m is None:
        rows = max(16, _SCORE_TILE_ELEMS // (block_n * g))
        block_m = max(1, min(rows, p.seqlen_q))
    return block_m, block_n


def forward_memory(p: AttentionProblem, block_m: int, block_n: int, *, new_out: bool, kv_copies: int,
                   workers: int | None = None) -> dict:
    """Bytes the tiled forward of ``p`` allocates, by array: ``out`` (when ``new_out``), ``lse``,
    the float32 ``kv_copies`` (bytes, 0 for none) and the tiles of ``workers`` threads (default
    :func:`cuflash.runtime.threads.num_threads`; at most one per work item). A tile holds the
    scaled q rows, the score block and its masks, the accumulator and the row statistics of the
    ``G * Br`` stacked rows, and a converted K/V tile. (With a non-finite value the masked product
    also forms per-pair terms for the few rows that hold a NaN or inf; those are not counted.)"""
    acc = dtypes.accumulator(p.dtype).itemsize
    rows = max(1, p.group_size) * min(block_m, p.seqlen_q)
    n = min(block_n, p.seqlen_k)
    d, dv = p.head_dim, p.head_dim_v
    tile = acc * rows * (d + 3 * dv + 8) + rows * n * (3 * acc + 3) + 2 * acc * n * (d + dv)
    heads = math.prod(p.lse_shape) // max(1, p.seqlen_q * p.group_size)   # batch * Hk
    items = heads * -(-p.seqlen_q // max(1, block_m))
    workers = min(threads.num_threads() if workers is None else workers, max(1, items))
    return {"out": nbytes(p.out_shape, p.dtype) if new_out else 0,
            "lse": nbytes(p.lse_shape, dtypes.accumulator(p.dtype)),
            "float32 copies of k and v": kv_copies,
            f"tiles ({workers} threads)": workers * tile}


def run_forward(p: AttentionProblem, q, k, v, out=None, block_m=None, block_n=None):
    """The tiled forward on validated NumPy input (the NumPy path of :func:`cuflash.attention`):
    ``(out, lse)``; ``block_m``/``block_n`` None = :func:`cpu_tiles`.

    Work items are (kv head, query tile) pairs, run on :func:`cuflash.runtime.threads.run`'s
    pool with BLAS single-threaded; each item computes all ``G`` query heads of its kv head as
    one ``(G * Br) x Bc`` score tile. fp16/bf16 K and V are converted to float32 once per head
    while those copies stay under :data:`_KV_COPY_BYTES`, else tile by tile.

    Before anything is allocated or read, the working memory (:func:`forward_memory`) is
    checked against :func:`cuflash.reference.memory.available_bytes`; the non-finite check of V
    then reads each head's distinct elements (a broadcast view is not expanded).

    Raises
    ------
    MemoryError
        When the working memory exceeds the available memory; the message begins with
        ``p.func`` and names the arrays and bytes (:func:`cuflash.reference.memory.check_memory`).
    """
    acc_t = dtypes.accumulator(p.dtype)
    block_m, block_n = cpu_tiles(p, block_m, block_n)   # (with a block mask: its blocks)
    kv = canonical(k, p.layout)
    vv = canonical(v, p.layout)
    n_heads = 0 if p.is_empty else math.prod(kv.shape[:-2])
    copies = 0
    if kv.dtype != acc_t and n_heads and p.seqlen_q > block_m:
        copies = nbytes((n_heads, p.seqlen_k, p.head_dim + p.head_dim_v), acc_t)
        copies = copies if copies <= _KV_COPY_BYTES else 0
    # refused before any head is listed or any value read
    check_memory(p.func, forward_memory(p, block_m, block_n, new_out=out is None, kv_copies=copies))
    heads = list(np.ndindex(*kv.shape[:-2])) if n_heads else []
    v_finite = dict(zip(heads, threads.run(lambda h: all_finite(vv[h]), heads)))
    if out is None:
        out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.full(p.lse_shape, -np.inf, dtype=acc_t)
    if p.is_empty:
        return out, lse
    out_v = split_heads(canonical(out, p.layout), p.num_heads_k)
    lse_v = lse[None] if p.layout == "bhsd" and q.ndim == 2 else lse
    lse_v = split_heads(lse_v[..., None], p.num_heads_k)[..., 0]
    qv = split_heads(canonical(q, p.layout), p.num_heads_k)

    def head_kv(h):
        if not copies:
            return kv[h], vv[h], v_finite[h]
        return in_dtype(kv[h], acc_t), in_dtype(vv[h], acc_t), v_finite[h]

    kv_acc = dict(zip(heads, threads.run(head_kv, heads)))
    items = []
    for h in heads:
        for r0 in range(0, p.seqlen_q, block_m):
            lo, hi = key_range(p, r0, min(r0 + block_m, p.seqlen_q))
            items.append((hi - lo, h, r0))
    items.sort(key=lambda it: -it[0])  # the longest key ranges first: the pool ends together

    def tile(item):
        _, h, r0 = item
        kf, vf, finite = kv_acc[h]
        o, row_lse = _forward_tile(p, qv[h], kf, vf, finite, r0, min(r0 + block_m, p.seqlen_q), block_n, acc_t,
                                   head_index=h)
        out_v[h][:, r0 : r0 + o.shape[1]] = o
        lse_v[h][:, r0 : r0 + o.shape[1]] = row_lse

    threads.run(tile, items)
    return out, lse


def _forward_tile(p: AttentionProblem, q_head, kf, vf, v_finite: bool, r0: int, r1: int, block_n: int, acc_t,
                  head_index=None):
    """Rows ``[r0, r1)`` of the ``G`` query heads ``q_head`` (``(G, Sq, D)``) against one kv head
    (``kf``, ``vf``: ``(Sk, D)``, ``(Sk, Dv)``; in another type than the accumulation type each
    K/V tile is converted into a tile buffer as it is read): ``(out, lse)`` of shapes
    ``(G, R, Dv)`` (q's dtype) and ``(G, R)``. The G heads' rows are stacked row-major by query
    row, so one matmul serves the group; every buffer is preallocated and updated in place."""
    g, rows = q_head.shape[0], r1 - r0
    m_rows = g * rows
    qf = np.empty((rows, g, p.head_dim), dtype=acc_t)
    qf[...] = q_head[:, r0:r1].swapaxes(0, 1)
    qf *= acc_t.type(p.softmax_scale)
    qf = qf.reshape(m_rows, p.head_dim)
    m = np.full(m_rows, -np.inf, dtype=acc_t)
    l = np.zeros(m_rows, dtype=acc_t)
    acc = np.zeros((m_rows, p.head_dim_v), dtype=acc_t)
    s_flat = np.empty(m_rows * block_n, dtype=acc_t)
    pv = np.empty((m_rows, p.head_dim_v), dtype=acc_t)
    shift = np.empty(m_rows, dtype=acc_t)
    alpha = np.empty(m_rows, dtype=acc_t)
    convert = kf.dtype != acc_t
    if convert:   # fp16/bf16 K/V read tile by tile: one converted tile at a time
        k_buf = np.empty((block_n, p.head_dim), dtype=acc_t)
        v_buf = np.empty((block_n, p.head_dim_v), dtype=acc_t)
    query_rows = np.arange(r0, r1)
    lo, hi = key_range(p, r0, r1)
    terms = None if p.modifiers is None else HeadTerms(p, head_index, acc_t)
    if terms is not None and terms.blocks is not None:   # a block mask: its listed key blocks only (r0 starts a block)
        tiles = terms.key_blocks(r0 // terms.block_size[0], lo, hi)
    else:
        tiles = [(c0, min(c0 + block_n, hi), False) for c0 in range(lo, hi, block_n)]
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite input: inf - inf, 0 * inf stay NaN
        for c0, c1, full in tiles:
            n = c1 - c0
            cols = np.arange(c0, c1)
            mask = problem_mask(p, query_rows, cols)
            if mask is not None and mask.all():
                mask = None
            if mask is not None:
                mask = np.repeat(mask, g, axis=0)  # (R, n) -> the stacked (R * G, n)
            keep = None if terms is None else terms.keep(query_rows, cols, stacked=True, user=not full)
            if keep is not None:   # attn_mask joins the causal/window mask; a tile it hides is skipped
                mask = keep if mask is None else mask & keep
                if not mask.any():
                    continue
                if mask.all():
                    mask = None
            s = s_flat[: m_rows * n].reshape(m_rows, n)
            k_t, v_t = kf[c0:c1], vf[c0:c1]
            if convert:
                k_buf[:n], v_buf[:n] = k_t, v_t
                k_t, v_t = k_buf[:n], v_buf[:n]
            np.matmul(qf, k_t.T, out=s)
            if terms is not None:   # softcap, ALiBi, bias (after the scale, before the mask)
                terms.modify(s, query_rows, cols, stacked=True)
            if mask is not None:
                np.copyto(s, -np.inf, where=~mask)
            m_new = np.maximum(m, s.max(axis=1))
            np.copyto(shift, m_new)
            shift[np.isneginf(m_new)] = 0  # a row with no key yet: exp(-inf - 0) = 0, no NaN
            np.subtract(m, shift, out=alpha)
            np.exp(alpha, out=alpha)
            s -= shift[:, None]
            np.exp(s, out=s)
            l *= alpha
            l += s.sum(axis=1)
            if p.dropout is not None:   # the row sum is the undropped softmax's; P V takes P * Z / (1 - p)
                s *= problem_keep(p, query_rows, np.arange(c0, c1), head_index).reshape(m_rows, n).astype(acc_t)
            acc *= alpha[:, None]
            if v_finite or mask is None:
                np.matmul(s, v_t, out=pv)
                acc += pv
            else:  # a NaN/inf value row: products of pairs a row does not see are left out
                acc += masked_matmul(s, v_t, mask)
            m = m_new
        if terms is not None and terms.sinks is not None:
            join_sinks(m, l, acc, terms.stacked_sinks(rows))
        seen = l != 0  # l == 0: no key; a NaN l (non-finite input the row sees) stays NaN
        acc /= np.where(seen, l, 1)[:, None]
        acc[~seen] = 0
        row_lse = np.full(m_rows, -np.inf, dtype=acc_t)
        row_lse[seen] = m[seen] + np.log(l[seen])
    return (acc.reshape(rows, g, p.head_dim_v).swapaxes(0, 1).astype(p.dtype, copy=False),
            row_lse.reshape(rows, g).T)
