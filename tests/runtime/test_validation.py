"""Every bad input gets a clear error naming the argument, the expectation and the value."""

from __future__ import annotations

import numpy as np
import pytest
from support.tolerance import check_close

import cuflash
from cuflash.runtime import dtypes, interop


def arrays(dtype=np.float32, b=2, hq=4, hk=2, sq=5, sk=7, d=8, dv=8):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((b, hq, sq, d)).astype(dtype),
        rng.standard_normal((b, hk, sk, d)).astype(dtype),
        rng.standard_normal((b, hk, sk, dv)).astype(dtype),
    )


class FakeDLPackTensor:
    """Minimal DLPack producer, as torch/JAX tensors look to cuflash's validation."""

    def __init__(self, shape, dtype="float32", device=(1, 0)):
        self.shape, self.dtype, self._device = tuple(shape), dtype, device

    def __dlpack__(self, stream=None):  # pragma: no cover - never called: validation reads metadata only
        raise AssertionError("validation must not export data")

    def __dlpack_device__(self):
        return self._device


def test_non_array_inputs():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"cuflash.attention: q must be an array .* got builtins.list"):
        cuflash.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"v must be an array .* got builtins.NoneType"):
        cuflash.attention(q, k, None)


@pytest.mark.parametrize("bad", [np.int32, np.complex64, np.bool_, np.float128 if hasattr(np, "float128") else np.int8])
def test_unsupported_dtype(bad):
    q, k, v = arrays()
    with pytest.raises(TypeError, match=rf"q.dtype={np.dtype(bad).name} is not supported; expected one of float16, bfloat16, float32, float64"):
        cuflash.attention(q.astype(bad), k.astype(bad), v.astype(bad))


def test_mixed_dtypes():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k.dtype=float16 must equal q.dtype=float32"):
        cuflash.attention(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match=r"v.dtype=bfloat16 must equal q.dtype=float32"):
        cuflash.attention(q, k, v.astype(dtypes.bfloat16))


def test_mixed_array_kinds():
    q, k, v = arrays()
    fake = FakeDLPackTensor(k.shape, device=(2, 0))
    with pytest.raises(TypeError, match=r"k is a .*FakeDLPackTensor but q is a numpy.ndarray; all arrays must be of one kind"):
        cuflash.attention(q, fake, v)


class FakeCupyArray:
    """Stands for cupy.ndarray (cuflash recognises CuPy by type name, without importing it);
    a real one cannot be created without a GPU."""

    def __init__(self, a):
        self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides
        self.device = type("Device", (), {"id": 0})()


FakeCupyArray.__name__ = FakeCupyArray.__qualname__ = "ndarray"
FakeCupyArray.__module__ = "cupy._core.core"


def test_mixed_numpy_and_cupy_kinds():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k is a cupy._core.core.ndarray but q is a numpy.ndarray; all arrays must be of one kind"):
        cuflash.attention(q, FakeCupyArray(k), v)
    # all-CuPy input is validated like NumPy input, before any device work
    with pytest.raises(ValueError, match=r"k.shape\[-1\]=4 must equal q.shape\[-1\]=8"):
        cuflash.attention(FakeCupyArray(q), FakeCupyArray(k[..., :4]), FakeCupyArray(v))


def test_cpu_dlpack_producer_numpy_cannot_import_is_a_type_error():
    shape = (2, 4, 5, 8)
    q, k, v = (FakeDLPackTensor(shape, device=(1, 0)) for _ in range(3))
    with pytest.raises(TypeError, match=r"q is a .*FakeDLPackTensor on the CPU that NumPy cannot import through "
                                        r"numpy.from_dlpack \(AssertionError: .*\); accepted: numpy.ndarray"):
        cuflash.attention(q, k, v)


class BareDLPack:
    """The protocol's minimum: ``__dlpack__`` and ``__dlpack_device__``, nothing else."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_bare_cpu_dlpack_producer_runs_the_numpy_path_and_gets_numpy_back():
    q, k, v = arrays()
    out, lse = cuflash.attention(BareDLPack(q), BareDLPack(k), BareDLPack(v), causal=True, return_lse=True)
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    expected, expected_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    y = cuflash.softmax(BareDLPack(q))
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, cuflash.softmax(q))
    dout = np.ones_like(out)
    grads = cuflash.attention_backward(*(BareDLPack(x) for x in (dout, q, k, v, out, lse)), causal=True)
    for g, e in zip(grads, cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)):
        assert type(g) is np.ndarray
        np.testing.assert_array_equal(g, e)
    assert cuflash.explain(BareDLPack(q), BareDLPack(k), BareDLPack(v))["backend"] == "numpy"


def test_cpu_dlpack_mixed_with_numpy_is_refused():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k is a numpy.ndarray but q is a .*BareDLPack; all arrays must be of one kind"):
        cuflash.attention(BareDLPack(q), k, v)
    with pytest.raises(TypeError, match=r"k is a .*BareDLPack but q is a numpy.ndarray"):
        cuflash.attention(q, BareDLPack(k), v)


def test_bare_cuda_dlpack_producer_without_metadata_is_a_type_error():
    class NoShape:
        def __dlpack__(self, **kw):  # pragma: no cover - never called
            raise AssertionError("validation must not export data")

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(TypeError, match=r"q is a .*NoShape with __dlpack__ but no .shape/.dtype .*cupy.from_dlpack\(q\)"):
        cuflash.attention(NoShape(), NoShape(), NoShape())


def test_torch_cpu_tensors_come_back_as_tensors_and_out_is_written_in_place(rng):
    torch = pytest.importorskip("torch")  # CI installs torch 2.13.0 (CPU build)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 5, 8).to(dtype) for _ in range(3))
        out = torch.full((2, 4, 5, 8), float("nan"), dtype=dtype)
        got = cuflash.attention(q, k, v, out=out)
        assert got is out  # the caller's tensor, filled
        qn, kn, vn = (interop.torch_to_numpy(t) for t in (q, k, v))
        np.testing.assert_array_equal(interop.torch_to_numpy(out), cuflash.attention(qn, kn, vn))
    q = torch.randn(1, 2, 4, 8, requires_grad=True)  # a tensor that needs grad is detached, not refused
    assert isinstance(cuflash.attention(q, q, q), torch.Tensor)


def test_torch_cpu_tensor_with_numpy_is_refused():
    torch = pytest.importorskip("torch")
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k is a numpy.ndarray but q is a torch.Tensor"):
        cuflash.attention(torch.from_numpy(q), k, v)


def test_dlpack_arrays_on_different_devices():
    shape = (2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"k is on device \(2, 1\) but q is on device \(2, 0\)"):
        cuflash.attention(FakeDLPackTensor(shape, device=(2, 0)), FakeDLPackTensor(shape, device=(2, 1)),
                          FakeDLPackTensor(shape, device=(2, 0)))


def test_cuda_dlpack_input_is_validated_before_device_work():
    # Shape errors surface for GPU tensors too, without a GPU and without touching the data.
    q, k, v = FakeDLPackTensor((2, 4, 5, 8), device=(2, 0)), FakeDLPackTensor((2, 4, 7, 16), device=(2, 0)), FakeDLPackTensor((2, 4, 7, 8), device=(2, 0))
    with pytest.raises(ValueError, match=r"k.shape\[-1\]=16 must equal q.shape\[-1\]=8"):
        cuflash.attention(q, k, v)
    with pytest.raises(TypeError, match=r"q.dtype=int8 is not supported"):
        cuflash.attention(*(FakeDLPackTensor((2, 4, 5, 8), dtype="int8", device=(2, 0)) for _ in range(3)))


def test_wrong_ndim():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"q.ndim must be >= 2 for layout='bhsd' .*got q.shape=\(8,\)"):
        cuflash.attention(q[0, 0, 0], k, v)
    with pytest.raises(ValueError, match=r"q, k and v must have the same number of dims; got q.shape=\(4, 5, 8\)"):
        cuflash.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"q.ndim must be == 4 for layout='bshd'"):
        cuflash.attention(q[0], k[0], v[0], layout="bshd")


def test_batch_dim_mismatch():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"batch dims must match: q.shape=\(2, 4, 5, 8\), k.shape=\(1, 2, 7, 8\)"):
        cuflash.attention(q, k[:1], v[:1])


def test_heads_not_a_multiple():
    q, k, v = arrays(hq=5, hk=2)
    with pytest.raises(ValueError, match=r"q.shape\[-3\]=5 query heads must be a multiple of k.shape\[-3\]=2 kv heads"):
        cuflash.attention(q, k, v)
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"v.shape\[-3\]=1 \(kv heads\) must equal k.shape\[-3\]=2"):
        cuflash.attention(q, k, v[:, :1])


def test_kv_length_mismatch():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"v.shape\[-2\]=6 must equal k.shape\[-2\]=7"):
        cuflash.attention(q, k, v[:, :, :6])
    qb, kb, vb = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"v.shape\[1\]=6 must equal k.shape\[1\]=7"):
        cuflash.attention(qb, kb, vb[:, :6], layout="bshd")


def test_head_dim_mismatch_and_limits():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"cuflash.attention: k.shape\[-1\]=72 must equal q.shape\[-1\]=64"):
        cuflash.attention(*arrays(d=64)[:1], arrays(d=72)[1], arrays(d=64)[2])
    with pytest.raises(NotImplementedError, match=r"q.shape\[-1\]=257 exceeds the largest supported head dim 256"):
        cuflash.attention(*arrays(d=257))
    with pytest.raises(NotImplementedError, match=r"v.shape\[-1\]=300 exceeds the largest supported head dim 256"):
        cuflash.attention(*arrays(dv=300))
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head dim\) must be at least 1, got 0"):
        cuflash.attention(*arrays(d=0))


def test_non_unit_last_axis_stride():
    q, k, v = arrays(d=16)
    with pytest.raises(ValueError, match=r"q must have unit stride on its last axis .*q.strides=\(320, 80, 16, 2\)"):
        cuflash.attention(q[..., ::2], k[..., ::2], v)


def test_negative_strides():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"k has a negative stride on axis 2"):
        cuflash.attention(q, k[:, :, ::-1], v)


def test_unknown_layout_and_backend():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"layout must be one of \('bhsd', 'bshd'\), got 'bsdh'"):
        cuflash.attention(q, k, v, layout="bsdh")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'numpy', 'sim', 'cuda'\), got 'gpu'"):
        cuflash.attention(q, k, v, backend="gpu")


@pytest.mark.parametrize(
    "window,exc,pattern",
    [
        ((-1,), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
        (5, ValueError, r"window_size must be a pair"),
        ("ab", ValueError, r"window_size must be a pair"),
        ((-2, 3), ValueError, r"window_size\[0\] must be >= -1 \(-1 = unbounded\), got -2"),
        ((1, -5), ValueError, r"window_size\[1\] must be >= -1 \(-1 = unbounded\), got -5"),
        ((1.5, 2), TypeError, r"window_size\[0\] must be an int, got 1.5"),
        ((True, 2), TypeError, r"window_size\[0\] must be an int, got True"),
    ],
)
def test_malformed_window_size(window, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cuflash.attention(*arrays(), window_size=window)


@pytest.mark.parametrize("scale,exc,pattern", [
    (float("nan"), ValueError, r"softmax_scale must be finite, got nan"),
    (float("inf"), ValueError, r"softmax_scale must be finite, got inf"),
    ("0.1", TypeError, r"softmax_scale must be a real number or None, got '0.1'"),
    (True, TypeError, r"softmax_scale must be a real number or None, got True"),
])
def test_bad_softmax_scale(scale, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cuflash.attention(*arrays(), softmax_scale=scale)


def test_flags_must_be_bools():
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'yes'"):
        cuflash.attention(*arrays(), causal="yes")
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got 1"):
        cuflash.attention(*arrays(), return_lse=1)


def test_bad_out_argument():
    q, k, v = arrays()
    good = np.empty((2, 4, 5, 8), np.float32)
    with pytest.raises(ValueError, match=r"out.shape=\(2, 4, 5, 9\) must be \(2, 4, 5, 8\)"):
        cuflash.attention(q, k, v, out=np.empty((2, 4, 5, 9), np.float32))
    with pytest.raises(TypeError, match=r"out.dtype=float16 must equal q.dtype=float32"):
        cuflash.attention(q, k, v, out=np.zeros(good.shape, np.float16))
    with pytest.raises(TypeError, match=r"out is a .*FakeDLPackTensor but q is a numpy.ndarray"):
        cuflash.attention(q, k, v, out=FakeDLPackTensor(good.shape, device=(2, 0)))
    with pytest.raises(TypeError, match=r"out must be an array"):
        cuflash.attention(q, k, v, out=[0.0])
    ro = good.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out is read-only"):
        cuflash.attention(q, k, v, out=ro)
    with pytest.raises(ValueError, match=r"out has stride 0 on axis 0"):
        cuflash.attention(q, k, v, out=np.broadcast_to(good[:1], good.shape))
    with pytest.raises(ValueError, match=r"out overlaps q in memory"):
        cuflash.attention(q, k, v[..., :8], out=q)


def test_backend_that_would_move_data():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"backend='cuda' needs GPU arrays .* got NumPy arrays"):
        cuflash.attention(q, k, v, backend="cuda")
    gpu = [FakeDLPackTensor(x.shape, device=(2, 0)) for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"backend='numpy' computes on the host and takes NumPy arrays"):
        cuflash.attention(*gpu, backend="numpy")


def test_backend_environment_variable(monkeypatch):
    q, k, v = arrays()
    monkeypatch.setenv("CUFLASH_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"environment variable CUFLASH_BACKEND must be one of .* got 'bogus'"):
        cuflash.attention(q, k, v)
    monkeypatch.setenv("CUFLASH_BACKEND", "cuda")  # overrides "auto" only, and says so
    with pytest.raises(ValueError, match=r"backend='cuda' \(from the environment variable "
                                         r"CUFLASH_BACKEND='cuda'\) needs GPU arrays"):
        cuflash.attention(q, k, v)
    with pytest.raises(ValueError, match=r"backend='cuda' \(from the environment variable CUFLASH_BACKEND"):
        cuflash.softmax(q)
    for spelling in (" sim", "SIM", "Sim\n"):  # one rule: case and surrounding spaces ignored
        monkeypatch.setenv("CUFLASH_BACKEND", spelling)
        with cuflash.sim.options(arch="sm_75"):
            out = cuflash.attention(q, k, v)
        check_close(out, q, k, v)
    monkeypatch.setenv("CUFLASH_BACKEND", "si m")
    with pytest.raises(ValueError, match=r"CUFLASH_BACKEND must be one of .*case and surrounding spaces ignored.* got 'si m'"):
        cuflash.attention(q, k, v)
    monkeypatch.setenv("CUFLASH_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"cuflash.softmax: environment variable CUFLASH_BACKEND must be one of"):
        cuflash.softmax(q)
    monkeypatch.setenv("CUFLASH_BACKEND", "cuda")
    out = cuflash.attention(q, k, v, backend="numpy")  # an explicit backend wins
    assert out.shape == (2, 4, 5, 8)


def test_validation_happens_before_computation(monkeypatch):
    # A bad out= must be refused before anything is written to it.
    q, k, v = arrays()
    out = np.full((2, 4, 5, 8), 7.0, np.float16)
    with pytest.raises(TypeError):
        cuflash.attention(q, k, v, out=out)
    assert (out == 7.0).all()


def test_non_native_byte_order_is_named():
    q, k, v = arrays()
    big = q.astype(q.dtype.newbyteorder(">" if np.little_endian else "<"))
    with pytest.raises(TypeError, match=r"q.dtype='.f4' has non-native byte order; .*q.astype\(q.dtype.newbyteorder\('='\)\)"):
        cuflash.attention(big, k, v)
    with pytest.raises(TypeError, match=r"x.dtype='.f4' has non-native byte order"):
        cuflash.softmax(big)
    fixed = big.astype(big.dtype.newbyteorder("="))
    np.testing.assert_array_equal(cuflash.attention(fixed, k, v), cuflash.attention(q, k, v))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # numpy's own, for np.matrix
def test_matrix_and_masked_arrays_are_refused_by_name():
    q, k, v = (x[0, 0] for x in arrays())
    with pytest.raises(TypeError, match=r"q is a numpy.matrix, which is not accepted: .*numpy.asarray\(q\)"):
        cuflash.attention(np.matrix(q), k, v)
    with pytest.raises(TypeError, match=r"v is a numpy.ma.MaskedArray, .*mask would be ignored"):
        cuflash.attention(q, k, np.ma.masked_array(v, mask=v > 0))
    with pytest.raises(TypeError, match=r"x is a numpy.matrix"):
        cuflash.softmax(np.matrix(q))


def test_explain_names_itself_in_arch_errors():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"^cuflash.explain: arch=60 must be one of 'sm_70', 'sm_75'"):
        cuflash.explain(q, k, v, arch=60)
    with pytest.raises(ValueError, match=r"^cuflash.explain: arch='volta' must be one of"):
        cuflash.explain(q, k, v, arch="volta", backend="sim")


def test_explain_reason_names_the_dtype_of_the_call():
    q = np.zeros((1, 1, 4, 64), np.float16)
    assert "sm_75: tensor-core mma.sync tier" in cuflash.explain(q, q, q, arch=75)["choice"]   # the Turing form
    b = q.astype(dtypes.bfloat16)
    assert "sm_75 (Turing) has no bfloat16 tensor-core mma" in cuflash.explain(b, b, b, arch=75)["choice"]
    f = q.astype(np.float32)
    assert "dtype float32 (tensor cores on sm_75 take float16)" in cuflash.explain(f, f, f, arch=75)["choice"]
