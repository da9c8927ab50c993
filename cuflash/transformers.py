"""Hugging Face transformers: ``attn_implementation="cuflash"`` after :func:`register`.

Importing :mod:`cuflash` never imports transformers; :func:`register` does, when called
(transformers >= 5 with torch). It registers :func:`attention_forward` in transformers'
``AttentionInterface`` and transformers' own ``sdpa_mask`` in its ``AttentionMaskInterface``
under the same name, so every model whose attention goes through the interface (Llama, Qwen,
Mistral, Gemma, ... the functional ``ALL_ATTENTION_FUNCTIONS.get_interface`` design) runs
cuflash::

    import cuflash.transformers
    cuflash.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cuflash")

Why a mask function too
    transformers builds its mask with the function registered under the model's
    ``attn_implementation`` and, for a name with none, builds no mask at all: padding would be
    silently ignored. ``sdpa_mask`` gives a 4-D boolean mask (True = attend) that already holds
    causality, padding, sliding windows and packed sequences, or ``None`` when there is no
    padding and ``Sq == Sk`` or ``Sq == 1`` (then ``is_causal`` decides, as for SDPA).

Why register() also touches the flash-attention preload (transformers 5.x)
    transformers treats every ``attn_implementation`` whose name contains ``"flash"``
    (``is_flash_attention_requested`` is a substring test) as a flash-attention kernel to load:
    ``PreTrainedModel._check_and_adjust_attn_implementation`` (run by ``from_pretrained``, the
    model's ``__init__`` and ``set_attn_implementation``) calls
    ``transformers.modeling_utils.lazy_import_flash_attention(name)``, which only knows the
    ``flash_attn`` packages and Hub kernels (``"org/repo"``, through the ``kernels`` package), so
    a plain registration of ``"cuflash"`` fails with "Could not find the currently requested
    flash attention implementation at `cuflash`". transformers offers no hook to say a
    registered name is not a flash-attn kernel, so :func:`register` wraps that one binding
    (``transformers.modeling_utils.lazy_import_flash_attention``): for the names registered here
    it returns without loading anything (cuflash compiles its kernels itself, on first use),
    every other name goes to transformers' function unchanged. A name without ``"flash"``
    (``register("cuattn")``, say) needs no such step and gets none.
    The name's ``"flash"`` has one more effect: code that branches on
    ``is_flash_attention_requested`` hands "flash" implementations packed sequences as
    ``cu_seq_lens_q``/``cu_seq_lens_k`` with no mask (e.g. Qwen-VL vision towers);
    :func:`attention_forward` runs those through :func:`cuflash.torch.attention_varlen`, and
    refuses paged caches (``block_table``, continuous batching) with ``NotImplementedError``.

Devices: CPU tensors run cuflash's NumPy path, CUDA tensors its kernels
(:func:`cuflash.torch.attention`).

Imports: torch and transformers (lazily, in :func:`register`); :mod:`cuflash.torch`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["register", "attention_forward", "NAME"]

#: The ``attn_implementation`` name :func:`register` uses by default.
NAME = "cuflash"

_FUNC = "cuflash.transformers.attention_forward"
_PRELOAD_EXEMPT: set = set()  # registered names the flash-attention preload must not try to load


def register(name: str = NAME) -> str:
    """Register cuflash in transformers under ``name`` (idempotent); return ``name``.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and
    ``transformers.masking_utils.sdpa_mask`` in ``transformers.AttentionMaskInterface``, so
    ``from_pretrained(..., attn_implementation=name)`` and ``model.set_attn_implementation(name)``
    select cuflash, padding included. For a name containing ``"flash"`` it also exempts that
    name from transformers' flash-attention preload (see the module docstring for why and how).

    Parameters
    ----------
    name : str
        The ``attn_implementation`` value; default ``"cuflash"``.

    Returns
    -------
    str
        ``name``.

    Raises
    ------
    ImportError
        transformers (>= 5) is not installed.
    ValueError
        ``name`` is empty, contains ``"/"`` or ``":"`` (transformers reads those as Hub
        kernels), or is one of transformers' own implementations.
    """
    if not isinstance(name, str) or not name or "/" in name or ":" in name or "|" in name:
        raise ValueError(f"cuflash.transformers.register: name must be a non-empty string without '/', ':' or '|' "
                         f"(transformers reads those as Hub kernels or prefixes), got {name!r}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as exc:
        raise ImportError(f"cuflash.transformers.register needs transformers >= 5 ({exc}); "
                          "install it with: pip install 'transformers>=5'") from exc
    own = AttentionInterface._global_mapping.get(name)
    if own is not None and own is not attention_forward:
        raise ValueError(f"cuflash.transformers.register: name={name!r} is already registered in transformers' "
                         f"AttentionInterface (as {getattr(own, '__qualname__', own)!r}); choose another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    if "flash" in name:
        _exempt_from_flash_preload(name)
    return name


def _exempt_from_flash_preload(name: str) -> None:
    """Make transformers' flash-attention preload skip ``name`` (idempotent; see the module
    docstring): wrap ``transformers.modeling_utils.lazy_import_flash_attention`` once."""
    import transformers.modeling_utils as modeling_utils

    _PRELOAD_EXEMPT.add(name)
    current = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if current is None or getattr(current, "_cuflash_exempt", None) is _PRELOAD_EXEMPT:
        return  # this transformers has no preload to skip, or the wrapper is in place

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _PRELOAD_EXEMPT:
            return None  # a cuflash registration: nothing to preload (the only caller ignores the result)
        return current(implementation, *args, **kwargs)

    lazy_import_flash_attention._cuflash_exempt = _PRELOAD_EXEMPT
    lazy_import_flash_attention.__wrapped__ = current
    lazy_import_flash_attention.__doc__ = current.__doc__
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def _refuse(argument: str, value, why: str):
    raise NotImplementedError(f"{_FUNC}: {argument}={value!r} is not supported: {why}")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function convention, computed by :func:`cuflash.torch.attention`.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` is read when ``is_causal`` is None).
    query : torch.Tensor ``(B, Hq, Sq, D)``
    key, value : torch.Tensor ``(B, Hk, Sk, D)``, ``(B, Hk, Sk, Dv)``
        GQA heads not repeated (``Hq % Hk == 0``; cuflash reads shared heads itself, no
        ``repeat_kv``).
    attention_mask : torch.Tensor or None
        A 4-D mask broadcastable to ``(B, Hq, Sq, Sk)``: boolean (True = attend; what the
        registered ``sdpa_mask`` gives, holding causality, padding, windows and packing) or
        additive float (``eager_mask``'s, or a user's). With a mask, causality is the mask's.
        None: no padding, and ``is_causal`` decides.
    dropout : float
        Attention dropout probability (transformers passes 0 in eval mode).
    scaling : float, optional
        Softmax scale; None means ``1/sqrt(D)``.
    sliding_window : int, optional
        Keep keys with ``kv_idx > q_idx - W`` (transformers' convention, positions counted from
        the sequence start, so the diagonal is bottom-right as cuflash's): cuflash's
        ``window_size=(W - 1, W - 1)``, the right bound cut to 0 by causality.
    softcap : float, optional
        Gemma-2 style logit soft-capping, ``softcap * tanh(scores / softcap)``; None/0 = off.
    is_causal : bool, optional
        Used when ``attention_mask`` is None (default: ``module.is_causal``, else True): causal
        with SDPA's top-left alignment for ``Sq > 1`` (transformers passes no mask only when
        ``Sq == Sk``, or an empty static cache holds ``Sk > Sq`` slots), none for ``Sq == 1``.
    **kwargs
        ``s_aux`` (per-head attention sinks, gpt-oss) maps to cuflash's ``sinks``;
        ``position_bias`` (additive, per layer) to ``attn_bias``; ``cu_seq_lens_q``,
        ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` (packed sequences in a batch of
        one) to :func:`cuflash.torch.attention_varlen`. ``output_attentions`` is ignored (no
        weights are returned); other keyword arguments (positions, the cache object) do not
        change attention and are ignored.

    Returns
    -------
    (out, None)
        ``out`` ``(B, Sq, Hq, Dv)`` contiguous, query's dtype; no attention weights.

    Raises
    ------
    NotImplementedError
        Naming the argument: paged caches (``block_table``, ``k_cache``, ``v_cache``), a mask
        that is not 4-D, packed sequences together with a mask or modifiers, a sliding window
        with ``Sq > Sk`` and no mask.
    TypeError, ValueError
        As :func:`cuflash.torch.attention`.
    """
    import torch

    from cuflash import torch as cuflash_torch
    from cuflash.torch_sdpa import top_left_causal

    for argument in ("block_table", "k_cache", "v_cache"):
        if kwargs.get(argument) is not None:
            _refuse(argument, "<tensor>", "paged key/value caches (continuous batching) have no cuflash path here; "
                    "use attn_implementation='sdpa' for continuous batching")
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    m = _Mapped(softmax_scale=scaling, dropout_p=float(dropout or 0.0), softcap=float(softcap or 0.0),
                sinks=None if kwargs.get("s_aux") is None else kwargs["s_aux"].to(torch.float32))
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        if attention_mask is not None:
            _refuse("attention_mask", "<tensor>", "packed sequences (cu_seq_lens_q) take no mask")
        return _packed(cuflash_torch, module, (query, key, value), m, (sliding_window, is_causal), kwargs)
    bias = kwargs.get("position_bias")

    causal, window, mask = False, (-1, -1), None
    if attention_mask is None:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if is_causal and seqlen_q > 1:
            key, value, causal, window = top_left_causal(key, value, seqlen_q)
            if sliding_window is not None and not causal:
                _refuse("sliding_window", sliding_window, f"with no attention_mask and Sq={seqlen_q} > Sk={seqlen_k}")
    elif attention_mask.dim() != 4:
        _refuse("attention_mask", f"<{attention_mask.dim()}-D tensor {tuple(attention_mask.shape)}>",
                "expected the 4-D mask of the registered mask function (sdpa_mask), broadcastable to (B, H, Sq, Sk)")
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:
        bias = attention_mask if bias is None else bias + attention_mask
    if sliding_window is not None:
        window = (int(sliding_window) - 1, int(sliding_window) - 1 if window[1] < 0 else window[1])
    out = cuflash_torch.attention(query, key, value, causal=causal, window_size=window, softmax_scale=m.softmax_scale,
                                  dropout_p=m.dropout_p, softcap=m.softcap, sinks=m.sinks, attn_bias=bias,
                                  attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """The options a transformers attention call maps onto cuflash's (besides masks and windows)."""

    softmax_scale: float | None
    dropout_p: float
    softcap: float
    sinks: object


def _packed(cuflash_torch, module, qkv, m: _Mapped, window_causal, kwargs):
    """Packed sequences (``cu_seq_lens_q``/``_k`` in a batch of one) through
    :func:`cuflash.torch.attention_varlen`, causal per sequence (bottom-right, flash-attn's).
    ``window_causal`` is ``(sliding_window, is_causal)``; ``kwargs`` are transformers' own."""
    import torch

    query, key, value = qkv
    sliding_window, is_causal = window_causal
    for name, on in (("softcap", m.softcap), ("sinks", m.sinks is not None),
                     ("attn_bias", kwargs.get("position_bias") is not None)):
        if on:
            _refuse(name, "<set>", "packed sequences (cu_seq_lens_q) run attention_varlen, which takes no " + name)
    if query.shape[0] != 1:
        raise ValueError(f"{_FUNC}: packed sequences (cu_seq_lens_q) need a batch of one, got query.shape="
                         f"{tuple(query.shape)}")
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q = kwargs.get("max_length_q")
    max_k = kwargs.get("max_length_k")
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (total, H, D)
    out = cuflash_torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                         softmax_scale=m.softmax_scale, dropout_p=m.dropout_p)
    return out.unsqueeze(0).contiguous(), None
