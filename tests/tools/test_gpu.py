"""On a GPU: the ground of ``python -m cuflash check`` as pytest tests (gpu marker: they skip
without a device, and fail instead with ``CUFLASH_REQUIRE_GPU=1``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cuflash
from cuflash.tools import check

pytestmark = pytest.mark.gpu


def _run(section: str, seconds: float = 600.0) -> str:
    try:
        return check._FUNCS[section](check._Clock(seconds), lambda line: None)
    except check.Skip as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("case", check.grid_cases(), ids=check._case_name)
def test_grid_case_against_the_oracle(case):
    ok, msg = check.run_case(case, np.random.default_rng(hash(check._case_name(case)) % 2**32))
    assert ok, msg


@pytest.mark.parametrize("section", ["compile", "large", "softmax", "sim", "torch", "jax", "graph", "demo"])
def test_check_section(section):
    _run(section)


def test_cupy_stream_and_types():
    import cupy

    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((2, 3, 40, 64)).astype(np.float16))
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        o, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
    s.synchronize()
    assert isinstance(o, cupy.ndarray) and o.dtype == np.float16 and lse.dtype == np.float32
    assert o.device.id == q.device.id


def test_empty_inputs_launch_nothing(monkeypatch):
    import cupy

    from cuflash.runtime import cuda_runner

    calls = []
    monkeypatch.setattr(cuda_runner, "launch", lambda plan, stream=None: calls.append(plan))
    q = cupy.zeros((0, 2, 5, 32), cupy.float16)
    assert cuflash.attention(q, q, q).shape == (0, 2, 5, 32)
    q = cupy.zeros((1, 2, 0, 32), cupy.float16)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    assert out.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0) and calls == []


def test_precompile_is_thread_safe():
    from cuflash.kernels import precompile
    from cuflash.runtime import cuda_runner

    names = []
    threads = [threading.Thread(target=lambda: names.append(precompile.precompile(dtypes="f16", head_dims=64,
                                                                                   progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(names) == 3 and names[0] == names[1] == names[2] and names[0]
    import cupy

    dev = cupy.cuda.Device().id
    mods = {id(cuda_runner._modules[(dev, v)]) for v in precompile.variants_to_compile(
        int(cupy.cuda.Device().compute_capability), dtypes="f16", head_dims=64)}
    assert len(mods) == len(names[0])


def test_out_overlapping_an_input_is_refused():
    import cupy

    q = cupy.zeros((1, 2, 8, 32), cupy.float16)
    with pytest.raises(ValueError, match="out overlaps q"):
        cuflash.attention(q, q, q, out=q)


def test_check_command_passes():
    assert check.main(["--quiet"]) == 0
