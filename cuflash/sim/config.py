"""The simulator's options: :func:`options` (a context manager), :func:`current_options` and
their environment variables (documented in :mod:`cuflash.sim`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re

__all__ = ["SimOptions", "options", "current_options", "parse_arch", "sm_count", "ARCHS"]

#: emulated compute capabilities
ARCHS = (70, 75, 80, 86, 87, 89, 90)
#: SMs of the device each emulated arch stands for (V100 SXM2, T4, A100, A40, Orin, L4, H100/H200
#: SXM), which plans that depend on the device's size (split-KV counts) use on the simulator
SM_COUNTS = {70: 80, 75: 40, 80: 108, 86: 84, 87: 16, 89: 58, 90: 132}


def sm_count(arch: int) -> int:
    """The SM count the simulator plans with for ``sm_<arch>`` (:data:`SM_COUNTS`)."""
    return SM_COUNTS[arch]
_FIBERS = ("auto", "asm", "ucontext")



def parse_arch(arch, func: str = "cuflash.sim.options") -> int:
    """Return the compute capability of ``"sm_90"``, ``"90"`` or ``90`` (``func`` names the
    caller in the error).

    Raises
    ------
    ValueError
        If ``arch`` is not one of :data:`ARCHS`.
    """
    m = re.fullmatch(r"(?:sm_)?(\d+)", str(arch).strip())
    cc = int(m.group(1)) if m else None
    if cc not in ARCHS:
        raise ValueError(
            f"{func}: arch={arch!r} must be one of " + ", ".join(f"'sm_{a}'" for a in ARCHS)
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
    gpu_numerics: bool = False

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch}"


_override: contextvars.ContextVar[dict] = contextvars.ContextVar("cuflash_sim_options", default={})


def _normalize(key: str, value):
    if key == "arch":
        return parse_arch(value)
    if key == "seed":
        return _parse_int("seed", value, 0)
    if key in ("checked", "gpu_numerics"):
        return _parse_bool(key, value)
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
    "gpu_numerics": "CUFLASH_SIM_GPU_NUMERICS",
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
def options(arch=None, checked=None, seed=None, *, workers=None, fibers=None, stack_kib=None, gpu_numerics=None):
    """Context manager setting simulator options for the code inside it.

    Parameters left as ``None`` keep their current value (an enclosing ``options`` block, else
    the environment variable, else the default). Blocks nest; the settings are local to the
    current thread / asyncio task.

    Parameters
    ----------
    arch : str or int, optional
        Emulated device, ``"sm_70"`` ... ``"sm_90"`` (default ``"sm_90"``).
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
    gpu_numerics : bool, optional
        Round as the GPU does rather than exactly (default off): float32 subnormals flushed to
        zero (CuPy compiles with ``-ftz=true``), ``a * b + c`` contracted to an FMA (NVRTC's
        default ``--fmad=true``), ``exp2f``/``expf`` within 2 ulp and ``logf`` within 1 ulp of the
        exact result, as the CUDA C++ Programming Guide's tables of maximum ulp errors allow
        (``exp2f`` is ``ex2.approx.ftz.f32``), and ``mma`` sums rounded as tensor cores do
        (products exact, aligned to the largest and truncated, Fasi et al., "Numerical behavior
        of NVIDIA tensor cores", PeerJ Comput. Sci. 7:e330, 2021). It needs an x86-64 CPU with
        FMA. The flush also applies to float64 on the CPU, which the GPU does not do.

    Raises
    ------
    ValueError
        For an invalid value (named in the message).
    """
    given = {"arch": arch, "checked": checked, "seed": seed, "workers": workers, "fibers": fibers,
             "stack_kib": stack_kib, "gpu_numerics": gpu_numerics}
    new = dict(_override.get())
    for key, value in given.items():
        if value is not None:
            new[key] = _normalize(key, value)
    token = _override.set(new)
    try:
        yield current_options()
    finally:
        _override.reset(token)
