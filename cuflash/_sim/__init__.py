"""The CUDA simulator: runs the kernels of ``kernels_cu/`` on the CPU (see :mod:`cuflash.sim`).

* :mod:`cuflash._sim.launcher` compiles one module per source text with g++ (disk cache),
  loads it with ctypes and runs :class:`cuflash._plan.LaunchPlan` objects;
* :mod:`cuflash._sim.lower` rewrites ``__shared__`` declarations into per-block arena slots;
* ``cusim.h`` (with ``cusim_half.h``, ``cusim_switch_x86_64.S`` and stand-ins for
  ``cuda_fp16.h``/``cuda_bf16.h``) is the C++ runtime: fibers, barriers, warp collectives, shared
  memory, atomics, device math. The PTX emulations live beside the PTX in ``kernels_cu/ptx.cuh``.
"""
