"""The SDPA drop-in: :func:`scaled_dot_product_attention`
(``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics on cuflash) is
:func:`plan` (validation and mapping) followed by :func:`cuflash.torch.attention`.

Swapping ``F.scaled_dot_product_attention`` for it changes nothing but the kernel: SDPA's
argument names and order (``scale`` and ``enable_gqa`` keyword-only, as in SDPA), its top-left
``is_causal``, boolean masks where True attends, additive float masks, any leading batch dims
broadcast as SDPA's math backend broadcasts them, GQA only with ``enable_gqa=True``. What SDPA
refuses is refused too, with :class:`SDPAError` (a ``ValueError`` and a ``RuntimeError``) or
:class:`SDPADtypeError` (a ``TypeError`` and a ``RuntimeError``), so code that catches SDPA's
``RuntimeError`` or cuflash's ``ValueError``/``TypeError`` keeps working.

How SDPA's conventions map onto cuflash's (:func:`top_left_causal` is the one place for the
causal alignment):

* ``is_causal`` is top-left in SDPA (query ``i`` sees key ``j`` iff ``j <= i``), bottom-right in
  cuflash (``j <= i + Sk - Sq``). For ``Sq == Sk`` they agree. For ``Sq < Sk`` no query sees a
  key past ``Sq - 1``, so the keys are sliced to the first ``Sq`` (a view; their gradients are
  0, as SDPA's) and the two alignments agree again. For ``Sq > Sk`` top-left is cuflash's window
  ``(-1, Sq - Sk)`` without ``causal``.
* A head dim ``E = 0`` (SDPA gives every key the same weight) runs as ``E = 1`` with zero q/k
  columns appended (``F.pad``, so gradients keep their empty shapes).
* ``dropout_p`` as SDPA: applied whenever it is > 0 (SDPA ignores ``training``; pass 0 to
  evaluate), values <= 0 mean none, 1 drops everything (zeros), above 1 is refused. The mask is
  cuflash's Philox mask (:func:`cuflash.torch.attention`), not torch's.

One documented difference: a query row whose mask leaves it no key gives output 0 (and zero
gradients) in cuflash; SDPA's math backend gives 0 as well (torch >= 2.5), some of its CUDA
backends give NaN.

Not registered through ``torch.nn.attention.register_flash_attention_impl`` (torch >= 2.13 has
it; it is how flash-attn 4 plugs into SDPA). That hook's ``register_fn`` overrides the CUDA
kernels of aten's ``_scaled_dot_product_flash_attention`` / ``_flash_attention_forward`` and
their backwards, which SDPA reaches only for CUDA float16/bfloat16 tensors when its own backend
choice picks flash (no mask, no top-left causal with ``L != S``). An implementation must return
that op's whole tuple (``logsumexp``, ``cum_seq_q/k``, ``philox_seed``/``offset`` that the
backward op receives back, ``debug_attn_mask``) from cuflash's CUDA path, and CPU tensors
never reach those ops, so such a registration can only be tested on a GPU; it is not provided.
This module's drop-in covers every device and case.

Imports: torch, :mod:`cuflash.torch.attention` and :mod:`cuflash.torch.tensors`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from cuflash.torch import tensors
from cuflash.torch.attention import attention

__all__ = ["scaled_dot_product_attention", "plan", "Mapped", "SDPAError", "SDPADtypeError", "top_left_causal"]

_FUNC = "cuflash.torch.scaled_dot_product_attention"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SDPAError(ValueError, RuntimeError):
    """Misuse that ``F.scaled_dot_product_attention`` refuses with a ``RuntimeError``: a
    ``ValueError`` (cuflash's rule for shapes and values) and a ``RuntimeError`` (what SDPA
    raises), so handlers written for either keep working."""


class SDPADtypeError(TypeError, RuntimeError):
    """A dtype that ``F.scaled_dot_product_attention`` refuses with a ``RuntimeError``: a
    ``TypeError`` (cuflash's rule for dtypes) and a ``RuntimeError`` (SDPA's)."""


def top_left_causal(key, value, seqlen_q: int):
    """Top-left causal attention (``j <= i``) as cuflash arguments: ``(key, value, causal,
    window_size)`` for :func:`cuflash.torch.attention`, whose causal mask is bottom-right.

    Parameters
    ----------
    key, value : torch.Tensor ``(..., Sk, E)``, ``(..., Sk, Ev)``
    seqlen_q : int
        ``Sq``.

    Returns
    -------
    (key, value, causal, window_size)
        ``Sq <= Sk``: the first ``Sq`` keys (views) and ``causal=True``, where both alignments
        agree; ``Sq > Sk``: the keys unchanged, ``causal=False``, ``window_size=(-1, Sq - Sk)``.
    """
    seqlen_k = key.shape[-2]
    if seqlen_q <= seqlen_k:
        return key[..., :seqlen_q, :], value[..., :seqlen_q, :], True, (-1, -1)
    return key, value, False, (-1, seqlen_q - seqlen_k)


def _shape_error(what: str) -> SDPAError:
    return SDPAError(f"{_FUNC}: {what}")


def _check_tensors(query, key, value, attn_mask):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNC}: {name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{_FUNC}: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__qualname__}")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise _shape_error(f"query, key and value must be at least 2-D (..., L, E); got query.dim()={query.dim()}, "
                           f"key.dim()={key.dim()}, value.dim()={value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise SDPADtypeError(f"{_FUNC}: query, key and value must have one dtype; got query.dtype={query.dtype}, "
                             f"key.dtype={key.dtype}, value.dtype={value.dtype}")
    if query.dtype not in _DTYPES:
        raise SDPADtypeError(f"{_FUNC}: query.dtype must be one of float16, bfloat16, float32, float64; "
                             f"got {query.dtype}")
    devices = {query.device, key.device, value.device} | ({attn_mask.device} if attn_mask is not None else set())
    if len(devices) != 1:
        raise _shape_error(f"query, key, value and attn_mask must be on one device; got "
                           f"{', '.join(sorted(str(d) for d in devices))}")
    if key.shape[-1] != query.shape[-1]:
        raise _shape_error(f"key.shape[-1]={key.shape[-1]} must equal query.shape[-1]={query.shape[-1]} (E)")
    if value.shape[-2] != key.shape[-2]:
        raise _shape_error(f"value.shape[-2]={value.shape[-2]} must equal key.shape[-2]={key.shape[-2]} (S)")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise SDPADtypeError(f"{_FUNC}: attn_mask.dtype must be bool, float32 or query.dtype={query.dtype}; "
                             f"got {attn_mask.dtype}")


def _broadcast(shapes: dict, what: str, hint: str = "") -> tuple:
    try:
        return tuple(torch.broadcast_shapes(*shapes.values()))
    except RuntimeError:
        listed = ", ".join(f"{n}{tuple(s)}" for n, s in shapes.items())
        raise _shape_error(f"the {what} must broadcast; got {listed}{hint}") from None


def _batch_shapes(query, key, value, enable_gqa: bool):
    """The broadcast batch shape and the (batch, head) shapes key and value expand to.

    Without GQA every leading dim broadcasts (SDPA's math backend broadcasts them, so a key
    with one head serves every query head). With GQA the head axis (-3) is excluded from
    broadcasting: ``Hq`` must be a multiple of key's and value's head counts.
    """
    lead = {"query": query.shape[:-2], "key": key.shape[:-2], "value": value.shape[:-2]}
    if not enable_gqa or query.dim() < 3:
        hint = ""
        if not enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3:
            hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
            if 0 < hk < hq and 0 < hv < hq and hq % hk == 0 and hq % hv == 0:
                hint = " (for grouped-query attention, pass enable_gqa=True)"
        batch = _broadcast(lead, "leading (batch) dims of query, key and value", hint)
        return batch, batch, batch
    if key.dim() < 3 or value.dim() < 3:
        raise _shape_error(f"enable_gqa=True needs a head axis (-3) in key and value; got key.shape="
                           f"{tuple(key.shape)}, value.shape={tuple(value.shape)}")
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk == 0 or hv == 0 or hq % hk or hq % hv:
        raise _shape_error(f"with enable_gqa=True the number of heads of key ({hk}) and value ({hv}) must divide "
                           f"the number of heads of query ({hq})")
    outer = _broadcast({n: s[:-1] for n, s in lead.items()}, "leading (batch) dims of query, key and value")
    return outer + (hq,), outer + (hk,), outer + (hv,)


def _gqa_heads(key, value, hq: int):
    """key and value with one head count for cuflash's GQA: unchanged when they agree, else
    each repeated to ``Hq`` heads (one copy; SDPA allows key and value head counts to differ)."""
    if key.shape[-3] == value.shape[-3]:
        return key, value
    return (key.repeat_interleave(hq // key.shape[-3], dim=-3),
            value.repeat_interleave(hq // value.shape[-3], dim=-3))


def _check_scalars(dropout_p, is_causal, scale, enable_gqa):
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_FUNC}: {name} must be a bool, got {type(flag).__qualname__}")
    if isinstance(dropout_p, torch.Tensor) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{_FUNC}: dropout_p must be a float, got {type(dropout_p).__qualname__}")
    dropout_p = float(dropout_p)
    if dropout_p > 1.0 or math.isnan(dropout_p):
        raise _shape_error(f"dropout_p must be between 0 and 1, got {dropout_p}")
    if scale is not None and (isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float))):
        raise TypeError(f"{_FUNC}: scale must be a float or None, got {type(scale).__qualname__}")
    return max(dropout_p, 0.0), None if scale is None else float(scale)


@dataclasses.dataclass(frozen=True)
class Mapped:
    """An SDPA call's options in :func:`cuflash.torch.attention`'s terms (a bool mask attends where
    True; a float mask is an additive bias)."""

    causal: bool
    softmax_scale: float
    window_size: tuple
    dropout_p: float
    attn_mask: object
    attn_bias: object


def plan(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """Validate an SDPA call and map it onto :func:`cuflash.torch.attention`.

    Parameters are :func:`cuflash.torch.scaled_dot_product_attention`'s (the public function,
    which calls this and then the operator).

    Returns
    -------
    (q, k, v, mapped) : the tensors (broadcast views, keys sliced for top-left causal) and the
        :class:`Mapped` options of :func:`cuflash.torch.attention`; or ``(out, None, None, None)``
        when ``dropout_p >= 1`` (``out`` is already the result: zeros connected to the inputs,
        so backward gives zero gradients, as SDPA's).

    Raises
    ------
    TypeError, SDPADtypeError, SDPAError
        As :func:`cuflash.torch.scaled_dot_product_attention`.
    """
    _check_tensors(query, key, value, attn_mask)
    dropout_p, scale = _check_scalars(dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and is_causal:
        raise _shape_error("attn_mask must be None when is_causal=True (SDPA's rule: the mask would be ambiguous)")
    batch, batch_k, batch_v = _batch_shapes(query, key, value, enable_gqa)
    seqlen_q, seqlen_k, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    out_shape = batch + (seqlen_q, value.shape[-1])
    if attn_mask is not None:
        full = batch + (seqlen_q, seqlen_k)
        if attn_mask.dim() > len(full) or _broadcast({"attn_mask": attn_mask.shape, "scores": full},
                                                    "attn_mask and the scores (..., L, S)") != full:
            raise _shape_error(f"attn_mask.shape={tuple(attn_mask.shape)} must broadcast to the scores' shape "
                               f"{full} (..., L, S)")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else math.inf

    q = query.expand(*batch, seqlen_q, head_dim)
    k = key.expand(*batch_k, seqlen_k, head_dim)
    v = value.expand(*batch_v, seqlen_k, value.shape[-1])
    if enable_gqa and query.dim() >= 3:
        k, v = _gqa_heads(k, v, query.shape[-3])
    if head_dim == 0:  # every score is 0: one zero column gives the same scores (and SDPA's uniform weights)
        q, k, scale = F.pad(q, (0, 1)), F.pad(k, (0, 1)), 1.0
    causal, window = False, (-1, -1)
    if is_causal:
        k, v, causal, window = top_left_causal(k, v, seqlen_q)
    if dropout_p >= 1.0:  # everything dropped: zeros, connected to the inputs so backward gives zero gradients
        return (q.sum() + k.sum() + v.sum()).mul(0).expand(out_shape).contiguous(), None, None, None
    is_bool = attn_mask is not None and attn_mask.dtype == torch.bool
    return q, k, v, Mapped(causal, scale, window, dropout_p, attn_mask if is_bool else None,
                           None if is_bool else attn_mask)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``softmax(query @ key^T * scale + mask) @ value`` with the signature and semantics of
    :func:`torch.nn.functional.scaled_dot_product_attention`, computed by cuflash.

    Differentiable with respect to query, key, value (and a float ``attn_mask`` that requires
    grad) through :func:`cuflash.torch.attention`'s custom operators, so it traces under
    ``torch.compile``. CPU tensors run cuflash's NumPy path, CUDA tensors its kernels.

    Parameters
    ----------
    query : torch.Tensor ``(..., L, E)``
    key : torch.Tensor ``(..., S, E)``
    value : torch.Tensor ``(..., S, Ev)``
        One dtype (float16, bfloat16, float32, float64) and device; rank >= 2. The leading dims
        broadcast against each other as in SDPA (e.g. key ``(1, H, S, E)`` serves a batch of
        queries; broadcast operands are stride-0 views, never copies). With ``enable_gqa=True``
        axis -3 is the head axis and is not broadcast: its size in key and value must divide
        query's (query head ``h`` reads key head ``h // (Hq // Hk)``).
    attn_mask : torch.Tensor, optional
        Broadcastable to ``(..., L, S)`` of the output's leading dims. bool: True = attend (a
        row left with no key gives 0). Float (float32 or query's dtype): added to the scaled
        scores (``-inf`` removes a key).
    dropout_p : float
        Probability of dropping an attention weight, applied whenever > 0 (SDPA ignores the
        module's training flag too); <= 0 means none, 1 gives zeros, > 1 is refused. The mask
        comes from cuflash's Philox generator, seeded from torch's default generator.
    is_causal : bool
        Top-left causal mask (query ``i`` sees key ``j`` iff ``j <= i``), SDPA's convention;
        cuflash's own ``causal`` is bottom-right (see the module docstring for the mapping).
        Not together with ``attn_mask``.
    scale : float, optional
        Keyword-only. None means ``1 / sqrt(E)``.
    enable_gqa : bool
        Keyword-only. Allow key/value with fewer heads than query (GQA/MQA) without repeating
        them.

    Returns
    -------
    torch.Tensor ``(..., L, Ev)``
        query's dtype and device; the leading dims are the broadcast of the inputs'.

    Raises
    ------
    TypeError
        A non-tensor input, a non-bool ``is_causal``/``enable_gqa``, a non-float ``dropout_p``
        or ``scale`` (as SDPA).
    SDPADtypeError
        (``TypeError`` and ``RuntimeError``) Mixed or unsupported dtypes of query/key/value, an
        ``attn_mask`` that is neither bool, float32 nor query's dtype.
    SDPAError
        (``ValueError`` and ``RuntimeError``) Rank < 2, mismatched ``E`` or ``S``, batch dims or
        a mask that do not broadcast, GQA head counts that do not divide, ``attn_mask`` with
        ``is_causal``, ``dropout_p > 1``, tensors on different devices.
    ValueError
        A meta tensor (naming the argument and its device).
    NotImplementedError
        Tensors on a device cuflash has no path for (as :func:`cuflash.torch.attention`).

    Examples
    --------
    >>> import torch
    >>> from cuflash.torch import scaled_dot_product_attention as sdpa
    >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
    >>> sdpa(q, k, v, is_causal=True).shape
    torch.Size([2, 8, 128, 64])
    """
    tensors.check_devices(_FUNC, {"query": query, "key": key, "value": value, "attn_mask": attn_mask})
    q, k, v, m = plan(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if m is None:
        return q  # dropout_p >= 1: the zeros plan() made
    return attention(q, k, v, causal=m.causal, softmax_scale=m.softmax_scale, window_size=m.window_size,
                     dropout_p=m.dropout_p, attn_mask=m.attn_mask, attn_bias=m.attn_bias)
