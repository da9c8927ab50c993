"""The tensor-core attention forward (``kernels_cu/attention_fwd_mma.cu``): variant and planner.

float16 and bfloat16 on sm_80 and newer (``mma.sync`` m16n8k16, ``ldmatrix``, ``cp.async``).
Compile-time axes: the dtype, the head-dim bucket (64, 96, 128, 192, 256: the smallest holding
``max(D, Dv)``; other multiples of 8 run in the next bucket, the extra columns zero-filled) and
the tile (Br = 16 x warps query rows, Bc key rows). Causal, windows, lengths, strides and the
scale are run-time arguments, exactly as for the SIMT kernel, whose argument list this kernel
shares.

The kernel moves rows with 16-byte copies, so it needs every row 16-byte aligned: q, k, v and
out at 16-byte-aligned addresses, all strides and both head dims multiples of 8 elements.
:func:`unsupported_reason` says why a call cannot run here; the dispatcher then falls back to
the SIMT kernel and says so (:func:`cuflash.kernels.dispatch.describe_choice`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels import attention_fwd_simt
from cuflash.runtime import plan, variants

#: head-dim buckets: a variant serves every ``max(D, Dv)`` (a multiple of 8) up to its bucket
HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
#: dtypes with a tensor-core kernel
MMA_DTYPES = ("f16", "bf16")
#: the arches the kernel is compiled and checked for
ARCHES = (80, 90)
#: oldest arch with m16n8k16 for bf16 and cp.async
MIN_ARCH = 80
#: tile shapes (warps, Bc) by bucket, in order of preference; Br = 16 * warps. The first that
#: fits the device's shared memory is used.
TILE_CANDIDATES = {
    64: ((8, 64), (4, 64)),
    96: ((8, 64), (4, 64)),
    128: ((8, 64), (4, 64), (4, 32)),
    192: ((4, 64), (4, 32)),
    256: ((4, 64), (4, 32)),
}
#: buckets whose Q fragments stay in registers for the whole K/V loop
Q_IN_REGS_MAX_BUCKET = 128
#: bytes every row (and base address) must be aligned to (fresh outputs are allocated so)
ALIGN_BYTES = attention_fwd_simt.OUTPUT_ALIGN_BYTES


@dataclasses.dataclass(frozen=True)
class AttentionFwdMma(variants.TileVariant):
    """One compiled configuration of the tensor-core forward kernel.

    Parameters
    ----------
    dtype : {"f16", "bf16"}
        Element type of q, k, v and out (accumulation and LSE are float32).
    head_dim_max : int
        Bucket of ``max(D, Dv)``: 64, 96, 128, 192 or 256.
    block_m, block_n : int
        Query rows (Br = 16 per warp) and key rows (Bc, a multiple of 16) per tile.
    """

    family: ClassVar[str] = "attn_fwd_mma"
    source: ClassVar[str] = "attention_fwd_mma.cu"
    dtypes: ClassVar[tuple[str, ...]] = MMA_DTYPES
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS

    def __post_init__(self):
        super().__post_init__()
        if self.block_m % 16 or not 1 <= self.block_m // 16 <= 16 or self.block_n % 16 or self.block_n <= 0:
            raise ValueError(f"AttentionFwdMma: tile ({self.block_m}, {self.block_n}) must be multiples of 16, <= 16 warps")

    @property
    def warps(self) -> int:
        return self.block_m // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def q_in_regs(self) -> bool:
        return self.head_dim_max <= Q_IN_REGS_MAX_BUCKET

    @property
    def pitch(self) -> int:
        """Shared-memory row pitch in elements: the bucket plus one 16-byte chunk of padding."""
        return self.head_dim_max + 8

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (Br rows) and two stages of K and V (Bc rows each), 16-bit
        elements, row pitch :attr:`pitch`. The kernel ``static_assert``s the same figure."""
        return 2 * self.pitch * (self.block_m + 4 * self.block_n)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
            ("CUFLASH_Q_IN_REGS", "1" if self.q_in_regs else "0"),
        )

    def describe(self) -> str:
        return (f"{self.entry}: {self.warps} warps, Br={self.block_m} x Bc={self.block_n} tiles, head-dim bucket "
                f"{self.head_dim_max}, {self.smem_bytes} B shared memory (Q + 2-stage K/V, cp.async), "
                f"mma.sync m16n8k16 {self.dtype}, Q in {'registers' if self.q_in_regs else 'shared memory'}")


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionFwdMma:
    """The preferred tile of the bucket that fits ``sm_<arch>``'s shared memory."""
    key = variants.dtype_key(dtype)
    if key not in MMA_DTYPES:
        raise NotImplementedError(f"cuflash: the tensor-core kernel computes float16 and bfloat16, not {np.dtype(dtype)}")
    bucket = AttentionFwdMma.bucket(head_dim, head_dim_v)
    candidates = (AttentionFwdMma(key, bucket, 16 * warps, bn) for warps, bn in TILE_CANDIDATES[bucket])
    v = AttentionFwdMma.first_fitting(candidates, plan.max_dynamic_smem(arch))
    if v is None:
        raise NotImplementedError(f"cuflash: no tensor-core attention tile fits sm_{arch}'s shared memory for head dim {bucket}")
    return v


def all_variants(arch: int) -> tuple[AttentionFwdMma, ...]:
    """Every variant the dispatcher can choose on ``sm_<arch>`` (for the compile gate)."""
    if arch < MIN_ARCH:
        return ()
    out = []
    for key in MMA_DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            out.append(choose_variant(variants.DTYPES[key][1], bucket, bucket, arch))
    return tuple(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
# eligibility


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why ``problem`` cannot run on this kernel on ``sm_<arch>`` (None if it can).

    ``arrays`` is ``(q, k, v)`` or ``(q, k, v, out)`` (``out`` may be None); without it only the
    shape-level conditions are checked.
    """
    p = problem
    if arch < MIN_ARCH:
        name = str(np.dtype(p.dtype)).replace("bfloat16", "bf16").replace("float16", "f16")
        return f"sm_{arch} has no m16n8k16 {name} mma with cp.async (needs sm_{MIN_ARCH}+)"
    try:
        key = variants.dtype_key(p.dtype)
    except KeyError:
        key = str(np.dtype(p.dtype))
    if key not in MMA_DTYPES:
        return f"dtype {np.dtype(p.dtype)} (tensor cores here take float16/bfloat16)"
    for name, d in (("D", p.head_dim), ("Dv", p.head_dim_v)):
        if d % 8:
            return f"{name}={d} is not a multiple of 8 (rows must be 16-byte aligned)"
    if max(p.head_dim, p.head_dim_v) > HEAD_DIM_BUCKETS[-1]:
        return f"head dim {max(p.head_dim, p.head_dim_v)} > {HEAD_DIM_BUCKETS[-1]}"
    for a, name in zip(arrays or (), ("q", "k", "v", "out")):
        if a is None or a.size == 0:
            continue
        item = a.dtype.itemsize
        bad = [int(s) // item for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1 and (int(s) // item) % 8]
        if bad:
            return f"{name} has a stride of {bad[0]} elements, not a multiple of 8 (rows must be 16-byte aligned)"
        try:
            addr = plan.array_address(a)
        except TypeError:
            addr = None
        if addr is None or addr % ALIGN_BYTES:
            return f"{name} starts at an address that is not {ALIGN_BYTES}-byte aligned (a view at an odd offset)"
    return None


# --------------------------------------------------------------------------------------------
# planning


def forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Run ``problem`` with this tier's variant for ``sm_<arch>``: the kernel takes the SIMT
    kernel's argument list, so :func:`~cuflash.kernels.attention_fwd_simt.run_variant` allocates,
    plans and launches it."""
    variant = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    return attention_fwd_simt.run_variant(problem, q, k, v, out, return_lse, variant, xp=xp, launch=launch)
