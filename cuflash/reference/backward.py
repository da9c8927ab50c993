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

import numpy as np

from cuflash.reference.masks import masked_matmul, problem_mask, query_range
from cuflash.reference.views import canonical, check_numpy, kv_view, split_heads
from cuflash.runtime import dtypes
from cuflash.runtime.interop import describe
from cuflash.runtime.validation import (
    AttentionProblem,
    check_attention,
    check_int,
    check_strides,
)

__all__ = ["attention_backward", "flash_attention_backward", "check_backward"]

_LSE_DTYPES = (dtypes.float32, dtypes.float64)


# --------------------------------------------------------------------------------------------
# validation


def check_backward(
    dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
    func: str, max_head_dim=None,
) -> AttentionProblem:
    """Validate a backward call: the forward's checks on q, k, v and options, then ``out``,
    ``dout`` and ``lse`` (kind, dtype, shape, strides). Reads no array data.

    Raises
    ------
    TypeError
        A non-array, an array of another kind than q, ``out.dtype != q.dtype``,
        ``dout.dtype != out.dtype``, or an ``lse`` that is not float32/float64.
    ValueError
        A wrong shape of ``out``, ``dout`` or ``lse``; a non-unit last-axis or negative stride of
        ``out`` or ``dout``; anything :func:`cuflash.runtime.validation.check_attention` refuses.
    """
    p = check_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
        func=func, max_head_dim=max_head_dim,
    )
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
    if oi.dtype != p.dtype:
        raise TypeError(f"{func}: out.dtype={oi.dtype_name} must equal q.dtype={p.dtype.name} (the forward's output)")
    if di.dtype != oi.dtype:
        raise TypeError(f"{func}: dout.dtype={di.dtype_name} must equal out.dtype={oi.dtype_name}")
    if li.dtype not in _LSE_DTYPES:
        raise TypeError(f"{func}: lse.dtype={li.dtype_name} must be float32 or float64 (the forward's lse)")
    out_rule = "(B, Sq, Hq, Dv)" if layout == "bshd" else "q.shape[:-1] + (v.shape[-1],)"
    if oi.shape != p.out_shape:
        raise ValueError(f"{func}: out.shape={oi.shape} must be {p.out_shape} ({out_rule}) for these q and v")
    if di.shape != oi.shape:
        raise ValueError(f"{func}: dout.shape={di.shape} must equal out.shape={oi.shape}")
    lse_rule = "(B, Hq, Sq) for layout='bshd'" if layout == "bshd" else "q.shape[:-1]"
    if li.shape != p.lse_shape:
        raise ValueError(f"{func}: lse.shape={li.shape} must be {p.lse_shape} ({lse_rule})")
    check_strides(oi, "out", func)
    check_strides(di, "dout", func)
    return p


def _check_blocks(block_m, block_n, func):
    block_m = check_int(block_m, "block_m", func)
    block_n = check_int(block_n, "block_n", func)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 1:
            raise ValueError(f"{func}: {name} must be >= 1, got {value}")
    return block_m, block_n


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

    Returns
    -------
    dq, dk, dv : numpy.ndarray, float64, the shapes of q, k and v

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
    p = check_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        layout=layout, func=func,
    )
    check_numpy(p)
    dq, dk, dv = _outputs(q, k, v, np.float64)
    if p.is_empty or not p.num_heads_k:
        return dq, dk, dv
    f64 = np.float64
    qv = split_heads(canonical(q, layout), p.num_heads_k).astype(f64)
    kv = kv_view(canonical(k, layout)).astype(f64)
    vv = kv_view(canonical(v, layout)).astype(f64)
    dov = split_heads(canonical(dout, layout), p.num_heads_k).astype(f64)
    ov = split_heads(canonical(out, layout), p.num_heads_k).astype(f64)
    lv = _lse_view(lse, p, q.ndim == 2).astype(f64)

    with np.errstate(invalid="ignore"):  # non-finite input: its NaN is kept, never warned about
        s = (qv @ kv.swapaxes(-1, -2)) * p.softmax_scale
        mask = problem_mask(p, np.arange(p.seqlen_q), np.arange(p.seqlen_k))
        probs, pairs = _probs_and_pairs(s, lv, mask)
        d_row = np.sum(dov * ov, axis=-1)
        dp = dov @ vv.swapaxes(-1, -2)
        ds = _grad_ds(probs, dp, d_row, pairs)
        pairs_t = pairs.swapaxes(-1, -2)
        split_heads(canonical(dq, layout), p.num_heads_k)[...] = p.softmax_scale * masked_matmul(ds, kv, pairs)
        canonical(dk, layout)[...] = p.softmax_scale * masked_matmul(ds.swapaxes(-1, -2), qv, pairs_t).sum(axis=-3)
        canonical(dv, layout)[...] = masked_matmul(probs.swapaxes(-1, -2), dov, pairs_t).sum(axis=-3)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# tiled backward (the CPU path)


def flash_attention_backward(
    dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
    block_m=64, block_n=128,
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

    Parameters
    ----------
    dout, q, k, v, out, lse, causal, softmax_scale, window_size, layout
        As :func:`attention_backward`.
    block_m, block_n : int
        Query rows (Br) and key rows (Bc) per tile, >= 1.

    Returns
    -------
    dq, dk, dv : numpy.ndarray of q's dtype, the shapes of q, k and v
        Accumulated in float32 (float64 for float64 input).

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_backward`; ``ValueError`` for tile sizes < 1.

    Notes
    -----
    Peak extra memory is O(batch * heads * (Sq * D + block_m * block_n)): the ``Sq x Sk``
    matrices never exist.
    """
    func = "cuflash.reference.flash_attention_backward"
    p = check_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        layout=layout, func=func,
    )
    check_numpy(p)
    block_m, block_n = _check_blocks(block_m, block_n, func)
    return _flash_backward(p, dout, q, k, v, out, lse, block_m, block_n)


def _flash_backward(p: AttentionProblem, dout, q, k, v, out, lse, block_m, block_n):
    """The tiled backward on validated NumPy input (shared with :func:`cuflash.attention_backward`)."""
    acc_t = dtypes.accumulator(p.dtype)
    dq, dk, dv = _outputs(q, k, v, p.dtype)
    if p.is_empty or not p.num_heads_k:
        return dq, dk, dv
    layout = p.layout
    qv = split_heads(canonical(q, layout), p.num_heads_k)
    kv = canonical(k, layout)
    vv = canonical(v, layout)
    dov = split_heads(canonical(dout, layout), p.num_heads_k)
    ov = split_heads(canonical(out, layout), p.num_heads_k)
    lv = _lse_view(lse, p, q.ndim == 2)
    dk_v, dv_v = canonical(dk, layout), canonical(dv, layout)
    scale = acc_t.type(p.softmax_scale)

    # pre-processing (Algorithm 2, line 4 of FlashAttention-2's backward): D_i = rowsum(dO_i * O_i)
    d_row = np.empty(qv.shape[:-1], dtype=acc_t)
    for r0 in range(0, p.seqlen_q, block_m):
        r1 = min(r0 + block_m, p.seqlen_q)
        d_row[..., r0:r1] = np.sum(dov[..., r0:r1, :].astype(acc_t) * ov[..., r0:r1, :].astype(acc_t), axis=-1)
    dq_acc = np.zeros(qv.shape, dtype=acc_t)  # the float32 dQ workspace

    for c0 in range(0, p.seqlen_k, block_n):
        c1 = min(c0 + block_n, p.seqlen_k)
        lo, hi = query_range(p, c0, c1)
        if lo >= hi:
            continue  # no query row sees these keys: dK_j = dV_j = 0 (already zero)
        k_tile = kv[..., c0:c1, :].astype(acc_t)[..., None, :, :]  # (*, Hk, 1, Bc, D)
        v_tile = vv[..., c0:c1, :].astype(acc_t)[..., None, :, :]
        dk_j = np.zeros(kv.shape[:-2] + (c1 - c0, p.head_dim), dtype=acc_t)
        dv_j = np.zeros(vv.shape[:-2] + (c1 - c0, p.head_dim_v), dtype=acc_t)
        cols = np.arange(c0, c1)
        for r0 in range(lo - lo % block_m, hi, block_m):
            r1 = min(r0 + block_m, hi)
            q_tile = qv[..., r0:r1, :].astype(acc_t)
            do_tile = dov[..., r0:r1, :].astype(acc_t)
            mask = problem_mask(p, np.arange(r0, r1), cols)
            with np.errstate(invalid="ignore"):  # non-finite input: its NaN is kept, never warned about
                s = (q_tile @ k_tile.swapaxes(-1, -2)) * scale
                probs, pairs = _probs_and_pairs(s, lv[..., r0:r1].astype(acc_t), mask)
                pairs_t = pairs.swapaxes(-1, -2)
                dv_j += masked_matmul(probs.swapaxes(-1, -2), do_tile, pairs_t).sum(axis=-3)
                dp = do_tile @ v_tile.swapaxes(-1, -2)
                ds = _grad_ds(probs, dp, d_row[..., r0:r1], pairs)
                dq_acc[..., r0:r1, :] += scale * masked_matmul(ds, k_tile, pairs)
                dk_j += scale * masked_matmul(ds.swapaxes(-1, -2), q_tile, pairs_t).sum(axis=-3)
        dk_v[..., c0:c1, :] = dk_j
        dv_v[..., c0:c1, :] = dv_j
    split_heads(canonical(dq, layout), p.num_heads_k)[...] = dq_acc
    return dq, dk, dv
