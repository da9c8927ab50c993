"""Running a KV-cache call: the append, the KV-cache forward and, with several key splits, the
combine, in that order on the call's stream.

The append (:mod:`~cuflash.kernels.kvcache_append`) writes the new keys and values into the
cache (rotated) and the rotated queries into a workspace; the KV-cache forward reads the cache
where it lies: on compute capability 9.0 the Hopper form (:mod:`~cuflash.kernels.attention_fwd_sm90`,
its ``kvcache`` form) when the query rows (``Sq``, or ``Sq * G`` with GQA packing) fill half its
128-row tiles, else the tensor-core one
(:mod:`~cuflash.kernels.attention_fwd_mma`, its ``kvcache`` form);
the combine (:mod:`~cuflash.kernels.attention_combine`) merges the split partials by their
log-sum-exp. Workspaces (rotated q, split partials) come from the call (the caller's allocator on
a GPU); nothing synchronizes the host, and every plan is made before the first launch, so a plan
that cannot be made launches nothing.

Imports: the kernel families above and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import numpy as np

from cuflash.kernels import attention_combine, attention_fwd_mma, attention_fwd_sm90, kvcache_append
from cuflash.runtime import validation_kvcache

__all__ = ["choose", "hopper_reason", "run_kvcache", "run_append", "fp8_cache_refusal"]


def fp8_cache_refusal(problem, arch: int) -> str | None:
    """Why the KV-cache call ``problem`` on an fp8 cache runs on no kernel of ``sm_<arch>`` (for
    its ``NotImplementedError``), or None when it can (or the cache is not fp8): the tensor-core
    KV-cache kernel's fp8-cache form (:data:`attention_fwd_mma.FP8_KVCACHE_FORM`) takes fixed
    query batches without score modifiers."""
    p = problem
    if p.fp8 is None:
        return None
    why = None
    if not getattr(attention_fwd_mma, "FP8_KVCACHE_FORM", False):
        why = "the tensor-core KV-cache kernel (mma.sync) reads float16/bfloat16 caches only"
    elif p.modifiers is not None:
        why = (f"the tensor-core KV-cache kernel's fp8-cache form takes no score modifiers "
               f"({p.modifiers.present[0]} given)")
    elif p.varlen is not None:
        why = "the tensor-core KV-cache kernel's fp8-cache form takes fixed query batches, not packed ones"
    if why is None:
        return None
    return (f"{p.func}: an fp8 (float8_e4m3fn) KV cache has no kernel for this call on sm_{arch}: {why}; the NumPy "
            f"path (NumPy arrays, backend='numpy') takes it. Nothing was appended")


def hopper_reason(problem, arch: int, arrays=None) -> str:
    """Why the KV-cache call ``problem`` does not run on the Hopper KV-cache form on ``sm_<arch>``
    (None if it does)."""
    if arch != 90:
        return f"sm_{arch} is not compute capability 9.0 (the Hopper kernel is compiled for sm_90a)"
    return attention_fwd_sm90.kvcache_reason(problem, arch, arrays)


def choose(problem, arch: int, arrays=None, sm_count=None) -> tuple:
    """``(variant, splits)``: the KV-cache variant that runs the KV-cache call ``problem`` on
    ``sm_<arch>`` and its key splits. On compute capability 9.0 the Hopper form
    (:func:`attention_fwd_sm90.kvcache_variant`, :func:`attention_fwd_sm90.kvcache_splits`) when
    :func:`hopper_reason` finds nothing against it; else the tensor-core form
    (:func:`attention_fwd_mma.kvcache_splits`). ``sm_count``, the device's SM count, is read only
    by the split heuristics (``num_splits=0``; the tensor-core form does not split a packed batch);
    neither reads the sequence
    lengths, so a CUDA-graph replay with new ``cache_seqlens`` keeps its plan.
    :func:`run_kvcache` launches with them; ``explain_kvcache`` reports them.

    ``arrays`` is ``(q, k_cache, v_cache, out)`` (alignment of views; None: shapes only). A call
    neither KV-cache form can take is refused, never sent to a slower tier.

    Raises
    ------
    NotImplementedError
        An fp8 cache the fp8-cache form cannot take (:func:`fp8_cache_refusal`), or a call the
        tensor-core tier cannot take (saying why).
    """
    p = problem
    why = fp8_cache_refusal(p, arch)
    if why is not None:
        raise NotImplementedError(why)
    if hopper_reason(p, arch, arrays) is None:
        variant = attention_fwd_sm90.kvcache_variant(p)
        return variant, attention_fwd_sm90.kvcache_splits(p, variant, sm_count)
    why = attention_fwd_mma.unsupported_reason(p, arch, arrays)
    if why is not None:
        raise NotImplementedError(f"{p.func}: the KV-cache kernel runs on the tensor-core tier only, which cannot "
                                  f"take this call: {why}")
    variant = attention_fwd_mma.choose_variant(p.dtype, p.head_dim, p.head_dim_v, arch, varlen=p.varlen is not None,
                                               kvcache=True, mods=p.modifiers is not None, cache_fp8=p.fp8 is not None)
    return variant, attention_fwd_mma.kvcache_splits(p, variant, arch, sm_count)


def run_kvcache(problem, q, out, call):
    """``(out, lse)`` of the KV-cache call ``problem`` (its ``kvcache`` arrays and ``q`` device
    arrays of ``call``; ``out`` None allocates).

    The form is :func:`choose`'s; a call no KV-cache form can take raises ``NotImplementedError``
    saying why (never a silent fallback).
    """
    p, c = problem, problem.kvcache
    variant, splits = choose(p, call.arch, (q, c.k_cache, c.v_cache, out), call.sm_count)
    if out is None:
        out = call.empty(p.out_shape, p.dtype)
    lse = call.empty(p.lse_shape, np.float32)
    q_rot = None if c.rotary_cos is None else call.empty(q.shape, p.dtype)
    plans = [kvcache_append.plan_append(p, q, q_rot, validation_kvcache.rotates_per_row(p), call)]
    if not p.is_empty:
        # (chunked prefill: the partials' rows are (head, total_q row), one sequence of total_q rows
        # to the combine, out (total_q, Hq, Dv) and lse (Hq, total_q) seen with a batch axis of 1)
        batch, sq = (1, p.varlen.total_q) if p.varlen is not None else (p.batch_shape[0], p.seqlen_q)
        rows = batch * p.num_heads_q * sq if splits > 1 else 0
        o_part = call.empty((splits, rows, p.head_dim_v), np.float32)
        lse_part = call.empty((splits, rows), np.float32)
        tier = attention_fwd_sm90 if isinstance(variant, attention_fwd_sm90.Sm90ForwardVariant) else attention_fwd_mma
        plans.append(tier.plan_kvcache(p, q if q_rot is None else q_rot, out, lse, variant, (o_part, lse_part), call))
        if splits > 1:
            as_batch = (lambda a: a.reshape((1,) + a.shape)) if p.varlen is not None else (lambda a: a)
            plans.append(attention_combine.plan_combine(o_part, lse_part, as_batch(out), as_batch(lse),
                                                        num_heads_q=p.num_heads_q, seqlen_q=sq))
    for launch_plan in plans:
        if launch_plan is not None:
            call.launch(launch_plan)
    return out, lse


def run_append(problem, q, call):
    """Only the append of the KV-cache call ``problem`` (device arrays of ``call``): the new rows
    written into the caches (rotated; quantized into an fp8 cache), and the rotated queries into
    a fresh workspace, which is returned (None without rotary tables). :func:`run_kvcache` runs
    the same launch first; this one serves the tests that compare a kernel's cache with the NumPy
    path's byte for byte."""
    c = problem.kvcache
    q_rot = None if c.rotary_cos is None else call.empty(q.shape, problem.dtype)
    launch_plan = kvcache_append.plan_append(problem, q, q_rot, validation_kvcache.rotates_per_row(problem), call)
    if launch_plan is not None:
        call.launch(launch_plan)
    return q_rot
