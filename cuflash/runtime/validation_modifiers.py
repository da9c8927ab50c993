"""Validation of the score modifiers: ``softcap``, ``alibi_slopes``, ``attn_bias``, ``attn_mask``, ``sinks``,
``score_mod`` and ``mask_mod``.

The convention (docs/conventions.md, "Score modifiers"), in the order a backend applies it to the scores ``s`` of query
row ``i`` and key ``j`` of batch ``b`` and query head ``h``::

    s = softmax_scale * q_i . k_j
    s = softcap * tanh(s / softcap)                 softcap > 0 (Gemma 2)
    s = s - alibi_slopes[b, h] * |i + Sk - Sq - j|  (ALiBi, Press et al. 2022; bottom-right aligned)
    s = s + attn_bias[b, h, i, j]
    s = score_mod(s, b, h, i, j)                    (a traced function, cuflash.runtime.score_mod)
    s = -inf where the causal/window mask, attn_mask[b, h, i, j] or not mask_mod(b, h, i, j) hides the pair
    lse_i = log(sum_j exp(s_ij) + exp(sinks[h]))    (the sink attends to nothing: its value is 0)

:func:`check_modifiers` turns the arguments into one :class:`Modifiers` (None when none is
given, so an unmodified call's path does not change). Every array is described by a
:class:`BroadcastArray`: the argument as given, its own metadata, and the element strides that
view it in the shape the kernels index (stride 0 on a broadcast axis), so a broadcast bias is
read tile by tile and never materialised. ``score_mod`` and ``mask_mod`` are traced here
(:func:`cuflash.runtime.score_mod.trace`), their captured arrays checked for kind, device and
index range. Imports: :mod:`cuflash.runtime.interop`, :mod:`cuflash.runtime.dtypes` and
:mod:`cuflash.runtime.score_mod` only. Nothing here reads array data.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from cuflash.runtime import dtypes, interop
from cuflash.runtime import score_mod as tracing
from cuflash.runtime.block_mask import BlockMask, check_block_mask
from cuflash.runtime.interop import ArrayInfo, describe

__all__ = ["BroadcastArray", "Modifiers", "check_modifiers", "MODIFIER_NAMES", "first_modifier", "refuse_modifiers"]

#: the modifier arguments, in the order of the convention
MODIFIER_NAMES = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks", "score_mod", "mask_mod", "block_mask")
#: those that are arrays
ARRAY_MODIFIERS = ("alibi_slopes", "attn_bias", "attn_mask", "sinks")


@dataclasses.dataclass(frozen=True, eq=False)
class BroadcastArray:
    """One array argument viewed (without a copy) in the shape a backend indexes.

    Attributes
    ----------
    name : str
        The argument's name (``"attn_bias"``, ...).
    array : array
        The argument as given (NumPy, CuPy or a CUDA DLPack array of q's device).
    info : ArrayInfo
        Its own metadata: shape, dtype, strides in elements, device.
    shape : tuple of int
        The shape it is indexed in: ``(*batch, Hq, Sq, Sk)`` for ``attn_bias``/``attn_mask``
        (``(B, Hq, Sq, Sk)`` for 4-D and ``"bshd"`` input, in both layouts), ``(*batch, Hq)``
        for ``alibi_slopes``, ``(Hq,)`` for ``sinks``.
    strides : tuple of int
        Element strides into ``array`` for ``shape``: the array's own stride on an axis it has
        in full, 0 on an axis it broadcasts over (a size-1 or missing axis).
    """

    name: str
    array: object
    info: ArrayInfo
    shape: tuple
    strides: tuple

    @property
    def dtype(self) -> np.dtype:
        return self.info.dtype

    @property
    def own_shape(self) -> tuple:
        """The argument's own shape (its gradient's shape)."""
        return self.info.shape

    @property
    def broadcast_axes(self) -> tuple:
        """Axes of :attr:`shape` (counted in it) that the argument does not have in full."""
        lead = len(self.shape) - len(self.info.shape)
        return tuple(ax for ax in range(len(self.shape))
                     if ax < lead or (self.info.shape[ax - lead] == 1 and self.shape[ax] != 1))


@dataclasses.dataclass(frozen=True, eq=False)
class Modifiers:
    """The score modifiers of one call (:mod:`cuflash.runtime.validation_modifiers` has the
    convention); ``AttentionProblem.modifiers`` is None when the call has none.

    Attributes
    ----------
    softcap : float
        ``>= 0``; 0 is off.
    alibi_slopes : BroadcastArray or None
        Shape ``(*batch, Hq)`` (``(B, Hq)``; from ``(Hq,)`` with stride 0 on the batch axes);
        float32 (float64 allowed with float64 q).
    attn_bias : BroadcastArray or None
        Shape ``(*batch, Hq, Sq, Sk)``; q's dtype or float32.
    attn_mask : BroadcastArray or None
        Shape ``(*batch, Hq, Sq, Sk)``; bool, True = attend.
    sinks : BroadcastArray or None
        Shape ``(Hq,)``; float32 (float64 allowed with float64 q).
    score_mod, mask_mod : TracedMod or None
        The traced functions (:mod:`cuflash.runtime.score_mod`); their captured arrays are of
        q's kind and device, and every read stays inside its array.
    block_mask : BlockMask or None
        The block-sparse summary of ``mask_mod`` (:mod:`cuflash.runtime.block_mask`), built for
        this call's lengths; ``mask_mod`` is then the one it was built from.
    """

    softcap: float = 0.0
    alibi_slopes: BroadcastArray | None = None
    attn_bias: BroadcastArray | None = None
    attn_mask: BroadcastArray | None = None
    sinks: BroadcastArray | None = None
    score_mod: tracing.TracedMod | None = None
    mask_mod: tracing.TracedMod | None = None
    block_mask: BlockMask | None = None

    @property
    def present(self) -> tuple:
        """Names of the modifiers this call has, in :data:`MODIFIER_NAMES` order."""
        return tuple(n for n in MODIFIER_NAMES if (self.softcap > 0 if n == "softcap" else getattr(self, n) is not None))


    def with_arrays(self, convert) -> "Modifiers":
        """A copy whose arrays are ``convert(array)`` (the CUDA path's zero-copy CuPy views); the
        shapes and element strides stay those validated."""
        changes = {n: dataclasses.replace(b, array=convert(b.array))
                   for n in ARRAY_MODIFIERS if (b := getattr(self, n)) is not None}
        changes.update({n: dataclasses.replace(t, arrays=tuple(convert(a) for a in t.arrays))
                        for n in ("score_mod", "mask_mod") if (t := getattr(self, n)) is not None})
        if self.block_mask is not None:
            changes["block_mask"] = self.block_mask.with_arrays(convert)
        return dataclasses.replace(self, **changes)


def first_modifier(problem, allowed=()) -> str | None:
    """The first modifier of ``problem`` (an ``AttentionProblem``) not in ``allowed``, or None."""
    mods = getattr(problem, "modifiers", None)
    if mods is None:
        return None
    return next((n for n in mods.present if n not in allowed), None)


def refuse_modifiers(problem, kernel: str = "this kernel", allowed=()) -> str | None:
    """The one line a kernel tier's ``unsupported_reason`` returns for a modifier it does not
    take (None when the call has none outside ``allowed``): ``"softcap is not in the tensor-core
    kernel yet"``. With no tier left the dispatcher raises ``NotImplementedError`` with it."""
    name = first_modifier(problem, allowed)
    return None if name is None else f"{name} is not in {kernel} yet"


def _check_real(value, name: str, func: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{func}: {name} must be a real number >= 0 (0 = off), got {value!r} ({type(value).__name__})")
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{func}: {name} must be a finite number >= 0 (0 = off), got {x!r}")
    return x


def _describe_like_q(x, name: str, func: str, q: ArrayInfo) -> ArrayInfo:
    info = describe(x, name, func)
    if info.kind != q.kind:
        raise TypeError(f"{func}: {name} is a {info.type_name} but q is a {q.type_name}; all arrays must be of one "
                        f"kind (no implicit copies between host and device)")
    if info.device != q.device:
        raise ValueError(f"{func}: {name} is on device {info.device} but q is on device {q.device} (DLPack "
                         f"(type, id)); all arrays must be on one device")
    if math.prod(info.shape) and info.strides is None:
        raise ValueError(f"{func}: {name}.strides={info.byte_strides} (bytes) must be multiples of the item size")
    for axis, (n, s) in enumerate(zip(info.shape, info.strides or ())):
        if n > 1 and s < 0:
            raise ValueError(f"{func}: {name} has a negative stride on axis {axis} ({name}.strides={info.strides} "
                             f"in elements); negative strides are not supported, copy the array first")
    return info


def _broadcast(info: ArrayInfo, name: str, target: tuple, target_name: str, func: str) -> tuple:
    """Element strides viewing ``info`` as ``target`` (NumPy's broadcasting; extra leading axes
    of size 1 are allowed), or a ValueError giving both shapes."""
    shape, strides = info.shape, info.strides or (0,) * info.ndim
    extra = info.ndim - len(target)
    if extra > 0 and all(n == 1 for n in shape[:extra]):
        shape, strides = shape[extra:], strides[extra:]
    ok = len(shape) <= len(target) and all(n in (1, t) for n, t in zip(shape[::-1], target[::-1]))
    if not ok:
        raise ValueError(f"{func}: {name}.shape={info.shape} does not broadcast to {target_name}={target} "
                         f"(NumPy broadcasting: each axis, aligned from the right, of size 1 or equal)")
    lead = len(target) - len(shape)
    return tuple(0 if ax < lead or shape[ax - lead] != t else (strides[ax - lead] if t > 1 else 0)
                 for ax, t in enumerate(target))


def _float_param(x, name: str, func: str, q: ArrayInfo, target: tuple, shapes: tuple, shapes_text: str):
    """``alibi_slopes``/``sinks``: float32 (or float64 with float64 q), one of ``shapes``."""
    info = _describe_like_q(x, name, func, q)
    allowed = ("float32", "float64") if q.dtype == dtypes.float64 else ("float32",)
    if info.dtype_name not in allowed:
        raise TypeError(f"{func}: {name} must be float32{' or float64' if len(allowed) > 1 else ''}, got "
                        f"{name}.dtype={info.dtype_name}")
    if info.shape not in shapes:
        raise ValueError(f"{func}: {name}.shape={info.shape} must be {shapes_text}")
    return BroadcastArray(name, x, info, target, _broadcast(info, name, target, shapes_text, func))


def check_modifiers(func: str, q: ArrayInfo, batch_shape: tuple, num_heads_q: int, seqlen_q: int, seqlen_k: int,
                    modifiers) -> Modifiers | None:
    """Validate the modifiers of one call (q's metadata ``q``; the problem's batch dims, heads and
    lengths; ``modifiers`` the :class:`~cuflash.runtime.options.ModifierOptions` as given) and
    return their :class:`Modifiers`, or None when none is given.

    Raises
    ------
    TypeError
        A non-real or bool ``softcap``; slopes or sinks not float32 (float64 too with float64 q);
        a bias not of q's dtype or float32; a mask that is not bool; an array of another kind
        than q.
    TypeError (traced functions)
        ``score_mod``/``mask_mod`` not traceable (the operation is named; see
        :mod:`cuflash.runtime.score_mod`), a captured array of an unsupported dtype or of
        another kind than q.
    ValueError (traced functions)
        A captured array read with an index that may fall outside it (the array, axis and range
        are named).
    ValueError
        A negative or non-finite ``softcap``; slopes not ``(Hq,)`` or ``(*batch, Hq)``; sinks not
        ``(Hq,)``; a bias or mask that does not broadcast to ``(*batch, Hq, Sq, Sk)`` (both shapes
        in the message); an array on another device or with negative strides.
    """
    m = modifiers
    softcap, alibi_slopes, attn_bias, attn_mask, sinks = m.softcap, m.alibi_slopes, m.attn_bias, m.attn_mask, m.sinks
    cap = _check_real(softcap, "softcap", func)
    if (cap == 0 and alibi_slopes is None and attn_bias is None and attn_mask is None and sinks is None
            and m.score_mod is None and m.mask_mod is None and m.block_mask is None):
        return None
    batch = tuple(batch_shape)
    hq = num_heads_q
    bias_target = batch + (hq, seqlen_q, seqlen_k)
    bias_name = "(B, Hq, Sq, Sk)" if len(batch) == 1 else "(*batch, Hq, Sq, Sk)"
    slopes = None
    if alibi_slopes is not None:
        want = ((hq,), batch + (hq,))
        text = f"(Hq,) = {(hq,)} or {'(B, Hq)' if len(batch) == 1 else '(*batch, Hq)'} = {batch + (hq,)}"
        slopes = _float_param(alibi_slopes, "alibi_slopes", func, q, batch + (hq,), want, text)
    sink = None
    if sinks is not None:
        sink = _float_param(sinks, "sinks", func, q, (hq,), ((hq,),), f"(Hq,) = {(hq,)}")
    bias = None
    if attn_bias is not None:
        info = _describe_like_q(attn_bias, "attn_bias", func, q)
        if info.dtype is None or info.dtype not in (q.dtype, dtypes.float32):
            raise TypeError(f"{func}: attn_bias.dtype={info.dtype_name} must be "
                            f"{dtypes.q_dtype_or_float32(q.dtype_name)}")
        bias = BroadcastArray("attn_bias", attn_bias, info, bias_target,
                              _broadcast(info, "attn_bias", bias_target, bias_name, func))
    mask = None
    if attn_mask is not None:
        info = _describe_like_q(attn_mask, "attn_mask", func, q)
        if info.dtype_name != "bool":
            raise TypeError(f"{func}: attn_mask must be a bool array (True = attend, SDPA's meaning), got "
                            f"attn_mask.dtype={info.dtype_name}; for an additive mask pass attn_bias")
        mask = BroadcastArray("attn_mask", attn_mask, info, bias_target,
                              _broadcast(info, "attn_mask", bias_target, bias_name, func))
    extents = {"b": math.prod(batch), "h": hq, "q_idx": seqlen_q, "kv_idx": seqlen_k}
    mask_mod = m.mask_mod
    if m.block_mask is not None:
        mask_mod = check_block_mask(m.block_mask, mask_mod, func, math.prod(batch), hq, seqlen_q, seqlen_k, q.kind)
    traced = [None if fn is None else _check_traced(tracing.trace(fn, role, func), func, q, extents)
              for fn, role in ((m.score_mod, "score_mod"), (mask_mod, "mask_mod"))]
    return Modifiers(cap, slopes, bias, mask, sink, *traced, m.block_mask)


def _check_traced(traced: tracing.TracedMod, func: str, q: ArrayInfo, extents: dict) -> tracing.TracedMod:
    """A traced function's captured arrays: q's kind and device (a CPU DLPack array, such as a
    torch CPU tensor, with NumPy q becomes a zero-copy NumPy view, as the operands do), no
    negative strides, every read inside its array (:func:`cuflash.runtime.score_mod.check_reads`)."""
    if q.kind == "numpy" and any(interop.is_host_dlpack(a) for a in traced.arrays):
        traced = dataclasses.replace(traced, arrays=tuple(
            interop.host_to_numpy(a, f"{traced.role}'s captured array {n!r}", func) if interop.is_host_dlpack(a) else a
            for n, a in zip(traced.names, traced.arrays)))
    for name, arr in zip(traced.names, traced.arrays):
        info = _describe_like_q(arr, f"{traced.role}'s captured array {name!r}", func, q)
        if info.dtype_name in ("float64", "int64") and q.kind != "numpy":
            raise TypeError(f"{func}: {traced.role}'s captured array {name!r} is {info.dtype_name}; the kernels take "
                            f"float32, int32 and bool captured arrays (float64/int64 on the NumPy path only)")
    tracing.check_reads(traced, extents, func)
    return traced
