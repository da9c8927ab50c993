"""What kind of array a user passed, described without touching its data.

``describe`` reads only metadata (type, shape, strides, dtype, DLPack device), so validation can
run before any device work and without importing CuPy, torch or JAX. Kinds:

* ``"numpy"``: ``numpy.ndarray`` (the CPU path);
* ``"cupy"``: ``cupy.ndarray`` (recognised by its module name, so CuPy is not imported here);
* ``"dlpack"``: anything else exposing ``__dlpack__`` and ``__dlpack_device__`` (PyTorch, JAX).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from cuflash import _dtypes


class DLDeviceType(enum.IntEnum):
    """DLPack device types (``dlpack.h``, ``DLDeviceType``) that cuflash names in messages."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17


def device_type_name(code: int) -> str:
    """Name of a DLPack device type code, e.g. ``1 -> "kDLCPU"``."""
    try:
        return DLDeviceType(int(code)).name
    except ValueError:
        return f"DLPack device type {code}"


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Metadata of one array argument.

    Attributes
    ----------
    kind : str
        ``"numpy"``, ``"cupy"`` or ``"dlpack"``.
    type_name : str
        Fully qualified Python type, for messages (e.g. ``"torch.Tensor"``).
    shape : tuple of int
    strides : tuple of int or None
        Strides in elements (not bytes); None when a byte stride is not a multiple of the item size.
    byte_strides : tuple of int or None
        Strides in bytes where the array exposes them.
    dtype : numpy.dtype or None
        None when the dtype has no NumPy equivalent cuflash knows (the name is in ``dtype_name``).
    dtype_name : str
    device : tuple of (int, int)
        DLPack ``(device_type, device_id)``; NumPy is ``(kDLCPU, 0)``.
    """

    kind: str
    type_name: str
    shape: tuple
    strides: tuple | None
    byte_strides: tuple | None
    dtype: np.dtype | None
    dtype_name: str
    device: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def on_cuda(self) -> bool:
        return self.device[0] in (DLDeviceType.kDLCUDA, DLDeviceType.kDLCUDAManaged)


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def is_cupy_array(x) -> bool:
    """True for ``cupy.ndarray`` (checked by type name; CuPy is not imported)."""
    t = type(x)
    return t.__module__.startswith("cupy") and t.__name__ == "ndarray"


def array_kind(x) -> str | None:
    """``"numpy"``, ``"cupy"``, ``"dlpack"`` or None for something that is not an array."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_cupy_array(x):
        return "cupy"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    return None


def _elem_strides(byte_strides, itemsize):
    if byte_strides is None or itemsize == 0:
        return None
    if any(s % itemsize for s in byte_strides):
        return None
    return tuple(s // itemsize for s in byte_strides)


def _c_contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def describe(x, name: str, func: str = "cuflash") -> ArrayInfo:
    """Describe ``x`` (an argument called ``name``) from its metadata alone.

    Raises
    ------
    TypeError
        If ``x`` is not an array cuflash accepts.
    """
    kind = array_kind(x)
    if kind is None:
        raise TypeError(
            f"{func}: {name} must be an array (numpy.ndarray, cupy.ndarray, or a GPU tensor supporting "
            f"DLPack such as torch.Tensor or jax.Array); got {_type_name(x)}"
        )
    if kind in ("numpy", "cupy"):
        dtype = np.dtype(x.dtype)
        byte_strides = tuple(int(s) for s in x.strides)
        device = (int(DLDeviceType.kDLCPU), 0) if kind == "numpy" else (int(DLDeviceType.kDLCUDA), int(x.device.id))
        return ArrayInfo(
            kind=kind,
            type_name=_type_name(x),
            shape=tuple(int(n) for n in x.shape),
            strides=_elem_strides(byte_strides, dtype.itemsize),
            byte_strides=byte_strides,
            dtype=_dtypes.supported_or_none(dtype),
            dtype_name=_dtypes.name_of(dtype),
            device=device,
        )
    # Generic DLPack producer (torch, JAX, ...): metadata through its Python attributes.
    device = tuple(int(c) for c in x.__dlpack_device__())
    shape = tuple(int(n) for n in x.shape)
    dtype_name = str(x.dtype).removeprefix("torch.")
    dtype = _dtypes.from_name(dtype_name)
    stride_attr = getattr(x, "stride", None)
    if callable(stride_attr):  # torch.Tensor.stride() gives strides in elements
        strides = tuple(int(s) for s in stride_attr())
    else:  # JAX arrays are always dense row-major
        strides = _c_contiguous_strides(shape)
    byte_strides = None if dtype is None else tuple(s * dtype.itemsize for s in strides)
    return ArrayInfo(
        kind=kind,
        type_name=_type_name(x),
        shape=shape,
        strides=strides,
        byte_strides=byte_strides,
        dtype=dtype,
        dtype_name=dtype_name,
        device=device,
    )
