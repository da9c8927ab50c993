"""The dtypes cuflash computes in, and their accumulation types.

bfloat16 is ``ml_dtypes.bfloat16``, the type NumPy >= 2.1 and CuPy 14 both use for it.

fp8 (OCP "E4M3", ``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities, largest
finite 448) is ``ml_dtypes.float8_e4m3fn`` on NumPy. It is an *input* type only: q, k, v of
:func:`cuflash.attention`'s forward (with descales) and the caches of
:func:`cuflash.attention_with_kvcache`; results are float16/bfloat16. It is not in
:data:`SUPPORTED` (the types every entry point computes in) but in :data:`FP8`, and
:func:`known_or_none` describes it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)

#: dtypes of q, k, v accepted by the NumPy path (the GPU kernels take the first three).
SUPPORTED = (float16, bfloat16, float32, float64)
#: the fp8 input types (see the module docstring)
FP8 = (float8_e4m3fn,)
#: the result types of an fp8 call (``out_dtype``); the first is the default
FP8_OUT = (bfloat16, float16)
#: largest finite e4m3 value: the ``satfinite`` conversions saturate to it
E4M3_MAX = 448.0

_BY_NAME = {dt.name: dt for dt in SUPPORTED}
_KNOWN_BY_NAME = {dt.name: dt for dt in SUPPORTED + FP8}


def name_of(dtype) -> str:
    """Short name of a dtype for messages (``bfloat16``, not ``<V2``)."""
    return np.dtype(dtype).name


def same(a, b) -> bool:
    """True when ``a`` and ``b`` are one dtype that cuflash describes; False when either is None
    (an ``ArrayInfo.dtype`` of an unsupported type). A plain ``a == b`` will not do: NumPy reads
    None as its default float64, so ``np.dtype("float64") == None`` holds."""
    return a is not None and b is not None and np.dtype(a) == np.dtype(b)


def among(dtype, allowed) -> bool:
    """True when ``dtype`` (None: unsupported) is one of ``allowed``, compared as :func:`same`."""
    return any(same(dtype, dt) for dt in allowed)


def supported_or_none(dtype) -> np.dtype | None:
    dtype = np.dtype(dtype)
    return dtype if dtype in SUPPORTED else None


def known_or_none(dtype) -> np.dtype | None:
    """A dtype cuflash describes: :data:`SUPPORTED` or :data:`FP8`; None otherwise."""
    dtype = np.dtype(dtype)
    return dtype if dtype in SUPPORTED or dtype in FP8 else None


def known_from_name(name: str) -> np.dtype | None:
    """:func:`known_or_none` from a name (``"float8_e4m3fn"``, as torch spells it too)."""
    return _KNOWN_BY_NAME.get(str(name))


def is_fp8(dtype) -> bool:
    """True for an fp8 input type (:data:`FP8`)."""
    return dtype is not None and np.dtype(dtype) in FP8


def from_name(name: str) -> np.dtype | None:
    """Supported dtype from a name such as ``"float16"`` or ``"bfloat16"``; None if unsupported."""
    return _BY_NAME.get(str(name))


def accumulator(dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 input, float32 for every other supported dtype."""
    return float64 if np.dtype(dtype) == float64 else float32


def q_dtype_or_float32(q_dtype_name: str) -> str:
    """How an error names the dtypes an operand beside q may have (q's, or float32):
    ``"float32"`` for a float32 q, else ``"q's dtype float16 or float32"``."""
    return "float32" if q_dtype_name == "float32" else f"q's dtype {q_dtype_name} or float32"
