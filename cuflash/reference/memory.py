"""Working memory of the NumPy path: the estimate before a call allocates, the refusal, and the
checks that read only the distinct elements of a (broadcast) view.

The tiled NumPy functions (:func:`cuflash.reference.forward.run_forward`,
:func:`cuflash.reference.backward.run_backward`, the online softmax) add up what they are about
to allocate (outputs, converted copies, the tiles of every worker thread) and call
:func:`check_memory` before the first large allocation. It compares the sum with
:func:`available_bytes` and raises ``MemoryError`` naming each array, the bytes needed and the
bytes available, rather than failing inside NumPy halfway through.

Available memory is, in this order: the environment variable ``CUFLASH_MEMORY_LIMIT`` (bytes, a
non-negative int; a limit that tests and shared machines can set), ``MemAvailable`` of
``/proc/meminfo`` (Linux), ``os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``;
where none of them is known no call is refused.

Broadcast views (stride-0 axes, as ``numpy.broadcast_to`` makes them) are never expanded for a
check: :func:`distinct` keeps one index along each stride-0 axis, and :func:`all_finite` reads that
distinct data in bounded chunks.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["available_bytes", "check_memory", "distinct", "all_finite", "nbytes", "ENV_LIMIT"]

#: the environment variable that sets the memory available to the NumPy path, in bytes
ENV_LIMIT = "CUFLASH_MEMORY_LIMIT"

#: elements per chunk of :func:`all_finite` (its temporary is this many booleans, or this many
#: float32 values for a type NumPy's isfinite does not take directly)
_CHECK_CHUNK = 1 << 20


def available_bytes() -> tuple[int | None, str]:
    """``(bytes, where from)``: the memory the NumPy path may allocate, and the source's name.

    ``CUFLASH_MEMORY_LIMIT`` if set, else ``MemAvailable`` of ``/proc/meminfo``, else
    ``os.sysconf``; ``(None, "unknown")`` when none is readable. Tests replace this function
    (or set the variable) instead of depending on the machine's memory.

    Raises
    ------
    ValueError
        For a ``CUFLASH_MEMORY_LIMIT`` that is not a non-negative int.
    """
    raw = os.environ.get(ENV_LIMIT, "").strip()
    if raw:
        try:
            limit = int(raw)
        except ValueError:
            limit = -1
        if limit < 0:
            raise ValueError(f"cuflash: environment variable {ENV_LIMIT} must be a non-negative int (bytes), "
                             f"got {raw!r}")
        return limit, ENV_LIMIT
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1), "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "os.sysconf available pages"
    except (AttributeError, OSError, ValueError):
        return None, "unknown"


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_memory(func: str, needs: dict) -> int:
    """Refuse a call whose working memory exceeds :func:`available_bytes`; return the total.

    Parameters
    ----------
    func : str
        The public function's name, which the message begins with.
    needs : dict of str to int
        Bytes per array (or group of buffers) about to be allocated, in the order to report.

    Raises
    ------
    MemoryError
        ``"<func>: the NumPy path needs about N bytes (...) of working memory (name: bytes, ...)
        but M bytes are available (<source>)"``.
    """
    needs = {name: int(b) for name, b in needs.items() if b}
    total = sum(needs.values())
    avail, source = available_bytes()
    if avail is not None and total > avail:
        parts = ", ".join(f"{name}: {b} bytes" for name, b in needs.items())
        raise MemoryError(
            f"{func}: the NumPy path needs about {total} bytes ({_human(total)}) of working memory ({parts}) but "
            f"{avail} bytes ({_human(avail)}) are available ({source}); use smaller inputs, a GPU backend, or "
            f"raise {ENV_LIMIT} if more memory is free"
        )
    return total


def nbytes(shape, dtype) -> int:
    """Bytes of a fresh array of ``shape`` and ``dtype`` (Python ints: no overflow)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * np.dtype(dtype).itemsize


def distinct(x: np.ndarray) -> np.ndarray:
    """The view of ``x`` with one index along each stride-0 axis: every distinct element once
    for a broadcast view (a view, never a copy)."""
    if x.size == 0 or 0 not in x.strides:
        return x
    return x[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(x.shape, x.strides))]


def all_finite(x: np.ndarray) -> bool:
    """Whether every element of ``x`` is finite, reading :func:`distinct` data in chunks of
    about 2**20 elements (no full-size temporary)."""
    x = distinct(x)
    if x.size <= _CHECK_CHUNK:
        return bool(np.isfinite(x).all())
    flat = x.reshape(-1) if x.flags.c_contiguous else None
    if flat is not None:
        return all(bool(np.isfinite(flat[i:i + _CHECK_CHUNK]).all()) for i in range(0, flat.size, _CHECK_CHUNK))
    axis = int(np.argmax(x.shape))   # chunks along the longest axis
    step = max(1, _CHECK_CHUNK // max(1, x.size // x.shape[axis]))
    index = [slice(None)] * x.ndim
    for i in range(0, x.shape[axis], step):
        index[axis] = slice(i, i + step)
        if not np.isfinite(x[tuple(index)]).all():
            return False
    return True
