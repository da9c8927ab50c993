"""The simulator's launcher: compile kernel sources with g++, cache them, run launch plans.

One module is compiled per source text: ``#include "cusim.h"``, the lowered kernel text
(:func:`cuflash._sim.lower.lower_shared`), and for each entry two exported stubs (launch and
parameter signature). Flags: ``-std=c++17 -O2 -fPIC -shared -pthread -fvisibility=hidden
-fno-strict-aliasing`` plus ``-D__CUDA_ARCH__=<arch>0``; on x86-64 the assembly fiber switch is
linked in, elsewhere (or with ``fibers="ucontext"``) ``-DCUSIM_FIBERS_UCONTEXT``.

The shared library lands in the cache folder (``CUFLASH_SIM_CACHE_DIR``, default
``~/.cache/cuflash/sim``) under the SHA-256 of everything that determines it: the module text,
the runtime files, the compiler's identity and the flags. Writes are atomic (rename), so
concurrent processes may share the folder.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .. import _plan, _source
from .. import sim as _simopts
from . import lower

SIM_DIR = Path(__file__).resolve().parent
RUNTIME_FILES = ("cusim.h", "cusim_half.h", "cuda_fp16.h", "cuda_bf16.h", "cusim_switch_x86_64.S")
_FORMAT_VERSION = "cusim-1"
_ERROR_CAP = 2048
STACK_POISON_BYTES = 4096


class SimError(RuntimeError):
    """A kernel failed in the simulator (a trap, a strictness check, a deadlock, a limit)."""


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


def compile_flags(arch: int, asm_fibers: bool) -> list[str]:
    flags = ["-std=c++17", "-O2", "-g0", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
             "-fno-strict-aliasing", "-fno-math-errno", "-Wno-attributes",
             f"-I{SIM_DIR}", f"-D__CUDA_ARCH__={arch * 10}"]
    if not asm_fibers:
        flags.append("-DCUSIM_FIBERS_UCONTEXT=1")
    return flags


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
    body = lower.lower_shared(source, origin)
    stubs = [f'\n#line 1 "<cusim entry stubs>"\n']
    for e in entries:
        stubs.append(
            f"CUSIM_EXPORT int cusim_launch_{e}(::cusim::LaunchConfig* c, void** a) "
            f"{{ return ::cusim::launch(&{e}, c, a); }}\n"
            f"CUSIM_EXPORT int cusim_signature_{e}(char* k, uint32_t* s, int cap) "
            f"{{ return ::cusim::signature(&{e}, k, s, cap); }}\n"
        )
    return '#include "cusim.h"\n' + body + "".join(stubs)


_SCALAR_KINDS = {
    np.dtype(np.int32): ("i", 4), np.dtype(np.uint32): ("u", 4),
    np.dtype(np.int64): ("i", 8), np.dtype(np.uint64): ("u", 8),
    np.dtype(np.float32): ("f", 4), np.dtype(np.float64): ("f", 8),
}
_KIND_NAMES = {"p": "pointer", "i": "signed integer", "u": "unsigned integer", "f": "floating point", "s": "struct"}


class SimModule:
    """A compiled simulator module (one source text, several entries)."""

    def __init__(self, path: Path, entries: Sequence[str], arch: int, compile_seconds: float):
        self.path = path
        self.arch = arch
        self.compile_seconds = compile_seconds
        self._lib = ctypes.CDLL(str(path))
        self._launch = {}
        self.signatures: dict[str, tuple[tuple[str, int], ...]] = {}
        for e in entries:
            fn = getattr(self._lib, f"cusim_launch_{e}")
            fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._launch[e] = fn
            sig = getattr(self._lib, f"cusim_signature_{e}")
            sig.restype = ctypes.c_int
            kinds = ctypes.create_string_buffer(64)
            sizes = (ctypes.c_uint32 * 64)()
            n = sig(kinds, sizes, 64)
            self.signatures[e] = tuple((kinds.raw[i : i + 1].decode(), int(sizes[i])) for i in range(n))

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self._launch)

    def _marshal(self, plan) -> tuple[list, ctypes.Array]:
        sig = self.signatures[plan.entry]
        if len(sig) != len(plan.args):
            raise TypeError(f"{plan.entry}: the kernel takes {len(sig)} arguments, the plan gives {len(plan.args)}")
        keep: list = []
        for i, (a, (kind, size)) in enumerate(zip(plan.args, sig)):
            if isinstance(a, _plan.PointerArg):
                if not isinstance(a.base, np.ndarray):
                    raise TypeError(
                        f"{plan.entry}: argument {i} ({a.name}) must be a NumPy array for the simulator, "
                        f"got {type(a.base).__name__}"
                    )
                if a.writable and not a.base.flags.writeable:
                    raise ValueError(f"{plan.entry}: argument {i} ({a.name}) is written but its array is read-only")
                got = ("p", 8)
                keep.append(ctypes.c_void_p(a.address))
            else:
                got = _SCALAR_KINDS[np.dtype(type(a.value))]
                keep.append(np.ctypeslib.as_ctypes(np.array(a.value)))
            if got != (kind, size):
                raise TypeError(
                    f"{plan.entry}: argument {i} ({a.name}) is a {size}-byte {_KIND_NAMES.get(kind, kind)} in the "
                    f"kernel; the plan passes a {got[1]}-byte {_KIND_NAMES[got[0]]}"
                    + (f" ({type(a.value).__name__})" if isinstance(a, _plan.ScalarArg) else "")
                )
        argv = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(k) for k in keep])
        return keep, argv

    def launch(self, plan, options: _simopts.SimOptions | None = None) -> LaunchStats:
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
        """
        opts = options or _simopts.current_options()
        if plan.entry not in self._launch:
            raise KeyError(f"cuflash simulator: module has no entry {plan.entry!r} (has {', '.join(self._launch)})")
        cc = self.arch
        plan.check_device(cc)
        keep, argv = self._marshal(plan)
        err = ctypes.create_string_buffer(_ERROR_CAP)
        cfg = _Config()
        cfg.grid[:] = plan.grid
        cfg.block[:] = plan.block
        cfg.dynamic_smem = plan.shared_mem_bytes
        cfg.smem_limit = plan.smem_limit(cc)
        cfg.static_smem_limit = _plan.SMEM_DEFAULT_LIMIT
        cfg.max_threads = _plan.MAX_THREADS_PER_BLOCK
        cfg.workers = max(1, min(opts.workers or (os.cpu_count() or 1), plan.num_blocks))
        cfg.seed = opts.seed
        cfg.stack_size = opts.stack_kib * 1024
        cfg.stack_poison = min(STACK_POISON_BYTES, cfg.stack_size)
        cfg.error = ctypes.cast(err, ctypes.c_char_p)
        cfg.error_cap = _ERROR_CAP
        if plan.shared_mem_bytes > cfg.smem_limit:
            raise ValueError(
                f"{plan.entry}: {plan.shared_mem_bytes} bytes of dynamic shared memory exceed the {cfg.smem_limit}-byte "
                f"limit of sm_{cc}" + ("" if plan.needs_smem_opt_in else " without the opt-in")
            )
        t0 = time.perf_counter()
        rc = self._launch[plan.entry](ctypes.byref(cfg), ctypes.cast(argv, ctypes.c_void_p))
        dt = time.perf_counter() - t0
        del keep
        if rc != 0:
            msg = err.value.decode(errors="replace") or f"launch failed (code {rc})"
            raise SimError(f"cuflash simulator: {plan.entry} (sm_{cc}): {msg}")
        return LaunchStats(dt, int(cfg.blocks_run), plan.threads_per_block, int(cfg.context_switches),
                           int(cfg.static_smem_used), plan.shared_mem_bytes)


_modules: dict[str, SimModule] = {}
_locks: dict[str, threading.Lock] = {}
_global_lock = threading.Lock()


def load_source(
    source: str,
    entries: Iterable[str] | None = None,
    *,
    origin: str = "kernel.cu",
    options: _simopts.SimOptions | None = None,
) -> SimModule:
    """Compile (or fetch from the caches) the module for a full source text.

    Parameters
    ----------
    source : str
        Full source text (as built by :mod:`cuflash._source`).
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
    opts = options or _simopts.current_options()
    entries = tuple(entries) if entries is not None else tuple(lower.find_entries(source))
    if not entries:
        raise ValueError(f"cuflash simulator: no kernel entries in {origin}")
    asm = use_asm_fibers(opts.fibers)
    flags = compile_flags(opts.arch, asm)
    cxx, ident = compiler()
    text = module_text(source, entries, origin)
    key = hashlib.sha256(
        "\0".join([_FORMAT_VERSION, _runtime_hash(), ident, " ".join(flags), " ".join(entries), text]).encode()
    ).hexdigest()[:32]
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
        if not so.exists():
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=folder, prefix="build-") as tmp:
                cpp = Path(tmp) / f"{Path(origin).stem}.cpp"
                cpp.write_text(text, encoding="utf-8")
                out = Path(tmp) / "module.so"
                cmd = [cxx, *flags, str(cpp)]
                if asm:
                    cmd.append(str(SIM_DIR / "cusim_switch_x86_64.S"))
                cmd += ["-o", str(out)]
                r = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if r.returncode != 0:
                    raise RuntimeError(
                        f"cuflash simulator: g++ failed on {origin} (sm_{opts.arch}):\n{r.stderr[-6000:]}"
                    )
                os.replace(out, so)
            seconds = time.perf_counter() - t0
        mod = SimModule(so, entries, opts.arch, seconds)
        _modules[key] = mod
        return mod


def load_variant(variant, options: _simopts.SimOptions | None = None) -> SimModule:
    """The simulator module of a :class:`cuflash._variants.Variant`."""
    return load_source(_source.build_source(variant), (variant.entry,), origin=variant.source, options=options)


def precompile(variants: Iterable, options: _simopts.SimOptions | None = None, jobs: int | None = None) -> list:
    """Compile several variants in parallel (g++ runs in subprocesses); returns their modules."""
    opts = options or _simopts.current_options()
    variants = list(variants)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
        return list(ex.map(lambda v: load_variant(v, opts), variants))


def run(plan, options: _simopts.SimOptions | None = None) -> LaunchStats:
    """Compile (cached) and run a :class:`cuflash._plan.LaunchPlan` on the simulator."""
    opts = options or _simopts.current_options()
    return load_variant(plan.variant, opts).launch(plan, opts)
