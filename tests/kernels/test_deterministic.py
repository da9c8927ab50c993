"""deterministic=True of the kernel backward (kernels_cu/attention_bwd_simt.cu) on the simulator.

Two runs with different seeded thread (fiber) orders give bit-identical dq, dk, dv; the results
are correct by the gradient tolerance rule; splits smaller than the key-tile count (a block
looping over several key tiles) are covered; the default (atomic) mode is correct too.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.grads import check_grads_close, make_qkv

import cuflash
from cuflash.kernels import backward_run
from cuflash.runtime import dtypes

CASES = [
    # (sq, sk, d, heads, causal, window, layout, dtype)
    (37, 97, 64, (2, 1), False, (-1, -1), "bhsd", dtypes.float16),
    (50, 70, 40, (4, 2), True, (-1, -1), "bshd", dtypes.bfloat16),
    (33, 65, 32, (3, 3), False, (9, 4), "bhsd", dtypes.float32),
]


def _run(rng_seed, case, deterministic, seeds):
    sq, sk, d, (hq, hk), causal, window, layout, dtype = case
    rng = np.random.default_rng(rng_seed)
    q, k, v = make_qkv(rng, 2, hq, hk, sq, sk, d, d, layout=layout, dtype=dtype)
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    runs = []
    for seed in seeds:
        with cuflash.sim.options(seed=seed):
            runs.append(cuflash.attention_backward(
                dout, q, k, v, out, lse, backend="sim", deterministic=deterministic, **kw))
    for grads in runs:
        check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return runs


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("max_splits", [16, 2])
@pytest.mark.parametrize("case", CASES, ids=["f16", "bf16_gqa_causal", "f32_window"])
def test_deterministic_bits_across_fiber_orders(case, max_splits, monkeypatch):
    # max_splits=2: each block loops over several key tiles (the partial RMW path); the split
    # partials are the portable and tensor-core tiers' scheme, so the Hopper backward (which orders
    # its adds instead: tests/kernels/test_hopper_backward.py) stays out
    from cuflash.kernels import attention_bwd_sm90, dispatch

    monkeypatch.setattr(dispatch, "BACKWARD_TIERS",
                        tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_sm90))
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", max_splits)
    a, b = _run(1234, case, True, seeds=(1, 987654))
    for ga, gb in zip(a, b):
        assert np.array_equal(_bits(ga), _bits(gb))


def test_default_mode_is_correct(rng):
    _run(77, CASES[0], False, seeds=(3, 4))  # correctness only: atomics may reorder the last bits


def test_deterministic_splits():
    f = backward_run.deterministic_splits
    assert f(1, 1) == 1 and f(4, 1) == 4
    assert f(1000, 1) == backward_run.MAX_DETERMINISTIC_SPLITS
    assert f(1000, 10_000) == 1 and f(0, 3) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 128), ("float32", 64), ("float16", 96)])
def test_deterministic_bits_on_the_gpu(dtype, d):
    # many blocks per kv head contend for dq: the atomic default may differ in the last bits run to
    # run; deterministic=True must not (and must agree with the default within the rounding)
    import cupy

    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 2, 8, 2, 1000, 1500, d, d, dtype=np.dtype(dtype) if dtype != "bfloat16" else dtypes.bfloat16)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    args = [cupy.asarray(x.view(np.uint16)).view(cupy.float16) if q.dtype == dtypes.bfloat16 else cupy.asarray(x)
            for x in (dout, q, k, v, out)]
    if q.dtype == dtypes.bfloat16:  # CuPy has no bfloat16: go through torch's DLPack
        torch = pytest.importorskip("torch")
        args = [torch.from_dlpack(a).view(torch.bfloat16) for a in args]
        lse_d = torch.from_dlpack(cupy.asarray(lse))
        to_bits = lambda g: cupy.from_dlpack(g.view(torch.int16)).get()  # noqa: E731
    else:
        lse_d = cupy.asarray(lse)
        to_bits = lambda g: cupy.asnumpy(g).view(np.uint8)  # noqa: E731
    runs = [cuflash.attention_backward(*args, lse_d, causal=True, backend="cuda", deterministic=True) for _ in range(3)]
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert np.array_equal(to_bits(a), to_bits(b))
    default = cuflash.attention_backward(*args, lse_d, causal=True, backend="cuda")
    for a, b in zip(runs[0], default):
        fa = to_bits(a).view(q.dtype).astype(np.float32) if q.dtype != np.float32 else to_bits(a).view(np.float32)
        fb = to_bits(b).view(q.dtype).astype(np.float32) if q.dtype != np.float32 else to_bits(b).view(np.float32)
        np.testing.assert_allclose(fa, fb, rtol=2e-2, atol=2e-2)
