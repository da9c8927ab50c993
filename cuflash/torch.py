"""PyTorch autograd for cuflash attention: :func:`attention`, differentiable and torch.compile-able.

Importing :mod:`cuflash` never imports torch; importing ``cuflash.torch`` does (torch >= 2.4).
It registers two custom operators with :func:`torch.library.custom_op`:

* ``cuflash::attention_fwd(q, k, v, causal, softmax_scale, window_left, window_right, layout,
  deterministic=False) -> (out, lse)`` (``deterministic`` only travels to the backward)
* ``cuflash::attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, window_left,
  window_right, layout, deterministic=False) -> (dq, dk, dv)``
* ``cuflash::attention_mod_fwd`` / ``cuflash::attention_mod_bwd``: the same with the score
  modifiers (``softcap, alibi_slopes, attn_bias, attn_mask, sinks``; the backward also returns
  ``dbias`` and ``dsinks``), used only when a modifier is given

for packed variable-length batches (:func:`attention_varlen`),

* ``cuflash::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False) -> (out, lse)``
* ``cuflash::attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
  max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False)
  -> (dq, dk, dv)``

and, for serving, ``cuflash::attention_with_kvcache`` (:func:`attention_with_kvcache`; it mutates
its ``k_cache`` and ``v_cache`` arguments, no backward); :func:`merge_attention` is plain torch
operations (differentiable). Context parallelism over ``torch.distributed`` (:func:`ring_attention`,
:func:`ulysses_attention`, :func:`zigzag_split`, :func:`zigzag_merge`) lives in
:mod:`cuflash.context_parallel` and is exported here, and so is :func:`scaled_dot_product_attention`
(:mod:`cuflash.torch_sdpa`: ``F.scaled_dot_product_attention``'s signature and semantics).

Each operator has a ``register_fake`` implementation (shapes and dtypes only), so ``torch.compile``
traces through them without graph breaks (``fullgraph=True`` works), and the forward with
``register_autograd`` (the context saves q, k, v, out and lse; the backward is the
FlashAttention-2 backward, :func:`cuflash.attention_backward`).

Devices: CPU tensors (float16, bfloat16, float32, float64) run the NumPy implementation on
zero-copy NumPy views of the tensors (bfloat16 through an int16 view, since NumPy has no
native bfloat16) and return tensors wrapping the NumPy results. CUDA tensors run the forward
and the backward on the CUDA kernels (:func:`_forward_cuda`, :func:`_backward_cuda`: torch's
current stream, zero-copy DLPack views, outputs from ``torch.empty``).

A tensor whose last axis is not unit-stride (e.g. the stride-0 gradient ``out.sum()``
produces) is copied once with ``.contiguous()``; other strides are used as they are.
"""

import math

import numpy as np
import torch

from cuflash import torch_sdpa
from cuflash.context_parallel import (
    merge_attention,
    ring_attention,
    ulysses_attention,
    zigzag_merge,
    zigzag_split,
)
from cuflash.reference import backward as ref_backward
from cuflash.reference import forward as ref_forward
from cuflash.runtime import interop, validation
from cuflash.torch_sdpa import SDPADtypeError, SDPAError

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "merge_attention", "ring_attention",
           "ulysses_attention", "zigzag_split", "zigzag_merge", "scaled_dot_product_attention", "SDPAError",
           "SDPADtypeError"]

_FUNC = "cuflash.torch.attention"


# --------------------------------------------------------------------------------------------
# torch <-> numpy on the CPU (zero-copy where the dtype allows)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()  # the one documented copy: the NumPy path needs a unit last-axis stride
    return interop.torch_to_numpy(t)


_from_numpy = interop.numpy_to_torch


# --------------------------------------------------------------------------------------------
# per-device implementations


def _forward_cpu(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic=False,
                 dropout=(0.0, 0, 0)):
    qa, ka, va = _to_numpy(q), _to_numpy(k), _to_numpy(v)
    problem = validation.check_attention(
        qa, ka, va, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        layout=layout, return_lse=True, func=_FUNC, max_head_dim=validation.MAX_HEAD_DIM,
        dropout_p=dropout[0], dropout_seed=dropout[1], dropout_offset=dropout[2],
    )
    out, lse = ref_forward._flash_forward(problem, qa, ka, va, None, None, None, True)
    return _from_numpy(out), _from_numpy(lse)


def _backward_cpu(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                  deterministic=False, dropout=(0.0, 0, 0)):  # the NumPy path is always deterministic
    arrays = [_to_numpy(t) for t in (dout, q, k, v, out, lse)]
    problem = ref_backward.check_backward(
        *arrays, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        layout=layout, func=_FUNC + " (backward)", max_head_dim=validation.MAX_HEAD_DIM,
        dropout_p=dropout[0], dropout_seed=dropout[1], dropout_offset=dropout[2],
    )
    dq, dk, dv = ref_backward._flash_backward(problem, *arrays, None, None)
    return _from_numpy(dq), _from_numpy(dk), _from_numpy(dv)


def _forward_cuda(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic=False,
                  dropout=(0.0, 0, 0)):
    """CUDA tensors: :func:`cuflash.attention` on torch's current stream, zero-copy through
    DLPack, outputs allocated with ``torch.empty`` (see :class:`cuflash.runtime.interop.CudaCall`)."""
    import cuflash

    if q.device.type != "cuda":  # only reached through _pick for CUDA tensors; meta etc. stop here
        raise NotImplementedError(
            f"{_FUNC}: CUDA tensors run the CUDA kernels; q is on {q.device}, and tensors there have no kernel"
        )

    def prepare(t):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            t = t.contiguous()  # the one documented copy (e.g. a stride-0 gradient)
        return t.detach()

    out, lse = cuflash.attention(
        prepare(q), prepare(k), prepare(v), causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), layout=layout, return_lse=True, backend="cuda",
        dropout_p=dropout[0], dropout_seed=dropout[1], dropout_offset=dropout[2],
    )
    return out, lse


def _backward_cuda(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                   deterministic=False, dropout=(0.0, 0, 0)):
    """CUDA tensors: :func:`cuflash.attention_backward` (the dispatcher's backward tier: the
    tensor-core kernel where it applies, else the SIMT one) on torch's current stream,
    zero-copy, gradients allocated with ``torch.empty``."""
    import cuflash

    if q.device.type != "cuda":
        raise NotImplementedError(
            f"{_FUNC} (backward): CUDA tensors run the CUDA kernels; q is on {q.device}, and tensors there have no kernel"
        )

    def prepare(t):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            t = t.contiguous()  # the one documented copy (e.g. a stride-0 gradient)
        return t.detach()

    return cuflash.attention_backward(
        prepare(dout), prepare(q), prepare(k), prepare(v), prepare(out), lse.detach(), causal=causal,
        softmax_scale=softmax_scale, window_size=(window_left, window_right), layout=layout, backend="cuda",
        deterministic=deterministic, dropout_p=dropout[0], dropout_seed=dropout[1], dropout_offset=dropout[2],
    )


_FORWARD = {"cpu": _forward_cpu, "cuda": _forward_cuda}
_BACKWARD = {"cpu": _backward_cpu, "cuda": _backward_cuda}


def _pick(table: dict, device: torch.device, what: str):
    try:
        return table[device.type]
    except KeyError:
        raise NotImplementedError(
            f"{_FUNC}: tensors on device {device} are not supported ({what}); expected CPU or CUDA tensors"
        ) from None


# --------------------------------------------------------------------------------------------
# the custom operators


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, layout: str, deterministic: bool = False, dropout_p: float = 0.0,
    dropout_seed: int = 0, dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)``; ``lse`` is float32 (float64 for float64 input). ``deterministic``
    is the backward's (saved for it); the dropout arguments are :func:`cuflash.attention`'s."""
    impl = _pick(_FORWARD, q.device, "forward")
    return impl(q, k, v, causal, softmax_scale, window_left, window_right, layout,
                dropout=(dropout_p, dropout_seed, dropout_offset))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic=False,
                        dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if layout == "bshd":
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = tuple(q.shape[:-1])
    return out, q.new_empty(lse_shape, dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int, layout: str,
    deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)`` in the dtypes and shapes of q, k and v (FlashAttention-2, Alg. 2)."""
    impl = _pick(_BACKWARD, q.device, "backward")
    return impl(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout, deterministic,
                dropout=(dropout_p, dropout_seed, dropout_offset))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                        deterministic=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    ), torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, layout, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    rest = list(rest) + [False, 0.0, 0, 0][len(rest):]   # deterministic, dropout_p, dropout_seed, dropout_offset
    ctx.options = (causal, softmax_scale, window_left, window_right, layout, bool(rest[0]), *rest[1:])
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# public function


# --------------------------------------------------------------------------------------------
# the score modifiers' operators (used only when a modifier is given: the plain call is unchanged)


def _mod_numpy(softcap, alibi_slopes, attn_bias, attn_mask, sinks) -> dict:
    # any strides (stride-0 expanded biases stay views: no copy, unlike q, k, v's last axis)
    conv = {name: None if t is None else interop.torch_to_numpy(t.detach()) for name, t in
            (("alibi_slopes", alibi_slopes), ("attn_bias", attn_bias), ("attn_mask", attn_mask), ("sinks", sinks))}
    return dict(conv, softcap=softcap)


@torch.library.custom_op("cuflash::attention_mod_fwd", mutates_args=())
def attention_mod_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, layout: str, deterministic: bool, dropout_p: float,
    dropout_seed: int, dropout_offset: int, softcap: float, alibi_slopes: torch.Tensor | None,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with score modifiers: ``(out, lse)`` (:func:`cuflash.attention`'s arguments)."""
    import cuflash

    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right), layout=layout,
              return_lse=True, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    if q.device.type == "cpu":
        qa, ka, va = _to_numpy(q), _to_numpy(k), _to_numpy(v)
        out, lse = cuflash.attention(qa, ka, va, backend="numpy", **kw,
                                     **_mod_numpy(softcap, alibi_slopes, attn_bias, attn_mask, sinks))
        return _from_numpy(out), _from_numpy(lse)
    _pick(_FORWARD, q.device, "forward")
    det = [None if t is None else t.detach() for t in (q, k, v, alibi_slopes, attn_bias, attn_mask, sinks)]
    return cuflash.attention(*det[:3], backend="cuda", **kw, softcap=softcap, alibi_slopes=det[3], attn_bias=det[4],
                             attn_mask=det[5], sinks=det[6])


@attention_mod_fwd.register_fake
def _attention_mod_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic,
                            dropout_p, dropout_seed, dropout_offset, softcap, alibi_slopes, attn_bias, attn_mask, sinks):
    return _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout)


@torch.library.custom_op("cuflash::attention_mod_bwd", mutates_args=())
def attention_mod_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int, layout: str,
    deterministic: bool, dropout_p: float, dropout_seed: int, dropout_offset: int, softcap: float,
    alibi_slopes: torch.Tensor | None, attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None,
    sinks: torch.Tensor | None, return_dbias: bool, return_dsinks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward with score modifiers: ``(dq, dk, dv, dbias, dsinks)``; ``dbias``/``dsinks`` are
    empty ``(0,)`` tensors when not asked for."""
    import cuflash

    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right), layout=layout,
              deterministic=deterministic, dropout_p=dropout_p, dropout_seed=dropout_seed,
              dropout_offset=dropout_offset, return_dbias=return_dbias, return_dsinks=return_dsinks)
    if q.device.type == "cpu":
        arrays = [_to_numpy(t) for t in (dout, q, k, v, out, lse)]
        grads = cuflash.attention_backward(*arrays, backend="numpy", **kw,
                                           **_mod_numpy(softcap, alibi_slopes, attn_bias, attn_mask, sinks))
        grads = [_from_numpy(g) for g in grads]
    else:
        _pick(_BACKWARD, q.device, "backward")
        det = [None if t is None else t.detach() for t in (dout, q, k, v, out, lse, alibi_slopes, attn_bias,
                                                             attn_mask, sinks)]
        if det[0].dim() and det[0].shape[-1] > 1 and det[0].stride(-1) != 1:
            det[0] = det[0].contiguous()
        grads = list(cuflash.attention_backward(*det[:6], backend="cuda", **kw, softcap=softcap, alibi_slopes=det[6],
                                                attn_bias=det[7], attn_mask=det[8], sinks=det[9]))
    dq, dk, dv = grads[:3]
    rest = grads[3:]
    dbias = rest.pop(0) if return_dbias else q.new_empty((0,))
    dsinks = rest.pop(0) if return_dsinks else q.new_empty((0,))
    return dq, dk, dv, dbias, dsinks


@attention_mod_bwd.register_fake
def _attention_mod_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                            deterministic, dropout_p, dropout_seed, dropout_offset, softcap, alibi_slopes, attn_bias,
                            attn_mask, sinks, return_dbias, return_dsinks):
    dq, dk, dv = _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout)
    dbias = torch.empty_like(attn_bias, memory_format=torch.contiguous_format) if return_dbias else q.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape, dtype=_lse_dtype(q.dtype)) if return_dsinks else q.new_empty((0,))
    return dq, dk, dv, dbias, dsinks


_MOD_BIAS, _MOD_SINKS = 14, 16   # input positions of attn_bias and sinks in attention_mod_fwd


def _mod_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    alibi, bias, mask, sinks = inputs[13:17]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi, bias, mask, sinks)
    ctx.options = tuple(inputs[3:13])
    ctx.mark_non_differentiable(lse)


def _mod_backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi, bias, mask, sinks = ctx.saved_tensors
    want_bias = bias is not None and ctx.needs_input_grad[_MOD_BIAS]
    want_sinks = sinks is not None and ctx.needs_input_grad[_MOD_SINKS]
    dq, dk, dv, dbias, dsinks = attention_mod_bwd(dout, q, k, v, out, lse, *ctx.options, alibi, bias, mask, sinks,
                                                  want_bias, want_sinks)
    grads = [dq, dk, dv] + [None] * 14
    if want_bias:
        grads[_MOD_BIAS] = dbias.to(bias.dtype)
    if want_sinks:
        grads[_MOD_SINKS] = dsinks.to(sinks.dtype)
    return tuple(grads)


attention_mod_fwd.register_autograd(_mod_backward, setup_context=_mod_setup_context)


# --------------------------------------------------------------------------------------------
# public function


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
              deterministic=False, dropout_p=0.0, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None,
              sinks=None):
    """Differentiable exact attention, ``softmax(softmax_scale * q k^T + mask) v``, for torch tensors.

    The conventions of :func:`cuflash.attention` (GQA/MQA, ``window_size``, layouts, empty rows
    -> 0); gradients come from the FlashAttention-2 backward (:func:`cuflash.attention_backward`)
    with ``P`` recomputed from the saved log-sum-exp. Works under ``torch.compile``
    (``fullgraph=True``) through the custom operators ``cuflash::attention_fwd`` and
    ``cuflash::attention_bwd``.

    Parameters
    ----------
    q : torch.Tensor, shape ``(..., Sq, D)`` ("bhsd") or ``(B, Sq, Hq, D)`` ("bshd")
    k : torch.Tensor, shape ``(..., Sk, D)`` or ``(B, Sk, Hk, D)``
    v : torch.Tensor, shape ``(..., Sk, Dv)`` or ``(B, Sk, Hk, Dv)``
        One dtype (float16, bfloat16, float32, float64) and one device. CPU tensors run the NumPy
        implementation; CUDA tensors (float16, bfloat16, float32) the CUDA forward and backward
        kernels on torch's current stream.
    causal : bool
        Causal mask aligned bottom-right (flash-attn >= 2.1): query ``i`` sees key ``j`` iff
        ``j <= i + Sk - Sq``. PyTorch SDPA's ``is_causal`` is top-left; they agree when ``Sq == Sk``.
    softmax_scale : float, optional
        None means ``1/sqrt(D)``; ``0.0`` is valid.
    window_size : (int, int)
        ``(left, right)`` local-attention bounds, -1 = unbounded; ``causal=True`` sets ``right = 0``.
    layout : {"bhsd", "bshd"}
    deterministic : bool
        The backward's: bit-identical gradients run to run on CUDA tensors (no atomics in the dQ
        sum; a float32 workspace of up to 16 copies of dq and a slower backward, see
        :func:`cuflash.attention_backward`). CPU tensors are always deterministic.
    dropout_p : float
        Attention dropout in ``[0, 1)`` (applied whenever it is > 0, as ``F.dropout(training=True)``;
        pass 0 to evaluate). The mask's seed and offset are drawn from torch's default CPU generator
        (``torch.randint``, no device synchronization), so ``torch.manual_seed`` reproduces a run;
        the backward regenerates the same mask (:func:`cuflash.reference.dropout_mask` shows it).
        Drawing them is a graph break under ``torch.compile``.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks
        The score modifiers of :func:`cuflash.attention` (softcap as in Gemma 2, ALiBi slopes
        ``(Hq,)``/``(B, Hq)`` float32, an additive ``attn_bias`` broadcastable to ``(B, Hq, Sq,
        Sk)``, a bool ``attn_mask`` (True = attend), float32 ``sinks`` ``(Hq,)``), as tensors of
        q's device. ``attn_bias`` and ``sinks`` are differentiable: their gradients come from
        the backward when they require grad (``d attn_bias`` summed over the axes it broadcasts
        over). These calls go through the operators ``cuflash::attention_mod_fwd`` /
        ``cuflash::attention_mod_bwd``; CUDA tensors raise ``NotImplementedError`` until the
        kernels take the modifiers.

    Returns
    -------
    torch.Tensor
        q's dtype and device, shape ``q.shape[:-1] + (Dv,)``; differentiable with respect to q, k,
        v (and ``attn_bias``, ``sinks``).

    Raises
    ------
    TypeError, ValueError
        As :func:`cuflash.attention` (raised when the operator runs).
    NotImplementedError
        Tensors on devices other than CPU and CUDA, float64 CUDA tensors.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNC}: {name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    causal = validation.check_flag(causal, "causal", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    layout = validation.check_layout(layout, _FUNC)
    left, right = validation.check_window_size(window_size, False, _FUNC)
    seq_axis = 1 if layout == "bshd" else -2
    if q.dim() >= 2 and k.dim() >= 2:  # other ranks are refused when the operator validates
        # bounds past both sequences mean "unbounded": -1 keeps the operator's int64 arguments in range
        left, right = validation.normalize_window(left, right, q.shape[seq_axis], k.shape[seq_axis])
    if softmax_scale is None:
        head_dim = q.shape[-1]
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    else:
        scale = validation.check_softmax_scale(softmax_scale, 1, _FUNC)
    seed, offset = _dropout_key(dropout_p, _FUNC)
    mods = (alibi_slopes, attn_bias, attn_mask, sinks)
    for name, x in zip(("alibi_slopes", "attn_bias", "attn_mask", "sinks"), mods):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNC}: {name} must be a torch.Tensor or None, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
    if softcap != 0.0 or any(x is not None for x in mods):
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"{_FUNC}: softcap must be a real number >= 0 (0 = off), got {softcap!r} "
                            f"({type(softcap).__name__})")
        out, _ = attention_mod_fwd(q, k, v, causal, scale, left, right, layout, deterministic, float(dropout_p), seed,
                                   offset, float(softcap), *mods)
        return out
    out, _ = attention_fwd(q, k, v, causal, scale, left, right, layout, deterministic, float(dropout_p), seed, offset)
    return out


def _dropout_key(dropout_p, func: str) -> tuple[int, int]:
    """``(seed, offset)`` of a dropout mask from torch's default generator ((0, 0) without
    dropout; validation of ``dropout_p`` itself happens in the operator)."""
    validation.check_dropout(dropout_p, 0, 0, func)
    if not dropout_p:
        return 0, 0
    seed, offset = (int(x) for x in torch.randint(0, 2**32, (2,), dtype=torch.int64))
    return seed, offset


# --------------------------------------------------------------------------------------------
# packed variable-length batches

_FUNC_VARLEN = "cuflash.torch.attention_varlen"


def _varlen_call(fn, arrays, index, device, **kw):
    """``fn`` (cuflash.attention_varlen or its backward) on CPU tensors through NumPy views, or
    on CUDA tensors through the CUDA kernels (``backend="cuda"``)."""
    cu_q, cu_k, used = index
    if device.type == "cpu":
        res = fn(*(_to_numpy(t) for t in arrays), _to_numpy(cu_q), _to_numpy(cu_k),
                 seqused_k=None if used is None else _to_numpy(used), backend="numpy", **kw)
        return tuple(_from_numpy(np.ascontiguousarray(r) if not r.flags.writeable else r) for r in res)
    if device.type != "cuda":
        raise NotImplementedError(f"{_FUNC_VARLEN}: tensors on device {device} are not supported; expected CPU or CUDA")

    def prepare(t):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            t = t.contiguous()  # the one documented copy (e.g. a stride-0 gradient)
        return t.detach()

    return tuple(fn(*(prepare(t) for t in arrays), cu_q, cu_k, seqused_k=used, backend="cuda", **kw))


@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward: ``(out (total_q, Hq, Dv), lse (Hq, total_q))``; ``deterministic`` is the
    backward's (saved for it)."""
    import cuflash

    return _varlen_call(cuflash.attention_varlen, (q, k, v), (cu_seqlens_q, cu_seqlens_k, seqused_k), q.device,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                        softmax_scale=softmax_scale, window_size=(window_left, window_right), return_lse=True,
                        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_left, window_right, deterministic=False, dropout_p=0.0,
                               dropout_seed=0, dropout_offset=0):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]),
                                                                           dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
    deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed backward: ``(dq, dk, dv)`` in q's, k's and v's shapes (keys past seqused_k: 0)."""
    import cuflash

    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
              window_size=(window_left, window_right), dropout_p=dropout_p, dropout_seed=dropout_seed,
              dropout_offset=dropout_offset)
    if q.device.type == "cuda":
        kw["deterministic"] = deterministic
    return _varlen_call(cuflash.attention_varlen_backward, (dout, q, k, v, out, lse),
                        (cu_seqlens_q, cu_seqlens_k, seqused_k), q.device, **kw)


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                               max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False,
                               dropout_p=0.0, dropout_seed=0, dropout_offset=0):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used, *ctx.options)
    return (dq, dk, dv) + (None,) * 13


attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


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
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNC_VARLEN}: {name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    if seqused_k is not None and not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"{_FUNC_VARLEN}: seqused_k must be a torch.Tensor or None, got {type(seqused_k).__qualname__}")
    causal = validation.check_flag(causal, "causal", _FUNC_VARLEN)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC_VARLEN)
    max_q = validation.check_int(max_seqlen_q, "max_seqlen_q", _FUNC_VARLEN)
    max_k = validation.check_int(max_seqlen_k, "max_seqlen_k", _FUNC_VARLEN)
    left, right = validation.normalize_window(*validation.check_window_size(window_size, False, _FUNC_VARLEN),
                                              max(max_q, 0), max(max_k, 0))
    if softmax_scale is None:
        head_dim = q.shape[-1] if q.dim() else 0
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    else:
        scale = validation.check_softmax_scale(softmax_scale, 1, _FUNC_VARLEN)
    seed, offset = _dropout_key(dropout_p, _FUNC_VARLEN)
    out, _ = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q, max_k, causal, scale, left,
                                  right, deterministic, float(dropout_p), seed, offset)
    return out


# --------------------------------------------------------------------------------------------
# KV cache (serving): attention_with_kvcache (no backward) and merge_attention (differentiable)

_FUNC_KVCACHE = "cuflash.torch.attention_with_kvcache"


@torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
    cache_seqlen: int, k: torch.Tensor | None, v: torch.Tensor | None, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None, rotary_interleaved: bool, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``; k/v appended into the caches in place."""
    import cuflash

    backend = "cuda" if q.device.type == "cuda" else "numpy"
    if q.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{_FUNC_KVCACHE}: tensors on device {q.device} are not supported")
    out, lse = cuflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlen if cache_seqlens is None else cache_seqlens, k=k, v=v,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, window_size=(window_left, window_right), num_splits=num_splits,
        return_lse=True, backend=backend)
    return out, lse


@attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlen, k, v, rotary_cos, rotary_sin,
                                 cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, causal,
                                 softmax_scale, window_left, window_right, num_splits):
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v_cache.shape[-1])),
            q.new_empty((b, hq, sq), dtype=_lse_dtype(q.dtype)))


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
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    optional = dict(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                    cache_leftpad=cache_leftpad, block_table=block_table)
    for name, x in {**tensors, **{n: t for n, t in optional.items() if t is not None}}.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNC_KVCACHE}: {name} must be a torch.Tensor, got {type(x).__module__}."
                            f"{type(x).__qualname__}")
    scalar = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if not scalar and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{_FUNC_KVCACHE}: cache_seqlens must be an int or an int32 torch.Tensor, got "
                        f"{type(cache_seqlens).__qualname__}")
    left, right = validation.check_window_size(window_size, validation.check_flag(causal, "causal", _FUNC_KVCACHE),
                                               _FUNC_KVCACHE)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() and q.shape[-1] > 0 else 1.0
    else:
        scale = validation.check_softmax_scale(softmax_scale, 1, _FUNC_KVCACHE)
    out, lse = attention_with_kvcache_op(
        q, k_cache, v_cache, None if scalar else cache_seqlens, cache_seqlens if scalar else 0, k, v, rotary_cos,
        rotary_sin, cache_batch_idx, cache_leftpad, block_table,
        validation.check_flag(rotary_interleaved, "rotary_interleaved", _FUNC_KVCACHE), bool(causal), scale,
        left, right, validation.check_int(num_splits, "num_splits", _FUNC_KVCACHE))
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention's signature and semantics (validation and mapping: cuflash.torch_sdpa)


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
    q, k, v, options = torch_sdpa.plan(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                       enable_gqa=enable_gqa)
    if options is None:
        return q  # dropout_p >= 1: the zeros plan() made
    return attention(q, k, v, **options)
