"""The dropout keep mask and raw generator as kernels (``kernels_cu/dropout_mask.cu``).

They run the text the attention kernels include (``kernels_cu/dropout.cuh``), so tests can hold
its bits to the NumPy path's (:mod:`cuflash.reference.dropout`) and to Random123's known-answer
vectors on the simulator, and :func:`mask` shows a user the mask a call applies.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.runtime import plan, variants

#: threads per block
THREADS = 128


@dataclasses.dataclass(frozen=True)
class DropoutMaskVariant(variants.Variant):
    """``mode``: ``"mask"`` (the uint8 keep mask of a (B, H, Sq, Sk) block) or ``"raw"`` (Philox
    4x32-10 of given counters)."""

    family: ClassVar[str] = "dropout"
    source: ClassVar[str] = "dropout_mask.cu"

    mode: str

    def __post_init__(self):
        if self.mode not in ("mask", "raw"):
            raise ValueError(f"DropoutMaskVariant: mode={self.mode!r} must be 'mask' or 'raw'")

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (("CUFLASH_DROPOUT_RAW", "1" if self.mode == "raw" else "0"),)

    @classmethod
    def all(cls) -> tuple["DropoutMaskVariant", ...]:
        return (cls("mask"), cls("raw"))


def plan_mask(keep, batch0: int, seed: int, offset: int, threshold: int) -> plan.LaunchPlan:
    """Fill ``keep`` (uint8, C-contiguous ``(B, H, Sq, Sk)``) with the keep mask."""
    b, h, sq, sk = keep.shape
    pairs = b * h * sq * ((sk + 1) // 2)
    v = DropoutMaskVariant("mask")
    args = (plan.PointerArg.of("keep", keep.reshape(-1), writable=True),
            *(plan.ScalarArg(n, np.int32(x)) for n, x in (("batch", b), ("heads", h), ("seqlen_q", sq), ("seqlen_k", sk))),
            plan.ScalarArg("batch0", np.int64(batch0)),
            *(plan.ScalarArg(n, np.uint32(x)) for n, x in (("seed", seed), ("offset", offset), ("threshold", threshold))))
    return plan.LaunchPlan(v, v.entry, (max(1, -(-pairs // THREADS)), 1, 1), v.block, 0, args)


def plan_raw(counters, words, key) -> plan.LaunchPlan:
    """Philox4x32-10 of ``counters`` (uint32 ``(n, 4)``) under ``key`` into ``words`` (uint32 ``(n, 4)``)."""
    n = counters.shape[0]
    v = DropoutMaskVariant("raw")
    args = (plan.PointerArg.of("counters", counters.reshape(-1)), plan.PointerArg.of("words", words.reshape(-1), writable=True),
            plan.ScalarArg("n", np.int32(n)), plan.ScalarArg("k0", np.uint32(key[0])), plan.ScalarArg("k1", np.uint32(key[1])))
    return plan.LaunchPlan(v, v.entry, (max(1, -(-n // THREADS)), 1, 1), v.block, 0, args)
