"""fp8 (``float8_e4m3fn``) in NumPy: saturating quantization, dequantization with FA3's descales,
and the NumPy path of an fp8 forward.

Conventions
-----------
* An fp8 array ``x`` with descale ``d`` stands for ``x * d`` (FA3's ``q_descale``, ``k_descale``,
  ``v_descale``: float32 ``(*batch, Hk)``; query head ``h`` uses kv head ``h // G``'s factor).
* The NumPy path computes in float32 on the descaled values: ``float32(x) * d`` (one float32
  rounding per element), then the float32 tiled forward (:func:`cuflash.reference.flash_attention`),
  the result rounded once to ``out_dtype``. The oracle is the float64 attention of ``float64(x) *
  float64(d)``: the same fp8 values, descaled without rounding.
* Quantization (the KV-cache append): ``e4m3(sat(float32(x) / d))``, the quotient rounded once
  to float32, then to nearest-even e4m3 with saturation as the GPU's ``cvt.rn.satfinite.e4m3x2.f32``
  (PTX ISA, "cvt"): a magnitude past 448 (e4m3's largest finite) becomes +-448, infinities too,
  NaN stays NaN. ``ml_dtypes``' own cast turns an overflow into NaN (e4m3fn has no infinity), so
  the values are clipped to [-448, 448] first (clipping keeps NaN), and a NaN is stored as the
  conversion's canonical NaN byte 0x7f.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cuflash.reference.memory import check_memory, nbytes
from cuflash.runtime import dtypes

__all__ = ["quantize_e4m3", "descale_factors", "dequantize", "run_forward_fp8", "fp8_memory"]


def quantize_e4m3(x, descale=1.0) -> np.ndarray:
    """``x / descale`` as e4m3 values, saturating as ``cvt.rn.satfinite.e4m3x2.f32`` does.

    Parameters
    ----------
    x : array_like
        Values of any float dtype (read as float32).
    descale : float or array_like
        float32 factor(s) broadcastable against ``x``; the stored value times ``descale``
        approximates ``x``.

    Returns
    -------
    numpy.ndarray of ``ml_dtypes.float8_e4m3fn``, ``x``'s shape: ``float32(x) / float32(descale)``
    rounded once to float32, clipped to [-448, 448] (NaN stays NaN: 480 and inf become 448), then
    rounded to nearest even e4m3 (subnormals kept); every NaN is the canonical NaN byte 0x7f, as
    the GPU's conversion gives it.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = np.asarray(x, dtype=np.float32) / np.asarray(descale, dtype=np.float32)
        y = np.clip(y, np.float32(-dtypes.E4M3_MAX), np.float32(dtypes.E4M3_MAX))
    out = np.asarray(y.astype(dtypes.float8_e4m3fn))
    nan = np.isnan(y)
    if nan.any():   # the conversion's canonical NaN, whatever the sign (ml_dtypes keeps the sign)
        out.view(np.uint8)[nan] = 0x7F
    return out


def descale_factors(descale, batch_shape: tuple, num_heads_k: int, group: int, layout: str, ndim: int,
                    acc=np.float32):
    """The per-element factor of an operand from its ``(*batch, Hk)`` descale (None: 1), shaped
    to broadcast against the operand in its layout: ``(*batch, H, 1, 1)`` ("bhsd", ``H = Hk *
    group`` heads: ``group`` > 1 for q under GQA), ``(B, 1, H, 1)`` ("bshd"), a scalar for 2-D
    input."""
    if descale is None:
        return acc(1)
    d = np.asarray(descale, dtype=acc).reshape(tuple(batch_shape) + (num_heads_k,))
    if group > 1:
        d = np.repeat(d, group, axis=-1)
    if layout == "bshd":
        return d[:, None, :, None]
    if ndim == 2:
        return d.reshape(())
    return d[..., None, None]


def dequantize(p, q, k, v, acc=np.float32):
    """The fp8 call ``p`` as a call on its descaled values: ``(problem, q, k, v)`` with the arrays
    ``acc(x) * acc(descale)`` (float32 for the NumPy path, float64 for the oracle) in their own
    layouts, and a problem of dtype ``acc`` without fp8. Operands that are not fp8 (a KV cache's
    q) are converted only."""
    f = p.fp8
    layout = p.layout
    batch = p.batch_shape if layout == "bhsd" else p.batch_shape[:1]
    g = p.group_size

    def one(x, descale, group):
        x = np.asarray(x)
        if not dtypes.is_fp8(x.dtype):
            return x.astype(acc)
        return x.astype(acc) * descale_factors(descale, batch, p.num_heads_k, group, layout, x.ndim, acc)

    qd = one(q, f.q_descale if f.q_fp8 else None, g)
    kd, vd = one(k, f.k_descale, 1), one(v, f.v_descale, 1)
    return dataclasses.replace(p, dtype=np.dtype(acc), fp8=None), qd, kd, vd


def fp8_memory(p, *, new_out: bool) -> dict:
    """Bytes :func:`run_forward_fp8` allocates before the tiled forward: the float32 copies of the
    descaled q, k, v, the float32 result, and the ``out_dtype`` output (``new_out``)."""
    k_elems = math.prod(p.k.shape)
    v_elems = math.prod(p.v.shape)
    return {"float32 descaled copies of q, k and v": 4 * (math.prod(p.q.shape) + k_elems + v_elems),
            "float32 result": nbytes(p.out_shape, np.float32),
            "out": nbytes(p.out_shape, p.out_dtype) if new_out else 0}


def run_forward_fp8(p, q, k, v, out=None):
    """The NumPy path of an fp8 forward (the module docstring's arithmetic): ``(out, lse)``,
    ``out`` of ``p.out_dtype`` (written into ``out`` when given), ``lse`` float32.

    Raises
    ------
    MemoryError
        When the descaled copies and the results do not fit (checked before anything is
        allocated; :func:`cuflash.reference.memory.check_memory`), or the tiled forward's own
        working memory does not.
    """
    from cuflash.reference.forward import run_forward

    check_memory(p.func, fp8_memory(p, new_out=out is None))
    p32, qf, kf, vf = dequantize(p, q, k, v)
    o32, lse = run_forward(p32, qf, kf, vf)
    if out is None:
        return o32.astype(p.out_dtype), lse
    out[...] = o32
    return out, lse
