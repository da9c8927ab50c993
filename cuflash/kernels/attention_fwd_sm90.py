"""Host side of ``kernels_cu/attention_fwd_sm90.cu``: the Hopper tier of the forward (docs/kernels.md).

FA3's design (Shah et al., "FlashAttention-3", 2024, §3.1-3.2): per block of 128 query rows, a
producer warpgroup feeds two consumer warpgroups through TMA and mbarriers (K and V in rings of
their own); wgmma runs both GEMMs, the online softmax stays in registers and runs while the
previous tile's P V wgmma does (intra-warpgroup overlap) and while the other consumer's GEMMs do
(ping-pong); the output leaves by TMA store. The kernel is compiled for
``sm_90a`` and runs on compute capability 9.0 only (the dispatcher passes it over elsewhere,
visibly). Calls it takes: f16/bf16, D and Dv multiples of 8 up to 256 with Dv <= D in the head-dim
buckets 64, 96, 128, 192, 256 (the tile's unused columns are the tensor maps' zero fill), causal
and windows (bottom-right), GQA, rows without keys (0 / lse -inf), the score modifiers (softcap,
ALiBi, bias, boolean mask, sinks: the ``mods`` forms), and any strides a tensor map can describe:
the head dim contiguous, every other stride and each base 16-byte aligned. Packed batches
(``cuflash.attention_varlen``, with ``seqused_k``; the ``varlen`` forms) run here too, with softcap and
ALiBi (``varlen`` + ``mods``) or without:
sequence starts come from ``cu_seqlens`` on the device, and ragged tensor maps
(:meth:`cuflash.runtime.tensor_map.TensorMap.ragged`) clip every load and store at its sequence's
end. KV caches (``cuflash.attention_with_kvcache``, contiguous or paged, with ``Sq`` from
:data:`KVCACHE_MIN_ROWS` on; the ``kvcache`` forms) run here too: the producer warpgroup gathers K
and V from the cache with cp.async (:func:`plan_kvcache`; where a paged cache's pages hold whole
key tiles, and for contiguous caches, the ``kv_tma`` forms load whole key tiles by TMA,
:func:`kvcache_tma_reason`), split-KV
merges by the combine kernel;
with softcap, ALiBi or sinks (:data:`KVCACHE_MODIFIERS`) their ``mods`` forms (the sink in split 0's
rows only, so that the combine counts it once a row).
A traced ``score_mod`` / ``mask_mod`` (:mod:`cuflash.runtime.score_mod`) is one more axis of the
``mods`` forms (the same emitted C as the tensor-core tier's, the same cache key: the functions'
canonical text), and a block mask runs their ``bs`` form, which walks the mask's key-block lists
(:data:`BLOCK_SPARSE_BLOCK_N`, :func:`block_mask_reason`).
fp8 (``float8_e4m3fn`` q, k, v with their descales; the ``fp8`` forms, entry suffix ``_e4m3``)
runs here on fixed shapes: S = Q K^T and O = P V on wgmma m64nNk32 .e4m3, P converted to e4m3 in
registers, the descales folded into the score scale and the output (:func:`plan_fp8`). fp8 wgmma
takes K-major operands only, so V is copied on the device, before the launch, into a key-contiguous
array whose keys are permuted within 32-key blocks to match P's register fragment
(:func:`fp8_value_copy`): one read and one write of V per call, and ``B * Hk * Dv * Sk'`` bytes of
workspace (``Sk'``: Sk rounded up to 32). Any V view is taken (its strides do not matter to the
copy). Packed fp8 batches (the ``varlen`` + ``fp8`` forms) take V from one copy in which each
sequence starts at a multiple of 32 keys and has zeros up to a whole tile after its end
(:func:`fp8_value_copy_packed`, built on the device from the index), so no tile reads another
sequence's values. fp8 KV caches run elsewhere (``explain`` says where).
Decode-like KV-cache calls (``Sq`` under 128) with a group of ``G`` query heads per kv head (2 to 64)
run GQA-packed when ``Sq * G`` fills half a tile and packing takes no more tiles than unpacked
(the ``kvcache`` + ``gqa`` forms, :func:`gqa_pack`): a block per kv head whose rows are the group's heads at consecutive
positions (each consumer's 64 rows ``64 // G`` positions of the G heads), q and o through 5-d
tensor maps. Plain fixed-shape calls with ``Sq`` under 128 and such a
group pack the same way (the ``gqa`` forms without ``kvcache``; one rule, :func:`gqa_pack_reason`).
Chunked prefill (``attention_varlen`` with a ``block_table``; the ``varlen`` + ``kvcache`` forms)
runs the KV-cache forms' gather under packed queries: q and o through the packed forms' ragged
maps, each sequence's key count from the packed index on the device (:func:`plan_kvcache`),
split-KV as the KV-cache forms (partial rows (head, total_q row); d256 unsplit).
The rest (fp32, dropout, traced functions on packed batches, decode-like KV-cache calls that
neither ``Sq`` nor GQA packing brings to half a tile, decode-like chunked prefill, Sk = 0, views TMA cannot describe, block masks whose blocks do not hold whole
Hopper tiles, windows whose shapes could carry the kernel's 32-bit window sums past ``2**31 - 1``,
:func:`window_reason`) goes to the tensor-core mma.sync tier, and ``explain`` says why.

Tiles (the roofline's per-head-dim choice; shared memory per block = Q + two stages of K and V +
1 KB of alignment): Br = 128 always; Bc = 128 for head dims up to 128, 112 for 192, 80 for 256.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from cuflash.kernels import attention_fwd_mma, forward_run
from cuflash.kernels import launch_args as la
from cuflash.runtime import plan, score_mod, variants
from cuflash.runtime.plan import LaunchPlan, PointerArg, ScalarArg, TensorMapArg
from cuflash.runtime.tensor_map import TensorMap
from cuflash.runtime.validation import MAX_SPLITS
from cuflash.runtime.validation_modifiers import refuse_modifiers

#: this module's tier, in the dispatcher's words
TARGET_ARCH = "90a"
HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
#: keys per tile by the QK head-dim bucket (shared memory: Q + 2 stages of K and V <= 227 KB)
BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}
#: the modifier forms' exceptions, by (D, Dv): at (192, 192) with a window, 112 keys spill 20 bytes
#: (both NVRTCs; the per-pair modifier code beside the 96-column O), 96 do not
BLOCK_N_MODS = {(192, 192): 96}
BLOCK_M = 128
STAGES = 2
#: the module takes fp8 (float8_e4m3fn) q, k, v (the dispatcher's rule, :func:`fp8_reason`)
FP8_FORM = True
#: the fp8 forms' head-dim buckets (D and Dv in the same one) and keys per tile: 192 at 128 (the
#: per-tile O rescale and loop overhead over more keys: 571 (NVRTC 13) or 598 (12.9) steady-loop
#: instructions per warp, 0.74 or 0.78 of the tile's fp8 tensor cycles in issue cycles, against 459
#: and 0.90 for 128 keys),
#: 64 at 256, where O's 128 accumulators a thread leave no registers for 128 keys' scores
FP8_HEAD_DIM_BUCKETS = (64, 128, 256)
#: the head-dim buckets GQA packing takes: at 256 the packed form's consumers spill under NVRTC 13
#: (28 B stores, 128 B loads; the unpacked KV-cache form at 256 has no register to spare)
GQA_HEAD_DIM_BUCKETS = (64, 96, 128, 192)
BLOCK_N_FP8 = {64: 128, 128: 192, 256: 64}
#: keys per block of the permutation fp8 V^T carries (:func:`fp8_value_copy`)
FP8_KEY_BLOCK = 32
PANEL = 64   # head-dim elements per 128-byte swizzle row
DTYPES = ("f16", "bf16")
TMA_ALIGN = 16
#: the score modifiers the kernel takes (its ``mods`` forms; kernels_cu/score_mods.cuh)
MODIFIERS = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
#: the ones its packed (varlen) forms take (those ``cuflash.attention_varlen`` has but the traced functions)
VARLEN_MODIFIERS = ("softcap", "alibi_slopes")
#: and the traced functions (the ``mods`` forms with ``score_c``/``mask_c``: CUFLASH_USER_MOD) and
#: the block mask (their ``block_sparse`` form)
USER_MODIFIERS = ("score_mod", "mask_mod", "block_mask")
#: keys per tile of the block-sparse forms: a key block of the mask must be whole tiles, so 128 up to
#: :data:`BLOCK_SPARSE_N128_MAX` where KV_BLOCK is a multiple of 128, else 64 (which divides every
#: BLOCK_SIZE)
BLOCK_SPARSE_BLOCK_N = (128, 64)
#: the largest bucket whose block-sparse form takes 128 keys: above it the list walk beside the 64
#: scores a thread holds spills (NVRTC 12.9, a softcapped ALiBi with a table and a document mask:
#: 8 bytes at 96, 24 at 128), 64 keys do not
BLOCK_SPARSE_N128_MAX = 64
#: keys per tile of the traced (dense) forms where they differ from the modifier forms': at 256 the
#: traced score_mod beside 80 keys spills 56 bytes (NVRTC 12.9, the same function), 64 do not
BLOCK_N_USER = {256: 64}
#: the widest key tile of any form (the window arithmetic's rounding to tiles, :func:`window_reason`)
BLOCK_N_MAX = max(*BLOCK_N.values(), *BLOCK_N_MODS.values(), *BLOCK_N_FP8.values(), *BLOCK_SPARSE_BLOCK_N,
                  *BLOCK_N_USER.values())


#: the smallest normal float32: the plain forms' stand-in for a zero scale (:func:`scale_arg`)
FLT_MIN = float(np.finfo(np.float32).tiny)


def scale_arg(softmax_scale: float, prescale: bool) -> ScalarArg:
    """The kernel's ``scale_log2``: ``softmax_scale * log2(e)`` as float32. The plain forms (``prescale``
    False; non-negative scales only, :func:`scale_reason`) take P = exp2(s * scale_log2 - m) on the
    raw scores, so a scale that is zero (or below the smallest normal float32, which the device
    flushes to zero) is passed as FLT_MIN: every finite score's exponent then rounds to 0 as with 0,
    and a hidden score's stays -inf, not the NaN of -inf * 0. The modifier forms (``prescale``)
    scale the scores first and take it as it is."""
    s = np.float32(softmax_scale * math.log2(math.e))
    if not prescale and 0 <= s < FLT_MIN:
        s = np.float32(FLT_MIN)
    return ScalarArg("scale_log2", s)


class ThreeWarpgroups:
    """The launch shape the Hopper kernels share: three warpgroups, a producer's and two
    consumers' (the consumers run the main loop: the roofline's pipes)."""

    @property
    def block(self) -> tuple[int, int, int]:
        return (384, 1, 1)

    @property
    def threads(self) -> int:
        return 384

    @property
    def math_threads(self) -> int:
        """The consumer warpgroups' threads, which run the main loop (the roofline's pipes)."""
        return 256

    @property
    def head_dim_max(self) -> int:
        return self.head_dim


@dataclasses.dataclass(frozen=True)
class Sm90ForwardVariant(ThreeWarpgroups, variants.Variant):
    """One compiled form of the Hopper forward.

    Parameters
    ----------
    dtype : {"f16", "bf16"}
    head_dim, head_dim_v : int
        Buckets of D and Dv (one of :data:`HEAD_DIM_BUCKETS`; Dv <= D).
    local : bool
        Causal or a window (tile skipping and boundary masking compiled in).
    """

    family: ClassVar[str] = "attn_fwd_sm90"
    source: ClassVar[str] = "attention_fwd_sm90.cu"
    target_arch: ClassVar[str | None] = TARGET_ARCH

    dtype: str
    head_dim: int
    head_dim_v: int
    local: bool
    #: the score modifiers (``CUFLASH_MODS``: softcap, ALiBi, bias, boolean mask, sinks as run-time
    #: arguments, kernels_cu/score_mods.cuh); a compile-time axis, so a plain call runs without them
    mods: bool = False
    #: packed variable-length batches (``CUFLASH_VARLEN``: ragged tensor maps, the sequence index on
    #: the device); a compile-time axis, so a fixed-shape call runs exactly the fixed kernel
    varlen: bool = False
    #: the KV-cache form (``CUFLASH_KVCACHE``: K and V gathered from a contiguous or paged cache by the
    #: producer warpgroup, split-KV); always ``local`` (an unbounded window runs the same steady loop);
    #: with ``varlen``, chunked prefill (packed q and o, the sequences' key counts from the packed
    #: index; split-KV partial rows (head, total_q row), d256 unsplit)
    kvcache: bool = False
    #: a traced score_mod's and mask_mod's CUDA C (:func:`cuflash.runtime.score_mod.kernel_texts`; ""
    #: for none): an axis of the ``mods`` forms (``CUFLASH_USER_MOD``), named by a hash of the two
    score_c: str = dataclasses.field(default="", kw_only=True)
    mask_c: str = dataclasses.field(default="", kw_only=True)
    #: the block-sparse form (``CUFLASH_BLOCK_SPARSE``, entry suffix ``_bs``): the walk over a block
    #: mask's lists, with ``tile_n`` keys per tile (:data:`BLOCK_SPARSE_BLOCK_N`)
    block_sparse: bool = dataclasses.field(default=False, kw_only=True)
    #: keys per tile of a traced form where not the modifier forms' (entry suffix ``_n<Bc>``; 0: theirs)
    tile_n: int = dataclasses.field(default=0, kw_only=True)
    #: the fp8 form (``CUFLASH_FP8``, entry suffix ``_e4m3``): float8_e4m3fn q, k and V^T
    #: (:func:`fp8_value_copy`) with descales; ``dtype`` is then the output's
    fp8: bool = dataclasses.field(default=False, kw_only=True)
    #: GQA packing (``CUFLASH_GQA``, entry suffix ``_gqa``; the plain fixed-shape forms and the fixed-batch
    #: KV-cache forms, with ``mods`` softcap, ALiBi and sinks, each row its own head's): a block per
    #: kv head whose two consumers' 64 rows each hold the group's query heads at ``P = 64 // G``
    #: consecutive positions (a consumer's row ``r``: position ``r // G`` of its P, head ``r % G``;
    #: rows from ``P * G`` on unused), q and o through 5-d tensor maps
    gqa: bool = dataclasses.field(default=False, kw_only=True)
    #: TMA over the cache (``CUFLASH_KV_TMA``, entry suffix ``_tma``; the KV-cache forms, ``mods`` too): key
    #: tiles wholly inside a page (a contiguous cache's batch) and below the sequence's end load by TMA
    #: from k and v tensor maps over the cache (:func:`kvcache_tma_reason`), the others by the cp.async gather
    kv_tma: bool = dataclasses.field(default=False, kw_only=True)
    #: (the forward has no score_mod derivative nor array gradients: AttentionVariant's prelude reads these)
    grad_c: ClassVar[str] = ""
    agrad_c: ClassVar[str] = ""
    agrad_warp_c: ClassVar[str] = ""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Sm90ForwardVariant: dtype={self.dtype!r} must be one of {DTYPES}")
        for name, d in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
            if d not in HEAD_DIM_BUCKETS:
                raise ValueError(f"Sm90ForwardVariant: {name}={d} must be one of {HEAD_DIM_BUCKETS}")
        if self.varlen and (self.user_mod or self.block_sparse):
            raise ValueError("Sm90ForwardVariant: the packed (varlen) forms have no traced functions or block masks")
        if self.kvcache and (self.user_mod or self.block_sparse or not self.local):
            raise ValueError("Sm90ForwardVariant: the KV-cache forms are local, without traced functions")
        if self.head_dim_v > self.head_dim:
            raise ValueError(f"Sm90ForwardVariant: head_dim_v={self.head_dim_v} must not exceed head_dim="
                             f"{self.head_dim} (the output is staged over the query tile)")
        if (self.score_c or self.mask_c) and not self.mods:
            raise ValueError("Sm90ForwardVariant: a traced score_mod/mask_mod is an axis of the modifier forms (mods=True)")
        if self.block_sparse and (self.tile_n not in BLOCK_SPARSE_BLOCK_N or not self.mask_c):
            raise ValueError(f"Sm90ForwardVariant: the block-sparse form has a traced mask_mod and tile_n in "
                             f"{BLOCK_SPARSE_BLOCK_N}, got mask_c={self.mask_c!r}, tile_n={self.tile_n}")
        if self.fp8 and (self.mods or self.kvcache or self.head_dim not in FP8_HEAD_DIM_BUCKETS
                         or self.head_dim_v != self.head_dim):
            raise ValueError(f"Sm90ForwardVariant: the fp8 form is plain (fixed or packed) with D = Dv in "
                             f"{FP8_HEAD_DIM_BUCKETS}, got head_dim={self.head_dim}, head_dim_v={self.head_dim_v}, "
                             f"mods={self.mods}, varlen={self.varlen}, kvcache={self.kvcache}")
        if self.gqa and (self.varlen or self.fp8 or self.user_mod or self.block_sparse or (self.mods and not self.kvcache)
                         or self.head_dim not in GQA_HEAD_DIM_BUCKETS):
            raise ValueError(f"Sm90ForwardVariant: GQA packing is an axis of the fixed-batch 16-bit forms (the plain "
                             f"fixed-shape ones and the KV-cache ones) at head dims {GQA_HEAD_DIM_BUCKETS}, got "
                             f"head_dim={self.head_dim}, varlen={self.varlen}, mods={self.mods}, kvcache={self.kvcache}")
        if self.kv_tma and (not self.kvcache or self.head_dim not in KV_TMA_HEAD_DIM_BUCKETS):
            raise ValueError(f"Sm90ForwardVariant: TMA over the cache (kv_tma) is an axis of the KV-cache forms "
                             f"at head dims {KV_TMA_HEAD_DIM_BUCKETS}, got kvcache={self.kvcache}, "
                             f"head_dim={self.head_dim}")
        if self.tile_n and (not self.user_mod or self.tile_n % 16):
            raise ValueError(f"Sm90ForwardVariant: tile_n={self.tile_n} is an axis of the traced forms (a multiple of 16)")

    def axes(self) -> tuple[str, ...]:
        dims = f"d{self.head_dim}" if self.head_dim == self.head_dim_v else f"d{self.head_dim}_dv{self.head_dim_v}"
        user = variants.AttentionVariant._user_suffix(self)[1:] if self.user_mod else ""
        return ((self.dtype, dims) + (("local",) if self.local else ()) + (("mods",) if self.mods else ())
                + (("varlen",) if self.varlen else ()) + (("kvcache",) if self.kvcache else ())
                + ((user,) if user else ()) + ((f"n{self.tile_n}",) if self.tile_n else ())
                + (("bs",) if self.block_sparse else ()) + (("e4m3",) if self.fp8 else ()) + (("gqa",) if self.gqa else ())
                + (("tma",) if self.kv_tma else ()))

    @property
    def user_mod(self) -> int:
        """``CUFLASH_USER_MOD``: bit 1 a traced score_mod, bit 2 a traced mask_mod."""
        return (1 if self.score_c else 0) | (2 if self.mask_c else 0)

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def block_n(self) -> int:
        if self.fp8:
            return BLOCK_N_FP8[self.head_dim]
        if self.tile_n:
            return self.tile_n
        if self.mods:
            return BLOCK_N_MODS.get((self.head_dim, self.head_dim_v), BLOCK_N[self.head_dim])
        return BLOCK_N[self.head_dim]

    @property
    def head_dim_v_max(self) -> int:
        return self.head_dim_v

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q, two stages of K and V (64-column panels), 1 KB for alignment."""
        panels, panels_v = -(-self.head_dim // PANEL), -(-self.head_dim_v // PANEL)
        if self.fp8:   # Q and K in 128-byte rows of 128 fp8 columns, V^T tiles (Dv x Bc bytes), O's staging
            p8 = -(-self.head_dim // 128)
            return (1024 + BLOCK_M * 128 * p8 + STAGES * self.block_n * (128 * p8 + self.head_dim_v)
                    + BLOCK_M * 128 * panels_v)
        return 1024 + BLOCK_M * 128 * panels + STAGES * self.block_n * 128 * (panels + panels_v)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
                                    ("CUFLASH_D", str(self.head_dim)), ("CUFLASH_DV", str(self.head_dim_v)),
                                    ("CUFLASH_BC", str(self.block_n)), ("CUFLASH_LOCAL", "1" if self.local else "0"),
                                    ("CUFLASH_MODS", "1" if self.mods else "0"),
                                    ("CUFLASH_VARLEN", "1" if self.varlen else "0"),
                                    ("CUFLASH_KVCACHE", "1" if self.kvcache else "0")) + (
            variants.AttentionVariant.user_defines(self) if self.user_mod else ()) + (   # (the other forms' text unchanged)
            (("CUFLASH_FP8", "1"),) if self.fp8 else ()) + ((("CUFLASH_GQA", "1"),) if self.gqa else ()) + (
            (("CUFLASH_KV_TMA", "1"),) if self.kv_tma else ()) + (
            (("CUFLASH_UNSPLIT", "1"),) if self.varlen and self.kvcache and self.head_dim in PREFILL_UNSPLIT_BUCKETS
            else ())

    def describe(self) -> str:
        packed = "packed sequences (ragged tensor maps clipped at each sequence's end): " if self.varlen else ""
        loads = "TMA, 2-stage K and V rings"
        if self.kvcache:
            loads = "Q by TMA, K and V gathered from the cache by cp.async into 2-stage rings"
            if self.kv_tma:
                loads = "Q by TMA, K and V into 2-stage rings (whole key tiles by TMA, the others by a cp.async gather)"
            if self.varlen:
                packed = "chunked prefill, packed query sequences (ragged tensor maps) over a paged cache: "
        if self.gqa:
            packed = ("GQA packing, a kv head's query heads at consecutive positions in each 128-row tile "
                      "(5-d tensor maps for q and o): ")
        if self.block_sparse:
            loads += ", over the block mask's partial then full key blocks (empty ones never loaded)"
        if self.fp8:
            out = {"bf16": "bfloat16", "f16": "float16"}[self.dtype]
            vcopy = ("a key-contiguous copy made before the launch, each sequence from a multiple of 32 keys with a "
                     "tile of zeros after it" if self.varlen else "a key-contiguous copy made before the launch")
            return (f"{self.entry}: fp8 (float8_e4m3fn) q, k, v, {out} output: {packed}a producer warpgroup ({loads}; "
                    f"V from {vcopy}) and 2 consumer warpgroups of 64 query rows "
                    f"(wgmma m64nNk32 e4m3, P converted to e4m3 in registers; ping-pong, softmax overlapped with P V), "
                    f"Br={BLOCK_M}, Bc={self.block_n}, {self.smem_bytes} B of shared memory")
        return (f"{self.entry}: {packed}a producer warpgroup ({loads}) and 2 consumer warpgroups of 64 "
                f"query rows (wgmma; ping-pong, softmax overlapped with P V), Br={BLOCK_M}, Bc={self.block_n}, {self.smem_bytes} B of shared memory")


def bucket(d: int) -> int:
    """The smallest head-dim bucket holding ``d`` (ValueError above 256)."""
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"attention_fwd_sm90: head dim {d} is above {HEAD_DIM_BUCKETS[-1]}")


def all_variants(arch: int = 90, *, varlen: bool = False, kvcache: bool = False,
                 dropout: bool = False, mods: bool = False, fp8: bool = False,
                 gqa: bool = False, kv_tma: bool = False) -> tuple[Sm90ForwardVariant, ...]:
    """Every variant (the compile gate's and precompile's list); none below sm_90, and no dropout
    forms; ``mods``: the score-modifier forms; ``varlen``: the packed
    forms (with ``mods``: softcap and ALiBi); ``kvcache``: the KV-cache forms (local only; with ``mods``,
    softcap, ALiBi and sinks; with ``varlen``, chunked prefill: packed queries over a paged cache);
    ``fp8``: the fp8 forms (plain, fixed or with ``varlen`` packed; ``dtype`` the output's); ``gqa``:
    the forms with GQA packing: plain fixed shapes, or with ``kvcache`` the KV-cache forms (with
    ``mods``, softcap, ALiBi and sinks); ``kv_tma``: the KV-cache forms (``kvcache``, with
    ``gqa`` or ``varlen``, and ``mods``) with TMA over the cache."""
    if arch != 90 or dropout or (gqa and (varlen or fp8 or (mods and not kvcache))) or (kv_tma and not kvcache):
        return ()
    if gqa and not kvcache:   # (the plain fixed-shape forms)
        return tuple(Sm90ForwardVariant(dt, d, dv, local, gqa=True) for dt in DTYPES for d in GQA_HEAD_DIM_BUCKETS
                     for dv in HEAD_DIM_BUCKETS if dv <= d and (dv == d or (d, dv) == (192, 128)) for local in (False, True))
    if fp8:
        return () if (kvcache or mods) else tuple(
            Sm90ForwardVariant(dt, d, d, local, varlen=varlen, fp8=True) for dt in DTYPES for d in FP8_HEAD_DIM_BUCKETS
            for local in (False, True))
    if kvcache:
        return tuple(Sm90ForwardVariant(dt, d, dv, True, mods, varlen, kvcache=True, gqa=gqa, kv_tma=kv_tma) for dt in DTYPES
                     for d in (GQA_HEAD_DIM_BUCKETS if gqa else KV_TMA_HEAD_DIM_BUCKETS if kv_tma else HEAD_DIM_BUCKETS)
                     for dv in HEAD_DIM_BUCKETS if dv <= d and (dv == d or (d, dv) == (192, 128)))
    return tuple(Sm90ForwardVariant(dt, d, dv, local, mods, varlen) for dt in DTYPES for d in HEAD_DIM_BUCKETS
                 for dv in HEAD_DIM_BUCKETS if dv <= d and (dv == d or (d, dv) == (192, 128)) for local in (False, True))


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int = 90, *, local: bool = False,
                   mods: bool = False, varlen: bool = False, user: tuple = ("", "", ""),
                   kv_block: int = 0) -> Sm90ForwardVariant:
    """The variant of a call's dtype and head dims (``local``: causal or a window; ``mods``: score
    modifiers; ``varlen``: a packed batch; ``user``: the traced score_mod's and mask_mod's CUDA C,
    :func:`cuflash.kernels.attention_fwd_mma.user_c`'s triple; ``kv_block``: a block mask's
    KV_BLOCK, which selects the block-sparse form, 0 for none)."""
    d, dv = bucket(head_dim), bucket(head_dim_v)
    bn = BLOCK_N_USER.get(d, 0) if (user[0] or user[1]) else 0
    if kv_block:
        bn = 128 if d <= BLOCK_SPARSE_N128_MAX and kv_block % 128 == 0 else 64
    return Sm90ForwardVariant(variants.dtype_key(dtype), d, dv, local, mods, varlen, score_c=user[0], mask_c=user[1],
                              block_sparse=bool(kv_block), tile_n=bn)


def _block_mask(problem):
    m = problem.modifiers
    return None if m is None else getattr(m, "block_mask", None)


def variant_for(problem, arch: int = 90) -> Sm90ForwardVariant:
    """The variant that runs ``problem`` (``arch``: the dispatcher's, for the signature every tier shares)."""
    p = problem
    if p.fp8 is not None:
        d = fp8_bucket(max(p.head_dim, p.head_dim_v))
        return Sm90ForwardVariant(variants.dtype_key(p.out_dtype), d, d, p.window_left >= 0 or p.window_right >= 0,
                                  varlen=p.varlen is not None, fp8=True)
    bm = _block_mask(p)
    v = choose_variant(p.dtype, p.head_dim, p.head_dim_v, local=p.window_left >= 0 or p.window_right >= 0,
                       mods=p.modifiers is not None, varlen=p.varlen is not None, user=attention_fwd_mma.user_c(p),
                       kv_block=bm.BLOCK_SIZE[1] if bm is not None else 0)
    return dataclasses.replace(v, gqa=True) if p.kvcache is None and gqa_pack(p) > 1 else v


def gqa_pack_reason(problem) -> str | None:
    """Why ``problem`` runs without GQA packing (None if its G = Hq / Hk query heads of a kv head share
    the 128-row tiles), the one rule of the fixed-shape and the KV-cache calls: packed queries (a
    packed batch or chunked prefill), fp8, score modifiers on a fixed-shape call (the KV-cache form
    packs softcap, ALiBi and sinks: each row takes its own head's slope and sink), ``Sq`` of a whole
    tile, a group outside 2..:data:`GQA_PACK_MAX`, a head dim (the larger of D and Dv) outside
    :data:`GQA_HEAD_DIM_BUCKETS`, more than one batch dim, or packing that takes more tiles per kv
    head than the unpacked form's ``G * ceil(Sq / 128)`` (``ceil(Sq / 2P)`` with ``P = 64 // G``
    positions a consumer: a group that is not a power of two at more than ``2 * P * G`` positions;
    under 64 positions ``P * G >= 32`` keeps packing within ``G`` tiles, so a KV-cache call under
    :data:`KVCACHE_MIN_ROWS`, which the unpacked Hopper form does not take, is never unpacked by
    it). Shapes only: a CUDA-graph replay keeps it."""
    p = problem
    g = p.group_size
    if p.varlen is not None:
        return ("packed queries (chunked prefill) are not GQA-packed" if p.kvcache is not None
                else "packed batches (cu_seqlens) are not GQA-packed")
    if p.fp8 is not None:
        return "fp8 (float8_e4m3fn) calls are not GQA-packed"
    if p.modifiers is not None and p.kvcache is None:
        return "score modifiers on a fixed-shape call are not GQA-packed"
    if p.seqlen_q >= BLOCK_M:
        return f"Sq={p.seqlen_q} fills {BLOCK_M}-row tiles unpacked"
    if g < 2 or g > GQA_PACK_MAX:
        return f"a group of {g} query heads per kv head (GQA packing takes groups of 2..{GQA_PACK_MAX})"
    d = bucket(max(p.head_dim, p.head_dim_v))
    if d not in GQA_HEAD_DIM_BUCKETS:
        return (f"head dim {max(p.head_dim, p.head_dim_v)} (bucket {d}): the packed form's consumers have no register "
                f"to spare there (GQA packing takes the buckets {GQA_HEAD_DIM_BUCKETS})")
    if len(p.batch_shape) != 1:
        return f"batch dims {p.batch_shape}: GQA packing takes one batch dim"
    packed, unpacked = -(-p.seqlen_q // gqa_tile_positions(g)), g * -(-p.seqlen_q // BLOCK_M)
    if packed > unpacked:
        return (f"a group of {g} at Sq={p.seqlen_q} ({64 // g} position{'s' * (g <= 32)} a consumer): packing takes "
                f"{packed} tiles per kv head against {unpacked} unpacked")
    return None


def gqa_pack(problem) -> int:
    """The query heads per tile's kv head: G = Hq / Hk with GQA packing (:func:`gqa_pack_reason`),
    else 1. A block per (packed tile of 2P positions, kv head) then loads each K/V tile once per
    packed tile for the G heads, instead of once per (128-row tile, query head)."""
    return problem.group_size if gqa_pack_reason(problem) is None else 1


def gqa_tile_positions(group: int) -> int:
    """Query positions per 128-row tile with ``group`` query heads packed per position: each
    consumer's 64 rows hold 64 // G positions of the G heads (rows past their P * G are dead), so
    128 for ``group`` 1."""
    return 2 * (64 // group)


def gqa_pack_note(problem, tiles: int) -> str:
    """explain's words for a GQA-packed call's rows (``tiles``: its query tiles per kv head and batch)."""
    p, g = problem, problem.group_size
    per = 64 // g
    note = (f"GQA packing: the {g} query heads of each kv head x {p.seqlen_q} positions = {g * p.seqlen_q} rows in "
            f"{tiles} 128-row tile{'s' * (tiles != 1)} (a consumer's row r: position r // {g} of its {per} "
            f"position{'s' * (per != 1)}, head r % {g})")
    if per * g < 64:
        note += f"; each consumer's 64 rows hold {per} position{'s' * (per != 1)} ({per * g} rows, {64 - per * g} unused)"
    return note


def form_note(problem, arch: int) -> str | None:
    """explain's note on a fixed-shape GQA call with ``Sq`` under a tile: its packing, or why it runs
    unpacked (:func:`gqa_pack_reason`)."""
    p = problem
    if p.group_size < 2 or p.kvcache is not None or p.varlen is not None or p.seqlen_q >= BLOCK_M:
        return None
    why = gqa_pack_reason(p)
    if why is None:
        return gqa_pack_note(p, -(-p.seqlen_q // gqa_tile_positions(p.group_size)))
    return f"GQA packing not used: {why}"


def block_mask_reason(problem) -> str | None:
    """Why ``problem``'s block mask cannot be walked by the Hopper block-sparse form (None if it
    can, or without one): a block of the kernel (128 query rows) must lie in one query block of
    the mask, so Q_BLOCK must be a multiple of 128; every KV_BLOCK (a multiple of 64) is whole
    key tiles (:data:`BLOCK_SPARSE_BLOCK_N`)."""
    bm = _block_mask(problem)
    if bm is None or bm.BLOCK_SIZE[0] % BLOCK_M == 0:
        return None
    return (f"the block_mask's Q_BLOCK={bm.BLOCK_SIZE[0]} is not a multiple of the Hopper kernel's {BLOCK_M} query rows "
            f"per block (its two consumers share one key-block walk); the tensor-core tier walks {bm.BLOCK_SIZE[0]}-row "
            f"query blocks")


def _bhsd(a, layout: str):
    """A (B, H, S, D) view of a layout's 4-d array (no copy), or None."""
    if a.ndim != 4:
        return None
    return a.transpose(0, 2, 1, 3) if layout == "bshd" else a


def _tma_reason(a, name: str, needs: str = "a TMA tensor map needs it") -> str | None:
    if a is None or a.size == 0:
        return None
    item = a.dtype.itemsize
    if a.strides[-1] != item and a.shape[-1] > 1:
        return f"{name}'s head dim is not contiguous"
    if any(int(s) == 0 for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1):
        return f"{name} is a broadcast (stride-0) view, which a TMA tensor map cannot describe"
    bad = [int(s) for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1 and int(s) % TMA_ALIGN]
    if bad:
        return f"{name} has a stride of {bad[0]} bytes, not a multiple of {TMA_ALIGN} ({needs})"
    try:
        addr = plan.array_address(a)
    except TypeError:
        return None
    if addr % TMA_ALIGN:
        return f"{name} starts at an address that is not {TMA_ALIGN}-byte aligned ({needs})"
    return None


def _dims_reason(p) -> str | None:
    """Why the head dims ``(D, Dv)`` of ``p`` have no Hopper variant (None if they have one)."""
    for name, d in (("D", p.head_dim), ("Dv", p.head_dim_v)):
        if d % 8:
            return f"{name}={d} is not a multiple of 8 (TMA rows are 16-byte multiples)"
    if max(p.head_dim, p.head_dim_v) > HEAD_DIM_BUCKETS[-1]:
        return f"head dim {max(p.head_dim, p.head_dim_v)} > {HEAD_DIM_BUCKETS[-1]}"
    if bucket(p.head_dim_v) > bucket(p.head_dim) or (bucket(p.head_dim_v) != bucket(p.head_dim)
                                                     and (bucket(p.head_dim), bucket(p.head_dim_v)) != (192, 128)):
        return f"(D, Dv) = ({p.head_dim}, {p.head_dim_v}) has no Hopper variant (Dv's bucket must equal D's, or be 128 for 192)"
    return None


def dtype_reason(problem) -> str | None:
    """Why ``problem``'s dtype is not one the Hopper kernels (forward and backward) take, or None."""
    try:
        key = variants.dtype_key(problem.dtype)
    except KeyError:
        key = str(np.dtype(problem.dtype))
    if key not in DTYPES:
        return f"dtype {np.dtype(problem.dtype)} (wgmma here takes float16/bfloat16)"
    return None


def scale_reason(problem) -> str | None:
    """Why ``problem``'s softmax scale does not suit the plain Hopper forms (None if it does): they
    take the row maximum on the unscaled scores, which a negative scale turns into the minimum. The
    modifier forms scale the scores first and take any scale."""
    if problem.modifiers is None and problem.softmax_scale < 0:
        return (f"softmax_scale={problem.softmax_scale} is negative (the Hopper kernel takes the row maximum "
                "on the unscaled scores; the tensor-core forward scales them first)")
    return None


def fp8_bucket(d: int) -> int:
    """The smallest fp8 head-dim bucket holding ``d`` (:data:`FP8_HEAD_DIM_BUCKETS`; ValueError above 256)."""
    for b in FP8_HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"attention_fwd_sm90: head dim {d} is above {FP8_HEAD_DIM_BUCKETS[-1]}")


def fp8_reason(problem, arrays=None) -> str | None:
    """Why the fp8 (float8_e4m3fn q, k, v) call ``problem`` does not run on the fp8 form (None if
    it does): fixed shapes with one batch dim or a packed batch (at least one key, at most the
    grid's sequences), no score modifiers, D a multiple of 16 and Dv of 8
    (TMA rows of 16 bytes: q and k in fp8, the output in 16 bits), D and Dv up to 256, a
    non-negative scale, and q, k and the output as a tensor map can describe them (V is copied,
    any view). ``arrays`` as for :func:`unsupported_reason`."""
    p = problem
    if p.modifiers is not None:
        return f"score modifiers ({p.modifiers.present[0]}) are not in the Hopper fp8 forward"
    why = scale_reason(p)
    if why is not None:
        return why
    if p.head_dim % 16 or p.head_dim_v % 8:
        return (f"(D, Dv) = ({p.head_dim}, {p.head_dim_v}): the fp8 form takes D a multiple of 16 and Dv of 8 "
                f"(TMA rows are 16-byte multiples)")
    if max(p.head_dim, p.head_dim_v) > FP8_HEAD_DIM_BUCKETS[-1]:
        return f"head dim {max(p.head_dim, p.head_dim_v)} > {FP8_HEAD_DIM_BUCKETS[-1]}"
    if p.varlen is not None:
        return _packed_reason(p, arrays, skip=("v",))
    return _fixed_reason(p, arrays, skip=("v",))


def _packed_reason(p, arrays, skip=()) -> str | None:
    """Why the packed batch ``p`` does not suit the ragged tensor maps and the grid (None if it
    does), ``arrays`` and ``skip`` as :func:`_fixed_reason`."""
    if p.varlen.total_k == 0:
        return "no key in the whole packed batch (a tensor map has no empty dimension)"
    if p.varlen.batch > plan.MAX_GRID_DIMS[2]:
        return f"{p.varlen.batch} packed sequences exceed the grid's {plan.MAX_GRID_DIMS[2]} (gridDim.z)"
    return _views_reason(arrays, skip)


def _fixed_reason(p, arrays, skip=()) -> str | None:
    """Why the fixed-shape call ``p`` does not suit the tensor maps (None if it does): Sk = 0,
    several batch dims, or a view of ``arrays`` (q, k, v, out; those named in ``skip`` aside)
    that a tensor map cannot describe."""
    if p.seqlen_k == 0:
        return "Sk = 0 (a tensor map has no empty dimension)"
    if len(p.batch_shape) != 1 or (p.layout == "bhsd" and len(p.q.shape) != 4):
        return f"batch dims {p.batch_shape}: the Hopper kernel's tensor maps take one batch dim"
    return _views_reason(arrays, skip)


def _views_reason(arrays, skip=()) -> str | None:
    for a, name in zip(arrays or (), ("q", "k", "v", "out")):
        if a is None or name in skip:
            continue
        why = _tma_reason(a, name)
        if why:
            return why
    return None


def window_extents(problem) -> tuple[int, int]:
    """``(rows, keys)``: the most query rows and keys a sequence of ``problem`` can have in the
    kernel, from the shapes only (a CUDA-graph replay keeps the plan): ``Sq`` and ``Sk`` (fixed
    shapes), the cache's capacity for the keys (a KV cache: the device clamps each length into
    it), the totals of a packed batch (the device clamps each sequence into them)."""
    p = problem
    rows = p.varlen.total_q if p.varlen is not None else p.seqlen_q
    if p.kvcache is not None:
        return rows, p.kvcache.capacity
    return rows, p.varlen.total_k if p.varlen is not None else p.seqlen_k


def window_reason(problem) -> str | None:
    """Why ``problem``'s window does not fit the Hopper kernel's 32-bit window arithmetic (None
    if it does, or without a window): every form (fixed, packed, KV cache, fp8, block-sparse)
    forms a row's visible keys from its position ``i``, ``diag = Sk - Sq`` and the bounds
    ``(left, right)`` in 32-bit ints. A position of the last 128-row tile is at most
    ``Sq + 126`` (padding rows included; with GQA packing too), ``Sk`` lies in ``[0, keys]`` and
    ``Sq`` in ``[1, rows]`` (:func:`window_extents`), so the values formed lie in:

    - ``i + diag - left`` (the left edge, and the block's first key): down to ``-(rows + left)``,
      negated in the rounding to tiles; up to ``keys + 126 - left``, plus ``Bc - 1`` in that
      rounding: ``rows + left`` and ``keys - left + 128 + Bc`` must stay under ``2**31``;
    - ``i + diag + right + 1`` (the right edge, and the block's key end): up to
      ``keys + right + 127``: ``keys + right + 128`` must stay under ``2**31``.

    Causal alone is ``right = 0``, which a cache's capacity (under ``2**31 - 256``) always
    fits. The host keeps each bound under ``Sq + Sk`` (or ``Sq`` + the capacity), so only a window
    over about ``2**30`` positions or more is refused here; the tensor-core tier's window
    arithmetic (common.cuh's ``band_range``) has no such limit. Shapes only, never the lengths."""
    p = problem
    left, right = p.window_left, p.window_right
    if left < 0 and right < 0:
        return None
    rows, keys = window_extents(p)
    peak = max(rows + left if left >= 0 else 0, keys - left + BLOCK_M + BLOCK_N_MAX if left >= 0 else 0,
               keys + right + BLOCK_M if right >= 0 else 0)
    if peak < 2**31:
        return None
    return (f"window_size=({left}, {right}) over up to {rows} query rows and {keys} keys: the Hopper kernel's window "
            f"arithmetic is 32-bit and would reach {peak} (past 2**31 - 1) at some position; the tensor-core tier's "
            f"is overflow-free")


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why ``problem`` cannot run on this tier on ``sm_<arch>`` (None if it can). The arch rule
    (``sm_90a``: compute capability 9.0 only) is the dispatcher's (:data:`TARGET_ARCH`)."""
    p = problem
    why = window_reason(p)
    if why is not None:
        return why
    if p.fp8 is not None and p.fp8.q_fp8:
        return fp8_reason(p, arrays)
    why = refuse_modifiers(p, "the Hopper kernel", MODIFIERS + USER_MODIFIERS)
    if why is not None:
        return why
    m = p.modifiers
    for traced in () if m is None else (m.score_mod, m.mask_mod):
        why = None if traced is None else score_mod.kernel_refusal(traced)
        if why is not None:
            return why + " in the Hopper kernel"
    why = block_mask_reason(p)
    if why is not None:
        return why
    why = dtype_reason(p)
    if why is not None:
        return why
    if p.dropout is not None:
        return "dropout is not in the Hopper kernel yet"
    if p.kvcache is not None:
        return kvcache_reason(p, arch, arrays)
    why = scale_reason(p)
    if why is not None:
        return why
    if p.varlen is not None:
        why = refuse_modifiers(p, "the Hopper kernel's packed forms", VARLEN_MODIFIERS)
        if why is not None:
            return why
    why = _dims_reason(p)
    if why is not None:
        return why
    if p.varlen is not None:
        return _packed_reason(p, arrays)
    return _fixed_reason(p, arrays)


def plan_forward(q, k, v, out, lse, *, softmax_scale: float, window_left: int = -1, window_right: int = -1,
                 dtype: str | None = None, mods_args: tuple = (), variant: Sm90ForwardVariant | None = None,
                 gqa_views: tuple = ()) -> LaunchPlan:
    """The launch for arrays in (B, H, S, D) order (any strides a tensor map can describe).

    Parameters
    ----------
    q : array (B, Hq, Sq, D), float16 or bfloat16 (or bf16 bits as uint16 with ``dtype="bf16"``)
    k : array (B, Hk, Sk, D); v : array (B, Hk, Sk, Dv); Hq a multiple of Hk (GQA)
    out : array (B, Hq, Sq, Dv), q's dtype, written
    lse : array (B, Hq, Sq) float32, C-contiguous, written (natural log; -inf for rows without keys)
    softmax_scale : float
    window_left, window_right : int
        Bottom-right window bounds, -1 unbounded (causal: ``window_right=0``).
    mods_args : tuple of plan arguments
        The score modifiers' (:func:`cuflash.kernels.launch_args.mods_args`); non-empty
        selects the ``mods`` variant.
    variant : Sm90ForwardVariant, optional
        The variant to launch (a traced function's or block-sparse form, :func:`variant_for`, whose
        ``mods_args`` carry the captured arrays and lists); None: the one of the dtype, head
        dims, window and ``mods_args``.
    gqa_views : tuple
        With a ``gqa`` variant: q and out as (B, Sq, Hk, G, D) views of the same memory (the 5-d
        tensor maps' arrays); a block per (query tile of ``Sq * G`` packed rows, kv head, batch).

    Raises
    ------
    TypeError, ValueError
        For dtypes, shapes or strides the kernel cannot take, naming the argument.
    """
    if dtype is None:
        name = np.dtype(q.dtype).name
        dtype = {"float16": "f16", "bfloat16": "bf16"}.get(name)
        if dtype is None:
            raise TypeError(f"attention_fwd_sm90: q must be float16 or bfloat16, got {q.dtype}")
    b, hq, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    dv = v.shape[-1]
    if tuple(v.shape[:3]) != (bk, hk, sk) or bk != b or dk != d or tuple(out.shape) != (b, hq, sq, dv):
        raise ValueError(f"attention_fwd_sm90: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
                         f"{tuple(out.shape)} must be (B, Hq, Sq, D), (B, Hk, Sk, D), (B, Hk, Sk, Dv), (B, Hq, Sq, Dv)")
    if hk == 0 or hq % hk:
        raise ValueError(f"attention_fwd_sm90: Hq={hq} must be a multiple of Hk={hk}")
    _check_lse(lse, (b, hq, sq))
    if sq < 1 or sk < 1:
        raise ValueError(f"attention_fwd_sm90: Sq={sq} and Sk={sk} must be at least 1")
    if variant is None:
        variant = Sm90ForwardVariant(dtype, bucket(d), bucket(dv), window_left >= 0 or window_right >= 0, bool(mods_args))
    bn = variant.block_n
    g = hq // hk
    if variant.gqa:   # (B, Sq, Hk, G, D) views: boxes of G heads x 64 // G positions, a consumer's rows
        q5, o5 = gqa_views
        maps = (TensorMapArg.of("map_q", q5, (1, 64 // g, 1, g, PANEL), swizzle=128),
                TensorMapArg.of("map_o", o5, (1, 64 // g, 1, g, PANEL), swizzle=128, writable=True))
        grid = (-(-sq // gqa_tile_positions(g)), hk, b)
    else:
        maps = (TensorMapArg.of("map_q", q, (1, 1, BLOCK_M, PANEL), swizzle=128),
                TensorMapArg.of("map_o", out, (1, 1, 64, PANEL), swizzle=128, writable=True))
        grid = (-(-sq // BLOCK_M), hq, b)
    args = (maps[0],
            TensorMapArg.of("map_k", k, (1, 1, bn, PANEL), swizzle=128),
            TensorMapArg.of("map_v", v, (1, 1, bn, PANEL), swizzle=128),
            maps[1],
            PointerArg.of("lse", lse, writable=True), ScalarArg("Sq", np.int32(sq)), ScalarArg("Sk", np.int32(sk)),
            ScalarArg("Hq", np.int32(hq)), ScalarArg("group", np.int32(hq // hk)),
            scale_arg(softmax_scale, variant.mods),
            ScalarArg("window_left", np.int32(window_left)), ScalarArg("window_right", np.int32(window_right)),
            *mods_args)
    return LaunchPlan(variant, variant.entry, grid, (384, 1, 1), variant.smem_bytes, args)


def _check_lse(lse, shape: tuple) -> None:
    """ValueError unless ``lse`` is a C-contiguous float32 array of ``shape`` (the kernels write it densely)."""
    if tuple(lse.shape) != tuple(shape) or np.dtype(lse.dtype) != np.float32 or not lse.flags.c_contiguous:
        raise ValueError(f"attention_fwd_sm90: lse must be a C-contiguous float32 {tuple(shape)}, got "
                         f"{tuple(lse.shape)} {lse.dtype}")


def _ragged_map(name: str, a, rows: int, cols: int = PANEL, writable: bool = False) -> TensorMapArg:
    """A packed array's tensor-map argument: boxes of ``rows`` x ``cols`` (128-byte swizzle) clipped at
    each sequence's end (:meth:`TensorMap.ragged`), with its pointer."""
    return TensorMapArg(name, PointerArg.of(name, a, writable=writable), TensorMap.ragged(a, rows, cols, swizzle=128))


def plan_varlen(q, k, v, out, lse, index_args: tuple, *, batch: int, max_seqlen_q: int, softmax_scale: float,
                window: tuple[int, int] = (-1, -1), dtype: str, mods_args: tuple = ()) -> LaunchPlan:
    """The launch of a packed batch: a block per (128-row query tile of the longest sequence, query
    head, sequence); each block finds its sequence's rows in the index on the device.

    Parameters
    ----------
    q : array (total_q, Hq, D); k : array (total_k, Hk, D); v : array (total_k, Hk, Dv)
        Packed rows, float16 or bf16 bits as uint16 (``dtype``); any strides a tensor map can
        describe. ``total_k`` must be at least 1.
    out : array (total_q, Hq, Dv), written only in the rows of the sequences' query rows
    lse : array (Hq, total_q) float32, C-contiguous, written likewise (natural log)
    index_args : tuple of plan arguments
        ``cu_seqlens_q, cu_seqlens_k, seqused_k, varlen`` (:func:`cuflash.kernels.launch_args.varlen_args`).
    batch, max_seqlen_q : int
        Sequences, and the query rows of the longest (the grid's extent; rows past it stay unwritten).
    window : (int, int)
        ``(window_left, window_right)`` as :func:`plan_forward` takes them.
    softmax_scale, dtype, mods_args
        As :func:`plan_forward` (``mods_args``: softcap and ALiBi, :data:`VARLEN_MODIFIERS`).

    Raises
    ------
    ValueError
        For shapes the kernel cannot take, naming the arrays.
    """
    total_q, hq, d = q.shape
    total_k, hk, dk = k.shape
    dv = v.shape[-1]
    if (tuple(v.shape[:2]) != (total_k, hk) or dk != d or tuple(out.shape) != (total_q, hq, dv)
            or hk == 0 or hq % hk or total_k < 1):
        raise ValueError(f"attention_fwd_sm90: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
                         f"{tuple(out.shape)} must be (total_q, Hq, D), (total_k, Hk, D), (total_k, Hk, Dv), "
                         "(total_q, Hq, Dv) with Hq a multiple of Hk and total_k >= 1")
    _check_lse(lse, (hq, total_q))
    window_left, window_right = window
    variant = Sm90ForwardVariant(dtype, bucket(d), bucket(dv), window_left >= 0 or window_right >= 0, bool(mods_args), True)
    bn = variant.block_n

    args = (_ragged_map("map_q", q, BLOCK_M), _ragged_map("map_k", k, bn), _ragged_map("map_v", v, bn),
            _ragged_map("map_o", out, 64, writable=True),
            PointerArg.of("lse", lse, writable=True), ScalarArg("Sq", np.int32(total_q)),
            ScalarArg("Sk", np.int32(total_k)), ScalarArg("Hq", np.int32(hq)), ScalarArg("group", np.int32(hq // hk)),
            scale_arg(softmax_scale, variant.mods),
            ScalarArg("window_left", np.int32(window_left)), ScalarArg("window_right", np.int32(window_right)),
            *index_args, *mods_args)
    return LaunchPlan(variant, variant.entry, (-(-max_seqlen_q // BLOCK_M), hq, batch), (384, 1, 1),
                      variant.smem_bytes, args)


def _forward_varlen(problem, q, k, v, out, call):
    """A packed batch: outputs NaN-filled first when the index lives on the device (rows no block
    covers, from an index that disagrees with ``max_seqlen_q``, read NaN, never stale data), then
    one launch."""
    p = problem
    vl = p.varlen
    out, lse = forward_run.outputs(p, out, call)
    if not p.is_empty and vl.max_seqlen_q > 0:
        key = variants.dtype_key(p.dtype)
        bits = _bits(key)
        mods = la.mods_args(p, la.modifier_views(p, call), call, p.modifiers is not None)   # (softcap, ALiBi)
        call.launch(plan_varlen(bits(q), bits(k), bits(v), bits(out), lse, la.varlen_args(p, call), batch=vl.batch,
                                max_seqlen_q=vl.max_seqlen_q, softmax_scale=p.softmax_scale,
                                window=(p.window_left, p.window_right), dtype=key, mods_args=mods))
    return out, lse


def _bits(key: str):
    """How a 16-bit array of dtype ``key`` reaches a tensor map: bfloat16 as its bits (uint16, no
    copy; the maps move them unchanged), float16 as it is."""
    return (lambda a: a.view(np.uint16)) if key == "bf16" else (lambda a: a)


def _bytes(a):
    """An fp8 array's bytes (uint8, the same strides; no copy)."""
    return a if np.dtype(a.dtype) == np.uint8 else a.view(np.uint8)


def fp8_value_copy(v, xp):
    """The fp8 form's V operand: ``v`` (B, Hk, Sk, Dv) fp8 (or its bytes; any strides) copied into a
    fresh key-contiguous uint8 array ``vt`` (B, Hk, Dv, Sk'), ``Sk'`` = Sk rounded up to
    :data:`FP8_KEY_BLOCK` (the extra keys are 0), whose keys are permuted within each 32-key block:
    key ``k = 16 a + 8 b + 2 t + c`` (a, b, c in {0, 1}, t in 0..3) of the block lies at position
    ``16 a + 4 t + 2 b + c``. The converted P of the kernel holds, in thread t of a quad, keys
    ``8 i + 2 t`` and ``8 i + 2 t + 1`` in the register-A slots of columns ``4 t ..`` and ``4 t + 16 ..``
    (kernels_cu/ptx.cuh, "P fragment for O = P V in fp8"); with V's keys so permuted, the product
    needs no exchange of P between lanes. ``xp``: the device's array module (NumPy on the
    simulator, CuPy on a GPU; ``empty`` allocating through the call)."""
    b, hk, sk, dv = v.shape
    full, rest = divmod(sk, FP8_KEY_BLOCK)
    vt = xp.empty((b, hk, dv, (full + (rest > 0)) * FP8_KEY_BLOCK), np.uint8)
    dst = vt.reshape(b, hk, dv, full + (rest > 0), 2, 4, 2, 2)   # position 16 a + 4 t + 2 b + c (a view)
    src = _bytes(v)

    def permute(keys, n):   # n 32-key blocks (b, hk, 32 n, dv), key 16 a + 8 b + 2 t + c
        return keys.reshape(b, hk, n, 2, 2, 4, 2, dv).transpose(0, 1, 7, 2, 3, 5, 4, 6)

    dst[:, :, :, :full] = permute(src[:, :, :full * FP8_KEY_BLOCK], full)   # one strided copy
    if rest:   # the last block's keys past Sk are 0
        last = xp.zeros((b, hk, FP8_KEY_BLOCK, dv), np.uint8)
        last[:, :, :rest] = src[:, :, full * FP8_KEY_BLOCK:]
        dst[:, :, :, full:] = permute(last, 1)
    return vt


def fp8_value_starts(cu_seqlens_k, total_k: int, block_n: int, xp):
    """Where each sequence of a packed batch starts in its fp8 V^T copy (:func:`fp8_value_copy_packed`):
    ``p[b] = 32 * (k0[b] // 32) + block_n * b``, ``k0[b]`` = ``cu_seqlens_k[b]`` clamped into
    ``[0, total_k]`` as the kernel clamps it (common.cuh, varlen_seq), which computes the same
    from the same index on the device. Each start is a multiple of :data:`FP8_KEY_BLOCK` (the
    permutation's blocks stay whole), and ``p[b + 1] - p[b]`` covers sequence b's keys rounded up
    to whole tiles of ``block_n`` keys (``block_n`` a multiple of 32): the kernel's last V^T tile of
    a sequence never reaches the next one's keys. ``xp``: the index's array module."""
    b = xp.arange(cu_seqlens_k.shape[0], dtype=np.int64)
    k0 = xp.clip(cu_seqlens_k.astype(np.int64), 0, total_k)
    return FP8_KEY_BLOCK * (k0 // FP8_KEY_BLOCK) + block_n * b


def fp8_value_keys(total_k: int, batch: int, block_n: int) -> int:
    """Keys of a packed batch's V^T copy (host-known): every start of :func:`fp8_value_starts` and
    its sequence's tiles lie below ``total_k`` rounded up to 32, plus ``block_n * batch``."""
    return -(-total_k // FP8_KEY_BLOCK) * FP8_KEY_BLOCK + block_n * batch


def fp8_value_copy_packed(v, cu_seqlens_k, seqused_k, block_n: int, xp):
    """The fp8 form's V operand for a packed batch: ``v`` (total_k, Hk, Dv) fp8 (or its bytes; any
    strides) into a fresh uint8 array ``vt`` (Hk, Dv, P), ``P`` = :func:`fp8_value_keys`: key
    ``j`` of sequence ``b`` at column ``p[b] + j`` (:func:`fp8_value_starts`), its keys permuted
    within 32-key blocks as :func:`fp8_value_copy` permutes them, every other column 0 (keys past
    ``seqused_k[b]``, the padding between sequences). Computed on the device from the index
    (``cu_seqlens_k``, ``seqused_k`` or None: device arrays of ``xp``) by array operations: the
    host never reads it, and the lengths are clamped as the kernel clamps them."""
    total_k, hk, dv = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    starts = fp8_value_starts(cu_seqlens_k, total_k, block_n, xp)
    k0 = xp.clip(cu_seqlens_k.astype(np.int64), 0, total_k)
    keys = xp.maximum(k0[1:], k0[:-1]) - k0[:-1]   # clamp_index(cu[b + 1], k0[b], total_k) - k0[b]
    if seqused_k is not None:
        keys = xp.clip(seqused_k.astype(np.int64), 0, keys)
    col = xp.arange(fp8_value_keys(total_k, batch, block_n), dtype=np.int64)
    r = col % FP8_KEY_BLOCK   # position 16 a + 4 t + 2 b + c holds key 16 a + 8 b + 2 t + c of its block
    src = col - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2
    seq = xp.clip(xp.searchsorted(starts[:-1], src, side="right") - 1, 0, max(batch - 1, 0))
    key = src - starts[seq]
    live = (key >= 0) & (key < keys[seq])
    rows = xp.clip(k0[seq] + key, 0, total_k - 1)
    keys_rows = _bytes(v)[rows]   # (P, Hk, Dv): whole rows gathered, then the columns that are no key zeroed in place
    keys_rows *= live[:, None, None]   # (bytes: 0 whatever they held, NaN included)
    vt = xp.empty((hk, dv, col.shape[0]), np.uint8)
    vt[...] = keys_rows.transpose(1, 2, 0)
    return vt


def _descale_args(problem, call) -> tuple:
    """The fp8 form's descale arguments: q, k and v's (float32 ``(B, Hk)`` device arrays, any
    non-negative strides; absent: the device's one-element 1.0, ``call.unit_scale``, with strides
    0) and their (batch, kv head) element strides."""
    f = problem.fp8
    ptrs, strides = [], []
    for name in ("q_descale", "k_descale", "v_descale"):
        d = getattr(f, name)
        if d is None:
            d, st = call.unit_scale, (0, 0)
        else:
            st = la.element_strides(d)
        ptrs.append(PointerArg.of(name, d))
        strides += [la.i64(f"{name[0]}d_batch_stride", st[0]), la.i64(f"{name[0]}d_head_stride", st[1])]
    return (*ptrs, *strides)


def plan_fp8(q, k, vt, out, lse, descale_args: tuple, *, softmax_scale: float, window_left: int = -1,
             window_right: int = -1, out_dtype: str = "bf16") -> LaunchPlan:
    """The fp8 form's launch.

    Parameters
    ----------
    q : array (B, Hq, Sq, D), k : array (B, Hk, Sk, D)
        float8_e4m3fn bytes (uint8), any strides a tensor map can describe (the head dim contiguous,
        others 16-byte multiples); D a multiple of 16.
    vt : array (B, Hk, Dv, Sk') uint8, C-contiguous: :func:`fp8_value_copy` of V
    out : array (B, Hq, Sq, Dv), float16 or bf16 bits as uint16 (``out_dtype``), written
    lse : array (B, Hq, Sq) float32, C-contiguous, written (natural log of the descaled scores)
    descale_args : the descales' plan arguments (q, k, v pointers, then their strides)
    softmax_scale, window_left, window_right
        As :func:`plan_forward`.
    out_dtype : {"bf16", "f16"}

    Raises
    ------
    ValueError
        For shapes the kernel cannot take, naming the arrays.
    """
    b, hq, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    dv = out.shape[-1]
    skp = -(-sk // FP8_KEY_BLOCK) * FP8_KEY_BLOCK
    if (bk != b or dk != d or tuple(vt.shape) != (b, hk, dv, skp) or tuple(out.shape[:3]) != (b, hq, sq)
            or hk == 0 or hq % hk or d % 16 or sk < 1):
        raise ValueError(f"attention_fwd_sm90: q {tuple(q.shape)}, k {tuple(k.shape)}, vt {tuple(vt.shape)}, out "
                         f"{tuple(out.shape)} must be (B, Hq, Sq, D), (B, Hk, Sk, D), (B, Hk, Dv, Sk rounded up to "
                         f"{FP8_KEY_BLOCK}), (B, Hq, Sq, Dv) with Hq a multiple of Hk, D a multiple of 16, Sk >= 1")
    _check_lse(lse, (b, hq, sq))
    db = fp8_bucket(max(d, dv))
    variant = Sm90ForwardVariant(out_dtype, db, db, window_left >= 0 or window_right >= 0, fp8=True)
    bn = variant.block_n
    args = (TensorMapArg.of("map_q", q, (1, 1, BLOCK_M, 128), swizzle=128),
            TensorMapArg.of("map_k", k, (1, 1, bn, 128), swizzle=128),
            TensorMapArg.of("map_v", vt, (1, 1, db, fp8_value_panel(bn)), swizzle=fp8_value_panel(bn)),
            TensorMapArg.of("map_o", out, (1, 1, 64, PANEL), swizzle=128, writable=True),
            PointerArg.of("lse", lse, writable=True), ScalarArg("Sq", np.int32(sq)), ScalarArg("Sk", np.int32(sk)),
            ScalarArg("Hq", np.int32(hq)), ScalarArg("group", np.int32(hq // hk)), scale_arg(softmax_scale, False),
            ScalarArg("window_left", np.int32(window_left)), ScalarArg("window_right", np.int32(window_right)),
            *descale_args)
    return LaunchPlan(variant, variant.entry, (-(-sq // BLOCK_M), hq, b), (384, 1, 1), variant.smem_bytes, args)


def plan_fp8_varlen(q, k, vt, out, lse, index_args: tuple, descale_args: tuple, *, batch: int, max_seqlen_q: int,
                    softmax_scale: float, window: tuple[int, int] = (-1, -1), out_dtype: str = "bf16") -> LaunchPlan:
    """The fp8 form's launch for a packed batch: :func:`plan_varlen`'s grid and ragged maps for q
    (total_q, Hq, D) and k (total_k, Hk, D) fp8 bytes and ``out`` (total_q, Hq, Dv) (16-bit, as
    ``out_dtype``), V^T ``vt`` (Hk, Dv, P) from :func:`fp8_value_copy_packed` (the kernel reads
    sequence b's keys from column ``p[b]``, :func:`fp8_value_starts`), lse (Hq, total_q).

    Raises
    ------
    ValueError
        For shapes the kernel cannot take, naming the arrays.
    """
    total_q, hq, d = q.shape
    total_k, hk, dk = k.shape
    dv = out.shape[-1]
    db = fp8_bucket(max(d, dv))
    window_left, window_right = window
    variant = Sm90ForwardVariant(out_dtype, db, db, window_left >= 0 or window_right >= 0, varlen=True, fp8=True)
    bn = variant.block_n
    if (dk != d or tuple(vt.shape) != (hk, dv, fp8_value_keys(total_k, batch, bn)) or tuple(out.shape[:2]) != (total_q, hq)
            or hk == 0 or hq % hk or d % 16 or total_k < 1):
        raise ValueError(f"attention_fwd_sm90: q {tuple(q.shape)}, k {tuple(k.shape)}, vt {tuple(vt.shape)}, out "
                         f"{tuple(out.shape)} must be (total_q, Hq, D), (total_k, Hk, D), (Hk, Dv, "
                         f"{fp8_value_keys(total_k, batch, bn)}), (total_q, Hq, Dv) with Hq a multiple of Hk, D a "
                         f"multiple of 16, total_k >= 1")
    _check_lse(lse, (hq, total_q))

    vp = fp8_value_panel(bn)
    args = (_ragged_map("map_q", q, BLOCK_M, 128), _ragged_map("map_k", k, bn, 128),
            TensorMapArg.of("map_v", vt.reshape((1,) + tuple(vt.shape)), (1, 1, db, vp), swizzle=vp),
            _ragged_map("map_o", out, 64, writable=True),
            PointerArg.of("lse", lse, writable=True), ScalarArg("Sq", np.int32(total_q)),
            ScalarArg("Sk", np.int32(total_k)), ScalarArg("Hq", np.int32(hq)), ScalarArg("group", np.int32(hq // hk)),
            scale_arg(softmax_scale, False),
            ScalarArg("window_left", np.int32(window_left)), ScalarArg("window_right", np.int32(window_right)),
            *index_args, *descale_args)
    return LaunchPlan(variant, variant.entry, (-(-max_seqlen_q // BLOCK_M), hq, batch), (384, 1, 1),
                      variant.smem_bytes, args)


def fp8_value_panel(block_n: int) -> int:
    """Keys per panel of the fp8 form's V^T tiles (each a TMA box and a swizzle of that many bytes):
    128 where the tile's keys are a multiple of 128, else 64."""
    return 128 if block_n % 128 == 0 else 64


def _forward_fp8(problem, q, k, v, out, call):
    """fp8 q, k, v: V's key-contiguous copy (:func:`fp8_value_copy`), then one launch."""
    p = problem
    if p.varlen is not None:
        return _forward_fp8_varlen(p, q, k, v, out, call)
    out, lse = forward_run.outputs(p, out, call)
    if not p.is_empty:
        key = variants.dtype_key(p.out_dtype)
        obits = _bits(key)
        qs, ks, vs = (_bytes(_bhsd(a, p.layout)) for a in (q, k, v))
        vt = fp8_value_copy(vs, call.xp)
        call.launch(plan_fp8(qs, ks, vt, obits(_bhsd(out, p.layout)), lse.reshape(p.batch_shape[0], p.num_heads_q,
                                                                                    p.seqlen_q),
                             _descale_args(p, call), softmax_scale=p.softmax_scale, window_left=p.window_left,
                             window_right=p.window_right, out_dtype=key))
    return out, lse


def _forward_fp8_varlen(problem, q, k, v, out, call):
    """A packed fp8 batch: V's per-sequence copy (:func:`fp8_value_copy_packed`, from the index on
    the device), then one launch (outputs NaN-filled first for a device index, as
    :func:`_forward_varlen`)."""
    p = problem
    vl = p.varlen
    out, lse = forward_run.outputs(p, out, call)
    if not p.is_empty and vl.max_seqlen_q > 0:
        key = variants.dtype_key(p.out_dtype)
        bn = variant_for(p).block_n
        vt = fp8_value_copy_packed(v, vl.cu_seqlens_k, vl.seqused_k, bn, call.xp)
        call.launch(plan_fp8_varlen(_bytes(q), _bytes(k), vt, _bits(key)(out), lse, la.varlen_args(p, call),
                                    _descale_args(p, call), batch=vl.batch, max_seqlen_q=vl.max_seqlen_q,
                                    softmax_scale=p.softmax_scale, window=(p.window_left, p.window_right),
                                    out_dtype=key))
    return out, lse


def forward(problem, q, k, v, out, call):
    """``(out, lse)`` of ``problem`` on the Hopper kernel: allocate what the caller did not pass on
    the call's device, view the arrays as (B, H, S, D) (bfloat16 as its 16 bits, which the tensor
    maps move unchanged) and launch once (a packed batch: its own plan, :func:`plan_varlen`; fp8
    q, k, v: :func:`_forward_fp8`)."""
    p = problem
    if p.fp8 is not None:
        return _forward_fp8(p, q, k, v, out, call)
    if p.varlen is not None:
        return _forward_varlen(p, q, k, v, out, call)
    out, lse = forward_run.outputs(p, out, call)
    if not p.is_empty:
        key = variants.dtype_key(p.dtype)
        bits = _bits(key)
        qs, ks, vs, os_ = (bits(_bhsd(a, p.layout)) for a in (q, k, v, out))
        variant = variant_for(p)
        mods = ()
        if p.modifiers is not None:
            grid = -(-p.seqlen_q // BLOCK_M) * p.num_heads_q * p.batch_shape[0]
            sparse = la.block_sparse_args(p, call, False, grid) if variant.block_sparse else ()
            mods = la.mods_args(p, la.modifier_views(p, call), call, True, bool(variant.user_mod), 0, sparse)
        views = ()
        if variant.gqa:   # q and out as (B, Sq, Hk, G, D) views (any layout: the strides say where)
            hk, g = p.num_heads_k, p.group_size

            def split_heads(a):   # (a: (B, H, S, D))
                st = a.strides
                return call.as_strided(a, (a.shape[0], a.shape[2], hk, g, a.shape[3]), (st[0], st[2], g * st[1], st[1], st[3]))
            views = (split_heads(qs), split_heads(os_))
        call.launch(plan_forward(qs, ks, vs, os_, lse.reshape(p.batch_shape[0], p.num_heads_q, p.seqlen_q),
                                 softmax_scale=p.softmax_scale, window_left=p.window_left,
                                 window_right=p.window_right, dtype=key, mods_args=mods, variant=variant,
                                 gqa_views=views))
    return out, lse


# --------------------------------------------------------------------------------------------
# the KV-cache form

#: a KV-cache call runs here when its query rows fill at least this many of the 128 rows of a
#: query tile (``Sq``, or ``Sq * G`` with GQA packing, :func:`gqa_pack`), and on the
#: tensor-core decode kernel otherwise (which packs a GQA group's heads into 64-row tiles)
KVCACHE_MIN_ROWS = 64
#: GQA packing (the ``gqa`` forms): groups of G = Hq / Hk query heads from 2 up to this (a
#: consumer's 64 rows hold whole groups of G heads at 64 // G positions), and ``Sq`` under
#: :data:`BLOCK_M` (from there on the unpacked tiles are full)
GQA_PACK_MAX = 64
#: split-KV: at least this many key tiles per split (as the tensor-core form), and at most
#: :data:`~cuflash.runtime.validation.MAX_SPLITS` splits
MIN_TILES_PER_SPLIT = 2
#: the head-dim buckets whose chunked-prefill form runs unsplit (a compile-time single split, the
#: kernel's CUFLASH_UNSPLIT: with a run-time split count the d256 form spilled under NVRTC 12 and 13)
PREFILL_UNSPLIT_BUCKETS = (256,)
#: the score modifiers the KV-cache form takes (its ``mods`` forms; those
#: ``cuflash.attention_with_kvcache`` has): the sink joins split 0's rows only, so the combine
#: counts it once a row
KVCACHE_MODIFIERS = ("softcap", "alibi_slopes", "sinks")


def kvcache_variant(problem) -> Sm90ForwardVariant:
    """The KV-cache form of ``problem``'s dtype and head dims (always ``local``; packed queries:
    the chunked-prefill form)."""
    p = problem
    gqa = gqa_pack(p) > 1
    v = Sm90ForwardVariant(variants.dtype_key(p.dtype), bucket(p.head_dim), bucket(p.head_dim_v), True,
                           p.modifiers is not None, p.varlen is not None, kvcache=True, gqa=gqa)
    return dataclasses.replace(v, kv_tma=True) if kvcache_tma_reason(p, v) is None else v


#: the head-dim buckets of the forms with TMA over the cache (at 256 the consumers spill under NVRTC 13
#: beside the cache's maps: 32 B stores, 108 B loads; and 80-key tiles fit no power-of-two page)
KV_TMA_HEAD_DIM_BUCKETS = (64, 96, 128, 192)
def kvcache_tma_reason(problem, variant) -> str | None:
    """Why the KV-cache call ``problem`` on ``variant`` (its form without TMA over the cache) gathers
    every key tile by cp.async (None if the tiles that lie whole in a page load by TMA): a paged
    cache's ``page_size`` must be a multiple of the tile's keys
    (a contiguous cache's batches are the map's pages, each a whole sequence's rows). Shapes only
    (the caches' strides are TMA's already: :func:`kvcache_reason`), so a CUDA-graph replay keeps
    it."""
    p, c = problem, problem.kvcache
    if variant.head_dim not in KV_TMA_HEAD_DIM_BUCKETS:
        return f"head dim bucket {variant.head_dim} (TMA over the cache takes the buckets {KV_TMA_HEAD_DIM_BUCKETS})"
    if not c.paged and c.capacity == 0:   # (a tensor map's extents are 1 or more)
        return "a contiguous cache of 0 rows per sequence holds no key tile"
    if c.paged and c.page_size % variant.block_n:
        return f"pages of {c.page_size} rows do not hold whole {variant.block_n}-key tiles"
    return None


def kvcache_loads(problem, variant) -> str:
    """How the Hopper KV-cache form ``variant`` loads ``problem``'s keys and values (explain's words)."""
    c = problem.kvcache
    if variant.kv_tma and c.paged:
        return (f"keys and values: {variant.block_n}-key tiles of pages of {c.page_size} rows load by TMA, the "
                f"others (across a sequence's end or a page's) by cp.async gather")
    if variant.kv_tma:
        return (f"keys and values: {variant.block_n}-key tiles of the contiguous cache load by TMA, the one across "
                f"a sequence's end by cp.async gather")
    return f"keys and values gathered by cp.async: {kvcache_tma_reason(problem, variant)}"


def kvcache_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the KV-cache call ``problem`` does not run on the Hopper KV-cache form (None if it does).

    ``arrays`` is ``(q, k_cache, v_cache)`` or ``(q, k_cache, v_cache, out)`` (alignment of views;
    None: shapes only). The arch rule (compute capability 9.0) is the caller's.
    """
    p = problem
    if p.fp8 is not None:
        return ("an fp8 (float8_e4m3fn) cache: the Hopper KV-cache form reads float16/bfloat16 caches only (the "
                "tensor-core form dequantizes fp8 as it reads)")
    why = refuse_modifiers(p, "the Hopper KV-cache form", KVCACHE_MODIFIERS)
    if why is not None:
        return why
    why = dtype_reason(p) or scale_reason(p) or window_reason(p)
    if why is not None:
        return why
    why = _dims_reason(p)
    if why is not None:
        return why
    rows, pack = kvcache_rows(p), gqa_pack(p)
    if rows * pack < KVCACHE_MIN_ROWS:
        what = f"max_seqlen_q={rows}" if p.varlen is not None else f"Sq={rows}"
        if pack > 1:
            what = f"Sq*G={rows}*{pack}={rows * pack} packed"
        unpacked = f"; GQA packing not used: {gqa_pack_reason(p)}" if pack == 1 and p.group_size > 1 else ""
        return (f"{what} query rows would fill under half of the 128-row Hopper tile (from "
                f"{KVCACHE_MIN_ROWS} on it runs here); the tensor-core decode kernel packs the "
                f"{p.group_size} query heads of a GQA group into its tiles{unpacked}")
    if p.varlen is not None:
        if p.varlen.batch > plan.MAX_GRID_DIMS[2]:
            return f"{p.varlen.batch} packed sequences exceed the grid's {plan.MAX_GRID_DIMS[2]} (gridDim.z)"
    elif len(p.batch_shape) != 1 or p.batch_shape[0] > plan.MAX_GRID_DIMS[2]:
        return f"batch dims {p.batch_shape}: the Hopper KV-cache form takes one batch dim of at most {plan.MAX_GRID_DIMS[2]}"
    arrays = tuple(arrays or ())
    for a, name in zip(arrays[:1] + arrays[3:4], ("q", "out")):
        if a is not None:
            why = _tma_reason(_bhsd(a, "bshd") if a.ndim == 4 else a, name)
            if why:
                return why
    for a, name in zip(arrays[1:3], ("k_cache", "v_cache")):
        why = _tma_reason(a, name, "cp.async copies 16-byte chunks")
        if why:
            return why
    return None


def kvcache_rows(problem) -> int:
    """Query rows per (sequence, query head): ``Sq``, or a packed batch's ``max_seqlen_q``."""
    return problem.varlen.max_seqlen_q if problem.varlen is not None else problem.seqlen_q


def kvcache_query_tiles(problem) -> int:
    """Query tiles of 128 rows per (sequence, query head), or with GQA packing per (sequence, kv
    head): ``ceil(Sq / 2P)`` packed tiles of ``2P`` positions (:func:`gqa_tile_positions`)."""
    return -(-kvcache_rows(problem) // gqa_tile_positions(gqa_pack(problem)))


def kvcache_heads(problem) -> int:
    """The grid's heads (its y): query heads, or kv heads with GQA packing."""
    return problem.num_heads_q // gqa_pack(problem)


def kvcache_splits(problem, variant, sm_count) -> int:
    """The split-KV count, from what a CUDA-graph replay cannot change: the cache's capacity and the
    shapes, never the lengths (the device reads those, and each split takes its share of the key
    tiles they give). ``num_splits`` when given (at most the capacity's key tiles, and
    :data:`MAX_SPLITS`); else enough splits for one block per SM (``sm_count``), keeping
    :data:`MIN_TILES_PER_SPLIT` key tiles of the capacity per split. Chunked prefill (packed
    queries) alike, its blocks counted over ``max_seqlen_q`` rows a sequence and its capacity the
    block table's width x ``page_size``; at head dim 256 unsplit (:data:`PREFILL_UNSPLIT_BUCKETS`)."""
    c = problem.kvcache
    if problem.varlen is not None and variant.head_dim in PREFILL_UNSPLIT_BUCKETS:
        return 1
    n_tiles = max(1, -(-c.capacity // variant.block_n))
    if c.num_splits:
        return max(1, min(c.num_splits, n_tiles, MAX_SPLITS))
    blocks = kvcache_query_tiles(problem) * kvcache_heads(problem) * problem.batch_shape[0]
    want = -(-max(1, sm_count or 1) // max(blocks, 1))
    return max(1, min(want, n_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def plan_kvcache(problem, q, out, lse, variant, partials, call) -> LaunchPlan:
    """The Hopper KV-cache forward's launch plan: ``q`` (B, Sq, Hq, D) (possibly the rotated copy)
    against the caches of ``problem.kvcache`` (device arrays of ``call``); ``out`` (B, Sq, Hq, Dv)
    and ``lse`` (B, Hq, Sq) C-contiguous float32; ``partials`` is ``(o_partial, lse_partial)``,
    ``(splits, B * Hq * Sq, Dv)`` and ``(splits, B * Hq * Sq)`` float32, which the kernel writes
    instead of ``out`` and ``lse`` when there are several splits (``splits`` = their first axis).
    A block per (128-row query tile x split, query head, sequence).

    Chunked prefill (``problem.varlen``): ``q`` (total_q, Hq, D) and ``out`` through the packed
    forms' ragged maps, ``lse`` (Hq, total_q), the packed index's arguments
    (:func:`cuflash.kernels.launch_args.varlen_args`) after the scalars; the partials
    ``(splits, Hq * total_q, Dv)`` and ``(splits, Hq * total_q)``, rows (head, total_q row): the
    combine's one sequence of ``total_q`` rows."""
    p, c = problem, problem.kvcache
    o_partial, lse_partial = partials
    splits = o_partial.shape[0]
    bits = (lambda a: a.view(np.uint16)) if variant.dtype == "bf16" else (lambda a: a)
    hk = c.k_cache.shape[2]
    if p.varlen is not None:   # chunked prefill: the ragged maps, lse (Hq, total_q), the key counts' index
        qs, os_ = bits(q), bits(out)
        total_q, hq, _ = qs.shape
        b, sq = p.varlen.batch, total_q
        head = (_ragged_map("map_q", qs, BLOCK_M), _ragged_map("map_o", os_, 64, writable=True))
        lse_arg = PointerArg.of("lse", lse.reshape(hq, total_q), writable=True)
        # (Sk: the packed key index's clamp, which no chunked-prefill index reaches: each sequence's
        # key count is its cu_seqlens_k difference, or seqused_k)
        index = la.varlen_args(p, call)
        sk = 2**31 - 257
    elif variant.gqa:   # GQA packing: (B, Sq, Hk, G, D) views, boxes of G heads x 64 // G positions (a consumer's rows)
        b, sq, hq, _ = q.shape
        g = hq // hk
        def split_heads(a):   # (a view: the head axis as (Hk, G))
            st = a.strides
            return call.as_strided(bits(a), (b, sq, hk, g, a.shape[-1]), (st[0], st[1], g * st[2], st[2], st[3]))
        qs, os_ = split_heads(q), split_heads(out)
        head = (TensorMapArg.of("map_q", qs, (1, 64 // g, 1, g, PANEL), swizzle=128),
                TensorMapArg.of("map_o", os_, (1, 64 // g, 1, g, PANEL), swizzle=128, writable=True))
        lse_arg = PointerArg.of("lse", lse.reshape(b, hq, sq), writable=True)
        index = ()
        sk = c.capacity
    else:
        qs, os_ = bits(_bhsd(q, "bshd")), bits(_bhsd(out, "bshd"))
        b, hq, sq, _ = qs.shape
        head = (TensorMapArg.of("map_q", qs, (1, 1, BLOCK_M, PANEL), swizzle=128),
                TensorMapArg.of("map_o", os_, (1, 1, 64, PANEL), swizzle=128, writable=True))
        lse_arg = PointerArg.of("lse", lse.reshape(b, hq, sq), writable=True)
        index = ()
        sk = c.capacity
    if variant.kv_tma:   # TMA over the cache: (page, kv head, row in page, head dim) views, a tile's rows a box
        head = (head[0], *(TensorMapArg.of(name, bits(_bhsd(a, "bshd")), (1, 1, variant.block_n, PANEL), swizzle=128)
                           for name, a in (("map_k", c.k_cache), ("map_v", c.v_cache))), head[1])
    kst, vst = ([int(s) for s in a.strides] for a in (c.k_cache, c.v_cache))
    flags = (1 if c.cache_seqlens is not None else 0) | (2 if c.cache_leftpad is not None else 0) | \
        (4 if c.cache_batch_idx is not None else 0) | (8 if c.paged else 0)
    bt = c.block_table

    def idx(name):
        a = getattr(c, name)
        return PointerArg.of(name, a if a is not None else call.empty_index)

    args = (*head, lse_arg, ScalarArg("Sq", np.int32(sq)),
            ScalarArg("Sk", np.int32(sk)), ScalarArg("Hq", np.int32(hq)), ScalarArg("group", np.int32(hq // hk)),
            scale_arg(p.softmax_scale, variant.mods),
            ScalarArg("window_left", np.int32(p.window_left)), ScalarArg("window_right", np.int32(p.window_right)),
            *index, PointerArg.of("k_cache", c.k_cache), PointerArg.of("v_cache", c.v_cache),
            *(la.i64(f"k_{n}_stride", s) for n, s in zip(("page", "row", "head"), kst[:3])),
            *(la.i64(f"v_{n}_stride", s) for n, s in zip(("page", "row", "head"), vst[:3])),
            idx("cache_seqlens"), idx("cache_leftpad"), idx("cache_batch_idx"), idx("block_table"),
            la.i64("block_table_stride", la.element_strides(bt)[0] if bt is not None else 0),
            la.i32("page_size", c.page_size), la.i32("num_pages", c.num_pages), la.i32("cache_seqlen", c.cache_seqlen),
            la.i32("seqlen_new", c.seqlen_new), la.i32("cache_capacity", c.capacity), la.i32("cache_flags", flags),
            la.i32("num_splits", splits), la.i64("partial_rows", lse_partial.shape[1]),
            la.i32("head_dim", p.head_dim), la.i32("head_dim_v", p.head_dim_v),
            PointerArg.of("o_partial", o_partial, writable=True), PointerArg.of("lse_partial", lse_partial, writable=True),
            *la.mods_args(p, la.modifier_views(p, call), call, variant.mods))
    return LaunchPlan(variant, variant.entry, (kvcache_query_tiles(p) * splits, kvcache_heads(p), b), (384, 1, 1),
                      variant.smem_bytes, args)
