"""The dtypes cuflash computes in, and their accumulation types.

bfloat16 is ``ml_dtypes.bfloat16``, the type NumPy >= 2.1 and CuPy 14 both use for it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

#: dtypes of q, k, v accepted by the NumPy path (the GPU kernels take the first three).
SUPPORTED = (float16, bfloat16, float32, float64)

_BY_NAME = {dt.name: dt for dt in SUPPORTED}


def name_of(dtype) -> str:
    """Short name of a dtype for messages (``bfloat16``, not ``<V2``)."""
    return np.dtype(dtype).name


def supported_or_none(dtype) -> np.dtype | None:
    dtype = np.dtype(dtype)
    return dtype if dtype in SUPPORTED else None


def from_name(name: str) -> np.dtype | None:
    """Supported dtype from a name such as ``"float16"`` or ``"bfloat16"``; None if unsupported."""
    return _BY_NAME.get(str(name))


def accumulator(dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 input, float32 for every other supported dtype."""
    return float64 if np.dtype(dtype) == float64 else float32
