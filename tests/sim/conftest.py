"""Fixtures for the simulator suite.

The compiled modules are shared by all tests through the simulator's disk cache (a fresh
temporary folder per session unless ``CUFLASH_SIM_CACHE_DIR`` is set: ``_sim_cache`` in
tests/conftest.py). All modules the suite needs are compiled up front, in parallel, by the
session fixture ``modules``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuflash import sim
from cuflash.kernels.softmax import SoftmaxVariant
from cuflash.runtime import source
from cuflash.sim import launcher

KERNELS = Path(__file__).parent / "kernels"


def probe_source(name: str) -> str:
    return source.build_text((KERNELS / name).read_text(), origin=name, search_dirs=[KERNELS])


def load_probe(name: str, **opts) -> launcher.SimModule:
    with sim.options(**opts) as o:
        return launcher.load_source(probe_source(name), origin=name, options=o)


class Modules:
    """The compiled test modules, by name."""

    def __init__(self):
        with sim.options() as default, sim.options(fibers="ucontext") as uc:
            jobs = {
                "sim": lambda: launcher.load_source(probe_source("sim_probes.cu"), origin="sim_probes.cu", options=default),
                "ptx": lambda: launcher.load_source(probe_source("ptx_probes.cu"), origin="ptx_probes.cu", options=default),
                "too_much_static": lambda: launcher.load_source(
                    probe_source("too_much_static.cu"), origin="too_much_static.cu", options=default
                ),
                "sim_ucontext": lambda: launcher.load_source(
                    probe_source("sim_probes.cu"), origin="sim_probes.cu", options=uc
                ),
            }
            for v in SoftmaxVariant.all():
                jobs[v.name] = (lambda v=v: launcher.load_variant(v, default))
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
                futures = {k: ex.submit(f) for k, f in jobs.items()}
                self.by_name = {k: f.result() for k, f in futures.items()}

    def __getitem__(self, name):
        return self.by_name[name]


@pytest.fixture(scope="session")
def modules(_sim_cache) -> Modules:
    return Modules()
