"""Serving: :func:`attention_with_kvcache` (decode and chunked prefill against a contiguous or
paged KV cache, with in-place append, rotary embedding and split-KV), :func:`explain_kvcache` and
:func:`merge_attention` (exported as ``cuflash.attention_with_kvcache``,
``cuflash.explain_kvcache`` and ``cuflash.merge_attention``).

flash-attn's ``flash_attn_with_kvcache`` names and conventions (the conventions are spelled out in
:mod:`cuflash.reference.kvcache`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cuflash.api import pipeline
from cuflash.reference import forward as ref_forward
from cuflash.reference import kvcache as ref_kvcache
from cuflash.reference.memory import check_memory
from cuflash.reference.memory import nbytes as _nbytes
from cuflash.reference.modifiers import broadcast_view
from cuflash.runtime import interop, validation
from cuflash.runtime.options import CacheOptions, Fp8Options, ModifierOptions, Options
from cuflash.runtime.validation_kvcache import check_attention_with_kvcache, rotates_per_row

__all__ = ["attention_with_kvcache", "explain_kvcache", "merge_attention"]


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), num_splits=0, return_lse=False,
                           out=None, backend="auto", softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None,
                           v_descale=None):
    """Attention of new queries over a KV cache, appending new keys and values first (in place).

    Sequence ``b`` attends to its cache rows ``[leftpad[b], cache_seqlens[b] + Snew)``: the keys
    already there and the ``Snew`` new ones, written into the cache at ``[cache_seqlens[b],
    cache_seqlens[b] + Snew)`` before attending (flash-attn's ``flash_attn_with_kvcache``). The
    kernels read the cache where it lies (paged caches page by page), pack the query heads that
    share a kv head into one tile (FA3's pack-GQA: each cache byte is read once per kv head and packed tile), and
    split the keys over several blocks when the batch alone cannot fill the device
    (flash-decoding: partial results merged by their log-sum-exp, as :func:`merge_attention`).

    Parameters
    ----------
    q : array ``(B, Sq, Hq, D)``
        float16/bfloat16 on the GPU; also float32 (and float64) on the NumPy path.
    k_cache, v_cache : arrays
        Contiguous ``(B_cache, S_cache, Hk, D)`` / ``(..., Dv)``, or paged ``(num_pages,
        page_size, Hk, D)`` with ``block_table``; any ``page_size >= 1``. q's kind, dtype and
        device; ``Hq % Hk == 0`` (GQA). Written in place when ``k``/``v`` are given.
    cache_seqlens : int or int32 array ``(B,)``
        Keys in each sequence's cache before the append (cache index of the first new key).
    k, v : arrays ``(B, Snew, Hk, D)`` / ``(B, Snew, Hk, Dv)``, optional
        New keys and values to append (both or neither).
    rotary_cos, rotary_sin : arrays ``(seqlen_ro, rotary_dim / 2)``, optional
        Rotary tables (q's dtype or float32; ``rotary_dim`` even, ``<= D``), applied to the new
        keys at positions ``cache_seqlens[b] + t`` and to q at ``cache_seqlens[b] + i`` (causal or
        a finite window) or ``cache_seqlens[b]`` (otherwise), as flash-attn does. Only with k/v.
    rotary_interleaved : bool
        True (flash-attn's default): rotate dims ``(0, 1), (2, 3), ...``; False: ``(i, i +
        rotary_dim / 2)`` (GPT-NeoX).
    cache_batch_idx : int32 array ``(B,)``, optional
        Contiguous cache only: sequence ``b`` lives in cache batch ``cache_batch_idx[b]``.
    cache_leftpad : int32 array ``(B,)``, optional
        First cache index a sequence keeps (its keys start later in the cache); rows before it
        are never read.
    block_table : int32 array ``(B, max_pages)``, optional
        Paged cache: cache index ``p`` of sequence ``b`` is row ``p % page_size`` of page
        ``block_table[b, p // page_size]``. Entries past the pages a sequence uses are never read.
    causal : bool
        Bottom-right aligned on the sequence's keys: query ``i`` sees the key ``Sq - 1 - i``
        places before the last one and all before it.
    softmax_scale : float, optional
        None means ``1/sqrt(D)``.
    window_size : (int, int)
        ``(left, right)``, as :func:`cuflash.attention`, on the same alignment.
    num_splits : int
        Key splits per (sequence, kv head, query tile): 0 chooses from the work and the device's
        SM count; 1 runs unsplit; ``n > 1`` splits into ``n`` (at most the key tiles). Ignored by
        the NumPy path (the result is the same up to rounding).
    return_lse : bool
        Also return the natural-log log-sum-exp, float32 ``(B, Hq, Sq)``.
    out : array ``(B, Sq, Hq, Dv)``, optional
    backend : {"auto", "numpy", "sim", "cuda"}
        As :func:`cuflash.attention`.
    softcap : float
        ``softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2); 0 is off.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi (Press et al. 2022): ``-slope * |i + Sk - Sq - j|``, ``Sk`` the sequence's keys
        (``cache_seqlens[b] + Snew - leftpad[b]``), i.e. minus the slope times the distance
        between the query's and the key's positions.
    sinks : float32 array ``(Hq,)``, optional
        Attention sinks (gpt-oss): a logit per head in each row's softmax denominator; the lse
        includes it. On the kernel backends the tensor-core KV-cache kernel's modifier forms take
        ``softcap``, ``alibi_slopes`` and ``sinks`` (split-KV included: split 0 holds the sink).
    k_descale, v_descale : float32 arrays ``(B, Hk)``, optional
        An fp8 cache: ``k_cache``/``v_cache`` of dtype float8_e4m3fn (``ml_dtypes.float8_e4m3fn``,
        ``torch.float8_e4m3fn``, CuPy bytes through :func:`cuflash.fp8_view`; both caches fp8, q
        and the new k/v of their own dtype), FA3's descales: sequence ``b``'s rows of kv head
        ``h`` stand for ``x * descale[b, h]`` (None: 1; a stride-0 view is one scale). Keys and
        values are dequantized as they are read. The append quantizes the new rows (rotated and
        rounded to their dtype first): ``x / descale`` in float32, rounded to nearest-even e4m3,
        saturating as the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` does (a magnitude past 448, inf
        included, becomes +-448: 480 is stored as 448; NaN stays NaN, the canonical 0x7f).
        ``ml_dtypes``' own cast turns an overflow into NaN, so the NumPy path clips first; the
        kernel's append writes the same bytes. The kernel backends read an fp8 cache with the
        tensor-core KV-cache kernel's fp8-cache form (sm_80 and newer, q float16/bfloat16; sm_75, q float16; no
        score modifiers: ``NotImplementedError``): each e4m3 value is converted exactly to q's
        dtype, ``k_descale`` scales the scores and ``v_descale`` the output, in float32 (the
        products of dequantizing each element, summed in another order). Host descales must be
        finite and > 0.

    Returns
    -------
    out : array ``(B, Sq, Hq, Dv)`` of q's kind and dtype
    lse : float32 array ``(B, Hq, Sq)`` (float64 for float64); only with ``return_lse``.

    A row that sees no key (an empty cache with no append, a window that misses every key) gets 0
    and ``lse = -inf``. Unused cache rows and unused pages are never read, so NaN there never
    reaches a result. With device-resident index arrays (or an int ``cache_seqlens``) no host
    synchronization happens on the GPU path (split-KV's workspace comes from the caller's
    allocator), so a decode step with ``out=`` can be captured in a CUDA graph; NumPy index arrays
    with GPU q are copied to the device on every call (a few bytes, but a blocking copy that a
    graph capture refuses: keep decode-loop indices on the device).

    Raises
    ------
    TypeError
        Non-arrays, mixed kinds or dtypes; index arrays that are not int32; device indices with
        NumPy q.
    ValueError
        Shapes that do not fit together; ``cache_seqlens + Snew`` outside the cache, a
        ``cache_leftpad`` past ``cache_seqlens``, a ``cache_batch_idx`` or a used ``block_table``
        entry outside the cache, rotary tables of the wrong shape or too short, rotary without
        k/v, ``cache_batch_idx`` with a paged cache, a read-only cache to append to, bad options
        or ``out=``. Nothing is written when a call is refused.
    NotImplementedError
        A head dim above 256; a call the tensor-core kernel cannot take on the GPU (float32,
        rows not 16-byte aligned).

    Notes
    -----
    Device-resident index arrays (CuPy, torch or JAX ``cache_seqlens``, ``cache_leftpad``,
    ``cache_batch_idx``, ``block_table``) are checked for dtype and shape only (reading them would
    synchronize the host). The kernels clamp every index into the cache: a sequence whose
    index is out of range gets NaN in all its rows (never a memory fault, never another
    sequence's rows), and an append that would land outside the cache or on an out-of-range page
    is not written.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> k_cache = np.zeros((4, 16, 2, 64), np.float32); v_cache = np.zeros_like(k_cache)  # 4 pages of 16
    >>> block_table = np.array([[2, 0], [1, 3]], np.int32)      # two sequences, 2 pages each
    >>> q = np.random.randn(2, 1, 8, 64).astype(np.float32)      # decode: one token, 8 query heads
    >>> k = np.random.randn(2, 1, 2, 64).astype(np.float32); v = np.random.randn(2, 1, 2, 64).astype(np.float32)
    >>> out = cuflash.attention_with_kvcache(q, k_cache, v_cache, np.array([5, 20], np.int32), k=k, v=v,
    ...                                      block_table=block_table, causal=True)
    >>> out.shape, bool((k_cache[3, 4] == k[1, 0]).all())   # token 20 of sequence 1: row 4 of page block_table[1, 1]
    ((2, 1, 8, 64), True)
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout="bshd",
                      return_lse=return_lse, backend=backend, modifiers=ModifierOptions(softcap, alibi_slopes, sinks=sinks),
                      fp8=Fp8Options(None, k_descale, v_descale),
                      cache=CacheOptions(cache_seqlens, k, v, rotary_cos, rotary_sin, rotary_interleaved,
                                         cache_batch_idx, cache_leftpad, block_table, num_splits))
    return pipeline.run(KVCACHE, (q, k_cache, v_cache, out), options)


def explain_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=False,
                    softmax_scale=None, window_size=(-1, -1), num_splits=0, backend="auto", arch=None, softcap=0.0,
                    alibi_slopes=None, sinks=None, k_descale=None, v_descale=None) -> dict:
    """What :func:`attention_with_kvcache` would run for these arguments, without running it.

    The KV-cache counterpart of :func:`cuflash.explain`: the call is validated exactly as
    :func:`attention_with_kvcache` validates it, and the answer names the kernel form (paged or
    contiguous cache), its tiles, the key splits and why each faster tier was passed over.
    Nothing is appended, copied to a device or launched: the caches are left as they are.

    Parameters
    ----------
    q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, rotary_interleaved,
    cache_batch_idx, cache_leftpad, block_table, causal, softmax_scale, window_size, num_splits,
    backend, softcap, alibi_slopes, sinks, k_descale, v_descale
        As for :func:`attention_with_kvcache` (``out`` and ``return_lse`` are not taken: they do
        not change the kernel). The arrays are read for their metadata; host index arrays
        (NumPy ``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx``, ``block_table``) are
        read and checked in full, as the real call checks them on the host; device-resident
        ones are checked for dtype and shape only. The split count never depends on the lengths
        (``num_splits=0`` plans with the cache's capacity and the shapes, as the real call does,
        so a CUDA-graph replay with new ``cache_seqlens`` keeps its plan).
    arch : int or str, optional
        Compute capability to plan for (``90``, ``"sm_80"``), as :func:`cuflash.explain` takes
        it. With ``num_splits=0`` the split count depends on the SM count: the GPU's for CUDA
        arrays and ``arch=None``, else that of the device the simulator's arch stands for
        (:data:`cuflash.sim.config.SM_COUNTS`: 132 for sm_90, 108 for sm_80).

    Returns
    -------
    dict
        :func:`cuflash.explain`'s keys (``backend``; on the kernel backends ``arch``, ``tier``,
        ``variant``, ``entry``, ``block_m``/``block_n``, ``threads``, ``smem_bytes``, ``blocks``
        of the attention kernel, ``choice``), and ``splits``: the key splits per (sequence, kv
        head, query tile); above 1 the combine kernel merges the partial results. On the NumPy
        path ``block_m``/``block_n`` are None (each sequence picks its own tiles).

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`attention_with_kvcache` raises them (the message names
        ``cuflash.explain_kvcache``), including the kernel backends' refusals of an fp8 cache
        and of calls the tensor-core KV-cache kernel cannot take. ``ValueError`` also for
        ``num_splits=0`` with an ``arch`` whose SM count is not known here (neither the GPU's
        nor one the simulator emulates).
    RuntimeError
        For CUDA arrays with ``arch=None`` on a machine without a usable GPU.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> k_cache = v_cache = np.zeros((64, 16, 2, 128), np.float16)    # 64 pages of 16 rows
    >>> block_table = np.arange(64, dtype=np.int32).reshape(2, 32)
    >>> q = np.zeros((2, 1, 16, 128), np.float16)                     # decode, 16 query heads
    >>> info = cuflash.explain_kvcache(q, k_cache, v_cache, np.array([500, 300], np.int32),
    ...                                block_table=block_table, arch=90)
    >>> info["variant"], info["splits"]
    ('f16_d128_m64_n64_kvcache', 4)
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout="bshd",
                      backend=backend, modifiers=ModifierOptions(softcap, alibi_slopes, sinks=sinks),
                      fp8=Fp8Options(None, k_descale, v_descale),
                      cache=CacheOptions(cache_seqlens, k, v, rotary_cos, rotary_sin, rotary_interleaved,
                                         cache_batch_idx, cache_leftpad, block_table, num_splits))
    return pipeline.explain_forward(KVCACHE, (q, k_cache, v_cache, None), options, arch, "cuflash.explain_kvcache",
                                    "each sequence through cuflash.reference.flash_attention on its gathered keys")


def merge_attention(outs, lses):
    """Combine attention results computed over disjoint key sets into the result over their union.

    ``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i`` (the
    flash-decoding combine; Milakov & Gimelshein 2018 for the identity), computed in float32
    (float64 for float64 input).

    The rule for empty and non-finite parts: a part with ``lse = -inf`` (it saw no key, or was
    never written) adds nothing, even when its ``out`` holds NaN or garbage; a row where every
    part has ``-inf`` gives 0 and ``-inf``. Every other part counts, so a NaN ``lse``, or a NaN
    in the ``out`` of a part whose ``lse`` is not ``-inf``, makes its row's ``out`` (and, for a
    NaN ``lse``, its ``lse``) NaN, on every backend.

    Parameters
    ----------
    outs : list or tuple of arrays ``(..., Sq, Dv)``
        At least one; one kind, dtype and shape (NumPy, CuPy, or DLPack arrays: torch, JAX, on the
        CPU through NumPy views, on the GPU through CuPy).
    lses : sequence of arrays ``(..., Sq)``
        The parts' natural-log log-sum-exp (as ``return_lse=True`` gives them in layout "bhsd"),
        float32 or float64, the kind of ``outs``.

    Returns
    -------
    out : array ``(..., Sq, Dv)`` of the parts' dtype and kind
    lse : array ``(..., Sq)``, float32 (float64 if any part is float64)

    Raises
    ------
    TypeError
        Not a list or tuple of arrays (an array itself is refused: its first axis is not a list of
        parts), mixed kinds or dtypes.
    ValueError
        No part, different numbers of ``outs`` and ``lses``, shapes that disagree, arrays on
        different devices.
    MemoryError
        On the NumPy path, when its working memory exceeds the available memory
        (``CUFLASH_MEMORY_LIMIT``, else ``MemAvailable``), before anything is allocated.

    Notes
    -----
    The parts' kind chooses where it runs, as ``backend="auto"`` does for
    :func:`cuflash.attention` (NumPy on the host, CuPy or CUDA tensors on their GPU; the
    ``CUFLASH_BACKEND`` environment variable overrides it likewise). torch tensors that require
    grad run through :func:`cuflash.torch.merge_attention` and JAX tracers through
    :func:`cuflash.jax.merge_attention`, both differentiable in every input
    (:mod:`cuflash.autodiff`).
    """
    func = "cuflash.merge_attention"
    for name, seq in (("outs", outs), ("lses", lses)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{func}: {name} must be a list or tuple of arrays (one per part), got "
                            f"{type(seq).__module__}.{type(seq).__qualname__}")
    names = tuple(f"outs[{i}]" for i in range(len(outs))) + tuple(f"lses[{i}]" for i in range(len(lses)))
    entry = dataclasses.replace(MERGE, names=names, validate=functools.partial(_validate_merge, len(outs)))
    return pipeline.run(entry, tuple(outs) + tuple(lses), Options())


# --------------------------------------------------------------------------------------------
# the KV cache's steps


def _validate_kvcache(operands, options, func):
    q, k_cache, v_cache, out = operands
    return check_attention_with_kvcache(q, k_cache, v_cache, options, func=func, out=out)


def _kvcache_numpy(problem, operands):
    """The NumPy path: rotate, append in place, then each sequence through
    :func:`cuflash.attention`'s NumPy implementation on its gathered keys."""
    q, _, _, out = operands
    p, c = problem, problem.kvcache
    batch, sq = p.batch_shape[0], p.seqlen_q
    seqlens, leftpad = c.host_seqlens(batch), c.host_leftpad(batch)
    where = dict(page_size=c.page_size, block_table=c.block_table if c.paged else None,
                 cache_batch_idx=c.cache_batch_idx)
    acc = np.float64 if p.dtype == np.float64 else np.float32
    fp8 = p.fp8
    longest = max((int(seqlens[b]) + c.seqlen_new - int(leftpad[b]) for b in range(batch)), default=0)
    # a paged cache is gathered (copied) per sequence, a contiguous one sliced; an fp8 one dequantized (copied)
    rows = longest if (c.paged or fp8 is not None) else 0
    itemsize = np.dtype(acc if fp8 is not None else p.dtype).itemsize
    check_memory(p.func, {"out": 0 if out is not None else _nbytes(p.out_shape, p.dtype),   # before the append
                          "lse": _nbytes(p.lse_shape, acc),
                          "one sequence's gathered k_cache and v_cache rows":
                              rows * p.num_heads_k * (p.head_dim + p.head_dim_v) * itemsize})
    if c.k_new is not None:
        k_new = c.k_new
        if c.rotary_cos is not None:
            k_new = ref_kvcache.apply_rotary(k_new, c.rotary_cos, c.rotary_sin,
                                             ref_kvcache.rotary_positions(seqlens, c.seqlen_new),
                                             interleaved=c.rotary_interleaved)
            q = ref_kvcache.apply_rotary(q, c.rotary_cos, c.rotary_sin,
                                         ref_kvcache.rotary_positions(seqlens, sq, per_row=rotates_per_row(p)),
                                         interleaved=c.rotary_interleaved)
        ref_kvcache.append(c.k_cache, c.v_cache, k_new, c.v_new, seqlens, **where,
                           **({} if fp8 is None else {"k_descale": fp8.k_descale, "v_descale": fp8.v_descale}))
    if out is None:
        out = np.empty(p.out_shape, dtype=p.dtype)
    lse = np.empty(p.lse_shape, dtype=acc)
    mods = p.modifiers
    slopes = None if mods is None or mods.alibi_slopes is None else broadcast_view(mods.alibi_slopes)
    sinks = None if mods is None or mods.sinks is None else np.asarray(mods.sinks.array)
    for b in range(batch):
        start, stop = int(leftpad[b]), int(seqlens[b]) + c.seqlen_new
        kb = ref_kvcache.gather(c.k_cache, b, start, stop, **where)
        vb = ref_kvcache.gather(c.v_cache, b, start, stop, **where)
        qb = q[b:b + 1]
        if fp8 is not None:   # dequantized as read; the sequence computes in the accumulation type
            kb, vb = (ref_kvcache.dequantized(x, d, b, acc) for x, d in ((kb, fp8.k_descale), (vb, fp8.v_descale)))
            qb = qb.astype(acc)
        kb, vb = kb[None], vb[None]
        options = Options(causal=p.causal, softmax_scale=p.softmax_scale, window_size=(p.window_left, p.window_right),
                          layout="bshd", modifiers=ModifierOptions(0.0 if mods is None else mods.softcap,
                                                                   None if slopes is None else slopes[b:b + 1],
                                                                   sinks=sinks))
        o, lse_b = ref_forward.run_forward(validation.check_attention(qb, kb, vb, options, func=p.func), qb, kb, vb)
        out[b], lse[b] = o[0], lse_b[0]
    return out, lse


def _kvcache_device(problem, operands, call):
    """:func:`pipeline.forward_on` (the forward's device steps), after refusing an fp8 cache that
    no KV-cache kernel form reads, before any array is imported or any row appended."""
    if problem.fp8 is not None:
        from cuflash.kernels.kvcache_run import fp8_cache_refusal

        why = fp8_cache_refusal(problem, call.arch)
        if why is not None:
            raise NotImplementedError(why)
    return pipeline.forward_on(problem, operands, call)


#: :func:`attention_with_kvcache`'s steps (the device steps are :func:`cuflash.attention`'s)
KVCACHE = pipeline.Entry("cuflash.attention_with_kvcache", ("q", "k_cache", "v_cache", "out"), _validate_kvcache,
                         _kvcache_numpy, _kvcache_device, pipeline.lse_pair, out=3)


# --------------------------------------------------------------------------------------------
# merge's steps


@dataclasses.dataclass(frozen=True)
class _MergeProblem:
    func: str
    kind: str
    dtype: object
    device: tuple
    parts: int


def _check_merge(outs, lses, func):
    outs, lses = list(outs), list(lses)
    if not outs:
        raise ValueError(f"{func}: outs must hold at least one part, got none")
    if len(outs) != len(lses):
        raise ValueError(f"{func}: {len(outs)} outs but {len(lses)} lses; one lse per part")
    infos = validation.describe_inputs({f"outs[{i}]": x for i, x in enumerate(outs)}, func)
    first = infos["outs[0]"]
    if first.ndim < 2:
        raise ValueError(f"{func}: outs[0].shape={first.shape} must be (..., Sq, Dv)")
    for i, s in enumerate(lses):
        info = interop.describe(s, f"lses[{i}]", func)
        if info.kind != first.kind or info.device != first.device:
            raise TypeError(f"{func}: lses[{i}] is a {info.type_name} on {info.device} but outs[0] is a "
                            f"{first.type_name} on {first.device}")
        if info.dtype_name not in ("float32", "float64"):
            raise TypeError(f"{func}: lses[{i}].dtype={info.dtype_name} must be float32 or float64")
        if info.shape != first.shape[:-1]:
            raise ValueError(f"{func}: lses[{i}].shape={info.shape} must be {first.shape[:-1]} (outs[0].shape[:-1])")
        if infos[f"outs[{i}]"].shape != first.shape:
            raise ValueError(f"{func}: outs[{i}].shape={infos[f'outs[{i}]'].shape} must equal outs[0].shape={first.shape}")
    return outs, lses


def _validate_merge(parts: int, operands, options, func):
    outs, lses = _check_merge(operands[:parts], operands[parts:], func)
    info = interop.describe(outs[0], "outs[0]", func)
    return _MergeProblem(func, info.kind, info.dtype, info.device, parts)


def _merge_numpy(problem, operands):
    n = problem.parts
    check_memory(problem.func, ref_kvcache.merge_memory(operands[:n], operands[n:]))   # before any allocation
    with np.errstate(invalid="ignore", over="ignore"):   # a +inf or NaN lse: NaN out, quietly
        return ref_kvcache.merge_attention(list(operands[:n]), list(operands[n:]))


def _merge_on(problem, operands, call):
    n = problem.parts
    arrays = [call.import_array(x) for x in operands]
    with np.errstate(invalid="ignore", over="ignore"):
        o, s = ref_kvcache.merge_attention(arrays[:n], arrays[n:], xp=call.xp)
    return call.export(o), call.export(s)


#: :func:`merge_attention`'s steps (the operand names and the parts' count are set per call: outs[0],
#: ..., lses[0], ...)
MERGE = pipeline.Entry("cuflash.merge_attention", (), None, _merge_numpy, _merge_on,
                       lambda results, problem: tuple(results))
