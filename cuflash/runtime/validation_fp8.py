"""Validation of fp8 (``float8_e4m3fn``) input: the descales and the result type.

FA3's convention (``flash_attn_func(..., q_descale=, k_descale=, v_descale=)``): fp8 q, k, v
stand for ``q * q_descale``, ``k * k_descale``, ``v * v_descale``, each descale a float32 array
``(B, Hk)`` (``(*batch, Hk)`` for layout "bhsd" with several batch dims), one factor per batch
entry and kv head; query head ``h`` uses its kv head's ``h // (Hq // Hk)``. A stride-0 view
(``numpy.broadcast_to(scale, (B, Hk))``) gives one per-tensor scale. A descale left out is 1.

Like :mod:`cuflash.runtime.validation`, nothing here touches a device: host (NumPy) descales are
read and must be finite and > 0; device-resident ones are checked for dtype and shape only
(reading them would synchronize the host), as device index arrays are.

Imports: :mod:`cuflash.runtime` only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuflash.runtime import dtypes
from cuflash.runtime.interop import ArrayInfo, describe

__all__ = ["Fp8", "check_fp8", "check_out_dtype", "check_descale", "DESCALES"]

#: the descale arguments, in order
DESCALES = ("q_descale", "k_descale", "v_descale")


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8:
    """The fp8 side of a validated call.

    Attributes
    ----------
    q_descale, k_descale, v_descale : array or None
        float32 ``(*batch, Hk)`` as given (None: 1); only for operands that are fp8.
    out_dtype : numpy.dtype
        The result's dtype (bfloat16 by default, or float16) for fp8 q; q's dtype when only a
        KV cache is fp8.
    q_fp8 : bool
        True when q (and k, v) are fp8 (:func:`cuflash.attention`); False when only the caches of
        :func:`cuflash.attention_with_kvcache` are.
    checked : bool
        True when every descale given was read and checked on the host.
    """

    q_descale: object
    k_descale: object
    v_descale: object
    out_dtype: np.dtype
    q_fp8: bool
    checked: bool

    def with_arrays(self, convert) -> "Fp8":
        """A copy whose descales are ``convert(array)`` (a device call's imports)."""
        return dataclasses.replace(self, **{n: convert(getattr(self, n)) for n in DESCALES
                                            if getattr(self, n) is not None})


def check_out_dtype(value, func: str) -> np.dtype:
    """``out_dtype``: None (bfloat16), or bfloat16/float16 by NumPy dtype, ``ml_dtypes`` type,
    torch dtype or name."""
    if value is None:
        return dtypes.FP8_OUT[0]
    name = str(value).removeprefix("torch.")
    try:
        dt = dtypes.known_from_name(name) or dtypes.known_or_none(value)
    except TypeError:
        dt = None
    if dt is None or dt not in dtypes.FP8_OUT:
        raise ValueError(f"{func}: out_dtype must be bfloat16 or float16 (the result type of fp8 input), got {value!r}")
    return dt


def _positive_finite(x: np.ndarray, name: str, func: str) -> None:
    a = np.asarray(x, dtype=np.float32)
    bad = ~(np.isfinite(a) & (a > 0))
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise ValueError(f"{func}: {name}{list(i)}={float(a[i])!r} must be finite and > 0 (a descale multiplies the "
                         f"fp8 values back to their scale)")


def check_descale(x, name: str, func: str, q: ArrayInfo, shape: tuple) -> bool:
    """One descale: float32 of exactly ``shape``, q's kind and device, non-negative strides in
    whole elements (stride 0 broadcasts one value); host values finite and > 0. Returns True when
    its values were checked (a NumPy array)."""
    info = describe(x, name, func)
    if info.dtype_name != "float32":
        raise TypeError(f"{func}: {name} must be float32, got {name}.dtype={info.dtype_name}")
    if info.shape != tuple(shape):
        raise ValueError(f"{func}: {name}.shape={info.shape} must be {tuple(shape)} (batch, kv heads), as FA3's "
                         f"descales; one per-tensor scale is a stride-0 view, e.g. numpy.broadcast_to(scale, "
                         f"{tuple(shape)})")
    if info.kind != q.kind or info.device != q.device:
        raise TypeError(f"{func}: {name} is a {info.type_name} on device {info.device} but q is a {q.type_name} on "
                        f"device {q.device}; they must be of one kind and device")
    if info.strides is None or any(s < 0 for n, s in zip(info.shape, info.strides) if n > 1):
        raise ValueError(f"{func}: {name}.strides={info.byte_strides} (bytes) must be non-negative multiples of 4")
    if info.kind == "numpy":
        _positive_finite(x, name, func)
        return True
    return False


def check_fp8(func: str, q: ArrayInfo, fp8_inputs: dict, batch_shape: tuple, num_heads_k: int, fp8_options,
              dropout=None) -> Fp8 | None:
    """The fp8 side of a call, or None when no input is fp8.

    Parameters
    ----------
    func : str
    q : ArrayInfo
        The query (its kind and device are the descales').
    fp8_inputs : dict
        ``{"q": info, "k": info, "v": info}`` for :func:`cuflash.attention`, ``{"k_cache": ...,
        "v_cache": ...}`` for a KV cache (a descale belongs to the input whose name begins as its
        own: ``k_descale`` to ``k_cache``); q is fp8 iff ``"q"`` is among them and fp8.
    batch_shape, num_heads_k : the descales' shape is ``batch_shape + (num_heads_k,)``.
    fp8_options : cuflash.runtime.options.Fp8Options
    dropout : the call's validated dropout (refused with fp8)

    Raises
    ------
    ValueError
        Descales or ``out_dtype`` without fp8 input; a descale of the wrong shape, strides or
        (host) values; a bad ``out_dtype``.
    TypeError
        A descale that is not float32, or not of q's kind and device.
    NotImplementedError
        fp8 with dropout.
    """
    fo = fp8_options
    given = {n: getattr(fo, n) for n in DESCALES if getattr(fo, n) is not None}
    is_fp8 = {n: dtypes.is_fp8(info.dtype) for n, info in fp8_inputs.items()}
    q_fp8 = is_fp8.get("q", False)
    if not any(is_fp8.values()):
        if given:
            name = next(iter(given))
            what = ", ".join(f"{n}.dtype={i.dtype_name}" for n, i in fp8_inputs.items())
            raise ValueError(f"{func}: {name} is a descale of float8_e4m3fn input, but {what}; pass descales only "
                             f"with fp8 arrays")
        if fo.out_dtype is not None:
            raise ValueError(f"{func}: out_dtype={fo.out_dtype!r} applies to float8_e4m3fn input only; the result "
                             f"has q's dtype {q.dtype_name}")
        return None
    for name in given:   # q_descale belongs to "q", k_descale to "k" (or "k_cache"), ...
        owner = next((n for n in fp8_inputs if n.split("_")[0] == name.split("_")[0]), "q")
        if not is_fp8.get(owner, False):
            dt = fp8_inputs[owner].dtype_name if owner in fp8_inputs else q.dtype_name
            raise ValueError(f"{func}: {name} is a descale of float8_e4m3fn input, but {owner}.dtype={dt}")
    if dropout is not None:
        raise NotImplementedError(f"{func}: float8_e4m3fn input takes no dropout (dropout_p={dropout.p}); the fp8 "
                                  f"forward is for inference")
    if q_fp8:
        out_dtype = check_out_dtype(fo.out_dtype, func)
    elif fo.out_dtype is not None:
        raise ValueError(f"{func}: out_dtype applies to float8_e4m3fn q only; the result has q's dtype "
                         f"{q.dtype_name}")
    else:
        out_dtype = q.dtype
    shape = tuple(batch_shape) + (num_heads_k,)
    checked = all([check_descale(x, n, func, q, shape) for n, x in given.items()])
    return Fp8(fo.q_descale, fo.k_descale, fo.v_descale, out_dtype, q_fp8, checked)
