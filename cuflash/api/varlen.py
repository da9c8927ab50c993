"""Packed variable-length batches: :func:`attention_varlen`, :func:`attention_varlen_backward` and
:func:`explain_varlen` (exported as ``cuflash.attention_varlen``, ``cuflash.attention_varlen_backward``
and ``cuflash.explain_varlen``).

flash-attn's ``flash_attn_varlen_func`` convention (and FA3's ``seqused_k``): the sequences of a
batch are concatenated along one axis, q ``(total_q, Hq, D)``, k/v ``(total_k, Hk, D|Dv)``, and
``cu_seqlens_q``/``cu_seqlens_k`` (int32, ``(B + 1,)``, prefix sums starting at 0) say where
each begins. The kernels run the whole batch in one launch: the grid covers ``max_seqlen_q``
query tiles (``max_seqlen_k`` key tiles in the backward) per sequence, and each block reads its
sequence's offsets and lengths and exits at once when it lies past the sequence's end.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuflash.api import pipeline
from cuflash.reference import backward as ref_backward
from cuflash.reference import forward as ref_forward
from cuflash.reference import fp8 as ref_fp8
from cuflash.reference import kvcache as ref_kvcache
from cuflash.runtime import interop, score_mod, validation, validation_kvcache
from cuflash.runtime.options import DropoutOptions, Fp8Options, ModifierOptions, Options, PackedOptions

__all__ = ["attention_varlen", "attention_varlen_backward", "explain_varlen"]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), seqused_k=None, block_table=None, return_lse=False,
                     out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
                     alibi_slopes=None, score_mod=None, mask_mod=None, q_descale=None, k_descale=None, v_descale=None,
                     out_dtype=None, num_splits=1):
    """Exact attention over a packed batch of sequences of different lengths, fused.

    Sequence ``b`` is attention of its query rows ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` over
    its keys ``k[cu_seqlens_k[b]:cu_seqlens_k[b] + n_k]`` and values likewise, with ``n_k =
    seqused_k[b]`` if given else ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``; each as
    :func:`cuflash.attention` computes it (FlashAttention-2, Dao 2023, Algorithm 1).

    Parameters
    ----------
    q : array, shape ``(total_q, Hq, D)``
    k : array, shape ``(total_k, Hk, D)``
    v : array, shape ``(total_k, Hk, Dv)``
        One kind, dtype and device, as :func:`cuflash.attention` takes them (``Hq % Hk == 0``;
        any strides with unit last axis; ``1 <= D, Dv <= 256``), fp8 (``float8_e4m3fn``) included
        (see ``q_descale``).
    cu_seqlens_q, cu_seqlens_k : int32 arrays, shape ``(B + 1,)``
        Prefix sums of the sequences' query and key lengths: 0 first, non-decreasing, last
        ``total_q`` / ``total_k``. NumPy arrays are checked in full (with GPU q they are copied to
        the device, a few bytes); device arrays (CuPy, torch, JAX on q's device) are checked for
        dtype and shape only, since reading them would synchronize the host.
    max_seqlen_q, max_seqlen_k : int
        At least the longest query and key sequence (flash-attn's contract; the grid covers
        ``max_seqlen_q`` query rows per sequence, the backward's ``max_seqlen_k`` keys). A larger
        value is correct and costs only blocks that exit at once; windows apply per sequence
        whatever it is. NumPy indices are checked (``ValueError``). Device indices are not read by
        the host, so a longer sequence goes undetected and its results are undefined: rows past
        the covered tiles come out NaN, the others may be wrong (a window of at least
        ``min(max_seqlen_q, total_q) + min(max_seqlen_k, total_k)`` counts as unbounded; the backward's dq misses the uncovered
        keys). Never another sequence's data, never an access outside the arrays (every index is
        clamped into them).
    causal : bool
        Causal mask aligned to each sequence's bottom-right corner: row ``i`` of a sequence with
        ``Sq`` queries and ``Sk`` keys sees key ``j`` iff ``j <= i + Sk - Sq`` (flash-attn).
    softmax_scale : float, optional
        Scale of ``q k^T``; None means ``1/sqrt(D)``.
    window_size : (int, int)
        ``(left, right)`` as in :func:`cuflash.attention`, per sequence; -1 = unbounded.
    seqused_k : int32 array, shape ``(B,)``, optional
        Sequence ``b`` attends to its first ``seqused_k[b]`` keys only (FA3); ``0 <= seqused_k[b]
        <= `` its key count.
    block_table : int32 array, shape ``(B, max_pages)``, optional
        Chunked prefill over a paged KV cache (flash-attn's varlen ``block_table``): k and v are
        then the caches ``(num_pages, page_size, Hk, D|Dv)`` (any ``page_size >= 1``), and
        sequence ``b``'s keys are cache indices ``[0, n_k)`` of its pages (row ``p % page_size``
        of page ``block_table[b, p // page_size]``), ``n_k`` as above from ``cu_seqlens_k`` /
        ``seqused_k``. Host indices are checked (the pages a sequence uses inside the cache); with
        device ones an out-of-range page gives NaN in that sequence's rows. On compute
        capability 9.0 (float16/bfloat16) the Hopper kernel runs it when ``max_seqlen_q >= 64``
        (causal, windows, GQA, softcap, ALiBi), split over the keys as ``num_splits`` asks; else
        the tensor-core KV-cache kernel, which packs a GQA group's query heads into its tiles
        (unsplit); or the NumPy path. No backward.
    return_lse : bool
        Also return the log-sum-exp (natural log) of each row, float32 ``(Hq, total_q)``.
    out : array, shape ``(total_q, Hq, Dv)``, optional
        Output buffer of q's kind and dtype.
    backend : {"auto", "numpy", "sim", "cuda"}
        As in :func:`cuflash.attention`.
    dropout_p, dropout_seed, dropout_offset
        Attention dropout as in :func:`cuflash.attention`; the mask's batch index is the
        sequence's and its rows and keys count from the sequence's start.
    softcap : float
        ``softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2); 0 is off. As
        :func:`cuflash.attention`.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi (Press et al. 2022): ``-slope * |i + Sk - Sq - j|`` with each sequence's own
        lengths (bottom-right aligned per sequence). On the kernel backends the tensor-core
        tier's packed modifier forms take them (float16/bfloat16), forward and backward.
    score_mod, mask_mod : callable, optional
        As :func:`cuflash.attention` takes them (docs/api.md, "score_mod and mask_mod"), per
        sequence: ``b`` is the sequence's index, ``q_idx`` and ``kv_idx`` the positions within
        the sequence (from 0; ``q_idx < max_seqlen_q``, ``kv_idx < max_seqlen_k`` bound the
        captured arrays' index ranges), ``h`` the query head. After softcap and ALiBi, before
        the masks. On the NumPy path (the kernel tiers raise ``NotImplementedError``).
    q_descale, k_descale, v_descale : float32 arrays ``(B, Hk)``, optional
        fp8 input only, as :func:`cuflash.attention` takes them, with one row per sequence:
        sequence ``b``'s fp8 rows of kv head ``h`` stand for ``x * descale[b, h]`` (query head
        ``h`` uses its kv head's); None is 1, a stride-0 view one per-tensor scale. The NumPy
        path computes each sequence in float32 on the descaled values. On compute capability 9.0
        the Hopper forward's fp8 form runs the packed batch (head dims up to 256, causal,
        windows, GQA, ``seqused_k``; no score modifiers, no ``block_table``): V is first copied
        on the device into a key-contiguous array in which each sequence starts on a multiple of
        32 keys and has zero keys up to a whole tile after its end (at most ``Hk * Dv * (total_k +
        192 B + 32)`` bytes for ``B`` sequences). Elsewhere a kernel backend raises
        ``NotImplementedError`` naming the tier and the arch. No dropout and no backward in fp8.
    out_dtype : {None, "bfloat16", "float16"}
        The result's dtype for fp8 input (None: bfloat16); only with fp8 input.
    num_splits : int
        Split-KV with a ``block_table`` (flash-attn's ``num_splits``), an int in ``[0, 256]``:
        each sequence's keys are split into up to this many runs, computed by separate blocks and
        merged by their log-sum-exp, which fills the GPU when the query tiles alone are few (short
        chunks over long caches). 1 (the default, as flash-attn's varlen call) runs unsplit; 0
        chooses from the shapes and the SM count (enough splits for a block per SM, at least two
        key tiles of the cache's capacity, ``max_pages * page_size``, per split), never from
        the lengths, so a CUDA-graph replay with new ``cu_seqlens``/``seqused_k`` keeps its
        plan. A performance hint: only the Hopper chunked-prefill form splits (never more splits
        than the capacity has key tiles; head dim 256 runs unsplit); the tensor-core kernel, the
        NumPy path and packed batches without a ``block_table`` run unsplit (``explain_varlen``
        reports ``splits``).
        Several splits need float32 workspace of ``splits * Hq * total_q * (Dv + 1)`` values.

    Returns
    -------
    out : array ``(total_q, Hq, Dv)`` of q's kind and dtype (``out_dtype`` for fp8 input)
    lse : array ``(Hq, total_q)``, float32 (float64 for float64 input); only with ``return_lse``.

    A sequence of length 0 does no work and writes nothing; a query row that sees no key
    (``seqused_k[b] = 0``, causal with more queries than keys) gets 0 and ``lse = -inf``.

    Raises
    ------
    TypeError
        As :func:`cuflash.attention`; an index array that is not int32, or a device index with
        NumPy q; ``num_splits`` not an int (a bool is refused).
    ValueError
        q/k/v not 3-D or mismatched; an index that is not 1-D of length ``B + 1`` (``B`` for
        ``seqused_k``), does not start at 0, decreases, or does not end at ``total_q`` /
        ``total_k``; a ``max_seqlen`` below a sequence's length (NumPy indices); ``seqused_k`` outside
        ``[0, keys]``; an index on another device; bad options or ``out=``; descales of the
        wrong shape or strides, non-positive or non-finite (host) descales, descales or
        ``out_dtype`` without fp8 input (``TypeError`` for descales that are not float32);
        ``num_splits`` outside ``[0, 256]``.
    TypeError (gradients)
        An option without a gradient given with torch tensors that require grad (named by
        :func:`cuflash.torch.attention_varlen`). torch tensors that require grad run through
        :func:`cuflash.torch.attention_varlen` and JAX tracers through
        :func:`cuflash.jax.attention_varlen` (:mod:`cuflash.autodiff`), so gradients reach q, k, v.
    NotImplementedError
        A head dim above 256, or a valid call without a kernel on the chosen backend (fp8 input
        off compute capability 9.0, or with what the Hopper fp8 form does not take: the message
        names each tier and the arch); fp8 with dropout or a ``block_table``.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> cu = np.array([0, 3, 3, 10], dtype=np.int32)       # three sequences: 3, 0 and 7 tokens
    >>> q, k, v = (np.random.randn(10, 4, 32).astype(np.float32) for _ in range(3))
    >>> cuflash.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True).shape
    (10, 4, 32)
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, return_lse=return_lse,
                      backend=backend, dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, score_mod=score_mod, mask_mod=mask_mod),
                      packed=PackedOptions(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                           block_table, num_splits),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    return pipeline.run(FORWARD, (q, k, v, out), options)


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   softmax_scale=None, window_size=(-1, -1), seqused_k=None, block_table=None, backend="auto",
                   arch=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
                   alibi_slopes=None, score_mod=None, mask_mod=None, q_descale=None, k_descale=None,
                   v_descale=None, out_dtype=None, num_splits=1) -> dict:
    """What :func:`attention_varlen` would run for these arguments, without running it.

    The packed-batch counterpart of :func:`cuflash.explain`: the call is validated exactly as
    :func:`attention_varlen` validates it, and the dispatcher says which kernel form, variant and
    tiles serve it on ``sm_<arch>`` and why each faster tier was passed over. Nothing is copied
    to a device, launched or written.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    window_size, seqused_k, block_table, backend, dropout_p, dropout_seed, dropout_offset,
    softcap, alibi_slopes, score_mod, mask_mod, q_descale, k_descale, v_descale, out_dtype,
    num_splits
        As for :func:`attention_varlen` (``out`` and ``return_lse`` are not taken: they do not
        change the kernel). The arrays are read for their metadata (kind, dtype, shape, strides,
        device); index arrays on the host (NumPy ``cu_seqlens_q``, ``cu_seqlens_k``,
        ``seqused_k``, ``block_table``) are read and checked in full, as the real call checks
        them on the host; device-resident ones for dtype and shape only, as the real call does,
        and no plan depends on their values (the grid covers ``max_seqlen_q`` rows per sequence).
    arch : int or str, optional
        Compute capability to plan for (``90``, ``"sm_80"``), as :func:`cuflash.explain` takes it.

    Returns
    -------
    dict
        :func:`cuflash.explain`'s keys: ``backend``; on the kernel backends ``arch``, ``tier``,
        ``variant`` (its name contains ``_varlen`` for the packed forms, ``_varlen_kvcache`` for
        chunked prefill over a paged cache, with the suffix ``_tma`` where pages of whole key
        tiles load by TMA), ``entry``, ``block_m``/``block_n``, ``threads``, ``smem_bytes``,
        ``blocks`` (``ceil(max_seqlen_q / block_m)`` query tiles per head and sequence, x
        ``splits`` with a ``block_table``; blocks past a sequence's end exit at once), ``choice`` and ``backward`` (the
        backward's tier and variant, and why; not with a ``block_table``). With a
        ``block_table`` also ``splits`` (key splits; above 1 the Hopper form's partials are merged
        by the combine kernel). With ``num_splits=0`` on the Hopper form the count depends on the
        SM count: the GPU's, or the simulator's for the arch it emulates. On the NumPy path
        ``block_m``/``block_n`` are None (each sequence picks its own tiles).

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`attention_varlen` raises them (the message names ``cuflash.explain_varlen``).
    RuntimeError
        For CUDA arrays with ``arch=None`` on a machine without a usable GPU.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> cu = np.array([0, 3, 3, 10], dtype=np.int32)
    >>> q = k = v = np.zeros((10, 4, 64), np.float16)
    >>> cuflash.explain_varlen(q, k, v, cu, cu, 7, 7, causal=True, arch=90)["variant"]
    'f16_d64_local_varlen'
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, backend=backend,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, score_mod=score_mod, mask_mod=mask_mod),
                      packed=PackedOptions(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                           block_table, num_splits),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    return pipeline.explain_forward(FORWARD, (q, k, v, None), options, arch, "cuflash.explain_varlen",
                                    "each sequence through cuflash.reference.flash_attention")


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), seqused_k=None,
                              deterministic=False, backend="auto", dropout_p=0.0, dropout_seed=None,
                              dropout_offset=0, softcap=0.0, alibi_slopes=None, score_mod=None, mask_mod=None,
                              return_dscore_mod=False):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen` from its output and log-sum-exp.

    Each sequence's gradients are those of :func:`cuflash.attention_backward` (FlashAttention-2,
    Dao 2023, Algorithm 2); keys past ``seqused_k[b]`` get ``dk = dv = 0``.

    Parameters
    ----------
    dout : array ``(total_q, Hq, Dv)``, out's dtype
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    window_size, seqused_k
        Exactly as the forward took them.
    out : array ``(total_q, Hq, Dv)``
    lse : array ``(Hq, total_q)``, float32 or float64
        The forward's output and log-sum-exp (``return_lse=True``).
    deterministic : bool
        Bit-identical results run to run on the kernel backends (see
        :func:`cuflash.attention_backward`).
    dropout_p, dropout_seed, dropout_offset
        The forward's dropout.
    softcap, alibi_slopes, score_mod, mask_mod
        The forward's score modifiers (see :func:`attention_varlen`).
    return_dscore_mod : bool
        Also return the gradients of the score_mod's captured float arrays, a dict by variable
        name, as :func:`cuflash.attention_backward` (each sequence's, added in sequence order;
        the NumPy path).
    backend : {"auto", "numpy", "sim", "cuda"}
        As :func:`cuflash.attention_backward`; on compute capability 9.0 the kernel backends run
        float16/bfloat16 packed batches with D = Dv = 64, 96 or 128 on the Hopper backward
        (Q, dO, K and V through ragged tensor maps), the rest on the tensor-core or portable one.

    Returns
    -------
    dq, dk, dv : arrays of q's, k's and v's shapes and q's dtype and kind
    dscore_mod : dict of str to array; only with ``return_dscore_mod``

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`attention_varlen`, and for ``dout``, ``out`` or ``lse`` of the wrong shape or
        dtype.
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, backend=backend,
                      deterministic=deterministic, dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      return_dscore_mod=return_dscore_mod,
                      modifiers=ModifierOptions(softcap, alibi_slopes, score_mod=score_mod, mask_mod=mask_mod),
                      packed=PackedOptions(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k))
    return pipeline.run(BACKWARD, (dout, q, k, v, out, lse), options)


# --------------------------------------------------------------------------------------------
# validation


def _validate_forward(operands, options, func):
    q, k, v, out = operands
    return validation.check_attention_varlen(q, k, v, options, func=func, out=out,
                                             cache_check=validation_kvcache.varlen_cache, fp8=True)


def _validate_backward(operands, options, func):
    dout, q, k, v, out, lse = operands
    options = validation.check_flags(options, func, "deterministic", "return_dscore_mod")
    if options.return_dscore_mod and options.modifiers.score_mod is None:
        raise ValueError(f"{func}: return_dscore_mod=True needs score_mod (the gradient is of its captured arrays); "
                         f"got score_mod=None")
    problem = validation.check_attention_varlen(q, k, v, options, func=func)
    _check_backward_arrays(problem, dout, out, lse)
    return problem


def _check_backward_arrays(problem, dout, out, lse) -> None:
    func = problem.func
    infos = validation.describe_inputs({"out": out, "dout": dout}, func)
    for name, info in infos.items():
        validation.check_like_output(info, name, problem, "(total_q, Hq, Dv)")
    li = interop.describe(lse, "lse", func)
    if li.dtype_name not in ("float32", "float64"):
        raise TypeError(f"{func}: lse.dtype={li.dtype_name} must be float32 (or float64 on the NumPy path)")
    if li.shape != problem.lse_shape:
        raise ValueError(f"{func}: lse.shape={li.shape} must be {problem.lse_shape} (Hq, total_q)")
    if li.kind != problem.kind or li.device != problem.device:
        raise ValueError(f"{func}: lse must be a {problem.q.type_name} on q's device {problem.device}")


# --------------------------------------------------------------------------------------------
# the NumPy path: each sequence as a fixed-shape call


def _sequences(problem):
    """``(query rows, key rows used)`` slices of each sequence (host indices)."""
    vl = problem.varlen
    cq = np.asarray(vl.cu_seqlens_q, dtype=np.int64)
    ck = np.asarray(vl.cu_seqlens_k, dtype=np.int64)
    used = vl.used_keys()
    for b in range(vl.batch):
        yield slice(cq[b], cq[b + 1]), slice(ck[b], ck[b] + used[b])


def _sequence_problem(p, q, k, v, b: int):
    """The fixed-shape problem of sequence ``b`` (``(1, S, H, D)`` views), its dropout counting
    batches from ``b``, its ALiBi slopes row ``b`` of the batch's, its score_mod/mask_mod with
    ``b`` bound to the sequence's index (their ``q_idx``/``kv_idx`` are positions within it)."""
    mods = p.modifiers
    slopes = None
    if mods is not None and mods.alibi_slopes is not None:
        from cuflash.reference.modifiers import broadcast_view

        slopes = broadcast_view(mods.alibi_slopes)[b:b + 1]
    traced = [None if mods is None or t is None else score_mod.bind(t, "b", b)
              for t in ((None, None) if mods is None else (mods.score_mod, mods.mask_mod))]
    f = p.fp8
    fp8 = Fp8Options() if f is None else Fp8Options(
        *(None if d is None else np.asarray(d)[b:b + 1] for d in (f.q_descale, f.k_descale, f.v_descale)), f.out_dtype)
    options = Options(causal=p.causal, softmax_scale=p.softmax_scale, window_size=(p.window_left, p.window_right),
                      layout="bshd", return_dscore_mod=p.options.return_dscore_mod,
                      modifiers=ModifierOptions(0.0 if mods is None else mods.softcap, slopes, None, None, None,
                                                *traced), fp8=fp8)
    sp = validation.check_attention(q, k, v, options, func=p.func, fp8=f is not None)
    return sp if p.dropout is None else dataclasses.replace(sp, dropout=dataclasses.replace(p.dropout, batch0=b))


def _forward_numpy(problem, operands):
    """The NumPy path: each sequence through :func:`cuflash.attention`'s NumPy implementation."""
    q, k, v, out = operands
    p = problem
    acc = np.float64 if p.dtype == np.float64 else np.float32
    if out is None:
        out = np.empty(p.out_shape, dtype=p.out_dtype)
    lse = np.empty(p.lse_shape, dtype=acc)
    c = p.kvcache
    for b, (rq, rk) in enumerate(_sequences(p)):
        if rq.stop == rq.start:
            continue
        if c is not None:   # keys [0, n) of the sequence's pages
            where = dict(page_size=c.page_size, block_table=c.block_table)
            kb = ref_kvcache.gather(k, b, 0, rk.stop - rk.start, **where)
            vb = ref_kvcache.gather(v, b, 0, rk.stop - rk.start, **where)
        else:
            kb, vb = k[rk], v[rk]
        qs, ks, vs = q[None, rq], kb[None], vb[None]
        sp = _sequence_problem(p, qs, ks, vs, b)
        run = ref_forward.run_forward if p.fp8 is None else ref_fp8.run_forward_fp8   # (fp8: float32, descaled)
        o, lse_b = run(sp, qs, ks, vs)
        out[rq] = o[0]
        lse[:, rq] = lse_b[0]
    return out, lse


def _backward_numpy(problem, operands):
    """The NumPy path: each sequence through :func:`cuflash.attention_backward`'s NumPy one."""
    dout, q, k, v, out, lse = operands
    p = problem
    dq, dk, dv = np.zeros(q.shape, p.dtype), np.zeros(k.shape, p.dtype), np.zeros(v.shape, p.dtype)
    darrays = None
    if p.options.return_dscore_mod:   # the sequences' gradients added in sequence order
        t = p.modifiers.score_mod
        darrays = {t.names[i]: np.zeros(t.arrays[i].shape, np.float64) for i in score_mod.float_slots(t)}
    for b, (rq, rk) in enumerate(_sequences(p)):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue   # no query: nothing flows; no key used: dq = 0 and dk = dv = 0
        qs, ks, vs = q[None, rq], k[None, rk], v[None, rk]
        g = ref_backward.run_backward(_sequence_problem(p, qs, ks, vs, b), dout[None, rq], qs, ks, vs,
                                      out[None, rq], np.ascontiguousarray(lse[None, :, rq]))
        dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
        for name, grad in (g[3] if darrays is not None else {}).items():
            darrays[name] += grad
    if darrays is None:
        return dq, dk, dv
    t = p.modifiers.score_mod
    dtypes_ = dict(zip(t.names, t.array_dtypes))
    return dq, dk, dv, {n: a.astype(dtypes_[n]) for n, a in darrays.items()}


#: :func:`attention_varlen`'s steps (the device steps are :func:`cuflash.attention`'s)
FORWARD = pipeline.Entry("cuflash.attention_varlen", ("q", "k", "v", "out"), _validate_forward, _forward_numpy,
                         pipeline.forward_on, pipeline.lse_pair, out=3)
#: :func:`attention_varlen_backward`'s steps (the device steps are :func:`cuflash.attention_backward`'s)
BACKWARD = pipeline.Entry("cuflash.attention_varlen_backward", ("dout", "q", "k", "v", "out", "lse"),
                          _validate_backward, _backward_numpy, pipeline.backward_on,
                          lambda grads, problem: tuple(grads), like=1)
