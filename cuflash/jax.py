"""JAX: :func:`attention` and :func:`attention_varlen`, differentiable (``jax.custom_vjp``), under
``jax.jit``, ``jax.vmap`` and ``jax.grad``, with every option of :func:`cuflash.attention` and
:func:`cuflash.attention_varlen` (score modifiers, dropout, windows, ``return_lse``, ``backend``,
``num_splits``) but fp8 input (``q_descale``, ``k_descale``, ``v_descale`` and ``out_dtype``
are taken, and refused unless None);
:func:`softmax` and :func:`merge_attention`, the forms of :func:`cuflash.softmax` and
:func:`cuflash.merge_attention`, likewise differentiable and traceable.

Importing :mod:`cuflash` never imports JAX; importing ``cuflash.jax`` does (JAX with
``jax.experimental.buffer_callback``, 0.7 and newer).

The forward and the backward each run as one ``buffer_callback`` (JAX's callback that hands the
function the device buffers themselves and, on GPU, XLA's stream), so the same code serves eager
calls and traced ones, and nothing leaves the device:

* CPU arrays: the buffers are NumPy views (``__array__``); cuflash's NumPy implementation (or,
  with ``backend="sim"``, the CUDA kernels on cuflash's CPU simulator) writes the results into
  JAX's output buffers.
* GPU arrays: the buffers are CuPy views (``__cuda_array_interface__``, zero-copy) and the CUDA
  kernels run on XLA's stream (``cupy.cuda.ExternalStream(ctx.stream)``), writing ``out`` in
  place; the LSE is copied into its buffer on the same stream. No host synchronization, no
  device-to-host round trip.

The callbacks run the public functions' pipeline (:func:`cuflash.api.pipeline.run`) under this
module's names, so validation, the backends and the messages are those of :func:`cuflash.attention`.
Array options (the modifiers, the packed batch's indices) are traced inputs of the callbacks;
scalar options are static (compiled into the call).

``jax.vmap`` batches the callbacks with ``vmap_method="broadcast_all"``: the mapped axes become
leading batch dims, which cuflash takes as they are ("bhsd"); inputs without the mapped axis are
broadcast by XLA first. Calls whose meaning depends on the batch index beyond what a batch dim
expresses (``sinks``, dropout, and every packed batch) run the pipeline once per mapped element,
so that ``jax.vmap(f)(x)[i]`` equals ``f(x[i])``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

from cuflash.api import attention as api_attention
from cuflash.api import backward as api_backward
from cuflash.api import pipeline
from cuflash.api import softmax as api_softmax
from cuflash.api import varlen as api_varlen
from cuflash.runtime import dtypes, score_mod, validation, validation_kvcache
from cuflash.runtime.block_mask import BlockMask, own_mask_mod
from cuflash.runtime.score_mod import trace as score_mod_trace
from cuflash.runtime.options import DropoutOptions, Fp8Options, ModifierOptions, Options, PackedOptions

__all__ = ["attention", "attention_varlen", "softmax", "merge_attention"]

_FUNC = "cuflash.jax.attention"
_FUNC_VARLEN = "cuflash.jax.attention_varlen"
_FUNC_SOFTMAX = "cuflash.jax.softmax"
_FUNC_MERGE = "cuflash.jax.merge_attention"
#: the static options' stand-in for an array option the call has (its buffer arrives in the callback)
_GIVEN = "given"
#: the width of the zero values in the backward pass that carries lse's cotangent (16-byte rows)
_LSE_PASS_DV = 8


# --------------------------------------------------------------------------------------------
# the static part of a call and the callbacks


@dataclasses.dataclass(frozen=True)
class _Call:
    """What a traced call fixes (hashable: ``jax.custom_vjp``'s static argument).

    ``options`` hold :data:`_GIVEN` for each array option the call has; the callbacks receive
    those arrays after the operands, in the order of ``options.arrays()``. ``rank`` is q's rank
    in the callback without ``jax.vmap``'s axes."""

    func: str
    forward: pipeline.Entry
    backward: pipeline.Entry
    options: Options
    rank: int

    @property
    def names(self) -> tuple:
        return tuple(name for name, _, _ in self.options.arrays())

    @property
    def per_element(self) -> bool:
        """Whether a mapped call runs the pipeline once per element of ``jax.vmap``'s axes."""
        o = self.options
        return (o.packed is not None or o.modifiers.sinks is not None or bool(o.dropout.p)
                or o.modifiers.score_mod is not None or o.modifiers.mask_mod is not None
                or o.modifiers.block_mask is not None)

    @property
    def traced(self) -> tuple:
        """The traced score_mod and mask_mod (None where absent); their arrays are stand-ins of
        the captured arrays' shapes and dtypes, which the callbacks receive after the array
        options."""
        m = self.options.modifiers
        return m.score_mod, m.mask_mod


def _entries(func: str, forward: pipeline.Entry, backward: pipeline.Entry) -> tuple:
    """The public functions' pipelines under this adapter's name ``func`` (messages name it)."""
    return dataclasses.replace(forward, func=func), dataclasses.replace(backward, func=func)


_ATTENTION = _entries(_FUNC, api_attention.FORWARD, api_backward.BACKWARD)
_VARLEN = _entries(_FUNC_VARLEN, api_varlen.FORWARD, api_varlen.BACKWARD)


def _stand_in(x, dtype=None):
    """A NumPy array of ``x``'s shape and dtype holding one row (stride 0 elsewhere), for the
    validation cuflash.attention does, without materializing anything."""
    shape, dtype = tuple(x.shape), np.dtype(x.dtype if dtype is None else dtype)
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
    or as NumPy arrays (CPU) and call ``compute(xp, inputs, outputs)`` (``xp``: the array
    module), which writes the outputs."""
    if _on_gpu(ins[0]):
        cupy = _cupy()
        with cupy.cuda.ExternalStream(int(ctx.stream)):
            compute(cupy, [cupy.asarray(b) for b in ins], [cupy.asarray(b) for b in outs])
        return
    compute(np, [np.asarray(b) for b in ins], [np.asarray(b) for b in outs])


def _write(results, outs) -> None:
    flat = []
    for r in results:   # the score_mod's captured arrays' gradients come as a dict, in their order
        flat.extend(r.values() if isinstance(r, dict) else (r,))
    for dst, r in zip(outs, flat):
        if r is not dst:
            dst[...] = r


def _elements(call: _Call, q):
    """The index of each pipeline run in a callback's buffers: ``()`` (the whole buffers, one run),
    or every element of ``jax.vmap``'s leading axes for a call that runs per element."""
    extra = q.ndim - call.rank
    if extra <= 0 or not call.per_element:
        yield ()
    else:
        yield from np.ndindex(q.shape[:extra])


def _with_arrays(options: Options, arrays) -> Options:
    """``options`` with each :data:`_GIVEN` replaced by the callback's array, in field order."""
    it = iter(arrays)
    return options.map_arrays(lambda value, name, role: next(it))


def _options_of(call: _Call, arrays) -> Options:
    """``call.options`` with the callback's arrays: the array options (:func:`_with_arrays`),
    then the captured arrays of the score_mod and of the mask_mod in their traced functions."""
    n = len(call.names)
    options = _with_arrays(call.options, arrays[:n])
    captured = list(arrays[n:])
    traced = []
    for t in call.traced:
        if t is not None:
            t = dataclasses.replace(t, arrays=tuple(captured[:len(t.arrays)]))
            del captured[:len(t.arrays)]
        traced.append(t)
    if not any(t is not None for t in traced):
        return options
    return dataclasses.replace(options, modifiers=dataclasses.replace(options.modifiers, score_mod=traced[0],
                                                                      mask_mod=traced[1]))


def _forward_callback(call, ctx, outs, *ins):
    def compute(xp, a, o):
        for idx in _elements(call, a[0]):
            x, y = [b[idx] for b in a], [b[idx] for b in o]
            _write(pipeline.run(call.forward, (*x[:3], y[0]), _options_of(call, x[3:])), y)

    _run(ctx, outs, ins, compute)


def _backward_callback(call, passes, ctx, outs, *ins):
    """``ins``: q, k, v, out, lse, then dout and dlse where ``passes`` (two flags) says so, then
    the array options; ``outs``: dq, dk, dv, then d attn_bias and d sinks where asked for."""
    main, carry_lse = passes

    def compute(xp, a, o):
        for idx in _elements(call, a[0]):
            x, y = [b[idx] for b in a], [b[idx] for b in o]
            q, k, v, out, lse = x[:5]
            options = _options_of(call, x[5 + main + carry_lse:])
            if main:
                _write(pipeline.run(call.backward, (x[5], q, k, v, out, lse), options), y)
            if carry_lse:
                dlse = x[5 + main]
                grads = pipeline.run(call.backward, _lse_pass(xp, call, dlse, q, k, v, out, lse), options)
                grads = [g for r in grads for g in (r.values() if isinstance(r, dict) else (r,))]
                for i, (dst, g) in enumerate(zip(y, grads)):
                    if i == 2:      # dv of the zero values
                        if not main:
                            dst[...] = 0
                    elif main:
                        dst += g
                    else:
                        dst[...] = g

    _run(ctx, outs, ins, compute)


def _lse_pass(xp, call: _Call, dlse, q, k, v, out, lse) -> tuple:
    """The backward's operands whose gradients are lse's cotangent's share.

    ``d lse_i / d s_ij = P_ij``, so the cotangent ``dlse`` adds ``P * dlse`` to ``dS = P * (dP -
    D)``: the backward of values that are zero (``dP = 0``) with a ``(dout, out)`` pair whose row
    dot product is ``D = -dlse`` (``dlse`` split into two terms of out's dtype, so the float32
    sum keeps its precision; for float16 each row scaled by a power of two that ``out`` carries,
    so the terms stay in its range). The sink and bias gradients follow from ``dS`` and ``D``
    alike."""
    rows = dlse.T if call.options.packed is not None else dlse   # (Hq, total_q) -> out's rows
    unit = 1.0
    if out.dtype == np.float16:   # its narrow range: carry each row as (dlse / 2^e) * 2^e, 2^e in [2^-14, 2^15]
        unit = xp.exp2(xp.clip(xp.ceil(xp.log2(xp.maximum(xp.abs(rows), 2.0**-24))), -14, 15)).astype(rows.dtype)
        rows = rows / unit
    hi = rows.astype(out.dtype)
    lo = (rows - hi.astype(rows.dtype)).astype(out.dtype)
    shape = out.shape[:-1] + (_LSE_PASS_DV,)
    dout2, out2 = xp.zeros(shape, out.dtype), xp.zeros(shape, out.dtype)
    dout2[..., 0], dout2[..., 1] = hi, lo
    out2[..., 0] = out2[..., 1] = -unit
    return dout2, q, k, xp.zeros(v.shape[:-1] + (_LSE_PASS_DV,), v.dtype), out2, lse


def _cupy():
    """CuPy, which the GPU branch of the callbacks needs (a clear error where it is missing)."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("cuflash.jax: JAX GPU arrays run the CUDA kernels through CuPy, which is not "
                           f"installed ({e}); pip install 'cuflash[cuda12]' (or [cuda13]), or from a source "
                           "checkout pip install '.[cuda12]' (or '.[cuda13]')") from None
    return cupy


def _lse_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# --------------------------------------------------------------------------------------------
# the differentiable core both public functions share


def _forward(q, k, v, arrays, call: _Call):
    if call.options.packed is None:
        out_shape, lse_shape = q.shape[:-1] + (v.shape[-1],), q.shape[:-1]
    else:   # (total_q, Hq, Dv) and (Hq, total_q)
        out_shape, lse_shape = q.shape[:2] + (v.shape[-1],), (q.shape[1], q.shape[0])
    result = (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, _lse_dtype(q.dtype)))
    cb = functools.partial(_forward_callback, call)
    return buffer_callback(cb, result, vmap_method="broadcast_all")(q, k, v, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(q, k, v, arrays, call):
    """``(out, lse)``; ``arrays`` are the array options in ``call.names``' order."""
    return _forward(q, k, v, arrays, call)


def _core_fwd(q, k, v, arrays, call):
    perturbed = _Perturbed(tuple(a.perturbed for a in arrays))
    q, k, v = q.value, k.value, v.value
    arrays = tuple(a.value for a in arrays)
    out, lse = _forward(q, k, v, arrays, call)
    return (out, lse), (perturbed, q, k, v, out, lse, arrays)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Which array options carry a perturbation (static residual: the backward asks for
    ``d attn_bias`` and ``d sinks`` only when they do)."""

    flags: tuple


def _core_bwd(call, res, cotangents):
    perturbed, q, k, v, out, lse, arrays = res
    dout, dlse = cotangents
    none = (None, None, None, (None,) * len(arrays))
    main, carry_lse = not isinstance(dout, SymbolicZero), not isinstance(dlse, SymbolicZero)
    if call.options.packed is not None and call.options.packed.block_table is not None:
        raise TypeError(f"{call.func}: block_table has no gradient: attention over a paged KV cache has no "
                        "backward in cuflash; differentiate a call without block_table (k and v packed as "
                        "(total_k, Hk, D)), or apply jax.lax.stop_gradient to q, k and v")
    if not (main or carry_lse):
        return none
    names = call.names
    want = {n: n in names and perturbed.flags[names.index(n)] for n in ("attn_bias", "sinks")}
    # the score_mod's captured float arrays (after the array options): their gradients when one is perturbed
    score = call.traced[0]
    floats = () if score is None else tuple(len(names) + i for i in score_mod.float_slots(score))
    want_mod = any(perturbed.flags[i] for i in floats)
    options = dataclasses.replace(call.options, return_lse=False, return_dbias=want["attn_bias"],
                                  return_dsinks=want["sinks"], return_dscore_mod=want_mod)
    result = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    for name in ("attn_bias", "sinks"):
        if want[name]:
            a = arrays[names.index(name)]
            result.append(jax.ShapeDtypeStruct(a.shape, a.dtype if name == "attn_bias" else _lse_dtype(q.dtype)))
    if want_mod:
        result += [jax.ShapeDtypeStruct(arrays[i].shape, arrays[i].dtype) for i in floats]
    ins = [q, k, v, out, lse] + ([dout.astype(out.dtype)] if main else []) + \
          ([dlse.astype(lse.dtype)] if carry_lse else []) + list(arrays)
    cb = functools.partial(_backward_callback, dataclasses.replace(call, options=options), (main, carry_lse))
    grads = list(buffer_callback(cb, tuple(result), vmap_method="broadcast_all")(*ins))
    dq, dk, dv = grads[:3]
    extra = iter(grads[3:])
    darrays = [next(extra).astype(a.dtype) if want.get(n) else None for n, a in zip(names, arrays)]
    darrays += [None] * (len(arrays) - len(names))
    for i in floats if want_mod else ():
        g = next(extra)
        darrays[i] = g if perturbed.flags[i] else None
    return dq, dk, dv, tuple(darrays)


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------
# argument checks shared by both public functions


def _check_arrays(func: str, arrays: dict, optional: dict) -> None:
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{func}: {name} must be a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    for name, x in optional.items():
        if x is not None and (not hasattr(x, "shape") or not hasattr(x, "dtype")):
            raise TypeError(f"{func}: {name} must be a jax.Array or None, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")


def _check_static(func: str, scalars: dict) -> None:
    """Scalar options are compiled into the call: a JAX array (traced or not) is refused by name."""
    for name, x in scalars.items():
        if isinstance(x, jax.Array):
            raise TypeError(f"{func}: {name} must be a Python number (a static option, compiled into the call), "
                            f"got a jax.Array of shape {tuple(x.shape)}; under jax.jit pass it as a static "
                            f"argument (static_argnames)")


def _check_out(func: str, out) -> None:
    if out is not None:
        raise TypeError(f"{func}: out must be None: JAX arrays are immutable, so the result is always a new "
                        f"array (got out of type {type(out).__module__}.{type(out).__qualname__})")


def _refuse_fp8(func: str, public: str, fp8: dict, arrays: tuple) -> None:
    """The fp8 options (``q_descale``, ``k_descale``, ``v_descale``, ``out_dtype``): taken as the
    public function takes them, refused by name when given with float8 ``arrays`` (q, k, v; fp8
    input has no form here). Given with other input they reach the shared validation, which
    raises the public function's ``ValueError``."""
    if not any(dtypes.is_fp8(getattr(a, "dtype", None)) for a in arrays):
        return
    for name, x in fp8.items():
        if x is not None:
            got = (f"an array of shape {tuple(x.shape)}" if hasattr(x, "shape") else
                   f"{x!r} ({type(x).__name__})")
            raise NotImplementedError(f"{func}: {name} must be None: fp8 input has no form in cuflash.jax (its "
                                      f"forward has no backward); call {public} on concrete arrays outside "
                                      f"jax.jit and jax.grad; got {got}")


def _check_backend(func: str, backend, q) -> None:
    """The backend's name, and for a concrete array (an eager call) its fit with q's device; under
    ``jax.jit`` the device is known when the call runs, where the pipeline checks it."""
    if backend not in pipeline.BACKENDS:
        raise ValueError(f"{func}: backend must be one of {pipeline.BACKENDS}, got {backend!r}")
    if isinstance(q, jax.core.Tracer):
        return
    devices = q.devices() if isinstance(q, jax.Array) else [jax.devices()[0]]   # NumPy: JAX's default device
    host = all(d.platform == "cpu" for d in devices)
    pipeline.resolve_backend(backend, "numpy" if host else "jax", func)


def _dropout(problem) -> DropoutOptions:
    d = problem.dropout
    return DropoutOptions() if d is None else DropoutOptions(d.p, d.seed, d.offset)


def _softcap(problem) -> float:
    return 0.0 if problem.modifiers is None else float(problem.modifiers.softcap)


def _given(x):
    return None if x is None else _GIVEN


@dataclasses.dataclass(frozen=True, eq=False)
class _StaticMod(score_mod.TracedMod):
    """A traced score_mod or mask_mod in the static part of a call: equal to another when the
    call it compiles is the same (role, canonical text, variable names, and the stand-in
    arrays' shapes and dtypes), so a new closure of the same function, or new values of its
    captured arrays, reuse the traced call instead of tracing it again."""

    def _what(self) -> tuple:
        return (self.role, self.key, self.names, tuple((a.shape, str(a.dtype)) for a in self.arrays))

    def __eq__(self, other):
        return type(other) is _StaticMod and self._what() == other._what()

    def __hash__(self):
        return hash(self._what())


def _trace_mods(score_mod, mask_mod) -> tuple:
    """``((score, mask), captured)``: the traced functions with NumPy stand-ins of their captured
    arrays' shapes and dtypes (nothing of JAX's traces is kept in the static call), and the
    captured arrays themselves as JAX arrays (the score_mod's, then the mask_mod's)."""
    traced, captured = [], []
    for fn, role in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if fn is None:
            traced.append(None)
            continue
        t = score_mod_trace(fn, role, _FUNC)
        captured += [jnp.asarray(a) for a in t.arrays]
        traced.append(_StaticMod(t.role, t.expr, tuple(_stand_in(a) for a in t.arrays), t.names, t.key, None))
    return tuple(traced), tuple(captured)


def _stand_in_block_mask(block_mask):
    """``block_mask`` with NumPy stand-ins of its index arrays and of its mask_mod's captured
    arrays (shapes and dtypes only), for the trace-time validation on stand-in operands (None
    stays None; anything else is passed on, for the validation to refuse by name)."""
    if not isinstance(block_mask, BlockMask):
        return block_mask
    mm = block_mask.mask_mod
    return dataclasses.replace(block_mask.with_arrays(_stand_in),
                               mask_mod=dataclasses.replace(mm, arrays=tuple(_stand_in(a) for a in mm.arrays)))


def _check_block_mask_kind(block_mask, q) -> None:
    """A block mask's arrays of the kind q's buffers will be: NumPy for CPU arrays, device
    (CuPy) arrays for GPU ones. Checked for a concrete q (an eager call); under ``jax.jit`` the
    device is known when the call runs, where the pipeline checks it.

    Raises
    ------
    TypeError
        The other kind, naming ``block_mask`` and the ``device=`` that builds the right one.
    """
    if block_mask is None or isinstance(q, jax.core.Tracer):
        return
    devices = q.devices() if isinstance(q, jax.Array) else [jax.devices()[0]]
    host = all(d.platform == "cpu" for d in devices)
    a = block_mask.kv_num_blocks
    kind = "NumPy" if isinstance(a, np.ndarray) else ("CuPy" if type(a).__module__.split(".")[0] == "cupy" else
                                                      f"{type(a).__module__}.{type(a).__qualname__}")
    if kind != ("NumPy" if host else "CuPy"):
        raise TypeError(f"{_FUNC}: block_mask holds {kind} arrays, q is a JAX array on {'the CPU' if host else 'a GPU'}"
                        f", which takes {'NumPy' if host else 'CuPy'} ones; build it with create_block_mask(..., "
                        f"device={'cpu' if host else 'cuda'!r})")


# --------------------------------------------------------------------------------------------
# fixed-shape attention


@functools.partial(jax.jit, static_argnames=("call", "layout"))
def _fixed(q, k, v, mods: dict, captured: tuple = (), *, call: _Call, layout: str):
    """:func:`attention` after validation, as one jitted computation (an eager call compiles once
    per shape, not once per operation): the callbacks run "bhsd" of rank >= 3, so that mapped
    axes lead and the modifiers line up with them."""
    if layout == "bshd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    one_head = q.ndim == 2
    if one_head:
        q, k, v = q[None], k[None], v[None]
    arrays = dict(mods)
    if "alibi_slopes" in arrays:   # constants, in the batched form (*batch, Hq) that a mapped axis extends
        arrays["alibi_slopes"] = jnp.broadcast_to(jax.lax.stop_gradient(arrays["alibi_slopes"]), q.shape[:-2])
    for name in ("attn_bias", "attn_mask"):
        if name in arrays:   # rank q.ndim: a mapped axis leads both
            x = arrays[name]
            arrays[name] = x.reshape((1,) * (q.ndim - x.ndim) + x.shape)
    o, lse = _core(q, k, v, tuple(arrays[n] for n in call.names) + tuple(captured), call)
    if one_head:
        o, lse = o[0], lse[0]
    if layout == "bshd":
        o = jnp.swapaxes(o, 1, 2)
    return o, lse


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
              out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
              alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
              deterministic=False, block_mask=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Differentiable exact attention for JAX arrays: ``softmax(softmax_scale * q k^T + mask) v``.

    Every parameter, convention and return value of :func:`cuflash.attention` (GQA/MQA,
    bottom-right causal alignment, ``window_size``, the score modifiers, dropout, rows without
    keys -> 0 and ``lse = -inf``) but fp8 input, plus the backward's ``deterministic``. The gradient is
    cuflash's FlashAttention-2 backward (:func:`cuflash.attention_backward`; Dao 2023, Algorithm
    2) through ``jax.custom_vjp``. Works eagerly and under ``jax.jit``, ``jax.vmap`` (mapped axes
    become batch dims) and ``jax.grad``, on CPU (the NumPy implementation, or the CUDA kernels on
    cuflash's simulator) and GPU (the CUDA kernels on XLA's stream).

    Parameters
    ----------
    q : jax.Array, shape ``(..., Sq, D)`` ("bhsd") or ``(B, Sq, Hq, D)`` ("bshd")
    k : jax.Array, shape ``(..., Sk, D)`` or ``(B, Sk, Hk, D)``
    v : jax.Array, shape ``(..., Sk, Dv)`` or ``(B, Sk, Hk, Dv)``
        One dtype: float16, bfloat16, float32 (float64 with ``jax_enable_x64`` on the NumPy path).
    causal : bool
        Query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq`` (flash-attn's alignment; ``jax.nn.
        dot_product_attention``'s ``is_causal`` aligns top-left, the same when ``Sq == Sk``).
    softmax_scale : float, optional
        None means ``1/sqrt(D)``.
    window_size : (int, int)
        ``(left, right)``, -1 = unbounded.
    return_lse : bool
        Also return the log-sum-exp of each row (natural log). Its cotangent is honoured: a loss
        that uses ``lse`` gets ``d lse_i / d s_ij = P_ij`` in the gradients of q, k, ``attn_bias``
        and ``sinks``. That costs one more backward pass, run only when the cotangent is not
        JAX's symbolic zero (a loss that ignores ``lse`` pays nothing).
    layout : {"bhsd", "bshd"}
    out : None
        Must be None: JAX arrays are immutable, so the result is always a new array (an array
        raises ``TypeError``).
    backend : {"auto", "numpy", "sim", "cuda"}
        "auto": CPU arrays run the NumPy implementation, GPU arrays the CUDA kernels (the
        ``CUFLASH_BACKEND`` environment variable overrides "auto" only). "numpy" and "sim" (the
        CUDA kernels on cuflash's CPU simulator) take CPU arrays, "cuda" GPU arrays. Checked when
        called on concrete arrays; under ``jax.jit`` a backend that does not fit the device raises
        when the call runs (JAX reports the error raised in its callback).
    dropout_p, dropout_seed, dropout_offset
        Attention dropout as :func:`cuflash.attention` (Philox 4x32-10; the seed is required with
        ``dropout_p > 0``): static Python numbers, compiled into the call (a ``jax.Array`` raises
        ``TypeError``). The backward regenerates the same mask. Under ``jax.vmap`` each mapped
        element gets the mask the unmapped call would get, so every element draws the same mask.
    softcap : float
        ``softcap * tanh(s / softcap)`` on the scaled scores; 0 is off. Static, as ``dropout_p``.
    alibi_slopes : jax.Array, float32, ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi (``-slope * |i + Sk - Sq - j|``). Constants: cuflash computes no gradient for the
        slopes, and JAX cannot refuse a cotangent asked for later, so the slopes pass through
        ``jax.lax.stop_gradient`` (their gradient is 0).
    attn_bias : jax.Array, q's dtype or float32, broadcastable to ``(B, Hq, Sq, Sk)``, optional
        Additive bias (indexed by batch, head, query, key in both layouts). Differentiable: its
        cotangent is ``dS`` summed over the axes it broadcasts over (computed only when the bias
        is being differentiated).
    attn_mask : jax.Array, bool, broadcastable likewise, optional
        True = attend. No gradient (a bool array has none).
    sinks : jax.Array, float32 ``(Hq,)``, optional
        One logit per head in each row's softmax denominator. Differentiable (float32 cotangent).
    score_mod, mask_mod : callable, optional
        As :func:`cuflash.attention` takes them (traced once per call, at trace time; refusals
        are raised then). The arrays they capture (``jax.Array`` or NumPy) become traced inputs
        of the call, so new values compile nothing and ``jax.grad`` reaches them: a score_mod's
        captured float arrays are differentiable (their cotangent is
        :func:`cuflash.attention_backward`'s ``return_dscore_mod``: the NumPy path, or the
        tensor-core backward, bit-identical run to run with ``deterministic=True``); a mask_mod's
        get none. Under ``jax.vmap`` such a call runs the pipeline once
        per mapped element.
    deterministic : bool
        The backward's, on the kernel backends (see :func:`cuflash.attention_backward`).
    block_mask : BlockMask, optional
        A block-sparse mask (:func:`cuflash.create_block_mask`), as :func:`cuflash.attention`
        takes it; the forward and the backward visit only its listed blocks. It is static, a
        part of the compiled call hashed by identity: the same ``BlockMask`` object compiles
        once, a new one (even an equal one) compiles again, so build it once, before the
        function is traced (its index arrays are NumPy or device arrays, never JAX tracers;
        reading them never syncs the device at trace time). ``mask_mod`` None means the block
        mask's own; a ``mask_mod`` given too must be the function it was built from. Its
        mask_mod's captured arrays stay those it was built with (static, no gradient). NumPy
        index arrays serve CPU arrays (the NumPy path and ``backend="sim"``), device ones
        (``device="cuda"``) GPU arrays; the other kind is a ``TypeError`` at trace time for a
        concrete q, and under ``jax.jit`` when the call runs. Under ``jax.vmap`` such a call
        runs the pipeline once per mapped element.
    q_descale, k_descale, v_descale, out_dtype : None
        fp8 input has no form here: each must be None (a value raises ``NotImplementedError``
        naming it; float8 q, k, v likewise). :func:`cuflash.attention` runs the fp8 forward on
        concrete arrays, outside ``jax.jit`` and ``jax.grad``.

    The modifier arrays are traced like q, k and v. Under ``jax.vmap`` they may carry the mapped
    axis or not: ALiBi slopes, bias and mask batch with the call (one kernel call); with
    ``sinks`` or dropout the pipeline runs once per mapped element.

    Returns
    -------
    out : jax.Array of q's dtype, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)``
    lse : jax.Array, float32 (float64 for float64 input), shape ``q.shape[:-1]`` ("bhsd") or
        ``(B, Hq, Sq)`` ("bshd"); only with ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention`, at trace time (shapes, dtypes and static options only);
        ``TypeError`` for ``out`` or for a scalar option given as a ``jax.Array``; for a
        ``block_mask``, ``ValueError`` when built for other lengths, batch or heads or with
        another ``mask_mod``, ``TypeError`` for one that is not a ``BlockMask`` or of the other
        array kind; ``NotImplementedError`` for float8 input (with an fp8 option that is not None,
        naming it); an fp8 option with other input is the ``ValueError`` of :func:`cuflash.attention`.
    """
    _check_out(_FUNC, out)
    _refuse_fp8(_FUNC, "cuflash.attention", dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                                 out_dtype=out_dtype), (q, k, v))
    if block_mask is not None:   # static: its own mask_mod (checked here) and its arrays stay in the call
        mask_mod = own_mask_mod(block_mask, mask_mod, _FUNC)
    causal = validation.check_flag(causal, "causal", _FUNC)
    return_lse = validation.check_flag(return_lse, "return_lse", _FUNC)
    deterministic = validation.check_flag(deterministic, "deterministic", _FUNC)
    layout = validation.check_layout(layout, _FUNC)
    _check_static(_FUNC, dict(softmax_scale=softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                              dropout_offset=dropout_offset, softcap=softcap))
    mods = dict(alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask, sinks=sinks)
    _check_arrays(_FUNC, {"q": q, "k": k, "v": v}, mods)
    stand = {n: None if x is None else _stand_in(x) for n, x in mods.items()}
    traced, captured = _trace_mods(score_mod, None if block_mask is not None else mask_mod)
    problem = validation.check_attention(
        _stand_in(q), _stand_in(k), _stand_in(v),
        Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                modifiers=ModifierOptions(softcap, **stand, score_mod=traced[0], mask_mod=traced[1],
                                          block_mask=_stand_in_block_mask(block_mask)),
                fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype)), func=_FUNC)
    _check_backend(_FUNC, backend, q)
    _check_block_mask_kind(block_mask, q)
    present = {n: x for n, x in mods.items() if x is not None}
    options = Options(causal=problem.causal, softmax_scale=float(problem.softmax_scale),
                      window_size=(problem.window_left, problem.window_right), return_lse=True, backend=backend,
                      deterministic=deterministic, dropout=_dropout(problem),
                      modifiers=ModifierOptions(_softcap(problem), *(_given(x) for x in mods.values()), *traced,
                                                block_mask))
    call = _Call(_FUNC, *_ATTENTION, options, max(q.ndim, 3))
    o, lse = _fixed(q, k, v, present, captured, call=call, layout=layout)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------
# packed variable-length batches


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), seqused_k=None, block_table=None, return_lse=False,
                     out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
                     alibi_slopes=None, score_mod=None, mask_mod=None, deterministic=False, num_splits=1,
                     q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Differentiable attention over a packed batch of variable-length sequences (JAX arrays).

    Every parameter, convention and return value of :func:`cuflash.attention_varlen` but fp8 input
    (flash-attn's ``flash_attn_varlen_func``, FA3's ``seqused_k``), plus the backward's
    ``deterministic``; gradients with respect to q, k and v (:func:`cuflash.attention_varlen_backward`)
    through ``jax.custom_vjp``; eager and under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (the
    pipeline runs once per mapped element), on CPU and GPU as :func:`attention`.

    Parameters
    ----------
    q : jax.Array ``(total_q, Hq, D)``
    k, v : jax.Array ``(total_k, Hk, D)``, ``(total_k, Hk, Dv)``
        Or, with ``block_table``, the paged caches ``(num_pages, page_size, Hk, D|Dv)``.
    cu_seqlens_q, cu_seqlens_k : jax.Array, int32 ``(B + 1,)``
        Device-resident, so checked for dtype and shape only (the kernels clamp every index; see
        :func:`cuflash.attention_varlen`).
    max_seqlen_q, max_seqlen_k : int
    causal, softmax_scale, window_size, seqused_k
        As :func:`cuflash.attention_varlen` (``seqused_k``: int32 ``(B,)`` jax.Array).
    block_table : jax.Array, int32 ``(B, max_pages)``, optional
        Chunked prefill over a paged KV cache, as :func:`cuflash.attention_varlen`; forward only:
        cuflash has no backward over a paged cache, so differentiating such a call (``jax.grad``
        reaching q, k or v) raises ``TypeError`` naming ``block_table`` when JAX builds the
        gradient (not when the forward is traced: whether a gradient will be taken is not known
        then). Apply ``jax.lax.stop_gradient`` to q, k and v to use it inside a differentiated
        function.
    return_lse : bool
        Also return the log-sum-exp, ``(Hq, total_q)``; its cotangent is honoured, as in
        :func:`attention`.
    out : None
        Must be None (JAX arrays are immutable; an array raises ``TypeError``).
    backend : {"auto", "numpy", "sim", "cuda"}
        As :func:`attention`.
    dropout_p, dropout_seed, dropout_offset, softcap
        As :func:`attention` (static Python numbers).
    alibi_slopes : jax.Array, float32 ``(Hq,)`` or ``(B, Hq)``, optional
        Constants, as in :func:`attention` (``jax.lax.stop_gradient``: cuflash computes no
        gradient for them).
    score_mod, mask_mod : callable, optional
        Not here yet: given, they raise ``NotImplementedError`` (:func:`cuflash.attention_varlen`
        takes them on concrete arrays, and :func:`attention` through ``jax.grad``).
    deterministic : bool
        The backward's (see :func:`cuflash.attention_varlen_backward`).
    num_splits : int, default 1
        Split-KV with a ``block_table``, as :func:`cuflash.attention_varlen` takes it: an int in
        ``[0, 256]``; 1 runs unsplit, 0 chooses from the shapes and the SM count (never from the
        lengths). A performance hint: only the Hopper chunked-prefill form splits (GPU arrays,
        or CPU arrays with ``backend="sim"``); the NumPy path runs unsplit. Static, as
        ``dropout_p`` (a ``jax.Array`` raises ``TypeError``).
    q_descale, k_descale, v_descale, out_dtype : None
        As in :func:`attention`: each must be None (fp8 input has no form here).

    Returns
    -------
    out : jax.Array ``(total_q, Hq, Dv)``
    lse : jax.Array ``(Hq, total_q)``, float32 (float64 for float64 input); only with ``return_lse``.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`cuflash.attention_varlen`, at trace time (shapes, dtypes and static options;
        the device indices' values are not read); ``TypeError`` for ``out``, a scalar option
        given as a ``jax.Array``, or a gradient through ``block_table``; ``NotImplementedError``
        for float8 input (with an fp8 option that is not None, naming it); an fp8 option with
        other input is the ``ValueError`` of :func:`cuflash.attention_varlen`.
    """
    func = _FUNC_VARLEN
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None:
            raise NotImplementedError(f"{func}: {name} on a packed batch is not in cuflash.jax yet; call "
                                      f"cuflash.attention_varlen on concrete arrays, or cuflash.jax.attention per "
                                      f"sequence")
    _check_out(func, out)
    _refuse_fp8(func, "cuflash.attention_varlen", dict(q_descale=q_descale, k_descale=k_descale,
                                                       v_descale=v_descale, out_dtype=out_dtype), (q, k, v))
    causal = validation.check_flag(causal, "causal", func)
    return_lse = validation.check_flag(return_lse, "return_lse", func)
    deterministic = validation.check_flag(deterministic, "deterministic", func)
    _check_static(func, dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                             dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                             softcap=softcap, num_splits=num_splits))
    optional = dict(seqused_k=seqused_k, block_table=block_table, alibi_slopes=alibi_slopes)
    _check_arrays(func, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
                  optional)
    index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table)
    for name, x in index.items():
        if x is not None and np.dtype(x.dtype) != np.int32:   # before jnp.asarray, which narrows int64 silently
            raise TypeError(f"{func}: {name} must be int32, got {name}.dtype={np.dtype(x.dtype)}")
    cq, ck = (tuple(x.shape) for x in (cu_seqlens_q, cu_seqlens_k))
    batch = cq[0] - 1 if len(cq) == 1 else 0
    for name, x, n in (("cu_seqlens_q", cu_seqlens_q, None), ("cu_seqlens_k", cu_seqlens_k, cq[:1]),
                       ("seqused_k", seqused_k, (batch,))):
        if x is None:
            continue
        if x.ndim != 1:
            raise ValueError(f"{func}: {name} must be 1-D, got {name}.shape={tuple(x.shape)}")
        if n is not None and tuple(x.shape) != n:
            raise ValueError(f"{func}: {name}.shape={tuple(x.shape)} must be {n}")
    if batch < 0:
        raise ValueError(f"{func}: cu_seqlens_q must have at least one entry (0)")
    max_q = validation.check_int(max_seqlen_q, "max_seqlen_q", func)
    max_k = validation.check_int(max_seqlen_k, "max_seqlen_k", func)
    splits = validation.check_num_splits(num_splits, func)
    # q, k, v and the options as cuflash.attention_varlen checks them, on host indices of the
    # batch's size whose values fit any call (device indices have no values to read at trace time)
    total_q, total_k = q.shape[0] if q.ndim else 0, k.shape[0] if k.ndim else 0
    ends = lambda total: np.array([0] * batch + [total], np.int32)  # noqa: E731
    packed = PackedOptions(ends(total_q), np.zeros(batch + 1, np.int32) if block_table is not None else ends(total_k),
                           total_q, total_k,
                           None if seqused_k is None else np.zeros(batch, np.int32),
                           None if block_table is None else np.zeros(tuple(block_table.shape), np.int32), splits)
    problem = validation.check_attention_varlen(
        _stand_in(q), _stand_in(k), _stand_in(v),
        Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                modifiers=ModifierOptions(softcap, None if alibi_slopes is None else _stand_in(alibi_slopes)),
                packed=packed, fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype)), func=func,
        cache_check=validation_kvcache.varlen_cache)
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not 0 <= value < 2**31 - 256:
            raise ValueError(f"{func}: {name}={value} must be in [0, 2**31 - 256)")
    left, right = validation.normalize_window(*validation.check_window_size(window_size, causal, func), max_q, max_k)
    _check_backend(func, backend, q)
    arrays = {n: x for n, x in dict(alibi_slopes=alibi_slopes, **index).items() if x is not None}
    options = Options(causal=problem.causal, softmax_scale=float(problem.softmax_scale), window_size=(left, right),
                      return_lse=True, backend=backend, deterministic=deterministic, dropout=_dropout(problem),
                      modifiers=ModifierOptions(_softcap(problem), _given(alibi_slopes)),
                      packed=PackedOptions(_GIVEN, _GIVEN, max_q, max_k, _given(seqused_k), _given(block_table),
                                           splits))
    o, lse = _packed(q, k, v, arrays, call=_Call(func, *_VARLEN, options, 3))
    return (o, lse) if return_lse else o


@functools.partial(jax.jit, static_argnames=("call",))
def _packed(q, k, v, arrays: dict, *, call: _Call):
    """:func:`attention_varlen` after validation, as one jitted computation."""
    if "alibi_slopes" in arrays:   # constants
        arrays = dict(arrays, alibi_slopes=jax.lax.stop_gradient(arrays["alibi_slopes"]))
    return _core(q, k, v, tuple(arrays[n] for n in call.names), call)


# --------------------------------------------------------------------------------------------
# softmax


#: :func:`cuflash.softmax`'s pipeline under this adapter's name
_SOFTMAX = dataclasses.replace(api_softmax.SOFTMAX, func=_FUNC_SOFTMAX)


def softmax(x, axis=-1, *, backend="auto"):
    """Differentiable softmax of a JAX array along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    The forward is :func:`cuflash.softmax` (the online-normalizer kernel, or its NumPy
    implementation) run in one ``buffer_callback`` on JAX's buffers, as :func:`attention` runs
    its forward; the gradient (``jax.custom_vjp``) is ``dx = y * (g - sum(g * y, axis))`` in
    ``jax.numpy`` operations, in float32 (float64 for float64 input), rounded once to x's dtype.
    Works eagerly and under ``jax.jit``, ``jax.vmap`` (mapped axes become leading axes of the
    callback's buffers; ``axis`` refers to the unmapped array) and ``jax.grad``, on CPU and GPU.

    Parameters
    ----------
    x : jax.Array (or a NumPy array), at least 1-D
        dtype float16, bfloat16, float32, or float64 (with ``jax_enable_x64``; NumPy path only).
    axis : int, default -1
        Axis to normalize over; a static Python int (compiled into the call).
    backend : {"auto", "numpy", "sim", "cuda"}, default "auto"
        As :func:`attention`: "auto" runs the NumPy implementation for CPU arrays and the CUDA
        kernel for GPU arrays (``CUFLASH_BACKEND`` overrides "auto" only); "numpy" and "sim" take
        CPU arrays, "cuda" GPU arrays. Checked when called on concrete arrays; under ``jax.jit`` a
        backend that does not fit the device raises when the call runs.

    Returns
    -------
    jax.Array
        Same shape and dtype as ``x``. ``-inf`` entries get probability 0, a row of only ``-inf``
        gives NaN, a NaN makes its whole row NaN (as :func:`cuflash.softmax`); the gradient of a
        NaN row is NaN, of a ``-inf`` entry 0.

    Raises
    ------
    TypeError
        ``x`` not an array, an unsupported dtype, ``axis`` not an int (a ``jax.Array`` included:
        the axis is static).
    ValueError
        A 0-d ``x``, an out-of-range ``axis``, an unknown backend, or (for concrete arrays) a
        backend that does not fit their device.
    NotImplementedError
        float64 input with ``backend="sim"`` or ``"cuda"`` (the kernels compute float16, bfloat16
        and float32).
    """
    func = _FUNC_SOFTMAX
    _check_arrays(func, {"x": x}, {})
    try:
        dtype = np.dtype(x.dtype)
    except TypeError:
        dtype = None
    allowed = (np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float64))
    if dtype not in allowed:
        raise TypeError(f"{func}: x.dtype must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{func}: axis must be an int, got {type(axis).__name__}")
    ndim = len(x.shape)
    if ndim == 0:
        raise ValueError(f"{func}: x must have at least 1 dimension, got a 0-d array")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{func}: axis={axis} must be in [{-ndim}, {ndim - 1}] for x.ndim={ndim}")
    _check_backend(func, backend, x)
    explicit = backend if backend != "auto" else pipeline.env_backend(func)
    if dtype == np.float64 and explicit in ("sim", "cuda"):
        raise NotImplementedError(f"{func}: the kernels compute float16, bfloat16 and float32; float64 runs on the "
                                  f"NumPy path only (backend='numpy'), got backend={explicit!r}")
    # counted from the end, so that the leading axes jax.vmap adds to the callback's buffers leave it in place
    return _softmax(x, axis=int(axis) % ndim - ndim, backend=backend)


@functools.partial(jax.jit, static_argnames=("axis", "backend"))
def _softmax(x, *, axis: int, backend: str):
    """:func:`softmax` after validation (``axis`` negative), one jitted computation."""
    if x.size == 0:   # nothing to normalize, and no callback on an empty buffer
        return x
    return _softmax_core(x, axis, backend)


def _softmax_forward(x, axis: int, backend: str):
    cb = functools.partial(_softmax_callback, axis, backend)
    return buffer_callback(cb, (jax.ShapeDtypeStruct(x.shape, x.dtype),), vmap_method="broadcast_all")(x)[0]


def _softmax_callback(axis, backend, ctx, outs, x):
    def compute(xp, a, o):
        _write((pipeline.run(_SOFTMAX, (a[0],), Options(backend=backend, axis=axis)),), o)

    _run(ctx, outs, (x,), compute)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _softmax_core(x, axis, backend):
    return _softmax_forward(x, axis, backend)


def _softmax_fwd(x, axis, backend):
    y = _softmax_forward(x, axis, backend)
    return y, y


def _softmax_bwd(axis, backend, y, g):
    acc = _lse_dtype(y.dtype)
    yf, gf = y.astype(acc), g.astype(acc)
    return ((yf * (gf - jnp.sum(gf * yf, axis=axis, keepdims=True))).astype(y.dtype),)


_softmax_core.defvjp(_softmax_fwd, _softmax_bwd)


# --------------------------------------------------------------------------------------------
# merging partial attention results


def merge_attention(outs, lses):
    """Combine attention results over disjoint key sets into the result over their union
    (JAX arrays; differentiable in every ``out`` and ``lse``).

    ``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i`` in float32
    (float64 if any part is float64), the result rounded once to the parts' dtype, with
    :func:`cuflash.merge_attention`'s rule for empty and non-finite parts: a part with ``lse =
    -inf`` adds nothing, even when its ``out`` holds NaN or garbage (its gradients are 0); a row
    where every part has ``-inf`` gives 0 and ``-inf`` (zero gradients, no NaN from ``-inf -
    -inf``); every other part counts, so a NaN ``lse``, or a NaN in the ``out`` of a part whose
    ``lse`` is not ``-inf``, makes its row NaN.

    The merge is written in ``jax.numpy`` operations, not a callback: it is elementwise work
    and one reduction over the parts (on the GPU, :func:`cuflash.merge_attention` itself runs
    it as CuPy array operations, not a kernel), which XLA fuses into the surrounding
    computation; JAX's autodiff then gives the exact gradient in every input, and ``jax.jit``,
    ``jax.vmap`` and ``jax.grad`` need nothing more. The row maximum that shifts the
    exponentials carries no gradient (``jax.lax.stop_gradient``: the result does not depend on
    it), and an empty part's ``out`` is replaced by 0 before it is weighted, so neither its NaN
    nor a ``0 * inf`` reaches the values or the gradients.

    Parameters
    ----------
    outs : list or tuple of jax.Array ``(..., Sq, Dv)``
        At least one part; one shape and one dtype (float16, bfloat16, float32, float64). NumPy
        arrays are taken as constants.
    lses : list or tuple of jax.Array ``(..., Sq)``
        One per part: its natural-log log-sum-exp (as ``return_lse=True`` gives it in layout
        "bhsd"), float32 or float64.

    Returns
    -------
    out : jax.Array ``(..., Sq, Dv)`` of the parts' dtype
    lse : jax.Array ``(..., Sq)``, float32 (float64 if any part is float64)

    Raises
    ------
    TypeError
        ``outs`` or ``lses`` not a list or tuple (an array is refused: its first axis is not a
        list of parts), a part that is not an array, dtypes that are not supported or disagree.
    ValueError
        No part, different numbers of ``outs`` and ``lses``, shapes that disagree.
    """
    func = _FUNC_MERGE
    for name, seq in (("outs", outs), ("lses", lses)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{func}: {name} must be a list or tuple of arrays (one per part), got "
                            f"{type(seq).__module__}.{type(seq).__qualname__}")
    outs, lses = list(outs), list(lses)
    if not outs:
        raise ValueError(f"{func}: outs must hold at least one part, got none")
    if len(outs) != len(lses):
        raise ValueError(f"{func}: {len(outs)} outs but {len(lses)} lses; one lse per part")
    named = {f"outs[{i}]": o for i, o in enumerate(outs)}
    named.update({f"lses[{i}]": s for i, s in enumerate(lses)})
    _check_arrays(func, named, {})
    first = tuple(outs[0].shape)
    for i, o in enumerate(outs):
        dt = _np_dtype(o)
        if dt not in dtypes.SUPPORTED:
            raise TypeError(f"{func}: outs[{i}].dtype={o.dtype} is not supported; expected one of "
                            f"{', '.join(d.name for d in dtypes.SUPPORTED)}")
        if dt != _np_dtype(outs[0]):
            raise TypeError(f"{func}: outs[{i}].dtype={o.dtype} must equal outs[0].dtype={outs[0].dtype}")
    if len(first) < 2:
        raise ValueError(f"{func}: outs[0].shape={first} must be (..., Sq, Dv)")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if _np_dtype(s) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"{func}: lses[{i}].dtype={s.dtype} must be float32 or float64")
        if tuple(s.shape) != first[:-1]:
            raise ValueError(f"{func}: lses[{i}].shape={tuple(s.shape)} must be {first[:-1]} (outs[0].shape[:-1])")
        if tuple(o.shape) != first:
            raise ValueError(f"{func}: outs[{i}].shape={tuple(o.shape)} must equal outs[0].shape={first}")
    return _merge(tuple(outs), tuple(lses))


def _np_dtype(x):
    try:
        return np.dtype(x.dtype)
    except TypeError:
        return None


@jax.jit
def _merge(outs: tuple, lses: tuple):
    """:func:`merge_attention` after validation, one jitted computation."""
    wide = any(x.dtype == jnp.float64 for x in outs + lses)
    acc = jnp.float64 if wide else jnp.float32
    lse = jnp.stack([s.astype(acc) for s in lses])                        # (n, ..., Sq)
    m = jax.lax.stop_gradient(jnp.max(lse, axis=0))                       # NaN if any lse is NaN
    m = jnp.where(jnp.isneginf(m), jnp.zeros((), acc), m)                 # every part empty: shift 0
    w = jnp.exp(lse - m)                                                  # 0 for the empty parts
    total = jnp.sum(w, axis=0)
    empty = total == 0
    total_safe = jnp.where(empty, jnp.ones((), acc), total)
    lse_out = jnp.where(empty, jnp.full((), -jnp.inf, acc), m + jnp.log(total_safe))
    o = 0
    for i, part in enumerate(outs):   # an empty part's out is never weighted (0 * NaN would be NaN)
        o = o + w[i][..., None] * jnp.where(jnp.isneginf(lse[i])[..., None], jnp.zeros((), acc), part.astype(acc))
    return (o / total_safe[..., None]).astype(outs[0].dtype), lse_out
