"""Small helpers for the simulator tests (plans for the probe kernels)."""

from __future__ import annotations

import numpy as np

from cuflash.runtime.plan import LaunchPlan, PointerArg, ScalarArg


def P(a, name="p"):
    """Pointer argument (writable) to a NumPy array."""
    return PointerArg.of(name, a, writable=True)


def plan(entry, grid, block, *args, smem=0):
    """A launch plan for a test kernel (no variant: the module is given explicitly)."""
    return LaunchPlan(None, entry, grid, block, smem, args)


def i32(v):
    return ScalarArg("i", np.int32(v))
