"""The split-KV combine (``kernels_cu/attention_combine.cu``): variant and planner.

Merges the ``num_splits`` partial results the KV-cache forward wrote into its float32 workspace
into the output and its LSE (flash-decoding). One warp per query row; the KV-cache call's types (float16, bfloat16), every arch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels.kvcache_append import KVCACHE_DTYPES
from cuflash.runtime import plan, variants
from cuflash.runtime.validation import MAX_SPLITS

#: threads per block (one warp per row)
THREADS = 128


@dataclasses.dataclass(frozen=True)
class AttentionCombine(variants.Variant):
    """The combine kernel for one output element type (``"f16"``, ``"bf16"``, ``"f32"``)."""

    family: ClassVar[str] = "attn_combine"
    source: ClassVar[str] = "attention_combine.cu"

    dtype: str

    def __post_init__(self):
        if self.dtype not in variants.DTYPES:
            raise ValueError(f"AttentionCombine: dtype={self.dtype!r} must be one of {sorted(variants.DTYPES)}")

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_T", variants.DTYPES[self.dtype][0]),
            ("CUFLASH_THREADS", str(THREADS)),
            ("CUFLASH_MAX_SPLITS", str(MAX_SPLITS)),
        )

    @classmethod
    def all(cls) -> tuple["AttentionCombine", ...]:
        """Every variant a call can run: the output types of a split KV-cache call."""
        return tuple(cls(d) for d in KVCACHE_DTYPES)


def plan_combine(o_partial, lse_partial, out, lse, *, num_heads_q: int, seqlen_q: int) -> plan.LaunchPlan:
    """Combine ``o_partial`` ``(num_splits, rows, Dv)`` and ``lse_partial`` ``(num_splits, rows)``
    (float32, contiguous; rows ordered (batch, head, query row)) into ``out`` ``(B, Sq, Hq, Dv)``
    and ``lse`` ``(B, Hq, Sq)``."""
    splits, rows, dv = o_partial.shape
    if splits > MAX_SPLITS:
        raise ValueError(f"cuflash: {splits} splits exceed the combine kernel's {MAX_SPLITS}")
    v = AttentionCombine(variants.dtype_key(out.dtype))
    warps = THREADS // 32
    grid = -(-rows // warps)
    if grid > plan.MAX_GRID_DIMS[0]:
        raise NotImplementedError(f"cuflash: {rows} rows exceed the combine kernel's grid limit")
    item = out.dtype.itemsize
    os_ = tuple(int(s) // item for s in out.strides)
    ls = tuple(int(s) // 4 for s in lse.strides)
    args = (
        plan.PointerArg.of("o_partial", o_partial), plan.PointerArg.of("lse_partial", lse_partial),
        plan.PointerArg.of("out", out, writable=True), plan.PointerArg.of("lse", lse, writable=True),
        plan.ScalarArg("partial_rows", np.int64(rows)),
        plan.ScalarArg("num_splits", np.int32(splits)),
        plan.ScalarArg("num_heads_q", np.int32(num_heads_q)),
        plan.ScalarArg("seqlen_q", np.int32(seqlen_q)),
        plan.ScalarArg("head_dim_v", np.int32(dv)),
        plan.ScalarArg("o_batch_stride", np.int64(os_[0])),
        plan.ScalarArg("o_row_stride", np.int64(os_[1])),
        plan.ScalarArg("o_head_stride", np.int64(os_[2])),
        plan.ScalarArg("lse_batch_stride", np.int64(ls[0])),
        plan.ScalarArg("lse_head_stride", np.int64(ls[1])),
    )
    return plan.LaunchPlan(v, v.entry, (grid, 1, 1), v.block, 0, args)
