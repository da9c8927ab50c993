"""Every kernel variant the dispatcher can choose, by target arch.

One list for the NVRTC compile gate (tests/kernels/test_compile_gate.py), for precompilation and
for the GPU self-check, so a new kernel family is added in one place.
"""

from __future__ import annotations

import dataclasses

from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_bwd_sm90,
    attention_combine,
    attention_fwd_mma,
    attention_fwd_simt,
    attention_fwd_sm90,
    dropout_mask,
    kvcache_append,
    softmax,
)
from cuflash.runtime import nvrtc

#: the arches the SIMT kernels are compiled and checked for (sm_70, Volta, with NVRTC 12.x only:
#: sm_75 is CUDA 13's oldest; :func:`compilers`)
SIMT_ARCHS = (70, 75, 80, 90)
#: the arches the tensor-core kernels are compiled and checked for
MMA_ARCHS = attention_fwd_mma.ARCHES


def variants_for_arch(arch: int) -> tuple:
    """The variants a device of compute capability ``arch`` may run."""
    out: list = []
    if arch in SIMT_ARCHS or arch >= 75:
        out.extend(softmax.SoftmaxVariant.all())
    for varlen in (False, True):   # fixed shapes, then the packed variable-length forms
        if arch in SIMT_ARCHS or arch >= 75:   # (and the dropout, modifier and combined forms)
            for dropout, mods in ((False, False), (False, True), (True, False), (True, True)):
                out.extend(attention_fwd_simt.all_variants(arch, varlen=varlen, dropout=dropout, mods=mods))
                out.extend(attention_bwd_simt.all_variants(arch, varlen=varlen, dropout=dropout, mods=mods))
        if arch >= attention_fwd_mma.SM75_ARCH:   # (sm_75: the float16 Turing form)
            out.extend(attention_fwd_mma.all_variants(arch, varlen=varlen))
        if arch >= attention_fwd_mma.SM75_ARCH:
            out.extend(attention_bwd_mma.all_variants(arch, varlen=varlen))
            out.extend(attention_bwd_mma.all_variants(arch, varlen=varlen, deterministic=True))   # (their dQ form)
    if arch >= attention_fwd_mma.SM75_ARCH:   # the KV-cache forms (fixed q, and packed q for chunked prefill)
        for varlen in (False, True):
            out.extend(attention_fwd_mma.all_variants(arch, varlen=varlen, kvcache=True))
        out.extend(attention_fwd_mma.all_variants(arch, kvcache=True, cache_fp8=True))   # over an fp8 cache
    if arch >= attention_fwd_mma.SM75_ARCH:   # the score-modifier forms: fixed, packed, KV-cache (fixed and
        for varlen in (False, True):         # packed q), and the backward's (fixed, packed)
            for kvcache in (False, True):
                out.extend(attention_fwd_mma.all_variants(arch, varlen=varlen, kvcache=kvcache, mods=True))
            out.extend(attention_bwd_mma.all_variants(arch, varlen=varlen, mods=True))
    if arch >= attention_fwd_mma.SM75_ARCH:   # the dropout forms (fixed and packed), forward and backward
        for varlen in (False, True):
            out.extend(dataclasses.replace(v, varlen=varlen) for v in attention_fwd_mma.all_variants(arch, dropout=True))
            out.extend(attention_bwd_mma.all_variants(arch, varlen=varlen, dropout=True))
    out.extend(attention_fwd_sm90.all_variants(arch))   # (sm_90a: compute capability 9.0 only)
    out.extend(attention_fwd_sm90.all_variants(arch, mods=True))
    out.extend(attention_fwd_sm90.all_variants(arch, varlen=True))
    out.extend(attention_fwd_sm90.all_variants(arch, varlen=True, mods=True))   # (softcap, ALiBi on packed batches)
    out.extend(attention_bwd_sm90.all_variants(arch))   # (sm_90a, the backward's main stage)
    out.extend(attention_fwd_sm90.all_variants(arch, kvcache=True))
    out.extend(attention_fwd_sm90.all_variants(arch, kvcache=True, mods=True))   # (softcap, ALiBi, sinks on a cache)
    out.extend(attention_fwd_sm90.all_variants(arch, gqa=True))   # (GQA packing: fixed shapes, Sq under a tile)
    out.extend(attention_fwd_sm90.all_variants(arch, kvcache=True, gqa=True))   # (GQA packing: decode-like calls)
    out.extend(attention_fwd_sm90.all_variants(arch, kvcache=True, mods=True, gqa=True))   # (softcap, ALiBi, sinks)
    out.extend(attention_fwd_sm90.all_variants(arch, varlen=True, kvcache=True))   # (chunked prefill over a paged cache)
    out.extend(attention_fwd_sm90.all_variants(arch, varlen=True, kvcache=True, mods=True))   # (with softcap, ALiBi)
    for gqa, varlen in ((False, False), (True, False), (False, True)):   # (TMA over the cache: plain, modifiers)
        for mods in (False, True):
            out.extend(attention_fwd_sm90.all_variants(arch, varlen=varlen, kvcache=True, gqa=gqa, mods=mods,
                                                       kv_tma=True))
    out.extend(attention_fwd_sm90.all_variants(arch, fp8=True))   # (fp8 q, k, v; sm_90a)
    out.extend(attention_fwd_sm90.all_variants(arch, varlen=True, fp8=True))   # (fp8 packed batches)
    if arch >= 70:
        out.extend(dropout_mask.DropoutMaskVariant.all())
    if arch >= 75:
        out.extend(kvcache_append.KVCacheAppend.all())
        out.extend(attention_combine.AttentionCombine.all())
    if arch >= attention_fwd_mma.SM75_ARCH:   # the append into an fp8 cache (read by the form above)
        out.extend(kvcache_append.KVCacheAppend.fp8_forms())
    return tuple(dict.fromkeys(out))


def compilers(arch: int, variant) -> tuple[int, ...]:
    """The NVRTC majors that compile ``variant`` for ``sm_<arch>``: those not older than its
    ``min_nvrtc_major`` whose oldest arch is not newer than ``arch`` (sm_70: 12.x only)."""
    return tuple(m for m in nvrtc.MAJORS
                 if m >= getattr(variant, "min_nvrtc_major", 12) and nvrtc.OLDEST_ARCH[m] <= arch)


def compile_targets() -> list[tuple[int, object]]:
    """``(arch, variant)`` pairs of the compile gate: every variant on every arch it targets."""
    return [(arch, v) for arch in SIMT_ARCHS for v in variants_for_arch(arch)]


def passed_over_targets() -> list[tuple[int, object]]:
    """``(arch, variant)`` pairs the dispatcher passes over because ptxas spills them (each
    module's ``passed_over``): the compile gate compiles them too, against its KNOWN_SPILLS, so a
    form that stops spilling is seen and can be picked again."""
    return [(arch, v) for arch in SIMT_ARCHS for v in attention_fwd_simt.passed_over(arch)]
