"""The device side of one call: :class:`DeviceCall`, and the CUDA device it usually runs on.

A call on a device (a GPU through CuPy, or the CPU simulator standing in for one) goes through
the same steps whatever the device, and this module holds them once:

* the arrays' device and the *consumer stream* are made current for the call;
* every array the kernels touch is *imported* as a device array, zero-copy (a NumPy index array
  with device q is the one exception: a few bytes copied to the device);
* outputs are allocated by the caller's framework (``torch.empty`` for torch, CuPy's pool or the
  simulated device's memory otherwise) unless ``out=`` is given, which must not overlap the inputs;
* launches go to the device's runner, and results go back as the caller's framework's arrays.

A *device* object supplies what differs: :class:`CudaDevice` here (CuPy, CUDA streams, the CUDA
runner) and :class:`cuflash.sim.device.SimDevice` (the simulator: arrays of its own memory type,
no streams, launches run on the CPU). ``backend="sim"`` therefore runs exactly the host code a GPU
call runs, and CI executes it.

Imports: :mod:`cuflash.runtime` only.
"""

from __future__ import annotations

import functools

import numpy as np

from cuflash.runtime import cuda_runner, interop, plan
from cuflash.runtime.interop import framework_of, require_cuda, type_name

__all__ = ["DeviceCall", "CudaDevice", "check_no_overlap", "span_bytes"]


def span_bytes(a) -> int:
    """Bytes from element 0 of a strided (non-negative strides) array to one past its last element."""
    if a.size == 0:
        return 0
    item = a.dtype.itemsize
    return item * (1 + sum((int(n) - 1) * (int(s) // item) for n, s in zip(a.shape, a.strides)))


def check_no_overlap(func: str, out, inputs: dict, out_name: str = "out") -> None:
    """Refuse an ``out`` (named ``out_name``) whose memory span meets an input's span
    (conservative: spans, not elements). Arrays are device arrays of one device (NumPy-backed on
    the simulator, CuPy on a GPU); None inputs are skipped.

    Raises
    ------
    ValueError
        Naming the input that ``out`` overlaps.
    """
    if out.size == 0:
        return
    lo = plan.array_address(out)
    hi = lo + span_bytes(out)
    for name, x in inputs.items():
        if x is None or x.size == 0:
            continue
        xlo = plan.array_address(x)
        if xlo < hi and lo < xlo + span_bytes(x):
            raise ValueError(f"{func}: {out_name} overlaps {name} in device memory; pass a separate "
                             f"{'output buffer' if out_name == 'out' else 'array'}")


_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "bool")


class _CallNamespace:
    """The device's array module, except that ``empty``/``zeros`` allocate through the call (the
    caller's framework: torch's caching allocator sees a torch caller's workspaces)."""

    def __init__(self, call: "DeviceCall"):
        self._call = call

    def empty(self, shape, dtype=np.float32):
        return self._call.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        a = self._call.empty(shape, dtype)
        a.fill(0)
        return a

    def __getattr__(self, name):
        return getattr(self._call.device.xp, name)


class DeviceCall:
    """Device, stream, imports, outputs and launches of one call (see the module docstring).

    Parameters
    ----------
    func : str
        The public function, for messages.
    device : CudaDevice or cuflash.sim.device.SimDevice
        Where the call runs.
    like : array
        The array whose framework the results take (q, or softmax's x): a CuPy array, a DLPack
        tensor (torch, JAX, ...) on a GPU; a NumPy array or a CPU torch/JAX tensor on the simulator.
    out : array, optional
        The caller's output buffer (returned as it is by :meth:`export`).

    Raises
    ------
    ValueError
        A JAX ``out`` (JAX arrays are immutable).
    TypeError
        A producer whose framework has no ``from_dlpack`` to hand results back with.
    """

    def __init__(self, func: str, device, like, *, out=None):
        self.func = func
        self.device = device
        self.framework = framework_of(like)
        if out is not None and framework_of(out) == "jax":
            raise ValueError(f"{func}: out is a {type_name(out)}; JAX arrays are immutable, so out= cannot be one. "
                             f"Leave out=None and use the returned array")
        self._export = interop.exporter(like, func)
        self._owned: list = []   # (device view, framework tensor) of framework-allocated arrays
        self._scope = None

    def __enter__(self) -> "DeviceCall":
        self._scope = self.device.activate(self.framework)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        return self._scope.__exit__(*exc)

    # what the kernel hosts ask for ------------------------------------------------------------
    @property
    def arch(self) -> int:
        return self.device.arch

    @property
    def sm_count(self) -> int:
        return self.device.sm_count

    @property
    def poisoned(self) -> bool:
        """True where fresh memory is NaN-filled (the simulator), so unwritten elements show."""
        return self.device.poisoned

    @property
    def xp(self):
        """The array module for the kernel hosts: the device's, with allocation by the call."""
        return _CallNamespace(self)

    @property
    def empty_index(self):
        """An empty int32 device array: the index argument of a launch that reads none."""
        return self.device.empty_index

    @property
    def unit_scale(self):
        """A one-element float32 device array holding 1.0 (read with strides 0, never written): the
        scale argument of a launch whose scale the caller left out (an fp8 call's absent descale)."""
        return self.device.unit_scale

    def launch(self, launch_plan) -> None:
        self.device.launch(launch_plan)

    def pointer(self, name: str, a, *, writable: bool = False) -> plan.PointerArg:
        """A pointer argument to element 0 of the device array ``a`` whose base is the allocation
        behind the view, so the region is checked against the real memory."""
        return self.device.pointer(name, a, writable)

    def as_strided(self, a, shape, strides):
        """A view of ``a`` (no copy) with ``shape`` and byte ``strides`` (stride 0 broadcasts)."""
        return self.device.as_strided(a, shape, strides)

    # arrays -----------------------------------------------------------------------------------
    def import_array(self, x):
        """The device array of argument ``x`` (None stays None): a zero-copy view of a framework
        array; a NumPy array is host memory, which the device copies in (a GPU: a few bytes of
        indices) or, on the simulator, views."""
        if x is None:
            return None
        if isinstance(x, np.ndarray) and not self.device.is_device_array(x):
            return self.device.from_host(x)
        a = self.device.from_framework(x)
        if self.framework == "torch":
            self._owned.append((a, x))
        return a

    def empty(self, shape, dtype):
        """A fresh array of the caller's framework, as a device array."""
        shape = tuple(int(n) for n in shape)
        if self.framework == "torch" and np.dtype(dtype).name in _TORCH_DTYPES:
            import torch

            t = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device.torch_device)
            a = self.device.from_framework(t)
            self._owned.append((a, t))
            return a
        try:
            return self.device.empty(shape, dtype)
        except MemoryError as e:   # NumPy's or CuPy's own, which names neither the call nor the backend
            n = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
            raise MemoryError(f"{self.func}: a result of shape {shape} and dtype {np.dtype(dtype).name} ({n} bytes) "
                              f"does not fit in the memory of backend {self.device.backend!r} ({e}); use smaller "
                              f"inputs") from None

    def output(self, out, shape, dtype, reads: dict):
        """The output buffer: ``out`` imported (refused if it overlaps an array of ``reads``, the
        device arrays the kernels read) or a fresh array."""
        if out is None:
            return self.empty(shape, dtype)
        oc = self.import_array(out)
        check_no_overlap(self.func, oc, reads)
        return oc

    def export(self, a, *, out=None):
        """The device array ``a`` as the caller's framework array; ``out`` itself when given."""
        if out is not None:
            return out
        for view, tensor in self._owned:
            if view is a:
                return tensor
        return self._export(self.device.to_host_kind(a))


class CudaDevice:
    """A CUDA device through CuPy: what a GPU call needs beyond :class:`DeviceCall`.

    Parameters
    ----------
    func : str
        The public function, for messages.
    device_id : int
        The CUDA ordinal the arrays live on.

    Raises
    ------
    RuntimeError
        Without CuPy or a usable GPU (:func:`cuflash.runtime.interop.require_cuda`).
    ValueError
        For an ordinal CuPy does not see.
    """

    #: the backend this device serves, for messages
    backend = "cuda"

    poisoned = False

    def __init__(self, func: str, device_id: int):
        self.cupy = require_cuda(func)
        count = int(self.cupy.cuda.runtime.getDeviceCount())
        if not 0 <= device_id < count:
            raise ValueError(f"{func}: arrays are on CUDA device {device_id}, but CuPy sees {count} device(s)")
        self.id = int(device_id)
        self._device = self.cupy.cuda.Device(self.id)
        self.arch = int(self._device.compute_capability)
        self.xp = self.cupy
        self.torch_device = f"cuda:{self.id}"
        self.stream = None

    @property
    def sm_count(self) -> int:
        return cuda_sm_count(self.id)

    @property
    def empty_index(self):
        return _empty_index_on(self.id)

    @property
    def unit_scale(self):
        return _unit_scale_on(self.id)

    def activate(self, framework: str):
        """The device current and the consumer stream current: torch's current stream (through
        ``cupy.cuda.Stream.from_external``) for torch, CuPy's current stream otherwise."""
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self._device)
        if framework == "torch":
            import torch

            self.stream = self.cupy.cuda.Stream.from_external(torch.cuda.current_stream(self.id))
        else:
            self.stream = self.cupy.cuda.get_current_stream()
        stack.enter_context(self.stream)
        return stack

    def is_device_array(self, x) -> bool:
        return interop.is_cupy_array(x)

    def from_host(self, x):
        return self.cupy.asarray(x)

    def from_framework(self, x):
        return cover_span(x if interop.is_cupy_array(x) else self.cupy.from_dlpack(x))

    def to_host_kind(self, a):
        return a

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype=dtype)

    def launch(self, launch_plan) -> None:
        cuda_runner.launch(launch_plan, stream=self.stream)

    def pointer(self, name: str, a, writable: bool) -> plan.PointerArg:
        return cupy_pointer(name, a, writable)

    def as_strided(self, a, shape, strides):
        return self.cupy.lib.stride_tricks.as_strided(a, shape=shape, strides=strides)


def cupy_pointer(name: str, a, writable: bool) -> plan.PointerArg:
    """Pointer to element 0 of the CuPy array ``a``, based on the whole memory object behind the
    view (the planner checks every access against it)."""
    import cupy

    item = a.dtype.itemsize
    mem = a.data.mem
    flat = cupy.ndarray((mem.size // item,), dtype=a.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return plan.PointerArg(name, flat, (a.data.ptr - mem.ptr) // item, tuple(int(n) for n in a.shape),
                           tuple(int(s) // item for s in a.strides), writable)


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


@functools.lru_cache(maxsize=None)
def cuda_sm_count(device_id: int) -> int:
    """The SM count of CUDA device ``device_id`` (one attribute query, then cached: split-KV plans
    ask for it on every call)."""
    import cupy

    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id))


@functools.lru_cache(maxsize=None)
def _empty_index_on(device_id: int):
    """An empty CuPy int32 array on device ``device_id``, made once (launches allocate nothing)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.empty(0, np.int32)


@functools.lru_cache(maxsize=None)
def _unit_scale_on(device_id: int):
    """A one-element CuPy float32 array holding 1.0 on device ``device_id``, made once (an absent
    scale costs no allocation or fill per call; launches only read it)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.ones(1, np.float32)
