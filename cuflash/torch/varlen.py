"""The packed variable-length operators of :mod:`cuflash.torch` and :func:`attention_varlen`.

* ``cuflash::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False, dropout_p=0.0,
  dropout_seed=0, dropout_offset=0, softcap=0.0, alibi_slopes=None, block_table=None,
  backend="auto", num_splits=1) -> (out, lse)``
* ``cuflash::attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
  max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False,
  dropout_p=0.0, dropout_seed=0, dropout_offset=0, softcap=0.0, alibi_slopes=None,
  backend="auto") -> (dq, dk, dv)``
* ``cuflash::attention_varlen_out(q, k, v, out, ...) -> lse``: the forward into a given ``out``
  (it mutates ``out``; no backward)

Each runs :func:`cuflash.attention_varlen`'s (or its backward's) pipeline on its tensors. The
backward has no paged form (:func:`cuflash.attention_varlen_backward` takes no ``block_table``),
so :func:`attention_varlen` refuses ``block_table`` when a gradient is needed.

Imports: torch, :mod:`cuflash.api` and below.
"""

import torch

from cuflash.api import varlen as api_varlen
from cuflash.runtime import validation
from cuflash.runtime.options import DropoutOptions, ModifierOptions, Options, PackedOptions
from cuflash.torch import tensors
from cuflash.torch.tensors import detached, lse_dtype, prepare

__all__ = ["attention_varlen", "attention_varlen_fwd", "attention_varlen_bwd", "attention_varlen_out"]

_FUNC = "cuflash.torch.attention_varlen"


def _options(index, sizes, causal, softmax_scale, window, dropout, deterministic=False, softcap=0.0,
             alibi_slopes=None, backend="auto", num_splits=1) -> Options:
    """``index`` ``(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)`` tensors, ``sizes``
    ``(max_seqlen_q, max_seqlen_k)``, ``window`` ``(left, right)``, ``dropout`` ``(p, seed, offset)``,
    ``num_splits`` the forward's split-KV count."""
    cu_q, cu_k, used, table = (detached(t) for t in index)
    return Options(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window), return_lse=True,
                   backend=backend, deterministic=deterministic, dropout=DropoutOptions(*dropout),
                   modifiers=ModifierOptions(softcap, detached(alibi_slopes)),
                   packed=PackedOptions(cu_q, cu_k, sizes[0], sizes[1], used, table, num_splits))


@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0,
    dropout_offset: int = 0, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None, backend: str = "auto", num_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward: ``(out (total_q, Hq, Dv), lse (Hq, total_q))``; ``deterministic`` is the
    backward's (saved for it)."""
    options = _options((cu_seqlens_q, cu_seqlens_k, seqused_k, block_table), (max_seqlen_q, max_seqlen_k), causal,
                       softmax_scale, (window_left, window_right), (dropout_p, dropout_seed, dropout_offset),
                       softcap=softcap, alibi_slopes=alibi_slopes, backend=backend, num_splits=num_splits)
    return tensors.run(api_varlen.FORWARD, (prepare(q), prepare(k), prepare(v), None), options, _FUNC, q)


def _out_fake(q, v):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


def _lse_fake(q):
    return q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype))


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_left, window_right, deterministic=False, dropout_p=0.0,
                               dropout_seed=0, dropout_offset=0, softcap=0.0, alibi_slopes=None, block_table=None,
                               backend="auto", num_splits=1):
    return _out_fake(q, v), _lse_fake(q)


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
    deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0,
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed backward: ``(dq, dk, dv)`` in q's, k's and v's shapes (keys past seqused_k: 0)."""
    options = _options((cu_seqlens_q, cu_seqlens_k, seqused_k, None), (max_seqlen_q, max_seqlen_k), causal,
                       softmax_scale, (window_left, window_right), (dropout_p, dropout_seed, dropout_offset),
                       deterministic, softcap, alibi_slopes, backend)
    operands = (*(prepare(t) for t in (dout, q, k, v, out)), lse.detach())
    return tensors.run(api_varlen.BACKWARD, operands, options, _FUNC + " (backward)", q)


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                               max_seqlen_k, causal, softmax_scale, window_left, window_right, deterministic=False,
                               dropout_p=0.0, dropout_seed=0, dropout_offset=0, softcap=0.0, alibi_slopes=None,
                               backend="auto"):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


#: the forward's arguments after (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k), with their defaults
_REST = ("max_seqlen_q", "max_seqlen_k", "causal", "softmax_scale", "window_left", "window_right", "deterministic",
         "dropout_p", "dropout_seed", "dropout_offset", "softcap", "alibi_slopes", "block_table", "backend",
         "num_splits")
_REST_DEFAULTS = (False, 0.0, 0, 0, 0.0, None, None, "auto", 1)   # from deterministic on


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used, *rest = inputs
    named = dict(zip(_REST, list(rest) + list(_REST_DEFAULTS[len(rest) - 6:])))
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used, named["alibi_slopes"])
    ctx.paged = named["block_table"] is not None
    ctx.options = tuple(named[n] for n in _REST[:11])
    ctx.backend = named["backend"]
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, dlse):
    if ctx.paged:
        raise NotImplementedError(f"{_FUNC} (backward): block_table (a paged KV cache) has no backward; "
                                  f"cuflash.attention_varlen_backward takes packed k and v only")
    q, k, v, out, lse, cu_q, cu_k, used, alibi = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used, *ctx.options, alibi, ctx.backend)
    return (dq, dk, dv) + (None,) * 18


attention_varlen_fwd.register_autograd(_grads, setup_context=_setup_context)


@torch.library.custom_op("cuflash::attention_varlen_out", mutates_args=("out",))
def attention_varlen_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None, block_table: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int, dropout_p: float,
    dropout_seed: int, dropout_offset: int, softcap: float, alibi_slopes: torch.Tensor | None, backend: str,
    num_splits: int = 1,
) -> torch.Tensor:
    """Packed forward written into ``out`` (checked as :func:`cuflash.attention_varlen` checks
    ``out=``); returns ``lse``."""
    options = _options((cu_seqlens_q, cu_seqlens_k, seqused_k, block_table), (max_seqlen_q, max_seqlen_k), causal,
                       softmax_scale, (window_left, window_right), (dropout_p, dropout_seed, dropout_offset),
                       softcap=softcap, alibi_slopes=alibi_slopes, backend=backend, num_splits=num_splits)
    _, lse = tensors.run(api_varlen.FORWARD, (prepare(q), prepare(k), prepare(v), out.detach()), options, _FUNC, q)
    return lse


@attention_varlen_out.register_fake
def _attention_varlen_out_fake(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                               max_seqlen_k, causal, softmax_scale, window_left, window_right, dropout_p, dropout_seed,
                               dropout_offset, softcap, alibi_slopes, backend, num_splits=1):
    return _lse_fake(q)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), seqused_k=None, block_table=None, return_lse=False,
                     out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
                     alibi_slopes=None, score_mod=None, mask_mod=None, deterministic=False, q_descale=None,
                     k_descale=None, v_descale=None, out_dtype=None, num_splits=1):
    """Differentiable attention over a packed batch of variable-length sequences.

    Every parameter of :func:`cuflash.attention_varlen` with its name, default and meaning, plus
    ``deterministic`` (the backward's); its conventions (flash-attn's ``flash_attn_varlen_func``
    with FA3's ``seqused_k``). Gradients with respect to q and k and v come from
    :func:`cuflash.attention_varlen_backward`. Works under ``torch.compile`` (``fullgraph=True``)
    through the custom operators ``cuflash::attention_varlen_fwd`` / ``_bwd``
    (``cuflash::attention_varlen_out`` with ``out=``).

    Parameters
    ----------
    q : torch.Tensor ``(total_q, Hq, D)``
    k, v : torch.Tensor ``(total_k, Hk, D)``, ``(total_k, Hk, Dv)``
        One dtype and device (CPU or CUDA; a meta tensor is refused). With ``block_table``: the
        paged caches ``(num_pages, page_size, Hk, D|Dv)``.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, int32 ``(B + 1,)``
        On the tensors' device (CPU indices are checked in full; CUDA ones for dtype and shape).
        Other integer dtypes are refused (``TypeError`` suggesting ``.int()``).
    max_seqlen_q, max_seqlen_k : int
    causal, softmax_scale, window_size
        As :func:`cuflash.torch.attention`, per sequence (bottom-right causal alignment).
    seqused_k : torch.Tensor, int32 ``(B,)``, optional
    block_table : torch.Tensor, int32 ``(B, max_pages)``, optional
        Chunked prefill over a paged KV cache, as :func:`cuflash.attention_varlen`. Forward only:
        with grad mode on and q, k or v requiring grad it raises ``TypeError`` (the backward has
        no paged form).
    num_splits : int
        Split-KV with a ``block_table``, as :func:`cuflash.attention_varlen` (1: unsplit; 0:
        chosen from the shapes and the SM count; a performance hint).
    return_lse : bool
        Also return the lse ``(Hq, total_q)`` (natural log). Not differentiable
        (``lse.requires_grad`` is False): a loss through it gets no gradient from it.
    out : torch.Tensor ``(total_q, Hq, Dv)``, optional
        Output buffer, written in place and returned; refused (``TypeError``) together with tensors
        that require grad, with grad mode on.
    backend : {"auto", "numpy", "sim", "cuda"}
        As :func:`cuflash.torch.attention` (the backward runs on the forward's backend).
    dropout_p, dropout_seed, dropout_offset
        As :func:`cuflash.torch.attention` (without ``dropout_seed`` the key is drawn from torch's
        default generator).
    softcap, alibi_slopes
        The score modifiers of :func:`cuflash.attention_varlen`; the backward takes both, but
        computes no gradient for the slopes: ``alibi_slopes`` that requires grad raises
        ``TypeError``.
    score_mod, mask_mod : callable, optional
        Not here yet: given, they raise ``NotImplementedError`` before any work
        (:func:`cuflash.attention_varlen` takes them on arrays that carry no gradient, and
        :func:`cuflash.torch.attention` through autograd).
    deterministic : bool
        The backward's, on the kernel backends (the NumPy path is always deterministic).
    q_descale, k_descale, v_descale, out_dtype : optional
        fp8 (``torch.float8_e4m3fn``) input, as :func:`cuflash.attention_varlen` takes it: the
        call is forwarded to :func:`cuflash.attention_varlen` unchanged. fp8 attention has no
        backward, so with grad mode on, fp8 input together with tensors that require grad raises
        ``TypeError``.

    Returns
    -------
    out : torch.Tensor ``(total_q, Hq, Dv)``, differentiable with respect to q, k, v.
    lse : torch.Tensor ``(Hq, total_q)``, float32 (float64 for float64 input); only with
        ``return_lse=True``; not differentiable.

    Raises
    ------
    TypeError
        A non-tensor argument, an index tensor that is not int32; with grad mode on, ``out=``,
        ``block_table`` or ``alibi_slopes`` together with tensors that require grad (naming the
        option); otherwise as :func:`cuflash.attention_varlen`.
    ValueError, NotImplementedError
        A meta tensor, an unknown backend; as :func:`cuflash.attention_varlen`; ``score_mod`` or
        ``mask_mod`` given (``NotImplementedError``).
    """
    fp8 = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale, "out_dtype": out_dtype}
    if tensors.is_fp8(q, fp8):
        tensors.refuse_fp8_gradients(_FUNC, {"q": q, "k": k, "v": v})
        return api_varlen.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, seqused_k=seqused_k, block_table=block_table, return_lse=return_lse, out=out,
            backend=backend, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
            softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod, num_splits=num_splits,
            **fp8)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None:
            raise NotImplementedError(f"{_FUNC}: {name} on a packed batch does not run through torch autograd yet; "
                                      f"call cuflash.attention_varlen on tensors that do not require grad (the NumPy "
                                      f"path), or cuflash.torch.attention per sequence")
    index = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    optional_index = {"seqused_k": seqused_k, "block_table": block_table}
    tensors.check_tensors(_FUNC, {"q": q, "k": k, "v": v, **index},
                          {**optional_index, "out": out, "alibi_slopes": alibi_slopes})
    tensors.check_index_dtypes(_FUNC, {**index, **optional_index})
    causal = validation.check_flag(causal, "causal", _FUNC)
    return_lse = validation.check_flag(return_lse, "return_lse", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    backend = tensors.check_backend(backend, _FUNC)
    max_q = validation.check_int(max_seqlen_q, "max_seqlen_q", _FUNC)
    max_k = validation.check_int(max_seqlen_k, "max_seqlen_k", _FUNC)
    num_splits = validation.check_num_splits(num_splits, _FUNC)
    left, right = validation.normalize_window(*validation.check_window_size(window_size, False, _FUNC),
                                              max(max_q, 0), max(max_k, 0))
    _refuse_gradients(q, k, v, out, block_table, alibi_slopes)
    scale = tensors.scale_of(softmax_scale, q.shape[-1] if q.dim() else 0, _FUNC)
    seed, offset = tensors.dropout_key(dropout_p, dropout_seed, dropout_offset, _FUNC)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{_FUNC}: softcap must be a real number >= 0 (0 = off), got {softcap!r} "
                        f"({type(softcap).__name__})")
    scalars = (causal, scale, left, right)
    if out is not None:
        lse = attention_varlen_out(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_q, max_k,
                                   *scalars, float(dropout_p), seed, offset, float(softcap), alibi_slopes, backend,
                                   num_splits)
    else:
        out, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q, max_k, *scalars,
                                        deterministic, float(dropout_p), seed, offset, float(softcap), alibi_slopes,
                                        block_table, backend, num_splits)
    return (out, lse) if return_lse else out


def _refuse_gradients(q, k, v, out, block_table, alibi_slopes) -> None:
    """The options without a gradient, refused where one is needed (never dropped quietly)."""
    if tensors.requiring_grad({"alibi_slopes": alibi_slopes}):
        raise TypeError(f"{_FUNC}: alibi_slopes requires grad (grad mode is on), but the backward computes no "
                        f"gradient for the ALiBi slopes; pass alibi_slopes.detach() (constant slopes), or call under "
                        f"torch.no_grad()")
    needing = tensors.requiring_grad({"q": q, "k": k, "v": v, "out": out})
    if block_table is not None and needing:
        raise TypeError(f"{_FUNC}: block_table (a paged KV cache) has no backward, and "
                        f"{tensors.require_phrase(needing)} (grad mode is on): cuflash.attention_varlen_backward "
                        f"takes packed k and v only; gather the pages into packed k and v for a differentiable "
                        f"result, or call under torch.no_grad()")
    if out is not None and needing:
        raise TypeError(f"{_FUNC}: out= cannot be differentiated, and {tensors.require_phrase(needing)} (grad "
                        f"mode is on): a result written into a given buffer has no autograd history (torch's "
                        f"own out= operators refuse autograd too); drop out= for a differentiable result, or "
                        f"call under torch.no_grad()")
