"""NVRTC compilation, the per-device memoized modules and the CUDA runner of launch plans.

Every variant is compiled for an explicit arch by NVRTC (:mod:`cuflash.runtime.nvrtc`: 12.x or
13.x through ctypes, no GPU needed) to a cubin, which is cached on disk under CuPy's cache
directory and loaded with ``cupy.RawModule(path=...)`` (docs/kernels.md, "Compile path"). The
options are exactly the ones CuPy's ``RawModule(code=...)`` used before: ours
(:func:`nvrtc_options`), plus those CuPy adds by itself (:data:`CUPY_IMPLICIT_OPTIONS`) and
``-arch``. The arch is the device's own compute capability for the tensor-core and SIMT tiers and
``sm_90a`` for a variant whose :attr:`~cuflash.runtime.variants.Variant.target_arch` says so (the
Hopper tier), which loads on compute capability 9.0 only. The compile gate uses
:func:`nvrtc_compile` with each installed NVRTC. CuPy is imported lazily: ``import cuflash``
works without it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
import threading

from cuflash.runtime import nvrtc as _nvrtc
from cuflash.runtime.cubin import (  # noqa: F401
    arch_name,
    arch_reason,
    complete_elf,
    cubin_arch,
    parse_arch,
)
from cuflash.runtime.source import build_source

#: options ``cupy.RawModule`` adds by itself (CuPy 14: -ftz=true in its cache layer,
#: --device-as-default-execution-space in its NVRTC layer, -std=c++17 when no -std is given)
CUPY_IMPLICIT_OPTIONS = ("-ftz=true", "--device-as-default-execution-space", "-std=c++17")

#: compute capabilities every SIMT kernel is compiled and checked for
SIMT_ARCHS = (75, 80, 90)

_CUDART_VERSION = re.compile(r"^#define\s+CUDART_VERSION\s+(\d+)", re.M)


def _include_candidates() -> list[str]:
    candidates: list[str] = []
    try:
        from cuda import pathfinder  # type: ignore

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(str(found))
    except Exception:  # noqa: BLE001 - any failure means "look elsewhere"
        pass
    try:
        import nvidia.cuda_runtime  # type: ignore

        for base in getattr(nvidia.cuda_runtime, "__path__", []):
            candidates.append(os.path.join(base, "include"))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    candidates.append("/usr/local/cuda/include")
    return list(dict.fromkeys(candidates))


def headers_major(include_dir: str) -> int | None:
    """The CUDA major of the runtime headers in ``include_dir`` (``CUDART_VERSION`` in
    ``cuda_runtime_api.h`` divided by 1000), or None if it cannot be read."""
    try:
        with open(os.path.join(include_dir, "cuda_runtime_api.h"), encoding="utf-8", errors="replace") as f:
            m = _CUDART_VERSION.search(f.read())
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


@functools.lru_cache(maxsize=None)
def cuda_include_dir(major: int | None = None) -> str:
    """Folder holding the CUDA runtime headers (``cuda_fp16.h``, ``cuda_bf16.h``) for NVRTC.

    Looked for with ``cuda.pathfinder.find_nvidia_header_directory("cudart")`` (which CuPy 14
    brings), in the ``nvidia-cuda-runtime`` wheel, under ``CUDA_PATH``/``CUDA_HOME`` and in
    ``/usr/local/cuda/include``. With ``major`` (the NVRTC's major), the first folder whose
    headers are of that CUDA major wins, else the first folder with headers at all: measured,
    NVRTC 13.5 compiles every variant of the compile gate with the 12.9 headers of
    ``nvidia-cuda-runtime-cu12`` as with CUDA 13.0's, the same variants spilling.

    Raises
    ------
    FileNotFoundError
        If no folder with ``cuda_fp16.h`` is found.
    """
    candidates = _include_candidates()
    found = [c for c in candidates if os.path.isfile(os.path.join(c, "cuda_fp16.h"))]
    if not found:
        raise FileNotFoundError(
            "cuflash: CUDA runtime headers (cuda_fp16.h) not found; install nvidia-cuda-runtime-cu12 "
            "(extra 'cuda12') or set CUDA_PATH. Looked in: " + ", ".join(candidates)
        )
    if major is not None:
        for c in found:
            if headers_major(c) == major:
                return c
    return found[0]


def _resolve_nvrtc(nvrtc) -> _nvrtc.Nvrtc:
    if nvrtc is None:
        return default_nvrtc()
    if isinstance(nvrtc, _nvrtc.Nvrtc):
        return nvrtc
    if isinstance(nvrtc, int) and not isinstance(nvrtc, bool):
        return _nvrtc.load(nvrtc)
    raise TypeError(f"cuflash: nvrtc={nvrtc!r} must be None, an NVRTC major (12, 13) or a "
                    f"cuflash.runtime.nvrtc.Nvrtc, not {type(nvrtc).__name__}")


def _cupy_cuda_major() -> int | None:
    """The CUDA major CuPy was built for (``cupy-cuda12x``: 12), None without CuPy."""
    try:
        from cupy_backends.cuda.api import runtime  # type: ignore
    except ImportError:
        return None
    try:
        return int(runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - a broken CuPy: choose without it
        return None


def default_nvrtc() -> _nvrtc.Nvrtc:
    """The NVRTC cuflash compiles with unless told otherwise.

    ``CUFLASH_NVRTC`` (``12`` or ``13``) if set; else the NVRTC of the CUDA major CuPy was built
    for (``cupy-cuda12x``: 12.x, which CuPy's own ``RawModule`` used before), if installed; else
    the newest installed. A variant that needs a newer NVRTC gets one from :func:`nvrtc_for`.

    Raises
    ------
    ValueError
        If ``CUFLASH_NVRTC`` is not one of 12, 13.
    RuntimeError
        If no NVRTC is installed (the message names the wheels) or the one asked for is missing.
    """
    env = os.environ.get("CUFLASH_NVRTC", "").strip()
    if env:
        if env not in {str(m) for m in _nvrtc.MAJORS}:
            raise ValueError(f"cuflash: CUFLASH_NVRTC={env!r} must be one of " + ", ".join(map(str, _nvrtc.MAJORS)))
        return _nvrtc.load(int(env))
    installed = _nvrtc.installed_majors()
    if not installed:
        raise RuntimeError("cuflash: no NVRTC found; install the 'cuda12' extra (nvidia-cuda-nvrtc-cu12) or the "
                           "'cuda13' extra (nvidia-cuda-nvrtc 13.x)")
    want = _cupy_cuda_major()
    return _nvrtc.load(want if want in installed else installed[-1])


def nvrtc_for(variant, arch: int | None = None) -> _nvrtc.Nvrtc:
    """The NVRTC that compiles ``variant``: :func:`default_nvrtc`, or the newest installed one if
    the default is older than the variant's :attr:`~cuflash.runtime.variants.Variant.min_nvrtc_major`.
    With ``arch`` (the device's compute capability, ``90`` for 9.0): if the chosen major spills the
    variant there (:meth:`~cuflash.runtime.variants.Variant.spilling_nvrtc_majors`) and another
    installed major compiles it without spills, that one.

    Raises
    ------
    RuntimeError
        If no installed NVRTC is new enough (the message names the wheel to install).
    """
    need = getattr(variant, "min_nvrtc_major", 12)
    lib = default_nvrtc()
    if arch is not None and lib.major >= need and lib.major in variant.spilling_nvrtc_majors(arch):
        clean = [m for m in usable_nvrtc_majors(arch) if m >= need and m not in variant.spilling_nvrtc_majors(arch)]
        if clean:
            return _nvrtc.load(clean[-1])
    if lib.major >= need:
        return lib
    newer = [m for m in _nvrtc.installed_majors() if m >= need]
    if not newer:
        raise RuntimeError(f"cuflash: {variant.entry} is CUDA-{need}-only (NVRTC {lib.version_string} cannot "
                           f"compile it); install {_nvrtc.WHEELS.get(need, f'NVRTC {need}.x')!r}")
    return _nvrtc.load(newer[-1])


def usable_nvrtc_majors(arch: int) -> tuple[int, ...]:
    """The NVRTC majors cuflash may compile for ``sm_<arch>`` with: the one ``CUFLASH_NVRTC`` names
    if set, else every installed major whose oldest arch is not newer than ``arch`` (found on disk,
    nothing loaded)."""
    env = os.environ.get("CUFLASH_NVRTC", "").strip()
    if env in {str(m) for m in _nvrtc.MAJORS}:
        return (int(env),)
    return tuple(m for m in _nvrtc.installed_majors() if _nvrtc.OLDEST_ARCH[m] <= arch)


def nvrtc_majors() -> tuple[int, ...]:
    """The NVRTC majors installed, e.g. ``(12, 13)`` (found on disk, nothing loaded)."""
    return _nvrtc.installed_majors()


def available_nvrtcs() -> tuple[_nvrtc.Nvrtc, ...]:
    """Every installed NVRTC that loads, oldest first (``python -c "from cuflash.runtime import
    cuda_runner; print(cuda_runner.available_nvrtcs())"`` lists them)."""
    return _nvrtc.available()


def nvrtc_options(nvrtc=None) -> tuple[str, ...]:
    """The options cuflash passes to NVRTC for every kernel (``-I`` the CUDA headers for that
    NVRTC's major, :func:`cuda_include_dir`), before :data:`CUPY_IMPLICIT_OPTIONS` and ``-arch``.

    ``nvrtc`` is None (:func:`default_nvrtc`; without any NVRTC installed, the first headers
    found), a major (12, 13) or an :class:`~cuflash.runtime.nvrtc.Nvrtc`.
    """
    if nvrtc is None and not _nvrtc.installed_majors():
        major = None
    else:
        major = _resolve_nvrtc(nvrtc).major
    return (f"-I{cuda_include_dir(major)}", "-DCUFLASH_NVRTC=1")


def device_arch(cc: int, nvrtc=None) -> int:
    """The ``sm_XY`` an NVRTC compiles for a device of compute capability ``cc``: ``cc`` itself
    if the NVRTC knows it, else the newest arch it knows of the same major and not above ``cc``
    (SASS runs on later minors of its major).

    Raises
    ------
    RuntimeError
        If the NVRTC knows no arch that runs on ``cc`` (a device newer than the compiler, or one
        older than it supports: NVRTC 13 has no sm_70).
    """
    lib = _resolve_nvrtc(nvrtc)
    if cc in lib.supported_archs:
        return cc
    same = [a for a in lib.supported_archs if a // 10 == cc // 10 and a <= cc]
    if not same and cc < min(lib.supported_archs):
        raise RuntimeError(f"cuflash: NVRTC {lib.version_string} cannot compile for compute capability "
                           f"{cc // 10}.{cc % 10} (its oldest arch is sm_{min(lib.supported_archs)}; CUDA 13 dropped "
                           f"sm_70, Volta): install the cuda12 extra (pip install 'cuflash[cuda12]') and use its "
                           f"NVRTC 12.x (CUFLASH_NVRTC=12)")
    if not same:
        raise RuntimeError(f"cuflash: NVRTC {lib.version_string} cannot compile for compute capability "
                           f"{cc // 10}.{cc % 10} (it knows sm_{', sm_'.join(map(str, lib.supported_archs))}); "
                           "install a newer NVRTC")
    return max(same)


def nvrtc_compile(source: str, arch, *, name: str = "cuflash.cu", extra_options: tuple = (),
                  nvrtc=None) -> tuple[bytes, str]:
    """Compile ``source`` for ``arch`` with the run-time options, without a GPU.

    Parameters
    ----------
    source : str
        The full CUDA C++ text (:func:`cuflash.runtime.source.build_source`).
    arch : int or str
        ``80``, ``90`` (``sm_80``, ``sm_90``) or ``"90a"`` / ``"sm_90a"``.
    name : str
        The program's file name in NVRTC's diagnostics.
    extra_options : tuple of str
        Appended after the run-time options (the compile gate adds ``-Xptxas=-v`` to read
        registers, spills and shared memory from the log).
    nvrtc : None, int or cuflash.runtime.nvrtc.Nvrtc
        The compiler: None for :func:`default_nvrtc`, 12 or 13 for that major.

    Returns
    -------
    (cubin, log) : (bytes, str)
        The whole image (:func:`complete_elf`) and NVRTC's log.

    Raises
    ------
    TypeError, ValueError
        For an ``arch`` or ``nvrtc`` of the wrong kind or value.
    RuntimeError
        With NVRTC's log if compilation fails, or if the NVRTC asked for is not installed.
    """
    target = arch_name(arch)
    lib = _resolve_nvrtc(nvrtc)
    options = nvrtc_options(lib) + CUPY_IMPLICIT_OPTIONS + (f"-arch={target}",) + tuple(extra_options)
    try:
        cubin, log = lib.compile(source, options, name=name)
    except _nvrtc.NVRTCError as e:
        raise RuntimeError(f"NVRTC {lib.version_string} failed for {target}:\n{e.log or e}") from e
    return complete_elf(cubin), log


_REGS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_resources(log: str, entry: str) -> dict:
    """Registers, stack frame, spills and static shared memory of ``entry`` from an NVRTC log
    compiled with ``-Xptxas=-v``: keys ``registers``, ``stack_frame``, ``spill_stores``,
    ``spill_loads``, ``static_smem`` (bytes).

    Raises
    ------
    ValueError
        If the log has no figures for ``entry``.
    """
    start = log.find(f"Function properties for {entry}")
    if start < 0:
        raise ValueError(f"ptxas log has no entry {entry}:\n{log}")
    block = log[start:]
    nxt = block.find("Compiling entry function", 1)
    block = block if nxt < 0 else block[:nxt]
    regs, frame, smem = _REGS.search(block), _FRAME.search(block), _SMEM.search(block)
    if not (regs and frame):
        raise ValueError(f"cannot read ptxas figures for {entry}:\n{block}")
    return {
        "registers": int(regs.group(1)),
        "stack_frame": int(frame.group(1)),
        "spill_stores": int(frame.group(2)),
        "spill_loads": int(frame.group(3)),
        "static_smem": int(smem.group(1)) if smem else 0,
    }


_modules: dict = {}
_modules_lock = threading.Lock()


def cache_dir() -> str:
    """CuPy's kernel cache folder: ``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache`` (read on
    every call, as CuPy does)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def cubin_cache_key(source: str, arch, options, nvrtc_version) -> str:
    """SHA-256 (hex) of everything that decides a cubin: the source text, the options (which
    hold the header folder), the NVRTC version and the arch."""
    h = hashlib.sha256()
    for part in (source, "\0".join(options), ".".join(map(str, nvrtc_version)), arch_name(arch)):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def cached_cubin(source: str, arch, *, name: str = "cuflash.cu", nvrtc=None, stem: str = "cuflash") -> str:
    """The path of the cubin of ``source`` for ``arch`` in :func:`cache_dir`, compiling it with
    :func:`nvrtc_compile` (and writing it atomically) unless a valid one is there.

    The file is ``<stem>_<key>.cubin`` with :func:`cubin_cache_key` as key; a file that is not a
    whole ELF image for ``arch`` (a torn or foreign file) is compiled again.

    Raises
    ------
    RuntimeError
        As :func:`nvrtc_compile`.
    """
    lib = _resolve_nvrtc(nvrtc)
    target = arch_name(arch)
    options = nvrtc_options(lib) + CUPY_IMPLICIT_OPTIONS + (f"-arch={target}",)
    folder = cache_dir()
    path = os.path.join(folder, f"{stem}_{cubin_cache_key(source, target, options, lib.version)}.cubin")
    try:
        with open(path, "rb") as f:
            image = f.read()
        if complete_elf(image) == image and cubin_arch(image) == target:
            return path
    except (OSError, ValueError):
        pass
    cubin, _ = nvrtc_compile(source, target, name=name, nvrtc=lib)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cuflash-", suffix=".cubin.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def compile_arch(variant, cc: int, nvrtc=None):
    """The arch ``variant`` is compiled for on a device of compute capability ``cc``: its
    :attr:`~cuflash.runtime.variants.Variant.target_arch` (``"90a"``) if it has one, else
    :func:`device_arch`.

    Raises
    ------
    ValueError
        If the variant's target arch does not run on ``cc`` (sm_90a off compute capability 9.0).
    """
    target = getattr(variant, "target_arch", None)
    if target is None:
        return device_arch(cc, nvrtc)
    why = arch_reason(target, cc)
    if why is not None:
        raise ValueError(f"cuflash: {variant.entry} cannot load on this device: {why}")
    return target


def check_loadable(cubin: bytes, cc: int, what: str = "cubin") -> None:
    """Refuse a cubin the device of compute capability ``cc`` cannot run (its ELF header's arch,
    :func:`cubin_arch`, against :func:`arch_reason`): a ValueError saying why, before the driver
    would answer with an opaque "no kernel image"."""
    why = arch_reason(cubin_arch(cubin), cc)
    if why is not None:
        raise ValueError(f"cuflash: {what} cannot load on this device: {why}")


_modules: dict = {}
_modules_lock = threading.Lock()


def get_module(variant, device_id: int):
    """Return the ``cupy.RawModule`` of ``variant`` for device ``device_id`` (memoized per
    device and variant, thread-safe).

    The variant is compiled by :func:`nvrtc_for` for :func:`compile_arch` (the device's compute
    capability, or ``sm_90a`` for a Hopper-tier variant), cached on disk by :func:`cached_cubin`,
    checked against the device (:func:`check_loadable`) and loaded with
    ``cupy.RawModule(path=...)``.

    Raises
    ------
    ValueError
        If the variant's cubin cannot run on the device (an ``sm_90a`` variant off compute
        capability 9.0).
    RuntimeError
        If NVRTC fails or the NVRTC the variant needs is not installed.
    """
    key = (device_id, variant)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    import cupy

    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            cc = int(cupy.cuda.Device(device_id).compute_capability)
            lib = nvrtc_for(variant, cc)
            arch = compile_arch(variant, cc, lib)
            path = cached_cubin(build_source(variant), arch, name=variant.source, nvrtc=lib,
                                stem=variant.entry)
            with open(path, "rb") as f:
                check_loadable(f.read(), cc, variant.entry)
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(path=path)
                mod.compile()   # loads the module into this device's context now
            _modules[key] = mod
    return mod


def _cuda_arg(a):
    import numpy as np

    from cuflash.runtime.plan import PointerArg, TensorMapArg

    if isinstance(a, PointerArg):
        return np.uint64(a.address)  # 64-bit pointer including the view's offset
    if isinstance(a, TensorMapArg):  # the driver's 128-byte CUtensorMap, passed by value as a structured scalar
        struct = np.dtype([("opaque", "<u8", (16,))])   # (CuPy's custom-structure kernel arguments)
        return np.frombuffer(a.encode(a.pointer.address, simulator=False), dtype=struct)[0]
    return a.value


def launch(plan, *, stream=None) -> None:
    """Launch ``plan`` on the current CUDA device (asynchronously, on ``stream`` or the current one).

    Sets ``max_dynamic_shared_size_bytes`` when the plan's shared memory needs the opt-in.
    """
    import cupy

    dev = cupy.cuda.Device()
    cc = int(dev.compute_capability)
    rt = cupy.cuda.runtime
    plan.check_device(cc, int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev.id)))
    fn = _get_function(plan.variant, plan.entry, dev.id)
    if plan.needs_smem_opt_in or plan.shared_mem_bytes + fn.shared_size_bytes > 48 * 1024:
        if fn.max_dynamic_shared_size_bytes < plan.shared_mem_bytes:
            fn.max_dynamic_shared_size_bytes = plan.shared_mem_bytes
    args = tuple(_cuda_arg(a) for a in plan.args)
    if stream is None:
        fn(plan.grid, plan.block, args, shared_mem=plan.shared_mem_bytes)
    else:
        with stream:
            fn(plan.grid, plan.block, args, shared_mem=plan.shared_mem_bytes)


_functions: dict = {}


def _get_function(variant, entry: str, device_id: int):
    key = (device_id, variant, entry)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(variant, device_id).get_function(entry)
        with _modules_lock:
            _functions[key] = fn
    return fn
