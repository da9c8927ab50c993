"""The KV-cache operator of :mod:`cuflash.torch` and :func:`attention_with_kvcache`.

``cuflash::attention_with_kvcache`` mutates its ``k_cache``, ``v_cache`` and ``out`` arguments
and has no backward (as flash-attn's); it runs :func:`cuflash.attention_with_kvcache`'s pipeline
on its tensors, on the backend its ``backend`` argument names.

Imports: torch, :mod:`cuflash.api` and below.
"""

import torch

from cuflash.api import kvcache as api_kvcache
from cuflash.runtime import validation
from cuflash.runtime.options import CacheOptions, ModifierOptions, Options
from cuflash.torch import tensors
from cuflash.torch.tensors import detached, lse_dtype

__all__ = ["attention_with_kvcache", "attention_with_kvcache_op"]

_FUNC = "cuflash.torch.attention_with_kvcache"


@torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache", "out"))
def attention_with_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
    cache_seqlen: int, k: torch.Tensor | None, v: torch.Tensor | None, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None, rotary_interleaved: bool, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, num_splits: int, out: torch.Tensor | None = None, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``; k/v appended into the caches in place. With
    ``out`` given the result is written there and the first tensor returned is empty ``(0,)``
    (an operator cannot return its own argument)."""
    cache = CacheOptions(cache_seqlen if cache_seqlens is None else cache_seqlens, *(detached(t) for t in (
        k, v, rotary_cos, rotary_sin)), rotary_interleaved, *(detached(t) for t in (cache_batch_idx, cache_leftpad,
                                                                                   block_table)), num_splits)
    mods = ModifierOptions(softcap, detached(alibi_slopes), None, None, detached(sinks))
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                      layout="bshd", return_lse=True, backend=backend, cache=cache, modifiers=mods)
    operands = (q.detach(), k_cache.detach(), v_cache.detach(), detached(out))
    result, lse = tensors.run(api_kvcache.KVCACHE, operands, options, _FUNC, q)
    return (q.new_empty((0,)) if out is not None else result), lse


@attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlen, k, v, rotary_cos, rotary_sin,
                                 cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, causal,
                                 softmax_scale, window_left, window_right, num_splits, out=None, softcap=0.0,
                                 alibi_slopes=None, sinks=None, backend="auto"):
    b, sq, hq, _ = q.shape
    result = q.new_empty((0,)) if out is not None else q.new_empty((b, sq, hq, v_cache.shape[-1]))
    return result, q.new_empty((b, hq, sq), dtype=lse_dtype(q.dtype))


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), num_splits=0, return_lse=False,
                           out=None, backend="auto", softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None,
                           v_descale=None):
    """:func:`cuflash.attention_with_kvcache` as the custom operator
    ``cuflash::attention_with_kvcache`` (it mutates ``k_cache``, ``v_cache`` and ``out``; no
    backward, as flash-attn's), so a decode step traces under ``torch.compile`` and, on CUDA with
    a warm compile cache, can be captured in a CUDA graph (no host synchronization).

    Every parameter of :func:`cuflash.attention_with_kvcache`, with its name, default and meaning;
    every array is a ``torch.Tensor`` on one device, CPU or CUDA (a meta tensor is refused),
    ``cache_seqlens`` an int or an int32 tensor. ``backend`` as :func:`cuflash.torch.attention`
    ("auto": CPU tensors run the NumPy path, CUDA tensors the kernels on torch's current stream;
    "sim" runs the kernels on the simulator with CPU tensors).

    An fp8 cache (``torch.float8_e4m3fn`` caches, or ``k_descale``/``v_descale`` given) is
    forwarded to :func:`cuflash.attention_with_kvcache` unchanged (no custom operator: it does
    not trace under ``torch.compile``).

    Returns
    -------
    out : torch.Tensor ``(B, Sq, Hq, Dv)`` (``out=`` itself when given)
    lse : torch.Tensor, float32 ``(B, Hq, Sq)``; only with ``return_lse=True``.

    Raises
    ------
    TypeError
        A non-tensor argument or an index tensor that is not int32; with grad mode on, any
        tensor argument that requires grad (this is the inference path: it appends to the caches
        in place and has no backward; use :func:`cuflash.torch.attention` for gradients);
        otherwise as :func:`cuflash.attention_with_kvcache`.
    ValueError, NotImplementedError
        A meta tensor, an unknown backend; as :func:`cuflash.attention_with_kvcache`.
    """
    arrays = {"k": k, "v": v, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "out": out,
              "alibi_slopes": alibi_slopes, "sinks": sinks}
    index = {"cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad, "block_table": block_table}
    tensors.check_tensors(_FUNC, {"q": q, "k_cache": k_cache, "v_cache": v_cache}, {**arrays, **index})
    scalar = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if not scalar and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{_FUNC}: cache_seqlens must be an int or an int32 torch.Tensor, got "
                        f"{type(cache_seqlens).__qualname__}")
    tensors.check_devices(_FUNC, {"cache_seqlens": cache_seqlens})
    tensors.check_index_dtypes(_FUNC, {"cache_seqlens": None if scalar else cache_seqlens, **index})
    needing = tensors.requiring_grad({"q": q, "k_cache": k_cache, "v_cache": v_cache, **arrays})
    if needing:
        raise TypeError(f"{_FUNC}: {tensors.require_phrase(needing)} (grad mode is on), but attention_with_kvcache "
                        f"has no backward: it is the inference path, appending k and v to the caches in place; call "
                        f"it under torch.no_grad() or torch.inference_mode(), or use cuflash.torch.attention for a "
                        f"differentiable result")
    fp8 = getattr(torch, "float8_e4m3fn", 0)
    if k_descale is not None or v_descale is not None or getattr(k_cache, "dtype", None) == fp8:
        return api_kvcache.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            num_splits=num_splits, return_lse=return_lse, out=out, backend=backend, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale, v_descale=v_descale)
    left, right = validation.check_window_size(window_size, validation.check_flag(causal, "causal", _FUNC), _FUNC)
    return_lse = validation.check_flag(return_lse, "return_lse", _FUNC)
    backend = tensors.check_backend(backend, _FUNC)
    scale = tensors.scale_of(softmax_scale, q.shape[-1] if q.dim() else 0, _FUNC)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{_FUNC}: softcap must be a real number >= 0 (0 = off), got {softcap!r} "
                        f"({type(softcap).__name__})")
    result, lse = attention_with_kvcache_op(
        q, k_cache, v_cache, None if scalar else cache_seqlens, cache_seqlens if scalar else 0, k, v, rotary_cos,
        rotary_sin, cache_batch_idx, cache_leftpad, block_table,
        validation.check_flag(rotary_interleaved, "rotary_interleaved", _FUNC), bool(causal), scale,
        left, right, validation.check_int(num_splits, "num_splits", _FUNC), out, float(softcap), alibi_slopes, sinks,
        backend)
    result = out if out is not None else result
    return (result, lse) if return_lse else result
