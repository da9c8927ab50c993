"""The host side of cuflash's CUDA kernels, and the dispatcher that chooses among them.

One module per ``kernels_cu/*.cu`` file, with the same stem (``kernels/attention_fwd_mma.py``
drives ``kernels_cu/attention_fwd_mma.cu``): its variants (the compile-time axes), the tile
heuristic, the eligibility rule (``unsupported_reason``) and the planner that turns a validated
problem into :class:`cuflash.runtime.plan.LaunchPlan` objects. Beside them:
:mod:`~cuflash.kernels.dispatch` (which tier serves a call, and why faster ones did not),
:mod:`~cuflash.kernels.catalog` (every variant by arch: the compile gate's list) and
:mod:`~cuflash.kernels.precompile` (``cuflash.precompile``).

A kernel module never launches by itself: it is handed a ``launch(plan)`` callable (the CUDA
runner's or the simulator's) and an array module ``xp`` by its caller in :mod:`cuflash.api`.

Imports: :mod:`cuflash.runtime`, :mod:`cuflash.reference` and :mod:`cuflash.sim` only; never
the public API, the framework adapters or the tools.
"""
