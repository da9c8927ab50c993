"""Kernel variants: the compile-time choices of one kernel, as a frozen, hashable value.

A variant does two jobs with one object (DESIGN.md §4): its :attr:`~Variant.name` encodes every
compile-time axis and is the suffix of the kernel's ``extern "C"`` entry name, and its
:meth:`~Variant.defines` give the ``#define`` prelude that selects those axes in the
``kernels_cu/`` source. Run-time values (lengths, strides, flags) are kernel arguments, never
variant axes. A later kernel adds a subclass here, its ``kernels_cu/`` file and a planner.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

try:  # bfloat16 as NumPy (>= 2.1) and CuPy 14 use it
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _bfloat16 = None

#: dtype key -> (CUDA element type, NumPy dtype)
DTYPES: dict[str, tuple[str, np.dtype]] = {
    "f16": ("__half", np.dtype(np.float16)),
    "f32": ("float", np.dtype(np.float32)),
}
if _bfloat16 is not None:
    DTYPES["bf16"] = ("__nv_bfloat16", np.dtype(_bfloat16))


def dtype_key(dtype) -> str:
    """Return the variant dtype key (``"f16"``, ``"bf16"``, ``"f32"``) of a NumPy/CuPy dtype.

    Raises
    ------
    KeyError
        If no kernel handles ``dtype``.
    """
    dt = np.dtype(dtype)
    for key, (_, npdt) in DTYPES.items():
        if npdt == dt:
            return key
    raise KeyError(str(dt))


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base class of kernel variants.

    Subclasses set :attr:`family` (the kernel family, also the entry name's prefix) and
    :attr:`source` (the ``kernels_cu/`` file), declare their axes as dataclass fields and extend
    :meth:`defines`.
    """

    family: ClassVar[str] = ""
    source: ClassVar[str] = ""

    def axes(self) -> tuple[str, ...]:
        """The axis values in field order, as they appear in :attr:`name`."""
        return tuple(str(getattr(self, f.name)) for f in dataclasses.fields(self))

    @property
    def name(self) -> str:
        """Unique, C-identifier-safe name of this variant, e.g. ``"f16_warp"``."""
        return "_".join(self.axes())

    @property
    def entry(self) -> str:
        """The ``extern "C"`` entry name: ``cuflash_<family>_<name>``."""
        return f"cuflash_{self.family}_{self.name}"

    def defines(self) -> tuple[tuple[str, str], ...]:
        """The ``#define`` prelude as ``(macro, value)`` pairs (the base gives the entry name)."""
        return (("CUFLASH_ENTRY", self.entry), ("CUFLASH_VARIANT", f'"{self.name}"'))


@dataclasses.dataclass(frozen=True)
class SoftmaxVariant(Variant):
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
        if self.dtype not in DTYPES:
            raise ValueError(f"SoftmaxVariant: dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
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
            ("CUFLASH_T", DTYPES[self.dtype][0]),
            ("CUFLASH_SOFTMAX_WARP", "1" if self.mode == "warp" else "0"),
            ("CUFLASH_ROWS_PER_BLOCK", str(SOFTMAX_ROWS_PER_BLOCK)),
            ("CUFLASH_THREADS", str(SOFTMAX_BLOCK_THREADS)),
        )

    @classmethod
    def all(cls) -> tuple["SoftmaxVariant", ...]:
        """Every softmax variant (for compile checks and precompilation)."""
        return tuple(cls(d, m) for d in DTYPES for m in ("warp", "block"))


#: rows per block of the warp-per-row softmax
SOFTMAX_ROWS_PER_BLOCK = 4
#: threads per row of the block-per-row softmax
SOFTMAX_BLOCK_THREADS = 256
#: longest row handled by one warp; longer rows get a block
SOFTMAX_WARP_MAX_COLS = 1024
