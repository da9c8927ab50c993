"""The tensor-core attention backward (``kernels_cu/attention_bwd_mma.cu``): variant and chooser.

float16 and bfloat16 on sm_80+ (``mma.sync`` m16n8k16, ``ldmatrix``, ``cp.async``), head dims up
to 128 (buckets 64 and 128; other multiples of 8 run in the next bucket, zero-filled). Only the
main stage is new: the ``dot`` and ``convert`` stages, the float32 dQ workspace and the
deterministic mode's per-split partials are those of :mod:`cuflash.kernels.attention_bwd_simt`, whose
main-stage argument list this kernel shares (:func:`backward` passes this variant to it).

Alignment rules as the forward's (:func:`cuflash.kernels.attention_fwd_mma.unsupported_reason`): q, k, v,
out and dout rows 16-byte aligned; :func:`unsupported_reason` says why a call cannot run here,
and the dispatcher (:func:`cuflash.kernels.dispatch.backward_tier`) falls back to the SIMT backward.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from cuflash.kernels import attention_bwd_simt, attention_fwd_mma
from cuflash.runtime import variants

#: head-dim buckets and their (Br, Bc, warps, dsplit): Bc = 16 keys per key group of ``dsplit``
#: warps, each owning ``1 / dsplit`` of dK's and dV's columns (register budget: no spills)
CONFIGS = {64: (32, 64, 4, 1), 128: (32, 64, 8, 2)}
TILES = {b: c[:2] for b, c in CONFIGS.items()}
HEAD_DIM_BUCKETS = tuple(TILES)
MMA_DTYPES = attention_fwd_mma.MMA_DTYPES
ARCHES = attention_fwd_mma.ARCHES
MIN_ARCH = attention_fwd_mma.MIN_ARCH


@dataclasses.dataclass(frozen=True)
class AttentionBwdMma(variants.BucketTiledVariant):
    """The tensor-core main stage of the backward for one dtype and head-dim bucket."""

    family: ClassVar[str] = "attn_bwd_mma"
    source: ClassVar[str] = "attention_bwd_mma.cu"
    dtypes: ClassVar[tuple[str, ...]] = MMA_DTYPES
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS
    tiles: ClassVar[dict[int, tuple[int, int]]] = TILES

    dtype: str
    head_dim_max: int

    #: the kernel loops over the launch's key tiles (see cuflash.kernels.attention_bwd_simt.backward)
    loops_over_key_tiles: ClassVar[bool] = True

    def axes(self) -> tuple[str, ...]:
        return ("main",) + super().axes()

    @property
    def stage(self) -> str:
        return "main"

    @property
    def threads(self) -> int:
        return 32 * CONFIGS[self.head_dim_max][2]

    @property
    def dsplit(self) -> int:
        return CONFIGS[self.head_dim_max][3]

    @property
    def smem_bytes(self) -> int:
        """K, V (Bc rows), Q, dO (Br rows) at pitch Dmax + 8 and dS (Br x (Bc + 8)), 16-bit;
        lse and Dd (Br floats each). The kernel ``static_assert``s the same figure."""
        bm, bn = self.tile
        pitch = self.head_dim_max + 8
        return 2 * (2 * bn * pitch + 2 * bm * pitch + bm * (bn + 8)) + 4 * 2 * bm

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
            ("CUFLASH_DSPLIT", str(self.dsplit)),
        )

    def describe(self) -> str:
        bm, bn = self.tile
        return (f"{self.entry}: {self.threads // 32} warps, Bc={bn} keys x Br={bm} query tiles, head-dim bucket {self.head_dim_max}, "
                f"{self.smem_bytes} B shared memory, mma.sync m16n8k16 {self.dtype}")


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionBwdMma:
    return AttentionBwdMma(variants.dtype_key(dtype), AttentionBwdMma.bucket(head_dim, head_dim_v))


def all_variants(arch: int) -> tuple[AttentionBwdMma, ...]:
    """Every variant the backward dispatcher can choose on ``sm_<arch>`` (for the compile gate)."""
    if arch < MIN_ARCH:
        return ()
    return tuple(AttentionBwdMma(key, b) for key in MMA_DTYPES for b in HEAD_DIM_BUCKETS)


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the backward of ``problem`` cannot run on this kernel (None if it can). ``arrays`` is
    ``(q, k, v, out, dout)``; the forward's rules apply to each, and head dims must be <= 128."""
    p = problem
    if max(p.head_dim, p.head_dim_v) > HEAD_DIM_BUCKETS[-1]:
        return f"head dim {max(p.head_dim, p.head_dim_v)} > {HEAD_DIM_BUCKETS[-1]} (the tensor-core backward's largest bucket)"
    arrays = tuple(arrays or ())
    why = attention_fwd_mma.unsupported_reason(p, arch, arrays[:4])
    if why is None and len(arrays) > 4:
        why = attention_fwd_mma.unsupported_reason(p, arch, (arrays[4],))
        if why is not None:
            why = why.replace("q ", "dout ", 1)
    return why


def backward(problem, dout, q, k, v, out, lse, *, xp, arch: int, launch, deterministic: bool = False):
    """``(dq, dk, dv)``: the SIMT dot and convert stages around this kernel's main stage."""
    main = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    return attention_bwd_simt.backward(problem, dout, q, k, v, out, lse, xp=xp, arch=arch, launch=launch,
                                        deterministic=deterministic, main_variant=main)
