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
the SIMT kernel and says so (:func:`cuflash._dispatch.describe_choice`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash import _attention_simt, _plan, _variants

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
#: bytes every row (and base address) must be aligned to
ALIGN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class AttentionFwdMma(_variants.Variant):
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

    dtype: str
    head_dim_max: int
    block_m: int
    block_n: int

    def axes(self) -> tuple[str, ...]:
        return (self.dtype, f"d{self.head_dim_max}", f"m{self.block_m}", f"n{self.block_n}")

    def __post_init__(self):
        if self.dtype not in MMA_DTYPES:
            raise ValueError(f"AttentionFwdMma: dtype={self.dtype!r} must be one of {MMA_DTYPES}")
        if self.head_dim_max not in HEAD_DIM_BUCKETS:
            raise ValueError(f"AttentionFwdMma: head_dim_max={self.head_dim_max} must be one of {HEAD_DIM_BUCKETS}")
        if self.block_m % 16 or not 1 <= self.block_m // 16 <= 16 or self.block_n % 16 or self.block_n <= 0:
            raise ValueError(f"AttentionFwdMma: tile ({self.block_m}, {self.block_n}) must be multiples of 16, <= 16 warps")

    @property
    def warps(self) -> int:
        return self.block_m // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

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
            ("CUFLASH_T", _variants.DTYPES[self.dtype][0]),
            ("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
            ("CUFLASH_HEAD_DIM_MAX", str(self.head_dim_max)),
            ("CUFLASH_BLOCK_M", str(self.block_m)),
            ("CUFLASH_BLOCK_N", str(self.block_n)),
            ("CUFLASH_THREADS", str(self.threads)),
            ("CUFLASH_Q_IN_REGS", "1" if self.q_in_regs else "0"),
            ("CUFLASH_SMEM_BYTES", str(self.smem_bytes)),
        )

    def describe(self) -> str:
        return (f"{self.entry}: {self.warps} warps, Br={self.block_m} x Bc={self.block_n} tiles, head-dim bucket "
                f"{self.head_dim_max}, {self.smem_bytes} B shared memory (Q + 2-stage K/V, cp.async), "
                f"mma.sync m16n8k16 {self.dtype}, Q in {'registers' if self.q_in_regs else 'shared memory'}")


def head_dim_bucket(head_dim: int, head_dim_v: int) -> int:
    """Smallest bucket holding both head dims."""
    need = max(head_dim, head_dim_v)
    for b in HEAD_DIM_BUCKETS:
        if need <= b:
            return b
    raise NotImplementedError(f"cuflash: head dim {need} exceeds the largest tensor-core bucket {HEAD_DIM_BUCKETS[-1]}")


def smem_limit(arch: int) -> int:
    return _attention_simt.smem_limit(arch)


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionFwdMma:
    """The preferred tile of the bucket that fits ``sm_<arch>``'s shared memory."""
    key = _variants.dtype_key(dtype)
    if key not in MMA_DTYPES:
        raise NotImplementedError(f"cuflash: the tensor-core kernel computes float16 and bfloat16, not {np.dtype(dtype)}")
    bucket = head_dim_bucket(head_dim, head_dim_v)
    for warps, bn in TILE_CANDIDATES[bucket]:
        v = AttentionFwdMma(key, bucket, 16 * warps, bn)
        if v.smem_bytes <= smem_limit(arch):
            return v
    raise NotImplementedError(f"cuflash: no tensor-core attention tile fits sm_{arch}'s shared memory for head dim {bucket}")


def all_variants(arch: int) -> tuple[AttentionFwdMma, ...]:
    """Every variant the dispatcher can choose on ``sm_<arch>`` (for the compile gate)."""
    if arch < MIN_ARCH:
        return ()
    out = []
    for key in MMA_DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            out.append(choose_variant(_variants.DTYPES[key][1], bucket, bucket, arch))
    return tuple(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
# eligibility


def _address(x) -> int | None:
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    data = getattr(x, "data", None)
    ptr = getattr(data, "ptr", None)
    return None if ptr is None else int(ptr)


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why ``problem`` cannot run on this kernel on ``sm_<arch>`` (None if it can).

    ``arrays`` is ``(q, k, v)`` or ``(q, k, v, out)`` (``out`` may be None); without it only the
    shape-level conditions are checked.
    """
    p = problem
    if arch < MIN_ARCH:
        return f"sm_{arch} has no m16n8k16 bf16 mma / cp.async (needs sm_{MIN_ARCH}+)"
    try:
        key = _variants.dtype_key(p.dtype)
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
        addr = _address(a)
        if addr is None or addr % ALIGN_BYTES:
            return f"{name} starts at an address that is not {ALIGN_BYTES}-byte aligned (a view at an odd offset)"
    return None


# --------------------------------------------------------------------------------------------
# planning


def plan_attention(problem, q, k, v, out, lse, arch: int) -> list[_plan.LaunchPlan]:
    """Launch plans computing ``problem`` into ``out`` and ``lse``: the kernel takes the SIMT
    kernel's argument list, so the SIMT planner's :func:`~cuflash._attention_simt.plan_forward`
    plans it with this tier's variant."""
    variant = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    return _attention_simt.plan_forward(problem, q, k, v, out, lse, variant)


def _aligned_empty(xp, shape, dtype):
    """``xp.empty`` at a 16-byte-aligned address (CuPy's allocations always are; NumPy's are on
    the usual 64-bit allocators, and otherwise a slice of a slightly larger buffer is used)."""
    a = xp.empty(shape, dtype=dtype)
    if xp is not np or a.size == 0 or _address(a) % ALIGN_BYTES == 0:
        return a
    item = np.dtype(dtype).itemsize
    raw = np.empty(a.size + ALIGN_BYTES // item, dtype=dtype)
    skip = (-_address(raw) % ALIGN_BYTES) // item
    return raw[skip : skip + a.size].reshape(shape)


def forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Allocate what the caller did not pass, plan, and launch with ``launch(plan)``.

    ``xp`` is NumPy (the simulator; fresh outputs are NaN-poisoned so an element the kernel never
    writes shows) or CuPy (the GPU). Fresh outputs from either are 16-byte aligned.
    """
    if out is None:
        out = _aligned_empty(xp, problem.out_shape, problem.dtype)
        if xp is np:
            out.fill(np.nan)
    lse = xp.empty(problem.lse_shape, dtype=np.float32)
    if xp is np:
        lse.fill(np.nan)
    if not problem.is_empty:
        for plan in plan_attention(problem, q, k, v, out, lse, arch):
            launch(plan)
    return (out, lse) if return_lse else out
