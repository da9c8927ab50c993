"""Zero-copy views of q, k, v, out in the reference's canonical layouts."""

from __future__ import annotations

import numpy as np

from cuflash.runtime.validation import AttentionProblem

__all__ = ["canonical", "split_heads", "kv_view", "check_numpy", "in_dtype"]


def canonical(x: np.ndarray, layout: str) -> np.ndarray:
    """View of ``x`` as ``(*batch, H, S, D)`` (no copy)."""
    if layout == "bshd":
        return x.swapaxes(1, 2)
    if x.ndim == 2:
        return x[None]
    return x


def split_heads(x: np.ndarray, num_heads_k: int) -> np.ndarray:
    """View ``(*batch, H, S, D)`` as ``(*batch, Hk, H // Hk, S, D)``; never copies."""
    *batch, h, s, d = x.shape
    *bs, sh, ss, sd = x.strides
    g = h // num_heads_k if num_heads_k else 0
    return np.lib.stride_tricks.as_strided(
        x, shape=(*batch, num_heads_k, g, s, d), strides=(*bs, g * sh, sh, ss, sd), writeable=x.flags.writeable
    )


def in_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` itself when it already has ``dtype``, else one converted copy (the accumulation
    type of the tiled paths: fp16/bf16 converted once per head, not per tile)."""
    return x if x.dtype == dtype else x.astype(dtype)


def kv_view(x: np.ndarray) -> np.ndarray:
    """View ``(*batch, Hk, S, D)`` as ``(*batch, Hk, 1, S, D)`` so it broadcasts over a group."""
    return x[..., None, :, :]


def check_numpy(problem: AttentionProblem) -> None:
    if problem.kind != "numpy":
        raise TypeError(
            f"{problem.func}: the NumPy reference takes numpy.ndarray inputs; got q of type "
            f"{problem.q.type_name}"
        )
