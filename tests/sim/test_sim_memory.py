"""The simulated device's memory (:mod:`cuflash.sim.memory`) and array module
(:class:`cuflash.sim.device.SimDevice`'s ``xp``): device arrays stay device arrays, and host memory
never mixes with them silently (CuPy refuses ``cupy_array + numpy_array``)."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.sim.device import SimDevice
from cuflash.sim.memory import SimArray, is_sim_array, to_device


def test_arithmetic_with_host_memory_is_refused_like_on_a_gpu():
    a = to_device(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"add mixes a simulated device array with a host NumPy array of shape \(2, 3\)"):
        a + np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="multiply mixes"):
        np.multiply(a, a, out=np.empty((2, 3), np.float32))
    assert is_sim_array(a * 2.0) and float((a * 2.0).sum()) == 12.0   # a scalar is not host memory


def test_ufunc_into_a_device_output_and_tuples_of_arrays():
    a = to_device(np.arange(4, dtype=np.float32))
    out = to_device(np.zeros(4, np.float32))
    assert np.add(a, a, out=out) is out and np.array_equal(out, [0, 2, 4, 6])
    q, r = to_device((np.ones(2), np.zeros(2)))
    assert is_sim_array(q) and is_sim_array(r)
    assert to_device(3.5) == 3.5 and to_device(a) is a


def test_the_device_array_module_makes_device_arrays():
    xp = SimDevice().xp
    e = xp.empty((2, 2), np.float16)
    assert is_sim_array(e) and np.isnan(e.astype(np.float32)).all()   # fresh memory is poisoned
    z = xp.zeros((3,), np.int32)
    assert is_sim_array(z) and (z == 0).all()
    host = np.arange(3.0)
    d = xp.asarray(host)
    assert is_sim_array(d) and d.base is not host and np.array_equal(d, host)   # a copy in, as cupy.asarray
    assert xp.asarray(d) is d and xp.asarray(d, dtype=np.float32).dtype == np.float32
    assert is_sim_array(xp.concatenate([d, d])) and xp.float32 is np.float32
    assert isinstance(xp.asarray(d), SimArray)
