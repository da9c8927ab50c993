"""NVRTC, the CUDA runtime compiler, by major version, through ctypes: no CuPy, no GPU.

cuflash compiles with NVRTC 12.x and 13.x side by side (docs/kernels.md): each major is a separate
library (``libnvrtc.so.12``, ``libnvrtc.so.13``) whose exported symbols are versioned
(``nvrtcCompileProgram@@libnvrtc.so.12``) and bound ``-Bsymbolic``, so both load into one process
without one resolving into the other. Where each is found, first hit wins:

1. the pip wheels, in every ``sys.path`` entry: ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``
   (``nvidia-cuda-nvrtc-cu12``) and ``nvidia/cu13/lib/libnvrtc.so.13`` (``nvidia-cuda-nvrtc``
   13.x), the folders ``cuda-pathfinder`` searches too;
2. ``$CUDA_PATH/lib64`` and ``$CUDA_HOME/lib64``, then ``/usr/local/cuda/lib64``;
3. the dynamic loader's own search by soname (``LD_LIBRARY_PATH``, ``ldconfig``).

``cuda-pathfinder`` itself loads only one NVRTC per process (the newest it finds), which is why
the search is ours. Linux only. The C API used (NVRTC User Guide, "NVRTC API"):
``nvrtcVersion``, ``nvrtcGetNumSupportedArchs``/``nvrtcGetSupportedArchs``, ``nvrtcCreateProgram``,
``nvrtcCompileProgram``, ``nvrtcGetProgramLogSize``/``nvrtcGetProgramLog``,
``nvrtcGetCUBINSize``/``nvrtcGetCUBIN``, ``nvrtcDestroyProgram``, ``nvrtcGetErrorString``. The API
is thread-safe, and ctypes releases the GIL for the call, so compiles on several threads run in
parallel.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

#: the NVRTC majors cuflash knows how to find
MAJORS = (12, 13)
#: major -> the pip requirement that installs it
WHEELS = {12: "nvidia-cuda-nvrtc-cu12==12.*", 13: "nvidia-cuda-nvrtc==13.*"}
#: major -> the oldest compute capability its ``-arch=sm_XY`` accepts (``nvrtcGetSupportedArchs``:
#: 12.9 lists sm_50 ... sm_121, 13.x starts at sm_75: CUDA 13 dropped Maxwell, Pascal and Volta)
OLDEST_ARCH = {12: 50, 13: 75}
#: major -> the folder of its wheel inside site-packages
_WHEEL_DIRS = {12: ("nvidia", "cuda_nvrtc", "lib"), 13: ("nvidia", "cu13", "lib")}

_NVRTC_SUCCESS = 0
_NVRTC_ERROR_COMPILATION = 6


def _check_major(major) -> int:
    if isinstance(major, bool) or not isinstance(major, int):
        raise TypeError(f"cuflash.nvrtc: major={major!r} must be an int, one of {MAJORS}")
    if major not in MAJORS:
        raise ValueError(f"cuflash.nvrtc: major={major} must be one of {MAJORS}")
    return major


def candidate_paths(major: int) -> list[str]:
    """Where :func:`find` looks for ``libnvrtc.so.<major>``, in order (files that may not exist;
    the last entry is the bare soname, for the loader's own search)."""
    soname = f"libnvrtc.so.{_check_major(major)}"
    out = [os.path.join(entry, *_WHEEL_DIRS[major], soname) for entry in sys.path if entry]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            out.append(os.path.join(os.environ[env], "lib64", soname))
    out.append(os.path.join("/usr/local/cuda", "lib64", soname))
    out.append(soname)
    return list(dict.fromkeys(out))


def find(major: int) -> str | None:
    """The path of ``libnvrtc.so.<major>`` (the first existing :func:`candidate_paths` entry),
    the bare soname if only the loader can find it, or None if it is not installed."""
    paths = candidate_paths(major)
    for p in paths[:-1]:
        if os.path.isfile(p):
            return p
    try:
        ctypes.CDLL(paths[-1])
    except OSError:
        return None
    return paths[-1]


class NVRTCError(RuntimeError):
    """An NVRTC call failed; ``log`` holds the program log of a failed compilation."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class Nvrtc:
    """One loaded NVRTC library.

    Parameters
    ----------
    path : str
        ``libnvrtc.so.<major>`` (a path, or a soname the loader finds).

    Attributes
    ----------
    path : str
    version : tuple of int
        ``(major, minor)`` from ``nvrtcVersion``, e.g. ``(12, 9)``.
    supported_archs : tuple of int
        The compute capabilities its ``-arch=sm_XY`` accepts (``nvrtcGetSupportedArchs``).
    """

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)  # RTLD_LOCAL: its symbols stay out of the global scope
        c_int_p, size_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t)
        prog_p = ctypes.POINTER(ctypes.c_void_p)
        for name, args in (
            ("nvrtcVersion", (c_int_p, c_int_p)),
            ("nvrtcGetNumSupportedArchs", (c_int_p,)),
            ("nvrtcGetSupportedArchs", (c_int_p,)),
            ("nvrtcCreateProgram", (prog_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                    ctypes.c_void_p)),
            ("nvrtcCompileProgram", (ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))),
            ("nvrtcGetProgramLogSize", (ctypes.c_void_p, size_p)),
            ("nvrtcGetProgramLog", (ctypes.c_void_p, ctypes.c_char_p)),
            ("nvrtcGetCUBINSize", (ctypes.c_void_p, size_p)),
            ("nvrtcGetCUBIN", (ctypes.c_void_p, ctypes.c_char_p)),
            ("nvrtcDestroyProgram", (prog_p,)),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = (ctypes.c_int,), ctypes.c_char_p
        self._lib = lib
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._call("nvrtcVersion", ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)
        n = ctypes.c_int()
        self._call("nvrtcGetNumSupportedArchs", ctypes.byref(n))
        archs = (ctypes.c_int * n.value)()
        self._call("nvrtcGetSupportedArchs", archs)
        self.supported_archs = tuple(archs)

    @property
    def major(self) -> int:
        return self.version[0]

    @property
    def version_string(self) -> str:
        """``"12.9"``."""
        return f"{self.version[0]}.{self.version[1]}"

    def __repr__(self) -> str:
        return f"Nvrtc({self.version_string}, {self.path!r})"

    def _call(self, name: str, *args) -> int:
        rc = getattr(self._lib, name)(*args)
        if rc != _NVRTC_SUCCESS and rc != _NVRTC_ERROR_COMPILATION:
            what = self._lib.nvrtcGetErrorString(rc)
            raise NVRTCError(f"cuflash: NVRTC ({self.path}) {name} failed: {rc} "
                             f"({what.decode() if what else '?'})")
        return rc

    def compile(self, source: str, options, *, name: str = "cuflash.cu") -> tuple[bytes, str]:
        """Compile CUDA C++ ``source`` with ``options`` (which must hold ``-arch=sm_XY``) to a cubin.

        Returns
        -------
        (cubin, log) : (bytes, str)
            The image, ``nvrtcGetCUBINSize`` bytes long, and the program log (ptxas output with
            ``-Xptxas=-v``).

        Raises
        ------
        NVRTCError
            If compilation fails (``.log`` and the message hold NVRTC's log) or NVRTC reports
            another error.
        """
        prog = ctypes.c_void_p()
        self._call("nvrtcCreateProgram", ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
        try:
            opts = [str(o).encode() for o in options]
            rc = self._call("nvrtcCompileProgram", prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            self._call("nvrtcGetProgramLogSize", prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self._call("nvrtcGetProgramLog", prog, buf)
            log = buf.value.decode(errors="replace")
            if rc == _NVRTC_ERROR_COMPILATION:
                raise NVRTCError(f"NVRTC {self.version_string} compilation failed:\n{log}", log)
            self._call("nvrtcGetCUBINSize", prog, ctypes.byref(size))
            image = ctypes.create_string_buffer(size.value)
            self._call("nvrtcGetCUBIN", prog, image)
            return image.raw, log
        finally:
            self._call("nvrtcDestroyProgram", ctypes.byref(prog))


_loaded: dict[int, Nvrtc] = {}
_lock = threading.Lock()


def load(major: int) -> Nvrtc:
    """The NVRTC of ``major`` (12 or 13), loaded once per process.

    Raises
    ------
    TypeError, ValueError
        If ``major`` is not one of :data:`MAJORS`.
    RuntimeError
        If it is not installed (the message names the wheel) or does not load.
    """
    _check_major(major)
    with _lock:
        if major not in _loaded:
            path = find(major)
            if path is None:
                raise RuntimeError(f"cuflash: NVRTC {major}.x (libnvrtc.so.{major}) not found; install "
                                   f"{WHEELS[major]!r}. Looked in: " + ", ".join(candidate_paths(major)))
            try:
                lib = Nvrtc(path)
            except (OSError, AttributeError) as e:
                raise RuntimeError(f"cuflash: NVRTC {major}.x at {path} does not load: {e}") from e
            if lib.major != major:
                raise RuntimeError(f"cuflash: {path} reports NVRTC {lib.version_string}, expected {major}.x")
            _loaded[major] = lib
        return _loaded[major]


@functools.lru_cache(maxsize=None)
def _installed_cached(key) -> tuple[int, ...]:
    return tuple(m for m in MAJORS if find(m) is not None)


def installed_majors() -> tuple[int, ...]:
    """The NVRTC majors installed (found by :func:`find`; nothing is loaded), e.g. ``(12, 13)``.
    Remembered per ``sys.path`` and CUDA_PATH/CUDA_HOME/LD_LIBRARY_PATH."""
    env = tuple(os.environ.get(v, "") for v in ("CUDA_PATH", "CUDA_HOME", "LD_LIBRARY_PATH"))
    return _installed_cached((tuple(sys.path), env))


def available() -> tuple[Nvrtc, ...]:
    """Every NVRTC that is installed and loads, oldest major first."""
    out = []
    for m in installed_majors():
        try:
            out.append(load(m))
        except RuntimeError:
            pass
    return tuple(out)
