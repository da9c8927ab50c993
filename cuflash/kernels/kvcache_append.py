"""The KV-cache append (``kernels_cu/kvcache_append.cu``): variant and planner.

Writes the new keys and values of :func:`cuflash.attention_with_kvcache` into the cache in place
(rotating the keys first when rotary tables are given) and the rotated queries into a workspace.
float16 and bfloat16 (the KV-cache forward's types), every arch; one block per row. Into an fp8
(float8_e4m3fn) cache the new rows are quantized with their descales as they are stored
(``cache="e4m3"``: the kernel's ``cvt.rn.satfinite.e4m3x2.f32`` store, byte for byte what
:func:`cuflash.reference.fp8.quantize_e4m3` computes).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.runtime import plan, variants

#: threads per block (a row's columns are strided over them)
THREADS = 64
#: the element types of a KV-cache call (its forward runs on the tensor-core tier: float16 and
#: bfloat16; a float32 call is refused before any kernel runs)
KVCACHE_DTYPES = ("f16", "bf16")
#: the cache forms: ``"same"`` (the new rows' type) and ``"e4m3"`` (fp8 bytes, quantized on store)
CACHE_FORMS = ("same", "e4m3")


@dataclasses.dataclass(frozen=True)
class KVCacheAppend(variants.Variant):
    """The append kernel for one element type and one rotary-table type.

    Parameters
    ----------
    dtype : {"f16", "bf16", "f32"}
        Element type of the cache, the new rows and q.
    rot_dtype : {"f16", "bf16", "f32"}
        Element type of ``rotary_cos``/``rotary_sin`` (q's, or float32).
    cache : {"same", "e4m3"}
        The caches' type: the element type, or float8_e4m3fn bytes (``_e4m3`` ends the name).
    """

    family: ClassVar[str] = "kvcache_append"
    source: ClassVar[str] = "kvcache_append.cu"

    dtype: str
    rot_dtype: str
    cache: str = "same"

    def __post_init__(self):
        for name in ("dtype", "rot_dtype"):
            if getattr(self, name) not in variants.DTYPES:
                raise ValueError(f"KVCacheAppend: {name}={getattr(self, name)!r} must be one of {sorted(variants.DTYPES)}")
        if self.cache not in CACHE_FORMS:
            raise ValueError(f"KVCacheAppend: cache={self.cache!r} must be one of {CACHE_FORMS}")

    def axes(self) -> tuple[str, ...]:
        """``(dtype, rot_dtype)``, and ``"e4m3"`` for an fp8 cache (the names of the other variants
        stay as they were)."""
        return (self.dtype, self.rot_dtype) + (("e4m3",) if self.cache == "e4m3" else ())

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_T", variants.DTYPES[self.dtype][0]),
            ("CUFLASH_ROT_T", variants.DTYPES[self.rot_dtype][0]),
            ("CUFLASH_THREADS", str(THREADS)),
            ("CUFLASH_CACHE_FP8", "1" if self.cache == "e4m3" else "0"),
        )

    @classmethod
    def all(cls) -> tuple["KVCacheAppend", ...]:
        """Every variant a call can run (for the compile gate and precompilation): the KV-cache
        forward's element types with same-dtype and float32 tables (the fp8-cache forms,
        :meth:`fp8_forms`, are listed beside them for sm_75 and newer, where the KV-cache kernel
        reads an fp8 cache; on sm_75 with float16 q only)."""
        return tuple(dict.fromkeys(cls(d, r) for d in KVCACHE_DTYPES for r in (d, "f32")))

    @classmethod
    def fp8_forms(cls) -> tuple["KVCacheAppend", ...]:
        """The fp8-cache variants (float8_e4m3fn caches; new rows and tables as :meth:`all`)."""
        return tuple(cls(v.dtype, v.rot_dtype, "e4m3") for v in cls.all())


def _strides(a) -> tuple[int, ...]:
    return tuple(int(s) // a.dtype.itemsize for s in a.strides)


def plan_append(problem, q, q_rot, q_per_row: bool, call) -> plan.LaunchPlan | None:
    """The append's launch plan, or None when there is nothing to write (no new rows and no
    rotated queries). ``q_rot`` receives the rotated queries (None without rotary tables);
    ``q_per_row`` is flash-attn's query-rotation rule. The cache's arrays (``problem.kvcache``)
    and ``q`` are device arrays of ``call``; an absent index is the device's empty index (never
    read), absent tables an empty float32 array."""
    p, c = problem, problem.kvcache
    none = call.empty_index
    batch, sq = p.batch_shape[0], p.seqlen_q
    rotary = c.rotary_cos is not None
    kv_rows = batch * c.seqlen_new * p.num_heads_k
    q_rows = batch * sq * p.num_heads_q if rotary else 0
    if kv_rows + q_rows == 0:
        return None
    if kv_rows + q_rows > plan.MAX_GRID_DIMS[0]:
        raise NotImplementedError(f"{p.func}: {kv_rows + q_rows} rows to append or rotate exceed the grid limit")
    key = variants.dtype_key(p.dtype)
    rot_key = variants.dtype_key(c.rotary_cos.dtype) if rotary else key
    fp8 = p.fp8 is not None
    v = KVCacheAppend(key, rot_key, "e4m3" if fp8 else "same")
    kn = c.k_new if c.k_new is not None else c.k_cache[:0, :0]
    vn = c.v_new if c.v_new is not None else c.v_cache[:0, :0]
    ptr = call.pointer
    no_float = call.empty((0, 0), np.float32)
    q_out = q_rot if rotary else q
    st = [_strides(a) for a in (kn, vn, c.k_cache, c.v_cache, q, q_out)]
    rot_stride = _strides(c.rotary_cos)[0] if rotary else 0
    flags = (1 if c.cache_seqlens is not None else 0) | (4 if c.cache_batch_idx is not None else 0) | \
        (8 if c.paged else 0)
    bt = c.block_table
    # an fp8 cache's descales (B, Hk), any non-negative strides (stride 0: one scale); flags 16, 32
    kd = p.fp8.k_descale if fp8 else None
    vd = p.fp8.v_descale if fp8 else None
    kds = _strides(kd) if kd is not None else (0, 0)
    vds = _strides(vd) if vd is not None else (0, 0)
    descale_flags = (16 if kd is not None else 0) | (32 if vd is not None else 0)
    args = (
        ptr("k_new", kn), ptr("v_new", vn), ptr("k_cache", c.k_cache, writable=True),
        ptr("v_cache", c.v_cache, writable=True), ptr("q", q), ptr("q_rot", q_out, writable=rotary),
        *(plan.PointerArg.of(n, x) for n, x in (("rot_cos", c.rotary_cos if rotary else no_float),
                                                ("rot_sin", c.rotary_sin if rotary else no_float))),
        *(plan.ScalarArg(f"{n}_{w}_stride", np.int64(s[i] if len(s) > i else 0))
          for n, s in zip(("kn", "vn", "kc", "vc", "q", "qr"), st) for i, w in enumerate(("batch", "row", "head"))),
        plan.ScalarArg("rot_row_stride", np.int64(rot_stride)),
        *(plan.ScalarArg(n, np.int32(x)) for n, x in (
            ("batch", batch), ("seqlen_new", c.seqlen_new), ("seqlen_q", sq), ("num_heads_k", p.num_heads_k),
            ("num_heads_q", p.num_heads_q), ("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v),
            ("rotary_dim", c.rotary_dim), ("interleaved", int(c.rotary_interleaved)),
            ("q_per_row", int(q_per_row)), ("seqlen_ro", c.rotary_cos.shape[0] if rotary else 0))),
        plan.PointerArg.of("cache_seqlens", c.cache_seqlens if c.cache_seqlens is not None else none),
        plan.ScalarArg("cache_seqlen", np.int32(c.cache_seqlen)),
        plan.PointerArg.of("cache_batch_idx", c.cache_batch_idx if c.cache_batch_idx is not None else none),
        plan.PointerArg.of("block_table", bt if bt is not None else none),
        plan.ScalarArg("block_table_stride", np.int64(_strides(bt)[0] if bt is not None else 0)),
        plan.ScalarArg("page_size", np.int32(c.page_size)),
        plan.ScalarArg("num_pages", np.int32(c.num_pages)),
        plan.ScalarArg("capacity", np.int32(c.capacity)),
        plan.ScalarArg("cache_flags", np.int32(flags | descale_flags)),
        *(plan.PointerArg.of(n, x if x is not None else no_float) for n, x in (("k_descale", kd), ("v_descale", vd))),
        *(plan.ScalarArg(n, np.int64(s)) for n, s in (("kd_batch_stride", kds[0]), ("kd_head_stride", kds[1]),
                                                       ("vd_batch_stride", vds[0]), ("vd_head_stride", vds[1]))),
    )
    return plan.LaunchPlan(v, v.entry, (kv_rows + q_rows, 1, 1), v.block, 0, args)
