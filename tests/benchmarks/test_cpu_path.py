"""The CPU path (tiled NumPy forward) against naive NumPy attention.

B=1, H=8, S=2048, D=64, float32: the seed's example size. Run with timing:

    python -m pytest tests/benchmarks/test_cpu_path.py --benchmark-enable

In the default test run (``--benchmark-disable`` in setup.cfg) each benchmark runs once, as a
test, and its result is checked; no timing is asserted anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference

B, H, S, D = 1, 8, 2048, 64


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(2048)
    return tuple(rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(3))


def _naive_numpy_float32(q, k, v, causal):
    """What a user writes in NumPy: S and P materialised in float32."""
    s = (q @ k.swapaxes(-1, -2)) * np.float32(1 / np.sqrt(q.shape[-1]))
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", ["cuflash_cpu", "naive_numpy"])
def test_forward(benchmark, qkv, impl, causal):
    q, k, v = qkv
    if impl == "cuflash_cpu":
        out = benchmark(cuflash.attention, q, k, v, causal=causal)
    else:
        out = benchmark(_naive_numpy_float32, q, k, v, causal)
    flops = 4 * B * H * S * S * D // (2 if causal else 1)
    benchmark.extra_info.update(flops=flops, shape=f"B={B} H={H} S={S} D={D} float32")
    check = reference.naive_attention(q[:, :2, -64:], k[:, :2], v[:, :2], causal=causal)
    # causal is bottom-right aligned: the last 64 rows of the full problem are rows of a 64 x S one
    np.testing.assert_allclose(out[:, :2, -64:], check, rtol=2e-4, atol=2e-5)
