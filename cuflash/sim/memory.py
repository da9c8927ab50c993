"""The simulated device's memory: :class:`SimArray`, the array type of every argument the
simulator's launcher accepts.

On a GPU an array a kernel reads must have been brought to the device (zero-copy from CuPy or
DLPack, or copied from the host); the simulator keeps that rule visible. Host NumPy memory
becomes device memory only through :class:`cuflash.sim.device.SimDevice` (which views it as a
:class:`SimArray`, zero-copy), and :func:`cuflash.sim.launcher.run` refuses a pointer to any
other array. So a call path that forgets to import one of its arrays fails on the simulator as it
would on a GPU. Arithmetic between a :class:`SimArray` and a host array is refused too (CuPy
refuses ``cupy_array + numpy_array``).

Imports: NumPy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SimArray", "is_sim_array", "to_device"]


class SimArray(np.ndarray):
    """A NumPy array standing for simulated device memory (a view: no data is copied)."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for x in inputs + (out or ()):
            if isinstance(x, np.ndarray) and not isinstance(x, SimArray) and x.ndim > 0:
                raise TypeError(f"cuflash simulator: {ufunc.__name__} mixes a simulated device array with a host "
                                f"NumPy array of shape {x.shape}; a GPU refuses that too (import it to the device first)")
        plain = tuple(x.view(np.ndarray) if isinstance(x, SimArray) else x for x in inputs)
        if out is not None:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, SimArray) else x for x in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return to_device(result)


def is_sim_array(x) -> bool:
    return isinstance(x, SimArray)


def to_device(x):
    """``x`` (an array, or a tuple of arrays) viewed as :class:`SimArray`; scalars unchanged."""
    if isinstance(x, tuple):
        return tuple(to_device(a) for a in x)
    if isinstance(x, np.ndarray) and not isinstance(x, SimArray):
        return x.view(SimArray)
    return x
