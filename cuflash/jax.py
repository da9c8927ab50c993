"""JAX: :func:`attention`, differentiable (``jax.custom_vjp``), under ``jax.jit``, ``jax.vmap`` and
``jax.grad``.

Importing :mod:`cuflash` never imports JAX; importing ``cuflash.jax`` does (JAX with
``jax.experimental.buffer_callback``, 0.7 and newer).

The forward and the backward each run as one ``buffer_callback`` (JAX's callback that hands the
function the device buffers themselves and, on GPU, XLA's stream), so the same code serves eager
calls and traced ones, and nothing leaves the device:

* CPU arrays: the buffers are NumPy views (``__array__``); cuflash's NumPy implementation writes
  the results into JAX's output buffers.
* GPU arrays: the buffers are CuPy views (``__cuda_array_interface__``, zero-copy) and the CUDA
  kernels run on XLA's stream (``cupy.cuda.ExternalStream(ctx.stream)``), writing ``out`` in
  place; the LSE is copied into its buffer on the same stream. No host synchronization, no
  device-to-host round trip.

``jax.vmap`` batches the callback with ``vmap_method="broadcast_all"``: the mapped axes become
leading batch dims, which cuflash takes as they are ("bhsd"); inputs without the mapped axis are
broadcast by XLA first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from cuflash.api import attention as api_attention
from cuflash.api import backward as api_backward
from cuflash.api import pipeline
from cuflash.api import varlen as api_varlen
from cuflash.runtime import validation
from cuflash.runtime.options import Options, PackedOptions

__all__ = ["attention", "attention_varlen"]

_FUNC = "cuflash.jax.attention"


def _stand_in(x, name: str):
    """A NumPy array of ``x``'s shape and dtype holding one row (stride 0 elsewhere), for the
    validation cuflash.attention does, without materializing anything."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if not shape:
        return np.zeros((), dtype)
    row = np.zeros(shape[-1], dtype)
    return np.lib.stride_tricks.as_strided(row, shape, (0,) * (len(shape) - 1) + (dtype.itemsize,), writeable=False)


def _on_gpu(buf) -> bool:
    """Whether a callback buffer lives on a CUDA device (DLPack device type kDLCUDA = 2; the CPU
    buffers refuse ``__cuda_array_interface__`` with an error, so it is not probed)."""
    try:
        return int(buf.__dlpack_device__()[0]) == 2
    except (AttributeError, TypeError, RuntimeError):
        return False


def _run(ctx, outs, ins, compute) -> None:
    """The body every callback shares: view JAX's buffers as CuPy arrays on XLA's stream (GPU)
    or as NumPy arrays (CPU), call ``compute(inputs, outputs, backend)``, and write each result
    it returns into its output buffer (a result that is the output itself was written in place)."""
    if _on_gpu(ins[0]):
        cupy = _cupy()
        with cupy.cuda.ExternalStream(int(ctx.stream)):
            o = [cupy.asarray(b) for b in outs]
            _write(compute([cupy.asarray(b) for b in ins], o, "cuda"), o)
        return
    o = [np.asarray(b) for b in outs]
    _write(compute([np.asarray(b) for b in ins], o, "numpy"), o)


def _write(results, outs) -> None:
    for dst, r in zip(outs, results):
        if r is not dst:
            dst[...] = r


def _call(entry, func: str, operands: tuple, options: Options, backend: str):
    """The public function's pipeline (``entry``) on the callback's buffers, under this adapter's
    name ``func`` (its messages name it)."""
    return pipeline.run(dataclasses.replace(entry, func=func), operands, dataclasses.replace(options, backend=backend))


def _forward_callback(options, ctx, outs, q, k, v):
    _run(ctx, outs, (q, k, v), lambda a, o, backend: _call(api_attention.FORWARD, _FUNC, (*a, o[0]), options, backend))


def _backward_callback(options, ctx, outs, dout, q, k, v, out, lse):
    _run(ctx, outs, (dout, q, k, v, out, lse),
         lambda a, o, backend: _call(api_backward.BACKWARD, _FUNC, tuple(a), options, backend))


def _cupy():
    """CuPy, which the GPU branch of the callbacks needs (a clear error where it is missing)."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("cuflash.jax: JAX GPU arrays run the CUDA kernels through CuPy, which is not "
                           f"installed ({e}); pip install 'cuflash[cuda12]' (or [cuda13])") from None
    return cupy


def _lse_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _forward(q, k, v, options):
    result = (jax.ShapeDtypeStruct(q.shape[:-1] + (v.shape[-1],), q.dtype),
              jax.ShapeDtypeStruct(q.shape[:-1], _lse_dtype(q.dtype)))
    cb = functools.partial(_forward_callback, options)
    return buffer_callback(cb, result, vmap_method="broadcast_all")(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, options):
    return _forward(q, k, v, options)[0]


def _attention_fwd(q, k, v, options):
    out, lse = _forward(q, k, v, options)
    return out, (q, k, v, out, lse)


def _attention_bwd(options, res, dout):
    q, k, v, out, lse = res
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    cb = functools.partial(_backward_callback, options)
    return buffer_callback(cb, result, vmap_method="broadcast_all")(dout.astype(out.dtype), q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd",
              deterministic=False):
    """Differentiable exact attention for JAX arrays: ``softmax(softmax_scale * q k^T + mask) v``.

    The conventions of :func:`cuflash.attention` (GQA/MQA, bottom-right causal alignment,
    ``window_size``, rows without keys -> 0); the gradient is cuflash's FlashAttention-2 backward
    (:func:`cuflash.attention_backward`; Dao 2023, Algorithm 2) through ``jax.custom_vjp``. Works
    eagerly and under ``jax.jit``, ``jax.vmap`` (mapped axes become batch dims) and ``jax.grad``,
    on CPU (the NumPy implementation) and GPU (the CUDA kernels on XLA's stream).

    Parameters
    ----------
    q : jax.Array, shape ``(..., Sq, D)`` ("bhsd") or ``(B, Sq, Hq, D)`` ("bshd")
    k : jax.Array, shape ``(..., Sk, D)`` or ``(B, Sk, Hk, D)``
    v : jax.Array, shape ``(..., Sk, Dv)`` or ``(B, Sk, Hk, Dv)``
        One dtype: float16, bfloat16, float32 (float64 with ``jax_enable_x64`` on CPU).
    causal : bool
        Query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq`` (flash-attn's alignment; ``jax.nn.
        dot_product_attention``'s ``is_causal`` aligns top-left, the same when ``Sq == Sk``).
    softmax_scale : float, optional
        None means ``1/sqrt(D)``.
    window_size : (int, int)
        ``(left, right)``, -1 = unbounded.
    layout : {"bhsd", "bshd"}
    deterministic : bool
        The backward's, on GPU (see :func:`cuflash.attention_backward`).

    Returns
    -------
    jax.Array of q's dtype, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention`, at trace time (shapes and dtypes only).
    """
    causal = validation.check_flag(causal, "causal", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    layout = validation.check_layout(layout, _FUNC)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{_FUNC}: {name} must be a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    problem = validation.check_attention(*(_stand_in(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                                         Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                                 layout=layout), func=_FUNC)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if layout == "bshd":   # the callback runs "bhsd", so mapped axes can lead
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    options = Options(causal=problem.causal, softmax_scale=float(problem.softmax_scale),
                      window_size=(problem.window_left, problem.window_right), return_lse=True,
                      deterministic=deterministic)   # hashable: custom_vjp's static argument
    out = _attention(q, k, v, options)
    return jnp.swapaxes(out, 1, 2) if layout == "bshd" else out


# --------------------------------------------------------------------------------------------
# packed variable-length batches

_FUNC_VARLEN = "cuflash.jax.attention_varlen"
#: the static options' stand-in for a ``seqused_k`` the call has (its buffer arrives in the callback)
_GIVEN = "seqused_k given"


def _with_index(options: Options, cu_q, cu_k, used) -> Options:
    """``options`` with the callback's index buffers (``seqused_k`` only when the call had one)."""
    packed = options.packed
    return dataclasses.replace(options, packed=dataclasses.replace(
        packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used if packed.seqused_k is not None else None))


def _varlen_forward_callback(options, ctx, outs, q, k, v, cu_q, cu_k, used):
    def compute(a, o, backend):
        return _call(api_varlen.FORWARD, _FUNC_VARLEN, (*a[:3], o[0]), _with_index(options, *a[3:]), backend)

    _run(ctx, outs, (q, k, v, cu_q, cu_k, used), compute)


def _varlen_backward_callback(options, ctx, outs, dout, q, k, v, out, lse, cu_q, cu_k, used):
    def compute(a, o, backend):
        return _call(api_varlen.BACKWARD, _FUNC_VARLEN, tuple(a[:6]), _with_index(options, *a[6:]), backend)

    _run(ctx, outs, (dout, q, k, v, out, lse, cu_q, cu_k, used), compute)


def _varlen_forward(q, k, v, cu_q, cu_k, used, opts):
    result = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v.shape[-1]), q.dtype),
              jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), _lse_dtype(q.dtype)))
    cb = functools.partial(_varlen_forward_callback, opts)
    return buffer_callback(cb, result)(q, k, v, cu_q, cu_k, used)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention_varlen(q, k, v, cu_q, cu_k, used, opts):
    return _varlen_forward(q, k, v, cu_q, cu_k, used, opts)[0]


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, used, opts):
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, used, opts)
    return out, (q, k, v, out, lse, cu_q, cu_k, used)


def _attention_varlen_bwd(opts, res, dout):
    q, k, v, out, lse, cu_q, cu_k, used = res
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    cb = functools.partial(_varlen_backward_callback, opts)
    dq, dk, dv = buffer_callback(cb, result)(dout.astype(out.dtype), q, k, v, out, lse, cu_q, cu_k, used)
    zero = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)  # noqa: E731  (integer inputs)
    return dq, dk, dv, zero(cu_q), zero(cu_k), zero(used)


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), seqused_k=None, deterministic=False):
    """Differentiable attention over a packed batch of variable-length sequences (JAX arrays).

    The conventions of :func:`cuflash.attention_varlen` (flash-attn's ``flash_attn_varlen_func``,
    FA3's ``seqused_k``); gradients with respect to q, k and v (:func:`cuflash.attention_varlen_backward`)
    through ``jax.custom_vjp``; eager and under ``jax.jit`` and ``jax.grad`` (not ``jax.vmap``: a
    packed batch is already one), on CPU and GPU as :func:`attention`.

    Parameters
    ----------
    q : jax.Array ``(total_q, Hq, D)``
    k, v : jax.Array ``(total_k, Hk, D)``, ``(total_k, Hk, Dv)``
    cu_seqlens_q, cu_seqlens_k : jax.Array, int32 ``(B + 1,)``
        Device-resident, so checked for dtype and shape only (the kernels clamp every index; see
        :func:`cuflash.attention_varlen`).
    max_seqlen_q, max_seqlen_k : int
    causal, softmax_scale, window_size, seqused_k, deterministic
        As :func:`cuflash.attention_varlen` and its backward.

    Returns
    -------
    jax.Array ``(total_q, Hq, Dv)``

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention_varlen`, at trace time (shapes and dtypes only).
    """
    causal = validation.check_flag(causal, "causal", _FUNC_VARLEN)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC_VARLEN)
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{_FUNC_VARLEN}: {name} must be a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    if seqused_k is not None and not hasattr(seqused_k, "dtype"):
        raise TypeError(f"{_FUNC_VARLEN}: seqused_k must be a jax.Array or None, got {type(seqused_k).__qualname__}")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)):
        if x is not None and np.dtype(x.dtype) != np.int32:   # before jnp.asarray, which narrows int64 silently
            raise TypeError(f"{_FUNC_VARLEN}: {name} must be int32, got {name}.dtype={np.dtype(x.dtype)}")
    index = [jnp.asarray(x) for x in (cu_seqlens_q, cu_seqlens_k)]
    used = jnp.zeros((index[0].shape[0] - 1 if index[0].ndim == 1 else 0,), jnp.int32) if seqused_k is None \
        else jnp.asarray(seqused_k)
    # q, k, v and the options as cuflash.attention_varlen checks them (validated as one sequence:
    # device indices have no values to read at trace time); the indices' dtype and shape here
    for name, x, n in (("cu_seqlens_q", index[0], None), ("cu_seqlens_k", index[1], index[0].shape[:1]),
                       ("seqused_k", used, (index[0].shape[0] - 1,) if index[0].ndim == 1 else None)):
        if x.ndim != 1:
            raise ValueError(f"{_FUNC_VARLEN}: {name} must be 1-D, got {name}.shape={x.shape}")
        if n is not None and (name != "seqused_k" or seqused_k is not None) and x.shape != n:
            raise ValueError(f"{_FUNC_VARLEN}: {name}.shape={x.shape} must be {n}")
    if index[0].shape[0] < 1:
        raise ValueError(f"{_FUNC_VARLEN}: cu_seqlens_q must have at least one entry (0)")
    max_q = validation.check_int(max_seqlen_q, "max_seqlen_q", _FUNC_VARLEN)
    max_k = validation.check_int(max_seqlen_k, "max_seqlen_k", _FUNC_VARLEN)
    one = lambda n: np.array([0, n], np.int32)  # noqa: E731
    problem = validation.check_attention_varlen(
        *(_stand_in(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
        Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                packed=PackedOptions(one(q.shape[0]), one(k.shape[0]), q.shape[0], k.shape[0])), func=_FUNC_VARLEN)
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not 0 <= value < 2**31 - 256:
            raise ValueError(f"{_FUNC_VARLEN}: {name}={value} must be in [0, 2**31 - 256)")
    left, right = validation.normalize_window(*validation.check_window_size(window_size, causal, _FUNC_VARLEN),
                                              max_q, max_k)
    opts = Options(causal=problem.causal, softmax_scale=float(problem.softmax_scale), window_size=(left, right),
                   return_lse=True, deterministic=deterministic,   # hashable: custom_vjp's static argument
                   packed=PackedOptions(max_seqlen_q=max_q, max_seqlen_k=max_k,
                                        seqused_k=None if seqused_k is None else _GIVEN))
    return _attention_varlen(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), index[0], index[1], used, opts)
