"""TMA tensor maps: one host-side description of a tiled view of a global array.

A kernel's ``cp.async.bulk.tensor`` instructions (kernels_cu/ptx.cuh) name a tensor map, a 128-byte
object passed as a ``const __grid_constant__ cuflash_tensor_map`` parameter. :class:`TensorMap`
holds its geometry once, in NumPy order (outermost dimension first), and encodes it two ways:

* :meth:`TensorMap.encode_cuda`: the driver's own encoding, by ``cuTensorMapEncodeTiled`` (CUDA
  Driver API, "Tensor Map Object Management"), called through ``ctypes`` on the driver library
  that is loaded wherever a GPU is (``libcuda.so.1``); needs a GPU machine.
* :meth:`TensorMap.encode_sim`: the simulator's form (cuflash/sim/cusim_sm90.h ``SimTensorMap``):
  magic ``"TMAP"``, rank, element bytes, swizzle / 16, the address, dims and strides innermost
  first, the box.

Validation follows the driver's documented requirements of ``cuTensorMapEncodeTiled``: rank 1..5,
a 16-byte-aligned address, dims in 1..2**32, strides (all but the innermost, which must be the
element size) multiples of 16 below 2**40, box extents in 1..256 with an inner box of a
multiple of 16 bytes, and with a swizzle an inner box of at most the swizzle span. The simulator
models swizzled boxes whose inner extent equals the swizzle span (what wgmma's canonical layouts
use), and :class:`TensorMap` refuses the others rather than guess; out-of-bounds box elements
are zero-filled on load and dropped on store (``CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE``), element
strides are 1, no interleave, no L2 promotion.

A *ragged* map (:meth:`TensorMap.ragged`) views an array of packed sequences (rows of several
sequences one after another) so that every box is clipped at the end of its own sequence, not
only at the array's: two dimensions with the same row stride, the inner of extent ``E`` (the
box's rows) and the outer indexed by the sequence's end, and an origin ``E`` rows before the
array (:attr:`TensorMap.base_offset`). The hardware's bounds check on the inner dimension is
then the sequence's end; no element outside the array is ever reached.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct

import numpy as np

SWIZZLES = (0, 32, 64, 128)
_MAGIC = 0x50414D54  # "TMAP", little-endian

#: CUtensorMapDataType for the element types cuflash's kernels move
_CU_DTYPE = {np.dtype(np.uint8): 0, np.dtype(np.uint16): 1, np.dtype(np.uint32): 2, np.dtype(np.int32): 3,
             np.dtype(np.uint64): 4, np.dtype(np.int64): 5, np.dtype(np.float16): 6, np.dtype(np.float32): 7,
             np.dtype(np.float64): 8}
_CU_BFLOAT16 = 9
_CU_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}


@functools.lru_cache(maxsize=1)
def _encode_tiled():
    """The driver's ``cuTensorMapEncodeTiled`` (the library is loaded once per process: a launch
    encodes its maps on every call)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"TensorMap.encode_cuda: the CUDA driver library is not loadable ({e}); "
                           "tensor maps for a GPU need its driver") from e
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def _cu_dtype(dtype: np.dtype) -> int:
    if dtype.name == "bfloat16":
        return _CU_BFLOAT16
    if dtype not in _CU_DTYPE:
        raise TypeError(f"TensorMap: dtype {dtype} has no CUtensorMapDataType; expected one of "
                        f"{sorted(str(d) for d in _CU_DTYPE)} or bfloat16")
    return _CU_DTYPE[dtype]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """A tiled TMA view of a global array (``cuTensorMapEncodeTiled``'s arguments).

    Attributes
    ----------
    dtype : numpy.dtype
        Element type (1, 2, 4 or 8 bytes; ``ml_dtypes.bfloat16`` for bf16).
    shape : tuple of int
        Extents, outermost first (NumPy order), rank 1..5.
    strides : tuple of int
        Byte strides, outermost first; the innermost must equal the element size.
    box : tuple of int
        The box one instruction moves, outermost first; each in 1..256.
    swizzle : int
        Shared-memory swizzle span in bytes: 0 (none), 32, 64 or 128.
    base_offset : int
        Bytes from the array's address to the map's origin (negative for a ragged map, whose
        origin lies before the array; the kernel's coordinates reach only elements inside it).

    Raises
    ------
    TypeError
        For an element type without a CUtensorMapDataType, or a non-integer extent, stride or box.
    ValueError
        For geometry the driver (or the simulator's model) refuses, naming the field.
    """

    dtype: np.dtype
    shape: tuple
    strides: tuple
    box: tuple
    swizzle: int = 0
    base_offset: int = 0

    def __post_init__(self):
        dt = np.dtype(self.dtype)
        object.__setattr__(self, "dtype", dt)
        for f in ("shape", "strides", "box"):
            vals = tuple(getattr(self, f))
            bad = [x for x in vals if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
            if bad:
                raise TypeError(f"TensorMap: {f} must hold integers, got {bad[0]!r} in {vals}")
            object.__setattr__(self, f, tuple(int(x) for x in vals))
        _cu_dtype(dt)
        rank = len(self.shape)
        if not 1 <= rank <= 5:
            raise ValueError(f"TensorMap: rank must be 1..5, got shape {self.shape}")
        if len(self.strides) != rank or len(self.box) != rank:
            raise ValueError(f"TensorMap: shape {self.shape}, strides {self.strides} and box {self.box} must have "
                             "the same rank")
        if any(not 1 <= n <= 2**32 for n in self.shape):
            raise ValueError(f"TensorMap: every extent must be in 1..2**32, got shape {self.shape}")
        if self.strides[-1] != dt.itemsize:
            raise ValueError(f"TensorMap: the innermost stride must be the element size {dt.itemsize} bytes "
                             f"(contiguous rows), got strides {self.strides}")
        for s in self.strides[:-1]:
            if s <= 0 or s % 16 or s >= 2**40:
                raise ValueError(f"TensorMap: outer strides must be positive multiples of 16 bytes below 2**40 "
                                 f"(cuTensorMapEncodeTiled), got strides {self.strides}")
        if any(not 1 <= b <= 256 for b in self.box):
            raise ValueError(f"TensorMap: box extents must be in 1..256, got box {self.box}")
        inner = self.box[-1] * dt.itemsize
        if inner % 16:
            raise ValueError(f"TensorMap: the box's inner extent must be a multiple of 16 bytes, got "
                             f"{self.box[-1]} x {dt.itemsize} = {inner} bytes")
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"TensorMap: swizzle must be one of {SWIZZLES} bytes, got {self.swizzle!r}")
        if self.swizzle and inner != self.swizzle:
            raise ValueError(f"TensorMap: with a {self.swizzle}-byte swizzle the box's inner extent must be "
                             f"{self.swizzle} bytes (the driver allows less; the simulator models the canonical "
                             f"case only), got {inner} bytes")

    @classmethod
    def of(cls, array, box, *, swizzle: int = 0) -> "TensorMap":
        """The map of a NumPy or CuPy ``array`` (any strides TMA can describe) with ``box``. The
        stride of an axis of extent 1 is never used, so it is replaced by one the driver accepts
        (NumPy leaves such strides arbitrary, 0 among them)."""
        shape = tuple(int(n) for n in array.shape)
        strides = [int(s) for s in array.strides]
        for i in range(len(shape) - 2, -1, -1):
            if shape[i] == 1:
                inner = strides[i + 1] * shape[i + 1]
                strides[i] = max(16, -(-inner // 16) * 16)
        return cls(array.dtype, shape, tuple(strides), tuple(box), swizzle)

    @classmethod
    def ragged(cls, array, rows: int, inner: int, *, swizzle: int = 0) -> "TensorMap":
        """The ragged map of a packed ``array`` ``(total, H, D)`` (rows of sequences one after
        another; the head dim contiguous) with boxes of ``rows`` rows of one head and ``inner``
        head-dim elements.

        Its dims, innermost first, are (D, H, ``rows``, total + 1): element ``(c, h, r, e)`` is
        ``array[r + e - rows, h, c]``, in bounds iff ``0 <= r < rows``. A kernel loads or stores
        the box at packed row ``row`` of a sequence ending at row ``end`` with ``e = min(end, row +
        rows)`` and ``r = row - e + rows``: rows from ``end`` on are zero-filled on load and
        dropped on store, so the box never reaches another sequence.

        Raises
        ------
        ValueError
            If ``array`` is not 3-d, or for geometry the driver refuses (as the constructor).
        """
        if array.ndim != 3:
            raise ValueError(f"TensorMap.ragged: the array must be (total, H, D), got shape {tuple(array.shape)}")
        total, heads, dim = (int(n) for n in array.shape)
        item = array.dtype.itemsize
        row_stride, head_stride = int(array.strides[0]), int(array.strides[1])
        if heads == 1:   # never used: one the driver accepts
            head_stride = max(16, -(-dim * item // 16) * 16)
        if total == 0:
            row_stride = max(16, -(-heads * head_stride // 16) * 16)
        return cls(array.dtype, (total + 1, rows, heads, dim), (row_stride, row_stride, head_stride, item),
                   (1, rows, 1, inner), swizzle, -rows * row_stride)

    @property
    def box_bytes(self) -> int:
        """Bytes one instruction moves (the mbarrier's transaction count of a load)."""
        return int(np.prod(self.box)) * self.dtype.itemsize

    def _check_address(self, address: int) -> int:
        """The map's origin for a view at ``address`` (with :attr:`base_offset`), checked."""
        if address % 16:
            raise ValueError(f"TensorMap: the global address {address:#x} must be 16-byte aligned "
                             "(cuTensorMapEncodeTiled)")
        origin = address + self.base_offset
        if origin < 0:
            raise ValueError(f"TensorMap: the map's origin {self.base_offset} bytes from the view at {address:#x} "
                             "would lie below address 0")
        return origin

    def encode_sim(self, address: int) -> bytes:
        """The simulator's 128-byte form for a view starting at host ``address``."""
        address = self._check_address(address)
        rank = len(self.shape)
        dims = list(reversed(self.shape)) + [1] * (5 - rank)
        strides = list(reversed(self.strides))[1:] + [0] * (5 - rank)
        box = list(reversed(self.box)) + [1] * (5 - rank)
        blob = struct.pack("<IBBBBQ5II4Q5H", _MAGIC, rank, self.dtype.itemsize, self.swizzle // 16, 0, address,
                           *dims, 0, *strides[:4], *box)
        return blob + bytes(128 - len(blob))

    def encode_cuda(self, address: int) -> bytes:
        """The driver's encoding (``cuTensorMapEncodeTiled``) for device ``address``.

        Raises
        ------
        RuntimeError
            If the driver library cannot be loaded (no GPU driver) or refuses the map (its
            CUresult is in the message).
        """
        address = self._check_address(address)
        rank = len(self.shape)
        fn = _encode_tiled()
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        out = (ctypes.c_uint64 * 16)()
        dims = (u64 * rank)(*reversed(self.shape))
        strides = (u64 * max(1, rank - 1))(*list(reversed(self.strides))[1:])
        box = (u32 * rank)(*reversed(self.box))
        elem = (u32 * rank)(*([1] * rank))
        rc = fn(out, ctypes.c_int(_cu_dtype(self.dtype)), u32(rank), ctypes.c_void_p(address), dims, strides, box,
                elem, ctypes.c_int(0), ctypes.c_int(_CU_SWIZZLE[self.swizzle]), ctypes.c_int(0), ctypes.c_int(0))
        if rc != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled refused {self} at {address:#x}: CUresult {rc}")
        return bytes(out)
