"""Every kernel, and the simulator's probe kernels, compile with NVRTC for real GPUs (no device
needed: CuPy's low-level NVRTC binding), with exactly the options used at run time."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuflash.kernels.softmax import SoftmaxVariant
from cuflash.runtime import cuda_runner, source

KERNELS = Path(__file__).parent / "kernels"


def _probe(name):
    return source.build_text((KERNELS / name).read_text(), origin=name, search_dirs=[KERNELS])


def test_runtime_options_replicate_cupy():
    opts = cuda_runner.nvrtc_options()
    assert any(o.startswith("-I") and Path(o[2:], "cuda_fp16.h").is_file() for o in opts)
    assert not any(o.startswith(("-std", "--std", "-arch")) for o in opts)  # CuPy adds these
    assert cuda_runner.CUPY_IMPLICIT_OPTIONS == ("-ftz=true", "--device-as-default-execution-space", "-std=c++17")


@pytest.mark.parametrize("arch", cuda_runner.SIMT_ARCHS)
@pytest.mark.parametrize("variant", SoftmaxVariant.all(), ids=lambda v: v.name)
def test_softmax_variants_compile(variant, arch):
    cubin, log = cuda_runner.nvrtc_compile(source.build_source(variant), arch)
    assert cubin[:4] == b"\x7fELF"
    assert variant.entry.encode() in cubin


@pytest.mark.parametrize("arch", cuda_runner.SIMT_ARCHS)
@pytest.mark.parametrize("name", ["sim_probes.cu", "ptx_probes.cu"])
def test_probe_kernels_compile(name, arch):
    """The test kernels are real CUDA: ptx.cuh's asm (sm_80+) and its sm_75 fallbacks compile."""
    cubin, _ = cuda_runner.nvrtc_compile(_probe(name), arch)
    assert cubin[:4] == b"\x7fELF"


def test_static_shared_limit_agrees_with_ptxas():
    with pytest.raises(RuntimeError, match="too much shared data"):
        cuda_runner.nvrtc_compile(_probe("too_much_static.cu"), 90)
