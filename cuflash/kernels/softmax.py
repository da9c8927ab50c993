"""The online-softmax kernel (``kernels_cu/softmax.cu``): its variant, planner and runner.

One warp per row (:data:`SOFTMAX_ROWS_PER_BLOCK` rows per block) for rows of at most
:data:`SOFTMAX_WARP_MAX_COLS` elements, one block of :data:`SOFTMAX_BLOCK_THREADS` threads per
row above that; float16, bfloat16 and float32 with float32 arithmetic, on every arch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.runtime import plan, variants

#: rows per block of the warp-per-row softmax
SOFTMAX_ROWS_PER_BLOCK = 4
#: threads per row of the block-per-row softmax
SOFTMAX_BLOCK_THREADS = 256
#: longest row handled by one warp; longer rows get a block
SOFTMAX_WARP_MAX_COLS = 1024


@dataclasses.dataclass(frozen=True)
class SoftmaxVariant(variants.Variant):
    """The online-softmax kernel of ``kernels_cu/softmax.cu``.

    Parameters
    ----------
    dtype : {"f16", "bf16", "f32"}
        Element type of input and output (arithmetic is float32).
    mode : {"warp", "block"}
        ``"warp"``: one warp per row, :data:`SOFTMAX_ROWS_PER_BLOCK` rows per block (short rows);
        ``"block"``: one block of :data:`SOFTMAX_BLOCK_THREADS` threads per row (long rows).
    """

    family: ClassVar[str] = "softmax"
    source: ClassVar[str] = "softmax.cu"

    dtype: str
    mode: str

    def __post_init__(self):
        if self.dtype not in variants.DTYPES:
            raise ValueError(f"SoftmaxVariant: dtype={self.dtype!r} must be one of {sorted(variants.DTYPES)}")
        if self.mode not in ("warp", "block"):
            raise ValueError(f"SoftmaxVariant: mode={self.mode!r} must be 'warp' or 'block'")

    @property
    def block(self) -> tuple[int, int, int]:
        """Thread-block shape of this variant."""
        if self.mode == "warp":
            return (32, SOFTMAX_ROWS_PER_BLOCK, 1)
        return (SOFTMAX_BLOCK_THREADS, 1, 1)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_T", variants.DTYPES[self.dtype][0]),
            ("CUFLASH_SOFTMAX_WARP", "1" if self.mode == "warp" else "0"),
            ("CUFLASH_ROWS_PER_BLOCK", str(SOFTMAX_ROWS_PER_BLOCK)),
            ("CUFLASH_THREADS", str(SOFTMAX_BLOCK_THREADS)),
        )

    @classmethod
    def all(cls) -> tuple["SoftmaxVariant", ...]:
        """Every softmax variant (for compile checks and precompilation)."""
        return tuple(cls(d, m) for d in variants.DTYPES for m in ("warp", "block"))


def _rows_view(x, axis: int, call):
    """``x`` as a 2-D (rows, cols) view with unit column stride, copying only if impossible (the
    copy allocated by ``call``, so a copy that does not fit is refused as the result would be)."""
    xm = call.xp.moveaxis(x, axis, -1)
    n_cols = xm.shape[-1]
    n_rows = int(np.prod(xm.shape[:-1], dtype=np.int64))

    def contiguous(z):
        c = call.empty(z.shape, z.dtype)
        c[...] = z
        return c

    try:
        x2 = xm.reshape(n_rows, n_cols)  # a view when the leading axes collapse; else a copy
    except Exception:  # noqa: BLE001
        x2 = contiguous(xm).reshape(n_rows, n_cols)
    item = x2.dtype.itemsize
    if n_cols > 1 and x2.strides[1] != item or (n_rows > 1 and x2.strides[0] < 0):
        x2 = contiguous(x2)
    return xm.shape, x2


def plan_softmax(x2, y2) -> plan.LaunchPlan:
    """Launch plan for 2-D ``x2`` -> ``y2`` (rows x cols, unit column stride, same dtype)."""
    n_rows, n_cols = x2.shape
    if n_cols > 2**31 - 1:
        raise ValueError(f"cuflash.softmax: rows of {n_cols} elements exceed the kernel's int32 column index")
    key = variants.dtype_key(x2.dtype)
    mode = "warp" if n_cols <= SOFTMAX_WARP_MAX_COLS else "block"
    v = SoftmaxVariant(key, mode)
    if mode == "warp":
        grid = (-(-n_rows // SOFTMAX_ROWS_PER_BLOCK), 1, 1)
    else:
        grid = (n_rows, 1, 1)
    if grid[0] > plan.MAX_GRID_DIMS[0]:
        raise ValueError(f"cuflash.softmax: {n_rows} rows exceed the kernel's grid limit")
    item = x2.dtype.itemsize
    xs = x2.strides[0] // item if n_rows > 1 else n_cols
    ys = y2.strides[0] // item if n_rows > 1 else n_cols
    args = (
        plan.PointerArg("x", x2, 0, (n_rows, n_cols), (xs, 1)),
        plan.PointerArg("y", y2, 0, (n_rows, n_cols), (ys, 1), writable=True),
        plan.ScalarArg("n_rows", np.int64(n_rows)),
        plan.ScalarArg("n_cols", np.int32(n_cols)),
        plan.ScalarArg("x_row_stride", np.int64(xs)),
        plan.ScalarArg("y_row_stride", np.int64(ys)),
    )
    return plan.LaunchPlan(v, v.entry, grid, v.block, 0, args)


def run(x, axis: int, call):
    """Softmax of the device array ``x`` along ``axis`` on ``call``'s device (the result
    allocated by the call: the caller's framework; an empty ``x`` launches nothing)."""
    xp = call.xp
    if x.size == 0:
        return call.empty(x.shape, x.dtype)
    moved_shape, x2 = _rows_view(x, axis, call)
    if axis == x.ndim - 1:
        y = call.empty(x.shape, x.dtype)  # the result itself: framework-allocated, returned as is
        y2 = y.reshape(x2.shape)
    else:
        y2 = call.empty(x2.shape, x.dtype)
        y = None
    call.launch(plan_softmax(x2, y2))
    return y if y is not None else xp.moveaxis(y2.reshape(moved_shape), -1, axis)
