"""The CUDA target's device (:class:`cuflash.runtime.device_call.CudaDevice`) against a CuPy
stand-in: the ordinal check, the arch, which stream a call makes current for each framework, and
where each step hands off to CuPy and the runner. What needs real device memory (a CuPy array's
memory object, the device's attributes) is excluded from coverage by name in setup.cfg; the rest
runs here, so a change to the wiring shows without a GPU."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cuflash.runtime import device_call
from cuflash.runtime.device_call import CudaDevice, DeviceCall


class _Scope:
    """A context manager that logs its entry and exit."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))


def _stand_in(log, devices=2, cc="90"):
    """The part of CuPy's API CudaDevice uses, recording what it is asked."""
    def device(i):
        scope = _Scope(log, ("device", i))
        scope.compute_capability = cc
        return scope

    stream = types.SimpleNamespace(from_external=lambda s: _Scope(log, ("external stream", s)))
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: devices), Device=device,
                                 Stream=stream, get_current_stream=lambda: _Scope(log, "cupy's current stream"))
    return types.SimpleNamespace(
        cuda=cuda, lib=np.lib,
        asarray=lambda x: log.append(("asarray", x.shape)) or np.array(x),
        empty=lambda shape, dtype: log.append(("empty", shape, np.dtype(dtype).name)) or np.empty(shape, dtype),
        from_dlpack=lambda x: log.append(("from_dlpack", type(x).__name__)) or np.from_dlpack(x))


@pytest.fixture
def cuda(monkeypatch):
    log: list = []
    fake = _stand_in(log)
    monkeypatch.setattr(device_call, "require_cuda", lambda func: fake)
    monkeypatch.setattr(device_call, "cover_span", lambda a: log.append(("cover_span", a.shape)) or a)
    monkeypatch.setattr(device_call, "cuda_sm_count", lambda i: {1: 132}[i])
    monkeypatch.setattr(device_call, "_empty_index_on", lambda i: ("empty index", i))
    monkeypatch.setattr(device_call, "_unit_scale_on", lambda i: ("unit scale", i))
    monkeypatch.setattr(device_call.cuda_runner, "launch", lambda p, stream: log.append(("launch", p, stream.name)))
    return log


def test_ordinal_arch_and_attributes(cuda):
    with pytest.raises(ValueError, match=r"cuflash.attention: arrays are on CUDA device 2, but CuPy sees 2 device"):
        CudaDevice("cuflash.attention", 2)
    dev = CudaDevice("cuflash.attention", 1)
    assert (dev.arch, dev.sm_count, dev.empty_index, dev.torch_device) == (90, 132, ("empty index", 1), "cuda:1")
    assert dev.unit_scale == ("unit scale", 1)
    assert not dev.poisoned and dev.stream is None


@pytest.mark.parametrize("framework,stream", [("numpy", "cupy's current stream"), ("cupy", "cupy's current stream"),
                                              ("torch", ("external stream", ("torch stream", 1)))])
def test_a_call_makes_its_device_and_stream_current_and_launches_on_that_stream(cuda, monkeypatch, framework, stream):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: ("torch stream", i))
    dev = CudaDevice("cuflash.attention", 1)
    with dev.activate(framework):
        assert cuda == [("enter", ("device", 1)), ("enter", stream)]
        dev.launch("plan")
    assert cuda[2:] == [("launch", "plan", stream), ("exit", stream), ("exit", ("device", 1))]


def test_imports_allocations_and_views_hand_off_to_cupy(cuda):
    dev = CudaDevice("cuflash.attention", 0)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert not dev.is_device_array(x)
    assert np.array_equal(dev.from_host(x), x)
    assert np.array_equal(dev.from_framework(x), x)   # not a CuPy array: through DLPack, then its span covered
    e = dev.empty((2, 5), np.float16)
    assert e.shape == (2, 5) and dev.to_host_kind(e) is e
    view = dev.as_strided(x, (2, 2), (8, 4))
    assert np.array_equal(view, [[0, 1], [2, 3]])
    assert cuda == [("asarray", (3, 4)), ("from_dlpack", "ndarray"), ("cover_span", (3, 4)), ("empty", (2, 5), "float16")]


def test_device_call_runs_its_steps_on_the_cuda_device(cuda):
    """The call object itself over the CUDA device: import, a fresh output, export to the caller's kind."""
    x = np.ones((2, 3), np.float32)
    with DeviceCall("cuflash.attention", CudaDevice("cuflash.attention", 0), x) as call:
        a = call.import_array(x)
        out = call.empty((2, 3), np.float32)
        out[...] = a * 2
        result = call.export(out)
    assert isinstance(result, np.ndarray) and np.array_equal(result, 2 * x)
    assert ("asarray", (2, 3)) in cuda and ("empty", (2, 3), "float32") in cuda
