"""The simulated device: what a call on ``backend="sim"`` runs on in place of a GPU.

:class:`SimDevice` is the device half of :class:`cuflash.runtime.device_call.DeviceCall` for the
simulator, so a simulated call runs the host code of a GPU call (imports, ``out=``, overlap
checks, framework allocation, export) with three differences only:

* memory is the host's, viewed as :class:`~cuflash.sim.memory.SimArray` (importing is zero-copy;
  fresh arrays are NaN-filled so an element no kernel writes shows, and 128-byte aligned as a
  GPU allocation is);
* there are no streams (ordering is program order);
* launches run on the simulator (:func:`cuflash.sim.launcher.run`) with the options of
  :func:`cuflash.sim.options` (arch, checked mode, seed), and the device has that arch's SM count.

Imports: :mod:`cuflash.sim` and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from cuflash.runtime import interop, plan
from cuflash.sim import config, launcher
from cuflash.sim.memory import SimArray, is_sim_array, to_device

__all__ = ["SimDevice"]

#: fresh simulated allocations start at this alignment (a GPU allocator gives 256 bytes)
ALIGN_BYTES = 128


class _SimNumpy:
    """NumPy as the simulated device's array module: results are device arrays, ``empty`` is
    poisoned, ``asarray`` of host memory copies it in (as ``cupy.asarray`` does)."""

    def __init__(self, device: "SimDevice"):
        self._device = device

    def empty(self, shape, dtype=np.float32):
        return self._device.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        a = self._device.empty(shape, dtype)
        a.fill(0)
        return a

    def asarray(self, x, dtype=None):
        if is_sim_array(x):
            return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
        return to_device(np.array(x, dtype=dtype, copy=True))

    def __getattr__(self, name):
        fn = getattr(np, name)
        if not callable(fn) or isinstance(fn, type):
            return fn

        @functools.wraps(fn)
        def on_device(*args, **kwargs):
            return to_device(fn(*args, **kwargs))

        return on_device


class SimDevice:
    """The simulator as a device (see the module docstring).

    Parameters
    ----------
    options : cuflash.sim.SimOptions, optional
        The simulator's options; default :func:`cuflash.sim.current_options`, read once (the
        call runs under the options it started with).
    """

    #: the backend this device serves, for messages
    backend = "sim"

    poisoned = True
    torch_device = "cpu"

    def __init__(self, options: config.SimOptions | None = None):
        self.options = options or config.current_options()
        self.arch = self.options.arch
        self.xp = _SimNumpy(self)

    @property
    def sm_count(self) -> int:
        return config.sm_count(self.arch)

    @property
    def empty_index(self):
        return self.empty((0,), np.int32)

    @property
    def unit_scale(self):
        one = self.empty((1,), np.float32)
        one[...] = 1
        return one

    def activate(self, framework: str):
        """No device to select and no streams: ordering is program order."""
        return contextlib.nullcontext()

    def is_device_array(self, x) -> bool:
        return is_sim_array(x)

    def from_host(self, x):
        """Host NumPy memory as device memory: a zero-copy view (the simulator shares the host's
        memory, so ``out=`` and in-place cache appends write the caller's arrays)."""
        return x.view(SimArray)

    def from_framework(self, x):
        """A framework array (a device array already, or a CPU torch/JAX tensor: DLPack) viewed."""
        if is_sim_array(x):
            return x
        return interop.host_to_numpy(x, "array", "cuflash simulator").view(SimArray)

    def to_host_kind(self, a):
        """A result as the host NumPy array its framework export takes."""
        return a.view(np.ndarray) if is_sim_array(a) else a

    def empty(self, shape, dtype):
        """NaN-filled (every float type's NaN is all-ones bits), :data:`ALIGN_BYTES`-aligned."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        raw = np.empty(n * dtype.itemsize + ALIGN_BYTES, dtype=np.uint8)
        skip = -raw.__array_interface__["data"][0] % ALIGN_BYTES
        a = raw[skip:skip + n * dtype.itemsize].view(dtype).reshape(shape)
        a.view(np.uint8).fill(0xFF)
        return a.view(SimArray)

    def launch(self, launch_plan) -> None:
        launcher.run(launch_plan, self.options)

    def pointer(self, name: str, a, writable: bool) -> plan.PointerArg:
        """Pointer to element 0 of ``a``, based on the whole buffer behind the view (kept as
        ``a``'s type: a host array stays a host array, which the launcher refuses)."""
        item = a.dtype.itemsize
        shape = tuple(int(n) for n in a.shape)
        strides = tuple(int(s) // item for s in a.strides)
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or root.dtype != a.dtype or not (root.flags.c_contiguous or root.flags.f_contiguous):
            return plan.PointerArg(name, a, 0, shape, strides, writable)   # foreign memory: the view is the region
        flat = root.reshape(-1, order="A").view(type(a))
        offset = (plan.array_address(a) - plan.array_address(flat)) // item
        return plan.PointerArg(name, flat, offset, shape, strides, writable)

    def as_strided(self, a, shape, strides):
        return np.lib.stride_tricks.as_strided(a, shape=shape, strides=strides, subok=True)
