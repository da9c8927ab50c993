"""NVRTC options, the per-device memoized ``cupy.RawModule`` and the CUDA runner of launch plans.

CuPy is imported lazily: ``import cuflash`` works without it. The options here are exactly the
ones used at run time; :func:`nvrtc_compile` reproduces what ``RawModule`` does (our options, plus
the ones CuPy adds by itself: :data:`CUPY_IMPLICIT_OPTIONS` and ``-arch``) with CuPy's low-level
NVRTC binding, which needs no GPU, so CI checks that every variant compiles for every target.
"""

from __future__ import annotations

import functools
import os
import re
import threading

from cuflash.runtime.source import build_source

#: options ``cupy.RawModule`` adds by itself (CuPy 14: -ftz=true in its cache layer,
#: --device-as-default-execution-space in its NVRTC layer, -std=c++17 when no -std is given)
CUPY_IMPLICIT_OPTIONS = ("-ftz=true", "--device-as-default-execution-space", "-std=c++17")

#: compute capabilities every SIMT kernel is compiled and checked for
SIMT_ARCHS = (75, 80, 90)


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """Folder holding the CUDA runtime headers (``cuda_fp16.h``, ``cuda_bf16.h``) for NVRTC.

    Found with ``cuda.pathfinder.find_nvidia_header_directory("cudart")`` (which CuPy 14
    brings), else in the ``nvidia-cuda-runtime`` wheel, else under ``CUDA_PATH``.

    Raises
    ------
    FileNotFoundError
        If no folder with ``cuda_fp16.h`` is found.
    """
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
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda_fp16.h")):
            return c
    raise FileNotFoundError(
        "cuflash: CUDA runtime headers (cuda_fp16.h) not found; install nvidia-cuda-runtime-cu12 "
        "(extra 'cuda12') or set CUDA_PATH. Looked in: " + ", ".join(candidates)
    )


def nvrtc_options() -> tuple[str, ...]:
    """The options cuflash passes to ``cupy.RawModule`` for every kernel."""
    return (f"-I{cuda_include_dir()}", "-DCUFLASH_NVRTC=1")


def nvrtc_compile(source: str, arch: int, *, name: str = "cuflash.cu", extra_options: tuple = ()) -> tuple[bytes, str]:
    """Compile ``source`` for ``sm_<arch>`` with the run-time options, without a GPU.

    ``extra_options`` are appended (the compile gate adds ``-Xptxas=-v`` to read registers,
    spills and shared memory from the log).

    Returns
    -------
    (cubin, log) : (bytes, str)

    Raises
    ------
    RuntimeError
        With NVRTC's log if compilation fails.
    """
    from cupy.cuda import nvrtc  # lazily: needs CuPy's NVRTC binding only

    options = nvrtc_options() + CUPY_IMPLICIT_OPTIONS + (f"-arch=sm_{arch}",) + tuple(extra_options)
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for sm_{arch}:\n{nvrtc.getProgramLog(prog)}") from e
        return complete_elf(nvrtc.getCUBIN(prog)), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


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


def complete_elf(cubin: bytes) -> bytes:
    """``cubin`` padded with zero bytes to the end its ELF header declares.

    CuPy 14's ``nvrtc.getCUBIN`` returns one byte less than ``nvrtcGetCUBINSize`` (it drops the
    last byte, a 0, as if the image were a C string); the driver loads the short image, but
    ``cuobjdump`` and ``nvdisasm`` reject it ("does not contain device code"). The ELF-64 header
    (System V gABI, e_phoff/e_shoff at 0x20, entry sizes and counts at 0x36) says where the file
    ends: after the program or the section header table, whichever is last.
    """
    import struct

    if len(cubin) < 0x40 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return cubin  # not a 64-bit ELF image: left as it is
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * max(0, end - len(cubin))


_modules: dict = {}
_modules_lock = threading.Lock()


def get_module(variant, device_id: int):
    """Return the ``cupy.RawModule`` of ``variant`` for device ``device_id`` (memoized, thread-safe)."""
    key = (device_id, variant)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    import cupy

    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=build_source(variant), options=nvrtc_options())
                mod.compile()
            _modules[key] = mod
    return mod


def _cuda_arg(a):
    import numpy as np

    from cuflash.runtime.plan import PointerArg

    if isinstance(a, PointerArg):
        return np.uint64(a.address)  # 64-bit pointer including the view's offset
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
