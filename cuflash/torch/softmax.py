"""The softmax operator of :mod:`cuflash.torch` and :func:`softmax`.

``cuflash::softmax_fwd(x, axis, backend="auto") -> y`` runs :func:`cuflash.softmax`'s pipeline
(the online-normalizer kernels, or the NumPy path) on its tensor; its autograd formula is
softmax's own derivative in torch operations, ``dx = y * (g - sum(g * y, axis))`` (float32
arithmetic for 16-bit tensors, float64 for float64), so it needs only the saved output.

Imports: torch, :mod:`cuflash.api` and below.
"""

import torch

from cuflash.api import softmax as api_softmax
from cuflash.runtime.options import Options
from cuflash.torch import tensors

__all__ = ["softmax", "softmax_fwd"]

_FUNC = "cuflash.torch.softmax"


@torch.library.custom_op("cuflash::softmax_fwd", mutates_args=())
def softmax_fwd(x: torch.Tensor, axis: int, backend: str = "auto") -> torch.Tensor:
    """``softmax(x, axis)`` (:func:`cuflash.softmax`), contiguous, x's dtype."""
    y = tensors.run(api_softmax.SOFTMAX, (x.detach(),), Options(backend=backend, axis=axis), _FUNC, x)
    return y.contiguous()


@softmax_fwd.register_fake
def _softmax_fwd_fake(x, axis, backend="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.axis = inputs[1]
    ctx.save_for_backward(output)


def _grads(ctx, g):
    (y,) = ctx.saved_tensors
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    yf, gf = y.to(acc), g.to(acc)
    dx = yf * (gf - (gf * yf).sum(dim=ctx.axis, keepdim=True))
    return dx.to(y.dtype), None, None


softmax_fwd.register_autograd(_grads, setup_context=_setup_context)


def softmax(x, axis=-1, *, backend="auto"):
    """Differentiable softmax of ``x`` along ``axis``, computed by :func:`cuflash.softmax`'s
    kernels (the online normalizer: two reads and one write of each element).

    Parameters
    ----------
    x : torch.Tensor
        At least 1-D; float16, bfloat16, float32 or float64 (float64 on the NumPy path only); CPU
        or CUDA (a meta tensor is refused).
    axis : int, default -1
    backend : {"auto", "numpy", "sim", "cuda"}
        As :func:`cuflash.torch.attention`: "auto" runs CPU tensors on the NumPy path and CUDA
        tensors on the kernel (``CUFLASH_BACKEND`` overrides "auto"); "sim" runs the kernel on the
        simulator with CPU tensors; a backend that would move data raises ``ValueError``.

    Returns
    -------
    torch.Tensor
        x's shape, dtype and device (contiguous), differentiable with respect to ``x``: the
        backward is ``dx = y * (g - sum(g * y, axis))`` in torch operations. Works under
        ``torch.compile`` (``fullgraph=True``) through the custom operator ``cuflash::softmax_fwd``.

    Raises
    ------
    TypeError
        ``x`` not a tensor, ``axis`` not an int; as :func:`cuflash.softmax` for the dtype.
    ValueError
        A meta tensor, a 0-d ``x``, an out-of-range ``axis``, an unknown backend or one that would
        move data.
    NotImplementedError
        Tensors on devices other than CPU and CUDA; float64 on a kernel backend.
    """
    tensors.check_tensors(_FUNC, {"x": x})
    backend = tensors.check_backend(backend, _FUNC)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{_FUNC}: axis must be an int, got {type(axis).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{_FUNC}: x must have at least 1 dimension, got a 0-d tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"{_FUNC}: axis={axis} must be in [{-x.dim()}, {x.dim() - 1}] for x.ndim={x.dim()}")
    return softmax_fwd(x, axis % x.dim(), backend)
