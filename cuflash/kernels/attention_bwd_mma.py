"""The tensor-core attention backward (``kernels_cu/attention_bwd_mma.cu``): variants and chooser.

float16 and bfloat16 on sm_80+ (``mma.sync`` m16n8k16, ``ldmatrix``, ``cp.async``), and float16 on
sm_75 at bucket 64 in the sm_75 form (:data:`TILE_CANDIDATES_SM75`), head-dim
buckets 64, 128, 192 and 256 (other multiples of 8 run in the next bucket, zero-filled). Only the
main stage is this kernel's: the ``dot`` and ``convert`` stages, the float32 dQ workspace and the
deterministic mode's per-split partials are :mod:`cuflash.kernels.backward_run`'s, whose
main-stage argument list this kernel shares (:func:`main_variant` is what the dispatcher asks for).

Tiles (FlashAttention-2's backward, Dao 2023, §3.2; the flash-attn repository's sm_80 backward
uses 128 x 128 with 8 warps at head dim 64, 64 x 128 at 128 and 64 x 64 at 256): 8 warps; Br = 128
query rows by Bc = 128 keys at bucket 64 where it fits (sm_90; not the dropout forms),
else Br = 64 by Bc = 128 up to bucket 128, 64 x 64 above (dK and dV of Bc x D each stay in
registers: 128 per thread at 128 x 128 and at 64 x 256); Q/dO double-buffered where two stages fit the arch's
shared memory, else one stage, else a smaller tile (:data:`TILE_CANDIDATES`), else the SIMT
backward (:func:`unsupported_reason`).

Alignment rules as the forward's (:func:`cuflash.kernels.attention_fwd_mma.unsupported_reason`): q, k, v,
out and dout rows 16-byte aligned; the dispatcher (:func:`cuflash.kernels.dispatch.backward_tier`)
falls back to the SIMT backward otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels import attention_fwd_mma
from cuflash.runtime import cuda_runner, nvrtc, plan, score_mod, variants
from cuflash.runtime.validation_modifiers import refuse_modifiers

HEAD_DIM_BUCKETS = (64, 128, 192, 256)
MMA_DTYPES = attention_fwd_mma.MMA_DTYPES
ARCHES = attention_fwd_mma.ARCHES
MIN_ARCH = attention_fwd_mma.MIN_ARCH
#: warps per block (every tile)
WARPS = 8
#: (Br, Bc, Q/dO stages) by bucket, in order of preference: the first whose shared memory fits
#: the arch is used (sm_90: the first; sm_80's 163 KB: 64 x 128 at 64, one stage at 192 and 256;
#: sm_86/89's 99 KB: 64 x 64 one stage at 128, nothing at 192/256). At bucket 64 the 128 x 128
#: tile (FlashAttention-2's at head dim 64; 182 KB, so sm_90 and newer) spreads each query tile's
#: bookkeeping (the loop, barriers, copy and dQ addresses) over twice the products: 894 instead of
#: 2 x 529 instructions outside FP32 arithmetic per warp and 128 query rows (sm_90, NVRTC 12.9; FA2's
#: d64 backward in PyTorch: 974)
TILE_CANDIDATES = {
    64: ((128, 128, 2), (64, 128, 2), (64, 128, 1)),
    128: ((64, 128, 2), (64, 128, 1), (64, 64, 2), (64, 64, 1)),
    192: ((64, 64, 2), (64, 64, 1)),
    256: ((64, 64, 2), (64, 64, 1)),
}
#: before sm_90, ptxas spills the 64 x 128 tile of bucket 128 (72 bytes at one stage; the compile
#: gate refuses spills): there it takes 64 x 64
TILE_CANDIDATES_BEFORE_SM90 = {128: ((64, 64, 2), (64, 64, 1))}
#: the sm_75 form (:data:`cuflash.kernels.attention_fwd_mma.SM75_ARCH`: float16, two m16n8k8 per
#: m16n8k16, register-staged copies): in Turing's 64 KB only bucket 64 has a tile, 64 x 64 with one
#: Q/dO stage (55808 B, one CTA of 8 warps per SM); bucket 128's smallest (64 x 64, one stage)
#: needs 88576 B, so larger head dims take the portable backward
TILE_CANDIDATES_SM75 = {64: ((64, 64, 1),)}
#: the score-modifier forms (``mods``): the per-pair modifier code beside S and dP spills at 64 x
#: 128 (12 bytes for bucket 64, 84-96 for 128, sm_90), so 64 x 64 there
TILE_CANDIDATES_MODS = {64: ((64, 64, 2), (64, 64, 1)), 128: ((64, 64, 2), (64, 64, 1))}
#: the dropout forms: the keep bits drawn before S and dP, beside the 64 x 128 tile's dK/dV and its
#: per-thread ldmatrix offsets, spill 32 bytes under NVRTC 13.5 at bucket 128 (sm_90), so 64 x 64
#: there (as before sm_90); at bucket 64 a lane of the 128 x 128 tile holds 64 scores, more keep bits
#: than dropout.cuh's one word, so 64 x 128
TILE_CANDIDATES_DROPOUT = {64: ((64, 128, 2), (64, 128, 1)), 128: ((64, 64, 2), (64, 64, 1))}
#: the forms whose every fitting tile ptxas spills under one NVRTC major (with the kernel as of this
#: table, NVRTC 12.9 and 13.x; the compile gate's KNOWN_SPILLS rows), by (gate arch, bucket,
#: varlen, dropout, mods): NVRTC major -> the bytes spilled. The other tile of the bucket spills as
#: much or more (64 x 64 with one stage on sm_90: 8-56 bytes), and Br = Bc = 64 is the warp
#: layouts' least. Each compiles without spills under the other major, so such a variant is
#: compiled by that one where it is installed (:meth:`AttentionBwdMma.spilling_nvrtc_majors`,
#: :func:`cuflash.runtime.cuda_runner.nvrtc_for`); where only the spilling major is installed the
#: dispatcher sends the call to the portable backward, which takes every built-in modifier and
#: dropout (:func:`unsupported_reason` says so). A traced score_mod/mask_mod, which only this kernel
#: compiles, still runs here. Sm_8x rows stand for 8.x devices, sm_90 for 9.0 and newer.
SPILLING_FORMS = {
    (80, 256, False, True, False): {12: "4 bytes"},
    (80, 256, False, False, True): {12: "36 bytes"},
    (90, 192, False, True, False): {13: "8 bytes"},
    (90, 192, False, False, True): {12: "8 bytes"},
    (90, 192, True, False, True): {13: "12 bytes"},
    (90, 256, False, False, True): {12: "60 bytes"},
    (90, 256, True, False, True): {12: "12 bytes"},
    # the block-sparse forms of a traced mask_mod (keys end in "bs"; measured with the causal document
    # mask of cuflash.mods): the list walk's state beside the 64 x 64 tile at bucket 256 (at 192 the
    # traced forms' rolled k-step loops, attention_bwd_mma.cu, leave room)
    (80, 256, False, False, True, "bs"): {12: "36 bytes"},
    (90, 256, False, False, True, "bs"): {13: "24 bytes"},
    # the captured-array gradient forms of a traced score_mod (return_dscore_mod; keys end in "ag";
    # measured with a softcapped per-head-slope ALiBi plus a relative-position table, f16)
    (80, 256, False, False, True, "ag"): {12: "8 bytes"},
    # ... and their exact (deterministic) forms (keys end in "agx"; the same function, f16; the exact add
    # out of line)
    (80, 256, False, False, True, "agx"): {12: "28 bytes"},
}


@dataclasses.dataclass(frozen=True)
class AttentionBwdMma(variants.TileVariant):
    """The tensor-core main stage of the backward for one dtype, head-dim bucket and tile.

    Parameters
    ----------
    dtype : {"f16", "bf16"}
    head_dim_max : int
        Bucket of ``max(D, Dv)``: 64, 128, 192 or 256.
    block_m, block_n : int
        Query rows (Br, a multiple of 32) and keys (Bc, a multiple of 64) per tile.
    stages : {1, 2}
        Q/dO pipeline stages.
    """

    family: ClassVar[str] = "attn_bwd_mma"
    source: ClassVar[str] = "attention_bwd_mma.cu"
    dtypes: ClassVar[tuple[str, ...]] = MMA_DTYPES
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS

    stages: int = 2
    #: the sm_75 form built for a newer arch (``CUFLASH_SM75_FORM`` 1, entry suffix ``_sm75form``;
    #: :func:`cuflash.kernels.attention_fwd_mma.sm75_form`)
    sm75_form: bool = dataclasses.field(default=False, kw_only=True)
    #: the captured-array gradients added exactly, in integer limbs (``CUFLASH_AGRAD_EXACT`` 1, entry
    #: suffix ``_agx``; deterministic=True): the same bits in any order of the adds
    agrad_exact: bool = dataclasses.field(default=False, kw_only=True)
    #: deterministic mode's dQ as its own form (``CUFLASH_DETERMINISTIC_DQ`` 1, entry suffix ``_det``):
    #: each block adds into its split's partial without atomics, and the atomic form's loop holds no
    #: branch to that code. Plain forms only (fixed and packed); the dropout and modifier forms take
    #: deterministic mode as a run-time argument
    deterministic_dq: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def dq_padded(self) -> bool:
        """The main stage adds dQ into a padded workspace (``DQ_PADDED``: the fixed plain forms'
        atomic dQ): rows per (batch, query head) a multiple of ``block_m`` and a row pitch of
        ``head_dim_max``, so an edge query tile adds like an interior one; the padding is never read.
        Head dims up to 128 (at 256 the form spilled under NVRTC 13 on sm_90)."""
        return self.head_dim_max <= 128 and not (self.varlen or self.dropout or self.mods or self.deterministic_dq)

    def __post_init__(self):
        super().__post_init__()
        if self.deterministic_dq and (self.dropout or self.mods):
            raise ValueError("AttentionBwdMma: deterministic_dq is a form of the plain variants (no dropout, no "
                             f"score modifiers); got dropout={self.dropout}, mods={self.mods}")
        if self.block_m % 32 or self.block_n % 64 or self.block_m <= 0 or self.block_n <= 0 or self.stages not in (1, 2):
            raise ValueError(f"AttentionBwdMma: tile ({self.block_m}, {self.block_n}, stages={self.stages}) must be "
                             "a multiple of 32 rows by a multiple of 64 keys with 1 or 2 stages")

    def axes(self) -> tuple[str, ...]:
        return (("main",) + super().axes() + (f"s{self.stages}",) + (("sm75form",) if self.sm75_form else ())
                + (("agx",) if self.agrad_exact else ()) + (("det",) if self.deterministic_dq else ()))

    def spilling_nvrtc_majors(self, arch: int) -> tuple[int, ...]:
        """The NVRTC majors that spill this variant on ``sm_<arch>`` (:data:`SPILLING_FORMS`)."""
        return tuple(SPILLING_FORMS.get(_spill_key(arch, self), {}))

    @property
    def stage(self) -> str:
        return "main"

    @property
    def threads(self) -> int:
        return 32 * WARPS

    @property
    def warp_layouts(self) -> tuple[int, int, int]:
        """Warps along the first output axis of S/dP (queries), dK/dV (keys) and dQ (queries);
        the rest of the 8 split the second axis. Each warp's tile is as square as the 8 warps
        allow: S 32 x 32 at Bc = 128 (16 x 32 at 64: one A fragment per k-step, fewer registers
        than 32 x 16 for the same shared-memory bytes), dK/dV 32 keys x D/(Bc/32), dQ 32 x D/4; at
        Br = 128 (FA2's d64 layout), S 32 x 64 and dQ 32 x D/2."""
        if self.block_m >= 128:
            return 4, self.block_n // 32, 4
        return (2 if self.block_n >= 128 else 4), self.block_n // 32, 2

    @property
    def smem_bytes(self) -> int:
        """K, V (Bc rows), Q, dO (stages x Br rows) at pitch Dmax + 8, P and dS (Br x (Bc + 8)),
        16-bit; lse and Dd (stages x Br floats each). The kernel ``static_assert``s the same figure."""
        pitch = self.head_dim_max + 8
        bm, bn, st = self.block_m, self.block_n, self.stages
        return 2 * (2 * bn * pitch + 2 * st * bm * pitch + 2 * bm * (bn + 8)) + 4 * 2 * st * bm

    @property
    def dq_passes(self) -> int:
        """Column passes of the dQ product: 4 where one pass would hold 64 accumulators per thread
        beside dK's and dV's 128 (Br x D = 64 x 256; with 2 passes ptxas still spills 8-48 bytes
        on sm_90), else 1. A pass re-reads the dS fragments."""
        return 4 if self.block_m * self.head_dim_max // self.threads >= 64 else 1

    def defines(self) -> tuple[tuple[str, str], ...]:
        sm, kvn, qm = self.warp_layouts
        return super().defines() + (
            ("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
            ("CUFLASH_STAGES", str(self.stages)),
            ("CUFLASH_SDP_WARPS_M", str(sm)),
            ("CUFLASH_DKV_WARPS_N", str(kvn)),
            ("CUFLASH_DQ_WARPS_M", str(qm)),
            ("CUFLASH_DQ_PASSES", str(self.dq_passes)),
        ) + ((("CUFLASH_SM75_FORM", "1"),) if self.sm75_form else ()) + ((("CUFLASH_AGRAD_EXACT", "1"),) if self.agrad_exact else ()) + (
            (("CUFLASH_DETERMINISTIC_DQ", "1"),) if self.deterministic_dq else ()) + (
            (("CUFLASH_DQ_PADDED", "1"),) if self.dq_padded else ())

    def describe(self, arch: int | None = None) -> str:
        det = ", dQ into per-split partials without atomics (deterministic)" if self.deterministic_dq else ""
        return self._describe(arch) + det

    def _describe(self, arch: int | None) -> str:
        if self.sm75_form or (arch is not None and arch < MIN_ARCH):   # the sm_75 form (kernels_cu/ptx.cuh: CUFLASH_SM75_FORM)
            return (f"{self.entry}: {WARPS} warps, Bc={self.block_n} keys x Br={self.block_m} query tiles, head-dim "
                    f"bucket {self.head_dim_max}, {self.smem_bytes} B shared memory ({self.stages}-stage Q/dO, "
                    f"register-staged copies), mma.sync m16n8k8 x 2 per m16n8k16 {self.dtype}")
        return (f"{self.entry}: {WARPS} warps, Bc={self.block_n} keys x Br={self.block_m} query tiles, head-dim bucket "
                f"{self.head_dim_max}, {self.smem_bytes} B shared memory ({self.stages}-stage Q/dO, cp.async), "
                f"mma.sync m16n8k16 {self.dtype}")


def _candidates(bucket: int, arch: int, mods: bool = False, dropout: bool = False) -> tuple[tuple[int, int, int], ...]:
    if (arch < MIN_ARCH or attention_fwd_mma.sm75_form_forced()) and bucket in TILE_CANDIDATES_SM75:
        return TILE_CANDIDATES_SM75[bucket]
    if attention_fwd_mma.sm75_form_forced():   # (no sm_75 tile: the smallest of sm_80's, which fits no 64 KB)
        return TILE_CANDIDATES_BEFORE_SM90.get(bucket, TILE_CANDIDATES[bucket])
    if mods and bucket in TILE_CANDIDATES_MODS:
        return TILE_CANDIDATES_MODS[bucket]
    if dropout and bucket in TILE_CANDIDATES_DROPOUT:
        return TILE_CANDIDATES_DROPOUT[bucket]
    return TILE_CANDIDATES_BEFORE_SM90.get(bucket, TILE_CANDIDATES[bucket]) if arch < 90 else TILE_CANDIDATES[bucket]


def _fitting(key: str, bucket: int, arch: int, dropout: bool = False, mods: bool = False,
             user: tuple = ("", "", "")) -> AttentionBwdMma | None:
    forced = attention_fwd_mma.sm75_form_forced()
    candidates = (AttentionBwdMma(key, bucket, bm, bn, st, dropout=dropout, mods=mods, score_c=user[0],
                                  mask_c=user[1], grad_c=user[2], agrad_c=user[3] if len(user) > 3 else "",
                                  agrad_warp_c=user[4] if len(user) > 4 else "", sm75_form=forced and arch >= MIN_ARCH)
                  for bm, bn, st in _candidates(bucket, arch, mods, dropout))
    limit = plan.max_dynamic_smem(min(arch, attention_fwd_mma.SM75_ARCH) if forced else arch)
    return AttentionBwdMma.first_fitting(candidates, limit)


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int, *, dropout: bool = False,
                   mods: bool = False, user: tuple = ("", "", ""), block_sparse: bool = False) -> AttentionBwdMma:
    """The preferred tile of the bucket that fits ``sm_<arch>``'s shared memory (``user``: the
    traced functions' CUDA C, :func:`cuflash.kernels.attention_fwd_mma.user_c` with the derivative,
    and optionally a fourth and fifth text, the captured-array gradients'
    :func:`cuflash.runtime.score_mod.array_grad_c`).

    Raises
    ------
    NotImplementedError
        If no tile of the bucket fits (:func:`unsupported_reason` says so first).
    """
    key = variants.dtype_key(dtype)
    bucket = AttentionBwdMma.bucket(head_dim, head_dim_v)
    v = _fitting(key, bucket, arch, dropout, mods, user)
    if v is not None and block_sparse:   # (the form that walks a block mask's transposed index)
        v = dataclasses.replace(v, block_sparse=True)
    if v is None:
        raise NotImplementedError(f"cuflash: no tensor-core backward tile fits sm_{arch}'s shared memory "
                                  f"({plan.max_dynamic_smem(arch)} B) for head dim {bucket}")
    return v


def all_variants(arch: int, *, varlen: bool = False, dropout: bool = False,
                 mods: bool = False, deterministic: bool = False) -> tuple[AttentionBwdMma, ...]:
    """Every variant the backward dispatcher can choose on ``sm_<arch>`` (for the compile gate);
    with ``varlen``, their packed variable-length forms; with ``dropout``, their dropout forms; with
    ``deterministic``, the plain forms' deterministic dQ forms (:attr:`AttentionBwdMma.deterministic_dq`;
    none with dropout or modifiers). (A :data:`SPILLING_FORMS` variant is among them: it is chosen
    where an NVRTC major that does not spill it is installed.)"""
    if arch < attention_fwd_mma.SM75_ARCH or (deterministic and (dropout or mods)):
        return ()
    keys = attention_fwd_mma.SM75_DTYPES if arch < MIN_ARCH else MMA_DTYPES   # (the sm_75 form: float16)
    found = (_fitting(key, b, arch, dropout, mods) for key in keys for b in HEAD_DIM_BUCKETS)
    return tuple(dataclasses.replace(v, varlen=varlen or v.varlen, deterministic_dq=deterministic)
                 for v in found if v is not None)


def _spill_key(arch: int, variant) -> tuple:
    return ((90 if arch >= 90 else 80, variant.head_dim_max, variant.varlen, variant.dropout, variant.mods)
            + (("bs",) if getattr(variant, "block_sparse", False) else
               ("agx" if getattr(variant, "agrad_exact", False) else "ag",) if getattr(variant, "agrad_c", "") else ()))


def spill_note(arch: int, variant: AttentionBwdMma, majors: tuple[int, ...] | None = None) -> str | None:
    """What ptxas spills in ``variant`` on ``sm_<arch>`` under every NVRTC major of ``majors`` (None:
    :func:`cuflash.runtime.cuda_runner.usable_nvrtc_majors`, or every major cuflash knows when none
    is installed), or None if one of them compiles it without spills (:data:`SPILLING_FORMS`)."""
    if majors is None:
        majors = cuda_runner.usable_nvrtc_majors(arch) or nvrtc.MAJORS
    spills = SPILLING_FORMS.get(_spill_key(arch, variant), {})
    if not majors or any(m not in spills for m in majors):
        return None
    clean = [m for m in nvrtc.MAJORS if m not in spills and nvrtc.OLDEST_ARCH[m] <= arch]
    note = ", ".join(f"{spills[m]} under NVRTC {m}.x" for m in majors)
    if clean:
        note += "; NVRTC " + ", ".join(f"{m}.x" for m in clean) + ", which compiles it without spills, is not in use"
    return note


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the backward of ``problem`` cannot run on this kernel (None if it can). ``arrays`` is
    ``(q, k, v, out, dout)``; the forward's rules apply to each, and a tile of the head dims'
    bucket must fit the arch's shared memory."""
    p = problem
    why = refuse_modifiers(p, "the tensor-core backward", attention_fwd_mma.MODIFIERS + attention_fwd_mma.USER_MODIFIERS)
    if why is not None:
        return why
    if p.modifiers is not None and p.modifiers.score_mod is not None and p.options.return_dbias:
        # (the kernel writes d attn_bias before the score_mod's derivative is applied)
        return "return_dbias with score_mod is not in the tensor-core backward yet"
    if p.options.return_dscore_mod and p.options.deterministic:
        terms, pairs = exact_grad_terms(p)
        if terms * pairs >= EXACT_GRAD_MAX_TERMS:
            return (f"return_dscore_mod with deterministic=True: the exact sums of the captured arrays' gradients take "
                    f"fewer than 2^39 terms per element (captured-array reads per pair x query-key pairs: {terms} x {pairs} "
                    "here)")
    arrays = tuple(arrays or ())
    why = attention_fwd_mma.unsupported_reason(p, arch, arrays[:4])
    if why is None and len(arrays) > 4:
        why = attention_fwd_mma.unsupported_reason(p, arch, (arrays[4],))
        if why is not None:
            why = why.replace("q ", "dout ", 1)
    if why is None:
        bucket = AttentionBwdMma.bucket(p.head_dim, p.head_dim_v)
        if _fitting(variants.dtype_key(p.dtype), bucket, arch) is None:
            smallest = AttentionBwdMma("f16", bucket, *_candidates(bucket, arch)[-1]).smem_bytes
            where = (min(arch, attention_fwd_mma.SM75_ARCH) if attention_fwd_mma.sm75_form_forced() else arch)
            why = (f"head dim {max(p.head_dim, p.head_dim_v)}: the smallest backward tile needs {smallest} B of shared "
                   f"memory, sm_{where} has {plan.max_dynamic_smem(where)} B")
    m = p.modifiers
    traced = m is not None and (m.score_mod is not None or m.mask_mod is not None)
    if why is None and (p.dropout is not None or m is not None) and not traced:
        spills = spill_note(arch, dataclasses.replace(main_variant(p, arch), varlen=p.varlen is not None))
        if spills is not None:
            what = "dropout" if p.dropout is not None else "score modifiers"
            why = (f"with {what} at head dim {max(p.head_dim, p.head_dim_v)}{' in a packed batch' * (p.varlen is not None)}"
                   f", its only tile that fits sm_{arch} spills registers to local memory ({spills}); the portable "
                   "backward runs it without spills")
    return why


#: the exact form's (``CUFLASH_AGRAD_EXACT``) bound on the terms added into one element: a limb takes
#: ``2^39`` adds of at most ``2^24`` before it could overflow
EXACT_GRAD_MAX_TERMS = 2 ** 39


def exact_grad_terms(problem) -> tuple[int, int]:
    """``(terms, pairs)``: the captured-array gradient terms per query-key pair of the traced
    score_mod (each adds into one element) and an upper bound on the pairs (batch x query heads x
    query rows x keys; a packed batch: query heads x total query rows x its longest key sequence)."""
    p = problem
    terms = len(score_mod.array_derivatives(p.modifiers.score_mod))
    if p.varlen is not None:
        return terms, p.num_heads_q * p.varlen.total_q * p.varlen.max_seqlen_k
    return terms, int(np.prod(p.batch_shape, dtype=np.int64)) * p.num_heads_q * p.seqlen_q * p.seqlen_k


#: the exact form's limbs per element (``AGX_LIMBS``), their width in bits (``AGX_W``) and the weight of
#: limb 0's unit, ``2^EXACT_GRAD_LSB`` (float32's least subnormal step); one flag word follows the limbs
EXACT_GRAD_LIMBS, EXACT_GRAD_BITS, EXACT_GRAD_LSB = 12, 24, -149


def exact_grad_workspace(shape, call, name: str = "array"):
    """A zeroed int64 workspace ``(*shape, EXACT_GRAD_LIMBS + 1)`` for the exact form's gradient of a
    captured array of ``shape`` on ``call``'s device.

    Raises
    ------
    MemoryError
        If the device cannot hold it, naming the array, the shape and the bytes.
    """
    full = tuple(shape) + (EXACT_GRAD_LIMBS + 1,)
    try:
        return call.xp.zeros(full, dtype=np.int64)
    except MemoryError as e:
        n = 8 * int(np.prod(full, dtype=object))
        raise MemoryError(f"attention_backward: deterministic=True sums the gradient of captured array {name!r} "
                          f"(shape {tuple(shape)}) exactly in {EXACT_GRAD_LIMBS + 1} int64 words per element, "
                          f"{n} bytes, which do not fit in the device's memory ({e}); pass deterministic=False "
                          "or use a smaller array") from None


def exact_grad_sum(acc, xp):
    """The float32 values of the exact form's workspace ``acc`` (int64 ``(..., EXACT_GRAD_LIMBS + 1)``,
    :func:`exact_grad_workspace`; ``xp``: NumPy or CuPy): the limbs' integer sum times
    ``2^EXACT_GRAD_LSB``, rounded to float64 and then to float32 (the same for every order of the
    kernel's adds), NaN where a term was NaN or where both infinities were added, else the infinity
    added."""
    w, n = EXACT_GRAD_BITS, EXACT_GRAD_LIMBS
    limbs = [acc[..., i].copy() for i in range(n)]

    def carry():   # limbs 0 .. n-2 into [0, 2^w), the rest carried up (exact integer arithmetic)
        for i in range(n - 1):
            c = limbs[i] >> w
            limbs[i] -= c << w
            limbs[i + 1] += c

    carry()
    negative = limbs[-1] < 0   # the sum's sign: the lower limbs are non-negative
    limbs = [xp.where(negative, -x, x) for x in limbs]
    carry()
    total = xp.zeros(acc.shape[:-1], dtype=np.float64)
    for i in reversed(range(n)):   # non-negative parts, largest first
        total += limbs[i].astype(np.float64) * 2.0 ** (w * i + EXACT_GRAD_LSB)
    total = xp.where(negative, -total, total)
    with np.errstate(over="ignore"):   # (a sum past float32's largest value is an infinity)
        out = total.astype(np.float32)
    flags = acc[..., n] & 0xFFFFFFFF
    out = xp.where(flags == 2, np.float32(np.inf), out)
    out = xp.where(flags == 4, np.float32(-np.inf), out)
    return xp.where(((flags & 1) != 0) | ((flags & 6) == 6), np.float32(np.nan), out)


def main_variant(problem, arch: int) -> AttentionBwdMma:
    """The main stage that runs the backward of ``problem`` on ``sm_<arch>``, in its dropout and
    modifier forms as the call needs (:func:`cuflash.kernels.backward_run.backward` runs it
    between the portable dot and convert stages)."""
    agrad = _array_grad_c(problem)
    v = choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch,
                       dropout=problem.dropout is not None, mods=problem.modifiers is not None,
                       user=attention_fwd_mma.user_c(problem, grad=True) + agrad,
                       block_sparse=problem.modifiers is not None and problem.modifiers.block_mask is not None)
    v = dataclasses.replace(v, agrad_exact=True) if agrad and agrad[0] and problem.options.deterministic else v
    return with_dq_mode(v, problem.options.deterministic)


def with_dq_mode(variant: AttentionBwdMma, deterministic: bool) -> AttentionBwdMma:
    """``variant`` in the dQ form of ``deterministic`` mode: a plain form's deterministic mode is its
    own form (:attr:`AttentionBwdMma.deterministic_dq`); the dropout and modifier forms take the
    mode as a run-time argument."""
    plain = not (variant.dropout or variant.mods)
    return dataclasses.replace(variant, deterministic_dq=bool(deterministic) and plain)


def _array_grad_c(problem) -> tuple:
    """``(pair_c, warp_c)``: the captured-array gradients' CUDA C when the call asks for them
    (``return_dscore_mod``), else ``()``."""
    m = problem.modifiers
    if not problem.options.return_dscore_mod or m is None or m.score_mod is None:
        return ()
    return score_mod.array_grad_c(m.score_mod)
