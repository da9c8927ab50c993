"""Host side of ``kernels_cu/hopper_probe.cu``: launch plans for the sm_90a probes and what they
must compute.

The probes use only the Hopper instructions of ``kernels_cu/ptx.cuh`` (wgmma, TMA, mbarriers,
named barriers, setmaxnreg, elect.sync, stmatrix), so the simulator's emulation of them
(``cuflash/sim/cusim_sm90.h``) and a GPU can be held to the same expectations: NumPy's matrix
products of small integers (exact in float32), and the fragment formulas of the PTX ISA. The
simulator's tests run them (tests/sim/test_sim_hopper.py); ``python -m cuflash check`` runs them on
a compute-capability-9.0 GPU.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.runtime import variants
from cuflash.runtime.plan import LaunchPlan, PointerArg, ScalarArg, TensorMapArg

#: N of every probe GEMM; K is a multiple of 64 up to MAX_K
BN = 64
MAX_K = 256
SWIZZLES = (0, 32, 64, 128)
#: (swizzle, N-major B, A from registers) of each gemm entry the probe file defines
GEMMS = tuple([(sw, nm, False) for nm in (False, True) for sw in SWIZZLES]
              + [(128, False, True), (128, True, True), (0, True, True)])
PIPELINE_BM = 128
PIPELINE_BK = 64


@dataclasses.dataclass(frozen=True)
class HopperProbeVariant(variants.Variant):
    """The probe module (one variant, several entries), compiled for ``sm_90a``."""

    family: ClassVar[str] = "hopper_probe"
    source: ClassVar[str] = "hopper_probe.cu"
    target_arch: ClassVar[str | None] = "90a"


VARIANT = HopperProbeVariant()


def gemm_entry(swizzle: int, nmajor: bool, a_regs: bool) -> str:
    """The entry of one GEMM probe (see :data:`GEMMS`)."""
    if (swizzle, nmajor, a_regs) not in GEMMS:
        raise ValueError(f"hopper_probe: no GEMM probe for swizzle={swizzle}, nmajor={nmajor}, a_regs={a_regs}; "
                         f"the probes are {GEMMS}")
    return f"hopper_gemm_{'rs' if a_regs else 'ss'}_{swizzle}_{'nmajor' if nmajor else 'kmajor'}"


def _panel(swizzle: int) -> int:
    return swizzle // 2 if swizzle else 8


def _check_gemm_shapes(a, b, c, nmajor: bool) -> tuple[int, int]:
    m, k = a.shape
    bf16 = ("bfloat16", "uint16")   # (uint16: bf16 bits, as CuPy arrays hold them)
    if a.dtype.name not in bf16 or b.dtype.name not in bf16 or c.dtype != np.float32:
        raise TypeError(f"hopper_probe: a and b must be bfloat16 (or its bits as uint16) and c float32, got {a.dtype}, "
                        f"{b.dtype}, {c.dtype}")
    if k % 64 or not 64 <= k <= MAX_K:
        raise ValueError(f"hopper_probe: K={k} must be a multiple of 64 in 64..{MAX_K}")
    want_b = (k, BN) if nmajor else (BN, k)
    if tuple(b.shape) != want_b or tuple(c.shape) != (m, BN):
        raise ValueError(f"hopper_probe: b must be {want_b} and c ({m}, {BN}); got b {tuple(b.shape)}, "
                         f"c {tuple(c.shape)}")
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not x.flags.c_contiguous:
            raise ValueError(f"hopper_probe: {name} must be C-contiguous")
    return m, k


def plan_gemm(a, b, c, *, swizzle: int, nmajor: bool, a_regs: bool = False) -> LaunchPlan:
    """C = A B^T (B stored N x K, K-major) or C = A B (B stored K x N, N-major), one block per 64
    rows of C.

    Parameters
    ----------
    a : array (M, K) bfloat16
    b : array (64, K) or (K, 64) bfloat16
    c : array (M, 64) float32, written
    swizzle : {0, 32, 64, 128}
        Shared-memory swizzle of the TMA boxes and the wgmma descriptors, bytes.
    nmajor : bool
        B's layout (``trans-b`` of wgmma).
    a_regs : bool
        A from registers (each thread loads its fragment) instead of a descriptor.

    Raises
    ------
    TypeError, ValueError
        For dtypes, shapes or a combination without a probe entry.
    """
    entry = gemm_entry(swizzle, nmajor, a_regs)
    m, k = _check_gemm_shapes(a, b, c, nmajor)
    w = _panel(swizzle)
    map_a = TensorMapArg.of("map_a", a, (64, w), swizzle=swizzle)
    map_b = TensorMapArg.of("map_b", b, (k, w) if nmajor else (BN, w), swizzle=swizzle)
    args = (map_a, map_b, PointerArg.of("A", a), PointerArg.of("C", c, writable=True), ScalarArg("M", np.int32(m)),
            ScalarArg("K", np.int32(k)))
    smem = 1024 + 64 * MAX_K * 2 + MAX_K * BN * 2
    return LaunchPlan(VARIANT, entry, (-(-m // 64), 1, 1), (128, 1, 1), smem, args)


def plan_gemm_e4m3(a, b, c, *, a_regs: bool = False) -> LaunchPlan:
    """C = A B^T with float8_e4m3fn A (M, K) and B (64, K) (both K-major, as fp8 wgmma requires),
    loaded by TMA in 16-byte boxes (no swizzle), wgmma m64n64k32 with A from a descriptor or
    (``a_regs``) from registers; one block per 64 rows of C (float32 (M, 64), written). K is a multiple of 32 up to :data:`MAX_K`; a and b may be
    ``ml_dtypes.float8_e4m3fn`` or their bytes as uint8."""
    m, k = a.shape
    if a.dtype.name not in ("float8_e4m3fn", "uint8") or b.dtype != a.dtype or c.dtype != np.float32:
        raise TypeError(f"hopper_probe: a and b must be float8_e4m3fn (or its bytes as uint8) and c float32, got "
                        f"{a.dtype}, {b.dtype}, {c.dtype}")
    if k % 32 or not 32 <= k <= MAX_K or tuple(b.shape) != (BN, k) or tuple(c.shape) != (m, BN):
        raise ValueError(f"hopper_probe: a (M, K) with K a multiple of 32 in 32..{MAX_K}, b ({BN}, K), c (M, {BN}); "
                         f"got {tuple(a.shape)}, {tuple(b.shape)}, {tuple(c.shape)}")
    a8, b8 = a.view(np.uint8), b.view(np.uint8)   # (TMA moves bytes: a uint8 tensor map)
    args = (TensorMapArg.of("map_a", a8, (64, 16)), TensorMapArg.of("map_b", b8, (BN, 16)), PointerArg.of("A", a8),
            PointerArg.of("C", c, writable=True), ScalarArg("M", np.int32(m)), ScalarArg("K", np.int32(k)))
    smem = 1024 + 64 * MAX_K + BN * MAX_K
    return LaunchPlan(VARIANT, f"hopper_gemm_e4m3_{'rs' if a_regs else 'ss'}", (-(-m // 64), 1, 1), (128, 1, 1), smem,
                      args)


def gemm_e4m3_inputs(m: int, k: int, seed: int = 0):
    """e4m3 operands whose products and sums are exact in float32, C filled with NaN, as ``(a, b,
    c, expected)`` (expected: NumPy's product): integers in [-16, 16] (all e4m3 values), and row 0
    of A holding e4m3's extremes, 448, -448 and the subnormals 2^-9 and -3 * 2^-9, then zeros
    (its sums need 23 bits)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    a32 = rng.integers(-16, 17, (m, k)).astype(np.float32)
    b32 = rng.integers(-16, 17, (BN, k)).astype(np.float32)
    a32[0] = 0
    a32[0, :4] = [448, -448, 2.0**-9, -3 * 2.0**-9]
    a, b = a32.astype(ml_dtypes.float8_e4m3fn), b32.astype(ml_dtypes.float8_e4m3fn)
    assert (a.astype(np.float32) == a32).all() and (b.astype(np.float32) == b32).all()
    expected = a32 @ b32.T
    return a, b, np.full((m, BN), np.nan, np.float32), expected


def plan_pipeline(a, b, c) -> LaunchPlan:
    """C = A B^T by the warp-specialized probe (B stored 64 x K), one block of three warpgroups per
    128 rows of C."""
    m, k = _check_gemm_shapes(a, b, c, False)
    map_a = TensorMapArg.of("map_a", a, (PIPELINE_BM, PIPELINE_BK), swizzle=128)
    map_b = TensorMapArg.of("map_b", b, (BN, PIPELINE_BK), swizzle=128)
    map_c = TensorMapArg.of("map_c", c, (PIPELINE_BM, BN), writable=True)
    smem = 1024 + 2 * PIPELINE_BM * PIPELINE_BK * 2 + 2 * BN * PIPELINE_BK * 2 + PIPELINE_BM * BN * 4
    return LaunchPlan(VARIANT, "hopper_pipeline", (-(-m // PIPELINE_BM), 1, 1), (384, 1, 1), smem,
                      (map_a, map_b, map_c, ScalarArg("K", np.int32(k))))


def plan_stmatrix(out) -> LaunchPlan:
    """``out`` (6, 16, 16) uint16: the six stmatrix forms' tiles (see :func:`expected_stmatrix`)."""
    if out.shape != (6, 16, 16) or out.dtype != np.uint16:
        raise ValueError(f"hopper_probe: out must be (6, 16, 16) uint16, got {out.shape} {out.dtype}")
    return LaunchPlan(VARIANT, "stmatrix_probe", 1, 32, 0, (PointerArg.of("out", out, writable=True),))


def plan_elect(leader, winners) -> LaunchPlan:
    """``leader`` (4,) int32: the elected lane of each of 4 warps; ``winners`` (128,) int32: per
    thread, how many lanes of its warp were elected."""
    return LaunchPlan(VARIANT, "elect_probe", 1, 128, 0,
                      (PointerArg.of("leader", leader, writable=True), PointerArg.of("winners", winners, writable=True)))


def expected_stmatrix() -> np.ndarray:
    """The tiles the stmatrix probe must leave (PTX ISA 9.7.14.5.16 "stmatrix"): lane 4g + t's
    register j, low half ``0x100 * (lane + 1) + j`` and high half that + 0x4000, holds row g,
    columns 2t..2t+1 of matrix j (the low half the lower column); ``.trans`` stores the transpose (rows 2t..2t+1 of column g). Matrix j sits
    at rows (j % 2) * 8, columns (j // 2) * 8; untouched elements stay 0."""
    out = np.zeros((6, 16, 16), np.uint16)
    for v, (x, trans) in enumerate([(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)]):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(x):
                lo = 0x100 * (lane + 1) + j  # the register's halves, as the probe writes them
                hi = lo + 0x4000
                r0, c0 = (j % 2) * 8, (j // 2) * 8
                if not trans:
                    out[v, r0 + g, c0 + 2 * t], out[v, r0 + g, c0 + 2 * t + 1] = lo, hi
                else:
                    out[v, r0 + 2 * t, c0 + g], out[v, r0 + 2 * t + 1, c0 + g] = lo, hi
    return out


def gemm_inputs(m: int, k: int, nmajor: bool, seed: int = 0):
    """Small-integer bf16 operands (their products and sums are exact in float32) and C filled
    with NaN, as ``(a, b, c, expected)``."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    a32 = rng.integers(-4, 5, (m, k)).astype(np.float32)
    b32 = rng.integers(-4, 5, (k, BN) if nmajor else (BN, k)).astype(np.float32)
    expected = a32 @ (b32 if nmajor else b32.T)
    c = np.full((m, BN), np.nan, np.float32)
    return a32.astype(ml_dtypes.bfloat16), b32.astype(ml_dtypes.bfloat16), c, expected
