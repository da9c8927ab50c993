"""The CUDA simulator (``backend="sim"``) and its options.

The simulator runs cuflash's real CUDA C kernels (``kernels_cu/``) on the CPU: the same source
text, compiled with g++ against a small runtime that provides the CUDA built-ins, with every
thread of a block run as a fiber and blocks spread over OS threads (the C++ runtime in this folder). It
exists so that CI machines without a GPU execute the kernels; it is slow (a block of 128 threads
takes tens to hundreds of microseconds) and meant for small shapes.

Options are set with the :func:`options` context manager (per thread and per asyncio task, via
a :class:`contextvars.ContextVar`) or, as defaults, with environment variables:

==================  =========================  ===================================================
option              environment variable       meaning
==================  =========================  ===================================================
``arch``            ``CUFLASH_SIM_ARCH``       emulated device: ``"sm_70"``, ``"sm_75"``,
                                               ``"sm_80"``, ``"sm_86"``, ``"sm_87"``, ``"sm_89"``,
                                               ``"sm_90"`` (default). Sets ``__CUDA_ARCH__``
                                               and the shared-memory limits; the dispatcher picks
                                               the variant a device of that arch would get.
``seed``            ``CUFLASH_SIM_SEED``       seed of the order in which a block's threads run
                                               between barriers (default 0); a race shows as a
                                               wrong result that depends on the seed.
``checked``         ``CUFLASH_SIM_CHECKED``    ``True``: checked mode (below); every fault raises
                                               :class:`SimCheckError` (default ``False``).
``workers``         ``CUFLASH_SIM_WORKERS``    OS threads running blocks (default: CPU count).
``fibers``          ``CUFLASH_SIM_FIBERS``     ``"auto"`` (default: assembly switch on x86-64,
                                               ucontext elsewhere), ``"asm"`` or ``"ucontext"``.
``stack_kib``       ``CUFLASH_SIM_STACK_KIB``  stack per simulated thread (default 256 KiB, plus
                                               a guard page).
``gpu_numerics``    ``CUFLASH_SIM_GPU_NUMERICS`` ``True``: round as the GPU does (flush-to-zero,
                                               FMA contraction, approximate ``exp2f``/``expf``/
                                               ``logf``, truncating tensor-core sums; see
                                               :func:`options`). Default: exact.
==================  =========================  ===================================================

In every mode, a crash in a kernel's thread (a wild pointer, a misaligned vector access, an
integer division by zero) is a :class:`SimError` naming the block and thread (checked mode
reports a misaligned access before it happens, with the source line: ``"misaligned access"``);
a thread that re-reads one address with a volatile or atomic load (a spin-wait) yields to the
others, and 2**20 such polls in a block without progress (a write through a volatile or atomic
access, a barrier, a collective, an exit) are a deadlock, reported with where each warp waits.
Flags between blocks are not supported: a block runs to completion on its worker.

Checked mode
------------
``checked=True`` is the simulator's compute-sanitizer (memcheck, racecheck and initcheck) for CI.
Kernels are compiled a second time with g++'s thread-sanitizer instrumentation, without its
runtime, which calls a hook of the simulator's runtime before every load and every store
(separately: a read-modify-write is both; atomics check themselves). Each pointer argument is copied into its own shared-memory mapping,
with 16 KiB of registered slack and a ``PROT_NONE`` page on either side, and a per-byte map of its
view's elements built from the launch plan's shape and strides; the launch runs in a forked child
process, so even a crash comes back as an exception, and written views are copied back after it.
Faults raise :class:`SimCheckError` (a :class:`SimError`) naming the kernel, the block and thread,
the array and the element index, before the faulty access happens:

* ``"out-of-bounds read"`` / ``"out-of-bounds write"``: a global access to a byte outside the
  argument's view, byte-exact: one element past a view inside a larger buffer, the gaps of a
  strided view (a ``q`` slice of a packed ``qkv`` reading ``k``), the bytes before it;
* ``"write to read-only argument"``: a store through an argument the plan does not mark writable;
* ``"uninitialized shared read"``: a read of ``__shared__`` memory no thread of the block wrote
  (shared memory also starts as 0xFF bytes, NaN for every float type, in every mode);
* ``"shared race"``: two threads of a block touch one shared byte in the same barrier phase, at
  least one writing, with no ``__syncthreads`` between them and no ``__syncwarp`` (for lanes of
  one warp) that both took part in. Shuffles and votes do not order memory;
* ``"shared out-of-bounds"``: a shared access outside every ``__shared__`` variable;
* ``"cp.async in flight"``: an access to shared bytes a ``cp.async`` or a TMA load
  (``cp.async.bulk.tensor``) is still filling, by a thread, a wgmma or another TMA;
* sm_90a (``cusim_sm90.h``; PTX ISA "Memory Consistency Model: proxies"):
  ``"proxy fence"``, shared bytes a thread wrote read by a wgmma or a TMA store with no
  ``fence.proxy.async`` of the writer in between; ``"async overlap"``, bytes an unfinished wgmma
  or TMA store still reads, written by a thread or a TMA load; ``"wgmma registers"``, a thread's
  wgmma accumulator read or written before its ``wgmma.wait_group``, an A register written then,
  or registers touched after a wgmma landed in them used by the next wgmma with no ``wgmma.fence``
  (or a first wgmma with none at all); ``"mbarrier object"``, an mbarrier's bytes touched by
  ordinary loads or stores, or an mbarrier used by a thread that no barrier orders after its
  ``mbarrier.init``;
* ``"global race"``: the shared-memory rule for the bytes of written arguments within a block,
  and across blocks any byte one block writes and another reads or writes (blocks of a launch are
  not ordered); atomics are exempt, and so are volatile reads (a spin-wait's flag);
* ``"wild access"``: an access of the kernel's code outside every argument (and its slack), the
  shared memory, the thread's own stack and the module's image (an ``int`` offset past 2**31, a
  pointer into another thread's local memory);
* ``"misaligned access"``: below the natural alignment of the accessed type;
* ``"crash"``: the child died anyway (a fault in the runtime itself).

The race model knows ``__syncthreads``, ``__syncwarp``, named barriers (``bar.sync`` /
``bar.arrive``: the participants of a phase are ordered) and mbarriers (a thread's accesses before
its arrive are ordered before a waiter that sees that phase complete); these edges are not
transitive across different mechanisms. Data handed from one thread to another through a flag
(volatile or atomic) in the same barrier phase is reported as a race.

Uninitialized locals are not reported; checked modules fill them with the 0xFE byte pattern
(``-ftrivial-auto-var-init=pattern``; -1.7e38 as a float), so results show them. A checked launch
costs a ``fork`` and a few times the time of an unchecked one.

Compiled modules are cached on disk in ``CUFLASH_SIM_CACHE_DIR`` (default
``~/.cache/cuflash/sim``), keyed on the full source text, the runtime, the compiler and flags.

Examples
--------
>>> import numpy as np, cuflash
>>> with cuflash.sim.options(arch="sm_80", seed=3):
...     y = cuflash.softmax(np.ones((2, 5), np.float32), backend="sim")

Layout
------
* :mod:`cuflash.sim.config`: the options (:func:`options`, :func:`current_options`);
* :mod:`cuflash.sim.launcher` compiles one module per source text with g++ (disk cache), loads it
  with ctypes and runs :class:`cuflash.runtime.plan.LaunchPlan` objects, checked or not;
* :mod:`cuflash.sim.lower` rewrites ``__shared__`` declarations into per-block arena slots;
* ``cusim.h`` (with ``cusim_half.h``, ``cusim_switch_x86_64.S`` and stand-ins for
  ``cuda_fp16.h``/``cuda_bf16.h``) is the C++ runtime: fibers, barriers, warp collectives, shared
  memory, atomics, device math. The PTX emulations live beside the PTX in ``kernels_cu/ptx.cuh``.

Imports: :mod:`cuflash.runtime` only (the simulator knows nothing of attention).
"""

from cuflash.sim.config import (
    ARCHS,
    SimOptions,
    current_options,
    options,
    parse_arch,
    sm_count,
)
from cuflash.sim.launcher import SimCheckError, SimError, SimSlowLaunchWarning

__all__ = ["SimOptions", "options", "current_options", "parse_arch", "sm_count", "ARCHS", "SimError", "SimCheckError",
           "SimSlowLaunchWarning"]
