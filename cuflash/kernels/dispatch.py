"""The dispatcher: which forward kernel serves a validated attention call on a given arch.

Tiers, fastest first; the first that applies wins, so a problem the fast kernels cannot take
falls back visibly (:func:`describe_choice` names the tier, the variant, its tiles and, for a
fallback, why; the ``cuflash.dispatch`` logger logs the same line at DEBUG level):

1. Hopper wgmma (:mod:`cuflash.kernels.attention_fwd_sm90`, ``sm_90a``): float16/bfloat16 on
   compute capability 9.0, head dims up to 256 (multiples of 8), views a TMA tensor map can
   describe (16-byte-aligned strides and base), no dropout, varlen or KV cache;
2. tensor cores (:mod:`cuflash.kernels.attention_fwd_mma`): float16/bfloat16 on sm_80+, rows 16-byte
   aligned (head dims, strides and view offsets multiples of 8 elements);
3. portable SIMT (:mod:`cuflash.kernels.attention_fwd_simt`): every dtype, sm_75+.

A tier module may declare ``TARGET_ARCH`` (``"90a"``: its kernels are compiled for ``sm_90a``,
as the Hopper tier's are) and ``MIN_NVRTC_MAJOR`` (13: CUDA-13-only). Before asking the
module, the dispatcher applies the rule of :func:`target_reason`: an ``sm_90a`` tier runs only on
compute capability 9.0 (Blackwell, 10.x and 12.x, gets the next tier, and ``explain`` says why),
and a CUDA-13-only tier only where NVRTC 13.x is installed (under the ``cuda12`` extra the next
tier runs, visibly).

The simulator (``backend="sim"``) asks with its emulated arch (``cuflash.sim.options(arch=...)``,
sm_90 by default), so it runs the variant an sm_90 device would get.
"""

from __future__ import annotations

import logging

from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
    attention_fwd_sm90,
)
from cuflash.runtime import cubin, cuda_runner, nvrtc

log = logging.getLogger("cuflash.dispatch")

#: tiers in order of preference: (name, module); each module has ``unsupported_reason`` or
#: takes everything
TIERS = (("Hopper wgmma", attention_fwd_sm90), ("tensor-core mma.sync", attention_fwd_mma),
         ("portable SIMT", attention_fwd_simt))
#: the backward's tiers, likewise (:func:`backward_tier`)
BACKWARD_TIERS = (("tensor-core mma.sync", attention_bwd_mma), ("portable SIMT", attention_bwd_simt))


def target_reason(mod, arch: int, nvrtc_majors=None) -> str | None:
    """Why the tier module ``mod`` cannot run on compute capability ``arch`` whatever the call,
    from its ``TARGET_ARCH`` and ``MIN_NVRTC_MAJOR`` (None if it can, or if it declares neither).

    ``nvrtc_majors`` are the installed NVRTC majors; None asks
    :func:`cuflash.runtime.cuda_runner.nvrtc_majors`. With no NVRTC installed at all (a
    simulator-only install) the compiler condition is not applied.
    """
    target = getattr(mod, "TARGET_ARCH", None)
    if target is not None:
        why = cubin.arch_reason(target, arch)
        if why is not None:
            return why
    need = getattr(mod, "MIN_NVRTC_MAJOR", 12)
    if need > 12:
        if nvrtc_majors is None:
            nvrtc_majors = cuda_runner.nvrtc_majors()
        if nvrtc_majors and max(nvrtc_majors) < need:
            wheel = nvrtc.WHEELS.get(need, f"NVRTC {need}.x")
            return (f"its kernels are CUDA-{need}-only (NVRTC 12.x cannot compile them) and the newest NVRTC "
                    f"here is {max(nvrtc_majors)}.x: install {wheel!r} beside it")
    return None


def _choose(problem, arch: int, arrays=None, tiers=None, nvrtc_majors=None):
    """``(module, reasons)``: the tier that runs ``problem`` and why each faster one does not
    (``tiers`` default: :data:`TIERS`, looked up at call time)."""
    tiers = TIERS if tiers is None else tiers
    reasons = []
    for name, mod in tiers:
        why = target_reason(mod, arch, nvrtc_majors)
        if why is None:
            check = getattr(mod, "unsupported_reason", None)
            why = check(problem, arch, arrays) if check is not None else None
        if why is None:
            return mod, reasons
        reasons.append(f"{name} tier not used: {why}")
    raise NotImplementedError(f"{problem.func}: no kernel takes this call on sm_{arch}: " + "; ".join(reasons))


def forward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs ``problem`` on ``sm_<arch>``.

    A tier module provides ``forward(problem, q, k, v, out, return_lse, *, xp, arch, launch)``
    and ``choose_variant(...)``. ``arrays`` ((q, k, v) or (q, k, v, out)) lets a tier check the
    alignment of views; without it only shapes and dtypes decide.
    """
    return _choose(problem, arch, arrays)[0]


def backward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs the backward of ``problem`` on ``sm_<arch>``: the tensor-core
    backward (float16/bfloat16, sm_80+, a tile of the head dims' bucket fitting the shared memory,
    rows 16-byte aligned) or the portable
    SIMT one. A tier module provides ``backward(problem, dout, q, k, v, out, lse, *, xp, arch,
    launch, deterministic)``; ``arrays`` is ``(q, k, v, out, dout)`` (alignment of views)."""
    mod, reasons = _choose(problem, arch, arrays, BACKWARD_TIERS)
    if log.isEnabledFor(logging.DEBUG):
        name = dict((m, n) for n, m in BACKWARD_TIERS)[mod]
        log.debug("sm_%d: backward on the %s tier%s", arch, name, "; " + "; ".join(reasons) if reasons else "")
    return mod


def variant_for(mod, problem, arch: int):
    """The variant the tier module ``mod`` runs ``problem`` with on ``sm_<arch>`` (a tier whose
    variants depend on more than the dtype and head dims says so with ``variant_for``)."""
    if hasattr(mod, "variant_for"):
        return mod.variant_for(problem, arch)
    return mod.choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)


def describe_choice(problem, arch: int, arrays=None) -> str:
    """One line naming the tier, the variant and its tiles that run ``problem`` on ``sm_<arch>``,
    and why any faster tier was passed over, e.g.::

        sm_90: tensor-core mma.sync tier, cuflash_attn_fwd_mma_bf16_d128_m128_n64: 4 warps of 32 query rows, ...
        sm_90: portable SIMT tier, cuflash_attn_fwd_simt_f16_d128_m32_n32 (Br=32, Bc=32, ...);
            tensor-core mma.sync tier not used: D=59 is not a multiple of 8 (...)
    """
    mod, reasons = _choose(problem, arch, arrays)
    v = variant_for(mod, problem, arch)
    name = dict((m, n) for n, m in TIERS)[mod]
    what = v.describe() if hasattr(v, "describe") else (
        f"{v.entry} (Br={v.block_m}, Bc={v.block_n}, {v.block[0]} threads, {v.smem_bytes} B shared memory)")
    line = f"sm_{arch}: {name} tier, {what}"
    if reasons:
        line += "; " + "; ".join(reasons)
    return line


def run_forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Run the forward on the tier :func:`forward_tier` picks."""
    arrays = (q, k, v, out)
    tier = forward_tier(problem, arch, arrays)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", describe_choice(problem, arch, arrays))
    return tier.forward(problem, q, k, v, out, return_lse, xp=xp, arch=arch, launch=launch)


def run_kvcache(problem, q, out, return_lse: bool, *, xp, arch: int, launch, num_sms: int):
    """Run a KV-cache call (``problem.kvcache``): the append (new keys and values into the cache,
    rotated; the rotated queries into a workspace), the tensor-core KV-cache forward, and, with
    more than one key split, the combine (:mod:`~cuflash.kernels.kvcache_append`,
    :mod:`~cuflash.kernels.attention_fwd_mma`, :mod:`~cuflash.kernels.attention_combine`), in that
    order on one stream. Workspaces (rotated q, split partials) come from ``xp`` (the caller's
    allocator on the GPU); nothing synchronizes the host.

    Only the tensor-core tier has the KV-cache form: a call it cannot take raises
    ``NotImplementedError`` saying why (never a silent fallback).
    """
    import numpy as np

    from cuflash.kernels import attention_combine, kvcache_append
    from cuflash.runtime import validation_kvcache

    p, c = problem, problem.kvcache
    why = attention_fwd_mma.unsupported_reason(p, arch, (q, c.k_cache, c.v_cache, out))
    if why is not None:
        raise NotImplementedError(f"{p.func}: the KV-cache kernel runs on the tensor-core tier only, which cannot "
                                  f"take this call: {why}")
    host = xp is np
    none = attention_fwd_simt._NO_INDEX if host else attention_fwd_simt._no_index_on(q.device.id)
    index = {n: getattr(c, n) for n in ("cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table")}
    if out is None:
        out = attention_fwd_simt._aligned_empty(xp, p.out_shape, p.dtype)
        if host:
            out.fill(np.nan)
    lse = xp.empty(p.lse_shape, dtype=np.float32)
    if host:
        lse.fill(np.nan)
    q_rot = None
    if c.rotary_cos is not None:
        q_rot = attention_fwd_simt._aligned_empty(xp, q.shape, p.dtype)
    plans = [kvcache_append.plan_append(p, q, q_rot, dict(index, no_float=xp.empty((0, 0), np.float32),
                                                           q_per_row=validation_kvcache.rotates_per_row(p)),
                                        none=none)]
    if not p.is_empty:
        variant = attention_fwd_mma.choose_variant(p.dtype, p.head_dim, p.head_dim_v, arch, varlen=p.varlen is not None,
                                                   kvcache=True, mods=p.modifiers is not None)
        splits = attention_fwd_mma.kvcache_splits(p, variant, arch, num_sms)
        rows = p.batch_shape[0] * p.num_heads_q * p.seqlen_q if splits > 1 else 0
        o_part = xp.empty((splits, rows, p.head_dim_v), dtype=np.float32)
        lse_part = xp.empty((splits, rows), dtype=np.float32)
        if host:
            o_part.fill(np.nan), lse_part.fill(np.nan)
        plans.append(attention_fwd_mma.plan_kvcache(p, q if q_rot is None else q_rot, out, lse, variant, splits=splits,
                                                    o_partial=o_part, lse_partial=lse_part, index=index, none=none))
        if splits > 1:
            plans.append(attention_combine.plan_combine(o_part, lse_part, out, lse, num_heads_q=p.num_heads_q,
                                                        seqlen_q=p.seqlen_q))
    for launch_plan in plans:   # planned in full first: a plan that cannot be made launches nothing
        if launch_plan is not None:
            launch(launch_plan)
    return (out, lse) if return_lse else out
