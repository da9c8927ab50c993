"""The tensor-core attention forward (``kernels_cu/attention_fwd_mma.cu``): variant and planner.

float16 and bfloat16 on sm_80 and newer (``mma.sync`` m16n8k16, ``ldmatrix``, ``cp.async``); float16
on sm_75 in the sm_75 (Turing) form (:data:`SM75_ARCH`: two m16n8k8 per m16n8k16, register-staged
copies; ``kernels_cu/ptx.cuh``).
Compile-time axes: the dtype, the head-dim bucket (64, 96, 128, 192, 256: the smallest holding
``max(D, Dv)``; other multiples of 8 run in the next bucket, the extra columns zero-filled) and
the tile (Br query rows: 32 per warp up to bucket 128, 16 above; Bc key rows). Causal, windows, lengths, strides and the
scale are run-time arguments, exactly as for the SIMT kernel, whose argument list this kernel
shares.

The kernel moves rows with 16-byte copies, so it needs every row 16-byte aligned: q, k, v and
out at 16-byte-aligned addresses, all strides and both head dims multiples of 8 elements.
:func:`unsupported_reason` says why a call cannot run here; the dispatcher then falls back to
the SIMT kernel and says so (:func:`cuflash.kernels.dispatch.describe_choice`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels import forward_run
from cuflash.kernels import launch_args as la
from cuflash.runtime import plan, score_mod, variants
from cuflash.runtime.validation import MAX_SPLITS
from cuflash.runtime.validation_modifiers import refuse_modifiers

#: head-dim buckets: a variant serves every ``max(D, Dv)`` (a multiple of 8) up to its bucket
HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
#: dtypes with a tensor-core kernel
MMA_DTYPES = ("f16", "bf16")
#: the arches the kernel is compiled and checked for
ARCHES = (80, 90)
#: oldest arch with m16n8k16 for bf16 and cp.async
MIN_ARCH = 80
#: Turing (sm_75, the T4): the kernel's sm_75 form (kernels_cu/ptx.cuh, CUFLASH_SM75_FORM): float16
#: only (mma.sync takes bf16 from sm_80), m16n8k16 as two m16n8k8, ldmatrix, and register-staged
#: synchronous copies instead of cp.async; every form (fixed, packed, KV cache, dropout, modifiers)
SM75_ARCH = 75
#: dtypes of the sm_75 form
SM75_DTYPES = ("f16",)
#: its tiles by bucket (one K/V stage: with synchronous copies a second stage hides no latency and
#: costs shared memory). Turing has 64 KB of shared memory per SM: 128 x 32 at bucket 64 takes
#: 27 KB, so two CTAs (8 warps) share an SM; at 96 and 128 the 128 x 32 tile (39 and 51 KB) leaves
#: room for one, as 64 x 32 does at 192 (50 KB); at 256 only 64 x 16 fits (50 KB). A T4 without
#: the opt-in has 48 KB per block: plan.max_dynamic_smem(75) is the opt-in's 64 KB.
TILE_CANDIDATES_SM75 = {64: ((128, 32),), 96: ((128, 32),), 128: ((128, 32),), 192: ((64, 32),), 256: ((64, 16),)}
#: the sm_75 tiles of the KV-cache, dropout and score-modifier forms (16 rows per warp, one stage), in
#: order of preference; the fp8-cache form's staging takes 64 x 32 at 96 and 128
TILE_CANDIDATES_SM75_FORMS = {64: ((64, 64), (64, 32)), 96: ((64, 64), (64, 32)), 128: ((64, 64), (64, 32)),
                              192: ((64, 32), (64, 16)), 256: ((64, 16),)}
#: buckets whose score-modifier forms have no sm_75 tile: at 256 the 64 x 16 tile (the only one in
#: 64 KB) spills 8 to 56 bytes under NVRTC 12.9 and 13.x (the fixed, packed and KV-cache forms
#: alike; 255 registers), so those calls run on the portable tier, which takes every built-in modifier
SM75_MODS_SPILL_BUCKETS = (256,)
#: whether :func:`sm75_form` is in force (this context)
_SM75_FORM = contextvars.ContextVar("cuflash_sm75_form", default=False)
#: the packed (varlen) form's, where they differ: at bucket 128, 128 x 16, whose next K/V tile waits
#: in registers across the math (kernels_cu/attention_fwd_mma.cu, FWD_REG_STAGE): 248 registers, no
#: spill under NVRTC 12.9 and 13.x on sm_75. 128 x 32 also compiles without spills (248), but only
#: with the synchronous refill after the math (the fixed 128 x 32 tile spills 16 bytes staged); with
#: element-pointer ldmatrix addresses it took 255 registers and spilled 96 bytes under 12.9
TILE_CANDIDATES_SM75_VARLEN = {128: ((128, 16),)}
#: tile shapes (Br, Bc) by bucket, in order of preference; the first that fits the device's shared
#: memory is used. Br = rows per warp x warps: 4 warps of 32 rows (two 16-row mma fragments) up
#: to bucket 128, 4 warps of 16 rows above. FA2 (Dao 2023; the flash-attention repository) uses
#: 128 x 128 at head dim 64 and 128 x 64 at 128. Here 128 x 128 spills at head dim 64 (255
#: registers: the S accumulators of two fragments; python -m cuflash roofline and the compile
#: gate show it), so every bucket up to 128 takes 128 x 64, and 192/256 64 x 64 with one stage.
#: The packed variable-length forms (``varlen``) and sm_80 take the same tiles: 128 x 64 at
#: buckets 96 and 128 compiles without spills under NVRTC 12.9 and 13.5 on sm_80 and sm_90 (the
#: compile gate holds it).
TILE_CANDIDATES = {
    64: ((128, 64), (64, 64)),
    96: ((128, 64), (64, 64), (64, 32)),
    128: ((128, 64), (64, 64), (64, 32)),
    192: ((64, 64), (64, 32)),
    256: ((64, 64), (64, 32)),
}
#: the KV-cache forms (``kvcache``): 4 warps of 16 rows (one fragment each; a decode step's packed
#: rows fill one or two of them, and the others only copy) by 64 keys; 64 x 32 where 64 x 64 does
#: not fit (bucket 256 before sm_90)
TILE_CANDIDATES_KVCACHE = ((64, 64), (64, 32))
#: the dropout forms (``dropout``): the Philox draws take the registers a second fragment would
#: need (one call per lane, row and 4 keys), so 4 warps of 16 rows, as the KV-cache forms
TILE_CANDIDATES_DROPOUT = ((64, 64), (64, 32))
#: the score-modifier forms (``mods``): the per-pair modifier code and its pointers take the
#: registers a second fragment would need (with 32 rows a warp ptxas spills 4-440 bytes), so 4
#: warps of 16 rows, as the dropout forms; bucket 256 by 32 keys (64 keys spill 60-88 bytes)
TILE_CANDIDATES_MODS = {256: ((64, 32),)}
#: the block-sparse forms (``block_sparse``, a traced mask_mod's block mask): at bucket 192 the list
#: walk beside the 64 x 64 tile spills 16 bytes under NVRTC 12.9 (sm_80), so 64 x 32 there
TILE_CANDIDATES_BLOCK_SPARSE = {192: ((64, 32),), 256: ((64, 32),)}
#: the largest bucket whose warps own 32 query rows (two m16 fragments); above, 16
TWO_FRAGMENT_MAX_BUCKET = 128
#: CTAs per SM the kernel declares in __launch_bounds__: a register cap of 65536 / (2 x threads).
#: For the 4-warp tiles that is 256, above the 255 a thread can have, so it constrains nothing
#: today; it states the occupancy the tiles are sized for (python -m cuflash roofline: 8 warps
#: per SM), and binds if a tile of more warps is added.
MIN_BLOCKS = 2
#: the score modifiers the kernel takes (its ``mods`` forms; kernels_cu/score_mods.cuh)
MODIFIERS = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
#: and the traced functions (the ``mods`` forms with ``score_c``/``mask_c``: CUFLASH_USER_MOD)
USER_MODIFIERS = ("score_mod", "mask_mod", "block_mask")
#: bytes every row (and base address) must be aligned to (fresh outputs are allocated so)
ALIGN_BYTES = 16
#: the KV-cache form reads float8_e4m3fn caches (its ``cache_fp8`` variants: q and the new rows
#: float16/bfloat16, the cache dequantized as it is read); :attr:`FP8_FORM` of the fixed-shape
#: forward is False: fp8 q, k, v have no tensor-core form
FP8_KVCACHE_FORM = True


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
    kvcache : bool
        The KV-cache form (``CUFLASH_KVCACHE`` 1, entry suffix ``_kvcache``): keys from a
        contiguous or paged cache, pack-GQA and split-KV (see the kernel's header comment).
    cache_fp8 : bool
        Its fp8-cache form (``CUFLASH_CACHE_FP8`` 1, entry suffix ``_e4m3``; KV-cache form only):
        float8_e4m3fn caches, converted to ``dtype`` in shared memory, and the descales.
    single_stage : bool
        One K/V stage whatever the bucket (entry suffix ``_s1``): the sm_75 tiles
        (:data:`TILE_CANDIDATES_SM75`).
    sm75_form : bool
        The sm_75 form's instructions on a newer arch (``CUFLASH_SM75_FORM`` 1, entry suffix
        ``_sm75form``): a correctness check of the Turing kernel on a newer GPU (:func:`sm75_form`).
    """

    kvcache: bool = dataclasses.field(default=False, kw_only=True)
    cache_fp8: bool = dataclasses.field(default=False, kw_only=True)
    #: one K/V stage at every bucket (entry suffix ``_s1``): the sm_75 form's tiles
    single_stage: bool = dataclasses.field(default=False, kw_only=True)
    #: the sm_75 form built for a newer arch (``CUFLASH_SM75_FORM`` 1, entry suffix ``_sm75form``;
    #: :func:`sm75_form`); below sm_80 every build is in that form
    sm75_form: bool = dataclasses.field(default=False, kw_only=True)

    family: ClassVar[str] = "attn_fwd_mma"
    source: ClassVar[str] = "attention_fwd_mma.cu"
    dtypes: ClassVar[tuple[str, ...]] = MMA_DTYPES
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS

    def __post_init__(self):
        super().__post_init__()
        if self.cache_fp8 and not self.kvcache:
            raise ValueError("AttentionFwdMma: cache_fp8 is a form of the KV-cache kernel (kvcache=True)")
        rows = self.rows_per_warp
        if self.block_m % rows or not 1 <= self.block_m // rows <= 16 or self.block_n % 16 or self.block_n <= 0:
            raise ValueError(f"AttentionFwdMma: tile ({self.block_m}, {self.block_n}) must be a multiple of {rows} rows "
                             f"({rows} per warp, <= 16 warps) by a multiple of 16 keys")

    @property
    def rows_per_warp(self) -> int:
        """Query rows per warp: 32 (two m16 fragments, each K/V fragment feeding two mma) up to
        bucket 128, 16 above (the O accumulator fills the registers) and in the KV-cache form."""
        return 32 if self.head_dim_max <= TWO_FRAGMENT_MAX_BUCKET and not (self.kvcache or self.dropout or self.mods) else 16

    @property
    def stages(self) -> int:
        """K/V pipeline stages: 2 up to bucket 128; 1 above, so that two CTAs fit one SM."""
        return 2 if self.head_dim_max <= TWO_FRAGMENT_MAX_BUCKET and not self.single_stage else 1

    @property
    def warps(self) -> int:
        return self.block_m // self.rows_per_warp

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def pitch(self) -> int:
        """Shared-memory row pitch in elements: the bucket plus one 16-byte chunk of padding."""
        return self.head_dim_max + 8

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (Br rows) and :attr:`stages` stages of K and V (Bc rows each),
        16-bit elements, row pitch :attr:`pitch`; the fp8-cache form one stage and the fp8 staging
        of a K and a V tile (row pitch ``head_dim_max + 16`` bytes). The kernel ``static_assert``s
        the same figure."""
        if self.cache_fp8:
            return 2 * self.pitch * (self.block_m + 2 * self.block_n) + 2 * self.block_n * (self.head_dim_max + 16)
        return 2 * self.pitch * (self.block_m + 2 * self.stages * self.block_n)

    @property
    def name(self) -> str:
        return (super().name + ("_kvcache" if self.kvcache else "") + ("_e4m3" if self.cache_fp8 else "")
                + ("_s1" if self.single_stage else "") + ("_sm75form" if self.sm75_form else ""))

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_KVCACHE", "1" if self.kvcache else "0"),
            ("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
            ("CUFLASH_M_FRAGS", str(self.rows_per_warp // 16)),
            ("CUFLASH_STAGES", str(self.stages)),
            ("CUFLASH_MIN_BLOCKS", str(MIN_BLOCKS)),
        ) + ((("CUFLASH_CACHE_FP8", "1"),) if self.cache_fp8 else ()) + (   # (the other forms' sources unchanged)
            (("CUFLASH_SM75_FORM", "1"),) if self.sm75_form else ())

    def describe(self) -> str:
        if self.cache_fp8:
            return (f"{self.entry}: {self.warps} warps of {self.rows_per_warp} query rows, Br={self.block_m} x "
                    f"Bc={self.block_n} tiles, head-dim bucket {self.head_dim_max}, {self.smem_bytes} B shared memory "
                    f"(Q + K/V + fp8 staging, cp.async), fp8 (float8_e4m3fn) cache converted to {self.dtype} in "
                    f"shared memory, k_descale/v_descale per block, mma.sync m16n8k16 {self.dtype}")
        if self.single_stage:   # (the sm_75 form's tiles; ptx.cuh's CUFLASH_SM75_FORM below sm_80)
            return (f"{self.entry}: {self.warps} warps of {self.rows_per_warp} query rows, Br={self.block_m} x "
                    f"Bc={self.block_n} tiles, head-dim bucket {self.head_dim_max}, {self.smem_bytes} B shared "
                    f"memory (Q + 1-stage K/V), mma.sync {self.dtype}")
        return (f"{self.entry}: {self.warps} warps of {self.rows_per_warp} query rows, Br={self.block_m} x "
                f"Bc={self.block_n} tiles, head-dim bucket {self.head_dim_max}, {self.smem_bytes} B shared memory "
                f"(Q + {self.stages}-stage K/V, cp.async), mma.sync m16n8k16 {self.dtype}")


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int, *, varlen: bool = False,
                   kvcache: bool = False, dropout: bool = False, mods: bool = False,
                   user: tuple = ("", "", ""), cache_fp8: bool = False, block_sparse: bool = False) -> AttentionFwdMma:
    """The preferred tile of the bucket that fits ``sm_<arch>``'s shared memory (``varlen``: of
    the packed variable-length form; ``kvcache``: of the KV-cache form; ``mods``: with the score
    modifiers; ``user``: the traced score_mod's and mask_mod's CUDA C, :func:`user_c`;
    ``cache_fp8``: the KV-cache form over an fp8 cache; ``block_sparse``: the form that walks a
    block mask's key blocks)."""
    key = variants.dtype_key(dtype)
    if key not in MMA_DTYPES:
        raise NotImplementedError(f"cuflash: the tensor-core kernel computes float16 and bfloat16, not {np.dtype(dtype)}")
    bucket = AttentionFwdMma.bucket(head_dim, head_dim_v)
    if arch < MIN_ARCH or sm75_form_forced():
        why = sm75_reason(key, min(arch, SM75_ARCH), kvcache=kvcache, dropout=dropout, mods=mods)
        if why is not None:
            raise NotImplementedError(f"cuflash: the tensor-core kernel on sm_{arch}: {why}")
        if mods and bucket in SM75_MODS_SPILL_BUCKETS:
            tiles = ()
        elif kvcache or dropout or mods:
            tiles = TILE_CANDIDATES_SM75_FORMS[bucket]
        else:
            tiles = (TILE_CANDIDATES_SM75_VARLEN if varlen else {}).get(bucket, TILE_CANDIDATES_SM75[bucket])
        v = AttentionFwdMma.first_fitting((AttentionFwdMma(key, bucket, bm, bn, varlen=varlen, kvcache=kvcache,
                                                           dropout=dropout, mods=mods, score_c=user[0], mask_c=user[1],
                                                           grad_c=user[2], cache_fp8=cache_fp8, single_stage=True,
                                                           sm75_form=arch >= MIN_ARCH)
                                           for bm, bn in tiles), plan.max_dynamic_smem(min(arch, SM75_ARCH)))
        if v is None:
            raise NotImplementedError(f"cuflash: no tensor-core attention tile fits sm_{arch}'s shared memory for head "
                                      f"dim {bucket}")
        return v
    if kvcache:
        tiles = TILE_CANDIDATES_KVCACHE
    elif dropout:
        tiles = TILE_CANDIDATES_DROPOUT
    elif mods and block_sparse and bucket in TILE_CANDIDATES_BLOCK_SPARSE:
        tiles = TILE_CANDIDATES_BLOCK_SPARSE[bucket]
    elif mods:
        tiles = TILE_CANDIDATES_MODS.get(bucket, TILE_CANDIDATES_DROPOUT)
    else:
        tiles = TILE_CANDIDATES[bucket]
    candidates = (AttentionFwdMma(key, bucket, bm, bn, varlen=varlen, kvcache=kvcache, dropout=dropout, mods=mods,
                                  score_c=user[0], mask_c=user[1], grad_c=user[2], cache_fp8=cache_fp8,
                                  block_sparse=block_sparse)
                  for bm, bn in tiles)
    v = AttentionFwdMma.first_fitting(candidates, plan.max_dynamic_smem(arch))
    if v is None:
        raise NotImplementedError(f"cuflash: no tensor-core attention tile fits sm_{arch}'s shared memory for head dim {bucket}")
    return v


def all_variants(arch: int, *, varlen: bool = False, kvcache: bool = False,
                 dropout: bool = False, mods: bool = False, cache_fp8: bool = False) -> tuple[AttentionFwdMma, ...]:
    """Every variant the dispatcher can choose on ``sm_<arch>`` (for the compile gate); with
    ``varlen``, their packed variable-length forms; with ``kvcache``, their KV-cache forms (with
    ``cache_fp8``, over an fp8 cache)."""
    if arch < MIN_ARCH:   # the sm_75 form: float16
        if arch < SM75_ARCH:
            return ()
        return tuple(dict.fromkeys(choose_variant(variants.DTYPES[key][1], b, b, arch, varlen=varlen, kvcache=kvcache,
                                                  dropout=dropout, mods=mods, cache_fp8=cache_fp8)
                                   for key in SM75_DTYPES for b in HEAD_DIM_BUCKETS
                                   if not (mods and b in SM75_MODS_SPILL_BUCKETS)))
    out = []
    for key in MMA_DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            out.append(choose_variant(variants.DTYPES[key][1], bucket, bucket, arch, varlen=varlen, kvcache=kvcache,
                                      dropout=dropout, mods=mods, cache_fp8=cache_fp8))
    return tuple(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
# eligibility


@contextlib.contextmanager
def sm75_form():
    """In this context the tensor-core tiers run their sm_75 (Turing) form on every arch: the
    sm_75 tiles, built with ``CUFLASH_SM75_FORM`` (two m16n8k8 per m16n8k16, register-staged
    copies; both exist on newer GPUs), and the Hopper tiers step aside
    (:func:`cuflash.kernels.dispatch.target_reason`). ``python -m cuflash check`` runs it on a
    newer GPU to check the Turing kernel's results there; its speed there says nothing about a
    T4's. Calls the form does not take (bf16, float32, KV cache, dropout, modifiers) take the
    portable tier, as on sm_75."""
    token = _SM75_FORM.set(True)
    try:
        yield
    finally:
        _SM75_FORM.reset(token)


def sm75_form_forced() -> bool:
    """Whether :func:`sm75_form` is in force."""
    return _SM75_FORM.get()


def sm75_reason(key: str, arch: int, *, kvcache: bool = False, dropout: bool = False,
                mods: bool = False) -> str | None:
    """Why the sm_75 form (:data:`SM75_ARCH`) cannot run a call of dtype key ``key`` (``"f16"``,
    ``"bf16"``, ...) on ``sm_<arch>`` (None if it can; ``arch`` below sm_80). It has every form
    (``kvcache``, ``dropout``, ``mods``: kept for callers that name them)."""
    if arch < SM75_ARCH:
        return f"sm_{arch} has no mma.sync m16n8k8 or ldmatrix (the tensor-core kernel needs sm_{SM75_ARCH}+)"
    if key == "bf16":
        return (f"sm_{arch} (Turing) has no bfloat16 tensor-core mma (mma.sync takes bf16 from sm_80); its "
                "tensor-core form computes float16")
    if key not in SM75_DTYPES:
        return f"dtype {key} (tensor cores on sm_{arch} take float16)"
    return None


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why ``problem`` cannot run on this kernel on ``sm_<arch>`` (None if it can).

    ``arrays`` is ``(q, k, v)`` or ``(q, k, v, out)`` (``out`` may be None); without it only the
    shape-level conditions are checked.
    """
    p = problem
    why = refuse_modifiers(p, "the tensor-core kernel", MODIFIERS + USER_MODIFIERS)
    if why is not None:
        return why
    for traced in _traced(p):
        why = score_mod.kernel_refusal(traced)
        if why is not None:
            return why + " in the tensor-core kernel"
    if p.modifiers is not None and p.modifiers.block_mask is not None and p.varlen is not None:
        return "block_mask on a packed batch (attention_varlen) is not in the tensor-core kernel"
    if p.modifiers is not None and p.dropout is not None:   # (their forms spill 8-40 bytes at head dims 192, 256)
        return f"dropout with {p.modifiers.present[0]} is not in the tensor-core kernel yet (each alone is)"
    try:
        key = variants.dtype_key(p.dtype)
    except KeyError:
        key = str(np.dtype(p.dtype))
    if arch < MIN_ARCH or sm75_form_forced():
        why = sm75_reason(key if key in MMA_DTYPES else str(np.dtype(p.dtype)), min(arch, SM75_ARCH),
                          kvcache=getattr(p, "kvcache", None) is not None, dropout=p.dropout is not None,
                          mods=p.modifiers is not None)
        if why is None and getattr(p.modifiers, "block_mask", None) is not None:
            why = "a block_mask's block-sparse form is not in the tensor-core kernel's sm_75 form yet"
        if why is not None:
            return why
    if key not in MMA_DTYPES:
        return f"dtype {np.dtype(p.dtype)} (tensor cores here take float16/bfloat16)"
    for name, d in (("D", p.head_dim), ("Dv", p.head_dim_v)):
        if d % 8:
            return f"{name}={d} is not a multiple of 8 (rows must be 16-byte aligned)"
    if max(p.head_dim, p.head_dim_v) > HEAD_DIM_BUCKETS[-1]:
        return f"head dim {max(p.head_dim, p.head_dim_v)} > {HEAD_DIM_BUCKETS[-1]}"
    if arch < MIN_ARCH or sm75_form_forced():
        bucket = AttentionFwdMma.bucket(p.head_dim, p.head_dim_v)
        if p.modifiers is not None and bucket in SM75_MODS_SPILL_BUCKETS:
            return (f"with score modifiers at head dim {max(p.head_dim, p.head_dim_v)}, its only sm_75 tile (64 x 16) "
                    "spills registers to local memory (8 to 56 bytes under NVRTC 12.9 and 13.x); the portable tier "
                    "runs it without spills")
        smallest = AttentionFwdMma(key, bucket, *TILE_CANDIDATES_SM75[bucket][-1], single_stage=True).smem_bytes
        if smallest > plan.max_dynamic_smem(arch):
            return (f"head dim {max(p.head_dim, p.head_dim_v)}: the smallest tile needs {smallest} B of shared memory, "
                    f"sm_{arch} has {plan.max_dynamic_smem(arch)} B")
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


def _traced(problem) -> tuple:
    m = problem.modifiers
    return () if m is None else tuple(t for t in (m.score_mod, m.mask_mod) if t is not None)


def user_c(problem, grad: bool = False) -> tuple[str, str, str]:
    """The CUDA C of ``problem``'s traced score_mod, mask_mod and (``grad``) the score_mod's
    derivative (:func:`cuflash.runtime.score_mod.kernel_texts`)."""
    m = problem.modifiers
    if m is None:
        return ("", "", "")
    return score_mod.kernel_texts(m.score_mod, m.mask_mod, grad)


def variant_for(problem, arch: int) -> AttentionFwdMma:
    """The variant that runs ``problem`` on ``sm_<arch>``: its packed, dropout and modifier forms
    as the call needs (the KV-cache form: :func:`cuflash.kernels.kvcache_run.run_kvcache`)."""
    return choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch,
                          varlen=problem.varlen is not None, dropout=problem.dropout is not None,
                          mods=problem.modifiers is not None, user=user_c(problem),
                          block_sparse=problem.modifiers is not None and problem.modifiers.block_mask is not None)


def form_note(problem, arch: int) -> str | None:
    """The note :func:`cuflash.kernels.dispatch.describe_choice` adds on sm_75: the Turing form
    and what it gives up (None on sm_80 and newer)."""
    if sm75_form_forced() and arch >= MIN_ARCH:
        return (f"the sm_75 (Turing) form, built for sm_{arch} to check its results: its speed here says nothing "
                "about a T4's")
    if arch >= MIN_ARCH:
        return None
    return (f"the sm_{arch} (Turing) form: mma.sync m16n8k8, two per m16n8k16; no cp.async on sm_{arch}: "
            "register-staged synchronous copies")


def forward(problem, q, k, v, out, call):
    """``(out, lse)`` of ``problem`` with :func:`variant_for` on the call's device: the kernel
    takes the common forward argument list, so :func:`cuflash.kernels.forward_run.run_variant`
    allocates, plans and launches it."""
    return forward_run.run_variant(problem, q, k, v, out, variant_for(problem, call.arch), call)


# --------------------------------------------------------------------------------------------
# the KV-cache form

#: a split-KV grid aims at this many waves of resident blocks, and a split at least this many key
#: tiles (below, the combine's extra pass costs more than the parallelism gains)
SPLIT_WAVES = 1
MIN_TILES_PER_SPLIT = 2


def kvcache_pack(problem) -> int:
    """Query heads per block: the whole GQA group (pack-GQA, FA3), so each K/V byte is read once
    per kv head."""
    return problem.group_size


def kvcache_query_tiles(problem, variant) -> int:
    """Query tiles per (sequence, kv-head group): ``ceil(Sq * pack / Br)`` (``max_seqlen_q`` for a
    packed batch)."""
    sq = problem.varlen.max_seqlen_q if problem.varlen is not None else problem.seqlen_q
    return -(-sq * kvcache_pack(problem) // variant.block_m)


def kvcache_splits(problem, variant, arch: int, num_sms: int) -> int:
    """The split-KV count: ``num_splits`` when given, else enough splits for
    :data:`SPLIT_WAVES` waves of the blocks the SMs hold (``num_sms`` x the blocks that fit one
    SM's shared memory), keeping :data:`MIN_TILES_PER_SPLIT` key tiles per split; never more
    splits than the cache's capacity has key tiles. Never from the sequence lengths, even when
    the host knows them: a CUDA-graph replay with new ``cache_seqlens`` keeps the captured plan,
    and each split takes its share of the key tiles the lengths read on the device give. A packed
    batch (chunked prefill) runs unsplit."""
    c = problem.kvcache
    if problem.varlen is not None:
        return 1
    batch = problem.batch_shape[0]
    n_tiles = max(1, -(-c.capacity // variant.block_n))
    if c.num_splits:
        return max(1, min(c.num_splits, n_tiles, MAX_SPLITS))
    blocks = kvcache_query_tiles(problem, variant) * (problem.num_heads_q // kvcache_pack(problem)) * batch
    resident = num_sms * max(1, plan.max_dynamic_smem(arch) // variant.smem_bytes)
    want = -(-SPLIT_WAVES * resident // max(blocks, 1))
    return max(1, min(want, n_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def plan_kvcache(problem, q, out, lse, variant, partials, call) -> plan.LaunchPlan:
    """The KV-cache forward's launch plan: ``q`` (possibly the rotated copy) against the cache of
    ``problem.kvcache`` (device arrays of ``call``); ``partials`` is ``(o_partial, lse_partial)``,
    ``(splits, B * Hq * Sq, Dv)`` and ``(splits, B * Hq * Sq)`` float32, which the kernel writes
    instead of ``out`` and ``lse`` when there are several splits (``splits`` = their first axis)."""
    p, c = problem, problem.kvcache
    vl = p.varlen
    o_partial, lse_partial = partials
    splits = o_partial.shape[0]
    st = la.element_strides

    if vl is None:   # q/out (B, Sq, H, D): (batch, head, row) = axes (0, 2, 1); lse (B, Hq, Sq)
        qst, ost = ((s[0], s[2], s[1]) for s in (st(q), st(out)))
        lst = st(lse)[:2]
        batch, seqlen_q, seqlen_k = p.batch_shape[0], p.seqlen_q, c.capacity
    else:            # packed q/out (total, H, D); lse (Hq, total)
        qst, ost = ((0, s[1], s[0]) for s in (st(q), st(out)))
        lst = (0, st(lse)[0])
        batch, seqlen_q, seqlen_k = vl.batch, vl.total_q, 2**31 - 257
    kst, vst = ((s[0], s[2], s[1]) for s in (st(c.k_cache), st(c.v_cache)))
    pack = kvcache_pack(p)
    tiles = kvcache_query_tiles(p, variant)
    grid = tiles * splits * (p.num_heads_q // pack) * batch
    if grid > plan.MAX_GRID_DIMS[0]:
        raise NotImplementedError(f"{p.func}: {grid} thread blocks exceed the grid limit {plan.MAX_GRID_DIMS[0]}")
    flags = (1 if c.cache_seqlens is not None else 0) | (2 if c.cache_leftpad is not None else 0) | \
        (4 if c.cache_batch_idx is not None else 0) | (8 if c.paged else 0)
    if variant.cache_fp8:   # the descales given (else 1), as the append's flags
        flags |= (16 if p.fp8.k_descale is not None else 0) | (32 if p.fp8.v_descale is not None else 0)
    bt = c.block_table

    def idx(name):
        a = getattr(c, name)
        return plan.PointerArg.of(name, a if a is not None else call.empty_index)

    args = (
        *la.forward_args(p, (q, c.k_cache, c.v_cache, out, lse), (qst, kst, vst, ost), lst,
                         (seqlen_q, seqlen_k, tiles), call),
        *la.varlen_args(p, call),
        idx("cache_seqlens"), idx("cache_leftpad"), idx("cache_batch_idx"), idx("block_table"),
        la.i64("block_table_stride", st(bt)[0] if bt is not None else 0),
        la.i32("page_size", c.page_size), la.i32("num_pages", c.num_pages), la.i32("cache_seqlen", c.cache_seqlen),
        la.i32("seqlen_new", c.seqlen_new), la.i32("cache_capacity", c.capacity), la.i32("cache_flags", flags),
        la.i32("pack", pack), la.i32("num_splits", splits), la.i64("partial_rows", lse_partial.shape[1]),
        plan.PointerArg.of("o_partial", o_partial, writable=True),
        plan.PointerArg.of("lse_partial", lse_partial, writable=True),
        *(_descale_args(p, call) if variant.cache_fp8 else ()),
        *la.mods_args(p, la.modifier_views(p, call), call, variant.mods),
    )
    return plan.LaunchPlan(variant, variant.entry, (grid, 1, 1), variant.block, variant.smem_bytes, args)


def _descale_args(problem, call) -> tuple:
    """The fp8-cache form's trailing arguments: ``k_descale``, ``v_descale`` (float32 ``(B, Hk)``
    device arrays, any non-negative strides; absent: an empty array, never read) and their
    (batch, head) element strides."""
    f = problem.fp8
    none = call.empty((0, 0), np.float32)
    out, strides = [], []
    for name in ("k_descale", "v_descale"):
        d = getattr(f, name)
        out.append(plan.PointerArg.of(name, d if d is not None else none))
        s = la.element_strides(d) if d is not None else (0, 0)
        strides += [la.i64(f"{name[0]}d_batch_stride", s[0]), la.i64(f"{name[0]}d_head_stride", s[1])]
    return (*out, *strides)
