"""Options of the CUDA simulator (``backend="sim"``).

The simulator runs cuflash's real CUDA C kernels (``kernels_cu/``) on the CPU: the same source
text, compiled with g++ against a small runtime that provides the CUDA built-ins, with every
thread of a block run as a fiber and blocks spread over OS threads (see ``cuflash/_sim``). It
exists so that CI machines without a GPU execute the kernels; it is slow (a block of 128 threads
takes tens to hundreds of microseconds) and meant for small shapes.

Options are set with the :func:`options` context manager (per thread and per asyncio task, via
a :class:`contextvars.ContextVar`) or, as defaults, with environment variables:

==================  =========================  ===================================================
option              environment variable       meaning
==================  =========================  ===================================================
``arch``            ``CUFLASH_SIM_ARCH``       emulated device: ``"sm_75"``, ``"sm_80"``,
                                               ``"sm_86"``, ``"sm_87"``, ``"sm_89"``,
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
==================  =========================  ===================================================

Checked mode
------------
``checked=True`` is the simulator's compute-sanitizer (memcheck, racecheck and initcheck) for CI.
Kernels are compiled a second time with g++'s address-sanitizer instrumentation in its outlined,
runtime-free form, which calls a hook of the simulator's runtime before every load and store
(atomics check themselves). Each pointer argument is copied into its own shared-memory mapping,
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
* ``"crash"``: the child died (an access far outside every argument, a stack overflow).

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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re

__all__ = ["SimOptions", "options", "current_options", "ARCHS", "SimError", "SimCheckError"]

#: emulated compute capabilities
ARCHS = (75, 80, 86, 87, 89, 90)
_FIBERS = ("auto", "asm", "ucontext")


def __getattr__(name):
    # the exception classes live with the launcher; imported lazily (the launcher imports this module)
    if name in ("SimError", "SimCheckError"):
        from cuflash._sim import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'cuflash.sim' has no attribute {name!r}")


def parse_arch(arch) -> int:
    """Return the compute capability of ``"sm_90"``, ``"90"`` or ``90``.

    Raises
    ------
    ValueError
        If ``arch`` is not one of :data:`ARCHS`.
    """
    m = re.fullmatch(r"(?:sm_)?(\d+)", str(arch).strip())
    cc = int(m.group(1)) if m else None
    if cc not in ARCHS:
        raise ValueError(
            f"cuflash.sim.options: arch={arch!r} must be one of " + ", ".join(f"'sm_{a}'" for a in ARCHS)
        )
    return cc


def _parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"cuflash.sim.options: {name}={value!r} must be a boolean (0/1/true/false)")


def _parse_int(name: str, value, minimum: int) -> int:
    try:
        v = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"cuflash.sim.options: {name}={value!r} must be an integer") from None
    if isinstance(value, bool) or v < minimum:
        raise ValueError(f"cuflash.sim.options: {name}={value!r} must be an integer >= {minimum}")
    return v


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """The effective simulator options (see the module docstring)."""

    arch: int = 90
    seed: int = 0
    checked: bool = False
    workers: int | None = None
    fibers: str = "auto"
    stack_kib: int = 256

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch}"


_override: contextvars.ContextVar[dict] = contextvars.ContextVar("cuflash_sim_options", default={})


def _normalize(key: str, value):
    if key == "arch":
        return parse_arch(value)
    if key == "seed":
        return _parse_int("seed", value, 0)
    if key == "checked":
        return _parse_bool("checked", value)
    if key == "workers":
        return _parse_int("workers", value, 1)
    if key == "stack_kib":
        v = _parse_int("stack_kib", value, 16)
        if v % 4:
            raise ValueError(f"cuflash.sim.options: stack_kib={value!r} must be a multiple of 4")
        return v
    if key == "fibers":
        if value not in _FIBERS:
            raise ValueError(f"cuflash.sim.options: fibers={value!r} must be one of {_FIBERS}")
        return value
    raise TypeError(f"cuflash.sim.options: unknown option {key!r}")


_ENV = {
    "arch": "CUFLASH_SIM_ARCH",
    "seed": "CUFLASH_SIM_SEED",
    "checked": "CUFLASH_SIM_CHECKED",
    "workers": "CUFLASH_SIM_WORKERS",
    "fibers": "CUFLASH_SIM_FIBERS",
    "stack_kib": "CUFLASH_SIM_STACK_KIB",
}


def current_options() -> SimOptions:
    """Return the options in effect: environment defaults, overridden by :func:`options` blocks.

    Raises
    ------
    ValueError
        If an environment variable holds an invalid value.
    """
    values: dict = {}
    for key, env in _ENV.items():
        raw = os.environ.get(env)
        if raw is not None and raw.strip() != "":
            try:
                values[key] = _normalize(key, raw)
            except ValueError as e:
                raise ValueError(f"{e} (from environment variable {env})") from None
    values.update(_override.get())
    return SimOptions(**values)


@contextlib.contextmanager
def options(arch=None, checked=None, seed=None, *, workers=None, fibers=None, stack_kib=None):
    """Context manager setting simulator options for the code inside it.

    Parameters left as ``None`` keep their current value (an enclosing ``options`` block, else
    the environment variable, else the default). Blocks nest; the settings are local to the
    current thread / asyncio task.

    Parameters
    ----------
    arch : str or int, optional
        Emulated device, ``"sm_75"`` ... ``"sm_90"`` (default ``"sm_90"``).
    checked : bool, optional
        Checked mode: faults raise :class:`SimCheckError` (see the module docstring).
    seed : int, optional
        Seed of the thread order within barrier phases (default 0).
    workers : int, optional
        OS threads running blocks (default: the CPU count).
    fibers : {"auto", "asm", "ucontext"}, optional
        Fiber implementation (``"ucontext"`` is the portable fallback; slower).
    stack_kib : int, optional
        Stack per simulated thread, KiB (multiple of 4, at least 16; default 256).

    Raises
    ------
    ValueError
        For an invalid value (named in the message).
    """
    given = {"arch": arch, "checked": checked, "seed": seed, "workers": workers, "fibers": fibers,
             "stack_kib": stack_kib}
    new = dict(_override.get())
    for key, value in given.items():
        if value is not None:
            new[key] = _normalize(key, value)
    token = _override.set(new)
    try:
        yield current_options()
    finally:
        _override.reset(token)
