"""``cuflash.precompile``: compile the kernel variants a device may run, ahead of the first call.

NVRTC compiles a variant the first time a call needs it (about a second each; CuPy keeps the
result in its disk cache, ``CUPY_CACHE_DIR``, and cuflash memoizes the module per device and
variant, thread-safely). Precompiling moves that cost out of the first timed or captured call:
a CUDA graph capture must not compile.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from cuflash.kernels import catalog
from cuflash.runtime import variants

_FUNC = "cuflash.precompile"


def _dtype_keys(dtypes) -> set | None:
    if dtypes is None:
        return None
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = (dtypes,)
    keys = set()
    for dt in dtypes:
        try:
            keys.add(dt if dt in variants.DTYPES else variants.dtype_key(dt))
        except (KeyError, TypeError):
            raise TypeError(
                f"{_FUNC}: dtypes must name float16, bfloat16 or float32 (the kernels' dtypes), got {dt!r}"
            ) from None
    return keys


def _head_dims(head_dims) -> tuple | None:
    if head_dims is None:
        return None
    if isinstance(head_dims, (int, np.integer)):
        head_dims = (head_dims,)
    out = []
    for d in head_dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 1 <= int(d) <= 256:
            raise ValueError(f"{_FUNC}: head_dims must be ints in [1, 256], got {d!r}")
        out.append(int(d))
    return tuple(out)


def variants_to_compile(arch: int, dtypes=None, head_dims=None) -> list:
    """The variants :func:`precompile` compiles for ``sm_<arch>`` (no GPU needed).

    Every variant of :func:`cuflash.kernels.catalog.variants_for_arch`, restricted to ``dtypes``
    (variants with a ``dtype`` axis) and to the variants that serve ``head_dims`` (for each
    kernel family and dtype, the one with the smallest ``head_dim_max`` holding each head dim;
    variants without a head-dim axis, such as softmax, are kept).

    Raises
    ------
    TypeError
        For a dtype without a kernel (float64 runs on the NumPy path only).
    ValueError
        For a head dim outside ``[1, 256]``.
    """
    keys = _dtype_keys(dtypes)
    dims = _head_dims(head_dims)
    chosen = []
    candidates = [v for v in catalog.variants_for_arch(int(arch))
                  if keys is None or getattr(v, "dtype", None) is None or v.dtype in keys]
    for v in candidates:
        hmax = getattr(v, "head_dim_max", None)
        if dims is None or hmax is None:
            chosen.append(v)
            continue
        same = sorted({getattr(w, "head_dim_max") for w in candidates
                       if type(w) is type(v) and getattr(w, "dtype", None) == getattr(v, "dtype", None)})
        serves = {min((b for b in same if b >= d), default=None) for d in dims}
        if hmax in serves:
            chosen.append(v)
    return list(dict.fromkeys(chosen))


def _progress(total: int, show):
    """A progress bar (tqdm when installed; plain lines on stderr otherwise), or None."""
    if show is False or (show is None and total < 4):
        return None
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=_FUNC, unit="variant", file=sys.stderr)
    except ImportError:
        return _PlainProgress(total)


class _PlainProgress:
    def __init__(self, total: int):
        self.total, self.n = total, 0

    def set_postfix_str(self, text: str) -> None:
        self._text = text

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{_FUNC}: [{self.n}/{self.total}] {getattr(self, '_text', '')}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def precompile(dtypes=None, head_dims=None, device=None, *, progress=None) -> list[str]:
    """Compile (or load from CuPy's disk cache) the kernels a device may run.

    Parameters
    ----------
    dtypes : dtype or sequence of dtypes, optional
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 (NumPy dtypes, names such as
        ``"float16"``, or the keys ``"f16"``/``"bf16"``/``"f32"``). Default: all three.
    head_dims : int or sequence of int, optional
        Head dims to be ready for (each maps to the variant serving it). Default: all.
        Softmax variants have no head dim and are always included.
    device : int or cupy.cuda.Device, optional
        The device to compile for (its compute capability picks the variants). Default:
        CuPy's current device.
    progress : bool, optional
        Show a progress bar (tqdm if installed, else one line per variant on stderr). Default:
        when four or more variants are compiled.

    Returns
    -------
    list of str
        Entry names (``cuflash_<family>_<variant>``) of the compiled variants, in order.

    Raises
    ------
    RuntimeError
        Without CuPy or a usable CUDA device (NVRTC modules are loaded onto a device).
    TypeError, ValueError
        For an unsupported dtype or a head dim outside ``[1, 256]``.

    Notes
    -----
    Thread-safe: modules are memoized per (device, variant) under a lock, so concurrent calls
    compile each variant once.
    """
    from cuflash.runtime import cuda_runner, interop

    _dtype_keys(dtypes)  # validate the arguments before touching the device
    _head_dims(head_dims)
    cupy = interop.require_cuda(_FUNC)
    dev_id = int(getattr(device, "id", device)) if device is not None else int(cupy.cuda.Device().id)
    arch = int(cupy.cuda.Device(dev_id).compute_capability)
    todo = variants_to_compile(arch, dtypes, head_dims)
    bar = _progress(len(todo), progress)
    names = []
    try:
        for v in todo:
            start = time.perf_counter()
            cuda_runner.get_module(v, dev_id)
            names.append(v.entry)
            if bar is not None:
                bar.set_postfix_str(f"{v.entry} ({time.perf_counter() - start:.1f} s)")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return names
