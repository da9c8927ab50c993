"""The simulator's launcher: compile kernel sources with g++, cache them, run launch plans.

One module is compiled per source text: ``#include "cusim.h"``, the lowered kernel text
(:func:`cuflash.sim.lower.lower_shared`), and for each entry two exported stubs (launch and
parameter signature). Flags: ``-std=c++17 -O2 -fPIC -shared -pthread -fvisibility=hidden
-fno-strict-aliasing`` plus ``-D__CUDA_ARCH__=<arch>0``; on x86-64 the assembly fiber switch is
linked in, elsewhere (or with ``fibers="ucontext"``) ``-DCUSIM_FIBERS_UCONTEXT``.

Modules are compiled and linked in separate steps, so no sanitizer runtime is linked: cusim.h
defines the hooks. What does not depend on the kernel (the launch, the hooks) is compiled once per
flag set into a runtime object that each module links (:func:`_runtime_parts`). Checked mode
(``cuflash.sim.options(checked=True)``) compiles a second module per source, at ``-O1`` (a quarter
less compile time than ``-O2``, and no slower to run: the hooks dominate), with
``-DCUSIM_CHECKED=1 -fsanitize=thread --param
tsan-instrument-func-entry-exit=0 --param tsan-distinguish-volatile=1
-ftrivial-auto-var-init=pattern -fsanitize=alignment``: g++'s thread-sanitizer pass calls a hook
before every load and every store, and an access below its type's alignment calls another (see :meth:`SimModule._launch_checked` and ``cusim.h``). Locals the kernel never
initializes hold the 0xFE byte pattern. A normal module whose source has volatile data gets the
same instrumentation with empty plain hooks, so its volatile reads can yield (spin-waits).
``gpu_numerics`` adds ``-mfma -ffp-contract=fast -DCUSIM_GPU_NUMERICS=1``.

Before a launch runs, its time is estimated (:func:`estimate_seconds`); past
:data:`SLOW_LAUNCH_SECONDS` the launcher warns once per process and kernel entry with a
:class:`SimSlowLaunchWarning` (a ``RuntimeWarning``), so a long simulated launch does not run in
silence. Filter it as any warning (``warnings.simplefilter("ignore", SimSlowLaunchWarning)``).

The shared library lands in the cache folder (``CUFLASH_SIM_CACHE_DIR``, default
``~/.cache/cuflash/sim``) under the SHA-256 of everything that determines it: the module text,
the runtime files, the compiler's identity and the flags. Writes are atomic (rename), so
concurrent processes may share the folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import mmap
import os
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from cuflash.runtime import plan as plan_mod
from cuflash.runtime.plan import (
    MAX_THREADS_PER_BLOCK,
    SMEM_DEFAULT_LIMIT,
    PointerArg,
    ScalarArg,
    TensorMapArg,
)
from cuflash.runtime.source import build_source
from cuflash.sim import config as sim_config
from cuflash.sim import lower
from cuflash.sim.memory import is_sim_array

SIM_DIR = Path(__file__).resolve().parent
RUNTIME_FILES = ("cusim.h", "cusim_half.h", "cusim_sm90.h", "cuda_fp16.h", "cuda_bf16.h", "cusim_switch_x86_64.S")
_FORMAT_VERSION = "cusim-3"
_ERROR_CAP = 2048
STACK_POISON_BYTES = 4096


class SimError(RuntimeError):
    """A kernel failed in the simulator (a trap, a strictness check, a deadlock, a limit)."""


class SimSlowLaunchWarning(RuntimeWarning):
    """A simulated launch is estimated to run longer than :data:`SLOW_LAUNCH_SECONDS` (issued
    once per process and kernel entry, before the launch; the message gives the estimate)."""


class SimCheckError(SimError):
    """A fault found by the simulator's checked mode (``cuflash.sim.options(checked=True)``).

    Attributes
    ----------
    kind : str
        ``"out-of-bounds read"``, ``"out-of-bounds write"``, ``"write to read-only argument"``,
        ``"uninitialized shared read"``, ``"shared race"``, ``"shared out-of-bounds"``,
        ``"cp.async in flight"`` (an access to shared bytes a ``cp.async`` is still filling),
        ``"wild access"`` (outside every argument, the block's shared memory, the thread's own stack
        and the module's image), ``"global race"`` (two threads of one block in one barrier phase,
        or of two blocks, on one byte of an argument, at least one writing, neither atomic; or a
        plain access of bytes a ``cp.reduce.async.bulk`` of the block has in flight),
        ``"misaligned access"`` (below the natural alignment of the accessed type), the sm_90a kinds
        ``"wgmma registers"``, ``"proxy fence"``, ``"async overlap"``, ``"mbarrier object"``
        (:mod:`cuflash.sim`) or ``"crash"`` (the checked launch's child died).
    kernel : str
        The kernel entry.
    block, thread : tuple of 3 int or None
        ``blockIdx`` and ``threadIdx`` of the faulting access.
    array : str or None
        The plan's argument name (global memory) or the ``__shared__`` variable's name.
    index : tuple of int or None
        Element index of the access in the array (for an argument: relative to its view, so an
        index outside the view's shape, or a negative one, says how far off it is).
    access : str or None
        ``"read"`` or ``"write"`` (``"atomic"`` for atomics on shared memory).
    nbytes : int or None
        Bytes of the access.
    other_thread : tuple of 3 int or None
        For races: the thread whose earlier access in the same barrier phase conflicts.
    other_access : str or None
        For races: ``"read"`` or ``"write"``, that earlier access (``"reduce-add"``: the block's own
        ``cp.reduce.async.bulk`` in flight, issued by ``other_thread``).
    other_block : tuple of 3 int or None
        For global races: ``blockIdx`` of the other access (``None`` when several blocks read).
    address : int or None
        For wild and misaligned accesses: the address.
    """

    def __init__(self, message: str, fault: "Fault"):
        super().__init__(message)
        self.fault = fault
        for f in dataclasses.fields(fault):
            setattr(self, f.name, getattr(fault, f.name))


@dataclasses.dataclass(frozen=True)
class Fault:
    """Where and what a checked-mode fault was: the attributes of :class:`SimCheckError`."""

    kind: str
    kernel: str
    block: tuple | None = None
    thread: tuple | None = None
    array: str | None = None
    index: tuple | None = None
    access: str | None = None
    nbytes: int | None = None
    other_thread: tuple | None = None
    other_access: str | None = None
    other_block: tuple | None = None
    address: int | None = None


class _Region(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("valid", ctypes.c_void_p),
        ("writable", ctypes.c_uint32),
        ("index", ctypes.c_uint32),
    ]


class _Report(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("region", ctypes.c_uint32),
        ("offset", ctypes.c_int64),
        ("size", ctypes.c_uint32),
        ("is_write", ctypes.c_uint32),
        ("block", ctypes.c_uint32 * 3),
        ("thread", ctypes.c_uint32 * 3),
        ("other_thread", ctypes.c_uint32 * 3),
        ("other_write", ctypes.c_uint32),
        ("elem_size", ctypes.c_uint32),
        ("rank", ctypes.c_uint32),
        ("dims", ctypes.c_uint64 * 4),
        ("name", ctypes.c_char * 64),
        ("other_block", ctypes.c_uint32 * 3),
        ("other_valid", ctypes.c_uint32),
        ("address", ctypes.c_uint64),
        ("align", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


_CHECK_KINDS = {1: "out-of-bounds read", 2: "out-of-bounds write", 3: "write to read-only argument",
                4: "uninitialized shared read", 5: "shared race", 6: "shared out-of-bounds",
                7: "cp.async in flight", 8: "wild access", 9: "global race", 10: "misaligned access",
                # sm_90a (cusim_sm90.h)
                11: "wgmma registers", 12: "proxy fence", 13: "async overlap", 14: "mbarrier object"}


class _Config(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("dynamic_smem", ctypes.c_uint64),
        ("smem_limit", ctypes.c_uint64),
        ("static_smem_limit", ctypes.c_uint64),
        ("max_threads", ctypes.c_uint32),
        ("workers", ctypes.c_uint32),
        ("seed", ctypes.c_uint64),
        ("stack_size", ctypes.c_uint64),
        ("stack_poison", ctypes.c_uint64),
        ("error", ctypes.c_char_p),
        ("error_cap", ctypes.c_uint64),
        ("static_smem_used", ctypes.c_uint64),
        ("context_switches", ctypes.c_uint64),
        ("blocks_run", ctypes.c_uint64),
        ("regions", ctypes.c_void_p),
        ("nregions", ctypes.c_uint64),
        ("report", ctypes.c_void_p),
        ("stack_pool", ctypes.c_void_p),
    ]


@dataclasses.dataclass(frozen=True)
class LaunchStats:
    """What one simulated launch did."""

    seconds: float
    blocks: int
    threads_per_block: int
    context_switches: int
    static_smem_bytes: int
    dynamic_smem_bytes: int


#: estimated seconds past which a launch warns (:class:`SimSlowLaunchWarning`)
SLOW_LAUNCH_SECONDS = 60.0

#: CPU seconds per block-iteration (:func:`block_iterations`) on one worker thread, for an entry
#: whose own launches have not been timed yet: the first pattern found in the entry's name
#: decides, else :data:`DEFAULT_ITERATION_SECONDS`. Measured on 2 EPYC cores (head dim 64;
#: head dim 128 costs about 4x per iteration): the attention forwards 70-180 us (SIMT, mma,
#: sm_90a), the backward's main kernels 170-740 us, the row kernels (softmax, the backward's
#: dot and convert passes, the combine, the append, dropout) 0.2-2 us.
ITERATION_SECONDS = (("_dot_", 2e-6), ("_convert_", 2e-6), ("combine", 2e-6), ("append", 2e-6),
                     ("softmax", 3e-6), ("dropout", 2e-6), ("attn_bwd", 700e-6), ("attn_fwd", 250e-6))
DEFAULT_ITERATION_SECONDS = 2e-6
#: checked mode's cost over a normal launch (measured 7-13x)
CHECKED_FACTOR = 12.0
#: launches shorter than this are not timed into an entry's rate (their fixed costs dominate)
_MIN_TIMED_SECONDS = 0.05

_timing_lock = threading.Lock()
_timings: dict = {}     # (entry, checked) -> [block-iterations, CPU seconds] of timed launches
_warned: set = set()    # entries that have warned in this process


def block_iterations(plan) -> int:
    """The work measure of the launch-time estimate: blocks times the longest axis of the plan's
    arrays (pointer and tensor-map arguments). Each block of the attention kernels loops over the
    key (or query) sequence, the longest axis; a row kernel's block over its row. (An estimate:
    a paged cache's longest axis is its page count or page size, not the sequence.)"""
    longest = 1
    for a in plan.args:
        pointer = a.pointer if isinstance(a, TensorMapArg) else a
        if isinstance(pointer, PointerArg) and pointer.shape:
            longest = max(longest, *(int(n) for n in pointer.shape))
    return plan.num_blocks * longest


def estimate_seconds(plan, workers: int, checked: bool = False) -> float:
    """Estimated wall seconds of ``plan`` on ``workers`` threads: :func:`block_iterations` times
    the entry's CPU seconds per block-iteration, over the workers the grid can use.

    The rate is the one measured on this process's earlier launches of the entry (those of at
    least 0.05 s, summed), else the documented constant :data:`ITERATION_SECONDS` (times
    :data:`CHECKED_FACTOR` in checked mode)."""
    with _timing_lock:
        timed = _timings.get((plan.entry, checked))
    if timed is not None:
        rate = timed[1] / timed[0]
    else:
        rate = next((r for pat, r in ITERATION_SECONDS if pat in plan.entry), DEFAULT_ITERATION_SECONDS)
        rate *= CHECKED_FACTOR if checked else 1.0
    return block_iterations(plan) * rate / max(1, min(workers, plan.num_blocks))


def _caller_stacklevel() -> int:
    """The warnings stack level of the first frame outside the cuflash package."""
    package = str(SIM_DIR.parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _warn_if_slow(plan, workers: int, checked: bool) -> None:
    if plan.entry in _warned:
        return
    seconds = estimate_seconds(plan, workers, checked)
    if seconds <= SLOW_LAUNCH_SECONDS:
        return
    with _timing_lock:
        if plan.entry in _warned:
            return
        _warned.add(plan.entry)
    warnings.warn(SimSlowLaunchWarning(
        f"cuflash simulator: {plan.entry}: this launch of {_count(plan.num_blocks, 'block')} x "
        f"{_count(plan.threads_per_block, 'thread')} is estimated to take about {seconds:.0f} s on "
        f"{_count(workers, 'worker thread')} (more than {SLOW_LAUNCH_SECONDS:.0f} s; "
        f"the simulator runs every thread on the CPU); smaller inputs or a GPU run faster. This warning is given "
        f"once per kernel"), stacklevel=_caller_stacklevel())


def _record_time(plan, seconds: float, workers: int, checked: bool) -> None:
    if seconds < _MIN_TIMED_SECONDS:
        return
    cpu = seconds * max(1, min(workers, plan.num_blocks))
    with _timing_lock:
        timed = _timings.setdefault((plan.entry, checked), [0, 0.0])
        timed[0] += block_iterations(plan)
        timed[1] += cpu


def cache_dir() -> Path:
    """The module cache folder (``CUFLASH_SIM_CACHE_DIR`` or ``~/.cache/cuflash/sim``)."""
    env = os.environ.get("CUFLASH_SIM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cuflash" / "sim"


_compiler_ids: dict[str, str] = {}


def compiler() -> tuple[str, str]:
    """Return the C++ compiler's path (``CUFLASH_SIM_CXX``, else ``g++``) and identity string.

    Raises
    ------
    RuntimeError
        If the compiler is not found.
    """
    cxx = os.environ.get("CUFLASH_SIM_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"cuflash simulator: C++ compiler {cxx!r} not found (set CUFLASH_SIM_CXX)")
    ident = _compiler_ids.get(path)
    if ident is None:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
        mach = subprocess.run([path, "-dumpmachine"], capture_output=True, text=True, check=False).stdout
        ident = (out.splitlines()[0] if out else path) + " " + mach.strip()
        _compiler_ids[path] = ident
    return path, ident


def use_asm_fibers(fibers: str) -> bool:
    """Whether the assembly fiber switch is used for ``fibers`` ("auto", "asm", "ucontext")."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if fibers == "asm" and not x86:
        raise ValueError(f"cuflash.sim.options: fibers='asm' needs x86-64; this CPU is {platform.machine()}")
    return x86 and fibers != "ucontext"


#: g++'s thread-sanitizer instrumentation without its runtime (cusim.h defines the hooks): every
#: load and store of the kernel's code, volatile ones apart, calls a hook
TSAN_FLAGS = ("-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0", "--param",
              "tsan-distinguish-volatile=1")
#: extra g++ flags of checked modules (see the module docstring)
CHECKED_FLAGS = ("-DCUSIM_CHECKED=1", *TSAN_FLAGS, "-ftrivial-auto-var-init=pattern")
#: checked modules: an access below its type's alignment calls cusim.h's handler (no runtime).
#: (Not in normal modules: it costs them a quarter of their speed; there a misaligned vector
#: access faults, and the fault is a launch error naming the thread.)
ALIGNMENT_FLAGS = ("-fsanitize=alignment", "-fno-sanitize-recover=alignment")
#: normal modules whose source has volatile data: the hooks see volatile accesses (spin-waits)
POLL_FLAGS = ("-DCUSIM_POLL_HOOKS=1", *TSAN_FLAGS)
#: SimOptions(gpu_numerics=True): contraction to FMA as NVRTC does, and cusim.h's GPU rounding
GPU_NUMERICS_FLAGS = ("-DCUSIM_GPU_NUMERICS=1", "-mfma", "-ffp-contract=fast")
#: the link step (separate, so that no sanitizer runtime is linked)
LINK_FLAGS = ("-shared", "-pthread", "-fPIC")


def compile_flags(arch: int, asm_fibers: bool, checked: bool = False, polls: bool = False,
                  gpu_numerics: bool = False) -> list[str]:
    """The g++ compile flags of a module for ``sm_<arch>`` (``polls``: instrument volatile accesses;
    ``gpu_numerics``: see :func:`cuflash.sim.options`)."""
    flags = ["-std=c++17", "-O1" if checked else "-O2", "-g0", "-fPIC", "-pthread", "-fvisibility=hidden",
             "-fno-strict-aliasing", "-fno-math-errno", "-Wno-attributes", "-Wno-psabi",
             f"-I{SIM_DIR}", f"-D__CUDA_ARCH__={arch * 10}"]
    if arch == 90:  # the simulator's sm_90 is sm_90a: wgmma, setmaxnreg (kernels_cu/ptx.cuh)
        flags.append("-D__CUDA_ARCH_FEAT_SM90_ALL=1")
    if not asm_fibers:
        flags.append("-DCUSIM_FIBERS_UCONTEXT=1")
    if checked:
        flags += [*CHECKED_FLAGS, *ALIGNMENT_FLAGS]
    elif polls:
        flags += POLL_FLAGS
    if gpu_numerics:
        flags += GPU_NUMERICS_FLAGS
    return flags


@functools.cache
def check_gpu_numerics() -> None:
    """Raise ``ValueError`` unless this CPU can run ``gpu_numerics`` modules (x86-64 with FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"cuflash.sim.options: gpu_numerics=True needs an x86-64 CPU; this one is {platform.machine()}")
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = ["fma"]   # not Linux: let the compiler and the CPU decide
    if "fma" not in flags:
        raise ValueError("cuflash.sim.options: gpu_numerics=True needs a CPU with FMA instructions; this one has none")


def has_volatile_data(source: str) -> bool:
    """Whether ``source`` declares volatile data (``asm volatile`` and comments aside)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    return re.search(r"\bvolatile\b(?!\s*\()", re.sub(r"\b(asm|__asm__)\s+(volatile|__volatile__)", " ", text)) is not None


_runtime_digest: str | None = None


def _runtime_hash() -> str:
    global _runtime_digest
    if _runtime_digest is None:
        h = hashlib.sha256()
        for name in RUNTIME_FILES:
            h.update(name.encode() + b"\0" + (SIM_DIR / name).read_bytes() + b"\0")
        _runtime_digest = h.hexdigest()
    return _runtime_digest


def module_text(source: str, entries: Sequence[str], origin: str = "kernel.cu") -> str:
    """The C++ translation unit for ``source`` with stubs for ``entries``."""
    body = lower.lower_shared(lower.lower_launch_bounds(source), origin)
    stubs = ['\n#line 1 "<cusim entry stubs>"\n']
    for e in entries:
        stubs.append(
            f"CUSIM_EXPORT int cusim_launch_{e}(::cusim::LaunchConfig* c, void** a) "
            f"{{ return ::cusim::launch(&{e}, c, a); }}\n"
            f"CUSIM_EXPORT int cusim_signature_{e}(char* k, uint32_t* s, int cap) "
            f"{{ return ::cusim::signature(&{e}, k, s, cap); }}\n"
        )
    return '#include "cusim.h"\n' + body + "".join(stubs)


#: the most kernel parameters a signature is read for (the modifier backward has 75)
MAX_PARAMS = 128

_SCALAR_KINDS = {
    np.dtype(np.int32): ("i", 4), np.dtype(np.uint32): ("u", 4),
    np.dtype(np.int64): ("i", 8), np.dtype(np.uint64): ("u", 8),
    np.dtype(np.float32): ("f", 4), np.dtype(np.float64): ("f", 8),
}
_KIND_NAMES = {"p": "pointer", "i": "signed integer", "u": "unsigned integer", "f": "floating point", "s": "struct"}


#: the process's fiber-stack pool (cusim.h: StackPool), made by the first module loaded and
#: handed to every launch, so the modules of a session share one set of stacks (a pool per
#: module would exhaust the kernel's memory-map limit over a test session)
_STACK_POOL = None
_STACK_POOL_LOCK = threading.Lock()


def _share_stack_pool(lib) -> None:
    global _STACK_POOL
    with _STACK_POOL_LOCK:
        if _STACK_POOL is None:
            make = lib.cusim_new_stack_pool
            make.restype = ctypes.c_void_p
            make.argtypes = []
            _STACK_POOL = make()


class SimModule:
    """A compiled simulator module (one source text, several entries)."""

    def __init__(self, path: Path, entries: Sequence[str], arch: int, compile_seconds: float, checked: bool = False,
                 restrict: dict | None = None):
        self.path = path
        self.arch = arch
        self.checked = checked
        self.compile_seconds = compile_seconds
        self._lib = ctypes.CDLL(str(path))
        _share_stack_pool(self._lib)
        self._launch = {}
        self.signatures: dict[str, tuple[tuple[str, int], ...]] = {}
        for e in entries:
            fn = getattr(self._lib, f"cusim_launch_{e}")
            fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._launch[e] = fn
            sig = getattr(self._lib, f"cusim_signature_{e}")
            sig.restype = ctypes.c_int
            kinds = ctypes.create_string_buffer(MAX_PARAMS)
            sizes = (ctypes.c_uint32 * MAX_PARAMS)()
            n = sig(kinds, sizes, MAX_PARAMS)
            if n > MAX_PARAMS:
                raise SimError(f"cuflash simulator: {e} has {n} parameters, more than the {MAX_PARAMS} the launcher reads")
            self.signatures[e] = tuple((kinds.raw[i : i + 1].decode(), int(sizes[i])) for i in range(n))
        self.restrict = restrict or {}

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self._launch)

    def _check_declaration(self, plan) -> None:
        """What the kernel's declaration promises about its pointers: ``__restrict__`` ones do not
        alias, so a written one may overlap no other pointer argument (the compiler may reorder
        their accesses, and checked mode copies arguments separately). (``__launch_bounds__`` is
        checked by the kernel itself: :func:`cuflash.sim.lower.lower_launch_bounds`.)"""
        flags = self.restrict.get(plan.entry, ())
        pointers = [(i, a) for i, a in enumerate(plan.args) if isinstance(a, plan_mod.PointerArg) and a.extent > 0]
        spans = {}
        for i, a in pointers:
            start = plan_mod.array_address(a.base) + a.offset * a.base.dtype.itemsize
            spans[i] = (start, start + a.extent * a.base.dtype.itemsize)
        for i, a in pointers:
            if not (a.writable and i < len(flags) and flags[i]):
                continue
            for j, b in pointers:
                if j != i and spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]:
                    raise SimError(f"cuflash simulator: {plan.entry}: __restrict__ argument {a.name} (written) overlaps "
                                   f"argument {b.name} in memory; the kernel promises they do not alias")

    def _marshal(self, plan, addresses: dict | None = None) -> tuple[list, ctypes.Array]:
        sig = self.signatures[plan.entry]
        if len(sig) != len(plan.args):
            raise TypeError(f"{plan.entry}: the kernel takes {len(sig)} arguments, the plan gives {len(plan.args)}")
        keep: list = []
        for i, (a, (kind, size)) in enumerate(zip(plan.args, sig)):
            if isinstance(a, PointerArg):
                if not isinstance(a.base, np.ndarray):
                    raise TypeError(
                        f"{plan.entry}: argument {i} ({a.name}) must be a NumPy array for the simulator, "
                        f"got {type(a.base).__name__}"
                    )
                if a.writable and not a.base.flags.writeable:
                    raise ValueError(f"{plan.entry}: argument {i} ({a.name}) is written but its array is read-only")
                got = ("p", 8)
                keep.append(ctypes.c_void_p(addresses[i] if addresses else a.address))
            elif isinstance(a, TensorMapArg):
                if not isinstance(a.pointer.base, np.ndarray):
                    raise TypeError(f"{plan.entry}: argument {i} ({a.name}) must map a NumPy array for the simulator, "
                                    f"got {type(a.pointer.base).__name__}")
                got = ("s", 128)
                keep.append((ctypes.c_char * 128).from_buffer_copy(
                    a.encode(addresses[i] if addresses else a.pointer.address, simulator=True)))
            else:
                got = _SCALAR_KINDS[np.dtype(type(a.value))]
                keep.append(np.ctypeslib.as_ctypes(np.array(a.value)))
            if got != (kind, size):
                raise TypeError(
                    f"{plan.entry}: argument {i} ({a.name}) is a {size}-byte {_KIND_NAMES.get(kind, kind)} in the "
                    f"kernel; the plan passes a {got[1]}-byte {_KIND_NAMES[got[0]]}"
                    + (f" ({type(a.value).__name__})" if isinstance(a, ScalarArg) else "")
                )
        argv = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(k) for k in keep])
        return keep, argv

    def launch(self, plan, options: sim_config.SimOptions | None = None) -> LaunchStats:
        """Run ``plan`` (whose arrays are NumPy arrays) to completion.

        Raises
        ------
        KeyError
            If the module has no entry ``plan.entry``.
        TypeError
            If the plan's arguments do not match the kernel's parameters.
        ValueError
            If the plan exceeds a limit of the emulated device.
        SimError
            If the kernel fails (trap, misaligned or misplaced PTX operand, deadlock,
            shared memory over the limit, ...).

        Warns
        -----
        SimSlowLaunchWarning
            Once per process and entry, before a launch whose :func:`estimate_seconds` exceeds
            :data:`SLOW_LAUNCH_SECONDS`; the launch then runs as usual.
        """
        opts = options or sim_config.current_options()
        if plan.entry not in self._launch:
            raise KeyError(f"cuflash simulator: module has no entry {plan.entry!r} (has {', '.join(self._launch)})")
        cc = self.arch
        plan.check_device(cc)
        if self.checked != opts.checked:
            raise ValueError(f"cuflash simulator: module {self.path.name} was compiled with checked={self.checked}; "
                             f"the options say checked={opts.checked}")
        regions = _CheckedRegions(plan) if self.checked else None
        keep, argv = self._marshal(plan, regions.addresses if regions else None)
        self._check_declaration(plan)
        err = ctypes.create_string_buffer(_ERROR_CAP)
        cfg = _Config()
        cfg.grid[:] = plan.grid
        cfg.block[:] = plan.block
        cfg.dynamic_smem = plan.shared_mem_bytes
        cfg.smem_limit = plan.smem_limit(cc)
        cfg.static_smem_limit = SMEM_DEFAULT_LIMIT
        cfg.max_threads = MAX_THREADS_PER_BLOCK
        cfg.workers = max(1, min(opts.workers or (os.cpu_count() or 1), plan.num_blocks))
        cfg.seed = opts.seed
        cfg.stack_size = opts.stack_kib * 1024
        cfg.stack_poison = min(STACK_POISON_BYTES, cfg.stack_size)
        cfg.stack_pool = _STACK_POOL
        cfg.error = ctypes.cast(err, ctypes.c_char_p)
        cfg.error_cap = _ERROR_CAP
        if plan.shared_mem_bytes > cfg.smem_limit:
            raise ValueError(
                f"{plan.entry}: {plan.shared_mem_bytes} bytes of dynamic shared memory exceed the {cfg.smem_limit}-byte "
                f"limit of sm_{cc}" + ("" if plan.needs_smem_opt_in else " without the opt-in")
            )
        _warn_if_slow(plan, cfg.workers, self.checked)
        t0 = time.perf_counter()
        if regions is not None:
            try:
                rc = self._launch_checked(plan, cfg, argv, err, regions)
            finally:
                regions.close()
        else:
            rc = self._launch[plan.entry](ctypes.byref(cfg), ctypes.cast(argv, ctypes.c_void_p))
        dt = time.perf_counter() - t0
        del keep
        if rc != 0:
            msg = err.value.decode(errors="replace") or f"launch failed (code {rc})"
            raise SimError(f"cuflash simulator: {plan.entry} (sm_{cc}): {msg}")
        _record_time(plan, dt, cfg.workers, self.checked)
        return LaunchStats(dt, int(cfg.blocks_run), plan.threads_per_block, int(cfg.context_switches),
                           int(cfg.static_smem_used), plan.shared_mem_bytes)


    def _launch_checked(self, plan, cfg, argv, err, regions) -> int:
        """Run a checked launch in a forked child (a crash cannot kill this process); arguments live
        in shared memory, so the child's writes reach the copies, which are copied back here."""
        table = regions.table()
        report = _Report()
        cfg.regions = ctypes.cast(table, ctypes.c_void_p)
        cfg.nregions = len(regions.args)
        cfg.report = ctypes.cast(ctypes.pointer(report), ctypes.c_void_p)
        fn = self._launch[plan.entry]

        def child():
            rc = fn(ctypes.byref(cfg), ctypes.cast(argv, ctypes.c_void_p))
            return (rc, err.value, bytes(report), int(cfg.blocks_run), int(cfg.context_switches),
                    int(cfg.static_smem_used))

        got = _run_forked(child) if hasattr(os, "fork") else ("ok", child())
        if got[0] == "crash":
            raise SimCheckError(
                f"cuflash simulator (checked): {plan.entry} (sm_{self.arch}): the checked launch died ({got[1]}); "
                "an access far outside every argument, a stack overflow or a fault in the runtime",
                Fault("crash", plan.entry))
        if got[0] == "error":
            raise SimError(f"cuflash simulator (checked): {plan.entry}: the checked launch failed in its child: {got[1]}")
        rc, msg, rep_bytes, cfg.blocks_run, cfg.context_switches, cfg.static_smem_used = got[1]
        ctypes.memmove(ctypes.addressof(report), rep_bytes, ctypes.sizeof(report))
        if rc != 0 and report.kind:
            raise _check_error(plan, self.arch, report, regions, msg.decode(errors="replace"))
        if rc == 0:
            regions.copy_back()
        else:
            err.value = msg[: _ERROR_CAP - 1]
        return rc


def _run_forked(fn):
    """Run ``fn()`` in a forked child; returns ("ok", result), ("error", text) or ("crash", text)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            os.close(r)
            import faulthandler

            faulthandler.disable()  # a crash is reported by the parent, without a Python traceback here
            try:
                data = pickle.dumps(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
                data = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return ("crash", f"killed by {name}")
    if not chunks:
        return ("crash", f"exit status {os.waitstatus_to_exitcode(status)} without a result")
    return pickle.loads(b"".join(chunks))


_PAGE = mmap.PAGESIZE
#: bytes registered on each side of an argument's copy: accesses up to this far outside are
#: reported with their element; beyond, a PROT_NONE page makes the checked launch crash
CHECK_SLACK = 16384
_libc = None


def _mprotect_none(addr: int, size: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.mprotect(ctypes.c_void_p(addr), size, 0)


class _CheckedRegions:
    """Per pointer argument of a plan: a copy of its memory span in shared memory (``mmap``) with
    slack and guard pages around it, and the per-byte map of the view's elements."""

    def __init__(self, plan):
        self.plan = plan
        self.args: list = []  # (arg index, PointerArg, mmap, data offset, region start, region size, mask)
        self.addresses: dict[int, int] = {}
        self._keep: list = []
        for i, a in enumerate(plan.args):
            if isinstance(a, TensorMapArg):
                a = a.pointer  # the view the map reaches
            if not isinstance(a, PointerArg) or not isinstance(a.base, np.ndarray):
                continue
            item = a.dtype.itemsize
            span = a.extent * item
            mis = a.address % 256  # keep the pointer's alignment (cudaMalloc aligns to 256 bytes)
            data_off = _PAGE + CHECK_SLACK + mis
            total = -(-(data_off + span + CHECK_SLACK) // _PAGE) * _PAGE + _PAGE
            mm = mmap.mmap(-1, total)  # MAP_SHARED | MAP_ANONYMOUS: a forked child's writes come back
            cbuf = ctypes.c_char.from_buffer(mm)
            base = ctypes.addressof(cbuf)
            if span:
                ctypes.memmove(base + data_off, a.address, span)
            region_size = total - 2 * _PAGE
            mask = np.zeros(region_size, np.uint8)
            if span:
                offs = np.zeros((), np.int64)
                for n, st in zip(a.shape, a.strides):
                    offs = offs[..., None] + np.arange(n, dtype=np.int64) * st
                first = (data_off - _PAGE) + offs.reshape(-1, 1) * item + np.arange(item, dtype=np.int64)
                mask[first.ravel()] = 1
            self.args.append((i, a, mm, data_off, base + _PAGE, region_size, mask))
            self._keep.append(cbuf)
            self.addresses[i] = base + data_off
        for _, _, mm, _, start, size, _ in self.args:  # guard pages, after every copy is made
            _mprotect_none(start - _PAGE, _PAGE)
            _mprotect_none(start + size, _PAGE)

    def table(self) -> ctypes.Array:
        t = (_Region * max(1, len(self.args)))()
        for k, (i, a, mm, data_off, start, size, mask) in enumerate(self.args):
            t[k].start, t[k].size = start, size
            t[k].valid = mask.ctypes.data
            t[k].writable = int(a.writable)
            t[k].index = i
        self._keep.append(t)
        return t

    @staticmethod
    def _raw(dtype: np.dtype) -> np.dtype:
        return np.dtype(f"u{dtype.itemsize}") if dtype.itemsize in (1, 2, 4, 8) else np.dtype(f"V{dtype.itemsize}")

    def copy_back(self) -> None:
        """Copy the view elements of every writable argument back to the caller's array."""
        for i, a, mm, data_off, start, size, mask in self.args:
            if not a.writable or a.extent == 0:
                continue
            item = a.dtype.itemsize
            raw = self._raw(a.dtype)
            bstrides = tuple(s * item for s in a.strides)
            src = np.ndarray(a.shape, raw, buffer=mm, offset=data_off, strides=bstrides)
            dst_buf = (ctypes.c_char * (a.extent * item)).from_address(a.address)
            dst = np.ndarray(a.shape, raw, buffer=dst_buf, strides=bstrides)
            np.copyto(dst, src)

    def locate(self, k: int, offset: int):
        """(argument, element index in the view) of byte ``offset`` of region ``k``."""
        i, a, mm, data_off, start, size, mask = self.args[k]
        item = a.dtype.itemsize
        rel = offset - (data_off - _PAGE)
        elem = rel // item
        order = sorted(range(len(a.shape)), key=lambda d: -a.strides[d])
        idx = [0] * len(a.shape)
        rem = elem
        for pos, d in enumerate(order):
            st = a.strides[d]
            if st == 0 or (a.shape[d] == 1 and pos != len(order) - 1):
                continue
            idx[d] = rem // st
            rem -= idx[d] * st
        if order and rem:
            idx[order[-1]] += rem
        return a, tuple(int(x) for x in idx)

    def close(self) -> None:
        self._keep.clear()
        for _, _, mm, *_ in self.args:
            try:
                mm.close()
            except BufferError:
                pass
        self.args.clear()


def _xyz(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v)


def _check_error(plan, arch: int, r: _Report, regions: _CheckedRegions, detail: str) -> SimCheckError:
    kind = _CHECK_KINDS.get(r.kind, f"fault {r.kind}")
    block, thread = _xyz(r.block), _xyz(r.thread)
    where = f"block {block} thread {thread}"
    other = other_access = other_block = None
    if r.kind in (8, 10, 11):
        array, index = None, None
        access = "write" if r.is_write else "read"
        if r.kind == 10:
            array = r.name.decode(errors="replace")
        if r.other_valid:
            other = _xyz(r.other_thread)
        text = detail.split(": ", 2)[-1] if detail else f"{kind} at address {r.address:#x}"
    elif r.kind in (1, 2, 3, 9):
        arg, index = regions.locate(r.region, r.offset)
        access = "write" if r.is_write else "read"
        array = arg.name
        inside = all(0 <= x < n for x, n in zip(index, arg.shape))
        what = (f"{array}{list(index)} (view shape {arg.shape}, element strides {arg.strides}"
                + ("" if inside else ", outside the view") + ")")
        if r.kind == 3:
            text = f"write to read-only argument {what}"
        elif r.kind == 9:
            other_access = "write" if r.other_write else "read"
            if r.other_valid:
                other_block, other = _xyz(r.other_block), _xyz(r.other_thread)
            if r.other_write == 2:   # a cp.reduce.async.bulk of this block, still in flight
                other_access = "reduce-add"
                by = (f"a cp.reduce.async.bulk of this block issued by thread {other}, still in flight (no "
                      "cp.async.bulk.wait_group of its issuer covers it yet)")
            elif other_block == block:
                by = f"thread {other} of the same block in the same barrier phase (no __syncthreads orders them)"
            elif other_block is not None:
                by = f"block {other_block} thread {other} (blocks of one launch are not ordered; use an atomic)"
            else:
                by = "threads of several other blocks (blocks of one launch are not ordered; use an atomic)"
            text = f"global-memory race on {what}: {access} here, {other_access} by {by}"
        else:
            text = f"out-of-bounds {access} of {r.size} bytes at {what}"
    else:
        array = r.name.decode(errors="replace")
        elem = max(1, r.elem_size)
        flat = r.offset // elem
        dims = [int(r.dims[i]) for i in range(min(r.rank, 4))]
        index = []
        for n in reversed(dims[1:]):
            index.append(flat % n if n else flat)
            flat = flat // n if n else 0
        index.append(flat)
        index = tuple(reversed(index)) if dims else (flat,)
        access = "atomic" if (r.kind == 4 and r.is_write) else ("write" if r.is_write else "read")
        what = f"__shared__ {array}{list(index)}" + (f" (extents {tuple(dims)})" if dims else "")
        if r.kind == 5:
            other = _xyz(r.other_thread)
            other_access = "write" if r.other_write else "read"
            text = (f"shared-memory race on {what}: {access} by thread {thread}, {other_access} by thread {other} "
                    "in the same barrier phase (no __syncthreads or __syncwarp orders them)")
        elif r.kind == 4:
            text = f"read of uninitialized shared memory {what} (never written in this block)"
        elif r.kind == 7:
            other, other_access = _xyz(r.other_thread), "cp.async"
            text = (f"{access} of {what} while a cp.async or TMA load issued by thread {other} is still filling "
                    "it (the issuer's cp.async.wait_group, or a completed mbarrier phase, has not covered it)")
        elif r.kind in (12, 13, 14):
            text = (detail.split(": ", 2)[-1] if detail else kind) + f" [{what}]"
        else:
            text = f"{access} outside every __shared__ variable, near {what}"
    msg = f"cuflash simulator (checked): {plan.entry} (sm_{arch}): {kind}: {text}, at {where}"
    return SimCheckError(msg, Fault(kind, plan.entry, block, thread, array, index, access, int(r.size), other,
                                    other_access, other_block, int(r.address) if r.kind in (8, 10) else None))


_modules: dict[str, SimModule] = {}
_locks: dict[str, threading.Lock] = {}
_global_lock = threading.Lock()


@functools.lru_cache(maxsize=512)
def _prepare(source: str, entries: tuple, origin: str, arch: int, asm: bool, checked: bool, gpu_numerics: bool,
             ident: str) -> tuple[str, list, str]:
    """The module text, its g++ flags and its cache key: computed once per source and options (the
    lowering and the hash cost milliseconds, and every simulated launch asks)."""
    text = module_text(source, entries, origin)
    flags = compile_flags(arch, asm, checked, has_volatile_data(text), gpu_numerics)
    key = hashlib.sha256(
        "\0".join([_FORMAT_VERSION, _runtime_hash(), ident, " ".join(flags), " ".join(entries), text]).encode()
    ).hexdigest()[:32]
    return text, flags, key


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on ``path`` shared by every process using the cache folder (pytest-xdist's
    workers, concurrent sessions), so a module is compiled once, not once per process."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _g(cmd: list, what: str) -> float:
    """Run one g++ step; return the CPU seconds (user + system) it took."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"cuflash simulator: g++ failed on {what}:\n"
                               f"{err.read().decode(errors='replace')[-6000:]}")
    return usage.ru_utime + usage.ru_stime


#: ``CUFLASH_SIM_COMPILE_LOG=FILE`` appends one tab-separated line per module compiled (the test
#: running it, from pytest's ``PYTEST_CURRENT_TEST``; the cache key; the entries; arch, checked,
#: gpu_numerics; the wall seconds; g++'s CPU seconds; the CPU seconds of the runtime parts built for
#: it, if they were), to see what a test run spends on compiles
COMPILE_LOG_ENV = "CUFLASH_SIM_COMPILE_LOG"


def _log_compile(key: str, entries: Sequence[str], opts, wall: float, cpu: float, rt_cpu: float) -> None:
    path = os.environ.get(COMPILE_LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
    line = "\t".join([test, key, " ".join(entries), f"sm_{opts.arch}", str(int(opts.checked)),
                      str(int(opts.gpu_numerics)), f"{wall:.2f}", f"{cpu:.2f}", f"{rt_cpu:.2f}"]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())   # one write of a short line: whole, even from several processes
    finally:
        os.close(fd)


#: a module's translation unit: cusim.h declares the launch and the hooks, defined once per flag
#: set in the runtime object (``cusim.h``, "The launch itself ...")
MODULE_FLAGS = ("-DCUSIM_MODULE=1",)
#: the runtime object's translation unit
RUNTIME_OBJECT_FLAGS = ("-DCUSIM_RUNTIME_OBJECT=1",)


def _runtime_parts(flags: list, cxx: str, ident: str) -> tuple[Path, float]:
    """The folder of the runtime's parts compiled once per flag set (in the cache folder, under a
    lock shared by every process using it; each file written atomically) and the CPU seconds spent
    building them here (0 when they were there):

    * ``cusim.o``, the runtime object: the launch (the fibers, the block scheduler, the workers),
      checked mode's and the polls' hooks, the alignment handler. These do not depend on the
      kernel, so every module of the flag set links this one object instead of compiling them
      again: it more than halves a tensor-core or SIMT module's compile time. (Each module's
      shared library still holds its own copy of the runtime, as before.)
    * ``cusim.h.gch``, cusim.h precompiled for a module: a module lists the folder first among
      its include folders and g++ takes the precompiled header in place of ``cusim.h`` (and the
      runtime headers it includes), which saves about a third of what is left; a header it cannot
      use (other flags) it skips for the real one, so the result never depends on it.
    """
    key = hashlib.sha256("\0".join([_FORMAT_VERSION, _runtime_hash(), ident, *flags]).encode()).hexdigest()[:24]
    folder = cache_dir() / f"rt-{key}"
    gch, obj = folder / "cusim.h.gch", folder / "cusim.o"
    cache_dir().mkdir(parents=True, exist_ok=True)
    cpu = 0.0
    with _file_lock(cache_dir() / f"rt-{key}.lock"):
        if not (gch.exists() and obj.exists()):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".tmp.{os.getpid()}"
            tmp.write_text('#include "cusim.h"\n', encoding="utf-8")
            cpu += _g([cxx, *flags, *RUNTIME_OBJECT_FLAGS, "-x", "c++", str(tmp), "-c", "-o", f"{tmp}.o"],
                      "the runtime object")
            cpu += _g([cxx, *flags, *MODULE_FLAGS, "-x", "c++-header", str(SIM_DIR / "cusim.h"), "-o", f"{tmp}.gch"],
                      "cusim.h (precompiled)")
            tmp.unlink()
            os.replace(f"{tmp}.o", obj)
            os.replace(f"{tmp}.gch", gch)
    return folder, cpu


def _build(text: str, flags: list, origin: str, tools: tuple, so: Path) -> tuple[float, float]:
    """Compile and link one module into ``so`` (atomically: built in a temporary folder, renamed);
    return g++'s CPU seconds for the module and for the runtime parts it built (0 if none)."""
    cxx, ident, asm, arch = tools
    rt, rt_cpu = _runtime_parts(flags, cxx, ident)
    with tempfile.TemporaryDirectory(dir=so.parent, prefix="build-") as tmp:
        cpp = Path(tmp) / f"{Path(origin).stem}.cpp"
        cpp.write_text(text, encoding="utf-8")
        obj, out = Path(tmp) / "module.o", Path(tmp) / "module.so"
        link = [cxx, *LINK_FLAGS, str(obj), str(rt / "cusim.o")]
        if asm:
            link.append(str(SIM_DIR / "cusim_switch_x86_64.S"))
        cpu = _g([cxx, f"-I{rt}", *flags, *MODULE_FLAGS, "-c", str(cpp), "-o", str(obj)], f"{origin} (sm_{arch})")
        cpu += _g([*link, "-o", str(out)], f"{origin} (sm_{arch}, link)")
        os.replace(out, so)
    return cpu, rt_cpu


def load_source(
    source: str,
    entries: Iterable[str] | None = None,
    *,
    origin: str = "kernel.cu",
    options: sim_config.SimOptions | None = None,
) -> SimModule:
    """Compile (or fetch from the caches) the module for a full source text.

    Parameters
    ----------
    source : str
        Full source text (as built by :mod:`cuflash.runtime.source`).
    entries : iterable of str, optional
        Kernel names to export; by default the ``extern "C" __global__`` names found in ``source``.
    origin : str
        File name for diagnostics.
    options : SimOptions, optional
        Arch and fiber implementation; default: :func:`cuflash.sim.current_options`.

    Raises
    ------
    RuntimeError
        If g++ fails (with its diagnostics).
    """
    opts = options or sim_config.current_options()
    entries = tuple(entries) if entries is not None else tuple(lower.find_entries(source))
    if not entries:
        raise ValueError(f"cuflash simulator: no kernel entries in {origin}")
    asm = use_asm_fibers(opts.fibers)
    cxx, ident = compiler()
    if opts.gpu_numerics:
        check_gpu_numerics()
    text, flags, key = _prepare(source, entries, origin, opts.arch, asm, opts.checked, opts.gpu_numerics, ident)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _global_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        so = folder / f"{key}.so"
        seconds = 0.0
        with _file_lock(folder / f"{key}.lock"):   # another process building it: wait, then take its module
            if not so.exists():
                t0 = time.perf_counter()
                cpu, rt_cpu = _build(text, flags, origin, (cxx, ident, asm, opts.arch), so)
                seconds = time.perf_counter() - t0
                _log_compile(key, entries, opts, seconds, cpu, rt_cpu)
        written = lower.entry_restrict(source)
        if len(written) == 1 and len(entries) == 1 and entries[0] not in written:
            written = {entries[0]: next(iter(written.values()))}   # the entry's name is a macro (CUFLASH_ENTRY)
        restrict = {e: written[e] for e in entries if e in written}
        mod = SimModule(so, entries, opts.arch, seconds, opts.checked, restrict)
        _modules[key] = mod
        return mod


def load_variant(variant, options: sim_config.SimOptions | None = None) -> SimModule:
    """The simulator module of a :class:`cuflash.runtime.variants.Variant`."""
    return load_source(build_source(variant), (variant.entry,), origin=variant.source, options=options)


def precompile(variants: Iterable, options: sim_config.SimOptions | None = None, jobs: int | None = None) -> list:
    """Compile several variants in parallel (g++ runs in subprocesses); returns their modules."""
    opts = options or sim_config.current_options()
    variants = list(variants)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
        return list(ex.map(lambda v: load_variant(v, opts), variants))


def run(plan, options: sim_config.SimOptions | None = None) -> LaunchStats:
    """Compile (cached) and run a :class:`cuflash.runtime.plan.LaunchPlan` on the simulator: the
    simulated device's launcher (:class:`cuflash.sim.device.SimDevice`).

    Raises
    ------
    TypeError
        If a pointer or tensor-map argument is not simulated device memory
        (:class:`~cuflash.sim.memory.SimArray`): an array the call never imported, which a GPU
        could not read either.
    """
    for a in plan.args:
        base = a.pointer.base if isinstance(a, TensorMapArg) else getattr(a, "base", None)
        if isinstance(a, (PointerArg, TensorMapArg)) and not is_sim_array(base):
            raise TypeError(f"cuflash simulator: {plan.entry}: argument {a.name} is a {type(base).__name__}, not "
                            f"simulated device memory: the call never imported it to the device (a GPU could not "
                            f"read it either)")
    opts = options or sim_config.current_options()
    return load_variant(plan.variant, opts).launch(plan, opts)
