"""``cuflash.softmax``: row-wise softmax with the online normalizer.

The CUDA kernel (``kernels_cu/softmax.cu``) computes, for each row, the running maximum ``m`` and
the running sum ``d`` of ``exp(x - m)`` in one read pass, rescaling ``d`` whenever ``m`` grows
(Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018), then writes
``exp(x - m) / d`` in a second pass: two reads and one write of HBM per element. The NumPy path
follows the same recurrence over blocks of columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuflash.api import pipeline
from cuflash.kernels import softmax as softmax_kernel
from cuflash.reference import normalize
from cuflash.runtime import interop, variants
from cuflash.runtime.options import Options

_NAME = "cuflash.softmax"

__all__ = ["softmax"]


@dataclasses.dataclass(frozen=True)
class _SoftmaxProblem:
    func: str
    kind: str
    dtype: object
    device: tuple
    axis: int


def _check(x, axis):
    kind = interop.array_kind(x)
    if kind is None:
        raise TypeError(
            f"{_NAME}: x must be an array (numpy.ndarray, cupy.ndarray, or a DLPack array such as "
            f"torch.Tensor or jax.Array), got {type(x).__module__}.{type(x).__qualname__}"
        )
    info = interop.describe(x, "x", _NAME)
    if kind == "dlpack" and not info.on_cuda:
        raise ValueError(
            f"{_NAME}: x is a {info.type_name} on {interop.device_type_name(info.device[0])} (device {info.device}); "
            f"DLPack arrays must be on the CPU or a CUDA device"
        )
    allowed = [np.dtype(np.float16), variants.DTYPES["bf16"][1], np.dtype(np.float32), np.dtype(np.float64)]
    if info.dtype is None or info.dtype not in allowed:
        raise TypeError(f"{_NAME}: x.dtype must be float16, bfloat16, float32 or float64, got {info.dtype_name}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{_NAME}: axis must be an int, got {type(axis).__name__}")
    ndim = info.ndim
    if ndim == 0:
        raise ValueError(f"{_NAME}: x must have at least 1 dimension, got a 0-d array")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{_NAME}: axis={axis} must be in [{-ndim}, {ndim - 1}] for x.ndim={ndim}")
    return int(axis) % ndim, kind, info


def softmax(x, axis: int = -1, *, backend: str = "auto"):
    """Softmax of ``x`` along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : numpy.ndarray, cupy.ndarray, or a DLPack array (torch, JAX)
        Input of any shape (at least 1-D); dtype float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32, or float64 (NumPy path only). A CPU DLPack array (a torch or JAX CPU tensor)
        runs the NumPy path on a zero-copy view and comes back as its own kind.
    axis : int, default -1
        Axis to normalize over.
    backend : {"auto", "numpy", "sim", "cuda"}, default "auto"
        ``"auto"`` never moves data: NumPy input runs the NumPy implementation, CuPy input the
        CUDA kernel (the ``CUFLASH_BACKEND`` environment variable overrides ``"auto"`` only).
        ``"sim"`` runs the CUDA kernel on the CPU simulator (NumPy in and out; options in
        :mod:`cuflash.sim`). ``"cuda"`` with NumPy input is an error.

    Returns
    -------
    ndarray
        Same shape, dtype and array type as ``x``. Arithmetic is float32 (float64 for float64
        input); the 16-bit results are rounded to nearest even once.

    Notes
    -----
    Online normalizer (Milakov & Gimelshein 2018): one pass computes the running maximum and the
    rescaled running sum, a second pass writes the normalized values (two reads and one write
    of each element). ``-inf`` entries get probability 0; a row whose entries are all ``-inf``
    gives NaN (as ``scipy.special.softmax`` and ``torch.softmax`` do); a NaN in a row makes the
    whole row NaN. The kernels need unit stride along ``axis`` and one stride between rows; other
    layouts are copied once to a contiguous array first. Empty inputs return an empty result
    without launching anything.

    torch tensors that require grad (grad mode on) run through :func:`cuflash.torch.softmax`, whose
    backward is ``dx = y * (g - sum(g * y, axis))``, and JAX tracers through
    :func:`cuflash.jax.softmax` (:mod:`cuflash.autodiff`).

    Raises
    ------
    TypeError
        If ``x`` is not an array (or a NumPy subclass such as ``numpy.matrix``), has an
        unsupported dtype or byte order, is a CPU DLPack array NumPy cannot import, or ``axis``
        is not an int.
    ValueError
        For a 0-d ``x``, an out-of-range ``axis``, an unknown backend, or a backend that would
        move data between host and device.
    NotImplementedError
        For float64 input on the kernel backends (``"sim"``, ``"cuda"``).
    """
    return pipeline.run(SOFTMAX, (x,), Options(backend=backend, axis=axis))


def _validate(operands, options, func):
    axis, kind, info = _check(operands[0], options.axis)
    return _SoftmaxProblem(func, kind, info.dtype, info.device, axis)


def _numpy(problem, operands):
    """The NumPy path: :func:`cuflash.reference.online_softmax` (same recurrence) in the input dtype,
    its working memory checked first under the public function's name."""
    x = operands[0]
    return (normalize.run_online_softmax(x, problem.axis, 1024, problem.func).astype(x.dtype, copy=False),)


def _on_device(problem, operands, call):
    return (call.export(softmax_kernel.run(call.import_array(operands[0]), problem.axis, call)),)


#: :func:`softmax`'s steps
SOFTMAX = pipeline.Entry(_NAME, ("x",), _validate, _numpy, _on_device, lambda results, problem: results[0])
