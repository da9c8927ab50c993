"""The host side of cuflash's CUDA kernels, and the dispatcher that chooses among them.

One module per ``kernels_cu/*.cu`` file, with the same stem (``kernels/attention_fwd_mma.py``
drives ``kernels_cu/attention_fwd_mma.cu``): its variants (the compile-time axes), the tile
heuristic, the eligibility rule (``unsupported_reason``) and the planner that turns a validated
problem into :class:`cuflash.runtime.plan.LaunchPlan` objects. Beside them:
what the tiers share (:mod:`~cuflash.kernels.launch_args`, the kernels' argument groups;
:mod:`~cuflash.kernels.forward_run`, :mod:`~cuflash.kernels.backward_run` and
:mod:`~cuflash.kernels.kvcache_run`, planning and launching a forward, a backward, a KV-cache
call), :mod:`~cuflash.kernels.dispatch` (which tier serves a call, and why faster ones did not),
:mod:`~cuflash.kernels.catalog` (every variant by arch: the compile gate's list) and
:mod:`~cuflash.kernels.precompile` (``cuflash.precompile``).

A kernel module never launches by itself: it is handed the call's
:class:`~cuflash.runtime.device_call.DeviceCall` (its ``launch``, the CUDA runner's or the
simulator's, and its array module ``xp``) by its caller in :mod:`cuflash.api`.

Imports: :mod:`cuflash.runtime`, :mod:`cuflash.reference` and :mod:`cuflash.sim` only; never
the public API, the framework adapters or the tools.
"""
