"""Host threads for the NumPy path: one pool the size of the machine, BLAS held to one thread.

The tiled NumPy kernels issue many small matrix products. Left to itself, the BLAS library
(OpenBLAS in NumPy's wheels) starts one thread per core for each, and on a machine that is
already busy those threads oversubscribe the cores and spin: the issue that asked for this
measured a 10-50x collapse. So the tiles are spread over a thread pool of our own (NumPy
releases the GIL inside BLAS and inside ufunc loops over large arrays), and while they run the
BLAS libraries are held to one thread each (``threadpoolctl``).

``CUFLASH_NUM_THREADS`` sets the pool size (default: the CPUs this process may run on).
threadpoolctl is a dependency of the package; where it is missing (a source tree run on a
machine image without it, as the GPU commands are) the tiles still run on the pool, only the
BLAS limit is skipped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading

__all__ = ["num_threads", "run", "blas_single_threaded"]

_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0
_controller = None  # threadpoolctl's ThreadpoolController class; False where it is missing
_held = 0          # callers inside blas_single_threaded (the limit is process-wide)
_limit_ctx = None  # threadpoolctl's context of the first of them


def num_threads() -> int:
    """Worker threads of the NumPy path: ``CUFLASH_NUM_THREADS`` if set (a positive int), else
    the number of CPUs this process may run on.

    Raises
    ------
    ValueError
        For a ``CUFLASH_NUM_THREADS`` that is not a positive int.
    """
    raw = os.environ.get("CUFLASH_NUM_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"cuflash: environment variable CUFLASH_NUM_THREADS must be a positive int, got {raw!r}")
        return n
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


_libraries = None          # threadpoolctl's controller of the libraries loaded when it was made
_modules_seen = -1         # len(sys.modules) then


def _current_libraries():
    """A controller of the libraries loaded now. Looking them up costs about a millisecond, so
    the controller is kept until a Python import has happened since: a BLAS arrives with a
    module (the OpenBLAS SciPy brings, which jax and transformers import), and one loaded after
    the first call would otherwise keep its own thread count."""
    global _libraries, _modules_seen
    if _libraries is None or len(sys.modules) != _modules_seen:
        _libraries = _controller()
        _modules_seen = len(sys.modules)
    return _libraries


@contextlib.contextmanager
def blas_single_threaded():
    """Hold every BLAS library loaded in the process to one thread while the block runs.

    The limit is process-wide (threadpoolctl sets the libraries' global thread count), so
    concurrent callers share it: the first one in sets it, the last one out restores what was
    there before.
    """
    global _controller, _held, _limit_ctx
    with _lock:
        if _held == 0:
            if _controller is None:
                try:
                    from threadpoolctl import ThreadpoolController
                except ImportError:  # not installed: run without the limit (see the module docstring)
                    _controller = False
                else:
                    _controller = ThreadpoolController
            _limit_ctx = _current_libraries().limit(limits=1, user_api="blas") if _controller else None
        _held += 1
    try:
        yield
    finally:
        with _lock:
            _held -= 1
            if _held == 0:
                ctx, _limit_ctx = _limit_ctx, None
                if ctx is not None:
                    ctx.restore_original_limits()


def _get_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n:
            old = _pool
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="cuflash")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run(fn, items) -> list:
    """``[fn(item) for item in items]``, spread over the pool with BLAS single-threaded.

    Items should be independent (they may run in any order and concurrently); the results come
    back in the items' order, and the first exception raised by ``fn`` propagates. With one
    thread or one item everything runs in the calling thread. A call from inside a worker (a
    nested call) also runs inline, so the pool can never wait on itself.
    """
    items = list(items)
    n = num_threads()
    with blas_single_threaded():
        if n == 1 or len(items) <= 1 or threading.current_thread().name.startswith("cuflash"):
            return [fn(item) for item in items]
        return list(_get_pool(n).map(fn, items))
