"""The simulator's launch-time estimate and its warning (cuflash.sim.launcher): a launch estimated
past SLOW_LAUNCH_SECONDS warns once per process and kernel, before it runs. Rates and thresholds
are injected; no test runs a long launch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from cuflash import sim
from cuflash.kernels.softmax import SoftmaxVariant, plan_softmax
from cuflash.sim import launcher


@pytest.fixture
def fresh(monkeypatch):
    """No entry has warned or been timed yet in this test."""
    monkeypatch.setattr(launcher, "_warned", set())
    monkeypatch.setattr(launcher, "_timings", {})


def _plan(rows, cols):
    x = np.ones((rows, cols), np.float32)
    return plan_softmax(x, np.empty_like(x))


def test_the_estimate_is_block_iterations_times_the_rate_over_the_workers(fresh):
    p = _plan(3, 1025)   # the block-per-row kernel: 3 blocks over rows of 1025
    assert p.entry == "cuflash_softmax_f32_block" and p.num_blocks == 3
    assert launcher.block_iterations(p) == 3 * 1025
    assert launcher.estimate_seconds(p, workers=1) == pytest.approx(3 * 1025 * 3e-6)
    assert launcher.estimate_seconds(p, workers=8) == pytest.approx(1025 * 3e-6)   # 3 blocks use 3 workers
    assert launcher.estimate_seconds(p, workers=1, checked=True) == pytest.approx(3 * 1025 * 3e-6 * 12)
    # once the entry has been timed (0.5 s of CPU for 1000 block-iterations), that rate replaces the constant
    launcher._record_time(p, 0.25, 2, False)
    launcher._record_time(p, 0.01, 2, False)   # too short to time: ignored
    assert launcher._timings[(p.entry, False)] == [3075, 0.5]
    assert launcher.estimate_seconds(_plan(6, 1025), workers=2) == pytest.approx(6 * 1025 * 0.5 / 3075 / 2)


def test_a_launch_estimated_past_the_threshold_warns_once_per_kernel(fresh, modules, monkeypatch):
    monkeypatch.setattr(launcher, "ITERATION_SECONDS", (("softmax", 1.0),))   # an injected rate: 1 s per iteration
    block, warp = modules[SoftmaxVariant("f32", "block").name], modules[SoftmaxVariant("f32", "warp").name]
    p = _plan(3, 1025)
    with sim.options(workers=1) as o, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        block.launch(p, o)
        block.launch(_plan(4, 2000), o)   # the same kernel: no second warning
        q = _plan(2, 64)   # the warp kernel: 1 block x 64 = 64 s
        warp.launch(q, o)
    slow = [w for w in seen if issubclass(w.category, launcher.SimSlowLaunchWarning)]
    assert len(slow) == 2 and issubclass(launcher.SimSlowLaunchWarning, RuntimeWarning)
    assert "cuflash_softmax_f32_block" in str(slow[0].message) and "about 3075 s on 1 worker" in str(slow[0].message)
    assert "cuflash_softmax_f32_warp" in str(slow[1].message) and "about 64 s" in str(slow[1].message)
    assert slow[0].filename == __file__   # attributed to the caller, not to the launcher
    np.testing.assert_allclose(p.args[1].base.sum(axis=-1), 1.0, rtol=1e-5)   # the launches still ran


def test_a_launch_under_the_threshold_is_silent(fresh, modules, monkeypatch):
    monkeypatch.setattr(launcher, "SLOW_LAUNCH_SECONDS", 1e9)
    monkeypatch.setattr(launcher, "ITERATION_SECONDS", (("softmax", 1.0),))
    with sim.options(workers=1) as o, warnings.catch_warnings():
        warnings.simplefilter("error", launcher.SimSlowLaunchWarning)
        modules[SoftmaxVariant("f32", "block").name].launch(_plan(3, 1025), o)
