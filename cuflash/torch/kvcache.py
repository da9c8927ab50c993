"""The KV-cache operator of :mod:`cuflash.torch` and :func:`attention_with_kvcache`.

``cuflash::attention_with_kvcache`` mutates its ``k_cache`` and ``v_cache`` arguments and has no
backward (as flash-attn's); it runs :func:`cuflash.attention_with_kvcache`'s pipeline on its
tensors.

Imports: torch, :mod:`cuflash.api` and below.
"""

import torch

from cuflash.api import kvcache as api_kvcache
from cuflash.runtime import validation
from cuflash.runtime.options import CacheOptions, Options
from cuflash.torch import tensors
from cuflash.torch.tensors import detached, lse_dtype

__all__ = ["attention_with_kvcache", "attention_with_kvcache_op"]

_FUNC = "cuflash.torch.attention_with_kvcache"


@torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
    cache_seqlen: int, k: torch.Tensor | None, v: torch.Tensor | None, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None, rotary_interleaved: bool, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``; k/v appended into the caches in place."""
    cache = CacheOptions(cache_seqlen if cache_seqlens is None else cache_seqlens, *(detached(t) for t in (
        k, v, rotary_cos, rotary_sin)), rotary_interleaved, *(detached(t) for t in (cache_batch_idx, cache_leftpad,
                                                                                   block_table)), num_splits)
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                      layout="bshd", return_lse=True, cache=cache)
    return tensors.run(api_kvcache.KVCACHE, (q.detach(), k_cache.detach(), v_cache.detach(), None), options, _FUNC, q)


@attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlen, k, v, rotary_cos, rotary_sin,
                                 cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, causal,
                                 softmax_scale, window_left, window_right, num_splits):
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v_cache.shape[-1])),
            q.new_empty((b, hq, sq), dtype=lse_dtype(q.dtype)))


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), num_splits=0, return_lse=False):
    """:func:`cuflash.attention_with_kvcache` as the custom operator
    ``cuflash::attention_with_kvcache`` (it mutates ``k_cache`` and ``v_cache``; no backward, as
    flash-attn's), so a decode step traces under ``torch.compile`` and, on CUDA with a warm
    compile cache, can be captured in a CUDA graph (no host synchronization).

    Parameters and conventions are those of :func:`cuflash.attention_with_kvcache`; every array is
    a ``torch.Tensor`` on one device (CPU: the NumPy path; CUDA: the kernels on torch's current
    stream), ``cache_seqlens`` an int or an int32 tensor.

    Returns
    -------
    out : torch.Tensor ``(B, Sq, Hq, Dv)``; lse : float32 ``(B, Hq, Sq)`` with ``return_lse``.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention_with_kvcache` (raised when the operator runs).
    """
    tensors.check_tensors(_FUNC, {"q": q, "k_cache": k_cache, "v_cache": v_cache},
                          {"k": k, "v": v, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
                           "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad, "block_table": block_table})
    scalar = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if not scalar and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{_FUNC}: cache_seqlens must be an int or an int32 torch.Tensor, got "
                        f"{type(cache_seqlens).__qualname__}")
    left, right = validation.check_window_size(window_size, validation.check_flag(causal, "causal", _FUNC), _FUNC)
    scale = tensors.scale_of(softmax_scale, q.shape[-1] if q.dim() else 0, _FUNC)
    out, lse = attention_with_kvcache_op(
        q, k_cache, v_cache, None if scalar else cache_seqlens, cache_seqlens if scalar else 0, k, v, rotary_cos,
        rotary_sin, cache_batch_idx, cache_leftpad, block_table,
        validation.check_flag(rotary_interleaved, "rotary_interleaved", _FUNC), bool(causal), scale,
        left, right, validation.check_int(num_splits, "num_splits", _FUNC))
    return (out, lse) if return_lse else out
