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
import functools

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
    if kind == "numpy" and isinstance(x, (np.matrix, np.ma.MaskedArray)):
        why = ("its operators and indexing follow matrix rules and it is always 2-D" if isinstance(x, np.matrix)
               else "its mask would be ignored (use causal= or window_size= to mask attention)")
        raise TypeError(f"{func}: {name} is a {_type_name(x)}, which is not accepted: {why}; pass numpy.asarray({name})")
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
            type_name=_type_name(x),
            shape=tuple(int(n) for n in x.shape),
            strides=_elem_strides(byte_strides, dtype.itemsize),
            byte_strides=byte_strides,
            dtype=dtypes.supported_or_none(dtype),
            dtype_name=dtypes.name_of(dtype),
            device=device,
        )
    # Generic DLPack producer (torch, JAX, ...): metadata through its Python attributes.
    device = tuple(int(c) for c in x.__dlpack_device__())
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{func}: {name} is a {_type_name(x)} with __dlpack__ but no .shape/.dtype to validate it "
            f"by; pass it through cupy.from_dlpack({name}) (CUDA) or numpy.from_dlpack({name}) (CPU)"
        )
    shape = tuple(int(n) for n in x.shape)
    dtype_name = str(x.dtype).removeprefix("torch.")
    dtype = dtypes.from_name(dtype_name)
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


# --------------------------------------------------------------------------------------------
# The CUDA side: frameworks, devices, streams, zero-copy import and export (DESIGN.md §3, §7)

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
            f"the 'cuda12' or 'cuda13' extra (e.g. pip install 'cuflash[cuda12]')"
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


def _exporter(x, func: str):
    """The function that turns a CuPy result back into ``x``'s framework (zero-copy).

    Resolved before any device work, so an unknown producer is refused early.
    """
    fw = framework_of(x)
    if fw == "cupy":
        return lambda a: a
    if fw == "torch":
        import torch

        return torch.from_dlpack
    if fw == "jax":
        import jax.numpy as jnp

        return jnp.from_dlpack
    namespace = getattr(x, "__array_namespace__", None)
    if callable(namespace):
        fn = getattr(namespace(), "from_dlpack", None)
        if fn is not None:
            return fn
    import importlib

    top = importlib.import_module(type(x).__module__.split(".")[0])
    fn = getattr(top, "from_dlpack", None)
    if fn is None:
        raise TypeError(
            f"{func}: cannot hand a result back as {_type_name(x)}: its framework has no from_dlpack "
            f"(neither x.__array_namespace__().from_dlpack nor {top.__name__}.from_dlpack); pass CuPy "
            f"arrays (cupy.from_dlpack(x)) instead"
        )
    return fn


def span_bytes(a) -> int:
    """Bytes from element 0 of a strided (non-negative strides) array to one past its last element."""
    if a.size == 0:
        return 0
    item = a.dtype.itemsize
    return item * (1 + sum((int(n) - 1) * (int(s) // item) for n, s in zip(a.shape, a.strides)))


def cover_span(a):
    """``a`` itself if its memory object covers its view, else the same view over an
    ``UnownedMemory`` that does (zero-copy; it keeps ``a`` alive).

    CuPy arrays made by ``cupy.from_dlpack`` carry a memory object sized from the tensor's shape,
    not from the allocation; a strided view (a K/V slice of a longer cache) then appears to reach
    past its own memory, and the planner's bounds check would refuse it.
    """
    if a.size == 0:
        return a
    import cupy

    mem = a.data.mem
    need = span_bytes(a)
    start = int(a.data.ptr) - int(mem.ptr)
    if 0 <= start and start + need <= int(mem.size):
        return a
    owned = cupy.cuda.UnownedMemory(int(a.data.ptr), need, a, int(a.device.id))
    return cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(owned, 0), strides=a.strides)


def check_no_overlap(func: str, out, inputs: dict, out_name: str = "out") -> None:
    """Refuse an ``out`` (named ``out_name``) whose device memory span meets an input's span
    (conservative).

    Raises
    ------
    ValueError
        Naming the input that ``out`` overlaps.
    """
    if out.size == 0:
        return
    lo = int(out.data.ptr)
    hi = lo + span_bytes(out)
    for name, x in inputs.items():
        if x.size == 0:
            continue
        xlo = int(x.data.ptr)
        if xlo < hi and lo < xlo + span_bytes(x):
            raise ValueError(f"{func}: {out_name} overlaps {name} in device memory; pass a separate "
                             f"{'output buffer' if out_name == 'out' else 'array'}")


class _FrameworkNamespace:
    """CuPy, except that ``empty``/``zeros`` allocate through the caller's framework.

    Kernel tiers allocate their outputs with ``xp.empty``; for torch input this makes those
    outputs torch tensors (the caching allocator and ``torch.cuda.memory_allocated`` see them),
    viewed zero-copy as CuPy arrays for the launch.
    """

    def __init__(self, call: "CudaCall"):
        self._call = call

    def empty(self, shape, dtype=np.float32, order="C"):
        return self._call.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32, order="C"):
        a = self._call.empty(shape, dtype)
        a.fill(0)
        return a

    def __getattr__(self, name):
        import cupy

        return getattr(cupy, name)


def _torch_dtype(dtype):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}[np.dtype(dtype).name]


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """The SM count of CUDA device ``device_id`` (one attribute query, then cached: split-KV plans
    ask for it on every call)."""
    import cupy

    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id))


class CudaCall:
    """Device, stream, imports and outputs of one call on CUDA arrays.

    Entering it (``with CudaCall(func, first_input) as call:``) makes the arrays' device current
    and makes the *consumer stream* current:

    * CuPy input: CuPy's current stream on that device (the caller's choice, ``with stream:``);
    * torch input: torch's current stream of that device, wrapped with
      ``cupy.cuda.Stream.from_external`` (the CUDA stream protocol, ``__cuda_stream__``), so the
      kernels are ordered after the torch work that produced q, k, v and before whatever torch
      runs next on that stream, with no host synchronization;
    * JAX or another DLPack producer: CuPy's current stream; each input is imported with
      ``cupy.from_dlpack``, which passes that stream to ``x.__dlpack__(stream=...)`` so the
      producer makes it wait for the array to be ready (JAX does). The result is handed back
      through the producer's ``from_dlpack``, which passes the producer's own stream to
      ``cupy.ndarray.__dlpack__(stream=...)``, making it wait for the kernel.

    Outputs are allocated by the caller's framework: ``torch.empty`` (same device, current
    stream) for torch, CuPy's memory pool otherwise (JAX has no API to allocate a writable
    buffer, so its results live in CuPy memory, owned by the returned ``jax.Array``).
    """

    def __init__(self, func: str, like, *, out=None):
        self.func = func
        self.framework = framework_of(like)
        if self.framework == "numpy":
            raise ValueError(f"{func}: NumPy arrays run on the host; the CUDA path takes device arrays")
        if out is not None and framework_of(out) == "jax":
            raise ValueError(
                f"{func}: out is a {_type_name(out)}; JAX arrays are immutable, so out= cannot be one. "
                f"Leave out=None and use the returned array"
            )
        info = describe(like, "q", func)
        self.device_id = int(info.device[1])
        self._like = like
        self._export = _exporter(like, func)
        self._torch_owned: list = []  # (cupy view, torch tensor) of framework-allocated outputs
        self._cupy = None
        self._device = None
        self.stream = None
        self.arch = None

    # context management ------------------------------------------------------------------
    def __enter__(self) -> "CudaCall":
        cupy = require_cuda(self.func)
        count = int(cupy.cuda.runtime.getDeviceCount())
        if not 0 <= self.device_id < count:
            raise ValueError(f"{self.func}: arrays are on CUDA device {self.device_id}, but CuPy sees {count} device(s)")
        self._cupy = cupy
        self._device = cupy.cuda.Device(self.device_id)
        self._device.__enter__()
        try:
            self.stream = self._consumer_stream()
            self.stream.__enter__()
        except BaseException:
            self._device.__exit__(None, None, None)
            raise
        self.arch = int(self._device.compute_capability)
        return self

    def __exit__(self, *exc):
        try:
            self.stream.__exit__(*exc)
        finally:
            self._device.__exit__(*exc)
        return False

    def _consumer_stream(self):
        cupy = self._cupy
        if self.framework == "torch":
            import torch

            return cupy.cuda.Stream.from_external(torch.cuda.current_stream(self.device_id))
        return cupy.cuda.get_current_stream()

    # arrays ------------------------------------------------------------------------------
    @property
    def xp(self):
        """The array namespace handed to a kernel tier: CuPy, with framework allocation."""
        return self._cupy if self.framework in ("cupy", "jax", "dlpack") else _FrameworkNamespace(self)

    def import_array(self, x):
        """A CuPy view of ``x`` (zero-copy), its memory object covering the view."""
        if framework_of(x) == "cupy":
            return cover_span(x)
        a = cover_span(self._cupy.from_dlpack(x))  # passes the consumer stream to x.__dlpack__
        if framework_of(x) == "torch":
            self._torch_owned.append((a, x))
        return a

    def empty(self, shape, dtype):
        """A fresh output of the caller's framework, as a CuPy view."""
        if self.framework == "torch":
            import torch

            t = torch.empty(tuple(int(n) for n in shape), dtype=_torch_dtype(dtype), device=f"cuda:{self.device_id}")
            a = cover_span(self._cupy.from_dlpack(t))
            self._torch_owned.append((a, t))
            return a
        return self._cupy.empty(shape, dtype=dtype)

    def export(self, a, *, out=None):
        """``a`` (a CuPy array) as the caller's framework array; ``out`` itself when given."""
        if out is not None:
            return out
        for view, tensor in self._torch_owned:
            if view is a:
                return tensor
        return self._export(a)


# --------------------------------------------------------------------------------------------
# The host side: CPU DLPack arrays (torch and JAX CPU tensors, any producer) on the NumPy path


def torch_to_numpy(t):
    """A zero-copy NumPy view of a CPU ``torch.Tensor`` (detached; bfloat16 through an int16
    view, since NumPy's DLPack import has no bfloat16)."""
    import ml_dtypes
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray):
    """A CPU ``torch.Tensor`` sharing ``a``'s memory (bfloat16 through an int16 view)."""
    import ml_dtypes
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
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
            f"{func}: {name} is a {_type_name(x)} on the CPU that NumPy cannot import through "
            f"numpy.from_dlpack ({type(exc).__name__}: {exc}); accepted: {_ACCEPTED}"
        ) from None


class HostImport:
    """CPU DLPack arguments of one call, viewed as NumPy, and the way back (DESIGN.md §3).

    ``HostImport(func, q=q, k=k, v=v, out=out).arrays`` holds each argument, the CPU DLPack
    ones replaced by zero-copy NumPy views (None stays None). :meth:`export` hands a NumPy
    result back as the callers' kind: a ``torch.Tensor`` (sharing memory), a ``jax.Array``
    (``jax.numpy.asarray``), or NumPy for any other producer. Arguments of several kinds (a
    torch CPU tensor and a NumPy array, torch and JAX) are refused.

    Raises
    ------
    TypeError
        Mixed kinds, or a CPU producer NumPy cannot import (see :func:`host_to_numpy`).
    """

    def __init__(self, func: str, **arrays):
        self.func = func
        self.originals = arrays
        self.framework = None  # the CPU DLPack framework, None when nothing was imported
        host = {name for name, x in arrays.items() if x is not None and is_host_dlpack(x)}
        self.arrays = dict(arrays)
        if not host:
            return
        first = next(name for name in arrays if arrays[name] is not None)
        kinds = {name: (framework_of(x), _type_name(x)) for name, x in arrays.items() if x is not None}
        for name, (fw, type_name) in kinds.items():
            if fw != kinds[first][0] or (name in host) != (first in host):
                raise TypeError(
                    f"{func}: {name} is a {type_name} but {first} is a {kinds[first][1]}; all arrays must "
                    f"be of one kind (no implicit conversions)"
                )
        self.framework = kinds[first][0]
        for name in arrays:  # in argument order, so an error names the first bad one
            if name in host:
                self.arrays[name] = host_to_numpy(arrays[name], name, func)

    def export(self, a, name: str | None = None):
        """``a`` (a NumPy result) as the callers' kind; with ``name`` of an argument that was
        written in place (``out=``), that argument itself."""
        if self.framework is None or a is None:
            return a
        if name is not None and self.originals.get(name) is not None:
            return self.originals[name]
        if self.framework == "torch":
            return numpy_to_torch(a)
        if self.framework == "jax":
            import jax.numpy as jnp

            return jnp.asarray(a)
        return a

    def export_all(self, result):
        """:meth:`export` of a result or of each item of a tuple of results."""
        if isinstance(result, tuple):
            return tuple(self.export(a) for a in result)
        return self.export(result)
