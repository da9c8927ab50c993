"""The portable attention backward (``kernels_cu/attention_bwd_simt.cu``): its variants.

Three stages, each its own variant of the one source file: ``dot`` (``Dd = rowsum(dO * O)``),
``main`` (dK, dV per key tile in registers, dQ into a float32 workspace with atomics) and
``convert`` (the workspace to the input dtype). Every dtype (fp16, bf16, fp32) on sm_75+; the main
stage has dropout and score-modifier forms (``dropout``, ``mods``: dbias when asked). The
dot and convert stages serve every backward tier; :mod:`cuflash.kernels.backward_run` plans
and launches the three (and the deterministic mode's ordered dQ partials).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


from cuflash.kernels import attention_fwd_simt
from cuflash.runtime import variants

THREADS = 128
#: (Br, Bc) of the main stage by head-dim bucket; K, V, Q, dO tiles and P, dS live in shared
#: memory as float32 (see the kernel's layout), within sm_75's 64 KB opt-in limit
TILES = {32: (32, 32), 64: (32, 32), 128: (16, 32), 256: (8, 16)}
#: __launch_bounds__ minimum blocks per SM of the main stage by bucket (128 threads: 4 -> at
#: most 128 registers, 3 -> 168)
MIN_BLOCKS = {32: 4, 64: 4, 128: 3, 256: 3}
#: ... of the dropout and score-modifier forms: 3 (168 registers) for every bucket; at 128 the
#: packed dropout-and-modifier form spills (4 bytes stored, 68 loaded: d64, sm_90, NVRTC 13)
MIN_BLOCKS_FEATURES = 3
#: ... and of the packed score-modifier forms and those of buckets 128 and 256: 2 (255 registers);
#: at 168 they spill (12-24 bytes packed at d128 and d256, sm_90, NVRTC 12; the fixed-shape d128
#: and d256 forms on sm_75 and sm_80 with NVRTC 12 and 13)
MIN_BLOCKS_WIDE_MODS = 2
STAGES = ("dot", "main", "convert")
ARCHES = attention_fwd_simt.ARCHES


@dataclasses.dataclass(frozen=True)
class AttentionBwdSimt(variants.BucketTiledVariant):
    """One stage of the portable backward for one dtype and head-dim bucket (the ``dot`` and
    ``convert`` stages have no head-dim or tile axis: they are built with bucket 32)."""

    family: ClassVar[str] = "attn_bwd_simt"
    source: ClassVar[str] = "attention_bwd_simt.cu"
    head_dim_buckets: ClassVar[tuple[int, ...]] = tuple(TILES)
    tiles: ClassVar[dict[int, tuple[int, int]]] = TILES
    threads: ClassVar[int] = THREADS

    stage: str
    dtype: str
    head_dim_max: int

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"AttentionBwdSimt: stage={self.stage!r} must be one of {STAGES}")
        super().__post_init__()

    def axes(self) -> tuple[str, ...]:
        if self.stage == "main":
            return (self.stage,) + super().axes()
        return (self.stage, self.dtype)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main stage (0 for the others); the kernel checks it."""
        if self.stage != "main":
            return 0
        bm, bn = self.tile
        row = self.head_dim_max + 1
        return 4 * (2 * bn * row + 2 * bm * row + 2 * bm * (bn + 1) + 2 * bm)

    @property
    def min_blocks(self) -> int:
        """The main stage's ``__launch_bounds__`` minimum blocks per SM (the register budget)."""
        if self.mods and (self.varlen or self.head_dim_max >= 128):
            return MIN_BLOCKS_WIDE_MODS
        if self.dropout or self.mods:
            return min(MIN_BLOCKS[self.head_dim_max], MIN_BLOCKS_FEATURES)
        return MIN_BLOCKS[self.head_dim_max]

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_BWD_STAGE", str(STAGES.index(self.stage))),
            ("CUFLASH_MIN_BLOCKS", str(self.min_blocks)),
        )


def all_variants(arch: int, *, varlen: bool = False, dropout: bool = False,
                 mods: bool = False) -> tuple[AttentionBwdSimt, ...]:
    """Every backward variant the dispatcher can choose (the same on every arch >= sm_75); with
    ``varlen``, ``dropout``, ``mods``, the main stage's packed, dropout and score-modifier forms
    (the other stages take every call: they come with the plain forms only)."""
    out = []
    for key in variants.DTYPES:
        if not (varlen or dropout or mods):
            out += [AttentionBwdSimt("dot", key, 32), AttentionBwdSimt("convert", key, 32)]
        out += [AttentionBwdSimt("main", key, b, varlen=varlen, dropout=dropout, mods=mods) for b in TILES]
    return tuple(out)


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionBwdSimt:
    """The main-stage variant the backward runs for these head dims (the dot and convert stages
    have one variant per dtype)."""
    return AttentionBwdSimt("main", variants.dtype_key(dtype), AttentionBwdSimt.bucket(head_dim, head_dim_v))


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the portable backward cannot take ``problem`` (None if it can): the forward's rule (only
    a device older than sm_70); it takes every dtype, alignment, score modifier and dropout."""
    return attention_fwd_simt.unsupported_reason(problem, arch, arrays)


def main_variant(problem, arch: int) -> AttentionBwdSimt:
    """The main stage that runs the backward of ``problem``, in the dropout and modifier forms the
    call needs (the dispatcher runs it between the dot and convert stages:
    :func:`cuflash.kernels.backward_run.backward`)."""
    v = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    return dataclasses.replace(v, dropout=problem.dropout is not None, mods=problem.modifiers is not None)
