"""What every :mod:`cuflash.torch` function shares: the checks made before an operator runs
(tensor types, devices, index dtypes, options that have no gradient, the backend's name), tensors
handed to the public functions' pipeline, the LSE dtype, dropout keys and scales.

Imports: torch, :mod:`cuflash.api` and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cuflash.api import pipeline
from cuflash.runtime import validation
from cuflash.runtime.options import DropoutOptions

__all__ = ["prepare", "detached", "backend_for", "lse_dtype", "dropout_key", "scale_of", "check_tensors",
           "check_devices", "check_backend", "check_index_dtypes", "requiring_grad", "require_phrase", "run", "is_fp8",
           "refuse_fp8_gradients"]


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
    """The backend ``"auto"`` resolves to for tensors on ``t``'s device (the NumPy path for CPU
    tensors, the CUDA kernels for CUDA tensors; the ``CUFLASH_BACKEND`` environment variable can
    override ``"auto"``, as for :func:`cuflash.attention`).

    Raises
    ------
    ValueError
        For a meta tensor (shapes without data).
    NotImplementedError
        For any other device (XPU, MPS, ...).
    """
    if t.device.type == "cpu":
        return "numpy"
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "meta":
        raise ValueError(_meta_message(func, "the tensor", t))
    raise NotImplementedError(f"{func}: tensors on device {t.device} are not supported; expected CPU or CUDA tensors")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensors(func: str, required: dict, optional: dict | None = None) -> None:
    """Each of ``required`` a ``torch.Tensor``, each of ``optional`` one or None (TypeError naming
    it); then :func:`check_devices` on all of them."""
    for name, x in required.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{func}: {name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    for name, x in (optional or {}).items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{func}: {name} must be a torch.Tensor or None, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
    check_devices(func, {**required, **(optional or {})})


def _meta_message(func: str, name: str, t) -> str:
    return (f"{func}: {name} is on device {t.device} (a tensor with a shape but no data), which cuflash cannot "
            f"compute on; expected CPU or CUDA tensors (a module built on the meta device needs "
            f"module.to_empty(device=...) and its weights first)")


def check_devices(func: str, named: dict) -> None:
    """No meta tensor among ``named`` (``{name: tensor or None}``).

    Raises
    ------
    ValueError
        Naming the first meta tensor and its device.
    """
    for name, x in named.items():
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            raise ValueError(_meta_message(func, name, x))


def check_backend(backend, func: str) -> str:
    """``backend`` one of ``"auto"``, ``"numpy"``, ``"sim"``, ``"cuda"`` (the pipeline refuses a
    backend that would move data when the operator runs).

    Raises
    ------
    ValueError
        For any other value.
    """
    if not isinstance(backend, str) or backend not in pipeline.BACKENDS:
        raise ValueError(f"{func}: backend must be one of {pipeline.BACKENDS}, got {backend!r}")
    return backend


def check_index_dtypes(func: str, named: dict) -> None:
    """Each index tensor of ``named`` (``{name: tensor or None}``) int32.

    Raises
    ------
    TypeError
        Naming the tensor, its dtype and the conversion (``.int()``).
    """
    for name, x in named.items():
        if isinstance(x, torch.Tensor) and x.dtype != torch.int32:
            hint = f"; pass {name}.int()" if not x.is_floating_point() and not x.is_complex() else ""
            raise TypeError(f"{func}: {name} must be int32, got {name}.dtype={x.dtype}{hint}")


def requiring_grad(named: dict) -> list[str]:
    """The names of the tensors of ``named`` that need a gradient now: ``requires_grad`` with grad
    mode on (nothing under ``torch.no_grad()``)."""
    if not torch.is_grad_enabled():
        return []
    return [name for name, x in named.items() if isinstance(x, torch.Tensor) and x.requires_grad]


def require_phrase(needing: list[str]) -> str:
    """``"q, k require grad"`` / ``"q requires grad"``, for messages."""
    return f"{', '.join(needing)} {'requires' if len(needing) == 1 else 'require'} grad"


def dropout_key(dropout_p, dropout_seed, dropout_offset, func: str) -> tuple[int, int]:
    """``(seed, offset)`` of a dropout mask: the given ``dropout_seed`` and ``dropout_offset``
    (checked as :func:`cuflash.attention` checks them), or, for ``dropout_seed=None``, both drawn
    from torch's default CPU generator ((0, 0) without dropout).

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention` for ``dropout_p``, ``dropout_seed`` and ``dropout_offset``;
        ValueError for a ``dropout_offset`` given without ``dropout_seed`` (a drawn key has its
        own offset).
    """
    if dropout_seed is None:
        validation.check_dropout(DropoutOptions(dropout_p, 0, dropout_offset), func)
        if not dropout_p:
            return 0, 0
        if dropout_offset != 0:
            raise ValueError(f"{func}: dropout_offset={dropout_offset} needs dropout_seed: pass both (the mask's "
                             f"Philox key), or neither (the key is then drawn from torch's default generator)")
        seed, offset = (int(x) for x in torch.randint(0, 2**32, (2,), dtype=torch.int64))
        return seed, offset
    validation.check_dropout(DropoutOptions(dropout_p, dropout_seed, dropout_offset), func)
    return int(dropout_seed), int(dropout_offset)


def scale_of(softmax_scale, head_dim: int, func: str) -> float:
    """The scale an operator takes: ``1/sqrt(D)`` for None (1 for ``D = 0``), else the checked value."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return validation.check_softmax_scale(softmax_scale, 1, func)


def run(entry, operands: tuple, options, func: str, device_of):
    """The public function's pipeline (``entry``) on tensors, under the adapter's name ``func``
    (its messages name it), with ``options.backend`` as the caller gave it (``"auto"``: the
    backend of ``device_of``'s device, or ``CUFLASH_BACKEND``)."""
    backend_for(device_of, func)   # a device without a path is refused by name
    return pipeline.run(dataclasses.replace(entry, func=func), operands, options)


def is_fp8(q, fp8: dict) -> bool:
    """Whether the call is an fp8 one (fp8 q, or an fp8 option given)."""
    return any(x is not None for x in fp8.values()) or getattr(q, "dtype", None) == getattr(torch, "float8_e4m3fn", 0)


def refuse_fp8_gradients(func: str, arrays: dict) -> None:
    """fp8 attention has no backward: refuse inputs that would need one (never drop it quietly)."""
    needing = requiring_grad(arrays)
    if needing:
        raise TypeError(f"{func}: fp8 attention (float8_e4m3fn input or a descale) has no backward, and "
                        f"{require_phrase(needing)} (grad mode is on); detach the inputs or call under "
                        f"torch.no_grad()")
