"""The fixed-shape operators of :mod:`cuflash.torch` and :func:`attention`.

Registered with :func:`torch.library.custom_op`:

* ``cuflash::attention_fwd(q, k, v, causal, softmax_scale, window_left, window_right, layout,
  deterministic=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0, backend="auto") -> (out,
  lse)`` (``deterministic`` only travels to the backward)
* ``cuflash::attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, window_left,
  window_right, layout, deterministic=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
  backend="auto") -> (dq, dk, dv)``
* ``cuflash::attention_mod_fwd`` / ``cuflash::attention_mod_bwd``: the same with the score
  modifiers (``softcap, alibi_slopes, attn_bias, attn_mask, sinks``; the backward also returns
  ``dbias`` and ``dsinks``), used only when a modifier is given
* ``cuflash::attention_out(q, k, v, out, ...) -> lse``: the forward into a given ``out`` (it
  mutates ``out``; no backward: :func:`attention` refuses ``out=`` when a gradient is needed)

each with a ``register_fake`` implementation (shapes and dtypes only) and the functional
forwards with ``register_autograd`` (the context saves q, k, v, out and lse; the backward is the
FlashAttention-2 backward, :func:`cuflash.attention_backward`). Each operator runs
:func:`cuflash.attention`'s (or :func:`cuflash.attention_backward`'s) pipeline on its tensors, on
the backend its ``backend`` argument names.

Imports: torch, :mod:`cuflash.api` and below.
"""

import dataclasses

import torch

from cuflash.api import attention as api_attention
from cuflash.api import backward as api_backward
from cuflash.api import pipeline
from cuflash.runtime import score_mod as tracing
from cuflash.runtime import validation
from cuflash.runtime.block_mask import own_mask_mod
from cuflash.runtime.options import DropoutOptions, ModifierOptions, Options
from cuflash.torch import tensors
from cuflash.torch.tensors import detached, lse_dtype, prepare

__all__ = ["attention", "attention_fwd", "attention_bwd", "attention_mod_fwd", "attention_mod_bwd", "attention_out"]

_FUNC = "cuflash.torch.attention"
_FUNC_BWD = _FUNC + " (backward)"


def _options(causal, softmax_scale, window, layout, deterministic, dropout, modifiers=ModifierOptions(),
             backend="auto") -> Options:
    """The options of an operator's call: ``window`` is ``(left, right)``, ``dropout`` ``(p, seed,
    offset)``."""
    return Options(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window), layout=layout,
                   return_lse=True, backend=backend, deterministic=deterministic, dropout=DropoutOptions(*dropout),
                   modifiers=modifiers)


def _forward(q, k, v, options, out=None):
    operands = (prepare(q), prepare(k), prepare(v), detached(out))
    return tensors.run(api_attention.FORWARD, operands, options, _FUNC, q)


def _modifiers(softcap, alibi_slopes, attn_bias, attn_mask, sinks) -> ModifierOptions:
    return ModifierOptions(softcap, *(detached(t) for t in (alibi_slopes, attn_bias, attn_mask, sinks)))


def _backward(arrays, options):
    dout, q, k, v, out, lse = arrays
    return tensors.run(api_backward.BACKWARD, (*(prepare(t) for t in (dout, q, k, v, out)), lse.detach()), options,
                       _FUNC_BWD, q)


# --------------------------------------------------------------------------------------------
# the plain operators


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, layout: str, deterministic: bool = False, dropout_p: float = 0.0,
    dropout_seed: int = 0, dropout_offset: int = 0, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)``; ``lse`` is float32 (float64 for float64 input). ``deterministic``
    is the backward's (saved for it); the dropout arguments and ``backend`` are
    :func:`cuflash.attention`'s."""
    return _forward(q, k, v, _options(causal, softmax_scale, (window_left, window_right), layout, False,
                                      (dropout_p, dropout_seed, dropout_offset), backend=backend))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic=False,
                        dropout_p=0.0, dropout_seed=0, dropout_offset=0, backend="auto"):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if layout == "bshd":
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = tuple(q.shape[:-1])
    return out, q.new_empty(lse_shape, dtype=lse_dtype(q.dtype))


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int, layout: str,
    deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)`` in the dtypes and shapes of q, k and v (FlashAttention-2, Alg. 2)."""
    return _backward((dout, q, k, v, out, lse), _options(causal, softmax_scale, (window_left, window_right), layout,
                                                         deterministic, (dropout_p, dropout_seed, dropout_offset),
                                                         backend=backend))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                        deterministic=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0, backend="auto"):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, layout, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # deterministic, dropout_p, dropout_seed, dropout_offset, backend (the defaults where not given)
    rest = list(rest) + [False, 0.0, 0, 0, "auto"][len(rest):]
    ctx.options = (causal, softmax_scale, window_left, window_right, layout, bool(rest[0]), *rest[1:])
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * 10


attention_fwd.register_autograd(_grads, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# the score modifiers' operators (used only when a modifier is given: the plain call is unchanged)


@torch.library.custom_op("cuflash::attention_mod_fwd", mutates_args=())
def attention_mod_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, layout: str, deterministic: bool, dropout_p: float,
    dropout_seed: int, dropout_offset: int, softcap: float, alibi_slopes: torch.Tensor | None,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, sinks: torch.Tensor | None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with score modifiers: ``(out, lse)`` (:func:`cuflash.attention`'s arguments)."""
    mods = _modifiers(softcap, alibi_slopes, attn_bias, attn_mask, sinks)
    return _forward(q, k, v, _options(causal, softmax_scale, (window_left, window_right), layout, False,
                                      (dropout_p, dropout_seed, dropout_offset), mods, backend))


@attention_mod_fwd.register_fake
def _attention_mod_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout, deterministic,
                            dropout_p, dropout_seed, dropout_offset, softcap, alibi_slopes, attn_bias, attn_mask, sinks,
                            backend="auto"):
    return _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout)


@torch.library.custom_op("cuflash::attention_mod_bwd", mutates_args=())
def attention_mod_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int, layout: str,
    deterministic: bool, dropout_p: float, dropout_seed: int, dropout_offset: int, softcap: float,
    alibi_slopes: torch.Tensor | None, attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None,
    sinks: torch.Tensor | None, return_dbias: bool, return_dsinks: bool, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward with score modifiers: ``(dq, dk, dv, dbias, dsinks)``; ``dbias``/``dsinks`` are
    empty ``(0,)`` tensors when not asked for."""
    mods = _modifiers(softcap, alibi_slopes, attn_bias, attn_mask, sinks)
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                      layout=layout, backend=backend, deterministic=deterministic, return_dbias=return_dbias,
                      return_dsinks=return_dsinks, dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=mods)
    grads = list(_backward((dout, q, k, v, out, lse), options))
    dq, dk, dv = grads[:3]
    rest = grads[3:]
    dbias = rest.pop(0) if return_dbias else q.new_empty((0,))
    dsinks = rest.pop(0) if return_dsinks else q.new_empty((0,))
    return dq, dk, dv, dbias, dsinks


@attention_mod_bwd.register_fake
def _attention_mod_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout,
                            deterministic, dropout_p, dropout_seed, dropout_offset, softcap, alibi_slopes, attn_bias,
                            attn_mask, sinks, return_dbias, return_dsinks, backend="auto"):
    dq, dk, dv = _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, layout)
    dbias = torch.empty_like(attn_bias, memory_format=torch.contiguous_format) if return_dbias else q.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape, dtype=lse_dtype(q.dtype)) if return_dsinks else q.new_empty((0,))
    return dq, dk, dv, dbias, dsinks


_MOD_BIAS, _MOD_SINKS = 14, 16   # input positions of attn_bias and sinks in attention_mod_fwd


def _mod_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    alibi, bias, mask, sinks = inputs[13:17]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi, bias, mask, sinks)
    ctx.options = tuple(inputs[3:13])
    ctx.backend = inputs[17] if len(inputs) > 17 else "auto"
    ctx.mark_non_differentiable(lse)


def _mod_grads(ctx, dout, dlse):
    q, k, v, out, lse, alibi, bias, mask, sinks = ctx.saved_tensors
    want_bias = bias is not None and ctx.needs_input_grad[_MOD_BIAS]
    want_sinks = sinks is not None and ctx.needs_input_grad[_MOD_SINKS]
    dq, dk, dv, dbias, dsinks = attention_mod_bwd(dout, q, k, v, out, lse, *ctx.options, alibi, bias, mask, sinks,
                                                  want_bias, want_sinks, ctx.backend)
    grads = [dq, dk, dv] + [None] * 15
    if want_bias:
        grads[_MOD_BIAS] = dbias.to(bias.dtype)
    if want_sinks:
        grads[_MOD_SINKS] = dsinks.to(sinks.dtype)
    return tuple(grads)


attention_mod_fwd.register_autograd(_mod_grads, setup_context=_mod_setup_context)


# --------------------------------------------------------------------------------------------
# the forward into a given out= (mutates it; no autograd: attention() refuses out= when a gradient
# is needed)


@torch.library.custom_op("cuflash::attention_out", mutates_args=("out",))
def attention_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, layout: str, dropout_p: float, dropout_seed: int, dropout_offset: int,
    softcap: float, alibi_slopes: torch.Tensor | None, attn_bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None, sinks: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    """Forward written into ``out`` (checked as :func:`cuflash.attention` checks ``out=``); returns
    ``lse``."""
    mods = _modifiers(softcap, alibi_slopes, attn_bias, attn_mask, sinks)
    _, lse = _forward(q, k, v, _options(causal, softmax_scale, (window_left, window_right), layout, False,
                                        (dropout_p, dropout_seed, dropout_offset), mods, backend), out=out)
    return lse


@attention_out.register_fake
def _attention_out_fake(q, k, v, out, causal, softmax_scale, window_left, window_right, layout, dropout_p,
                        dropout_seed, dropout_offset, softcap, alibi_slopes, attn_bias, attn_mask, sinks, backend):
    return _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, layout)[1]


# --------------------------------------------------------------------------------------------
# the public function


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
              out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
              alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
              deterministic=False, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, block_mask=None):
    """Differentiable exact attention, ``softmax(softmax_scale * q k^T + mask) v``, for torch tensors.

    Every parameter of :func:`cuflash.attention` with its name, default and meaning, plus
    ``deterministic`` (the backward's); the conventions of :func:`cuflash.attention` (GQA/MQA,
    ``window_size``, layouts, empty rows -> 0). Gradients come from the FlashAttention-2 backward
    (:func:`cuflash.attention_backward`) with ``P`` recomputed from the saved log-sum-exp. Works
    under ``torch.compile`` (``fullgraph=True``) through the custom operators
    ``cuflash::attention_fwd`` / ``cuflash::attention_bwd`` (``cuflash::attention_mod_fwd`` /
    ``_bwd`` with a score modifier, ``cuflash::attention_out`` with ``out=``).

    Parameters
    ----------
    q : torch.Tensor, shape ``(..., Sq, D)`` ("bhsd") or ``(B, Sq, Hq, D)`` ("bshd")
    k : torch.Tensor, shape ``(..., Sk, D)`` or ``(B, Sk, Hk, D)``
    v : torch.Tensor, shape ``(..., Sk, Dv)`` or ``(B, Sk, Hk, Dv)``
        One dtype (float16, bfloat16, float32, float64) and one device, CPU or CUDA (a meta
        tensor is refused).
    causal : bool
        Causal mask aligned bottom-right (flash-attn >= 2.1): query ``i`` sees key ``j`` iff
        ``j <= i + Sk - Sq``. PyTorch SDPA's ``is_causal`` is top-left; they agree when ``Sq == Sk``.
    softmax_scale : float, optional
        None means ``1/sqrt(D)``; ``0.0`` is valid.
    window_size : (int, int)
        ``(left, right)`` local-attention bounds, -1 = unbounded; ``causal=True`` sets ``right = 0``.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores (natural log). The lse is
        not differentiable (``lse.requires_grad`` is False): a loss through it gets no gradient
        from it; only ``out`` carries gradients back to the inputs.
    layout : {"bhsd", "bshd"}
    out : torch.Tensor, optional
        Output buffer (the result's shape, q's dtype and device), written in place and returned.
        Not differentiable: with grad mode on, ``out=`` together with an input (or ``out``) that
        requires grad raises ``TypeError`` (as torch's own ``out=`` operators refuse autograd).
    backend : {"auto", "numpy", "sim", "cuda"}
        "auto": CPU tensors run the NumPy implementation, CUDA tensors the CUDA kernels on
        torch's current stream (``CUFLASH_BACKEND`` overrides "auto", as for
        :func:`cuflash.attention`). "numpy" and "sim" (the CUDA kernels on the CPU simulator)
        take CPU tensors, "cuda" CUDA tensors; a backend that would move data raises
        ``ValueError``. The backward runs on the forward's backend.
    dropout_p : float
        Attention dropout in ``[0, 1)`` (applied whenever it is > 0, as ``F.dropout(training=True)``;
        pass 0 to evaluate). The backward regenerates the same mask
        (:func:`cuflash.reference.dropout_mask` shows it).
    dropout_seed, dropout_offset : int, optional
        The mask's Philox key, each in ``[0, 2**32)``, as :func:`cuflash.attention` takes them.
        With ``dropout_seed=None`` (the default) and ``dropout_p > 0`` both are drawn from torch's
        default CPU generator (``torch.randint``, no device synchronization), so
        ``torch.manual_seed`` reproduces a run; drawing them is a graph break under
        ``torch.compile`` (pass ``dropout_seed`` to trace without one). A ``dropout_offset``
        without ``dropout_seed`` is refused.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks
        The score modifiers of :func:`cuflash.attention` (softcap as in Gemma 2, ALiBi slopes
        ``(Hq,)``/``(B, Hq)`` float32, an additive ``attn_bias`` broadcastable to ``(B, Hq, Sq,
        Sk)``, a bool ``attn_mask`` (True = attend), float32 ``sinks`` ``(Hq,)``), as tensors of
        q's device. ``attn_bias`` and ``sinks`` are differentiable: their gradients come from
        the backward when they require grad (``d attn_bias`` summed over the axes it broadcasts
        over). The backward computes no gradient for ``alibi_slopes``: slopes that require grad
        raise ``TypeError`` (pass ``alibi_slopes.detach()``).
    score_mod, mask_mod : callable, optional
        As :func:`cuflash.attention` takes them, differentiable: the backward multiplies ``dS``
        by the symbolic ``d score_mod / d score``, and a captured float tensor that requires
        grad (a learned relative-position table, trainable ALiBi slopes) gets its gradient
        (:func:`cuflash.attention_backward`'s ``return_dscore_mod``: the NumPy path, or the
        tensor-core backward's float32 atomics, or with ``deterministic=True`` its exact integer sums). The function is traced once per call; its captured tensors (of q's device)
        are read, never copied. A mask_mod's captured tensors get no gradient (float ones that
        require grad raise ``TypeError``). These calls run through a ``torch.autograd.Function``
        (eager autograd; not a registered operator, so ``torch.compile`` breaks the graph
        there). ``out=`` with them is refused (``TypeError``) when a gradient is needed.
    block_mask : BlockMask, optional
        A block-sparse mask (:func:`cuflash.create_block_mask`), as :func:`cuflash.attention`
        takes it, differentiable: the forward and the backward (:func:`cuflash.attention_backward`
        with the same ``block_mask``) visit only its listed blocks. ``mask_mod`` None means the
        block mask's own (``block_mask.mask_mod``); a ``mask_mod`` given too must be the function
        it was built from, checked before any captured tensor is detached. Its index arrays are
        NumPy for CPU tensors (the NumPy path and ``backend="sim"``) and device arrays for CUDA
        tensors (``create_block_mask(..., device=)``). The call runs through the same
        ``torch.autograd.Function`` as ``score_mod``/``mask_mod`` (eager autograd, ``gradcheck``
        in float64 on CPU tensors; ``torch.compile`` breaks the graph there); the block mask gets
        no gradient.
    deterministic : bool
        The backward's: bit-identical gradients run to run on the kernel backends (no atomics in
        the dQ sum; a float32 workspace of up to 16 copies of dq and a slower backward, see
        :func:`cuflash.attention_backward`). The NumPy path is always deterministic.
    q_descale, k_descale, v_descale, out_dtype : optional
        fp8 (``torch.float8_e4m3fn``) input, as :func:`cuflash.attention` takes it: the call is
        forwarded to :func:`cuflash.attention` unchanged. fp8 attention has no backward, so with
        grad mode on, fp8 options together with inputs that require grad raise ``TypeError``.

    Returns
    -------
    out : torch.Tensor
        q's dtype and device, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``;
        differentiable with respect to q, k, v, ``attn_bias`` and ``sinks`` (``out=`` itself
        when given).
    lse : torch.Tensor
        Only with ``return_lse=True``: float32 (float64 for float64 input), ``q.shape[:-1]``
        ("bhsd") or ``(B, Hq, Sq)`` ("bshd"); not differentiable.

    Raises
    ------
    TypeError
        A non-tensor argument; with grad mode on, ``out=`` with tensors that require grad, or
        ``alibi_slopes`` that requires grad; otherwise as :func:`cuflash.attention`.
    ValueError
        A meta tensor; an unknown backend or one that would move data; a ``block_mask`` built for
        other lengths, batch or heads, or with another ``mask_mod``; as :func:`cuflash.attention`.
    NotImplementedError
        Tensors on devices other than CPU and CUDA; as :func:`cuflash.attention` (float64 on a
        kernel backend, a call without a kernel).
    """
    mods = {"alibi_slopes": alibi_slopes, "attn_bias": attn_bias, "attn_mask": attn_mask, "sinks": sinks}
    fp8 = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "out_dtype": out_dtype}
    if (score_mod is not None or mask_mod is not None or block_mask is not None) and not tensors.is_fp8(q, fp8):
        return _traced_attention(q, k, v, (score_mod, mask_mod, block_mask), mods, dict(
            causal=causal, softmax_scale=softmax_scale, window_size=window_size, return_lse=return_lse,
            layout=layout, out=out, backend=backend, dropout=(dropout_p, dropout_seed, dropout_offset),
            softcap=softcap, deterministic=deterministic))
    if tensors.is_fp8(q, fp8):
        tensors.refuse_fp8_gradients(_FUNC, {"q": q, "k": k, "v": v})
        return api_attention.attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, return_lse=return_lse,
            layout=layout, out=out, backend=backend, dropout_p=dropout_p, dropout_seed=dropout_seed,
            dropout_offset=dropout_offset, softcap=softcap, **mods, score_mod=score_mod, mask_mod=mask_mod,
            block_mask=block_mask, **fp8)
    tensors.check_tensors(_FUNC, {"q": q, "k": k, "v": v}, {"out": out, **mods})
    causal = validation.check_flag(causal, "causal", _FUNC)
    return_lse = validation.check_flag(return_lse, "return_lse", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    layout = validation.check_layout(layout, _FUNC)
    backend = tensors.check_backend(backend, _FUNC)
    left, right = validation.check_window_size(window_size, False, _FUNC)
    _refuse_gradients(q, k, v, out, mods)
    seq_axis = 1 if layout == "bshd" else -2
    if q.dim() >= 2 and k.dim() >= 2:  # other ranks are refused when the operator validates
        # bounds past both sequences mean "unbounded": -1 keeps the operator's int64 arguments in range
        left, right = validation.normalize_window(left, right, q.shape[seq_axis], k.shape[seq_axis])
    scale = tensors.scale_of(softmax_scale, q.shape[-1] if q.dim() else 0, _FUNC)
    seed, offset = tensors.dropout_key(dropout_p, dropout_seed, dropout_offset, _FUNC)
    modified = softcap != 0.0 or any(x is not None for x in mods.values())
    if modified and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise TypeError(f"{_FUNC}: softcap must be a real number >= 0 (0 = off), got {softcap!r} "
                        f"({type(softcap).__name__})")
    scalars = (causal, scale, left, right, layout)
    if out is not None:
        lse = attention_out(q, k, v, out, *scalars, float(dropout_p), seed, offset, float(softcap), *mods.values(),
                            backend)
    elif modified:
        out, lse = attention_mod_fwd(q, k, v, *scalars, deterministic, float(dropout_p), seed, offset, float(softcap),
                                     *mods.values(), backend)
    else:
        out, lse = attention_fwd(q, k, v, *scalars, deterministic, float(dropout_p), seed, offset, backend)
    return (out, lse) if return_lse else out


def _refuse_gradients(q, k, v, out, mods) -> None:
    """The options without a gradient, refused where one is needed (never dropped quietly)."""
    slopes = tensors.requiring_grad({"alibi_slopes": mods["alibi_slopes"]})
    if slopes:
        raise TypeError(f"{_FUNC}: alibi_slopes requires grad (grad mode is on), but the backward computes no "
                        f"gradient for the ALiBi slopes; pass alibi_slopes.detach() (constant slopes), or call under "
                        f"torch.no_grad()")
    if out is not None:
        needing = tensors.requiring_grad({"q": q, "k": k, "v": v, "attn_bias": mods["attn_bias"],
                                          "sinks": mods["sinks"], "out": out})
        if needing:
            raise TypeError(f"{_FUNC}: out= cannot be differentiated, and {tensors.require_phrase(needing)} (grad "
                            f"mode is on): a result written into a given buffer has no autograd history (torch's "
                            f"own out= operators refuse autograd too); drop out= for a differentiable result, or "
                            f"call under torch.no_grad()")


# --------------------------------------------------------------------------------------------
# score_mod / mask_mod: a torch.autograd.Function (a traced function is not an operator argument)


def _traced_attention(q, k, v, fns, mods, kw):
    """:func:`attention` with a ``score_mod``/``mask_mod``/``block_mask`` (``fns``; ``kw`` the other
    options): traced here once, its captured tensors detached for the pipeline, the float ones of
    the score_mod that require grad made inputs of :class:`_TracedAttention` (so their gradients
    reach them). With a block mask the pipeline gets ``mask_mod=None`` and uses the block mask's
    own, whose captured arrays are not detached copies (its check compares them by identity)."""
    score_mod, mask_mod, block_mask = fns
    out, backend, softcap, return_lse = kw["out"], kw["backend"], kw["softcap"], kw["return_lse"]

    tensors.check_tensors(_FUNC, {"q": q, "k": k, "v": v}, {"out": out, **mods})
    if block_mask is not None:   # its own traced mask_mod, checked before any captured array is detached
        mask_mod = own_mask_mod(block_mask, mask_mod, _FUNC)
    traced = {role: None if fn is None else tracing.trace(fn, role, _FUNC)
              for role, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))}
    learned = []   # (slot, tensor) of the score_mod's float captured tensors that require grad
    grad_on = torch.is_grad_enabled()
    for role, t in traced.items():
        if t is None:
            continue
        floats = tracing.float_slots(t) if role == "score_mod" else ()
        for i, (name, a) in enumerate(zip(t.names, t.arrays)):
            if grad_on and isinstance(a, torch.Tensor) and a.requires_grad:
                if i not in floats:
                    raise TypeError(f"{_FUNC}: {role}'s captured tensor {name!r} requires grad, but a {role}'s "
                                    f"captured arrays get no gradient (only a score_mod's float ones do); pass "
                                    f"{name}.detach()")
                learned.append((i, a))
        traced[role] = dataclasses.replace(t, arrays=tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                           for a in t.arrays))
    _refuse_gradients(q, k, v, out, mods)
    if out is not None:
        needing = tensors.requiring_grad({name: a for (_, a), name in
                                          zip(learned, (traced["score_mod"].names[i] for i, _ in learned))})
        if needing:
            raise TypeError(f"{_FUNC}: out= cannot be differentiated, and {tensors.require_phrase(needing)} "
                            f"(grad mode is on); drop out= or detach the captured tensors")
    dropout_p, dropout_seed, dropout_offset = kw["dropout"]
    seed, offset = tensors.dropout_key(dropout_p, dropout_seed, dropout_offset, _FUNC)
    modifiers = ModifierOptions(softcap, *(detached(mods[n]) for n in ("alibi_slopes", "attn_bias", "attn_mask",
                                                                          "sinks")),
                                traced["score_mod"], None if block_mask is not None else traced["mask_mod"],
                                block_mask)   # with a block mask the pipeline takes the mask's own mask_mod
    options = Options(causal=kw["causal"], softmax_scale=kw["softmax_scale"], window_size=kw["window_size"],
                      layout=kw["layout"], return_lse=True, backend=tensors.check_backend(backend, _FUNC),
                      deterministic=kw["deterministic"],
                      dropout=DropoutOptions(dropout_p, seed, offset), modifiers=modifiers)
    if out is not None:
        o, lse = tensors.run(api_attention.FORWARD, (prepare(q), prepare(k), prepare(v), detached(out)), options,
                             _FUNC, q)
        return (o, lse) if return_lse else o
    cfg = _TracedCall(options, tuple(i for i, _ in learned))
    o, lse = _TracedAttention.apply(cfg, q, k, v, mods["attn_bias"], mods["sinks"], *(a for _, a in learned))
    return (o, lse) if return_lse else o


@dataclasses.dataclass(frozen=True, eq=False)
class _TracedCall:
    options: Options
    learned: tuple   # the score_mod's slots of the captured tensors given as inputs


class _TracedAttention(torch.autograd.Function):
    """``(out, lse)`` of a call with a traced score_mod/mask_mod; the backward is
    :func:`cuflash.attention_backward` with ``return_dbias``/``return_dsinks``/``return_dscore_mod``
    as the inputs need them."""

    @staticmethod
    def forward(ctx, cfg, q, k, v, attn_bias, sinks, *learned):
        o, lse = tensors.run(api_attention.FORWARD, (prepare(q), prepare(k), prepare(v), None), cfg.options, _FUNC, q)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        cfg = ctx.cfg
        q, k, v, o, lse = ctx.saved_tensors
        want_bias, want_sinks = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        want_arrays = any(ctx.needs_input_grad[6:])
        options = dataclasses.replace(cfg.options, return_lse=False, return_dbias=want_bias,
                                      return_dsinks=want_sinks, return_dscore_mod=want_arrays)
        if dout is None:
            dout = torch.zeros_like(o)
        grads = list(tensors.run(api_backward.BACKWARD, (*(prepare(t) for t in (dout, q, k, v, o)), lse.detach()),
                                 options, _FUNC_BWD, q))
        dq, dk, dv = grads[:3]
        rest = grads[3:]
        mods = options.modifiers
        dbias = rest.pop(0).to(mods.attn_bias.dtype) if want_bias else None
        dsinks = rest.pop(0).to(mods.sinks.dtype) if want_sinks else None
        darrays = [None] * len(cfg.learned)
        if want_arrays:
            by_name = rest.pop(0)
            names = mods.score_mod.names
            darrays = [by_name[names[i]].to(mods.score_mod.arrays[i].dtype) for i in cfg.learned]
        return (None, dq, dk, dv, dbias, dsinks, *darrays)
