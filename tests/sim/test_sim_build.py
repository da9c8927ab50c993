"""The simulator's build: the runtime parts compiled once per flag set (``rt-<key>/cusim.o`` and
``cusim.h.gch`` in the cache folder) and linked by each module, ``CUFLASH_SIM_COMPILE_LOG``'s one
line per module built, and a g++ failure reported with its diagnostics."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from conftest import KERNELS
from support.simtools import P, plan

import cuflash
from cuflash.runtime import source
from cuflash.sim import launcher

KERNEL = '#include "common.cuh"\nextern "C" __global__ void sim_build_fill(float* y) { y[threadIdx.x] = 2.0f * threadIdx.x; }\n'


def _fresh(text: str) -> str:
    """``text`` with a unique comment: a cache key no earlier build has, so it compiles now."""
    return source.build_text(f"{text}// {uuid.uuid4().hex}\n", origin="sim_build.cu", search_dirs=[KERNELS])


def test_a_new_module_links_the_runtime_object_and_logs_its_build(tmp_path, monkeypatch):
    log = tmp_path / "compiles.tsv"
    monkeypatch.setenv(launcher.COMPILE_LOG_ENV, str(log))
    with cuflash.sim.options(arch="sm_80") as o:
        mod = launcher.load_source(_fresh(KERNEL), origin="sim_build.cu", options=o)
        y = np.zeros(64, np.float32)
        mod.launch(plan("sim_build_fill", 1, 64, P(y)), o)
    assert np.array_equal(y, 2.0 * np.arange(64, dtype=np.float32))   # the launch is the runtime object's
    (line,) = log.read_text().splitlines()
    test, key, entries, arch, checked, numerics, wall, cpu, rt_cpu = line.split("\t")
    assert test.endswith("test_a_new_module_links_the_runtime_object_and_logs_its_build")
    assert (entries, arch, checked, numerics) == ("sim_build_fill", "sm_80", "0", "0")
    assert len(key) > 8 and float(wall) > 0 and float(cpu) > 0 and float(rt_cpu) >= 0
    parts = [p for p in launcher.cache_dir().glob("rt-*") if p.is_dir()]
    assert parts and all((p / "cusim.o").is_file() and (p / "cusim.h.gch").is_file() for p in parts)


def test_a_kernel_g_plus_plus_rejects_is_a_runtime_error_with_its_diagnostics(monkeypatch):
    monkeypatch.delenv(launcher.COMPILE_LOG_ENV, raising=False)
    bad = KERNEL.replace("2.0f * threadIdx.x;", "2.0f * undeclared_name;")
    with cuflash.sim.options(arch="sm_80") as o, pytest.raises(RuntimeError, match=r"(?s)g\+\+ failed on sim_build\.cu.*undeclared_name"):
        launcher.load_source(_fresh(bad), origin="sim_build.cu", options=o)
