"""The portable attention forward (``kernels_cu/attention_fwd_simt.cu``): variant and planner.

Every dtype (float16, bfloat16, float32) on every arch from sm_75, with every feature: the score
modifiers (softcap, ALiBi, additive bias, boolean mask, sinks: the ``mods`` forms) and dropout
(the ``dropout`` forms, the Philox keep bits of every tier). Compile-time axes are the dtype, the
head-dim bucket (the smallest of 32, 64, 128, 256 holding ``max(D, Dv)``), the tile shape and
those forms; causal, windows, lengths, strides and the scale are run-time arguments.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from cuflash.kernels import forward_run
from cuflash.runtime import plan, variants
from cuflash.runtime.validation_modifiers import refuse_modifiers

#: head-dim buckets: a variant serves every ``max(D, Dv)`` up to its bucket
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
#: threads per block (4 warps)
THREADS = 128
#: tile shapes (Br, Bc) by bucket, in order of preference; the first that fits the device's
#: shared memory is used (see :func:`choose_variant`)
TILE_CANDIDATES = {
    32: ((32, 64),),
    64: ((32, 64), (32, 32)),
    128: ((32, 32), (16, 32)),
    256: ((8, 32), (8, 16)),
}
#: the plain packed forms (no dropout, no modifier) ptxas spills under NVRTC 13.x, where the kernel
#: sets no register floor (its ``FWD_MIN_BLOCKS``): bucket 64's 32 x 64 on sm_75 (float16) runs
#: 32 x 32 there (0 spills with both compilers, every arch and form); bucket 256's 8 x 32 (8-16
#: bytes on sm_75 and sm_90; 8 x 16 spills as much) runs as the ``mods`` form with every modifier
#: off, whose register floor leaves it 0 spills (:func:`packed_form`)
PACKED_TILES_SM75 = {64: (32, 32)}
PACKED_AS_MODS_BUCKETS = (256,)
#: the arches the kernel targets (sm_70, Volta, with NVRTC 12.x only: CUDA 13 starts at sm_75)
ARCHES = (70, 75, 80, 90)
#: the oldest compute capability the portable kernels run on
MIN_ARCH = 70
#: the score modifiers the kernel takes (its ``mods`` forms; kernels_cu/score_mods.cuh): the built-in
#: ones, not a traced ``score_mod``/``mask_mod``
MODIFIERS = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")


@dataclasses.dataclass(frozen=True)
class AttentionFwdSimt(variants.TileVariant):
    """One compiled configuration of the portable forward kernel.

    Parameters
    ----------
    dtype : {"f16", "bf16", "f32"}
        Element type of q, k, v and out (arithmetic and LSE are float32).
    head_dim_max : int
        Bucket of ``max(D, Dv)``: 32, 64, 128 or 256.
    block_m, block_n : int
        Query rows (Br) and key rows (Bc) per tile.
    """

    family: ClassVar[str] = "attn_fwd_simt"
    source: ClassVar[str] = "attention_fwd_simt.cu"
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS
    threads: ClassVar[int] = THREADS

    def __post_init__(self):
        super().__post_init__()
        tpr = THREADS // self.block_m if self.block_m else 0
        if THREADS % max(self.block_m, 1) or not 1 <= tpr <= 32 or tpr & (tpr - 1) or self.block_n % tpr:
            raise ValueError(f"AttentionFwdSimt: tile ({self.block_m}, {self.block_n}) does not split over {THREADS} threads")

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (Br x Dmax), one K/V tile (Bc x Dmax), P (Br x Bc), float32,
        rows padded by one element. The kernel ``static_assert``s the same figure."""
        d = self.head_dim_max + 1
        return 4 * (self.block_m * d + self.block_n * d + self.block_m * (self.block_n + 1))


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionFwdSimt:
    """The tile heuristic: the preferred tile of the bucket that fits the device's shared memory."""
    key = variants.dtype_key(dtype)
    bucket = AttentionFwdSimt.bucket(head_dim, head_dim_v)
    candidates = (AttentionFwdSimt(key, bucket, bm, bn) for bm, bn in TILE_CANDIDATES[bucket])
    v = AttentionFwdSimt.first_fitting(candidates, plan.max_dynamic_smem(arch))
    if v is None:
        raise NotImplementedError(f"cuflash: no portable attention tile fits sm_{arch}'s shared memory for head dim {bucket}")
    return v


def all_variants(arch: int, *, varlen: bool = False, dropout: bool = False,
                 mods: bool = False) -> tuple[AttentionFwdSimt, ...]:
    """Every variant the dispatcher can choose on ``sm_<arch>`` (for the compile gate); with
    ``varlen``, ``dropout``, ``mods``, their packed, dropout and score-modifier forms."""
    out = []
    for key in variants.DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            v = choose_variant(variants.DTYPES[key][1], bucket, bucket, arch)
            out.append(packed_form(dataclasses.replace(v, varlen=varlen, dropout=dropout, mods=mods), arch))
    return tuple(dict.fromkeys(out))


def packed_form(variant: AttentionFwdSimt, arch: int) -> AttentionFwdSimt:
    """The form that runs ``variant`` on ``sm_<arch>``: itself, except a plain packed variant that
    spills (:data:`PACKED_TILES_SM75`, :data:`PACKED_AS_MODS_BUCKETS`)."""
    v = variant
    if not v.varlen or v.dropout or v.mods:
        return v
    if 75 <= arch < 80 and v.head_dim_max in PACKED_TILES_SM75:
        return dataclasses.replace(v, block_m=PACKED_TILES_SM75[v.head_dim_max][0],
                                   block_n=PACKED_TILES_SM75[v.head_dim_max][1])
    if v.head_dim_max in PACKED_AS_MODS_BUCKETS:
        return dataclasses.replace(v, mods=True)
    return v


def form_note(problem, arch: int) -> str | None:
    """Why :func:`variant_for` runs another form than the plain packed one for ``problem`` (the
    dispatcher's one-line account carries it), None where it does not."""
    v = dataclasses.replace(choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch),
                            varlen=problem.varlen is not None, dropout=problem.dropout is not None,
                            mods=problem.modifiers is not None)
    w = packed_form(v, arch)
    if w == v:
        return None
    if w.mods != v.mods:
        return (f"the plain packed form of head dim {v.head_dim_max} spills registers to local memory under NVRTC "
                "13.x (sm_75, sm_90); the score-modifier form, with every modifier off, runs it without spills")
    return (f"the plain packed {v.block_m} x {v.block_n} tile spills registers to local memory on sm_{arch} under "
            f"NVRTC 13.x (float16); {w.block_m} x {w.block_n} runs it without spills")


def passed_over(arch: int) -> tuple[AttentionFwdSimt, ...]:
    """The plain packed variants :func:`packed_form` replaces on ``sm_<arch>`` (the compile gate
    still compiles them, so one that stops spilling is seen)."""
    out = []
    for key in variants.DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            v = dataclasses.replace(choose_variant(variants.DTYPES[key][1], bucket, bucket, arch), varlen=True)
            if packed_form(v, arch) != v:
                out.append(v)
    return tuple(out)


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why this portable kernel cannot take ``problem`` (None if it can): a device older than
    :data:`MIN_ARCH`, or a traced ``score_mod``/``mask_mod`` (the tensor-core tier compiles those);
    it takes every dtype, alignment, built-in score modifier and dropout (the dispatcher's last
    tier)."""
    if arch < MIN_ARCH:
        return f"sm_{arch} is older than sm_{MIN_ARCH} (Volta), the oldest arch the kernels target"
    return refuse_modifiers(problem, "the portable kernel", MODIFIERS)


def variant_for(problem, arch: int) -> AttentionFwdSimt:
    """The variant that runs ``problem`` on ``sm_<arch>``, in the packed, dropout and modifier forms
    the call needs."""
    variant = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    return packed_form(dataclasses.replace(variant, varlen=problem.varlen is not None,
                                           dropout=problem.dropout is not None, mods=problem.modifiers is not None), arch)


def forward(problem, q, k, v, out, call):
    """``(out, lse)`` of ``problem`` with :func:`variant_for` on the call's device
    (:func:`cuflash.kernels.forward_run.run_variant`)."""
    return forward_run.run_variant(problem, q, k, v, out, variant_for(problem, call.arch), call)
