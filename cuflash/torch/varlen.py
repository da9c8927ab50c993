"""The packed variable-length operators of :mod:`cuflash.torch` and :func:`attention_varlen`.

* ``cuflash::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False, dropout_p=0.0,
  dropout_seed=0, dropout_offset=0) -> (out, lse)``
* ``cuflash::attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
  max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False,
  dropout_p=0.0, dropout_seed=0, dropout_offset=0) -> (dq, dk, dv)``

Each runs :func:`cuflash.attention_varlen`'s (or its backward's) pipeline on its tensors.

Imports: torch, :mod:`cuflash.api` and below.
"""

import torch

from cuflash.api import varlen as api_varlen
from cuflash.runtime import validation
from cuflash.runtime.options import DropoutOptions, Options, PackedOptions
from cuflash.torch import tensors
from cuflash.torch.tensors import detached, lse_dtype, prepare

__all__ = ["attention_varlen", "attention_varlen_fwd", "attention_varlen_bwd"]

_FUNC = "cuflash.torch.attention_varlen"


def _options(index, sizes, causal, softmax_scale, window, dropout, deterministic=False) -> Options:
    """``index`` ``(cu_seqlens_q, cu_seqlens_k, seqused_k)`` tensors, ``sizes`` ``(max_seqlen_q,
    max_seqlen_k)``, ``window`` ``(left, right)``, ``dropout`` ``(p, seed, offset)``."""
    cu_q, cu_k, used = (detached(t) for t in index)
    return Options(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window), return_lse=True,
                   deterministic=deterministic, dropout=DropoutOptions(*dropout),
                   packed=PackedOptions(cu_q, cu_k, sizes[0], sizes[1], used))


@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward: ``(out (total_q, Hq, Dv), lse (Hq, total_q))``; ``deterministic`` is the
    backward's (saved for it)."""
    options = _options((cu_seqlens_q, cu_seqlens_k, seqused_k), (max_seqlen_q, max_seqlen_k), causal, softmax_scale,
                       (window_left, window_right), (dropout_p, dropout_seed, dropout_offset))
    return tensors.run(api_varlen.FORWARD, (prepare(q), prepare(k), prepare(v), None), options, _FUNC, q)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_left, window_right, deterministic=False, dropout_p=0.0,
                               dropout_seed=0, dropout_offset=0):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]),
                                                                           dtype=lse_dtype(q.dtype))


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
    deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed backward: ``(dq, dk, dv)`` in q's, k's and v's shapes (keys past seqused_k: 0)."""
    options = _options((cu_seqlens_q, cu_seqlens_k, seqused_k), (max_seqlen_q, max_seqlen_k), causal, softmax_scale,
                       (window_left, window_right), (dropout_p, dropout_seed, dropout_offset), deterministic)
    operands = (*(prepare(t) for t in (dout, q, k, v, out)), lse.detach())
    return tensors.run(api_varlen.BACKWARD, operands, options, _FUNC + " (backward)", q)


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                               max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False,
                               dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used, *ctx.options)
    return (dq, dk, dv) + (None,) * 13


attention_varlen_fwd.register_autograd(_grads, setup_context=_setup_context)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), seqused_k=None, deterministic=False, dropout_p=0.0):
    """Differentiable attention over a packed batch of variable-length sequences.

    The conventions of :func:`cuflash.attention_varlen` (flash-attn's ``flash_attn_varlen_func``
    with FA3's ``seqused_k``); gradients with respect to q, k and v from
    :func:`cuflash.attention_varlen_backward`. Works under ``torch.compile`` (``fullgraph=True``)
    through the custom operators ``cuflash::attention_varlen_fwd`` / ``_bwd``.

    Parameters
    ----------
    q : torch.Tensor ``(total_q, Hq, D)``
    k, v : torch.Tensor ``(total_k, Hk, D)``, ``(total_k, Hk, Dv)``
        One dtype and device (CPU: the NumPy implementation; CUDA: the kernels, torch's current
        stream).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, int32 ``(B + 1,)``
        On the tensors' device (CPU indices are checked in full; CUDA ones for dtype and shape).
    max_seqlen_q, max_seqlen_k : int
    causal, softmax_scale, window_size
        As :func:`cuflash.torch.attention`, per sequence (bottom-right causal alignment).
    seqused_k : torch.Tensor, int32 ``(B,)``, optional
    deterministic : bool
        The backward's, on CUDA tensors (CPU is always deterministic).
    dropout_p : float
        As :func:`attention` (seed and offset from torch's default generator).

    Returns
    -------
    torch.Tensor ``(total_q, Hq, Dv)``, differentiable with respect to q, k, v.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention_varlen` (raised when the operator runs).
    """
    tensors.check_tensors(_FUNC, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
                          {"seqused_k": seqused_k})
    causal = validation.check_flag(causal, "causal", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    max_q = validation.check_int(max_seqlen_q, "max_seqlen_q", _FUNC)
    max_k = validation.check_int(max_seqlen_k, "max_seqlen_k", _FUNC)
    left, right = validation.normalize_window(*validation.check_window_size(window_size, False, _FUNC),
                                              max(max_q, 0), max(max_k, 0))
    scale = tensors.scale_of(softmax_scale, q.shape[-1] if q.dim() else 0, _FUNC)
    seed, offset = tensors.dropout_key(dropout_p, _FUNC)
    out, _ = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q, max_k, causal, scale, left,
                                  right, deterministic, float(dropout_p), seed, offset)
    return out
