"""Shared fixtures and markers.

``gpu`` tests skip without a CUDA device, unless ``CUFLASH_REQUIRE_GPU=1``, which turns the
missing device into a failure (a skip is never a pass).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


#: cache variables this session pointed at a temporary folder (pytest_configure), to undo
_CACHES_SET_HERE: list = []


def _temporary_caches() -> None:
    """Compiled simulator modules and CuPy's kernel cache go to a fresh temporary folder unless
    ``CUFLASH_SIM_CACHE_DIR`` / ``CUPY_CACHE_DIR`` say otherwise (CI sets both), so a test run
    never depends on, or writes to, ``~/.cache`` or ``~/.cupy``. Set before collection, which
    may import CuPy (it reads ``CUPY_CACHE_DIR`` when imported)."""
    import tempfile

    for var in ("CUFLASH_SIM_CACHE_DIR", "CUPY_CACHE_DIR"):
        if not os.environ.get(var):
            os.environ[var] = tempfile.mkdtemp(prefix=f"cuflash-test-{var.lower()}-")
            _CACHES_SET_HERE.append(var)


def pytest_unconfigure(config):
    import shutil

    while _CACHES_SET_HERE:
        shutil.rmtree(os.environ.pop(_CACHES_SET_HERE.pop()), ignore_errors=True)


@pytest.fixture(scope="session")
def _sim_cache():
    """The session's simulator module cache folder."""
    return Path(os.environ["CUFLASH_SIM_CACHE_DIR"])


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Saved benchmark runs go under ``.benchmarks/<machine>/`` (before pytest-benchmark opens
    its storage; see :func:`cuflash.tools.bench_compare.storage_per_machine`); the caches go to
    temporary folders (:func:`_temporary_caches`)."""
    _temporary_caches()
    if hasattr(config.option, "benchmark_storage"):  # pytest-benchmark is installed
        from cuflash.tools.bench_compare import storage_per_machine

        storage_per_machine(config.option)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _have_gpu():
        return
    if os.environ.get("CUFLASH_REQUIRE_GPU") == "1":
        fail = pytest.mark.usefixtures("_require_gpu_failure")
        for item in gpu_items:
            item.add_marker(fail)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (set CUFLASH_REQUIRE_GPU=1 to fail instead)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def _require_gpu_failure():
    pytest.fail("CUFLASH_REQUIRE_GPU=1 but no CUDA GPU is available")


@pytest.fixture(autouse=True)
def _sim_seed_per_test(request):
    """Every test runs the simulator under its own seed (0..7, from the test's name), so the
    kernel grids cover several thread orders and cp.async landings without multiplying the
    grids (a single-writer race shows under about half the seeds). ``CUFLASH_SIM_SEED`` set in
    the environment wins, a test marked ``sim_default_options`` runs without it, and a test's own
    ``sim.options(seed=...)`` wins inside it."""
    if os.environ.get("CUFLASH_SIM_SEED") or request.node.get_closest_marker("sim_default_options"):
        yield
        return
    from cuflash import sim

    with sim.options(seed=zlib.crc32(request.node.nodeid.encode()) % 8):
        yield


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())  # stable across processes (str hash is salted)
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# CI guard: .ci/run sets CUFLASH_SKIP_REPORT to a file; every skipped test is written there with
# whether it carries the `gpu` marker, and .ci/run fails if any other test skipped. Under
# pytest-xdist the controller receives every worker's reports, so it writes the whole list.

_skipped: list[tuple[str, bool, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, "gpu" in report.keywords, reason))


def pytest_sessionfinish(session, exitstatus):
    """Write the skip report, from the process that saw every test's report: the only process
    without pytest-xdist, the controller with it (its workers' reports reach it; a worker writes
    nothing, or it would overwrite the whole list with its share)."""
    path = os.environ.get("CUFLASH_SKIP_REPORT")
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w", encoding="utf-8") as f:
            for nodeid, is_gpu, reason in _skipped:
                f.write(f"{'gpu' if is_gpu else 'NOT-GPU'}\t{nodeid}\t{reason}\n")


def pytest_terminal_summary(terminalreporter):
    """Print the compile gate's resource table (registers, shared memory, NVRTC time) per
    compiler, and each compiler's total compile time and the wall time of its thread pool."""
    import sys

    gate = sys.modules.get("test_compile_gate")
    rows = getattr(gate, "RESOURCE_TABLE", None)
    if not rows:
        return
    tr = terminalreporter
    tr.section("NVRTC compile gate: resources per variant")
    tr.write_line(f"{'nvrtc':<6} {'arch':<7} {'entry':<52} {'regs':>5} {'smem B':>7} {'compile s':>9}")
    for nvrtc, arch, entry, regs, smem, seconds in sorted(rows):
        tr.write_line(f"{nvrtc:<6} {arch:<7} {entry:<52} {regs:>5} {smem:>7} {seconds:>9.2f}")
    for nvrtc, (total, wall) in sorted(getattr(gate, "COMPILE_TIMES", {}).items()):
        n = sum(1 for r in rows if r[0] == nvrtc)
        tr.write_line(f"NVRTC {nvrtc}: {n} compiles, {total:.1f} s of compiler time, {wall:.1f} s wall on "
                      f"{getattr(gate, 'WORKERS', '?')} threads")


@pytest.fixture
def without_hopper_tier(monkeypatch):
    """The dispatcher without its Hopper tiers (kernels_cu/attention_fwd_sm90.cu and
    attention_bwd_sm90.cu), for tests of the tensor-core tier on sm_90, which serves the calls the
    Hopper tiers refuse."""
    from cuflash.kernels import attention_bwd_sm90, attention_fwd_sm90, dispatch

    monkeypatch.setattr(dispatch, "TIERS", tuple(t for t in dispatch.TIERS if t[1] is not attention_fwd_sm90))
    monkeypatch.setattr(dispatch, "BACKWARD_TIERS",
                        tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_sm90))


@pytest.fixture(scope="session")
def cuobjdump() -> str:
    """The ``cuobjdump`` of the test extra (its ``nvdisasm`` beside it), or a failure naming the wheels."""
    from cuflash.analysis import roofline

    exe = roofline.find_tool("cuobjdump")
    if exe is None or roofline.find_tool("nvdisasm") is None:
        pytest.fail("cuobjdump/nvdisasm not found: install the test extra "
                    "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return exe
