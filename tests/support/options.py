"""The options of a call as the public functions spell them, for tests that reach the validated
problem or a kernel host directly (the package itself builds :class:`Options` at its faces)."""

from __future__ import annotations

from cuflash.runtime import validation, validation_kvcache
from cuflash.runtime.options import CacheOptions, DropoutOptions, Fp8Options, ModifierOptions, Options, PackedOptions

_DROPOUT = {"dropout_p": "p", "dropout_seed": "seed", "dropout_offset": "offset"}
_MODS = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
_PACKED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k")
_FP8 = ("q_descale", "k_descale", "v_descale", "out_dtype")
_CACHE = ("cache_seqlens", "k", "v", "rotary_cos", "rotary_sin", "rotary_interleaved", "cache_batch_idx",
          "cache_leftpad", "num_splits")


def options(**kw) -> Options:
    """``Options`` from any public function's keywords (``dropout_p``, ``softcap``,
    ``cu_seqlens_q``, ``cache_seqlens``, ``block_table``, ``q_descale``, ...)."""
    drop = {_DROPOUT[n]: kw.pop(n) for n in list(kw) if n in _DROPOUT}
    mods = {n: kw.pop(n) for n in list(kw) if n in _MODS}
    packed = {n: kw.pop(n) for n in list(kw) if n in _PACKED}
    if packed and "num_splits" in kw:   # (attention_varlen's split-KV count)
        packed["num_splits"] = kw.pop("num_splits")
    cache = {n: kw.pop(n) for n in list(kw) if n in _CACHE}
    fp8 = {n: kw.pop(n) for n in list(kw) if n in _FP8}
    table = kw.pop("block_table", None)
    if cache or (table is not None and not packed):
        cache["block_table"] = table
    elif table is not None:
        packed["block_table"] = table
    return Options(**kw, dropout=DropoutOptions(**drop), modifiers=ModifierOptions(**mods),
                   packed=PackedOptions(**packed) if packed else None, cache=CacheOptions(**cache) if cache else None,
                   fp8=Fp8Options(**fp8))


def check_attention(q, k, v, *, out=None, func="cuflash.attention", max_head_dim=validation.MAX_HEAD_DIM, **kw):
    """:func:`cuflash.runtime.validation.check_attention` of public keywords."""
    return validation.check_attention(q, k, v, options(**kw), func=func, out=out, max_head_dim=max_head_dim)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, out=None,
                 func="cuflash.attention_varlen", **kw):
    """:func:`cuflash.runtime.validation.check_attention_varlen` of public arguments."""
    opts = options(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, **kw)
    return validation.check_attention_varlen(q, k, v, opts, func=func, out=out,
                                             cache_check=validation_kvcache.varlen_cache, fp8=True)


def check_kvcache(q, k_cache, v_cache, cache_seqlens, *, out=None, func="cuflash.attention_with_kvcache", **kw):
    """:func:`cuflash.runtime.validation_kvcache.check_attention_with_kvcache` of public arguments."""
    opts = options(cache_seqlens=cache_seqlens, layout="bshd", **kw)
    return validation_kvcache.check_attention_with_kvcache(q, k_cache, v_cache, opts, func=func, out=out)
