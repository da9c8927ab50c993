"""FLOPs, HBM bytes, arithmetic intensity and roofline time of naive vs. fused attention.

The standard FLOP/byte analysis of naive and fused attention, as a library and a command
(``python -m cuflash intensity``): the IO analysis of FlashAttention (Dao et al.,
"FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", 2022, section 3.2,
and its Algorithms 0 and 3 for the standard attention's forward and backward) and the FLOP
conventions of FlashAttention-2 (Dao, 2023: the backward is counted as 2.5x the forward).

The model
---------
Everything is counted per call for ``B`` batches, ``H`` query heads and ``Hk`` key/value heads
(GQA/MQA: ``H % Hk == 0``; K, V, dK and dV bytes use ``Hk``), ``Sq`` queries, ``Sk`` keys, head
dim ``D`` for Q/K and ``Dv`` for V/O, ``e`` bytes per element.

*FLOPs* are the matrix-multiply FLOPs only (a multiply-add is 2 FLOPs). The softmax's
exponentials, maxima, sums and rescalings (O(Sq*Sk) per head, against O(Sq*Sk*D) for the
matmuls) are **not** counted: they are low-order terms. The fused kernel computes
only visible (query, key) pairs: ``2*B*H*(D + Dv)*P`` (DESIGN §6), where ``P`` is the exact number
of visible pairs (:func:`visible_pairs`); its backward is 2.5x that (the FA2 convention: S is
recomputed, then dV, dP, dS->dQ, dS->dK). Naive attention computes the dense matrices whatever
the mask, so its forward is ``2*B*H*Sq*Sk*(D + Dv)`` and its backward, which keeps P from the
forward and runs four matmuls (dV, dP, dQ, dK), ``4*B*H*Sq*Sk*(D + Dv)``.
:func:`flash_attn_flops` gives flash-attn's benchmark convention (``4*B*H*Sq*Sk*D``, halved for
causal; backward 2.5x) for comparing with published numbers.

*Bytes* are HBM (global memory) traffic; SRAM/register traffic is free. Naive forward
(FlashAttention Algorithm 0): read Q, K; write S; read S; write P; read P, V; write
O, so every (Sq x Sk) matrix is written once and read once (four Sq*Sk*e terms). Naive backward
(FlashAttention Algorithm 3, P kept from the forward): read P, dO, write dV; read dO, V, write dP;
read P, dP, write dS; read dS, K, write dQ; read dS, Q, write dK (seven Sq*Sk*e terms).
Fused forward: Q, K, V read once, O written once, LSE (float32; float64 for float64 input)
written once. For fp32 with ``B = H = 1``, ``D = Dv = d`` and ``Sq = Sk = N`` this is
``4*(4*N*d) + 4*N`` bytes against ``4*N**2*d`` FLOPs: intensity ``N*d/(4*d + 1)``, i.e. ``N/4``
once the LSE term is dropped (510 FLOP/byte at N = 2048, d = 64; 512 without the LSE).
Fused backward: reads Q, K, V, O, dO, LSE and writes dQ, dK, dV once each.

K/V re-reads. A fused forward runs one thread block per ``block_m``-row query tile and each of
them streams K and V. These re-reads hit L2 when K and V fit there (K and V of one head at
N = 2048 and fp32 are 1 MiB, against A100's 40 MB L2), so by default (``l2_reuse=True``) K and V
are counted once. With ``l2_reuse=False`` each query tile reads the K/V rows it can see (for a dense
mask: ``ceil(Sq/block_m)`` passes over K and V). The fused backward (FA2) runs one block per
``block_n``-row key tile; with ``l2_reuse=False`` each key tile re-reads the Q, dO and LSE rows
that see it and read-modify-writes a float32 dQ accumulator for those rows, then the accumulator
is read once and converted to dQ. Not counted anywhere: FA2's ``delta = rowsum(dO * O)``
preprocessing (it reads O and dO, which are counted once) and rounding of tiles to whole blocks.

Rows and keys that see nothing are not read (a causal mask with ``Sq > Sk`` leaves
``Sq - Sk`` query rows empty; a left window with ``Sk > Sq`` leaves early keys unseen), but every
output row is written (O = 0, LSE = -inf; dK = dV = 0). The naive path reads and writes everything.

Masks follow cuflash (DESIGN §3): bottom-right causal alignment, query ``i`` sees key ``j`` iff
``j <= i + Sk - Sq``; ``window_size=(left, right)`` with -1 unbounded keeps keys with
``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal=True`` sets ``right = 0``.

Roofline time on a device is ``max(FLOPs / peak, bytes / bandwidth)``
(:func:`roofline`); the device presets (:data:`DEVICES`) quote NVIDIA's datasheets.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from cuflash.analysis import cli

__all__ = [
    "A100",
    "Cost",
    "DEVICES",
    "Device",
    "H100",
    "H200",
    "Roofline",
    "T4",
    "V100",
    "attention_flops",
    "element_bytes",
    "flash_attn_flops",
    "fused_attention_cost",
    "main",
    "naive_attention_cost",
    "roofline",
    "visible_pairs",
]

_WHO = "cuflash.intensity"

# Canonical dtype names and bytes per element; the other spellings are the commands' shared ones
# (cli.DTYPE_ALIASES).
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


# --------------------------------------------------------------------------------------------
# devices
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """Peak throughputs of a GPU, dense (no structured sparsity), from its datasheet.

    Attributes
    ----------
    name : str
        Marketing name, e.g. ``"H100 SXM"``.
    fp16_tensor_tflops : float
        Dense FP16/BF16 tensor-core peak, TFLOP/s (1 TFLOP/s = 1e12 FLOP/s).
    tf32_tensor_tflops : float
        Dense TF32 tensor-core peak, TFLOP/s.
    fp32_tflops : float
        FP32 peak on the CUDA cores (no tensor cores), TFLOP/s.
    fp64_tflops : float
        FP64 peak on the CUDA cores, TFLOP/s.
    hbm_gb_per_s : float
        HBM bandwidth, GB/s (1 GB = 1e9 bytes).
    memory_gb : float
        HBM capacity, GB.
    l2_mb : float
        L2 cache size, MB (what the K/V of one head are compared against).
    source : str
        Where the numbers come from.
    """

    name: str
    fp16_tensor_tflops: float
    tf32_tensor_tflops: float
    fp32_tflops: float
    fp64_tflops: float
    hbm_gb_per_s: float
    memory_gb: float
    l2_mb: float
    source: str

    def peak_tflops(self, dtype="float32", *, tf32: bool = False) -> float:
        """Peak compute for a dtype, TFLOP/s.

        Parameters
        ----------
        dtype : str or int
            ``"float16"``/``"bfloat16"`` (or 2 bytes): the FP16/BF16 tensor-core peak;
            ``"float32"`` (or 4): the FP32 CUDA-core peak, or the TF32 tensor-core peak with
            ``tf32=True``; ``"float64"`` (or 8): the FP64 CUDA-core peak.
        tf32 : bool
            Use the TF32 tensor-core peak for float32.

        Returns
        -------
        float
            TFLOP/s.

        Raises
        ------
        ValueError
            For an element size with no peak here (e.g. 1 byte), or ``tf32`` on a device without
            TF32 tensor cores (T4, V100).
        """
        nbytes = element_bytes(dtype)
        if nbytes == 2:
            return self.fp16_tensor_tflops
        if nbytes == 4:
            if tf32 and not self.tf32_tensor_tflops:
                raise ValueError(f"{_WHO}: the {self.name} has no TF32 tensor cores (they start with sm_80); "
                                 "drop tf32")
            return self.tf32_tensor_tflops if tf32 else self.fp32_tflops
        if nbytes == 8:
            return self.fp64_tflops
        raise ValueError(f"{_WHO}: no peak FLOP rate for {nbytes}-byte elements on {self.name}; "
                         "expected 2 (fp16/bf16), 4 (fp32/tf32) or 8 (fp64)")

    def ridge_point(self, dtype="float32", *, tf32: bool = False) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound.

        ``peak_tflops * 1e12 / (hbm_gb_per_s * 1e9)``.
        """
        return self.peak_tflops(dtype, tf32=tf32) * 1e12 / (self.hbm_gb_per_s * 1e9)


#: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column; sparsity figures halved):
#: FP64 9.7, TF32 156, BF16/FP16 312 TFLOP/s dense, FP32 19.5 TFLOP/s, 2,039 GB/s, 80 GB;
#: L2 40 MB from the NVIDIA Ampere (GA100) architecture whitepaper.
A100 = Device(
    name="A100 SXM 80GB", fp16_tensor_tflops=312.0, tf32_tensor_tflops=156.0, fp32_tflops=19.5,
    fp64_tflops=9.7, hbm_gb_per_s=2039.0, memory_gb=80.0, l2_mb=40.0,
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); L2 from the NVIDIA A100 "
           "(Ampere) architecture whitepaper",
)

#: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; its tensor figures are "with
#: sparsity", halved here): FP64 34, TF32 494.7, BF16/FP16 989.4 TFLOP/s dense, FP32 67 TFLOP/s,
#: 3.35 TB/s, 80 GB; L2 50 MB from the NVIDIA H100 (Hopper) architecture whitepaper.
H100 = Device(
    name="H100 SXM", fp16_tensor_tflops=989.4, tf32_tensor_tflops=494.7, fp32_tflops=67.0,
    fp64_tflops=34.0, hbm_gb_per_s=3350.0, memory_gb=80.0, l2_mb=50.0,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM, dense = half the sparsity figures); "
           "L2 from the NVIDIA H100 (Hopper) architecture whitepaper",
)

#: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): the same compute as H100 SXM,
#: 4.8 TB/s HBM3e, 141 GB; L2 50 MB (the same GH100 die).
H200 = Device(
    name="H200 SXM", fp16_tensor_tflops=989.4, tf32_tensor_tflops=494.7, fp32_tflops=67.0,
    fp64_tflops=34.0, hbm_gb_per_s=4800.0, memory_gb=141.0, l2_mb=50.0,
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM, dense = half the sparsity figures)",
)

#: NVIDIA T4 Tensor Core GPU datasheet: 65 TFLOP/s mixed-precision FP16 tensor, 8.1 TFLOP/s
#: FP32, 320 GB/s GDDR6, 16 GB (no TF32 or BF16 tensor cores: Turing, sm_75); FP64 at 1/32 of
#: FP32 and the 4 MB L2 from the NVIDIA Turing architecture whitepaper (TU104).
T4 = Device(
    name="T4", fp16_tensor_tflops=65.0, tf32_tensor_tflops=0.0, fp32_tflops=8.1,
    fp64_tflops=8.1 / 32, hbm_gb_per_s=320.0, memory_gb=16.0, l2_mb=4.0,
    source="NVIDIA T4 Tensor Core GPU datasheet (FP16 tensor 65 TFLOP/s, FP32 8.1, 320 GB/s GDDR6); FP64 "
           "rate and L2 from the NVIDIA Turing architecture whitepaper",
)

#: NVIDIA V100 Tensor Core GPU datasheet (V100 SXM2 column): 125 TFLOP/s FP16 tensor, 15.7
#: TFLOP/s FP32, 7.8 TFLOP/s FP64, 900 GB/s HBM2, 32 GB (Volta, sm_70: no TF32 or BF16 tensor
#: cores); L2 6 MB from the NVIDIA Tesla V100 (Volta) architecture whitepaper.
V100 = Device(
    name="V100 SXM2", fp16_tensor_tflops=125.0, tf32_tensor_tflops=0.0, fp32_tflops=15.7,
    fp64_tflops=7.8, hbm_gb_per_s=900.0, memory_gb=32.0, l2_mb=6.0,
    source="NVIDIA V100 Tensor Core GPU datasheet (SXM2); L2 from the NVIDIA Tesla V100 (Volta) "
           "architecture whitepaper",
)

#: Presets by CLI name.
DEVICES = {"a100": A100, "h100": H100, "h200": H200, "t4": T4, "v100": V100}


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def _int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{_WHO}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = value.__index__()
    if value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{_WHO}: {name} must be {what}, got {value}")
    return value


def element_bytes(dtype) -> int:
    """Bytes per element of a dtype.

    Parameters
    ----------
    dtype : str, int or NumPy dtype
        ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"`` or another spelling of one
        of them (:data:`cuflash.analysis.cli.DTYPE_ALIASES`: ``fp16``, ``half``, ``bf16``,
        ``fp32``, ``float``, ``fp64``, ``double``, ...; case-insensitive), a NumPy dtype or
        scalar type of one of these, or a positive int taken as the size in bytes.

    Returns
    -------
    int
        Bytes per element.

    Raises
    ------
    TypeError
        For anything else than a str, int or NumPy dtype.
    ValueError
        For an unknown name or a non-positive size.
    """
    if isinstance(dtype, bool):
        raise TypeError(f"{_WHO}: dtype must be a dtype name or a size in bytes, got bool "
                        f"{dtype!r}")
    if isinstance(dtype, int) or (hasattr(dtype, "__index__") and not isinstance(dtype, str)
                                  and not isinstance(dtype, type)):
        return _int("dtype (bytes per element)", dtype)
    if not isinstance(dtype, str):
        try:
            import numpy as np
            dtype = np.dtype(dtype).name
        except (ImportError, TypeError) as exc:
            raise TypeError(f"{_WHO}: dtype must be a dtype name or a size in bytes, got "
                            f"{type(dtype).__name__} {dtype!r}") from exc
    name = cli.canonical_dtype(dtype)
    if name not in _DTYPE_BYTES:
        raise ValueError(f"{_WHO}: dtype must be one of {sorted(_DTYPE_BYTES)} or a size in "
                         f"bytes, got {dtype!r}")
    return _DTYPE_BYTES[name]


def _dtype_label(dtype) -> str:
    if isinstance(dtype, str):
        return cli.canonical_dtype(dtype) or dtype.lower()
    if isinstance(dtype, int):
        return f"{dtype}-byte"
    try:
        import numpy as np
        return np.dtype(dtype).name
    except (ImportError, TypeError):
        return str(dtype)


def _window(window_size, causal) -> tuple[int, int]:
    """Validated (left, right), -1 = unbounded; causal forces right = 0."""
    if not isinstance(causal, bool):
        raise TypeError(f"{_WHO}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{_WHO}: window_size must be a pair (left, right) of ints >= -1, got "
                        f"{window_size!r}") from None
    left = _int("window_size[0]", left, minimum=-1)
    right = _int("window_size[1]", right, minimum=-1)
    if causal:
        right = 0
    return left, right


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    headdim_v: int
    nbytes: int
    dtype: str
    left: int
    right: int
    causal: bool


def _shape(seqlen_q, headdim, seqlen_k, headdim_v, batch, heads, heads_k, dtype, causal,
           window_size) -> _Shape:
    seqlen_q = _int("seqlen_q", seqlen_q)
    seqlen_k = seqlen_q if seqlen_k is None else _int("seqlen_k", seqlen_k)
    headdim = _int("headdim", headdim)
    headdim_v = headdim if headdim_v is None else _int("headdim_v", headdim_v)
    batch = _int("batch", batch)
    heads = _int("heads", heads)
    heads_k = heads if heads_k is None else _int("heads_k", heads_k)
    if heads % heads_k:
        raise ValueError(f"{_WHO}: heads={heads} must be a multiple of heads_k={heads_k} (GQA)")
    nbytes = element_bytes(dtype)
    left, right = _window(window_size, causal)
    return _Shape(batch, heads, heads_k, seqlen_q, seqlen_k, headdim, headdim_v, nbytes,
                  _dtype_label(dtype), left, right, causal)


# --------------------------------------------------------------------------------------------
# counting visible pairs and rows
# --------------------------------------------------------------------------------------------

def _pairs_up_to(sq: int, sk: int, x: int) -> int:
    """Number of (i, j), 0 <= i < sq, 0 <= j < sk, with j - i <= x (closed form).

    It is sum_{i<sq} clamp(i + x + 1, 0, sk) = G(x + sq) - G(x), where G(t) is the sum of
    clamp(s, 0, sk) over all integers s <= t.
    """
    def g(t: int) -> int:
        if t <= 0:
            return 0
        if t <= sk:
            return t * (t + 1) // 2
        return sk * (sk + 1) // 2 + (t - sk) * sk

    return g(x + sq) - g(x)


def visible_pairs(seqlen_q, seqlen_k=None, *, causal: bool = False,
                  window_size=(-1, -1)) -> int:
    """Exact number of visible (query, key) pairs of one head.

    Query ``i`` sees key ``j`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (each
    bound dropped when it is -1; ``causal=True`` sets ``right = 0``): bottom-right alignment as in
    flash-attn >= 2.1 and cuflash (DESIGN §3). Counted in closed form, O(1).

    Parameters
    ----------
    seqlen_q : int
        Number of queries ``Sq`` (positive).
    seqlen_k : int, optional
        Number of keys ``Sk``; defaults to ``seqlen_q``.
    causal : bool
        Causal mask, bottom-right aligned.
    window_size : (int, int)
        ``(left, right)`` local window, -1 = unbounded.

    Returns
    -------
    int
        The pair count ``P`` (``Sq * Sk`` without a mask).

    Raises
    ------
    TypeError, ValueError
        For arguments of the wrong type or range; the message names the argument.
    """
    sq = _int("seqlen_q", seqlen_q)
    sk = sq if seqlen_k is None else _int("seqlen_k", seqlen_k)
    left, right = _window(window_size, causal)
    return _pairs(sq, sk, left, right)


def _pairs(sq: int, sk: int, left: int, right: int) -> int:
    off = sk - sq
    upper = sq * sk if right < 0 else _pairs_up_to(sq, sk, off + right)
    lower = 0 if left < 0 else _pairs_up_to(sq, sk, off - left - 1)
    return upper - lower


def _row_span(n_rows: int, n_cols: int, off: int, left: int, right: int):
    """Rows that see at least one column, and the column range they see.

    Row ``r`` sees columns ``[r + off - left, r + off + right]`` clipped to ``[0, n_cols)``.
    Returns ``(r0, r1)`` (inclusive; ``r0 > r1`` when empty) and the functions lo(r), hi(r).
    """
    def lo(r):
        return 0 if left < 0 else max(0, r + off - left)

    def hi(r):
        return n_cols - 1 if right < 0 else min(n_cols - 1, r + off + right)

    r0 = 0 if right < 0 else max(0, -off - right)
    r1 = n_rows - 1 if left < 0 else min(n_rows - 1, n_cols - 1 - off + left)
    return r0, r1, lo, hi


def _rows_seen(n_rows, n_cols, off, left, right) -> tuple[int, int]:
    """(rows that see something, columns seen by some row)."""
    r0, r1, lo, hi = _row_span(n_rows, n_cols, off, left, right)
    if r0 > r1:
        return 0, 0
    return r1 - r0 + 1, hi(r1) - lo(r0) + 1


def _tile_reads(n_rows, n_cols, off, left, right, block) -> int:
    """Sum over ``block``-row tiles of the number of columns the tile's rows see.

    The rows seeing something form one range and, per row, lo and hi are non-decreasing with
    contiguous unions, so a tile ``[a, b]`` sees ``[lo(a'), hi(b')]`` with ``[a', b']`` its part
    of that range.
    """
    r0, r1, lo, hi = _row_span(n_rows, n_cols, off, left, right)
    if r0 > r1:
        return 0
    total = 0
    for t in range(r0 // block, r1 // block + 1):
        a = max(r0, t * block)
        b = min(r1, t * block + block - 1)
        total += hi(b) - lo(a) + 1
    return total


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------

def attention_flops(seqlen_q, headdim, *, seqlen_k=None, headdim_v=None, batch=1, heads=1,
                    causal=False, window_size=(-1, -1), backward=False) -> int:
    """Matmul FLOPs of exact attention over the visible pairs (DESIGN §6).

    Forward: ``2 * B * H * (D + Dv) * P`` (S = QK^T and O = PV over the ``P`` visible pairs,
    :func:`visible_pairs`). Backward: 2.5x the forward (the FlashAttention-2 convention;
    ``5 * B * H * (D + Dv) * P``). Softmax FLOPs are not counted (see the module docstring).

    Parameters
    ----------
    seqlen_q, headdim : int
        ``Sq`` and the Q/K head dim ``D``.
    seqlen_k, headdim_v : int, optional
        ``Sk`` (default ``Sq``) and the V head dim ``Dv`` (default ``D``).
    batch, heads : int
        ``B`` and the number of query heads ``H``.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : (int, int)
        ``(left, right)``, -1 unbounded.
    backward : bool
        Count the backward pass instead of the forward.

    Returns
    -------
    int
        FLOPs.
    """
    s = _shape(seqlen_q, headdim, seqlen_k, headdim_v, batch, heads, None, 4, causal,
               window_size)
    fwd = 2 * s.batch * s.heads * (s.headdim + s.headdim_v) * _pairs(s.seqlen_q, s.seqlen_k,
                                                                     s.left, s.right)
    return fwd * 5 // 2 if backward else fwd


def flash_attn_flops(seqlen_q, headdim, *, seqlen_k=None, batch=1, heads=1, causal=False,
                     backward=False) -> int:
    """flash-attn's benchmark FLOP convention, for comparing with published numbers.

    ``4 * B * H * Sq * Sk * D`` for the forward, halved for causal (whatever ``Sq`` and ``Sk``);
    2.5x that for the backward. This is the formula of flash-attn's ``benchmarks/`` scripts; it
    uses ``D`` for both matmuls and ignores windows.

    Parameters
    ----------
    seqlen_q, headdim : int
        ``Sq`` and ``D``.
    seqlen_k : int, optional
        ``Sk``, default ``Sq``.
    batch, heads : int
        ``B`` and ``H``.
    causal : bool
        Halve the count.
    backward : bool
        Multiply by 2.5.

    Returns
    -------
    int
        FLOPs.
    """
    s = _shape(seqlen_q, headdim, seqlen_k, None, batch, heads, None, 4, causal, (-1, -1))
    flops = 4 * s.batch * s.heads * s.seqlen_q * s.seqlen_k * s.headdim
    if causal:
        flops //= 2
    return flops * 5 // 2 if backward else flops


# --------------------------------------------------------------------------------------------
# costs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Roofline:
    """Roofline estimate of one kernel on one device.

    Attributes
    ----------
    device : Device
        The device.
    flops : int
        FLOPs.
    bytes : int
        HBM bytes.
    peak_tflops : float
        Compute peak used, TFLOP/s.
    compute_s : float
        ``flops / (peak_tflops * 1e12)``, seconds.
    memory_s : float
        ``bytes / (hbm_gb_per_s * 1e9)``, seconds.
    time_s : float
        ``max(compute_s, memory_s)``, seconds: a lower bound on the run time.
    bound : str
        ``"compute"`` or ``"memory"``, whichever term is larger (``"compute"`` on a tie).
    ridge_point : float
        The device's FLOP/byte ridge for this peak.
    """

    device: Device
    flops: int
    bytes: int
    peak_tflops: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: str
    ridge_point: float

    @property
    def tflops_at_bound(self) -> float:
        """Attainable throughput, TFLOP/s: ``flops / time_s / 1e12``."""
        return self.flops / self.time_s / 1e12 if self.time_s else 0.0


@dataclass(frozen=True)
class Cost:
    """FLOPs and HBM bytes of one attention pass.

    Attributes
    ----------
    algorithm : str
        ``"naive"`` or ``"fused"``.
    pass_ : str
        ``"forward"`` or ``"backward"``.
    flops : int
        FLOPs (matmuls only; see the module docstring).
    bytes : int
        HBM bytes read plus written.
    traffic : tuple of (str, int)
        The terms that make up ``bytes``, e.g. ``("S write", n)``, in bytes.
    dtype : str
        Element type name (or ``"N-byte"`` when given as a size).
    element_bytes : int
        Bytes per element of Q, K, V, O and their gradients.
    """

    algorithm: str
    pass_: str
    flops: int
    bytes: int
    traffic: tuple
    dtype: str
    element_bytes: int

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP/byte."""
        return self.flops / self.bytes

    def roofline(self, device: Device | str, *, tf32: bool = False) -> Roofline:
        """Roofline time on ``device`` with this cost's dtype; see :func:`roofline`."""
        return roofline(self.flops, self.bytes, device,
                        dtype=self.element_bytes if self.dtype.endswith("-byte") else self.dtype,
                        tf32=tf32)


def _cost(algorithm, pass_, flops, terms, s: _Shape) -> Cost:
    terms = tuple((name, int(n)) for name, n in terms)
    return Cost(algorithm, pass_, int(flops), sum(n for _, n in terms), terms, s.dtype, s.nbytes)


def naive_attention_cost(seqlen_q, headdim, *, seqlen_k=None, headdim_v=None, batch=1, heads=1,
                         heads_k=None, dtype="float32", causal=False, window_size=(-1, -1),
                         backward=False) -> Cost:
    """FLOPs and minimum HBM bytes of naive (materialised S and P) attention.

    Forward (FlashAttention paper, Algorithm 0): ``S = QK^T`` written to HBM,
    read back, ``P = softmax(S)`` written, read back for ``O = PV``. Bytes, with ``e`` bytes per
    element::

        Q, K read      e*B*(H*Sq*D + Hk*Sk*D)
        S write, read  2 * e*B*H*Sq*Sk
        P write, read  2 * e*B*H*Sq*Sk
        V read         e*B*Hk*Sk*Dv
        O write        e*B*H*Sq*Dv

    FLOPs ``2*B*H*Sq*Sk*(D + Dv)``: the dense matmuls, whatever the mask, since the naive
    version masks S in place and multiplies full matrices. For fp32, ``B = H = 1``, ``D = Dv = d``,
    ``Sq = Sk = N`` the intensity is ``N*d / (4*(N + d))`` (15.5 FLOP/byte at N = 2048,
    d = 64).

    Backward (FlashAttention paper Algorithm 3, P kept from the forward): read P, dO, write dV;
    read dO, V, write dP; read P, dP, write dS; read dS, K, write dQ; read dS, Q, write dK.
    That is seven ``e*B*H*Sq*Sk`` terms for P/dP/dS. FLOPs ``4*B*H*Sq*Sk*(D + Dv)`` (four dense
    matmuls; no recomputation of S, unlike the fused 2.5x). With GQA, dK and dV are written per
    KV head (``Hk``; the reduction over the group is not counted).

    Parameters
    ----------
    seqlen_q, headdim : int
        ``Sq`` and the Q/K head dim ``D``.
    seqlen_k, headdim_v : int, optional
        ``Sk`` (default ``Sq``) and ``Dv`` (default ``D``).
    batch, heads, heads_k : int
        ``B``, query heads ``H``, KV heads ``Hk`` (default ``H``; ``H % Hk == 0``).
    dtype : str or int
        Element type of Q, K, V, O, S, P and gradients (see :func:`element_bytes`).
    causal : bool
        Bottom-right causal mask (changes nothing for the naive version).
    window_size : (int, int)
        Local window, validated only (the naive version is dense).
    backward : bool
        The backward pass instead of the forward.

    Returns
    -------
    Cost
        With ``algorithm="naive"``.

    Raises
    ------
    TypeError, ValueError
        For invalid arguments; the message names the argument, the expectation and the value.
    """
    s = _shape(seqlen_q, headdim, seqlen_k, headdim_v, batch, heads, heads_k, dtype, causal,
               window_size)
    e, b, h, hk = s.nbytes, s.batch, s.heads, s.heads_k
    sq, sk, d, dv = s.seqlen_q, s.seqlen_k, s.headdim, s.headdim_v
    mat = e * b * h * sq * sk
    q, o = e * b * h * sq * d, e * b * h * sq * dv
    k, v = e * b * hk * sk * d, e * b * hk * sk * dv
    if not backward:
        flops = 2 * b * h * sq * sk * (d + dv)
        terms = [("Q read", q), ("K read", k), ("S write", mat), ("S read", mat),
                 ("P write", mat), ("P read", mat), ("V read", v), ("O write", o)]
        return _cost("naive", "forward", flops, terms, s)
    flops = 4 * b * h * sq * sk * (d + dv)
    terms = [("P read", 2 * mat), ("dO read", 2 * o), ("dV write", v), ("V read", v),
             ("dP write", mat), ("dP read", mat), ("dS write", mat), ("dS read", 2 * mat),
             ("K read", k), ("dQ write", q), ("Q read", q), ("dK write", k)]
    return _cost("naive", "backward", flops, terms, s)


def fused_attention_cost(seqlen_q, headdim, *, seqlen_k=None, headdim_v=None, batch=1, heads=1,
                         heads_k=None, dtype="float32", causal=False, window_size=(-1, -1),
                         backward=False, l2_reuse=True, block_m=128, block_n=128) -> Cost:
    """FLOPs and minimum HBM bytes of fused (FlashAttention) attention.

    Forward (FlashAttention paper, section 3.2): Q, K, V read once, O and LSE written
    once. ``Sq_seen`` and ``Sk_seen`` are the query rows that see at least one key and the keys
    that at least one query sees (``Sq`` and ``Sk`` without a window, and for causal with
    ``Sq <= Sk``)::

        Q read     e*B*H*Sq_seen*D
        K, V read  e*B*Hk*Sk_seen*(D + Dv)      (l2_reuse=True)
        O write    e*B*H*Sq*Dv
        LSE write  l*B*H*Sq                     (l = 4, or 8 for float64)

    For fp32, ``B = H = 1``, ``D = Dv = d``, ``Sq = Sk = N``: ``16*N*d + 4*N`` bytes and
    ``4*N**2*d`` FLOPs, intensity ``N*d/(4*d + 1)`` ~ ``N/4`` (510 at N = 2048,
    d = 64, 512 without the LSE term). With ``l2_reuse=False``, K and V are read once per
    ``block_m``-row query tile, each tile reading the key rows it sees (``ceil(Sq/block_m)``
    passes for a dense mask).

    Backward (FA2): reads Q, K, V, O, dO, LSE and writes dQ, dK, dV, once each (``dK``/``dV``
    for all ``Sk`` keys, per KV head). With ``l2_reuse=False``, each ``block_n``-row key tile
    re-reads the Q, dO and LSE rows that see it and reads and writes those rows of a float32
    dQ accumulator (``2*4*D`` bytes per row), which is then read once more and converted to dQ.
    FLOPs: 2.5x the forward (:func:`attention_flops`).

    Parameters
    ----------
    seqlen_q, headdim : int
        ``Sq`` and the Q/K head dim ``D``.
    seqlen_k, headdim_v : int, optional
        ``Sk`` (default ``Sq``) and ``Dv`` (default ``D``).
    batch, heads, heads_k : int
        ``B``, query heads ``H``, KV heads ``Hk`` (default ``H``; ``H % Hk == 0``).
    dtype : str or int
        Element type of Q, K, V, O and gradients (see :func:`element_bytes`).
    causal : bool
        Bottom-right causal mask.
    window_size : (int, int)
        ``(left, right)`` local window, -1 unbounded.
    backward : bool
        The backward pass instead of the forward.
    l2_reuse : bool
        True (K/V, or Q/dO/LSE, fit in L2): re-reads of K/V (forward) or Q/dO/LSE/dQ (backward) by
        other tiles hit L2 and cost no HBM traffic. False: count them.
    block_m : int
        Query-tile rows of the forward (``Br``), used when ``l2_reuse=False``.
    block_n : int
        Key-tile rows of the backward (``Bc``), used when ``l2_reuse=False``.

    Returns
    -------
    Cost
        With ``algorithm="fused"``.

    Raises
    ------
    TypeError, ValueError
        For invalid arguments; the message names the argument, the expectation and the value.
    """
    s = _shape(seqlen_q, headdim, seqlen_k, headdim_v, batch, heads, heads_k, dtype, causal,
               window_size)
    if not isinstance(l2_reuse, bool):
        raise TypeError(f"{_WHO}: l2_reuse must be a bool, got {type(l2_reuse).__name__} "
                        f"{l2_reuse!r}")
    block_m = _int("block_m", block_m)
    block_n = _int("block_n", block_n)
    e, b, h, hk = s.nbytes, s.batch, s.heads, s.heads_k
    sq, sk, d, dv = s.seqlen_q, s.seqlen_k, s.headdim, s.headdim_v
    lse = 8 if e == 8 else 4
    off = sk - s.seqlen_q
    q_seen, k_seen = _rows_seen(sq, sk, off, s.left, s.right)
    fwd = 2 * b * h * (d + dv) * _pairs(sq, sk, s.left, s.right)
    if not backward:
        kv_rows = k_seen if l2_reuse else _tile_reads(sq, sk, off, s.left, s.right, block_m)
        terms = [("Q read", e * b * h * q_seen * d), ("K read", e * b * hk * kv_rows * d),
                 ("V read", e * b * hk * kv_rows * dv), ("O write", e * b * h * sq * dv),
                 ("LSE write", lse * b * h * sq)]
        return _cost("fused", "forward", fwd, terms, s)
    # The backward's key tiles: key j is seen by queries [j - off - right, j - off + left].
    q_rows = q_seen if l2_reuse else _tile_reads(sk, sq, -off, s.right, s.left, block_n)
    terms = [("Q read", e * b * h * q_rows * d), ("K read", e * b * hk * k_seen * d),
             ("V read", e * b * hk * k_seen * dv), ("O read", e * b * h * q_seen * dv),
             ("dO read", e * b * h * q_rows * dv), ("LSE read", lse * b * h * q_rows)]
    if not l2_reuse:
        terms += [("dQacc read+write", 2 * 4 * b * h * q_rows * d),
                  ("dQacc read", 4 * b * h * sq * d)]
    terms += [("dQ write", e * b * h * sq * d), ("dK write", e * b * hk * sk * d),
              ("dV write", e * b * hk * sk * dv)]
    return _cost("fused", "backward", fwd * 5 // 2, terms, s)


def roofline(flops, nbytes, device: Device | str, *, dtype="float32",
             tf32: bool = False) -> Roofline:
    """Roofline time: ``max(flops / peak, bytes / bandwidth)``.

    Parameters
    ----------
    flops : int
        FLOPs (non-negative).
    nbytes : int
        HBM bytes (non-negative).
    device : Device or str
        A :class:`Device` or a preset name (``"a100"``, ``"h100"``, ``"h200"``).
    dtype : str or int
        Picks the peak (:meth:`Device.peak_tflops`).
    tf32 : bool
        For float32, use the TF32 tensor-core peak.

    Returns
    -------
    Roofline
        Times in seconds and the dominating bound.

    Raises
    ------
    TypeError, ValueError
        For an unknown device name, negative counts or a dtype without a peak.
    """
    if isinstance(device, str):
        if device.lower() not in DEVICES:
            raise ValueError(f"{_WHO}: device must be one of {sorted(DEVICES)}, got {device!r}")
        device = DEVICES[device.lower()]
    elif not isinstance(device, Device):
        raise TypeError(f"{_WHO}: device must be a Device or one of {sorted(DEVICES)}, got "
                        f"{type(device).__name__}")
    flops = _int("flops", flops, minimum=0)
    nbytes = _int("nbytes", nbytes, minimum=0)
    peak = device.peak_tflops(dtype, tf32=tf32)
    compute_s = flops / (peak * 1e12)
    memory_s = nbytes / (device.hbm_gb_per_s * 1e9)
    bound = "compute" if compute_s >= memory_s else "memory"
    return Roofline(device, flops, nbytes, peak, compute_s, memory_s, max(compute_s, memory_s),
                    bound, device.ridge_point(dtype, tf32=tf32))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _time(seconds: float) -> str:
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


#: the model's argument names and the command-line options that set them
_CLI_NAMES = {"seqlen_q": "--seqlen", "seqlen_k": "--seqlen-k", "headdim_v": "--head-dim-v",
              "headdim": "--head-dim", "heads_k": "--heads-k", "heads": "--heads", "batch": "--batch",
              "block_m": "--block-m", "block_n": "--block-n", "window_size[0]": "--window LEFT",
              "window_size[1]": "--window RIGHT", "dtype": "--dtype"}

PROG = "python -m cuflash intensity"


def _cli_message(message: str) -> str:
    """A model error reworded for the command line: ``seqlen_q must ...`` -> ``--seqlen must ...``."""
    import re

    message = message.removeprefix(f"{_WHO}: ")
    pattern = "|".join(re.escape(n) for n in sorted(_CLI_NAMES, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({pattern})(?![\w\[])", lambda m: _CLI_NAMES[m.group(1)], message)


def _parser() -> argparse.ArgumentParser:
    positive = cli.int_at_least(1)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="FLOPs, HBM bytes, arithmetic intensity (FLOP/byte) and roofline time of "
                    "naive vs. fused (FlashAttention) attention: the standard FLOP/byte analysis "
                    "(FlashAttention, Dao et al. 2022, section 3.2).")
    p.add_argument("--seqlen", type=positive, default=2048, help="query length Sq (default 2048)")
    p.add_argument("--seqlen-k", type=positive, default=None, help="key length Sk (default Sq)")
    p.add_argument("--head-dim", type=positive, default=64, help="Q/K head dim D (default 64)")
    p.add_argument("--head-dim-v", type=positive, default=None, help="V head dim Dv (default D)")
    p.add_argument("--batch", type=positive, default=1, help="batch B (default 1)")
    p.add_argument("--heads", type=positive, default=1, help="query heads H (default 1)")
    p.add_argument("--heads-k", type=positive, default=None, help="KV heads Hk for GQA (default H)")
    p.add_argument("--dtype", type=cli.dtype_arg(), default="float32",
                   help=f"element type: {cli.dtype_help()} (default float32)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                   help="bottom-right aligned causal mask (default: none)")
    p.add_argument("--window", type=cli.int_at_least(-1), nargs=2, metavar=("LEFT", "RIGHT"),
                   default=(-1, -1), help="local window (left, right), -1 unbounded; with --causal "
                                          "RIGHT is 0 (or -1)")
    p.add_argument("--backward", action="store_true", help="also count the backward pass")
    p.add_argument("--device", choices=sorted(DEVICES), default=cli.DEFAULT_DEVICE,
                   help=f"roofline device preset (default {cli.DEFAULT_DEVICE})")
    p.add_argument("--tf32", action="store_true", help="float32 on TF32 tensor cores (--dtype float32 only)")
    p.add_argument("--no-l2", action="store_true",
                   help="count K/V re-reads per query tile instead of assuming L2 hits")
    p.add_argument("--block-m", type=positive, default=None,
                   help="query tile rows Br counted with --no-l2 (default 128)")
    p.add_argument("--block-n", type=positive, default=None,
                   help="key tile rows Bc of the backward counted with --no-l2 --backward (default 128)")
    p.add_argument("--json", metavar="FILE",
                   help="also write the counts as JSON to FILE ('-' for stdout, the text then goes to stderr)")
    return p


def _write_json(path: str, args, device: Device, rows, roofs, fa_flops: int) -> None:
    """The problem, the device and one record per (algorithm, pass) as JSON at ``path`` (``-``:
    stdout)."""
    import json

    problem = {k: v for k, v in vars(args).items() if k not in ("json", "device")}
    problem.update(window=list(args.window), block_m=128 if args.block_m is None else args.block_m,
                   block_n=128 if args.block_n is None else args.block_n)
    doc = dict(problem=problem, device=dict(name=device.name, preset=args.device, hbm_gb_per_s=device.hbm_gb_per_s),
               flash_attn_forward_flops=fa_flops, records=[
                   dict(algorithm=c.algorithm, **{"pass": c.pass_}, dtype=c.dtype, element_bytes=c.element_bytes,
                        flops=c.flops, bytes=c.bytes, intensity=c.intensity, traffic=[list(t) for t in c.traffic],
                        peak_tflops=r.peak_tflops, compute_s=r.compute_s, memory_s=r.memory_s, time_s=r.time_s,
                        bound=r.bound) for c, r in zip(rows, roofs)])
    text = json.dumps(doc, indent=1)
    if path == "-":
        print(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def _refuse_meaningless(parser: argparse.ArgumentParser, args) -> None:
    """parser.error for a combination of flags that means nothing."""
    if args.tf32 and args.dtype != "float32":
        parser.error(f"--tf32 applies to float32 only, got --dtype {args.dtype} (drop --tf32 or use "
                     "--dtype float32)")
    if args.block_m is not None and not args.no_l2:
        parser.error("--block-m counts K/V re-reads, which only --no-l2 counts; add --no-l2 or drop --block-m")
    if args.block_n is not None and not (args.no_l2 and args.backward):
        parser.error("--block-n counts the backward's Q/dO re-reads, which only --no-l2 --backward counts; "
                     "add them or drop --block-n")
    if args.causal and args.window[1] > 0:
        parser.error(f"--window RIGHT={args.window[1]} with --causal: the causal mask sets the right bound "
                     f"to 0; use --window {args.window[0]} 0 or drop --causal")


@cli.command(PROG, rewrite=_cli_message)
def main(argv: list[str] | None = None) -> int:
    """``python -m cuflash intensity``: print naive vs. fused FLOPs, bytes, intensity, roofline.

    Parameters
    ----------
    argv : list of str, optional
        Arguments after the command name (``sys.argv[1:]`` when None).

    Returns
    -------
    int
        0 on success, 2 for invalid arguments (``python -m cuflash intensity: error: ...`` on
        stderr; argparse's own errors raise ``SystemExit(2)``).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _refuse_meaningless(parser, args)
    block_m = 128 if args.block_m is None else args.block_m
    block_n = 128 if args.block_n is None else args.block_n
    kw = dict(seqlen_k=args.seqlen_k, headdim_v=args.head_dim_v, batch=args.batch,
              heads=args.heads, heads_k=args.heads_k, dtype=args.dtype, causal=args.causal,
              window_size=tuple(args.window))
    fused_kw = dict(l2_reuse=not args.no_l2, block_m=block_m, block_n=block_n)
    device = DEVICES[args.device]
    rows = [naive_attention_cost(args.seqlen, args.head_dim, **kw),
            fused_attention_cost(args.seqlen, args.head_dim, **kw, **fused_kw)]
    if args.backward:
        rows += [naive_attention_cost(args.seqlen, args.head_dim, backward=True, **kw),
                 fused_attention_cost(args.seqlen, args.head_dim, backward=True, **kw, **fused_kw)]
    fa_flops = flash_attn_flops(args.seqlen, args.head_dim, seqlen_k=args.seqlen_k,
                                batch=args.batch, heads=args.heads, causal=args.causal)
    roofs = [c.roofline(device, tf32=args.tf32) for c in rows]

    if args.json:   # before the text, which a reader of stdout may cut short (| head)
        _write_json(args.json, args, device, rows, roofs, fa_flops)
    out = sys.stderr if args.json == "-" else sys.stdout

    def say(*parts) -> None:
        print(*parts, file=out)

    c0 = rows[1]
    sq = args.seqlen
    sk = sq if args.seqlen_k is None else args.seqlen_k
    d = args.head_dim
    dv = d if args.head_dim_v is None else args.head_dim_v
    hk = args.heads if args.heads_k is None else args.heads_k
    mask = "causal" if args.causal else "no mask"
    if tuple(args.window) != (-1, -1):
        mask += f", window {tuple(args.window)}"
    peak_name = ("fp16/bf16 tensor" if c0.element_bytes == 2 else
                 "tf32 tensor" if args.tf32 and c0.element_bytes == 4 else
                 {4: "fp32", 8: "fp64"}.get(c0.element_bytes, "?"))
    say(f"attention B={args.batch} H={args.heads} Hk={hk} Sq={sq} Sk={sk} D={d} Dv={dv} "
          f"{c0.dtype} ({c0.element_bytes} B/elem), {mask}")
    tf32_note = (f" ({device.ridge_point(4, tf32=True):.0f} with --tf32)"
                 if c0.element_bytes == 4 and not args.tf32 else "")
    say(f"device {device.name}: {roofs[0].peak_tflops:g} TFLOP/s {peak_name}, "
          f"{device.hbm_gb_per_s:g} GB/s HBM, ridge point {roofs[0].ridge_point:.1f} FLOP/byte"
          + tf32_note)
    kv_mb = c0.element_bytes * sk * (d + dv) / 1e6
    say(f"K+V of one head: {kv_mb:.3g} MB vs. L2 {device.l2_mb:g} MB; fused K/V re-reads "
          + ("counted (--no-l2, Br=%d)" % block_m if args.no_l2 else "assumed L2 hits"))
    say()
    header = f"{'':<15}{'FLOPs':>11}{'HBM bytes':>12}{'FLOP/byte':>11}{'roofline':>11}  bound"
    say(header)
    say("-" * len(header))
    for cost, roof in zip(rows, roofs):
        label = f"{cost.algorithm} {'fwd' if cost.pass_ == 'forward' else 'bwd'}"
        say(f"{label:<15}{_si(cost.flops):>11}{_si(cost.bytes, 'B'):>12}"
              f"{cost.intensity:>11.1f}{_time(roof.time_s):>11}  {roof.bound}")
    say()
    say(f"flash-attn convention fwd FLOPs (4*B*H*Sq*Sk*D{', /2 causal' if args.causal else ''}):"
          f" {_si(fa_flops)}; naive/fused bytes: {rows[0].bytes / rows[1].bytes:.1f}x")
    say()
    e = c0.element_bytes
    # fused ~ N/e holds for the dense, MHA, D = Dv, L2-reuse case only
    dense_law = (not args.causal and tuple(args.window) == (-1, -1) and hk == args.heads
                 and d == dv and not args.no_l2)
    say("forward intensity (FLOP/byte) vs. N = Sq = Sk"
          + (f"; dense attention: fused ~ N/{e} for {e}-byte elements:" if dense_law else ":"))
    say(f"{'N':>8}{'naive':>9}{'fused':>9}" + (f"{'N/' + str(e):>9}" if dense_law else ""))
    for n in (512, 1024, 2048, 4096, 8192, 16384):
        skw = dict(kw, seqlen_k=None)
        nv = naive_attention_cost(n, d, **skw)
        fu = fused_attention_cost(n, d, **skw, **fused_kw)
        say(f"{n:>8}{nv.intensity:>9.1f}{fu.intensity:>9.1f}"
              + (f"{n / e:>9.0f}" if dense_law else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
