"""What every :mod:`cuflash.torch` operator shares: tensors handed to the public functions'
pipeline, the backend of a device, the LSE dtype, dropout keys and scales.

Imports: torch, :mod:`cuflash.api` and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cuflash.api import pipeline
from cuflash.runtime import validation

__all__ = ["prepare", "detached", "backend_for", "lse_dtype", "dropout_key", "scale_of", "check_tensors", "run"]


def prepare(t):
    """``t`` detached, its last axis made unit-stride by one copy where it is not (the one
    documented copy: a stride-0 gradient of ``out.sum()``, for instance)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.detach()


def detached(t):
    """``t.detach()``, None stays None (modifier tensors keep their strides: a stride-0
    expanded bias is not copied)."""
    return None if t is None else t.detach()


def backend_for(t, func: str) -> str:
    """The backend that runs tensors on ``t``'s device: the NumPy path for CPU tensors, the CUDA
    kernels for CUDA tensors.

    Raises
    ------
    NotImplementedError
        For any other device (meta, XPU, ...).
    """
    if t.device.type == "cpu":
        return "numpy"
    if t.device.type == "cuda":
        return "cuda"
    raise NotImplementedError(f"{func}: tensors on device {t.device} are not supported; expected CPU or CUDA tensors")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensors(func: str, required: dict, optional: dict | None = None) -> None:
    """Each of ``required`` a ``torch.Tensor``, each of ``optional`` one or None (TypeError naming it)."""
    for name, x in required.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{func}: {name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    for name, x in (optional or {}).items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{func}: {name} must be a torch.Tensor or None, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")


def dropout_key(dropout_p, func: str) -> tuple[int, int]:
    """``(seed, offset)`` of a dropout mask from torch's default generator ((0, 0) without
    dropout; ``dropout_p`` is checked here, the operator checks it again with the call)."""
    from cuflash.runtime.options import DropoutOptions

    validation.check_dropout(DropoutOptions(dropout_p, 0, 0), func)
    if not dropout_p:
        return 0, 0
    seed, offset = (int(x) for x in torch.randint(0, 2**32, (2,), dtype=torch.int64))
    return seed, offset


def scale_of(softmax_scale, head_dim: int, func: str) -> float:
    """The scale an operator takes: ``1/sqrt(D)`` for None (1 for ``D = 0``), else the checked value."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return validation.check_softmax_scale(softmax_scale, 1, func)


def run(entry, operands: tuple, options, func: str, device_of):
    """The public function's pipeline (``entry``) on tensors, under the adapter's name ``func``
    (its messages name it), on the backend of ``device_of``'s device."""
    options = dataclasses.replace(options, backend=backend_for(device_of, func))
    return pipeline.run(dataclasses.replace(entry, func=func), operands, options)
