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


def sim_kvcache_forward(problem, q, num_splits, checked=True):
    """``(out, lse)`` exported from the dispatcher's ``run_forward`` on the simulator for the KV-cache
    call ``problem`` (its :class:`~cuflash.runtime.validation_kvcache.KVCache` taken as it is, e.g.
    with device indices no host check has seen) at ``num_splits`` splits, in checked mode unless
    ``checked`` is False."""
    import dataclasses

    from cuflash import sim
    from cuflash.kernels import dispatch

    problem = dataclasses.replace(problem, kvcache=dataclasses.replace(problem.kvcache, num_splits=num_splits))
    with sim.options(checked=checked), sim_call(q) as call:
        p, qd = on_device(call, problem, q)
        return tuple(call.export(a) for a in dispatch.run_forward(p, qd, p.kvcache.k_cache, p.kvcache.v_cache,
                                                                   None, call))


def sim_backward(module, dout, q, k, v, out, lse, *, causal=False, window_size=(-1, -1), layout="bhsd",
                 deterministic=False):
    """``(dq, dk, dv)`` of the backward tier ``module`` (its ``main_variant`` between the shared dot
    and convert stages, :func:`cuflash.kernels.backward_run.backward`) on the simulator (its
    current options), bypassing the dispatcher; the tier's ``unsupported_reason`` must accept
    the call."""
    from cuflash.kernels import backward_run
    from cuflash.reference import backward as ref_backward
    from cuflash.runtime.options import Options

    opts = Options(causal=causal, window_size=window_size, layout=layout, deterministic=deterministic)
    p = ref_backward.check_backward(dout, q, k, v, out, lse, opts, func="test", max_head_dim=256)
    why = module.unsupported_reason(p, 90, (q, k, v, out, dout))
    assert why is None, why
    with sim_call(q) as call:
        pd = p.on_device(call.import_array)
        grads = backward_run.backward(pd, *(call.import_array(x) for x in (dout, q, k, v, out, lse)),
                                      module.main_variant(p, 90), call)
        return tuple(call.export(g) for g in grads)


__all__ = ["sim_call", "on_device", "to_device", "sim_kvcache_forward", "sim_backward"]
