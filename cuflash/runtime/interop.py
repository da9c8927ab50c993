"""What kind of array a user passed, described without touching its data.

``describe`` reads only metadata (type, shape, strides, dtype, DLPack device), so validation can
run before any device work and without importing CuPy, torch or JAX. Kinds:

* ``"numpy"``: ``numpy.ndarray`` (the CPU path);
* ``"cupy"``: ``cupy.ndarray`` (recognised by its module name, so CuPy is not imported here);
* ``"dlpack"``: anything else exposing ``__dlpack__`` and ``__dlpack_device__`` (PyTorch, JAX).

Beside the metadata: the frameworks (:func:`framework_of`, :func:`exporter`: how a result goes
back as the caller's kind), the check for a usable GPU (:func:`require_cuda`), and the host side
of a call (:class:`HostImport`: CPU DLPack arrays as zero-copy NumPy views). The device side of
a call is :mod:`cuflash.runtime.device_call`.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from cuflash.runtime import dtypes


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


def type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def is_cupy_array(x) -> bool:
    """True for ``cupy.ndarray`` (checked by type name; CuPy is not imported)."""
    t = type(x)
    return t.__module__.startswith("cupy") and t.__name__ == "ndarray"


def array_kind(x) -> str | None:
    """``"numpy"``, ``"cupy"``, ``"dlpack"`` or None for something that is not an array (a
    :class:`Float8Array` is ``"cupy"``: the CuPy bytes it reads as fp8)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_cupy_array(x) or isinstance(x, Float8Array):
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


def _dlpack_device(x, name: str, func: str):
    """``x.__dlpack_device__()``, after refusing by name a tensor on torch's meta device (a shape
    without data, which DLPack has no device code for).

    Raises
    ------
    ValueError
        Naming the argument and its device.
    """
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "meta":
        raise ValueError(f"{func}: {name} is a {type_name(x)} on device {device} (a shape without data), which "
                         f"cuflash cannot compute on; expected an array on the CPU or a CUDA device")
    return x.__dlpack_device__()


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
            f"DLPack such as torch.Tensor or jax.Array); got {type_name(x)}"
        )
    if kind == "numpy" and isinstance(x, (np.matrix, np.ma.MaskedArray)):
        why = ("its operators and indexing follow matrix rules and it is always 2-D" if isinstance(x, np.matrix)
               else "its mask would be ignored (use causal= or window_size= to mask attention)")
        raise TypeError(f"{func}: {name} is a {type_name(x)}, which is not accepted: {why}; pass numpy.asarray({name})")
    if kind in ("numpy", "cupy"):
        dtype = np.dtype(x.dtype)
        if not dtype.isnative:
            raise TypeError(
                f"{func}: {name}.dtype={dtype.str!r} has non-native byte order; cuflash computes in the "
                f"machine's byte order: pass {name}.astype({name}.dtype.newbyteorder('='))"
            )
        byte_strides = tuple(int(s) for s in x.strides)
        device = (int(DLDeviceType.kDLCPU), 0) if kind == "numpy" else (int(DLDeviceType.kDLCUDA), int(x.device.id))
        return ArrayInfo(
            kind=kind,
            type_name=type_name(x),
            shape=tuple(int(n) for n in x.shape),
            strides=_elem_strides(byte_strides, dtype.itemsize),
            byte_strides=byte_strides,
            dtype=dtypes.known_or_none(dtype),
            dtype_name=dtypes.name_of(dtype),
            device=device,
        )
    # Generic DLPack producer (torch, JAX, ...): metadata through its Python attributes.
    device = tuple(int(c) for c in _dlpack_device(x, name, func))
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{func}: {name} is a {type_name(x)} with __dlpack__ but no .shape/.dtype to validate it "
            f"by; pass it through cupy.from_dlpack({name}) (CUDA) or numpy.from_dlpack({name}) (CPU)"
        )
    shape = tuple(int(n) for n in x.shape)
    dtype_name = str(x.dtype).removeprefix("torch.")
    dtype = dtypes.known_from_name(dtype_name)
    stride_attr = getattr(x, "stride", None)
    if callable(stride_attr):  # torch.Tensor.stride() gives strides in elements
        strides = tuple(int(s) for s in stride_attr())
    else:  # JAX arrays are always dense row-major
        strides = _c_contiguous_strides(shape)
    byte_strides = None if dtype is None else tuple(s * dtype.itemsize for s in strides)
    return ArrayInfo(
        kind=kind,
        type_name=type_name(x),
        shape=shape,
        strides=strides,
        byte_strides=byte_strides,
        dtype=dtype,
        dtype_name=dtype_name,
        device=device,
    )


# --------------------------------------------------------------------------------------------
# fp8 bytes: the view a framework without an fp8 dtype (CuPy) passes (docs/api.md, "fp8 (float8_e4m3fn)")


class Float8Array:
    """A CuPy ``uint8`` array whose bytes cuflash reads as ``float8_e4m3fn`` (what
    :func:`fp8_view` returns for CuPy, which has no fp8 dtype).

    It carries the metadata validation reads (``shape``, ``strides`` in bytes, which are element
    strides too, ``dtype``: ``ml_dtypes.float8_e4m3fn``, ``device``) and hands the bytes to a
    device through ``__dlpack__`` / ``__cuda_array_interface__`` (as the uint8 array). The bytes
    are not copied: writes through either name are seen by the other.

    Attributes
    ----------
    data : cupy.ndarray
        The ``uint8`` array.
    """

    def __init__(self, data):
        self.data = data
        self.shape = tuple(int(n) for n in data.shape)
        self.strides = tuple(int(s) for s in data.strides)
        self.dtype = dtypes.float8_e4m3fn
        self.device = data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        import math

        return math.prod(self.shape)

    @property
    def __cuda_array_interface__(self):
        return self.data.__cuda_array_interface__

    def __dlpack__(self, *args, **kwargs):
        return self.data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()

    def __repr__(self) -> str:
        return f"cuflash.fp8_view(<cupy uint8 array of shape {self.shape}>)"


def fp8_view(x):
    """``x``'s bytes as ``float8_e4m3fn`` (OCP E4M3) input for cuflash, without a copy.

    Parameters
    ----------
    x : numpy.ndarray, cupy.ndarray or torch.Tensor of dtype uint8 (or already fp8)
        The raw e4m3 bytes, one element per byte (as a quantizer or a serving engine's fp8 KV
        cache stores them).

    Returns
    -------
    array
        NumPy: ``x.view(ml_dtypes.float8_e4m3fn)`` (an ordinary NumPy array). torch:
        ``x.view(torch.float8_e4m3fn)``. CuPy, which has no fp8 dtype: a :class:`Float8Array`
        that every cuflash function taking fp8 accepts where it accepts a CuPy array. An fp8
        array is returned as it is.

    Raises
    ------
    TypeError
        For another dtype or something that is not an array.
    """
    kind = array_kind(x)
    if isinstance(x, Float8Array) or (kind in ("numpy", "cupy", "dlpack") and _dtype_name(x) == "float8_e4m3fn"):
        return x
    if kind is None or _dtype_name(x) != "uint8":
        what = type_name(x) if kind is None else f"{type_name(x)} of dtype {_dtype_name(x)}"
        raise TypeError(f"cuflash.fp8_view: x must be a uint8 array (numpy, cupy or torch) holding float8_e4m3fn "
                        f"bytes, got {what}")
    if kind == "numpy":
        return x.view(dtypes.float8_e4m3fn)
    if kind == "cupy":
        return Float8Array(x)
    if framework_of(x) == "torch":
        import torch

        return x.view(torch.float8_e4m3fn)
    raise TypeError(f"cuflash.fp8_view: x is a {type_name(x)}; for a DLPack producer other than torch pass "
                    f"numpy.from_dlpack(x) (CPU) or cupy.from_dlpack(x) (GPU) of its uint8 bytes")


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", "")).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# The CUDA side: frameworks, devices, streams, zero-copy import and export (docs/conventions.md and docs/gpu.md)

#: frameworks whose CUDA arrays cuflash hands back as the same framework's arrays
FRAMEWORKS = ("numpy", "cupy", "torch", "jax", "dlpack")


def framework_of(x) -> str:
    """The framework an array comes from: ``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"``, or
    ``"dlpack"`` for any other DLPack producer. Reads the type's module name only (nothing is
    imported)."""
    kind = array_kind(x)
    if kind in ("numpy", "cupy"):
        return kind
    top = type(x).__module__.split(".")[0]
    if top == "torch":
        return "torch"
    if top in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def require_cuda(func: str):
    """Import CuPy and check that a CUDA device is usable; return the ``cupy`` module.

    Raises
    ------
    RuntimeError
        If CuPy is not installed, or no CUDA device (or driver) is usable. The message names the
        function and the reason, so a machine without a GPU fails clearly instead of with a
        CUDA error deep inside a launch.
    """
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"{func}: GPU arrays need CuPy, which is not installed ({exc}); install cuflash with "
            f"the 'cuda12' or 'cuda13' extra: pip install 'cuflash[cuda12]' (from a source checkout: "
            f"pip install '.[cuda12]'); [cuda13] for CUDA 13"
        ) from None
    except Exception as exc:  # noqa: BLE001 - CuPy installed but broken (missing libraries, ...)
        raise RuntimeError(f"{func}: CuPy failed to import ({type(exc).__name__}: {exc})") from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, missing driver library, ...
        raise RuntimeError(f"{func}: {_no_device_reason(cupy, exc)}") from None
    if count < 1:
        raise RuntimeError(f"{func}: no NVIDIA GPU found (the driver reports 0 CUDA devices)")
    return cupy


def device_name(device_id: int = 0) -> str:
    """The CUDA device's name as the driver reports it (e.g. ``"NVIDIA H200"``); needs CuPy and a
    device (:func:`require_cuda` first)."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(int(device_id))["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _no_device_reason(cupy, exc) -> str:
    """Why ``getDeviceCount`` failed, in words: no driver at all (``cudaDriverGetVersion`` gives 0,
    CUDA Runtime API), a driver older than CuPy's runtime, or the CUDA error itself."""
    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # noqa: BLE001
        driver = None
    try:
        runtime = int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001
        runtime = None

    def ver(v):
        return f"{v // 1000}.{v % 1000 // 10}"

    tail = "the CUDA kernels cannot run here (NumPy arrays run on the CPU path)"
    if driver == 0:
        return f"no NVIDIA driver or GPU found; {tail}"
    if driver and runtime and driver < runtime:
        return (f"the NVIDIA driver supports CUDA {ver(driver)} but CuPy was built for CUDA {ver(runtime)}: "
                f"update the driver or install the matching CuPy (cuflash[cuda12] / cuflash[cuda13]); {tail}")
    return f"no usable CUDA device ({type(exc).__name__}: {exc}); {tail}"


def exporter(x, func: str):
    """The function that hands a result back as ``x``'s framework's array (zero-copy where the
    framework can): from a CuPy array on a GPU, from a NumPy array on the simulator (whose device
    memory is host memory; bfloat16 through an int16 view for torch, as NumPy's DLPack has none).

    Resolved before any device work, so an unknown producer is refused early.

    Raises
    ------
    TypeError
        A producer whose framework has no ``from_dlpack``.
    """
    fw = framework_of(x)
    if fw in ("numpy", "cupy"):
        return lambda a: a
    if fw == "torch":
        import torch

        return lambda a: numpy_to_torch(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    if fw == "jax":
        import jax.numpy as jnp

        return lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else jnp.from_dlpack(a)
    namespace = getattr(x, "__array_namespace__", None)
    fn = getattr(namespace(), "from_dlpack", None) if callable(namespace) else None
    if fn is None:
        import importlib

        top = importlib.import_module(type(x).__module__.split(".")[0])
        fn = getattr(top, "from_dlpack", None)
        if fn is None:
            raise TypeError(
                f"{func}: cannot hand a result back as {type_name(x)}: its framework has no from_dlpack "
                f"(neither x.__array_namespace__().from_dlpack nor {top.__name__}.from_dlpack); pass CuPy "
                f"arrays (cupy.from_dlpack(x)) instead"
            )
    return lambda a: a if isinstance(a, np.ndarray) else fn(a)


# --------------------------------------------------------------------------------------------
# The host side: CPU DLPack arrays (torch and JAX CPU tensors, any producer) on the NumPy path


def torch_to_numpy(t):
    """A zero-copy NumPy view of a CPU ``torch.Tensor`` (detached; bfloat16 through an int16
    view and float8_e4m3fn through a uint8 view, since NumPy's DLPack import has neither: torch
    exports fp8 through DLPack, and ``numpy.from_dlpack`` refuses it as "Unsupported dtype")."""
    import ml_dtypes
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def numpy_to_torch(a: np.ndarray):
    """A CPU ``torch.Tensor`` sharing ``a``'s memory (bfloat16 through an int16 view,
    float8_e4m3fn through a uint8 view)."""
    import ml_dtypes
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


_ACCEPTED = ("numpy.ndarray, cupy.ndarray, or a DLPack array (torch.Tensor, jax.Array, ...) on the "
             "CPU or a CUDA device, of float16, bfloat16, float32 or float64")


def is_host_dlpack(x) -> bool:
    """True for a DLPack producer (not NumPy, not CuPy) whose ``__dlpack_device__`` is the CPU."""
    if array_kind(x) != "dlpack":
        return False
    try:
        return int(x.__dlpack_device__()[0]) == DLDeviceType.kDLCPU
    except Exception:  # noqa: BLE001 - a broken producer is refused later, by describe
        return False


def host_to_numpy(x, name: str, func: str) -> np.ndarray:
    """A zero-copy NumPy view of the CPU DLPack array ``x`` (``numpy.from_dlpack``; torch
    tensors are detached first and bfloat16 goes through an int16 view; JAX's bfloat16 through
    ``numpy.asarray``).

    Raises
    ------
    TypeError
        If NumPy cannot import ``x``: the message names what was passed and what is accepted.
    """
    fw = framework_of(x)
    if fw == "torch":
        return torch_to_numpy(x)
    try:
        return np.from_dlpack(x)
    except Exception as exc:  # noqa: BLE001 - whatever the producer raises, the message says what it was
        if fw == "jax":  # bfloat16: NumPy's DLPack import has no such dtype; JAX hands ml_dtypes out
            return np.asarray(x)
        raise TypeError(
            f"{func}: {name} is a {type_name(x)} on the CPU that NumPy cannot import through "
            f"numpy.from_dlpack ({type(exc).__name__}: {exc}); accepted: {_ACCEPTED}"
        ) from None


class HostImport:
    """The CPU DLPack arguments of one call viewed as NumPy, and the way back (docs/conventions.md).

    ``HostImport(func, names, operands, options)``: :attr:`operands` (a tuple, ``names`` naming
    each) and :attr:`options` (an :class:`~cuflash.runtime.options.Options`) with every CPU DLPack
    array (a torch or JAX CPU tensor, any producer) replaced by a zero-copy NumPy view; None stays
    None. The operands and the array options of q's kind (the score modifiers, a cache's new keys)
    must all be of one kind; index arrays (``cu_seqlens_*``, ``cache_seqlens``, ...) may be NumPy
    beside tensors. :meth:`export` hands NumPy results back as the callers' kind.

    Raises
    ------
    TypeError
        Mixed kinds, or a CPU producer NumPy cannot import (see :func:`host_to_numpy`).
    """

    def __init__(self, func: str, names: tuple, operands: tuple, options):
        from cuflash.runtime.options import INDEX

        self.func = func
        self.originals = operands
        self.framework = None  # the CPU DLPack framework, None when nothing was imported
        same = [(n, x) for n, x in zip(names, operands) if x is not None]
        same += [(n, x) for n, x, role in options.arrays() if role != INDEX]
        self.operands, self.options = operands, options
        if not any(is_host_dlpack(x) for _, x in same) and not any(is_host_dlpack(x) for _, x, _ in options.arrays()):
            return
        first, x0 = same[0]
        fw0, host0 = framework_of(x0), is_host_dlpack(x0)
        for name, x in same:   # in argument order, so an error names the first bad one
            if framework_of(x) != fw0 or is_host_dlpack(x) != host0:
                raise TypeError(f"{func}: {name} is a {type_name(x)} but {first} is a {type_name(x0)}; all arrays "
                                f"must be of one kind (no implicit conversions)")
        self.framework = fw0 if host0 else None

        def view(x, name, role=None):
            return host_to_numpy(x, name, func) if x is not None and is_host_dlpack(x) else x

        self.operands = tuple(view(x, n) for n, x in zip(names, operands))
        self.options = options.map_arrays(view)

    def export(self, result: tuple, out_index: int | None = None) -> tuple:
        """NumPy results as the callers' kind: a ``torch.Tensor`` (sharing memory), a ``jax.Array``
        (``jax.numpy.asarray``), or NumPy for any other producer; ``result[0]`` is the caller's
        ``out=`` operand itself when ``out_index`` names one that was given."""
        if self.framework is None:
            return result
        like = next(x for x in self.originals if x is not None)
        back = exporter(like, self.func) if self.framework in ("torch", "jax") else (lambda a: a)
        given = None if out_index is None else self.originals[out_index]
        return tuple(given if (i == 0 and given is not None) else
                     (None if a is None else {n: back(g) for n, g in a.items()} if isinstance(a, dict) else back(a))
                     for i, a in enumerate(result))
