"""Launch plans: everything needed to launch one kernel, for the CUDA runner and the simulator.

A planner (one per kernel family, e.g. :func:`cuflash.kernels.softmax.plan_softmax`) turns validated
inputs into a frozen :class:`LaunchPlan`. Both runners consume the same plan: the CUDA runner
(:mod:`cuflash.runtime.cuda_runner`) and the CPU simulator (:mod:`cuflash.sim.launcher`), which enforces
the same limits a device would (threads per block, grid dimensions, shared memory with and
without the opt-in).

Every argument is typed exactly as the kernel parameter it feeds: pointers are
:class:`PointerArg` (the base array, an element offset, and the shape/strides of the region the
kernel may touch through it, in elements), scalars are :class:`ScalarArg` holding a NumPy scalar
of the exact C type (``np.int32`` for ``int``, ``np.int64`` for ``long long``, ``np.float32``
for ``float``...). The simulator checks them against the compiled kernel's parameter list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

#: dynamic shared memory a kernel may use without the opt-in (and the static maximum), bytes
SMEM_DEFAULT_LIMIT = 48 * 1024
#: largest block
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIMS = (1024, 1024, 64)
MAX_GRID_DIMS = (2**31 - 1, 65535, 65535)

#: opt-in shared memory maximum per block (static + dynamic), by compute capability
SMEM_OPT_IN_LIMIT = {
    70: 96 * 1024,
    75: 64 * 1024,
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
}


def max_dynamic_smem(cc: int) -> int:
    """Largest dynamic shared memory per block on compute capability ``cc``, with the opt-in."""
    return SMEM_OPT_IN_LIMIT.get(cc, SMEM_DEFAULT_LIMIT)


_SCALAR_TYPES = {
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.int64): "long long",
    np.dtype(np.uint64): "unsigned long long",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}


def array_address(a) -> int:
    """Device or host address of element 0 of a NumPy or CuPy array.

    Raises
    ------
    TypeError
        For any other object (no ``__array_interface__`` or ``data.ptr``).
    """
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is None:
        raise TypeError(f"cuflash: cannot take the address of {type(a).__name__}")
    return int(ptr)


def _span_elements(a) -> int:
    """Elements from ``a``'s first element to one past its last (its memory span; 0 if empty)."""
    if a.size == 0:
        return 0
    item = a.dtype.itemsize
    if any(s < 0 for s in a.strides):
        raise ValueError("cuflash: arrays with negative strides are not supported")
    return 1 + sum((n - 1) * (s // item) for n, s in zip(a.shape, a.strides))


@dataclasses.dataclass(frozen=True, eq=False)
class PointerArg:
    """A pointer kernel argument.

    Attributes
    ----------
    name : str
        Parameter name (for messages).
    base : array
        A NumPy or CuPy array (or view) whose memory span contains the region.
    offset : int
        Element offset of the pointer from ``base``'s first element.
    shape, strides : tuple of int
        Extent of the region the kernel may access through the pointer, in elements
        (non-negative strides); element ``idx`` is at ``offset + sum(idx * strides)``.
    writable : bool
        Whether the kernel writes through the pointer.
    """

    name: str
    base: Any
    offset: int
    shape: tuple
    strides: tuple
    writable: bool = False

    def __post_init__(self):
        if len(self.shape) != len(self.strides):
            raise ValueError(f"PointerArg {self.name}: shape {self.shape} and strides {self.strides} differ in rank")
        if any(s < 0 for s in self.strides) or self.offset < 0:
            raise ValueError(f"PointerArg {self.name}: negative offset or strides are not supported")
        span = _span_elements(self.base)
        if self.extent > 0 and self.offset + self.extent > span:
            raise ValueError(
                f"PointerArg {self.name}: region ends at element {self.offset + self.extent}, "
                f"beyond the {span} elements the base array spans"
            )

    @classmethod
    def of(cls, name: str, array, *, writable: bool = False) -> "PointerArg":
        """Pointer to element 0 of ``array``, covering its shape and strides."""
        item = array.dtype.itemsize
        strides = tuple(int(s) // item for s in array.strides)
        return cls(name, array, 0, tuple(int(n) for n in array.shape), strides, writable)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.base.dtype)

    @property
    def extent(self) -> int:
        """Number of elements from the pointer to one past the last accessible element (0 if empty)."""
        if any(n == 0 for n in self.shape):
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

    @property
    def address(self) -> int:
        """Address of the pointed-to element (host address for NumPy, device for CuPy)."""
        return array_address(self.base) + self.offset * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ScalarArg:
    """A scalar kernel argument of an exact C type (the NumPy scalar type says which)."""

    name: str
    value: np.generic

    def __post_init__(self):
        if not isinstance(self.value, np.generic) or np.dtype(type(self.value)) not in _SCALAR_TYPES:
            raise TypeError(
                f"ScalarArg {self.name}: value must be a NumPy scalar of type "
                f"int32/uint32/int64/uint64/float32/float64, got {type(self.value).__name__}"
            )

    @property
    def c_type(self) -> str:
        return _SCALAR_TYPES[np.dtype(type(self.value))]


@dataclasses.dataclass(frozen=True)
class TensorMapArg:
    """A ``const __grid_constant__ cuflash_tensor_map`` kernel argument: a TMA view of an array.

    Each runner encodes it for the address it gives the array (the driver's form on a GPU, the
    simulator's on the CPU: :mod:`cuflash.runtime.tensor_map`); :attr:`pointer` is the region the
    kernel may reach through it (checked mode registers it like a pointer argument).

    Attributes
    ----------
    name : str
        Parameter name (for messages).
    pointer : PointerArg
        The array, its view (the map's shape and strides in elements) and whether the kernel
        writes through the map (TMA stores).
    tmap : cuflash.runtime.tensor_map.TensorMap
        The geometry (box, swizzle).
    """

    name: str
    pointer: PointerArg
    tmap: Any

    @classmethod
    def of(cls, name: str, array, box, *, swizzle: int = 0, writable: bool = False) -> "TensorMapArg":
        """The map of ``array`` (its shape and strides) with ``box``."""
        from cuflash.runtime.tensor_map import TensorMap

        return cls(name, PointerArg.of(name, array, writable=writable), TensorMap.of(array, box, swizzle=swizzle))

    def encode(self, address: int, *, simulator: bool) -> bytes:
        """The 128-byte map for the view at ``address`` (host address for the simulator)."""
        return self.tmap.encode_sim(address) if simulator else self.tmap.encode_cuda(address)


def _dim3(v, what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
    if not 1 <= len(t) <= 3:
        raise ValueError(f"LaunchPlan: {what} must have 1 to 3 dimensions, got {v!r}")
    return t + (1,) * (3 - len(t))


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch.

    Attributes
    ----------
    variant : cuflash.runtime.variants.Variant
        The compiled variant (source and defines).
    entry : str
        ``extern "C"`` kernel name inside the variant's module.
    grid, block : tuple of 3 int
        Launch shape (``gridDim``, ``blockDim``).
    shared_mem_bytes : int
        Dynamic shared memory per block, bytes.
    args : tuple of PointerArg, ScalarArg or TensorMapArg
        Kernel arguments in parameter order.
    """

    variant: Any
    entry: str
    grid: tuple
    block: tuple
    shared_mem_bytes: int
    args: tuple

    def __post_init__(self):
        object.__setattr__(self, "grid", _dim3(self.grid, "grid"))
        object.__setattr__(self, "block", _dim3(self.block, "block"))
        object.__setattr__(self, "args", tuple(self.args))
        for a in self.args:
            if not isinstance(a, (PointerArg, ScalarArg, TensorMapArg)):
                raise TypeError(f"LaunchPlan: argument {a!r} must be a PointerArg, ScalarArg or TensorMapArg")
        for i, (n, lim) in enumerate(zip(self.block, MAX_BLOCK_DIMS)):
            if not 1 <= n <= lim:
                raise ValueError(f"LaunchPlan {self.entry}: block[{i}]={n} must be in [1, {lim}]")
        if self.threads_per_block > MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"LaunchPlan {self.entry}: {self.threads_per_block} threads per block; the limit is {MAX_THREADS_PER_BLOCK}"
            )
        for i, (n, lim) in enumerate(zip(self.grid, MAX_GRID_DIMS)):
            if not 1 <= n <= lim:
                raise ValueError(f"LaunchPlan {self.entry}: grid[{i}]={n} must be in [1, {lim}]")
        if self.shared_mem_bytes < 0:
            raise ValueError(f"LaunchPlan {self.entry}: shared_mem_bytes={self.shared_mem_bytes} is negative")

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def needs_smem_opt_in(self) -> bool:
        """True when the dynamic shared memory exceeds the 48 KB available without opting in
        (``cudaFuncAttributeMaxDynamicSharedMemorySize``)."""
        return self.shared_mem_bytes > SMEM_DEFAULT_LIMIT

    def smem_limit(self, cc: int) -> int:
        """Static + dynamic shared memory allowed for this plan on compute capability ``cc``."""
        if not self.needs_smem_opt_in:
            return SMEM_DEFAULT_LIMIT
        return SMEM_OPT_IN_LIMIT.get(cc, SMEM_DEFAULT_LIMIT)

    def check_device(self, cc: int, opt_in_limit: int | None = None) -> None:
        """Raise ValueError if the plan cannot launch on compute capability ``cc``.

        ``opt_in_limit`` (bytes) overrides the table :data:`SMEM_OPT_IN_LIMIT`, e.g. with the
        device's ``MaxSharedMemoryPerBlockOptin`` attribute.
        """
        limit = opt_in_limit if opt_in_limit is not None else SMEM_OPT_IN_LIMIT.get(cc)
        if limit is None:
            raise ValueError(f"LaunchPlan {self.entry}: unknown compute capability {cc}")
        if self.shared_mem_bytes > limit:
            raise ValueError(
                f"LaunchPlan {self.entry}: {self.shared_mem_bytes} bytes of dynamic shared memory exceed "
                f"the sm_{cc} maximum of {limit} bytes per block"
            )
