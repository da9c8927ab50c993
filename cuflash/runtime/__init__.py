"""What every layer of cuflash stands on: arrays, dtypes, validation, variants, launch plans,
kernel source text and the CUDA runner.

* :mod:`~cuflash.runtime.dtypes`: the supported dtypes (bfloat16 is ``ml_dtypes.bfloat16``);
* :mod:`~cuflash.runtime.options`: the options object every public function builds once;
* :mod:`~cuflash.runtime.interop`: array kinds (NumPy, CuPy, DLPack), metadata, frameworks, and
  the host side of a call (CPU DLPack arrays as NumPy views);
* :mod:`~cuflash.runtime.device_call`: the device side of a call (device, stream, zero-copy
  imports, ``out=``, launches, export: :class:`~cuflash.runtime.device_call.DeviceCall`) and the
  CUDA device (:class:`~cuflash.runtime.device_call.CudaDevice`); the simulator's device is
  :class:`cuflash.sim.device.SimDevice`;
* :mod:`~cuflash.runtime.validation`: argument checks done from metadata before any work
  (:class:`~cuflash.runtime.validation.AttentionProblem`); :mod:`~cuflash.runtime.validation_modifiers`
  the score modifiers' (softcap, ALiBi, bias, mask, sinks, score_mod, mask_mod:
  ``AttentionProblem.modifiers``); :mod:`~cuflash.runtime.score_mod` traces ``score_mod`` and
  ``mask_mod`` into an expression tree (its canonical text, derivative and index ranges);
* :mod:`~cuflash.runtime.variants`: the base of kernel variants (compile-time axes);
* :mod:`~cuflash.runtime.plan`: launch plans, shared by the CUDA runner and the simulator;
* :mod:`~cuflash.runtime.paths` and :mod:`~cuflash.runtime.source`: finding ``kernels_cu/`` and
  building a variant's exact source text;
* :mod:`~cuflash.runtime.nvrtc`: NVRTC 12.x and 13.x found and loaded side by side (ctypes);
* :mod:`~cuflash.runtime.cubin`: arch names, which device loads which cubin, a cubin's arch
  read from its ELF header;
* :mod:`~cuflash.runtime.cuda_runner`: NVRTC options and compilation for an explicit arch, the
  cubin disk cache, per-device memoized modules, launching a plan on a stream (CuPy imported
  lazily).

Imports: nothing else of cuflash (this is the bottom layer).
"""
