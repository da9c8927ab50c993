"""The dispatcher: which forward kernel serves a validated attention call on a given arch.

Tiers, fastest first; the first that applies wins, so a problem the fast kernels cannot take
falls back visibly (:func:`describe_choice` names the tier, the variant, its tiles and, for a
fallback, why; the ``cuflash.dispatch`` logger logs the same line at DEBUG level):

1. Hopper wgmma (:mod:`cuflash.kernels.attention_fwd_sm90`, ``sm_90a``): float16/bfloat16 on
   compute capability 9.0, head dims up to 256 (multiples of 8), views a TMA tensor map can
   describe (16-byte-aligned strides and base), no dropout or KV cache; packed batches without
   score modifiers; traced score_mod/mask_mod on fixed shapes, and block masks whose Q_BLOCK is a
   multiple of its 128-row tile (:func:`cuflash.kernels.attention_fwd_sm90.block_mask_reason`);
   fp8 (float8_e4m3fn) q, k, v with a float16/bfloat16 result on fixed shapes (its ``_e4m3`` forms);
2. tensor cores (:mod:`cuflash.kernels.attention_fwd_mma`): float16/bfloat16 on sm_80+, rows 16-byte
   aligned (head dims, strides and view offsets multiples of 8 elements);
3. portable SIMT (:mod:`cuflash.kernels.attention_fwd_simt`): every dtype, every score modifier
   and dropout, sm_70+ (Volta: with NVRTC 12.x only, :func:`compiler_reason`).

fp8 (``float8_e4m3fn``) input goes only to a tier module that declares ``FP8_FORM = True``: the
Hopper tier (its ``_e4m3`` forms, compute capability 9.0; :func:`cuflash.kernels.attention_fwd_sm90.fp8_reason`
says which fp8 calls it takes). Every other tier says it has no fp8 form (:func:`fp8_reason`), so an
fp8 call elsewhere is a ``NotImplementedError`` naming the tiers and the arch (the NumPy path
computes fp8 input). An fp8
KV cache (q float16/bfloat16) is read by the tensor-core KV-cache kernel's fp8-cache form
(``attention_fwd_mma.FP8_KVCACHE_FORM``; :func:`cuflash.kernels.kvcache_run.fp8_cache_refusal`).

A tier module may declare ``TARGET_ARCH`` (``"90a"``: its kernels are compiled for ``sm_90a``,
as the Hopper tier's are) and ``MIN_NVRTC_MAJOR`` (13: CUDA-13-only). Before asking the
module, the dispatcher applies the rule of :func:`target_reason`: an ``sm_90a`` tier runs only on
compute capability 9.0 (Blackwell, 10.x and 12.x, gets the next tier, and ``explain`` says why),
and a CUDA-13-only tier only where NVRTC 13.x is installed (under the ``cuda12`` extra the next
tier runs, visibly).

:func:`explain_forward` answers, without launching, what :func:`run_forward` would launch: the
tier and variant above, or for a KV-cache call the tensor-core KV-cache variant and its key splits
(:func:`cuflash.kernels.kvcache_run.choose`, the choice the KV-cache path itself makes), with the
same refusals; the public ``explain`` functions return it.

The simulator (``backend="sim"``) asks with its emulated arch (``cuflash.sim.options(arch=...)``,
sm_90 by default), so it runs the variant an sm_90 device would get.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_bwd_sm90,
    attention_fwd_mma,
    attention_fwd_simt,
    attention_fwd_sm90,
    backward_run,
    kvcache_run,
)
from cuflash.runtime import cubin, cuda_runner, nvrtc, plan

log = logging.getLogger("cuflash.dispatch")

#: tiers in order of preference: (name, module); each module has ``unsupported_reason`` or
#: takes everything
TIERS = (("Hopper wgmma", attention_fwd_sm90), ("tensor-core mma.sync", attention_fwd_mma),
         ("portable SIMT", attention_fwd_simt))
#: the backward's tiers, likewise (:func:`backward_tier`)
BACKWARD_TIERS = (("Hopper wgmma", attention_bwd_sm90), ("tensor-core mma.sync", attention_bwd_mma),
                  ("portable SIMT", attention_bwd_simt))


def target_reason(mod, arch: int, nvrtc_majors=None) -> str | None:
    """Why the tier module ``mod`` cannot run on compute capability ``arch`` whatever the call,
    from its ``TARGET_ARCH`` and ``MIN_NVRTC_MAJOR`` (None if it can, or if it declares neither).

    ``nvrtc_majors`` are the installed NVRTC majors; None asks
    :func:`cuflash.runtime.cuda_runner.nvrtc_majors`. With no NVRTC installed at all (a
    simulator-only install) the compiler condition is not applied.
    """
    target = getattr(mod, "TARGET_ARCH", None)
    if target is not None and attention_fwd_mma.sm75_form_forced():
        return "the tensor-core tier's sm_75 (Turing) form is in force (attention_fwd_mma.sm75_form)"
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


def compiler_reason(arch: int, nvrtc_majors=None) -> str | None:
    """Why no kernel can be compiled for ``sm_<arch>`` with the NVRTCs installed (None if one can):
    CUDA 13 dropped sm_70 (Volta, the V100), so there only NVRTC 12.x (the ``cuda12`` extra)
    compiles. ``nvrtc_majors`` as for :func:`target_reason` (none installed: not applied)."""
    if nvrtc_majors is None:
        nvrtc_majors = cuda_runner.nvrtc_majors()
    if not nvrtc_majors or any(nvrtc.OLDEST_ARCH.get(m, 0) <= arch for m in nvrtc_majors):
        return None
    oldest = [m for m in nvrtc.MAJORS if nvrtc.OLDEST_ARCH[m] <= arch]
    if not oldest:
        return f"no NVRTC compiles for sm_{arch} (cuflash's kernels need sm_70 or newer)"
    return (f"NVRTC {', '.join(f'{m}.x' for m in nvrtc_majors)} cannot compile for sm_{arch} (CUDA 13 dropped "
            f"sm_70, Volta): install the cuda12 extra (pip install 'cuflash[cuda12]': cupy-cuda12x and "
            f"{nvrtc.WHEELS[oldest[-1]]!r})")


def fp8_reason(mod, problem) -> str | None:
    """Why the tier module ``mod`` cannot take ``problem``'s fp8 input (None when the problem is not
    fp8, or the module declares ``FP8_FORM = True``)."""
    if getattr(problem, "fp8", None) is None or getattr(mod, "FP8_FORM", False):
        return None
    return "it has no fp8 (float8_e4m3fn) form (it computes float16, bfloat16 and float32)"


def packed_mods_reason(problem) -> str | None:
    """Why no tier takes a packed batch (``attention_varlen``) with a traced score_mod/mask_mod
    (None otherwise): the tensor-core forward's packed form does not apply them per sequence
    with the NumPy path's meaning (``b`` the sequence, positions within it) in both directions."""
    m = getattr(problem, "modifiers", None)
    if getattr(problem, "varlen", None) is None or m is None or (m.score_mod is None and m.mask_mod is None):
        return None
    return ("score_mod/mask_mod on a packed batch (attention_varlen) is not in this kernel's packed form yet; "
            "the NumPy path takes them")


def _choose(problem, arch: int, arrays=None, tiers=None, nvrtc_majors=None):
    """``(module, reasons)``: the tier that runs ``problem`` and why each faster one does not
    (``tiers`` default: :data:`TIERS`, looked up at call time)."""
    tiers = TIERS if tiers is None else tiers
    why = compiler_reason(arch, nvrtc_majors)
    if why is not None:
        raise NotImplementedError(f"{problem.func}: no kernel takes this call on sm_{arch}: {why}")
    reasons = []
    for name, mod in tiers:
        why = fp8_reason(mod, problem) or packed_mods_reason(problem) or target_reason(mod, arch, nvrtc_majors)
        if why is None:
            check = getattr(mod, "unsupported_reason", None)
            why = check(problem, arch, arrays) if check is not None else None
        if why is None:
            return mod, reasons
        reasons.append(f"{name} tier not used: {why}")
    raise NotImplementedError(f"{problem.func}: no kernel takes this call on sm_{arch}: " + "; ".join(reasons))


def forward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs ``problem`` on ``sm_<arch>``.

    A tier module provides ``forward(problem, q, k, v, out, call) -> (out, lse)`` and
    ``variant_for(problem, arch)``. ``arrays`` ((q, k, v) or (q, k, v, out)) lets a tier check the
    alignment of views; without it only shapes and dtypes decide.
    """
    return _choose(problem, arch, arrays)[0]


def backward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs the backward of ``problem`` on ``sm_<arch>``: the Hopper
    backward (``sm_90a``: compute capability 9.0; float16/bfloat16 with D = Dv = 64, 96 or 128, views
    a TMA tensor map can describe, fixed or packed, no dropout or built-in modifiers, a traced
    score_mod / mask_mod / block mask at fixed shapes; deterministic mode too),
    the tensor-core backward (float16/bfloat16, sm_80+, a tile of the head dims' bucket fitting
    the shared memory, rows 16-byte aligned) or the portable SIMT one; why each faster tier was
    passed over is :func:`describe_backward_choice`'s line. A tier module provides
    ``main_variant(problem, arch)``, the main stage :func:`run_backward` runs between the common
    dot and convert stages; ``arrays`` is ``(q, k, v, out, dout)`` (alignment of views)."""
    mod, reasons = _choose(problem, arch, arrays, BACKWARD_TIERS)
    if log.isEnabledFor(logging.DEBUG):
        name = dict((m, n) for n, m in BACKWARD_TIERS)[mod]
        log.debug("sm_%d: backward on the %s tier%s", arch, name, "; " + "; ".join(reasons) if reasons else "")
    return mod


def describe_backward_choice(problem, arch: int, arrays=None) -> str:
    """One line naming the backward tier and main-stage variant that run ``problem`` on
    ``sm_<arch>`` and why each faster tier was passed over (``arrays``: ``(q, k, v, out, dout)``),
    e.g. ``sm_90: tensor-core mma.sync tier, cuflash_attn_bwd_mma_main_...; Hopper wgmma tier not
    used: dropout is not in the Hopper backward yet``."""
    mod, reasons = _choose(problem, arch, arrays, BACKWARD_TIERS)
    v = mod.main_variant(problem, arch)
    name = dict((m, n) for n, m in BACKWARD_TIERS)[mod]
    what = v.describe(arch) if mod is attention_bwd_mma else v.describe() if hasattr(v, "describe") else v.entry
    line = f"sm_{arch}: {name} tier, " + what
    return line + ("; " + "; ".join(reasons) if reasons else "")


def variant_for(mod, problem, arch: int):
    """The variant the tier module ``mod`` runs ``problem`` with on ``sm_<arch>``."""
    return mod.variant_for(problem, arch)


def describe_choice(problem, arch: int, arrays=None, sm_count=None) -> str:
    """One line naming the tier, the variant and its tiles that run ``problem`` on ``sm_<arch>``,
    and why any faster tier was passed over, e.g.::

        sm_90: tensor-core mma.sync tier, cuflash_attn_fwd_mma_bf16_d128_m128_n64: 4 warps of 32 query rows, ...
        sm_90: portable SIMT tier, cuflash_attn_fwd_simt_f16_d128_m32_n32 (Br=32, Bc=32, ...);
            tensor-core mma.sync tier not used: D=59 is not a multiple of 8 (...)

    A KV-cache call gets :func:`explain_forward`'s line: the KV-cache variant the launch uses
    (:func:`cuflash.kernels.kvcache_run.choose`) and its key splits (``sm_count`` as there).
    """
    if problem.kvcache is not None:
        return explain_forward(problem, arch, arrays, sm_count)["choice"]
    mod, reasons = _choose(problem, arch, arrays)
    v = variant_for(mod, problem, arch)
    name = dict((m, n) for n, m in TIERS)[mod]
    what = v.describe() if hasattr(v, "describe") else (
        f"{v.entry} (Br={v.block_m}, Bc={v.block_n}, {v.block[0]} threads, {v.smem_bytes} B shared memory)")
    note = getattr(mod, "form_note", lambda *a: None)(problem, arch)
    line = f"sm_{arch}: {name} tier, {what}" + (f" ({note})" if note else "")
    if reasons:
        line += "; " + "; ".join(reasons)
    return line


def describe_backward(problem, arch: int, arrays=None) -> str:
    """One line naming the tier and main-stage variant that would run the backward of ``problem``
    on ``sm_<arch>`` (:func:`backward_tier`), and why any faster tier was passed over, e.g.
    ``sm_90: backward on the portable SIMT tier, cuflash_attn_bwd_simt_main_bf16_d256_m8_n16_mods;
    tensor-core mma.sync tier not used: with score modifiers at head dim 256, its only tile ...``;
    or ``no backward kernel: ...`` where none takes it."""
    try:
        mod, reasons = _choose(problem, arch, arrays, BACKWARD_TIERS)
    except NotImplementedError as e:
        return f"no backward kernel: {e}"
    v = mod.main_variant(problem, arch)
    if problem.varlen is not None:   # (the packed form, as backward_run launches it)
        v = dataclasses.replace(v, varlen=True)
    line = f"sm_{arch}: backward on the {dict((m, n) for n, m in BACKWARD_TIERS)[mod]} tier, {v.entry}"
    return line + ("; " + "; ".join(reasons) if reasons else "")


def _tiles(variant) -> dict:
    """The tile fields of :func:`explain_forward`'s answer."""
    return {"variant": variant.name, "entry": variant.entry, "block_m": getattr(variant, "block_m", None),
            "block_n": getattr(variant, "block_n", None), "threads": math.prod(variant.block),
            "smem_bytes": getattr(variant, "smem_bytes", None)}


def forward_blocks(problem, variant) -> int | None:
    """Thread blocks of the forward launch of a fixed or packed ``problem`` on ``variant`` (None when
    the variant has no query tile): a block per query tile, head and batch, or with the Hopper
    forward's GQA packing per tile of :func:`attention_fwd_sm90.gqa_tile_positions` positions, kv head
    and batch."""
    p, bm = problem, getattr(variant, "block_m", None)
    pack = p.group_size if getattr(variant, "gqa", False) else 1
    per_tile = attention_fwd_sm90.gqa_tile_positions(pack) if pack > 1 else bm
    return -(-p.seqlen_q // per_tile) * (p.num_heads_q // pack) * math.prod(p.batch_shape) if bm else None


def _check_grid(problem, blocks: int) -> None:
    """The 1-D grid limit the packed and KV-cache launch plans refuse past (the same message)."""
    if blocks > plan.MAX_GRID_DIMS[0]:
        raise NotImplementedError(f"{problem.func}: {blocks} thread blocks exceed the grid limit {plan.MAX_GRID_DIMS[0]}")


def _unsplit_reason(problem, variant) -> str:
    """Why the KV-cache call ``problem`` on ``variant`` runs one split where ``num_splits`` asks for
    more (explain's words)."""
    p, c = problem, problem.kvcache
    hopper = isinstance(variant, attention_fwd_sm90.Sm90ForwardVariant)
    if p.varlen is not None and not hopper:
        return "the tensor-core tier does not split packed batches (chunked prefill)"
    if p.varlen is not None and variant.head_dim in attention_fwd_sm90.PREFILL_UNSPLIT_BUCKETS:
        return f"the head-dim-{variant.head_dim} chunked-prefill form runs unsplit"
    return f"the cache's capacity of {c.capacity} rows is one {variant.block_n}-key tile"


def explain_forward(problem, arch: int, arrays=None, sm_count=None) -> dict:
    """What :func:`run_forward` would launch for ``problem`` on ``sm_<arch>``, without launching.

    The same decisions in the same order, so the same refusals: a KV-cache problem (a KV cache,
    or a packed batch over a paged one) takes :func:`cuflash.kernels.kvcache_run.choose`'s
    variant and split count, any other the tier :func:`forward_tier` picks.

    Parameters
    ----------
    problem : AttentionProblem
        A validated forward (fixed, packed or KV-cache).
    arch : int
        Compute capability.
    arrays : tuple, optional
        ``(q, k, v)`` (the caches for a KV cache) when their strides and addresses are known
        (alignment checks); None decides from shapes and dtypes.
    sm_count : int, optional
        The device's SM count; needed only by a KV-cache call with ``num_splits=0`` (its split
        count depends on it), a packed batch (chunked prefill) only on the Hopper form.

    Returns
    -------
    dict
        ``tier`` (module name), ``variant``, ``entry``, ``block_m``, ``block_n``, ``threads``,
        ``smem_bytes``, ``blocks`` (thread blocks of the attention kernel), ``choice`` (one line:
        the form, its tiles, and why each faster tier was passed over), ``backward`` (the same for
        the call's backward, :func:`describe_backward`; not for the KV-cache form, which has none),
        and for the KV-cache form ``splits`` (key splits; above 1 a combine launch merges them).

    Raises
    ------
    NotImplementedError
        As the launch would: no tier takes the call, or the KV-cache kernel cannot.
    """
    p = problem
    c = p.kvcache
    if c is None:
        mod, reasons = _choose(p, arch, arrays)
        v = variant_for(mod, p, arch)
        blocks = forward_blocks(p, v)
        if p.varlen is not None and mod is not attention_fwd_sm90:   # one launch on a 1-D grid
            _check_grid(p, blocks)
        return {"tier": mod.__name__.rsplit(".", 1)[-1], **_tiles(v), "blocks": blocks,
                "choice": describe_choice(p, arch, arrays), "backward": describe_backward(p, arch)}
    reasons = []
    for name, mod in TIERS:   # the tiers faster than the one KV-cache kernel's, and why each passes
        if mod is attention_fwd_mma:
            break
        why = (kvcache_run.hopper_reason(p, arch, arrays) if mod is attention_fwd_sm90
               else target_reason(mod, arch) or mod.unsupported_reason(p, arch, arrays))
        reasons.append(f"{name} tier not used: {why}")
    # (packed queries split on the Hopper form only)
    if c.num_splits == 0 and sm_count is None and (p.varlen is None or kvcache_run.hopper_reason(p, arch, arrays) is None):
        raise ValueError(f"{p.func}: num_splits=0 chooses the split count from the device's SM count, which is "
                         f"not known here for sm_{arch}; pass num_splits=n, or an arch the simulator emulates")
    v, splits = kvcache_run.choose(p, arch, arrays, sm_count)
    batch = p.varlen.batch if p.varlen is not None else p.batch_shape[0]
    split = f"{splits} key splits merged by the combine kernel" if splits > 1 else "unsplit"
    if splits == 1 and c.num_splits > 1:
        split += f" (num_splits={c.num_splits} asked: {_unsplit_reason(p, v)})"
    if isinstance(v, attention_fwd_sm90.Sm90ForwardVariant):   # the Hopper KV-cache form (the fastest tier)
        tiles = attention_fwd_sm90.kvcache_query_tiles(p)
        blocks = tiles * splits * attention_fwd_sm90.kvcache_heads(p) * batch
        where = (f"a paged cache ({c.num_pages} pages of {c.page_size} rows)" if c.paged
                 else f"a contiguous cache ({c.num_pages} x {c.capacity} rows)")
        if p.varlen is not None:
            form = f"chunked prefill: packed queries over {where}, up to {p.varlen.max_seqlen_q} query rows a sequence"
        elif v.gqa:
            form = f"KV-cache form over {where}, {attention_fwd_sm90.gqa_pack_note(p, tiles)}"
        else:
            form = f"KV-cache form over {where}, {p.seqlen_q} query rows"
            why = attention_fwd_sm90.gqa_pack_reason(p) if p.group_size > 1 else None
            if why is not None:
                form += f" (GQA packing not used: {why})"
        per_tile = "" if v.gqa else " per 128-row tile"
        loads = attention_fwd_sm90.kvcache_loads(p, v)
        line = f"sm_{arch}: Hopper wgmma tier, {form}{per_tile}, {split}; {loads}: {v.describe()}"
        return {"tier": attention_fwd_sm90.__name__.rsplit(".", 1)[-1], **_tiles(v), "blocks": blocks,
                "splits": splits, "choice": line}
    tiles = attention_fwd_mma.kvcache_query_tiles(p, v)
    pack = attention_fwd_mma.kvcache_pack(p)
    blocks = tiles * splits * (p.num_heads_q // pack) * batch
    _check_grid(p, blocks)
    where = (f"a paged cache ({c.num_pages} pages of {c.page_size} rows)" if c.paged
             else f"a contiguous cache ({c.num_pages} x {c.capacity} rows)")
    if p.fp8 is not None:
        where = "an fp8 (float8_e4m3fn)" + where[1:] + ", dequantized as read"
    form = f"chunked prefill: packed queries over {where}" if p.varlen is not None else f"KV-cache form over {where}"
    line = (f"sm_{arch}: tensor-core mma.sync tier, {form}, {pack} query head{'s' * (pack != 1)} per block "
            f"(pack-GQA), {split}: {v.describe()}")
    if reasons:
        line += "; " + "; ".join(reasons)
    return {"tier": attention_fwd_mma.__name__.rsplit(".", 1)[-1], **_tiles(v), "blocks": blocks, "splits": splits,
            "choice": line}


def run_forward(problem, q, k, v, out, call):
    """``(out, lse)`` of a forward call on ``call``'s device (q, k, v, out: its device arrays;
    ``out`` None allocates): the KV-cache path for ``problem.kvcache``
    (:func:`cuflash.kernels.kvcache_run.run_kvcache`), else the tier :func:`forward_tier` picks."""
    if problem.kvcache is not None:
        return kvcache_run.run_kvcache(problem, q, out, call)
    arrays = (q, k, v, out)
    tier = forward_tier(problem, call.arch, arrays)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", describe_choice(problem, call.arch, arrays))
    return tier.forward(problem, q, k, v, out, call)


def run_backward(problem, dout, q, k, v, out, lse, call) -> tuple:
    """The gradients of a backward call on ``call``'s device: the main stage of the tier
    :func:`backward_tier` picks, in :func:`cuflash.kernels.backward_run.backward`'s three stages."""
    tier = backward_tier(problem, call.arch, (q, k, v, out, dout))
    return backward_run.backward(problem, dout, q, k, v, out, lse, tier.main_variant(problem, call.arch), call)
