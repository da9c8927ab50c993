"""On a GPU: the CUDA runner, and the simulator's PTX emulations against the hardware (same
probe kernels, same inputs). Skipped without a device (gpu marker)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cuflash import softmax
from cuflash.runtime import cuda_runner, source

pytestmark = pytest.mark.gpu
KERNELS = Path(__file__).parent / "kernels"


def test_softmax_cuda_matches_simulator(modules):
    import cupy

    x = (np.random.default_rng(0).standard_normal((7, 4097)) * 3).astype(np.float16)
    y = softmax(cupy.asarray(x))
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype
    np.testing.assert_allclose(cupy.asnumpy(y).astype(np.float32), softmax(x, backend="sim").astype(np.float32),
                               rtol=2e-3, atol=1e-7)


def test_ptx_probes_on_hardware_match_simulator(modules):
    import cupy
    from support.simtools import P, i32, plan

    src = source.build_text((KERNELS / "ptx_probes.cu").read_text(), origin="ptx_probes.cu", search_dirs=[KERNELS])
    mod = cupy.RawModule(code=src, options=cuda_runner.nvrtc_options())
    out_gpu = cupy.zeros((32, 14), cupy.uint32)
    mod.get_function("ldmatrix_probe")((1,), (32,), (out_gpu, np.int32(0)))
    out_sim = np.zeros((32, 14), np.uint32)
    modules["ptx"].launch(plan("ldmatrix_probe", 1, 32, P(out_sim), i32(0)))
    np.testing.assert_array_equal(cupy.asnumpy(out_gpu), out_sim)
    rng = np.random.default_rng(1)
    for bf16 in (0, 1):
        A = rng.integers(-8, 9, (16, 16)).astype(np.float16).view(np.uint16)
        B = rng.integers(-8, 9, (16, 8)).astype(np.float16).view(np.uint16)
        if bf16:
            import ml_dtypes

            A = A.view(np.float16).astype(ml_dtypes.bfloat16).view(np.uint16)
            B = B.view(np.float16).astype(ml_dtypes.bfloat16).view(np.uint16)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        D_gpu = cupy.zeros((16, 8), cupy.float32)
        mod.get_function("mma_direct")((1,), (32,), (cupy.asarray(A), cupy.asarray(B), cupy.asarray(C), D_gpu,
                                                     np.int32(bf16)))
        D_sim = np.zeros((16, 8), np.float32)
        modules["ptx"].launch(plan("mma_direct", 1, 32, P(A), P(B), P(C), P(D_sim), i32(bf16)))
        np.testing.assert_allclose(cupy.asnumpy(D_gpu), D_sim, rtol=1e-6, atol=1e-6)
