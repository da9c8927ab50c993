"""A roofline read from the kernels' own SASS: ``python -m cuflash roofline`` and :func:`analyze`.

The arithmetic-intensity analysis of :mod:`cuflash.intensity` (FLOPs against HBM bytes) carried
one level down, to what one SM does per K/V tile of a kernel's main loop. No GPU is needed: the
variant the dispatcher would choose is compiled with NVRTC (the run-time options), disassembled
with ``cuobjdump``/``nvdisasm`` (the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels),
and its main loops (the natural loops with the most tensor instructions, else the most FP32 ones,
found by :mod:`cuflash.analysis.sass_count`) are counted per warp along two passes: the
*unmasked* one (every tensor instruction and copy, fewest other instructions: a full tile in the
steady state, where the forward's conditional O rescale is skipped because no row's maximum
moved), from the loop where it is shortest, and the *masked* one (the most instructions: a
diagonal or window tile, with the rescale), from the loop where it is longest (a kernel that
compiles its edge tiles as loops of their own has several). From the counts and per-SM rates (:data:`RATES`, each with its source),
the time of each pipe per tile and CTA, and the binding one's throughput as the predicted
ceiling. **A model, never a measurement**: it ignores latency, occupancy effects beyond
``ctas_per_sm`` > 0, bank conflicts and L2; benchmarks on the GPU (``python -m cuflash bench``)
measure.

Pipes, per K/V tile and CTA (``w`` warps; counts per warp):

* ``tensor``: MACs / the SM's rate for the instruction kind (``mma.sync`` on sm_90 about 60% of
  ``wgmma``'s; fp8 ``wgmma``, SASS ``QGMMA``, twice the 16-bit ``wgmma``'s);
* ``smem``: shared-memory bytes read (``LDSM``, ``LDS``) and written (``STS``, ``LDGSTS``), w x
  bytes / 128 B per cycle;
* ``mufu``: w x 32 x MUFU instructions / 16 lanes per cycle;
* ``fp32``: w x 32 x FFMA/FADD/FMUL / the FP32 lanes per cycle;
* ``issue``: w x instructions / 4 (one warp instruction per scheduler and cycle);
* ``hbm``: the fused algorithm's HBM bytes (:func:`cuflash.intensity.fused_attention_cost`, L2
  reuse) for a reference problem (``seqlen`` keys and queries, one head), per tile.

The FLOPs of a tile are the tile math: ``2 Br Bc (D + Dv)`` forward, ``2 Br Bc (3D + 2Dv)``
backward (the MACs of ``S = Q K^T`` and ``O += P V``; of ``S``, ``dP``, ``dV``, ``dK``, ``dQ``).
A loop inside the main loop (``inner_loops`` > 0: the SIMT kernels' loops over the head dim, the
tensor-core backward's loop over dQ column blocks) is counted once, so its counts are a lower
bound there; the tensor and FP32 pipes then take at least the tile math's MACs.

``--call-mix`` (:func:`call_mix`, :mod:`cuflash.analysis.call_mix`) counts a whole forward call
instead: the tiles of each path of the key walk the grid runs for a call's shape, times each
path's per-warp instructions, by class. A count, never a speed.

``--what-if tf32|m8n8k4`` (:func:`what_if`) models tensor-core forwards that do not exist (float32
as TF32 on sm_80+, float16 on the V100's m8n8k4) from the float16 forward's counted SASS, each
instruction replaced by what the form would issue; model figures of a kernel not written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cuflash.analysis import cli, intensity, sass_count
from cuflash.analysis.sass_count import Insn, find_tool  # (the SASS reader is sass_count's)

__all__ = ["SmRates", "RATES", "Counts", "Roofline", "analyze", "compile_sass", "variants", "main", "WHAT_IF_FORMS",
           "WhatIf", "what_if", "tf32_counts", "m8n8k4_counts"]


# --------------------------------------------------------------------------------------------
# per-SM rates
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SmRates:
    """Per-SM throughputs of one GPU, per clock cycle, with the sources of the figures.

    Attributes
    ----------
    device : intensity.Device
        The datasheet figures (SM count via ``sms``, HBM bandwidth).
    arch : int
        Compute capability (90 for Hopper).
    sms : int
        Streaming multiprocessors.
    clock_ghz : float
        The clock at which the datasheet's tensor peak holds (GHz).
    mma_sync_macs, wgmma_macs : float
        Dense 16-bit multiply-accumulates per cycle per SM of ``mma.sync`` and of ``wgmma``
        (0 where the arch has none).
    smem_bytes : float
        Shared-memory bytes per cycle per SM.
    mufu_lanes, fp32_lanes : float
        MUFU results and FP32 FMA lanes per cycle per SM.
    issue : float
        Warp instructions issued per cycle per SM.
    registers, smem_per_sm, smem_reserved, max_threads, max_ctas : int
        Occupancy limits: 32-bit registers per SM, shared-memory bytes per SM and reserved per
        CTA, threads and CTAs per SM.
    source : str
        Where the figures come from.
    wgmma_fp8_macs : float
        Dense fp8 (e4m3/e5m2) multiply-accumulates per cycle per SM of ``wgmma`` (SASS ``QGMMA``,
        k = 32 per instruction); 0 where the arch has none.
    """

    device: intensity.Device
    arch: int
    sms: int
    clock_ghz: float
    mma_sync_macs: float
    wgmma_macs: float
    smem_bytes: float
    mufu_lanes: float
    fp32_lanes: float
    issue: float
    registers: int
    smem_per_sm: int
    smem_reserved: int
    max_threads: int
    max_ctas: int
    source: str
    wgmma_fp8_macs: float = 0.0


_GUIDE = ("CUDA C++ Programming Guide: 'Arithmetic Instructions' throughput table (MUFU 16, FP32 "
          "128 (cc 9.0) / 64 (cc 8.0) results per cycle per SM), 'Compute Capabilities' (registers, "
          "shared memory, threads, CTAs per SM; 1 KB reserved per CTA), 'Shared Memory' (32 banks of "
          "4 bytes: 128 B per cycle); 4 warp schedulers per SM (Hopper and Ampere whitepapers)")


def _hopper(device: intensity.Device) -> SmRates:
    sms = 132
    wgmma = 2048.0  # 989.4 TFLOP/s dense / (132 SMs x 2 FLOP per MAC x 1.83 GHz)
    return SmRates(
        device=device, arch=90, sms=sms, clock_ghz=device.fp16_tensor_tflops * 1e12 / (sms * 2 * wgmma) / 1e9,
        mma_sync_macs=0.6 * wgmma, wgmma_macs=wgmma, smem_bytes=128.0, mufu_lanes=16.0, fp32_lanes=128.0,
        issue=4.0, registers=65536, smem_per_sm=228 * 1024, smem_reserved=1024, max_threads=2048, max_ctas=32,
        wgmma_fp8_macs=2 * wgmma,
        source=(f"{device.source}; 132 SMs and 2048 dense 16-bit MACs per cycle per SM for wgmma (the "
                "datasheet's peak at 1.83 GHz); fp8 wgmma (QGMMA, k = 32) twice that (the datasheet's FP8 "
                "1,979 TFLOP/s dense, half its 3,958 with sparsity); mma.sync about 60% of the 16-bit rate on "
                "sm_90 (FlashAttention-3, Shah et al. 2024, section 1: mma.sync reaches about two thirds of "
                "the H100's peak); " + _GUIDE))


def _ampere(device: intensity.Device) -> SmRates:
    sms = 108
    mma = 1024.0  # 312 TFLOP/s dense / (108 SMs x 2 x 1.41 GHz)
    return SmRates(
        device=device, arch=80, sms=sms, clock_ghz=device.fp16_tensor_tflops * 1e12 / (sms * 2 * mma) / 1e9,
        mma_sync_macs=mma, wgmma_macs=0.0, smem_bytes=128.0, mufu_lanes=16.0, fp32_lanes=64.0, issue=4.0,
        registers=65536, smem_per_sm=164 * 1024, smem_reserved=1024, max_threads=2048, max_ctas=32,
        source=f"{device.source}; 108 SMs, 1024 dense 16-bit MACs per cycle per SM (the peak at 1.41 GHz); " + _GUIDE)


def _volta_turing(device: intensity.Device, *, arch: int, sms: int, smem_kb: int, max_threads: int,
                  max_ctas: int) -> SmRates:
    """Volta (V100) and Turing (T4): 8 tensor cores of 64 FP16 FMA per cycle per SM (the MACs
    that give the datasheet's peak at the derived clock) and 64 FP32 lanes."""
    mma = 512.0
    clock = device.fp16_tensor_tflops * 1e12 / (sms * 2 * mma) / 1e9
    return SmRates(
        device=device, arch=arch, sms=sms, clock_ghz=clock, mma_sync_macs=mma, wgmma_macs=0.0, smem_bytes=128.0,
        mufu_lanes=16.0, fp32_lanes=64.0, issue=4.0, registers=65536, smem_per_sm=smem_kb * 1024, smem_reserved=0,
        max_threads=max_threads, max_ctas=max_ctas,
        source=(f"{device.source}; {sms} SMs, 512 dense FP16 MACs per cycle per SM (8 tensor cores; the peak at "
                f"{clock:.2f} GHz), 64 FP32 lanes ({device.fp32_tflops:g} TFLOP/s), {smem_kb} KB shared memory, "
                f"{max_threads} threads and {max_ctas} CTAs per SM (compute capability {arch // 10}.{arch % 10}); "
                + _GUIDE))


#: per-SM rates by device preset (``--device``)
RATES = {"h200": _hopper(intensity.H200), "h100": _hopper(intensity.H100), "a100": _ampere(intensity.A100),
         "t4": _volta_turing(intensity.T4, arch=75, sms=40, smem_kb=64, max_threads=1024, max_ctas=16),
         "v100": _volta_turing(intensity.V100, arch=70, sms=80, smem_kb=96, max_threads=2048, max_ctas=32)}


def preset_for(name: str, arch: int) -> str | None:
    """The :data:`RATES` key of a device given its name (``"Tesla T4"``, ``"NVIDIA H200"``, as
    CUDA reports it) and compute capability (75, 90): the preset whose model name is a word of
    ``name`` and whose arch is ``arch``; None for any other device (an RTX 2080 is sm_75 too,
    with other rates)."""
    words = set(re.findall(r"[a-z0-9]+", str(name).lower()))
    for key, rates in RATES.items():
        if key in words and rates.arch == arch:
            return key
    return None


# --------------------------------------------------------------------------------------------
# SASS
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Counts:
    """Per-warp counts of one pass through the main loop's body."""

    instructions: int
    tensor: int
    macs: int
    smem_read: int
    smem_write: int
    global_read: int
    global_write: int
    mufu: int
    fp32: int
    barriers: int
    #: the MACs of fp8 tensor instructions (``QGMMA``), part of ``macs``
    fp8_macs: int = 0

    @property
    def other(self) -> int:
        """Instructions that are not tensor instructions."""
        return self.instructions - self.tensor


_COUNT_KEYS = tuple(f.name for f in dataclasses.fields(Counts))


def parse_sass(text: str, entry: str | None = None) -> list[Insn]:
    """The instructions of ``entry`` (default: the first function) in ``cuobjdump --dump-sass``
    output (:func:`cuflash.analysis.sass_count.parse_functions`).

    Raises
    ------
    ValueError
        If the function is not in ``text`` or has no instructions.
    """
    functions = sass_count.parse_functions(text)
    if entry is None:
        if not functions:
            raise ValueError("cuflash.roofline: no SASS instructions for the first function")
        return next(iter(functions.values()))
    if entry not in functions:
        raise ValueError(f"cuflash.roofline: function {entry!r} is not in the SASS "
                         f"(has {', '.join(functions) or 'none'})")
    return functions[entry]


def _width_bytes(mods: str, default: int = 4) -> int:
    for bits, nbytes in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if bits in mods:
            return nbytes
    return default


#: the tensor instructions the model counts: mma.sync (HMMA), 16-bit wgmma (HGMMA), fp8 wgmma (QGMMA)
TENSOR_OPS = ("HMMA", "HGMMA", "QGMMA")


def insn_counts(insn: Insn) -> dict:
    """What one warp instruction counts for (per warp; bytes for all 32 lanes)."""
    c = dict.fromkeys(_COUNT_KEYS, 0)
    if insn.op == "NOP":
        return c
    c["instructions"] = 1
    op, mods = insn.op, insn.mods
    if op in TENSOR_OPS:
        c["tensor"] = 1
        c["macs"] = sass_count.mma_macs(insn)
        if not c["macs"]:
            raise ValueError(f"cuflash.roofline: unknown {op} shape {op}{mods}")
        if op == "QGMMA":   # fp8 operands (E4M3/E5M2): k = 32, at twice the 16-bit rate
            c["fp8_macs"] = c["macs"]
    elif op == "LDSM":
        c["smem_read"] = 128 * (4 if mods.endswith(".4") else 2 if mods.endswith(".2") else 1)
    elif op == "LDS":   # "LDS RZ, [RZ]" (the compiler's dependency placeholders) moves no data
        c["smem_read"] = 0 if insn.operands.replace(" ", "").startswith("RZ,") else 32 * _width_bytes(mods)
    elif op == "STS":
        c["smem_write"] = 32 * _width_bytes(mods)
    elif op == "LDGSTS":
        c["global_read"] = c["smem_write"] = 32 * _width_bytes(mods)
    elif op == "LDG":
        c["global_read"] = 32 * _width_bytes(mods)
    elif op == "STG":
        c["global_write"] = 32 * _width_bytes(mods)
    elif op == "MUFU":
        c["mufu"] = 1
    elif op in ("FFMA", "FADD", "FMUL"):
        c["fp32"] = 1
    elif op == "BAR":
        c["barriers"] = 1
    return c


def unmasked_pass(c: dict):
    """The unmasked pass's preference: every tensor instruction and copy, the fewest others."""
    return c["tensor"], c["smem_write"], -c["instructions"]


def masked_pass(c: dict):
    """The masked pass's preference: every tensor instruction and copy, the most others."""
    return c["tensor"], c["smem_write"], c["instructions"]


def loop_passes(insns: list[Insn], keys=(unmasked_pass, masked_pass)):
    """``(passes, main)``: for each main loop, the per-warp :class:`Counts` of the pass that
    maximizes each key (a function of the running counts, by name in :class:`Counts`); ``main``
    the loops as :func:`cuflash.analysis.sass_count.main_loops` gives them, outer loops included
    (``(blocks, [(header, body, latches), ...])``).

    The main loops are the natural loops holding the most tensor instructions (else the most FP32
    ones), with their out-of-line blocks; a pass runs from the header to a latch, inner loops
    once. Several main loops mean masked tiles compiled as loops of their own.

    Raises
    ------
    ValueError
        If the code has no loop, or no pass reaches a latch.
    """
    blocks, loops = sass_count.main_loops(insns, innermost=False)
    passes = []
    for loop in loops:
        found = sass_count.best_passes(insns, blocks, loop, insn_counts,
                                       [lambda t, key=key: key(_full(t)) for key in keys])
        if any(t is None for t in found):
            raise ValueError("cuflash.roofline: no pass from the main loop's header to a latch")
        passes.append(tuple(Counts(**_full(t)) for t in found))
    return passes, (blocks, loops)


def _full(t: dict) -> dict:
    return {k: t.get(k, 0) for k in _COUNT_KEYS}


def _arithmetic_inner_loops(insns: list[Insn], blocks, loop) -> list:
    """The loops nested in ``loop`` that compute (tensor or FP32 instructions; not a spin-wait)."""
    starts, ends, _ = blocks
    return [g for g in sass_count.inner_loops(blocks, loop)
            if any(x.op in TENSOR_OPS + ("FFMA", "FADD", "FMUL") for b in g[1] for x in insns[starts[b]:ends[b]])]


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Roofline:
    """The roofline of one kernel variant (see the module docstring). Counts are per warp and
    per K/V tile of the main loop along the unmasked path, except ``macs_per_tile`` (per CTA);
    ``pipes`` are cycles per tile per CTA; ``ceiling_tflops`` is a prediction."""

    entry: str
    arch: int
    device: str
    direction: str
    block_m: int
    block_n: int
    head_dim: int
    head_dim_v: int
    warps: int
    tensor_per_tile: int
    macs_per_tile: int
    smem_read_bytes_per_tile: int
    smem_write_bytes_per_tile: int
    global_bytes_per_tile: int
    other_per_tile: int
    mufu_per_tile: int
    fp32_per_tile: int
    instructions_per_tile: int
    barriers_per_tile: int
    masked_instructions_per_tile: int
    masked_other_per_tile: int
    inner_loops: int
    registers: int
    spills: int
    smem_bytes: int
    ctas_per_sm: int
    warps_per_sm: int
    flops_per_tile: int
    pipes: dict
    bound: str
    ceiling_tflops: float
    #: the arch whose SASS was counted, where it is not ``arch`` (sm_70: CUDA 13's nvdisasm reads
    #: no sm_70 code, so a V100 kernel is counted in its sm_75 build)
    sass_arch: int | None = None

    @property
    def other_per_tensor(self) -> float:
        return self.other_per_tile / self.tensor_per_tile if self.tensor_per_tile else math.inf

    @property
    def smem_bytes_per_tensor(self) -> float:
        return self.smem_read_bytes_per_tile / self.tensor_per_tile if self.tensor_per_tile else math.inf

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["other_per_tensor"] = self.other_per_tensor if self.tensor_per_tile else None
        d["smem_read_bytes_per_tensor"] = self.smem_bytes_per_tensor if self.tensor_per_tile else None
        return d


def occupancy(rates: SmRates, threads: int, registers: int, smem: int) -> int:
    """CTAs per SM allowed by registers (allocated per warp in units of 256), shared memory
    (plus the per-CTA reserve), threads and the CTA limit."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = rates.registers // (per_warp * warps) if registers else rates.max_ctas
    by_smem = rates.smem_per_sm // (smem + rates.smem_reserved)
    return max(0, min(by_regs, by_smem, rates.max_threads // threads, rates.max_ctas))


def _tile_flops(direction: str, bm: int, bn: int, d: int, dv: int) -> int:
    return 2 * bm * bn * ((d + dv) if direction == "fwd" else (3 * d + 2 * dv))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What the model needs of a compiled kernel besides its loop's counts: its tile, its launch
    and its resources (ptxas's figures).

    ``math_threads``: the threads that run the main loop when fewer than the block's (a
    warp-specialized kernel's consumers; its producer warps issue TMA, counted in no pipe).
    ``wgmma``: the loop's tensor instructions are wgmma (their rate, and shared-memory operands
    read without instructions)."""

    entry: str
    direction: str
    block_m: int
    block_n: int
    head_dim: int
    head_dim_v: int
    threads: int
    registers: int
    spills: int
    smem: int
    dtype_bytes: int
    inner_loops: int = 0
    wgmma: bool = False
    math_threads: int | None = None


def model(counts: Counts, masked: Counts, kernel: Kernel, *, rates: SmRates, seqlen: int = 8192) -> Roofline:
    """The pipes' cycles per tile, the binding pipe and the ceiling, from the counts of the
    loop's unmasked and masked paths (per warp) and the ``kernel`` (:class:`Kernel`). A wgmma
    reads its shared-memory operands without instructions, so the smem pipe counts only the
    threads' own shared-memory accesses there."""
    k = kernel
    entry, direction, block_m, block_n = k.entry, k.direction, k.block_m, k.block_n
    head_dim, head_dim_v, threads, registers, spills, smem = (k.head_dim, k.head_dim_v, k.threads, k.registers,
                                                              k.spills, k.smem)
    dtype_bytes, inner_loops, wgmma = k.dtype_bytes, k.inner_loops, k.wgmma
    warps = (k.math_threads or threads) // 32
    flops = _tile_flops(direction, block_m, block_n, head_dim, head_dim_v)
    cost = intensity.fused_attention_cost(seqlen, head_dim, headdim_v=head_dim_v, dtype=dtype_bytes,
                                          backward=direction == "bwd")
    tiles = -(-seqlen // block_m) * -(-seqlen // block_n)
    hbm_per_cycle = rates.device.hbm_gb_per_s * 1e9 / (rates.sms * rates.clock_ghz * 1e9)
    mac_rate = rates.wgmma_macs if wgmma else rates.mma_sync_macs
    # Inner loops count one pass, so the compute pipes take at least the tile math's MACs.
    tile_macs = flops // 2
    fp8_share = counts.fp8_macs / counts.macs if counts.macs else 0.0
    if fp8_share and not rates.wgmma_fp8_macs:
        raise ValueError(f"cuflash.roofline: {entry} has fp8 tensor instructions (QGMMA), which sm_{rates.arch} "
                         "does not have")
    pipes = {
        # (fp8 MACs at the fp8 wgmma rate, the others at the 16-bit one)
        "tensor": max(warps * counts.macs, tile_macs) * ((1 - fp8_share) / mac_rate
                                                         + (fp8_share / rates.wgmma_fp8_macs if fp8_share else 0.0))
                  if counts.macs else 0.0,
        "smem": warps * (counts.smem_read + counts.smem_write) / rates.smem_bytes,
        "mufu": warps * 32 * counts.mufu / rates.mufu_lanes,
        "fp32": (warps * 32 * counts.fp32 if counts.macs else max(warps * 32 * counts.fp32, tile_macs))
                / rates.fp32_lanes,
        "issue": warps * counts.instructions / rates.issue,
        "hbm": cost.bytes / tiles / hbm_per_cycle,
    }
    bound = max(pipes, key=pipes.get)
    ctas = occupancy(rates, threads, registers, smem)
    ceiling = flops / pipes[bound] * rates.clock_ghz * 1e9 * rates.sms / 1e12 if ctas else 0.0
    return Roofline(
        entry=entry, arch=rates.arch, device=rates.device.name, direction=direction, block_m=block_m,
        block_n=block_n, head_dim=head_dim, head_dim_v=head_dim_v, warps=warps, tensor_per_tile=counts.tensor,
        macs_per_tile=warps * counts.macs, smem_read_bytes_per_tile=counts.smem_read,
        smem_write_bytes_per_tile=counts.smem_write, global_bytes_per_tile=counts.global_read + counts.global_write,
        other_per_tile=counts.other, mufu_per_tile=counts.mufu, fp32_per_tile=counts.fp32,
        instructions_per_tile=counts.instructions, barriers_per_tile=counts.barriers,
        masked_instructions_per_tile=masked.instructions, masked_other_per_tile=masked.other,
        inner_loops=inner_loops, registers=registers, spills=spills, smem_bytes=smem, ctas_per_sm=ctas,
        warps_per_sm=ctas * warps, flops_per_tile=flops, pipes={k: round(v, 1) for k, v in pipes.items()},
        bound=bound if ctas else "occupancy", ceiling_tflops=round(ceiling, 1))


# --------------------------------------------------------------------------------------------
# variants, compilation, disassembly
# --------------------------------------------------------------------------------------------

def disassemble(cubin: bytes) -> str:
    """``cuobjdump --dump-sass`` of a cubin.

    Raises
    ------
    RuntimeError
        If the tools are missing (install ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``)
        or fail.
    """
    tool, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if tool is None or nvdisasm is None:
        raise RuntimeError("cuflash.roofline: cuobjdump/nvdisasm not found; install the wheels "
                           "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the 'test' extra)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"cuflash.roofline: cuobjdump failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _shape_of(variant) -> tuple[str, int, int, int, int]:
    """(direction, block_m, block_n, head_dim, head_dim_v) of an attention variant."""
    fam = variant.family
    direction = "bwd" if "bwd" in fam else "fwd"
    bm, bn = (variant.block_m, variant.block_n)
    d = variant.head_dim_max
    return direction, bm, bn, d, getattr(variant, "head_dim_v_max", d)


def variants(arch: int, *, backward: bool | None = None, dtype: str | None = None,
             head_dim: int | None = None, head_dim_v: int | None = None, varlen: bool = False) -> list:
    """The attention variants the dispatcher can choose on ``sm_<arch>`` (the main stage of the
    backward), filtered; with ``head_dim`` (and ``dtype``), the one it would choose for that
    problem; ``varlen``: the packed variable-length forms (``cuflash.attention_varlen``) instead
    of the fixed-shape ones."""
    import numpy as np

    from cuflash.kernels import catalog, dispatch
    from cuflash.runtime import validation
    from cuflash.runtime.options import Options

    if head_dim is not None:
        dt = _numpy_dtype(dtype or "bf16")
        dv = head_dim_v or head_dim
        q = np.zeros((1, 1, 256, head_dim), dt)
        k = np.zeros((1, 1, 256, head_dim), dt)
        v = np.zeros((1, 1, 256, dv), dt)
        try:
            problem = validation.check_attention(q, k, v, Options())
        except (TypeError, ValueError, NotImplementedError) as e:   # its words are attention()'s
            raise type(e)(f"cuflash.roofline: head_dim={head_dim}, head_dim_v={dv}: "
                          f"{str(e).replace('cuflash.attention: ', '')}") from None
        out = []
        for bwd in ((False, True) if backward is None else (backward,)):
            tier = dispatch.backward_tier(problem, arch) if bwd else dispatch.forward_tier(problem, arch)
            if bwd and not getattr(tier, "ROOFLINE_MODEL", True):   # (its loop nest is not modelled yet:
                tier = next(m for _, m in dispatch.BACKWARD_TIERS    # the next tier's figures, said so)
                            if getattr(m, "ROOFLINE_MODEL", True) and m.unsupported_reason(problem, arch) is None)
            if varlen and not bwd:   # packed batches: the fastest tier that has packed forms
                tier = next(m for _, m in dispatch.TIERS if m.all_variants(arch, varlen=True))
            chosen = tier.choose_variant(dt, head_dim, dv, arch)
            if varlen:   # the tier's packed form of that variant
                chosen = next(v for v in tier.all_variants(arch, varlen=True)
                              if (v.dtype, v.head_dim_max) == (chosen.dtype, chosen.head_dim_max))
            out.append(chosen)
        return [v for v in out if _is_main(v)]
    found = []
    for v in catalog.variants_for_arch(arch):
        if not _is_main(v) or getattr(v, "varlen", False) != varlen:
            continue
        if backward is not None and (("bwd" in v.family) != backward):
            continue
        if dtype is not None and v.dtype != _dtype_key(dtype):
            continue
        found.append(v)
    return found


#: the dtypes the attention kernels compute in
KERNEL_DTYPES = ("float16", "bfloat16", "float32")


def _numpy_dtype(dtype):
    """A supported NumPy dtype from ``"bf16"``, ``"float16"``, ... (any spelling of
    :data:`cuflash.analysis.cli.DTYPE_ALIASES`; ValueError naming it if not a kernel dtype)."""
    from cuflash.runtime import dtypes

    name = cli.canonical_dtype(dtype)
    if name not in KERNEL_DTYPES:
        raise ValueError(f"cuflash.roofline: dtype={dtype!r} must be one of {cli.dtype_help(KERNEL_DTYPES)}")
    return dtypes.from_name(name)


def _dtype_key(dtype) -> str:
    from cuflash.runtime import variants as variants_mod

    return variants_mod.dtype_key(_numpy_dtype(dtype))


def _is_main(v) -> bool:
    return v.family.startswith("attn_") and hasattr(v, "block_m") and getattr(v, "stage", "main") == "main" \
        and not getattr(v, "kvcache", False) and not getattr(v, "dropout", False)


@lru_cache(maxsize=128)
def compile_sass(variant, arch: int) -> tuple[str, dict]:
    """``(sass, resources)`` of a kernel variant for ``sm_<arch>``: the ``cuobjdump --dump-sass``
    text and :func:`cuflash.runtime.cuda_runner.ptxas_resources` of its entry, compiled with the
    run-time NVRTC options once per process.

    Raises
    ------
    RuntimeError
        If NVRTC or the SASS tools fail or are missing; ImportError without CuPy.
    """
    from cuflash.runtime import cuda_runner, source

    from cuflash.runtime import nvrtc

    target = getattr(variant, "target_arch", None) or arch   # (the Hopper tier: sm_90a)
    lib = None   # the run-time default, except where it cannot target the arch (sm_70: NVRTC 12.x only)
    if not os.environ.get("CUFLASH_NVRTC") and arch < nvrtc.OLDEST_ARCH[cuda_runner.default_nvrtc().major]:
        lib = min(m for m in nvrtc.MAJORS if nvrtc.OLDEST_ARCH[m] <= arch)
    cubin, log = cuda_runner.nvrtc_compile(source.build_source(variant), target, name=variant.source,
                                           extra_options=("-Xptxas=-v",), nvrtc=lib)
    return disassemble(cubin), cuda_runner.ptxas_resources(log, variant.entry)


def _keep_sass(text: str, variant, arch: int, sass_dir: str | None) -> None:
    """Write the disassembly to ``<sass_dir>/<entry>.sm_<arch>.sass`` (nothing when None)."""
    if sass_dir is not None:
        Path(sass_dir).mkdir(parents=True, exist_ok=True)
        (Path(sass_dir) / f"{variant.entry}.sm_{arch}.sass").write_text(text)


def analyze(variant, device: str = "h200", *, seqlen: int = 8192, sass_dir: str | None = None) -> Roofline:
    """Compile ``variant`` for the device's arch, read its main loop and model it.

    Parameters
    ----------
    variant : cuflash.runtime.variants.Variant
        An attention variant (see :func:`variants`).
    device : {"h200", "h100", "a100"}
        The per-SM rates (:data:`RATES`).
    seqlen : int
        Reference sequence length of the HBM pipe (keys and queries).
    sass_dir : str, optional
        Folder to keep the disassembly in (``<entry>.sm_<arch>.sass``).

    Raises
    ------
    ValueError
        For an unknown device or a kernel without a loop.
    RuntimeError
        If NVRTC or the SASS tools fail or are missing.
    """
    if device not in RATES:
        raise ValueError(f"cuflash.roofline: device={device!r} must be one of {sorted(RATES)}")
    rates = RATES[device]
    sass_arch = rates.arch
    try:
        text, res = compile_sass(variant, rates.arch)
    except RuntimeError as e:   # CUDA 13's nvdisasm refuses sm_70: count the same kernel's sm_75 build
        if rates.arch >= 75 or "deprecated" not in str(e):
            raise
        sass_arch = 75
        text, res = compile_sass(variant, sass_arch)
    _keep_sass(text, variant, sass_arch, sass_dir)
    insns = parse_sass(text, variant.entry)
    passes, (blocks, loops) = loop_passes(insns)
    # the masked tiles as loops of their own: the unmasked pass from the shortest, masked the longest
    unmasked = min((p[0] for p in passes), key=lambda c: c.instructions)
    masked = max((p[1] for p in passes), key=lambda c: c.instructions)
    starts, ends, _ = blocks
    inner = max(len(_arithmetic_inner_loops(insns, blocks, loop)) for loop in loops)
    direction, bm, bn, d, dv = _shape_of(variant)
    wgmma = any(x.op in ("HGMMA", "QGMMA") for _, body, _ in loops for b in body for x in insns[starts[b]:ends[b]])
    kernel = Kernel(variant.entry, direction, bm, bn, d, dv, variant.threads, res["registers"],
                    res["spill_stores"] + res["spill_loads"], variant.smem_bytes + res["static_smem"],
                    2 if variant.dtype in ("f16", "bf16") else 4, inner_loops=inner, wgmma=wgmma,
                    math_threads=getattr(variant, "math_threads", None))
    result = model(unmasked, masked, kernel, rates=rates, seqlen=seqlen)
    return result if sass_arch == rates.arch else dataclasses.replace(result, sass_arch=sass_arch)


# --------------------------------------------------------------------------------------------
# what if: tensor-core forms that do not exist (--what-if)
#
# Two questions the roofline answers before anyone builds a kernel, each a **model figure, never a
# speed**:
#
# * ``tf32``: would a float32 forward on the tensor cores (``mma.sync.m16n8k8`` with ``.tf32``
#   operands, sm_80 and newer) pay for float32 users, who run the portable (CUDA-core) tier today?
# * ``m8n8k4``: would the V100's tensor cores (``mma.sync.m8n8k4``, sm_70) pay for a tier there,
#   where float16 runs the portable tier today?
#
# Method. The per-warp instructions of the nearest kernel that exists (the tensor-core forward in
# float16 the dispatcher picks: sm_80/sm_90's for ``tf32``, the sm_75 form's for ``m8n8k4``) are
# read from its SASS along the roofline's unmasked and masked passes, and each instruction is
# replaced by what the form would issue in its place (:func:`tf32_counts`, :func:`m8n8k4_counts`;
# every rule says where its figure comes from). The tile, the softmax and the bookkeeping are the
# same work in either form, so they are kept as counted. The per-SM rate of the form's tensor
# instruction comes from the datasheets (:data:`WHAT_IF_FORMS`). The result goes through the roofline's
# own :func:`cuflash.analysis.roofline.model`, beside the model of the tier those users run today
# (the portable forward, counted from its own SASS).
#
# What the model leaves out: registers (TF32 fragments take twice the registers of 16-bit ones, and
# the m8n8k4 operands are held twice, once per quad pair: a real kernel would take a smaller tile,
# whose per-MAC counts the model assumes equal), bank conflicts of the 32-bit and 64-bit
# shared-memory loads, and latency; as for every roofline figure, a GPU run has to confirm it.

#: instructions of one ``cvt.rna.tf32.f32`` on sm_80 and sm_90 (NVRTC 12.9's SASS: ``FSETP.GEU``
#: on |x| < inf, a predicated ``IADD`` of 0x1000, ``LOP3`` keeping the top 19 bits)
CVT_TF32 = 3


def _tensor_as(c: dict, insn: Insn, form: str, shape: str, n: int) -> dict:
    """The counts ``c`` of the ``HMMA<shape>`` ``insn`` as ``n`` instructions of the form's shape, the
    same MACs (ValueError for another tensor instruction)."""
    if insn.op != "HMMA" or not insn.mods.startswith(shape):
        raise ValueError(f"cuflash.roofline: --what-if {form} replaces HMMA{shape}, not {insn.op}{insn.mods}")
    return {**c, "instructions": n, "tensor": n}


def tf32_counts(insn: Insn) -> dict:
    """What one instruction of the float16 tensor-core forward (sm_80/sm_90 SASS) becomes in a TF32
    form of the same tile, as :func:`cuflash.analysis.insn_counts` counts it.

    * ``HMMA.16816`` (m16n8k16 f16, 2048 MACs) -> two ``HMMA.1688.F32.TF32`` (m16n8k8 tf32, 1024
      MACs each: the SASS NVRTC 12.9 emits for ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``
      on sm_80 and sm_90).
    * ``LDSM`` (ldmatrix, 16-bit elements): the same fragments hold 32-bit elements, twice the bytes.
      Q and K (not transposed) stay ldmatrix, twice as many; V's ``.trans`` form moves 16-bit
      elements, so 32-bit V elements are read by ``LDS.32`` (128 B per warp instruction).
    * ``F2FP`` (P packed to f16x2) -> P rounded to tf32, two ``cvt.rna.tf32.f32`` of
      :data:`CVT_TF32` instructions (the accumulator's columns are then the A operand's up to an
      order of the keys, which V's rows follow: no shuffle).
    * ``LDGSTS`` (cp.async, 16 B = 8 float16 per lane) -> 32 B of float32 per lane rounded to tf32
      on the way: 2 ``LDG.128``, 8 x :data:`CVT_TF32`, 2 ``STS.128`` (cp.async cannot round).

    Everything else (softmax, masks, addresses, barriers) is the same work on the same tile.

    Raises
    ------
    ValueError
        For a tensor instruction other than ``HMMA.16816``.
    """
    c = insn_counts(insn)
    op, mods = insn.op, insn.mods
    if op in TENSOR_OPS:
        return _tensor_as(c, insn, "tf32", ".16816", 2)
    if op == "LDSM":
        nbytes = 2 * c["smem_read"]
        return {**c, "instructions": nbytes // 128 if ".MT88" in mods else 2, "smem_read": nbytes}
    if op == "F2FP":
        return {**c, "instructions": 2 * CVT_TF32}
    if op == "LDGSTS":
        width = c["global_read"] // 32   # bytes per lane, float16
        loads = 2 * width // 16
        return {**c, "instructions": 2 * loads + CVT_TF32 * (width // 2), "global_read": 2 * c["global_read"],
                "smem_write": 2 * c["smem_write"]}
    return c


def m8n8k4_counts(insn: Insn) -> dict:
    """What one instruction of the sm_75 form (the float16 tensor-core forward built for Turing:
    m16n8k8, register-staged copies) becomes in an sm_70 form on ``mma.sync.m8n8k4``.

    * ``HMMA.1688`` (m16n8k8, 1024 MACs per warp) -> one m8n8k4 per warp (four quad pairs, each an
      8 x 8 x 4 product: 1024 MACs), which sm_70 runs as four ``HMMA.884.F32.F32`` steps of 256
      MACs (Jia et al. 2018, "Dissecting the NVIDIA Volta GPU Architecture via
      Microbenchmarking", section 4: a 16 x 16 x 16 wmma with float accumulation is 16 HMMA, 4
      sets of 4 steps).
    * ``LDSM`` (sm_70 has no ldmatrix) -> ``LDS.64`` (a thread's four 16-bit operand elements, 256 B
      per warp instruction). Each quad pair holds its own A and B, and a 16 x 16 warp tile is
      four quad pairs, so every operand element is loaded twice: twice the bytes. V is read the
      same way: m8n8k4 takes B row-major (``.row``), so V needs no transpose.
    * ``F2F.F16.F32`` (one element of P converted): one more instruction, for the exchange between
      threads that turns the m8n8k4 float accumulator's fragment into the A operand's (one
      ``SHFL`` and one ``SEL`` per packed register of P, an assumption of the model).

    The copies (``LDG`` + ``STS``, no cp.async before sm_80) and everything else stay as
    counted.

    Raises
    ------
    ValueError
        For a tensor instruction other than ``HMMA.1688``.
    """
    c = insn_counts(insn)
    op, mods = insn.op, insn.mods
    if op in TENSOR_OPS:
        return _tensor_as(c, insn, "m8n8k4", ".1688", 4)
    if op == "LDSM":
        nbytes = 2 * c["smem_read"]
        return {**c, "instructions": nbytes // 256, "smem_read": nbytes}
    if op == "F2F" and mods.startswith(".F16.F32"):
        return {**c, "instructions": 2}
    return c


@dataclass(frozen=True)
class WhatIfForm:
    """A modelled tensor-core form: the devices it is asked about, the kernel it is derived from,
    the per-SM rate of its tensor instruction and the users' dtype today."""

    name: str
    title: str
    devices: tuple
    #: the per-instruction rule (:func:`tf32_counts`, :func:`m8n8k4_counts`)
    counts: Callable
    #: dense MACs per cycle per SM of the form's mma.sync, from the device's rates
    macs_per_cycle: Callable
    rate_source: str
    #: the arch whose float16 tensor-core kernel is the base (None: the device's)
    base_arch: int | None
    #: the dtype those users run on the portable tier today, and the form's operand bytes
    users_dtype: str
    operand_bytes: int


def _tf32_rate(rates: SmRates) -> float:
    # the datasheet's dense TF32 peak in MACs per cycle per SM; mma.sync on sm_90 at the same 60%
    # of wgmma's rate as the 16-bit form
    macs = rates.device.tf32_tensor_tflops * 1e12 / (rates.sms * 2 * rates.clock_ghz * 1e9)
    return macs * (rates.mma_sync_macs / rates.wgmma_macs if rates.wgmma_macs else 1.0)


#: the forms ``--what-if`` models
WHAT_IF_FORMS = {
    "tf32": WhatIfForm(
        "tf32", "float32 on the tensor cores as TF32 (mma.sync m16n8k8 .tf32)", ("a100", "h100", "h200"),
        tf32_counts, _tf32_rate,
        "the datasheets' dense TF32 peaks, half their FP16 ones: A100 156 TFLOP/s (512 MACs per cycle per SM "
        "at 1.41 GHz), H100 and H200 SXM 494.7 TFLOP/s (1024 per SM at 1.83 GHz, for wgmma; mma.sync at the "
        "same 60% of it as in the 16-bit form)", None, "float32", 4),
    "m8n8k4": WhatIfForm(
        "m8n8k4", "float16 on the V100's tensor cores (mma.sync m8n8k4)", ("v100",),
        m8n8k4_counts, lambda rates: rates.mma_sync_macs,
        "the V100 SXM2 datasheet's 125 TFLOP/s FP16 tensor peak (8 tensor cores of 64 FP16 FMA per cycle: "
        "512 MACs per cycle per SM at 1.53 GHz)", 75, "float16", 2),
}


@dataclass(frozen=True)
class WhatIf:
    """The model of one form at one head dim on one device: the form (``model``, a
    :class:`cuflash.analysis.Roofline` of the derived counts), the kernel it was derived
    from (``base``, as the roofline models it there), and the portable tier those users run today
    (``today``). Ceilings are predictions."""

    form: str
    device: str
    head_dim: int
    base: Roofline
    model: Roofline
    today: Roofline
    base_arch: int
    stages: int

    @property
    def masked_issue(self) -> float:
        """Issue-pipe cycles per tile and CTA along the masked path (the model's, for the form)."""
        return self.model.warps * self.model.masked_instructions_per_tile / RATES[self.device].issue

    @property
    def gain(self) -> float:
        """The form's predicted ceiling over today's tier's (model figures)."""
        return self.model.ceiling_tflops / self.today.ceiling_tflops if self.today.ceiling_tflops else float("inf")

    def as_dict(self) -> dict:
        return {"form": self.form, "device": self.device, "head_dim": self.head_dim, "base_arch": self.base_arch,
                "stages": self.stages, "gain": round(self.gain, 2), "base": self.base.as_dict(),
                "model": self.model.as_dict(), "today": self.today.as_dict()}


def what_if_base(form: WhatIfForm, variant, arch: int):
    """The float16 tile the form is derived from: the dispatcher's ``variant``, or where the form's
    operands (:attr:`WhatIfForm.operand_bytes`) would not fit its shared memory on ``sm_<arch>``, the same
    tile with one K/V stage, then with half the keys per tile (down to 16)."""
    from cuflash.runtime import plan

    def fits(v):
        return form.operand_bytes // 2 * v.smem_bytes <= plan.max_dynamic_smem(arch)

    if not fits(variant):
        variant = dataclasses.replace(variant, single_stage=True)
    while not fits(variant) and variant.block_n > 16:
        variant = dataclasses.replace(variant, block_n=variant.block_n // 2)
    return variant


def _what_if_passes(variant, arch: int, measure):
    """(unmasked, masked) :class:`Counts` of the variant's main loop under ``measure``, and
    the ptxas resources."""
    text, res = compile_sass(variant, arch)
    insns = parse_sass(text, variant.entry)
    blocks, loops = sass_count.main_loops(insns, innermost=False)
    found = [sass_count.best_passes(insns, blocks, loop, measure,
                                    [lambda t: unmasked_pass(_full(t)),
                                     lambda t: masked_pass(_full(t))]) for loop in loops]
    unmasked = min((Counts(**_full(f[0])) for f in found), key=lambda c: c.instructions)
    masked = max((Counts(**_full(f[1])) for f in found), key=lambda c: c.instructions)
    return unmasked, masked, res


def what_if(form: str, device: str, head_dim: int, *, seqlen: int = 8192) -> WhatIf:
    """Model ``form`` (a key of :data:`WHAT_IF_FORMS`) for the forward at ``head_dim`` on ``device``.

    Raises
    ------
    ValueError
        For an unknown form, a device the form is not asked about, or a head dim no bucket serves.
    RuntimeError
        If NVRTC or the SASS tools fail or are missing.
    """
    import numpy as np

    from cuflash.kernels import attention_fwd_mma

    if form not in WHAT_IF_FORMS:
        raise ValueError(f"cuflash.roofline: what-if form {form!r} must be one of {sorted(WHAT_IF_FORMS)}")
    f = WHAT_IF_FORMS[form]
    if device not in f.devices:
        raise ValueError(f"cuflash.roofline: --what-if {form} models {', '.join(f.devices)}, not {device!r}")
    rates = RATES[device]
    arch = f.base_arch or rates.arch
    variant = what_if_base(f, attention_fwd_mma.choose_variant(np.float16, head_dim, head_dim, arch), rates.arch)
    base = analyze(variant, device if arch == rates.arch else {75: "t4"}[arch])
    unmasked, masked, res = _what_if_passes(variant, arch, f.counts)
    smem = f.operand_bytes // 2 * variant.smem_bytes + res["static_smem"]
    direction, bm, bn, d, dv = _shape_of(variant)
    kernel = Kernel(f"{variant.entry} as {form}", direction, bm, bn, d, dv, variant.threads,
                             res["registers"], res["spill_stores"] + res["spill_loads"], smem, f.operand_bytes)
    form_rates = dataclasses.replace(rates, mma_sync_macs=f.macs_per_cycle(rates))
    modelled = model(unmasked, masked, kernel, rates=form_rates, seqlen=seqlen)
    (portable,) = variants(rates.arch, backward=False, dtype=f.users_dtype, head_dim=head_dim)
    today = analyze(portable, device, seqlen=seqlen)
    return WhatIf(form, device, head_dim, base, modelled, today, arch, variant.stages)


def format_what_if_table(rows: list[WhatIf]) -> str:
    """One line per head dim: the form's tile, K/V stages, CTAs per SM, pipes (``issue*``: the
    masked path's issue cycles), bound and predicted ceiling; today's tier's bound and ceiling; the
    ratio of the two ceilings."""
    head = (f"{'D':>4} {'BrxBc':>7} {'st':>2} {'CTA/SM':>6} {'tensor':>6} {'smem':>6} {'issue':>6} {'issue*':>6} "
            f"{'bound':>7} {'TFLOP/s':>7} | {'today':>7} {'TFLOP/s':>7} | {'ratio':>5}")
    lines = [head, "-" * len(head)]
    for w in rows:
        m, p = w.model, w.model.pipes
        lines.append(f"{w.head_dim:>4} {f'{m.block_m}x{m.block_n}':>7} {w.stages:>2} {m.ctas_per_sm:>6} "
                     f"{p['tensor']:>6.0f} {p['smem']:>6.0f} {p['issue']:>6.0f} {w.masked_issue:>6.0f} {m.bound:>7} "
                     f"{m.ceiling_tflops:>7.0f} | "
                     f"{w.today.bound:>7} {w.today.ceiling_tflops:>7.0f} | {w.gain:>5.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the decode kernel (the KV-cache form)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeRoofline:
    """The roofline of one decode step on the KV-cache kernel (a prediction): per K/V tile of
    ``block_n`` keys and CTA, the pipes' cycles when ``rows`` packed query rows (GQA group x Sq)
    share each tile, ``active_warps`` of the CTA's warps computing and the others only copying.
    ``cache_reads_per_kv_head`` is how many times one kv head's cache bytes are read (the query
    tiles a (sequence, kv head, split) needs: 1 while ``rows <= block_m``); ``hbm_fraction`` the
    share of the device's HBM bandwidth the binding pipe leaves (1.0 when HBM binds)."""

    entry: str
    device: str
    arch: int
    cache: str
    rows: int
    block_m: int
    block_n: int
    head_dim: int
    head_dim_v: int
    warps: int
    active_warps: int
    registers: int
    spills: int
    smem_bytes: int
    ctas_per_sm: int
    cache_bytes_per_tile: int
    cache_reads_per_kv_head: int
    pipes: dict
    bound: str
    hbm_fraction: float
    predicted_gb_per_s: float


def analyze_decode(variant, device: str = "h200", *, rows: int = 4, cache: str = "paged",
                   sass_dir: str | None = None) -> DecodeRoofline:
    """Model a decode step of the KV-cache kernel ``variant`` from its SASS (a prediction).

    ``rows`` packed query rows per CTA (GQA group x Sq); ``cache`` "paged" (the row-by-row
    gather through the block table, its copy loop counted at its trip count) or "contiguous"
    (the unrolled regular copy). Warps whose rows are all past ``rows`` skip the math: they count
    the loop's path with the fewest tensor instructions. ``sass_dir``: folder to keep the
    disassembly in (``<entry>.sm_<arch>.sass``).
    """
    if device not in RATES:
        raise ValueError(f"cuflash.roofline: device={device!r} must be one of {sorted(RATES)}")
    if not getattr(variant, "kvcache", False):
        raise ValueError(f"cuflash.roofline: {variant.entry} is not a KV-cache variant")
    rates = RATES[device]
    text, res = compile_sass(variant, rates.arch)
    _keep_sass(text, variant, rates.arch, sass_dir)
    insns = parse_sass(text, variant.entry)
    paged = cache == "paged"
    sel = -1 if paged else 1   # paged: the path through the (one-pass) copy loop, fewest copies
    passes, (blocks, loops) = loop_passes(insns, keys=[
        lambda c: (c["tensor"], sel * c["smem_write"], -c["instructions"]),
        lambda c: (-c["tensor"], sel * c["smem_write"], -c["instructions"])])
    math_c, copy_c = passes[0]
    extra = dict.fromkeys(_COUNT_KEYS, 0)
    copy_loops = [g for g in sass_count.inner_loops(blocks, loops[0])
                  if any(insn_counts(x)["smem_write"] for b in g[1] for x in insns[blocks[0][b]:blocks[1][b]])]
    if paged and copy_loops:   # the paged copy loop: its pass once more per further trip
        body = Counts(**_full(sass_count.best_passes(insns, blocks, copy_loops[0], insn_counts,
                                                     [lambda t: (t.get("smem_write", 0), t.get("instructions", 0))])[0]))
        trips = -(-variant.block_n * (variant.head_dim_max // 8) // variant.threads)
        extra = {k: (trips - 1) * getattr(body, k) for k in _COUNT_KEYS}
    warps = variant.threads // 32
    active = min(warps, -(-rows // variant.rows_per_warp))
    idle = warps - active

    def per_cta(name):
        return active * getattr(math_c, name) + idle * getattr(copy_c, name) + warps * extra[name]

    d = dv = variant.head_dim_max
    tile_bytes = variant.block_n * (d + dv) * (2 if variant.dtype in ("f16", "bf16") else 4)
    hbm_per_cycle = rates.device.hbm_gb_per_s * 1e9 / (rates.sms * rates.clock_ghz * 1e9)
    pipes = {
        "tensor": active * math_c.macs / rates.mma_sync_macs,
        "smem": (per_cta("smem_read") + per_cta("smem_write")) / rates.smem_bytes,
        "mufu": active * 32 * math_c.mufu / rates.mufu_lanes,
        "fp32": active * 32 * math_c.fp32 / rates.fp32_lanes,
        "issue": per_cta("instructions") / rates.issue,
        "hbm": tile_bytes / hbm_per_cycle,
    }
    bound = max(pipes, key=pipes.get)
    ctas = occupancy(rates, variant.threads, res["registers"], variant.smem_bytes + res["static_smem"])
    frac = pipes["hbm"] / pipes[bound]
    return DecodeRoofline(
        entry=variant.entry, device=rates.device.name, arch=rates.arch, cache=cache, rows=rows,
        block_m=variant.block_m, block_n=variant.block_n, head_dim=d, head_dim_v=dv, warps=warps, active_warps=active,
        registers=res["registers"], spills=res["spill_stores"] + res["spill_loads"],
        smem_bytes=variant.smem_bytes + res["static_smem"], ctas_per_sm=ctas, cache_bytes_per_tile=tile_bytes,
        cache_reads_per_kv_head=-(-rows // variant.block_m), pipes={k: round(v, 1) for k, v in pipes.items()},
        bound=bound if ctas else "occupancy", hbm_fraction=round(frac, 3),
        predicted_gb_per_s=round(rates.device.hbm_gb_per_s * frac, 1))


#: the prefix every attention kernel's entry name starts with (left out of the narrow tables)
ENTRY_PREFIX = "cuflash_attn_"

#: the columns the narrow tables fit in
TABLE_COLUMNS = 100


def _short(entry: str) -> str:
    return entry.removeprefix(ENTRY_PREFIX)


def format_decode_table(rows: list[DecodeRoofline], *, wide: bool = False) -> str:
    """The decode model's table: every pipe with ``wide``, else the binding pipe and the predicted
    bandwidth in :data:`TABLE_COLUMNS` columns (entry names without :data:`ENTRY_PREFIX`)."""
    if wide:
        head = (f"{'entry':<46} {'cache':>10} {'rows':>4} {'act/w':>5} {'regs':>4} {'CTA/SM':>6} {'KB/tile':>7} "
                f"{'tensor':>7} {'smem':>7} {'issue':>7} {'hbm':>7} {'bound':>6} {'HBM %':>6} {'GB/s':>7}")
        lines = [head, "-" * len(head)]
        for r in rows:
            p = r.pipes
            lines.append(f"{r.entry:<46} {r.cache:>10} {r.rows:>4} {f'{r.active_warps}/{r.warps}':>5} "
                         f"{r.registers:>4} {r.ctas_per_sm:>6} {r.cache_bytes_per_tile / 1024:>7.1f} "
                         f"{p['tensor']:>7.0f} {p['smem']:>7.0f} {p['issue']:>7.0f} {p['hbm']:>7.0f} {r.bound:>6} "
                         f"{100 * r.hbm_fraction:>5.0f}% {r.predicted_gb_per_s:>7.0f}")
        return "\n".join(lines)
    w = max([len(_short(r.entry)) for r in rows] + [len("kernel")])
    head = (f"{'kernel':<{w}} {'cache':>10} {'rows':>4} {'act/w':>5} {'CTA/SM':>6} {'KB/tile':>7} "
            f"{'bound':>9} {'HBM %':>5} {'GB/s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{_short(r.entry):<{w}} {r.cache:>10} {r.rows:>4} {f'{r.active_warps}/{r.warps}':>5} "
                     f"{r.ctas_per_sm:>6} {r.cache_bytes_per_tile / 1024:>7.1f} {r.bound:>9} "
                     f"{100 * r.hbm_fraction:>4.0f}% {r.predicted_gb_per_s:>6.0f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line


def format_table(rows: list[Roofline], *, wide: bool = False) -> str:
    """The model's table, one row per kernel: every count and pipe with ``wide``; else the tile,
    the occupancy, the tensor, shared-memory and issue pipes' cycles, the binding pipe and the
    ceiling in :data:`TABLE_COLUMNS` columns (entry names without :data:`ENTRY_PREFIX`; ``*``
    after a name marks a main loop with inner loops, whose counts are lower bounds)."""
    if wide:
        head = (f"{'entry':<44} {'dir':>3} {'BrxBc':>7} {'D':>4} {'w':>2} {'regs':>4} {'spill':>5} {'smemKB':>6} "
                f"{'CTA/SM':>6} {'w/SM':>4} {'tensor':>6} {'other/T':>7} {'smemB/T':>7} {'mufu':>4} "
                f"{'tensor':>7} {'smem':>7} {'issue':>7} {'mufu':>6} {'hbm':>6} {'bound':>7} {'TFLOP/s':>7}")
        lines = [head, "-" * len(head)]
        for r in rows:
            p = r.pipes
            ot = f"{r.other_per_tensor:.2f}" if r.tensor_per_tile else "-"
            ot += "*" if r.inner_loops else ""
            st = f"{r.smem_bytes_per_tensor:.0f}" if r.tensor_per_tile else "-"
            lines.append(
                f"{r.entry:<44} {r.direction:>3} {f'{r.block_m}x{r.block_n}':>7} {r.head_dim:>4} {r.warps:>2} "
                f"{r.registers:>4} {r.spills:>5} {r.smem_bytes / 1024:>6.1f} {r.ctas_per_sm:>6} {r.warps_per_sm:>4} "
                f"{r.tensor_per_tile:>6} {ot:>7} {st:>7} {r.mufu_per_tile:>4} {p['tensor']:>7.0f} {p['smem']:>7.0f} "
                f"{p['issue']:>7.0f} {p['mufu']:>6.0f} {p['hbm']:>6.0f} {r.bound:>7} {r.ceiling_tflops:>7.0f}")
        return "\n".join(lines)
    names = [_short(r.entry) + ("*" if r.inner_loops else "") for r in rows]
    w = max([len(n) for n in names] + [len("kernel")])
    head = (f"{'kernel':<{w}} {'BrxBc':>7} {'CTA/SM':>6} {'tensor':>6} {'smem':>6} {'issue':>6} "
            f"{'bound':>9} {'TFLOP/s':>7}")
    lines = [head, "-" * len(head)]
    for name, r in zip(names, rows):
        p = r.pipes
        lines.append(f"{name:<{w}} {f'{r.block_m}x{r.block_n}':>7} {r.ctas_per_sm:>6} {p['tensor']:>6.0f} "
                     f"{p['smem']:>6.0f} {p['issue']:>6.0f} {r.bound:>9} {r.ceiling_tflops:>7.0f}")
    return "\n".join(lines)


PROG = "python -m cuflash roofline"


def _parser() -> argparse.ArgumentParser:
    positive = cli.int_at_least(1)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="A roofline read from the kernels' SASS (a MODEL, not a measurement): per K/V tile "
                    "of the main loop, the tensor, shared-memory, MUFU, FP32, issue and HBM pipes' cycles "
                    "and the binding one's predicted ceiling. Needs NVRTC (CuPy) and the "
                    "nvidia-cuda-cuobjdump/nvdisasm wheels; no GPU. Compiling every variant takes minutes: "
                    "progress is shown on stderr when it is a terminal (a tqdm bar when tqdm is installed).")
    p.add_argument("--device", default=cli.DEFAULT_DEVICE, choices=sorted(RATES),
                   help=f"per-SM rates (default {cli.DEFAULT_DEVICE})")
    p.add_argument("--arch", type=positive, default=None, help="compute capability; must match the device's")
    p.add_argument("--dtype", type=cli.dtype_arg(KERNEL_DTYPES), default="bfloat16",
                   help=f"{cli.dtype_help(KERNEL_DTYPES)} (default bfloat16)")
    p.add_argument("--head-dim", type=positive, default=None, help="the variant chosen for this head dim (default: all)")
    p.add_argument("--head-dim-v", type=positive, default=None, help="value head dim, with --head-dim (default: --head-dim)")
    p.add_argument("--backward", action="store_true", help="the backward pass")
    p.add_argument("--forward-and-backward", action="store_true", help="both passes")
    p.add_argument("--varlen", action="store_true", help="the packed variable-length kernels (attention_varlen)")
    p.add_argument("--seqlen", type=positive, default=None,
                   help="reference sequence length of the HBM pipe; with --call-mix the query length Sq (default 8192; "
                        "not with --decode)")
    p.add_argument("--decode", action="store_true",
                   help="the KV-cache (decode) kernel: per key tile, paged and contiguous caches, for --rows packed "
                        "query rows (GQA group x Sq)")
    p.add_argument("--rows", type=positive, default=None, help="packed query rows per CTA, with --decode (default 4)")
    p.add_argument("--what-if", choices=("tf32", "m8n8k4"), default=None,
                   help="model a tensor-core forward that does not exist, from the float16 one's SASS: tf32 (float32 "
                        "on mma.sync .tf32; --device a100, h100 or h200) or m8n8k4 (float16 on the V100's "
                        "mma.sync.m8n8k4; --device v100), beside the portable tier those users run today")
    p.add_argument("--json", metavar="FILE", help="write the records (one per variant) as JSON to FILE ('-' for "
                                                  "stdout, the table then goes to stderr)")
    p.add_argument("--sass", metavar="DIR", help="keep the disassembly read, one file per variant")
    p.add_argument("--wide", action="store_true",
                   help=f"the full table (every count and pipe); default: the main columns in {TABLE_COLUMNS} columns")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--sass-of", metavar="FILE",
                   help="count the main loop of a kernel in FILE instead (a cubin, shared library or executable, "
                        "disassembled with cuobjdump -sass, or a cuobjdump -sass text: .sass/.txt), with --kernel")
    p.add_argument("--kernel", metavar="NAME",
                   help="with --sass-of: the function whose mangled or demangled name contains NAME")
    g = p.add_argument_group(
        "a whole call (--call-mix)",
        "the instructions a forward call executes: the tiles of each path of the key walk the grid runs for the "
        "call's shape, times each path's per-warp count; our Hopper forward with --head-dim (its walk read from its "
        "source), or the kernel of --sass-of with its walk described by --block-m, --block-n and --walk")
    g.add_argument("--call-mix", action="store_true", help="count a whole call (the flags below)")
    g.add_argument("--seqlen-k", type=positive, default=None, help="key length Sk (default: --seqlen)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                   help="bottom-right aligned causal mask (default: none)")
    g.add_argument("--window", type=cli.int_at_least(-1), nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                   help="local window (left, right), -1 unbounded; with --causal RIGHT is 0 (or -1)")
    g.add_argument("--batch", type=positive, default=1, help="batch B (default 1)")
    g.add_argument("--heads", type=positive, default=1, help="query heads H (default 1)")
    g.add_argument("--block-m", type=positive, default=None, help="with --sass-of: query rows per tile")
    g.add_argument("--block-n", type=positive, default=None, help="with --sass-of: keys per tile")
    g.add_argument("--walk", choices=("down", "up"), default=None,
                   help="with --sass-of: the order of each query tile's key tiles, from the last down "
                        "(FlashAttention-3) or from the first up; the first tile runs before the loops")
    g.add_argument("--math-warps", type=positive, default=None,
                   help="with --sass-of: warps running the loop per tile (default block-m / 16)")
    return p


#: the flags of --call-mix, and those of them that describe another kernel's walk
CALL_FLAGS = ("seqlen_k", "causal", "window", "batch", "heads", "block_m", "block_n", "walk", "math_warps")
WALK_FLAGS = ("block_m", "block_n", "walk", "math_warps")


def _refuse_meaningless(parser: argparse.ArgumentParser, args, rates: SmRates) -> None:
    """parser.error for a combination of flags that means nothing."""
    if args.arch is not None and args.arch != rates.arch:
        fits = sorted(name for name, r in RATES.items() if r.arch == args.arch)
        hint = f"; a preset of that arch: --device {' / '.join(fits)}" if fits else ""
        parser.error(f"--arch {args.arch} does not match --device {args.device} (sm_{rates.arch}; the default "
                     f"device is {cli.DEFAULT_DEVICE}){hint}")
    if args.backward and args.forward_and_backward:
        parser.error("--backward with --forward-and-backward: pick one")
    if args.what_if:
        devices = WHAT_IF_FORMS[args.what_if].devices
        if args.device not in devices:
            parser.error(f"--what-if {args.what_if} models --device {' or '.join(devices)}, not {args.device}")
        for flag, given in (("--backward", args.backward), ("--forward-and-backward", args.forward_and_backward),
                            ("--varlen", args.varlen), ("--decode", args.decode), ("--call-mix", args.call_mix),
                            ("--sass-of", args.sass_of is not None), ("--head-dim-v", args.head_dim_v is not None)):
            if given:
                parser.error(f"{flag} with --what-if: the what-if models the fixed-shape forward; drop {flag}")
    defaults = {"causal": False, "batch": 1, "heads": 1}
    given_call = [f for f in CALL_FLAGS if getattr(args, f) != defaults.get(f)]
    if not args.call_mix and given_call:
        parser.error(f"--{given_call[0].replace('_', '-')} applies to --call-mix only; add --call-mix or drop it")
    if args.call_mix:
        for flag, given in (("--decode", args.decode), ("--backward", args.backward),
                            ("--forward-and-backward", args.forward_and_backward), ("--varlen", args.varlen)):
            if given:
                parser.error(f"{flag} with --call-mix: the call mix is the fixed-shape forward's; drop {flag}")
        if args.sass_of is None:
            if args.head_dim is None:
                parser.error("--call-mix needs --head-dim (the forward chosen for it), or --sass-of and --kernel")
            walk = [f for f in WALK_FLAGS if getattr(args, f) is not None]
            if walk:
                parser.error(f"--{walk[0].replace('_', '-')} describes the walk of a --sass-of kernel; our "
                             "forward's walk is read from its source: drop it")
        else:
            missing = [f"--{f.replace('_', '-')}" for f in ("block_m", "block_n", "walk") if getattr(args, f) is None]
            if missing:
                parser.error(f"--call-mix with --sass-of needs the kernel's walk: {', '.join(missing)}")
    if args.decode and rates.arch < 75:
        parser.error(f"--decode models the KV-cache kernel, which runs on sm_75 and newer; --device {args.device} "
                     f"is sm_{rates.arch}")
    if args.decode and rates.arch < 80 and cli.canonical_dtype(args.dtype or "bf16") != "float16":
        parser.error(f"--decode on --device {args.device} (sm_{rates.arch}): its KV-cache kernel computes float16 "
                     "(no bfloat16 tensor cores); add --dtype fp16")
    if args.decode:
        for flag, given in (("--backward", args.backward), ("--forward-and-backward", args.forward_and_backward),
                            ("--varlen", args.varlen), ("--seqlen", args.seqlen is not None)):
            if given:
                parser.error(f"{flag} with --decode: the decode model is the KV-cache forward kernel's, "
                             f"per key tile; drop {flag} or --decode")
        if args.head_dim_v is not None and args.head_dim is None:
            parser.error("--head-dim-v needs --head-dim (one value head dim for every head dim means nothing)")
    else:
        if args.rows is not None:
            parser.error("--rows applies to --decode only; add --decode or drop --rows")
        if args.head_dim_v is not None and args.head_dim is None:
            parser.error("--head-dim-v needs --head-dim (without it every variant is listed, whatever its head dims)")


def _install_hint(exc: BaseException) -> str:
    return (f"{exc}; the command compiles with NVRTC through CuPy and disassembles with cuobjdump/nvdisasm: "
            "pip install 'cuflash[cuda12,test]' (or cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 "
            "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def _say(text: str, out) -> None:
    import textwrap

    print(textwrap.fill(text, TABLE_COLUMNS, break_on_hyphens=False), file=out)


def _write_json(path: str, records) -> None:
    text = json.dumps(records, indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text)


@cli.command(PROG)
def main(argv: list[str] | None = None) -> int:
    """``python -m cuflash roofline``: the model's table for the variants chosen by the flags.

    Returns
    -------
    int
        0 on success; 2 for invalid arguments (``python -m cuflash roofline: error: ...``); 1 when
        the compiler or the SASS tools are missing or fail.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    rates = RATES[args.device]
    if (args.sass_of is None) != (args.kernel is None):
        parser.error("--sass-of and --kernel go together: give both or neither")
    _refuse_meaningless(parser, args, rates)
    out = sys.stderr if args.json == "-" else sys.stdout
    try:
        if args.what_if:
            return _main_what_if(args, out)
        if args.call_mix:
            return _main_call_mix(args, rates, out)
        if args.sass_of is not None:
            return _main_sass_of(args, out)
        if args.decode:
            return _main_decode(args, rates, out)
        return _main_loops(args, rates, out)
    except ImportError as e:
        cli.error(PROG, _install_hint(e))
        return 1
    except RuntimeError as e:
        if isinstance(e, NotImplementedError):   # cuflash refusing the input: cli.command's, status 2
            raise
        cli.error(PROG, str(e).removeprefix("cuflash.roofline: "))
        return 1


def _main_loops(args, rates: SmRates, out) -> int:
    backward = None if args.forward_and_backward else args.backward
    seqlen = 8192 if args.seqlen is None else args.seqlen
    chosen = variants(rates.arch, backward=backward, dtype=args.dtype, head_dim=args.head_dim,
                      head_dim_v=args.head_dim_v, varlen=args.varlen)
    rows = [analyze(v, args.device, seqlen=seqlen, sass_dir=args.sass)
            for v in cli.progress(chosen, "roofline", enabled=not args.no_progress, label=lambda v: v.entry)]
    records = [r.as_dict() for r in rows]
    if args.head_dim is not None:
        want_d, want_dv = args.head_dim, args.head_dim_v or args.head_dim
        for r, rec in zip(rows, records):
            useful = (want_d + want_dv) / (r.head_dim + r.head_dim_v) if r.direction == "fwd" else \
                (3 * want_d + 2 * want_dv) / (3 * r.head_dim + 2 * r.head_dim_v)
            rec.update(requested_head_dim=want_d, requested_head_dim_v=want_dv, useful_fraction=round(useful, 4))
    if args.json:   # before the text, which a reader of stdout may cut short (| head)
        _write_json(args.json, records)
    _say(f"MODEL, not a measurement: per-SM rates of the {rates.device.name} (sm_{rates.arch}, {rates.sms} SMs at "
         f"{rates.clock_ghz:.2f} GHz); counts per warp and K/V tile of the main loop (unmasked path), pipe "
         "cycles per tile and CTA; * marks loops with inner loops (counted once: lower bounds)"
         + ("" if args.wide else f"; kernels without their {ENTRY_PREFIX} prefix, --wide for every count and pipe")
         + ". Sources of the rates:", out)
    print(f"  python -c 'import cuflash.analysis.roofline as r; print(r.RATES[\"{args.device}\"].source)'", file=out)
    print(format_table(rows, wide=args.wide), file=out)
    if any(r.sass_arch for r in rows):
        _say(f"note: the counts are read from the sm_{rows[0].sass_arch} build of the same source (the "
             f"disassembler here, CUDA 13's, reads no sm_{rates.arch} code; CUDA 12's cuobjdump and nvdisasm "
             f"would), registers too; the rates and occupancy limits are the {rates.device.name}'s", out)
    for r, rec in zip(rows, records):
        useful = rec.get("useful_fraction", 1)
        if useful < 1:
            _say(f"note: head dim {rec['requested_head_dim']} (v {rec['requested_head_dim_v']}) runs in the "
                 f"d{r.head_dim} bucket of {r.entry}: the figures are that kernel's, {useful:.0%} of its FLOPs are "
                 f"useful (ceiling for D={rec['requested_head_dim']}: {r.ceiling_tflops * useful:.0f} TFLOP/s, "
                 "predicted)", out)
    return 0


def format_paths(name: str, paths: dict) -> str:
    """The named passes' table: instructions per warp and pass, per 16 tensor instructions, and
    the class mix per pass."""
    from cuflash.analysis import sass_count

    cls = sass_count.CLASSES
    head = f"{'path':<15} {'insns':>6} {'/16T':>7} {'o/100k':>6} " + " ".join(f"{c[:6]:>6}" for c in cls)
    lines = [f"kernel: {name}", head, "-" * len(head)]
    for p in paths.values():
        lines.append(f"{p.path:<15} {p.instructions:>6} {p.per_16_tensor():>7.1f} {p.per_100k_macs():>6.0f} "
                     + " ".join(f"{p.classes[c]:>6}" for c in cls))
    return "\n".join(lines)


def _main_sass_of(args, out) -> int:
    from cuflash.analysis import sass_count

    name, insns = sass_count.read_sass(args.sass_of, args.kernel)
    paths = sass_count.count_loop(insns)
    if args.json:
        _write_json(args.json, {"kernel": name, "paths": {
            k: {"instructions": p.instructions, "per_16_tensor": p.per_16_tensor(), "classes": p.classes, "macs_per_warp": p.macs,
                "rescale": p.rescale} for k, p in paths.items()}})
    _say("Counts per warp and pass of the main loop (the innermost natural loop holding tensor instructions), "
         "along the named paths; /16T: instructions per 16 tensor instructions; o/100k: non-tensor instructions "
         "per 100k MACs", out)
    print(format_paths(name, paths), file=out)
    return 0


def call_mix(args, rates: SmRates):
    """The :class:`cuflash.analysis.call_mix.Mix` of the call the flags describe: our Hopper
    forward (compiled for ``--head-dim``) or the ``--sass-of`` kernel with the walk the flags give.

    Raises
    ------
    ValueError
        For a window that means nothing, a device without the Hopper forward, or SASS whose loops
        do not match the walk.
    RuntimeError
        If NVRTC or the SASS tools fail or are missing.
    """
    from cuflash.analysis import call_mix as cm
    from cuflash.analysis import sass_count

    left, right = cm.window_of(args.causal, args.window)
    sq = 8192 if args.seqlen is None else args.seqlen
    sk = sq if args.seqlen_k is None else args.seqlen_k
    bh = args.batch * args.heads
    if args.sass_of is not None:
        name, insns = sass_count.read_sass(args.sass_of, args.kernel)
        walk = cm.anchor_walk(sq, sk, left=left, right=right, block_m=args.block_m, block_n=args.block_n,
                              order=args.walk, warps=args.math_warps)
        per_warp, first_as = cm.anchor_paths(sass_count.count_loops(insns))
        return cm.Mix(name, walk, per_warp, first_as, bh)
    chosen = variants(rates.arch, backward=False, dtype=args.dtype, head_dim=args.head_dim, head_dim_v=args.head_dim_v)
    if not chosen or chosen[0].family != "attn_fwd_sm90":
        raise ValueError(f"cuflash.roofline: --call-mix: the call mix follows the Hopper forward's walk, which "
                         f"--device {args.device} (sm_{rates.arch}) does not run; use --device h100 or h200")
    local = left >= 0 or right >= 0
    variant = dataclasses.replace(chosen[0], local=local)
    text, _ = compile_sass(variant, rates.arch)
    _keep_sass(text, variant, rates.arch, args.sass)
    per_warp, first_as = cm.hopper_paths(sass_count.count_loops(parse_sass(text, variant.entry)), local)
    walk = cm.hopper_walk(sq, sk, left=left, right=right, block_m=variant.block_m, block_n=variant.block_n)
    return cm.Mix(variant.entry, walk, per_warp, first_as, bh)


def _main_call_mix(args, rates: SmRates, out) -> int:
    from cuflash.analysis import call_mix as cm
    from cuflash.analysis import sass_count

    mix = call_mix(args, rates)
    left, right = cm.window_of(args.causal, args.window)
    sq = 8192 if args.seqlen is None else args.seqlen
    sk = sq if args.seqlen_k is None else args.seqlen_k
    record = {"seqlen": sq, "seqlen_k": sk, "window": [left, right], **mix.as_dict()}
    if args.json:
        _write_json(args.json, record)
    mask = "causal" if args.causal else ("no mask" if (left, right) == (-1, -1) else f"window ({left}, {right})")
    _say(f"A COUNT, not a speed: the instructions a forward call executes (Sq {sq}, Sk {sk}, {mask}, batch x heads "
         f"{args.batch * args.heads}): per path of the key walk, the tiles the grid runs times each path's per-warp "
         "instructions (its loop's pass with every tensor instruction and copy and the fewest instructions) times "
         f"the warps per tile. The first tile of each walk runs before the loops: its figure is assumed to be the "
         f"{mix.first_as} loop's, and the totals are given without it (loops) and with it (all).", out)
    if args.sass_of is not None:
        _say(f"Walk assumed from the flags: {args.block_m} x {args.block_n} tiles, keys walked {args.walk}, the first "
             "tile outside the loops, every other tile the mask cuts in the longest loop, the rest in the shortest.", out)
    print(cm.format_mix(mix, sass_count.CLASSES), file=out)
    return 0


def _main_what_if(args, out) -> int:
    from cuflash.kernels import attention_fwd_mma

    form = WHAT_IF_FORMS[args.what_if]
    dims = [args.head_dim] if args.head_dim else list(attention_fwd_mma.HEAD_DIM_BUCKETS)
    seqlen = 8192 if args.seqlen is None else args.seqlen
    rows = [what_if(args.what_if, args.device, d, seqlen=seqlen)
            for d in cli.progress(dims, "roofline --what-if", enabled=not args.no_progress, label=str)]
    if args.json:   # before the text, which a reader of stdout may cut short (| head)
        _write_json(args.json, [w.as_dict() for w in rows])
    rates = RATES[args.device]
    _say(f"MODEL, not a measurement, of a kernel that does not exist: {form.title} on the {rates.device.name}. "
         f"Counts of the float16 tensor-core forward (its sm_{rows[0].base_arch} SASS), each instruction replaced by "
         "what the form would issue (python -c 'import cuflash.analysis.roofline as r; help(r.tf32_counts); help(r.m8n8k4_counts)'); its tensor rate: "
         f"{form.rate_source}. Pipe cycles per tile and CTA, unmasked path; 'issue*' the masked path's; 'st' the "
         f"K/V stages that fit. 'today': the portable tier's forward in {form.users_dtype} on the same device "
         "(counted from its SASS), the ratio of the two ceilings last.", out)
    print(format_what_if_table(rows), file=out)
    return 0


def _main_decode(args, rates: SmRates, out) -> int:
    from cuflash.kernels import attention_fwd_mma

    rows_per_cta = 4 if args.rows is None else args.rows
    dt = _numpy_dtype(args.dtype)
    dims = [args.head_dim] if args.head_dim else list(attention_fwd_mma.HEAD_DIM_BUCKETS)
    chosen = [attention_fwd_mma.choose_variant(dt, d, args.head_dim_v or d, rates.arch, kvcache=True) for d in dims]
    jobs = [(v, c) for v in chosen for c in ("paged", "contiguous")]
    rows = [analyze_decode(v, args.device, rows=rows_per_cta, cache=c, sass_dir=args.sass)
            for v, c in cli.progress(jobs, "roofline --decode", enabled=not args.no_progress,
                                     label=lambda job: f"{job[0].entry} {job[1]}")]
    if args.json:   # before the text, which a reader of stdout may cut short (| head)
        _write_json(args.json, [dataclasses.asdict(r) for r in rows])
    _say(f"MODEL, not a measurement: a decode step on the KV-cache kernel, per key tile and CTA, with {rows_per_cta} "
         f"packed query rows; per-SM rates of the {rates.device.name} (sm_{rates.arch}); HBM % is the share of "
         "its bandwidth the binding pipe leaves (throughput only: latency and bytes in flight are not modelled)"
         + ("" if args.wide else f"; kernels without their {ENTRY_PREFIX} prefix, --wide for every pipe"), out)
    print(format_decode_table(rows, wide=args.wide), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
