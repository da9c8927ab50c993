"""The CPU path (tiled NumPy forward, threaded) against what a CPU user already has.

B=1, H=8, D=64, float32 (the size of the CPU benchmark, ``bench --cpu``) at S=2048 and, under the ``slow`` marker
(not run by default), S=8192; causal or not. Baselines in the same run: naive NumPy attention
(S and P materialised) and, when torch is installed, torch's CPU
``scaled_dot_product_attention``. The cases and runners are ``python -m cuflash bench --cpu``'s
(:mod:`cuflash.tools.cpu_bench`). Run with timing, and save the run for regression checks::

    python -m pytest tests/benchmarks/test_cpu_path.py --benchmark-enable --benchmark-autosave

When a run is saved, tests/benchmarks/conftest.py adds each cuflash benchmark's
``time_ratio_to_<baseline>`` to its ``extra_info``; ``python -m cuflash bench --compare`` checks
two saved runs on those ratios (README, "Benchmark regression runs"). In the default test run
(``--benchmark-disable``) each case runs once, as a test, and its result is checked; no timing
is asserted anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference
from cuflash.tools import cpu_bench

CASES = []
for _case in cpu_bench.cases():
    for _impl in cpu_bench.IMPLS:
        _marks = [pytest.mark.slow] if _case.seqlen > 2048 else []
        CASES.append(pytest.param(_case, _impl, id=f"{_impl}-S{_case.seqlen}-{'causal' if _case.causal else 'full'}",
                                  marks=_marks))


@pytest.mark.parametrize("case,impl", CASES)
def test_forward(benchmark, case, impl):
    if impl == "torch_sdpa" and not cpu_bench.have_torch():
        pytest.skip("torch is not installed: no SDPA baseline")
    q, k, v = cpu_bench.make_inputs(case)
    out = benchmark(cpu_bench.runner(impl, q, k, v, case.causal))
    benchmark.extra_info.update(case=case.label, impl=impl, flops=case.flops,
                                shape=f"B={cpu_bench.B} H={cpu_bench.H} S={case.seqlen} D={cpu_bench.D} float32")
    # causal is bottom-right aligned: the last 64 rows of the full problem are rows of a 64 x S one
    check = reference.naive_attention(q[:, :2, -64:], k[:, :2], v[:, :2], causal=case.causal)
    np.testing.assert_allclose(out[:, :2, -64:], check, rtol=2e-4, atol=2e-5)
