"""cuflash.softmax: the online-softmax kernel on the simulator against float64, and the NumPy path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuflash import sim
from cuflash import softmax
from cuflash.kernels.softmax import SoftmaxVariant, plan_softmax
from cuflash.reference import online_softmax

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
# |y - ref| <= atol + rtol * |ref|: two roundings of the output type plus float32 accumulation
RTOL = {"float16": 2 * 2.0**-11 + 1e-5, "bfloat16": 2 * 2.0**-8 + 1e-5, "float32": 2e-5}
ATOL = {"float16": 2.0**-24, "bfloat16": 1e-38, "float32": 1e-38}


def reference(x, axis=-1):
    x64 = np.asarray(x, np.float64)
    m = np.max(x64, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(x64 - m)
        return e / e.sum(axis=axis, keepdims=True)


def check(y, x, axis=-1):
    name = np.dtype(x.dtype).name
    assert y.dtype == x.dtype and y.shape == x.shape and isinstance(y, np.ndarray)
    ref = reference(x, axis)
    yv = y.astype(np.float64)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(yv), nan)
    err = np.abs(yv - ref)[~nan]
    bound = ATOL[name] + RTOL[name] * np.abs(ref[~nan])
    assert (err <= bound).all(), f"{name}: max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("n", [1, 7, 1000, 4097, 2**17])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sim_softmax_lengths_and_dtypes(modules, n, dtype):
    rng = np.random.default_rng(n)
    rows = 3 if n >= 4097 else 6
    x = (rng.standard_normal((rows, n)) * 4).astype(dtype)
    y = softmax(x, backend="sim")
    check(y, x)
    np.testing.assert_allclose(y.astype(np.float64).sum(-1), 1.0, rtol=RTOL[np.dtype(dtype).name] * 4 + 1e-4)


@pytest.mark.parametrize("n", [7, 4097])
def test_sim_softmax_neg_inf_entries_and_empty_rows(modules, n):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, n)) * 3).astype(np.float32)
    x[0, ::2] = -np.inf  # some -inf entries: probability 0
    x[1, :] = -np.inf  # all -inf: NaN, as SciPy and PyTorch
    x[2, 1:] = -np.inf  # one finite entry: probability 1
    x[3, 0] = -np.inf
    y = softmax(x, backend="sim")
    check(y, x)
    assert (y[0, ::2] == 0).all()
    assert np.isnan(y[1]).all()
    assert y[2, 0] == 1 and (y[2, 1:] == 0).all()


def test_sim_softmax_nan_row(modules):
    x = np.random.default_rng(4).standard_normal((3, 50)).astype(np.float32)
    x[1, 10] = np.nan
    y = softmax(x, backend="sim")
    assert np.isnan(y[1]).all() and not np.isnan(y[[0, 2]]).any()


def test_sim_softmax_axis_and_strides(modules):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 33, 5)).astype(np.float32)
    for axis in (0, 1, -1):
        check(softmax(x, axis=axis, backend="sim"), x, axis)
    big = rng.standard_normal((6, 80)).astype(np.float16)
    view = big[::2, 5:70]  # row stride 160 elements, unit column stride: no copy needed
    check(softmax(view, backend="sim"), view)
    check(softmax(big.T, axis=0, backend="sim"), big.T, 0)


def test_sim_softmax_large_logits(modules):
    x = np.array([[1e4, 1e4 - 1, -1e4, 0.0], [-3e38, 3e38, 0, 1]], np.float32)
    check(softmax(x, backend="sim"), x)


def test_sim_softmax_variant_choice():
    x = np.zeros((3, 1024), np.float32)
    y = np.zeros_like(x)
    p = plan_softmax(x, y)
    assert p.variant == SoftmaxVariant("f32", "warp") and p.entry == "cuflash_softmax_f32_warp"
    assert p.grid == (1, 1, 1) and p.block == (32, 4, 1) and not p.needs_smem_opt_in
    x = np.zeros((3, 1025), np.float16)
    p = plan_softmax(x, x.copy())
    assert p.variant == SoftmaxVariant("f16", "block") and p.grid == (3, 1, 1) and p.block == (256, 1, 1)
    assert [a.name for a in p.args] == ["x", "y", "n_rows", "n_cols", "x_row_stride", "y_row_stride"]
    assert [type(a.value) for a in p.args[2:]] == [np.int64, np.int32, np.int64, np.int64]


def test_sim_softmax_honours_arch_and_seed(modules):
    x = np.random.default_rng(1).standard_normal((5, 300)).astype(ml_dtypes.bfloat16)
    base = softmax(x, backend="sim")
    with sim.options(seed=12345):
        np.testing.assert_array_equal(softmax(x, backend="sim"), base)  # race-free: order does not matter
    with sim.options(arch="sm_80"):
        y = softmax(x, backend="sim")
    np.testing.assert_array_equal(y, base)


def test_numpy_path_and_auto(monkeypatch):
    rng = np.random.default_rng(3)
    for dt in DTYPES + [np.float64]:
        x = (rng.standard_normal((4, 3000)) * 5).astype(dt)
        x[1, :] = -np.inf
        x[2, ::3] = -np.inf
        y = softmax(x)  # auto -> numpy
        assert y.dtype == x.dtype
        if dt != np.float64:
            check(y, x)
            check(online_softmax(x, -1, block_size=100).astype(x.dtype), x)  # blocks that split rows
        else:
            np.testing.assert_allclose(y, reference(x), rtol=1e-12, atol=0)
    monkeypatch.setenv("CUFLASH_BACKEND", "sim")
    x = rng.standard_normal((2, 9)).astype(np.float32)
    check(softmax(x), x)  # the override reaches "auto" only
    monkeypatch.setenv("CUFLASH_BACKEND", "bogus")
    with pytest.raises(ValueError, match="CUFLASH_BACKEND"):
        softmax(x)


def test_empty_input_launches_nothing():
    for shape in [(0, 5), (3, 0), (0,)]:
        x = np.zeros(shape, np.float32)
        for backend in ("numpy", "sim"):
            y = softmax(x, backend=backend)
            assert y.shape == shape and y.dtype == x.dtype


def test_validation_errors():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match=r"x must be an array \(numpy.ndarray, cupy.ndarray, or a DLPack array .*got builtins.list"):
        softmax([[1.0, 2.0]])
    with pytest.raises(TypeError, match="x.dtype must be .* got int32"):
        softmax(np.ones(3, np.int32))
    with pytest.raises(TypeError, match="axis must be an int, got float"):
        softmax(x, axis=1.0)
    with pytest.raises(ValueError, match=r"axis=2 must be in \[-2, 1\]"):
        softmax(x, axis=2)
    with pytest.raises(ValueError, match="0-d"):
        softmax(np.ones((), np.float32))
    with pytest.raises(ValueError, match="backend must be one of .* got 'gpu'"):
        softmax(x, backend="gpu")
    with pytest.raises(ValueError, match=r"cuflash.softmax: backend='cuda' needs GPU arrays .*got NumPy arrays"):
        softmax(x, backend="cuda")
    with pytest.raises(NotImplementedError, match="cuflash.softmax: the kernels compute .*float64 runs on the NumPy path only"):
        softmax(x.astype(np.float64), backend="sim")
