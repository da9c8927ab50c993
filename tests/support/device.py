"""A simulated device call for tests that run a kernel host (a tier's ``forward``, the
dispatcher's ``run_*``) below the public functions: the same :class:`DeviceCall` a
``backend="sim"`` call makes, so its arrays must be imported as a GPU call's are."""

from __future__ import annotations

import contextlib

from cuflash.runtime.device_call import DeviceCall
from cuflash.sim.device import SimDevice
from cuflash.sim.memory import to_device


@contextlib.contextmanager
def sim_call(like, func: str = "test"):
    """A :class:`DeviceCall` on the simulator (its current options) for arrays like ``like``."""
    with DeviceCall(func, SimDevice(), like) as call:
        yield call


def on_device(call, problem, *arrays):
    """``(problem, *arrays)`` imported into ``call``'s device (None stays None)."""
    return (problem.on_device(call.import_array), *(call.import_array(a) for a in arrays))


__all__ = ["sim_call", "on_device", "to_device"]
