"""NumPy backward of attention: the float64 oracle and the tiled FlashAttention-2 backward.

Both functions take the forward's inputs, its output ``out``, its log-sum-exp ``lse`` and the
upstream gradient ``dout``, and return ``(dq, dk, dv)``. With ``S = softmax_scale * Q K^T``
(masked entries ``-inf``), the backward of ``O = softmax(S) V`` is (FlashAttention-2, Dao 2023,
Section 2.2 and Algorithm 2)::

    P  = exp(S - lse)              (recomputed from the saved lse; no second softmax)
    dV = P^T dO
    dP = dO V^T
    D  = rowsum(dO * O)            (= rowsum(P * dP), one number per query row)
    dS = P * (dP - D)
    dQ = softmax_scale * dS K
    dK = softmax_scale * dS^T Q

* :func:`attention_backward` materialises ``S``, ``P``, ``dP`` and ``dS`` in float64: the ground
  truth every backward kernel is checked against.
* :func:`flash_attention_backward` mirrors FlashAttention-2's backward (Algorithm 2): an outer
  loop over K/V tiles and an inner loop over the query tiles that can see them; ``P`` is
  recomputed per tile from Q, K and the saved ``lse``, ``dK`` and ``dV`` are accumulated per
  K/V tile and written once, ``dQ`` is accumulated across K/V tiles in a float32 buffer (float64
  for float64 input; on a GPU this is the atomically updated workspace). ``D`` is computed once
  up front (the paper's pre-processing step). Extra memory is O(batch * heads * (Sq * D +
  block_m * block_n)), never O(Sq * Sk).

Conventions are the forward's (:mod:`cuflash.reference`): layouts ``"bhsd"``/``"bshd"``,
bottom-right causal masks, ``window_size``, GQA/MQA (the gradient of a kv head sums the
contributions of every query head that reads it), 2-D input, any strides with unit last axis.
A query row whose ``lse`` is ``-inf`` (it sees no key) contributes nothing: its ``P`` row is 0
(``exp(s - lse)`` is special-cased, never ``exp(-inf - -inf)``), so its ``dq`` row is exactly 0
and no NaN appears. Non-finite input (a NaN or inf in q, k, v, dout, or the NaN ``out``/``lse``
the forward made of it) travels only along the (query, key) pairs that are visible: ``P`` and
``dS`` are exactly 0 on the others and their products are left out (not multiplied by 0), so a
gradient entry is non-finite exactly where the math puts a non-finite term into its sum.
"""

from __future__ import annotations

import math

import numpy as np

from cuflash.reference.dropout import problem_keep
from cuflash.reference.masks import masked_matmul, problem_mask, query_range
from cuflash.reference.memory import all_finite, check_memory, nbytes
from cuflash.reference.modifiers import BiasGrad, HeadTerms, reduce_bias_grad, scale_grad, sink_grad
from cuflash.reference.score_mods import ArrayGrads
from cuflash.reference.views import (
    canonical,
    check_numpy,
    in_dtype,
    kv_view,
    split_heads,
)
from cuflash.runtime import dtypes, threads
from cuflash.runtime.interop import describe
from cuflash.runtime.options import DropoutOptions, ModifierOptions, Options
from cuflash.runtime.validation import (
    AttentionProblem,
    check_attention,
    check_block_sizes,
    check_flags,
    check_strides,
)

__all__ = ["attention_backward", "flash_attention_backward", "check_backward", "backward_memory", "run_backward"]

_LSE_DTYPES = (dtypes.float32, dtypes.float64)


# --------------------------------------------------------------------------------------------
# validation


def check_backward(dout, q, k, v, out, lse, options, *, func: str, max_head_dim=None) -> AttentionProblem:
    """Validate a backward call: the forward's checks on q, k, v and options, then ``out``,
    ``dout`` and ``lse`` (kind, dtype, shape, strides). Reads no array data.

    Raises
    ------
    TypeError
        A non-array, an array of another kind than q, ``out.dtype != q.dtype``,
        ``dout.dtype != out.dtype``, or an ``lse`` that is not float32/float64; a bad modifier
        (:func:`cuflash.runtime.validation_modifiers.check_modifiers`).
    ValueError
        ``return_dbias`` without ``attn_bias``, ``return_dsinks`` without ``sinks``,
        ``return_dscore_mod`` without ``score_mod``. A wrong shape of ``out``, ``dout`` or ``lse``; a non-unit last-axis or negative stride of
        ``out`` or ``dout``; anything :func:`cuflash.runtime.validation.check_attention` refuses.
    """
    options = check_flags(options, func, "deterministic", "return_dbias", "return_dsinks", "return_dscore_mod")
    p = check_attention(q, k, v, options, func=func, max_head_dim=max_head_dim)
    mods = options.modifiers
    for flag, name in (("return_dbias", "attn_bias"), ("return_dsinks", "sinks"), ("return_dscore_mod", "score_mod")):
        if getattr(options, flag) and getattr(mods, name) is None:
            raise ValueError(f"{func}: {flag}=True needs {name} (the gradient is {name}'s); got {name}=None")
    infos = {name: describe(x, name, func) for name, x in (("out", out), ("dout", dout), ("lse", lse))}
    for name, info in infos.items():
        if info.kind != p.kind:
            raise TypeError(
                f"{func}: {name} is a {info.type_name} but q is a {p.q.type_name}; all arrays must be of "
                f"one kind (no implicit copies between host and device)"
            )
        if info.device != p.device:
            raise ValueError(f"{func}: {name} is on device {info.device} but q is on device {p.device}")
    oi, di, li = infos["out"], infos["dout"], infos["lse"]
    if not dtypes.same(oi.dtype, p.dtype):
        raise TypeError(f"{func}: out.dtype={oi.dtype_name} must equal q.dtype={p.dtype.name} (the forward's output)")
    if not dtypes.same(di.dtype, oi.dtype):
        raise TypeError(f"{func}: dout.dtype={di.dtype_name} must equal out.dtype={oi.dtype_name}")
    if not dtypes.among(li.dtype, _LSE_DTYPES):
        raise TypeError(f"{func}: lse.dtype={li.dtype_name} must be float32 or float64 (the forward's lse)")
    out_rule = "(B, Sq, Hq, Dv)" if p.layout == "bshd" else "q.shape[:-1] + (v.shape[-1],)"
    if oi.shape != p.out_shape:
        raise ValueError(f"{func}: out.shape={oi.shape} must be {p.out_shape} ({out_rule}) for these q and v")
    if di.shape != oi.shape:
        raise ValueError(f"{func}: dout.shape={di.shape} must equal out.shape={oi.shape}")
    lse_rule = "(B, Hq, Sq) for layout='bshd'" if p.layout == "bshd" else "q.shape[:-1]"
    if li.shape != p.lse_shape:
        raise ValueError(f"{func}: lse.shape={li.shape} must be {p.lse_shape} ({lse_rule})")
    check_strides(oi, "out", func)
    check_strides(di, "dout", func)
    return p


# --------------------------------------------------------------------------------------------
# shared helpers


def _lse_view(lse: np.ndarray, p: AttentionProblem, two_dim: bool) -> np.ndarray:
    """``lse`` as ``(*batch, Hk, G, Sq)``."""
    view = lse[None] if p.layout == "bhsd" and two_dim else lse
    return split_heads(view[..., None], p.num_heads_k)[..., 0]


def _probs_and_pairs(s: np.ndarray, lse: np.ndarray, mask: np.ndarray | None):
    """``(P, pairs)``: ``P = exp(s - lse)`` on the visible pairs and exactly 0 elsewhere, and the
    visible pairs (the mask, less the rows whose ``lse`` is ``-inf``: they see no key).

    Non-finite input stays on its pairs: a NaN ``lse`` (the forward saw NaN in that row) makes
    that row's visible ``P`` NaN, never its masked entries."""
    pairs = ~np.isneginf(lse)[..., None]
    if mask is not None:
        pairs = pairs & mask
    with np.errstate(invalid="ignore"):  # inf - inf where a score is +inf: kept as NaN
        probs = np.where(pairs, np.exp(s - np.where(pairs, lse[..., None], 0)), 0)
    return probs, pairs


def _grad_ds(probs, dp, d_row, pairs):
    """``dS = P * (dP - D)`` on the visible pairs, exactly 0 elsewhere (a NaN ``dP`` or ``D`` of
    an invisible pair does not spread)."""
    with np.errstate(invalid="ignore"):
        return np.where(pairs, probs * (dp - d_row[..., None]), 0)


def _outputs(q, k, v, dtype):
    """Zeroed dq, dk, dv with the shapes of q, k, v (C-contiguous, whatever the inputs' strides)."""
    return tuple(np.zeros(x.shape, dtype=dtype) for x in (q, k, v))


# --------------------------------------------------------------------------------------------
# naive backward (float64 ground truth)


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
    dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None,
    sinks=None, score_mod=None, mask_mod=None, return_dbias=False, return_dsinks=False, return_dscore_mod=False,
):
    """Gradients of attention with S, P, dP and dS materialised, in float64: the ground truth.

    Computes, entirely in float64 (FlashAttention-2, Dao 2023, Section 2.2)::

        S  = softmax_scale * Q K^T  (masked -inf)     P  = exp(S - lse)
        dV = P^T dO                                   dP = dO V^T
        D  = rowsum(dO * O)                           dS = P * (dP - D)
        dQ = softmax_scale * dS K                     dK = softmax_scale * dS^T Q

    With GQA/MQA, ``dK`` and ``dV`` of a kv head sum over the query heads that share it.

    Parameters
    ----------
    dout : numpy.ndarray, shape and dtype of ``out``
        Gradient of the loss with respect to ``out``; any strides with unit last axis.
    q, k, v : numpy.ndarray
        The forward's inputs, as :func:`cuflash.reference.naive_attention` takes them (float16,
        bfloat16, float32 or float64, one dtype; no head-dim limit).
    out : numpy.ndarray, q's dtype, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``
        The forward's output (enters only through ``D = rowsum(dO * O)``).
    lse : numpy.ndarray, float32 or float64, shape ``q.shape[:-1]`` ("bhsd") or ``(B, Hq, Sq)``
        The forward's natural-log log-sum-exp; ``-inf`` for a row that sees no key.
    causal, softmax_scale, window_size, layout
        As the forward (bottom-right causal alignment; ``softmax_scale=None`` is ``1/sqrt(D)``).
    dropout_p, dropout_seed, dropout_offset
        The forward's dropout: with the mask ``Z`` of :func:`cuflash.reference.dropout_mask`,
        ``dV = (P Z / (1 - p))^T dO`` and ``dS = P (dP Z / (1 - p) - D)``.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod
        The forward's score modifiers (:mod:`cuflash.reference.modifiers` has the gradients:
        ``dS * score_mod'`` through score_mod's symbolic derivative, then ``d attn_bias`` =
        that summed over the broadcast axes, ``* (1 - tanh^2)`` under a softcap, ``d sinks =
        -sum exp(sink - lse) * D``).
    return_dbias, return_dsinks : bool
        Also return ``d attn_bias`` (the bias's own shape) and ``d sinks`` (``(Hq,)``).
    return_dscore_mod : bool
        Also return the gradients of the score_mod's captured float arrays: ``sum dS * d
        score_mod / d read`` over every pair, scattered at each read's index
        (:func:`cuflash.runtime.score_mod.array_derivatives`).

    Returns
    -------
    dq, dk, dv : numpy.ndarray, float64, the shapes of q, k and v
    dbias : numpy.ndarray, float64, ``attn_bias.shape``; only with ``return_dbias``
    dsinks : numpy.ndarray, float64, ``(Hq,)``; only with ``return_dsinks``
    dscore_mod : dict of str to numpy.ndarray, float64; only with ``return_dscore_mod``
        Each captured float array's name (its variable name in the score_mod) to its gradient
        (the array's shape).

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention` for q, k, v and options; for ``dout``, ``out`` and ``lse``
        of the wrong kind, dtype (``out.dtype`` must be q's, ``dout.dtype`` out's, ``lse``
        float32/float64) or shape.

    Notes
    -----
    A row with ``lse = -inf`` gets ``P = 0``: its ``dq`` row is exactly 0 and it adds nothing to
    ``dk``/``dv``. Memory is O(batch * heads * Sq * Sk); use it on small problems.
    """
    func = "cuflash.reference.attention_backward"
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout, return_dbias=return_dbias,
                      return_dsinks=return_dsinks, return_dscore_mod=return_dscore_mod,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod))
    p = check_backward(dout, q, k, v, out, lse, options, func=func)
    check_numpy(p)
    dq, dk, dv = _outputs(q, k, v, np.float64)
    extra = []
    mods = p.modifiers
    if return_dbias:
        extra.append(np.zeros(mods.attn_bias.own_shape, np.float64))
    if return_dsinks:
        extra.append(np.zeros((p.num_heads_q,), np.float64))
    array_grad = ArrayGrads(mods.score_mod, np.float64) if p.options.return_dscore_mod else None
    if array_grad is not None:
        extra.append(array_grad.result(np.float64))
    if p.is_empty or not p.num_heads_k:
        return (dq, dk, dv, *extra)
    f64 = np.float64
    qv = split_heads(canonical(q, layout), p.num_heads_k).astype(f64)
    kv = kv_view(canonical(k, layout)).astype(f64)
    vv = kv_view(canonical(v, layout)).astype(f64)
    dov = split_heads(canonical(dout, layout), p.num_heads_k).astype(f64)
    ov = split_heads(canonical(out, layout), p.num_heads_k).astype(f64)
    lv = _lse_view(lse, p, q.ndim == 2).astype(f64)

    with np.errstate(invalid="ignore"):  # non-finite input: its NaN is kept, never warned about
        s = (qv @ kv.swapaxes(-1, -2)) * p.softmax_scale
        rows, cols = np.arange(p.seqlen_q), np.arange(p.seqlen_k)
        mask = problem_mask(p, rows, cols)
        terms = None if mods is None else HeadTerms(p, None, f64)
        chain = None
        if terms is not None:
            chain = terms.modify(s, rows, cols, grad=True, arrays=array_grad is not None)
            user = terms.keep(rows, cols)
            if user is not None:
                mask = user if mask is None else mask & user
        probs, pairs = _probs_and_pairs(s, lv, mask)
        d_row = np.sum(dov * ov, axis=-1)
        dp = dov @ vv.swapaxes(-1, -2)
        keep = problem_keep(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))   # Z / (1 - p), or None
        ds = _grad_ds(probs, dp if keep is None else dp * keep, d_row, pairs)
        if array_grad is not None:   # the captured float arrays: dS (of score_mod's result) * d / d read
            array_grad.add(array_grad.buf, ds, chain.arrays)
        if chain is not None:   # through score_mod: d score_mod / d score
            ds = scale_grad(ds, chain.mod)
        extra = []
        if return_dbias:
            extra.append(reduce_bias_grad(mods.attn_bias, ds.reshape(mods.attn_bias.shape)))
        if return_dsinks:   # d sink = -sum over batch and rows of exp(sink - lse) * D
            w = np.where(np.isneginf(lv), 0, np.exp(terms.sinks[..., None] - np.where(np.isneginf(lv), 0, lv)))
            extra.append(-(w * d_row).sum(axis=-1).reshape((-1, p.num_heads_q)).sum(axis=0))
        if array_grad is not None:
            extra.append(array_grad.result(np.float64))
        if chain is not None and chain.cap is not None:   # through the softcap (dbias may be a view of ds)
            ds = scale_grad(ds.copy(), chain.cap)
        pairs_t = pairs.swapaxes(-1, -2)
        split_heads(canonical(dq, layout), p.num_heads_k)[...] = p.softmax_scale * masked_matmul(ds, kv, pairs)
        canonical(dk, layout)[...] = p.softmax_scale * masked_matmul(ds.swapaxes(-1, -2), qv, pairs_t).sum(axis=-3)
        dropped = probs if keep is None else probs * keep
        canonical(dv, layout)[...] = masked_matmul(dropped.swapaxes(-1, -2), dov, pairs_t).sum(axis=-3)
    return (dq, dk, dv, *extra)


# --------------------------------------------------------------------------------------------
# tiled backward (the CPU path)


def flash_attention_backward(
    dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
    block_m=None, block_n=None, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
    return_dbias=False, return_dsinks=False, return_dscore_mod=False,
):
    """The tiled FlashAttention-2 backward in NumPy: the CPU path of :func:`cuflash.attention_backward`.

    FlashAttention-2 (Dao 2023), Algorithm 2. First ``D = rowsum(dO * O)`` per query row. Then
    for each K/V tile ``j`` of ``block_n`` keys, with ``dK_j = dV_j = 0``, for each ``block_m``-row
    query tile ``i`` that can see a key of tile ``j``::

        S_ij  = softmax_scale * Q_i K_j^T          (masked entries -inf)
        P_ij  = exp(S_ij - lse_i)                  (0 for a row whose lse is -inf)
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)
        dQ_i += softmax_scale * dS_ij K_j          (float32 buffer; atomics on a GPU)
        dK_j += softmax_scale * dS_ij^T Q_i

    and ``dK_j``, ``dV_j`` are written once after the query loop; ``dQ`` is cast after the last
    K/V tile. Tiles of keys no query row can see (causal, windows) are skipped and their
    gradients are 0. With GQA/MQA a kv head's ``dK_j``/``dV_j`` sum over its query heads.

    The key tiles of each kv head are split into chunks run on a thread pool of the machine's
    size (``CUFLASH_NUM_THREADS``) with BLAS held to one thread; each chunk has its own dQ
    buffer, and a head's buffers are summed in chunk order (a function of the shape only), so
    the result is bit-identical run to run and for any number of threads.

    Parameters
    ----------
    dout, q, k, v, out, lse, causal, softmax_scale, window_size, layout
        As :func:`attention_backward`.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod, return_dbias, return_dsinks, return_dscore_mod
        As :func:`attention_backward`. ``d attn_bias`` (and the captured float arrays'
        gradients) is summed per work item over the bias's
        broadcast axes into a small partial, and the partials are added in a fixed order (the
        work items run in waves of the pool's size for it), so it is bit-identical run to run
        and for any thread count; a key tile attn_mask hides from a whole query tile is skipped.
    block_m, block_n : int, optional
        Query rows (Br) and key rows (Bc) per tile, >= 1; None (default): the forward's
        cache-sized tiles (:func:`cuflash.reference.forward.cpu_tiles`).

    Returns
    -------
    dq, dk, dv : numpy.ndarray of q's dtype, the shapes of q, k and v
        Accumulated in float32 (float64 for float64 input).
    dbias : numpy.ndarray of attn_bias's dtype and shape; only with ``return_dbias``
    dsinks : numpy.ndarray, float32 (float64 for float64 input), ``(Hq,)``; only with ``return_dsinks``
    dscore_mod : dict of str to numpy.ndarray; only with ``return_dscore_mod``
        Each captured float array's gradient, in its shape and dtype, by variable name.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_backward`; ``ValueError`` for tile sizes < 1.
    MemoryError
        When the working memory (:func:`backward_memory`) exceeds the available memory
        (:func:`cuflash.reference.memory.available_bytes`, ``CUFLASH_MEMORY_LIMIT``), before
        anything is allocated.

    Notes
    -----
    Peak extra memory is O(batch * heads * Sq * D) (the float32 dQ buffers and the per-head
    float32 copies of q, dO) plus O(threads * G * block_m * block_n) for the tiles, besides the
    gradients themselves: the ``Sq x Sk`` matrices never exist, and K and V are read (converted
    for fp16/bf16) one tile at a time.
    """
    func = "cuflash.reference.flash_attention_backward"
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout, return_dbias=return_dbias,
                      return_dsinks=return_dsinks, return_dscore_mod=return_dscore_mod,
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias,
                                                                             attn_mask, sinks, score_mod, mask_mod))
    p = check_backward(dout, q, k, v, out, lse, options, func=func)
    check_numpy(p)
    block_m, block_n = check_block_sizes(block_m, block_n, func)
    return run_backward(p, dout, q, k, v, out, lse, block_m, block_n)


#: key tiles of one kv head are split into about this many independent chunks in all (over the
#: heads), so a problem with few heads still fills the pool; a function of the shape alone, so
#: the summation order of dq, and with it every bit, does not depend on the thread count
_BWD_CHUNKS = 8


def backward_memory(p: AttentionProblem, shapes, heads: int, items: int, block_m: int, block_n: int,
                    workers: int | None = None) -> dict:
    """Bytes the tiled backward of ``p`` allocates, by array: ``dq, dk, dv`` (of ``shapes``, the
    shapes of q, k, v), the per-head float32 copies of q and dO with their ``lse`` and ``D`` rows
    (``heads`` kv heads in all), the dQ accumulators of ``items`` work items and of each head, and
    the tiles of ``workers`` threads (default :func:`cuflash.runtime.threads.num_threads`; at most
    one per item): score, probability, gradient and mask blocks of ``G * Br`` stacked rows, the
    converted K/V tile and its dK/dV rows. (With non-finite input the masked products also form
    per-pair terms for the few rows that hold a NaN or inf; those are not counted.)"""
    acc_t = dtypes.accumulator(p.dtype)
    acc = acc_t.itemsize
    g, d, dv = max(1, p.group_size), p.head_dim, p.head_dim_v
    rows = g * min(block_m, p.seqlen_q)
    n = min(block_n, p.seqlen_k)
    per_head_q = p.seqlen_q * g
    tile = rows * n * (7 * acc + 3) + 4 * acc * n * (d + dv) + acc * per_head_q * dv
    workers = min(threads.num_threads() if workers is None else workers, max(1, items))
    return {"dq, dk, dv": sum(nbytes(shape, p.dtype) for shape in shapes),
            "float32 copies of q and dout": heads * acc * per_head_q * (d + dv + 2),
            "dq accumulators": (items + heads) * acc * per_head_q * d,
            f"tiles ({workers} threads)": workers * tile if heads else 0}


def run_backward(p: AttentionProblem, dout, q, k, v, out, lse, block_m=None, block_n=None):
    """The tiled backward on validated NumPy input (the NumPy path of :func:`cuflash.attention_backward`).

    ``block_m``/``block_n`` None pick the forward's cache-sized tiles
    (:func:`cuflash.reference.forward.cpu_tiles`). Work items are (kv head, chunk of key tiles)
    pairs on :func:`cuflash.runtime.threads.run`'s pool with BLAS single-threaded; each keeps
    its own float32 dQ accumulator, and a head's chunks are added in chunk order afterwards
    (deterministic, whatever the number of threads). The ``G`` query heads of a kv head are
    stacked into ``(G * Br)``-row tiles, as in the forward. ``p.options.return_dbias`` /
    ``return_dsinks`` append ``d attn_bias`` (the bias's dtype) and ``d sinks`` (the
    accumulation type).

    Before allocating, the working memory (:func:`backward_memory`) is checked against
    :func:`cuflash.reference.memory.available_bytes`; K and V are read (and fp16/bf16 converted)
    tile by tile, and their non-finite checks read the distinct elements only (a broadcast view is
    not expanded).

    Raises
    ------
    MemoryError
        When the working memory exceeds the available memory; the message begins with
        ``p.func`` and names the arrays and bytes (:func:`cuflash.reference.memory.check_memory`).
    """
    return_dbias, return_dsinks = p.options.return_dbias, p.options.return_dsinks
    from cuflash.reference.forward import cpu_tiles

    acc_t = dtypes.accumulator(p.dtype)
    heads_n = 0 if p.is_empty or not p.num_heads_k else math.prod(canonical(k, p.layout).shape[:-2])
    block_m, block_n = cpu_tiles(p, block_m, block_n)   # (with a block mask: its blocks)
    n_tiles = -(-p.seqlen_k // block_n)
    chunks = max(1, min(n_tiles, -(-_BWD_CHUNKS // max(1, heads_n))))
    check_memory(p.func, backward_memory(p, (q.shape, k.shape, v.shape), heads_n, heads_n * chunks, block_m, block_n))
    dq, dk, dv = _outputs(q, k, v, p.dtype)
    mods = p.modifiers
    bias_grad = BiasGrad(p, acc_t) if return_dbias else None
    dsinks = np.zeros((p.num_heads_k, p.group_size), acc_t) if return_dsinks else None
    array_grad = ArrayGrads(mods.score_mod, acc_t) if p.options.return_dscore_mod else None

    def extra():
        more = [] if bias_grad is None else [bias_grad.result(mods.attn_bias.dtype)]
        more = more if dsinks is None else [*more, dsinks.reshape(p.num_heads_q)]
        return more if array_grad is None else [*more, array_grad.result()]

    if p.is_empty or not p.num_heads_k:
        return (dq, dk, dv, *extra())
    layout = p.layout
    qv = split_heads(canonical(q, layout), p.num_heads_k)
    dov = split_heads(canonical(dout, layout), p.num_heads_k)
    ov = split_heads(canonical(out, layout), p.num_heads_k)
    lv = _lse_view(lse, p, q.ndim == 2)
    kv, vv = canonical(k, layout), canonical(v, layout)
    dq_v = split_heads(canonical(dq, layout), p.num_heads_k)
    dk_v, dv_v = canonical(dk, layout), canonical(dv, layout)
    heads = list(np.ndindex(*kv.shape[:-2]))
    g = p.group_size

    def stacked(x, h):
        """``(G, S, D)`` of head ``h`` as ``(S, G, D)`` rows in the accumulation type (one copy)."""
        a = np.empty((x.shape[-2], g, x.shape[-1]), dtype=acc_t)
        a[...] = x[h].swapaxes(0, 1)
        return a

    def prepare(h):
        """Head ``h`` converted once: q, dO stacked by row; lse and D = rowsum(dO * O) likewise."""
        qf, dof = stacked(qv, h), stacked(dov, h)
        with np.errstate(invalid="ignore", over="ignore"):
            d_row = np.einsum("sgd,sgd->sg", dof, stacked(ov, h))  # FA2 Algorithm 2's pre-processing
        lse_h = np.empty((p.seqlen_q, g), dtype=acc_t)
        lse_h[...] = lv[h].T
        finite = {name: all_finite(a) for name, a in (("q", qf), ("do", dof), ("k", kv[h]))}
        return qf, dof, d_row, lse_h, kv[h], vv[h], finite   # K and V are converted tile by tile

    per_head = dict(zip(heads, threads.run(prepare, heads)))
    if dsinks is not None:   # d sink = -sum over rows of exp(sink - lse) * D, heads added in order
        sinks = HeadTerms(p, None, acc_t).sinks
        for h in heads:
            _, _, d_row, lse_h, _, _, _ = per_head[h]
            dsinks[h[-1]] += sink_grad(sinks[h], lse_h, d_row)
    bounds = [(n_tiles * c // chunks, n_tiles * (c + 1) // chunks) for c in range(chunks)]
    items = [(h, c, t0, t1) for h in heads for c, (t0, t1) in enumerate(bounds) if t1 > t0]

    def work(item):
        h, _, t0, t1 = item
        return _backward_chunk(p, per_head[h], t0, t1, block_m, block_n, acc_t, dk_v[h], dv_v[h], head_index=h,
                               bias_grad=bias_grad, array_grad=array_grad)

    # with d attn_bias, waves of the pool's size keep only that many partials alive; each wave's
    # results are added in item order, so the sums' order does not depend on the wave size
    wave = max(1, len(items) if bias_grad is None and array_grad is None else threads.num_threads())
    by_head: dict = {}
    for w0 in range(0, len(items), wave):
        part_items = items[w0:w0 + wave]
        for (h, _, t0, t1), (part, dbias_part, arrays_part) in zip(part_items, threads.run(work, part_items)):
            if part is not None:   # items are in chunk order per head
                by_head[h] = part if h not in by_head else by_head[h] + part
            if dbias_part is not None:
                bias_grad.commit(dbias_part, h, t0 * block_n, min(t1 * block_n, p.seqlen_k))
            if arrays_part is not None:
                array_grad.commit(arrays_part)
    for h, dq_h in by_head.items():
        dq_v[h][...] = dq_h.swapaxes(0, 1)
    return (dq, dk, dv, *extra())


def _backward_chunk(p: AttentionProblem, head, t0, t1, block_m, block_n, acc_t, dk_out, dv_out, head_index=None,
                    bias_grad=None, array_grad=None):
    """Key tiles ``[t0, t1)`` of one kv head: writes their dK, dV rows into ``dk_out``/``dv_out``
    (``(Sk, D)`` views) and returns ``(dq, dbias, darrays)``: this chunk's dQ contribution, ``(Sq, G, D)``
    in the accumulation type (None when no query row sees these keys), its ``d attn_bias``
    partial (:class:`cuflash.reference.modifiers.BiasGrad`; None without ``bias_grad``) and its
    captured float arrays' partial (:class:`cuflash.reference.score_mods.ArrayGrads`; None
    without ``array_grad``)."""
    qf, dof, d_row, lse_h, kf, vf, finite = head
    g = qf.shape[1]
    scale = acc_t.type(p.softmax_scale)
    dq_acc = None
    terms = None if p.modifiers is None else HeadTerms(p, head_index, acc_t)
    k0 = t0 * block_n
    dbias = None if bias_grad is None else bias_grad.partial(k0, min(t1 * block_n, p.seqlen_k))
    darrays = None if array_grad is None else array_grad.partial()
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite input: its NaN is kept, never warned about
        for t in range(t0, t1):
            c0 = t * block_n
            c1 = min(c0 + block_n, p.seqlen_k)
            lo, hi = query_range(p, c0, c1)
            if lo >= hi:
                continue  # no query row sees these keys: dK_j = dV_j = 0 (already zero)
            kt, vt = in_dtype(kf[c0:c1], acc_t), in_dtype(vf[c0:c1], acc_t)   # each K/V tile is read once
            dk_j = np.zeros((c1 - c0, p.head_dim), dtype=acc_t)
            dv_j = np.zeros((c1 - c0, p.head_dim_v), dtype=acc_t)
            cols = np.arange(c0, c1)
            if dq_acc is None:
                dq_acc = np.zeros(qf.shape, dtype=acc_t)
            if terms is not None and terms.blocks is not None:   # the block mask's transposed index: key block t's query blocks
                row_tiles = terms.query_blocks(t, lo, hi)
            else:
                row_tiles = [(r0, min(r0 + block_m, hi), False) for r0 in range(lo, hi, block_m)]
            for r0, r1, full in row_tiles:
                rows = (r1 - r0) * g
                q_t = qf[r0:r1].reshape(rows, p.head_dim)
                do_t = dof[r0:r1].reshape(rows, p.head_dim_v)
                mask = problem_mask(p, np.arange(r0, r1), cols)
                if mask is not None:
                    mask = None if mask.all() else np.repeat(mask, g, axis=0)
                user = None if terms is None else terms.keep(np.arange(r0, r1), cols, stacked=True, user=not full)
                if user is not None:   # attn_mask joins the window mask; a tile it hides is skipped
                    mask = user if mask is None else mask & user
                    if not mask.any():
                        continue
                s = q_t @ kt.T
                s *= scale
                chain = None if terms is None else terms.modify(s, np.arange(r0, r1), cols, stacked=True, grad=True,
                                                                arrays=darrays is not None)
                probs, pairs = _probs_and_pairs(s, lse_h[r0:r1].reshape(rows), mask)
                pairs_t = pairs.T
                keep = problem_keep(p, np.arange(r0, r1), cols, head_index)   # dropout: Z / (1 - p)
                keep = None if keep is None else keep.reshape(rows, c1 - c0).astype(acc_t)
                dropped = probs if keep is None else probs * keep
                dv_j += masked_matmul(dropped.T, do_t, pairs_t) if not finite["do"] else dropped.T @ do_t
                dp = do_t @ vt.T
                if keep is not None:
                    dp *= keep
                ds = _grad_ds(probs, dp, d_row[r0:r1].reshape(rows), pairs)
                if darrays is not None:   # the captured float arrays: dS (of score_mod's result) * d / d read
                    array_grad.add(darrays, ds, chain.arrays)
                if chain is not None:   # through score_mod: d score_mod / d score
                    scale_grad(ds, chain.mod)
                if dbias is not None:
                    bias_grad.add(dbias, ds, r0, r1, c0 - k0, c1 - k0)
                if chain is not None:   # through the softcap: d tanh-capped / d s = 1 - tanh^2
                    scale_grad(ds, chain.cap)
                ds *= scale
                dq_acc[r0:r1].reshape(rows, p.head_dim)[...] += (
                    masked_matmul(ds, kt, pairs) if not finite["k"] else ds @ kt)
                dk_j += masked_matmul(ds.T, q_t, pairs_t) if not finite["q"] else ds.T @ q_t
            dk_out[c0:c1] = dk_j
            dv_out[c0:c1] = dv_j
    return dq_acc, dbias, darrays
