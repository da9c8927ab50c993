"""The one pipeline every public entry point runs, from its arguments to a target.

Each public function builds one :class:`~cuflash.runtime.options.Options` from its flat
arguments and calls :func:`run` with its :class:`Entry`. The steps, the same for every entry:

0. **no framework state dropped**: a torch tensor that requires grad, or a JAX tracer, is refused
   (:func:`refuse_framework_state`; the public functions route those to the adapters first);
1. **host import**: CPU DLPack arrays (torch and JAX CPU tensors) become zero-copy NumPy views
   (:class:`~cuflash.runtime.interop.HostImport`), so validation and the NumPy path see NumPy;
2. **validation**, once, from metadata (the entry's ``validate``: an ``AttentionProblem``);
3. **the target**, from ``backend`` and the arrays' kind (:func:`resolve_backend`; it never
   moves data):

   * ``"numpy"``: the entry's NumPy implementation (:mod:`cuflash.reference`), results handed
     back as the caller's kind;
   * ``"cuda"`` and ``"sim"``: one :class:`~cuflash.runtime.device_call.DeviceCall` on a
     :class:`~cuflash.runtime.device_call.CudaDevice` or a :class:`~cuflash.sim.device.SimDevice`,
     and the entry's device steps (:func:`forward_on`, :func:`backward_on`, ...): import every
     array the kernels touch, check ``out=``, launch through the dispatcher, export. The
     simulator target runs this code exactly as a GPU call does.

:func:`explain_forward` takes steps 1-3 the same way and then asks the dispatcher what the device
steps would launch, without a device call (``cuflash.explain_varlen``, ``cuflash.explain_kvcache``).

Imports: :mod:`cuflash.kernels`, :mod:`cuflash.sim`, :mod:`cuflash.reference`, :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Callable

from cuflash.kernels import dispatch
from cuflash.runtime import device_call, dtypes, interop
from cuflash.runtime.options import Options

__all__ = ["Entry", "run", "refuse_framework_state", "resolve_backend", "env_backend", "check_kernel_dtype", "BACKENDS", "forward_on",
           "backward_on", "lse_pair", "explain_forward"]

BACKENDS = ("auto", "numpy", "sim", "cuda")


@dataclasses.dataclass(frozen=True)
class Entry:
    """The steps of one public function (see the module docstring).

    Attributes
    ----------
    func : str
        Its public name, for messages (``"cuflash.attention"``).
    names : tuple of str
        The operands' names, in the order the operand tuple holds them.
    validate : callable
        ``(operands, options, func) -> problem`` (metadata only; the problem has ``kind``,
        ``dtype``, ``device``).
    numpy : callable
        ``(problem, operands) -> tuple`` of NumPy results.
    device : callable
        ``(problem, operands, call) -> tuple`` of the caller's framework's results.
    result : callable
        ``(results, problem) -> what the public function returns``.
    out : int or None
        The index of the ``out=`` operand (``results[0]`` is the caller's buffer when given).
    like : int
        The operand whose framework the results take.
    """

    func: str
    names: tuple
    validate: Callable
    numpy: Callable
    device: Callable
    result: Callable
    out: int | None = None
    like: int = 0


def run(entry: Entry, operands: tuple, options: Options):
    """Run one call through the pipeline (the module docstring's steps)."""
    func = entry.func
    refuse_framework_state(func, entry.names, operands, options)
    host = interop.HostImport(func, entry.names, operands, options)
    problem = entry.validate(host.operands, host.options, func)
    backend = resolve_backend(options.backend, problem.kind, func)
    if backend == "numpy":
        return entry.result(host.export(entry.numpy(problem, host.operands), entry.out), problem)
    check_kernel_dtype(problem, backend)
    if backend == "sim":
        from cuflash.sim.device import SimDevice

        device = SimDevice()
    else:
        device = device_call.CudaDevice(func, int(problem.device[1]))
    out = None if entry.out is None else operands[entry.out]
    with device_call.DeviceCall(func, device, operands[entry.like], out=out) as call:
        return entry.result(entry.device(problem, operands, call), problem)


def refuse_framework_state(func: str, names: tuple, operands: tuple, options: Options) -> None:
    """No gradient or trace is dropped here: the pipeline computes on arrays that carry neither.

    ``cuflash.attention`` and the other public functions send torch tensors that require grad,
    and JAX tracers, to :mod:`cuflash.torch` / :mod:`cuflash.jax` before they reach the pipeline
    (:mod:`cuflash.autodiff`), and those adapters hand it detached tensors and concrete buffers.
    A call that reaches it any other way is refused rather than run without its gradient.

    Raises
    ------
    TypeError
        For a torch tensor that requires grad with grad mode on, or a JAX tracer, among the
        operands or the options' arrays.
    """
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    if torch is None and jax is None:
        return
    arrays = [(n, x) for n, x in zip(names, operands) if x is not None]
    arrays += [(n, x) for n, x, _ in options.arrays()]
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    for name, x in arrays:
        if torch is not None and isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise TypeError(f"{func}: {name} requires grad, and this function computes no gradient; call "
                            f"the function of the same name in cuflash (cuflash.attention routes such tensors "
                            f"through cuflash.torch's autograd) or in cuflash.torch, or detach the tensor")
        if tracer is not None and isinstance(x, tracer):
            raise TypeError(f"{func}: {name} is a JAX tracer (inside jax.jit, jax.grad or jax.vmap), which this "
                            f"function cannot compute on; call the function of the same name in cuflash or "
                            f"cuflash.jax")


def env_backend(func: str) -> str | None:
    """The backend the ``CUFLASH_BACKEND`` environment variable names (surrounding spaces and
    case ignored), or None when it is unset or empty.

    Raises
    ------
    ValueError
        For a value that names no backend.
    """
    raw = os.environ.get("CUFLASH_BACKEND", "")
    env = raw.strip().lower()
    if not env:
        return None
    if env not in BACKENDS:
        raise ValueError(
            f"{func}: environment variable CUFLASH_BACKEND must be one of {BACKENDS} (case and "
            f"surrounding spaces ignored), got {raw!r}"
        )
    return env


def resolve_backend(backend, kind: str, func: str) -> str:
    """The concrete backend (``"numpy"``, ``"sim"`` or ``"cuda"``) for arrays of ``kind``.

    ``"auto"`` never moves data: NumPy input runs the NumPy path, CuPy or CUDA DLPack input the
    CUDA kernels. The ``CUFLASH_BACKEND`` environment variable overrides only ``"auto"``; its
    value is read with surrounding spaces and case ignored (``" SIM"`` is ``"sim"``), while the
    ``backend`` argument must be spelled exactly.

    Raises
    ------
    ValueError
        For an unknown backend name (argument or environment variable), or a backend that would
        need the data moved between host and device (the message names the variable when the
        backend came from it).
    """
    if backend not in BACKENDS:
        raise ValueError(f"{func}: backend must be one of {BACKENDS}, got {backend!r}")
    origin = f"backend={backend!r}"
    if backend == "auto":
        env = env_backend(func)
        if env:
            backend = env
            origin = f"backend={env!r} (from the environment variable CUFLASH_BACKEND={os.environ['CUFLASH_BACKEND']!r})"
    if backend == "auto":
        return "numpy" if kind == "numpy" else "cuda"
    host = kind == "numpy"
    if backend in ("numpy", "sim") and not host:
        raise ValueError(
            f"{func}: {origin} computes on the host and takes NumPy arrays; got device "
            f"arrays ({kind}). Data is never moved implicitly: copy them to NumPy first, or use "
            f"backend='cuda'"
        )
    if backend == "cuda" and host:
        raise ValueError(
            f"{func}: {origin} needs GPU arrays (CuPy, or torch/JAX CUDA tensors); got NumPy "
            f"arrays. Data is never moved implicitly: move them with cupy.asarray first, or use "
            f"backend='numpy' or 'sim'"
        )
    return backend


def check_kernel_dtype(problem, backend: str) -> None:
    """The kernels compute float16, bfloat16 and float32; float64 is the NumPy path's alone.

    Raises
    ------
    NotImplementedError
        For float64 input on a kernel backend (``"sim"`` or ``"cuda"``).
    """
    if problem.dtype == dtypes.float64:
        raise NotImplementedError(
            f"{problem.func}: the kernels compute float16, bfloat16 and float32; float64 runs on the "
            f"NumPy path only (backend='numpy'), got backend={backend!r}"
        )


# --------------------------------------------------------------------------------------------
# the device steps (the CUDA and simulator targets)


def lse_pair(results, problem):
    """A forward's return value: ``out``, or ``(out, lse)`` with ``return_lse``."""
    return tuple(results) if problem.options.return_lse else results[0]


def forward_on(problem, operands, call) -> tuple:
    """A forward (fixed, packed or KV-cache: ``operands`` are ``(q, k, v, out)``, k and v the caches
    for a KV cache) on ``call``'s device: every array imported, ``out=`` checked against what the
    kernels read, the dispatcher's kernels launched, ``(out, lse)`` exported. fp8 q, k, v ask the
    dispatcher first, so a call no tier has an fp8 form for is refused before any array is
    imported."""
    q, k, v, out = operands
    if problem.fp8 is not None and problem.fp8.q_fp8:
        dispatch.forward_tier(problem, call.arch)
    qc, kc, vc = (call.import_array(x) for x in (q, k, v))
    problem = problem.on_device(call.import_array)
    c = problem.kvcache
    reads = {"q": qc, "k": kc, "v": vc} if c is None else {"q": qc, "k_cache": kc, "v_cache": vc}
    if c is not None:   # the append writes the caches while q and the new k, v are read
        for name, cache in (("k_cache", c.k_cache), ("v_cache", c.v_cache)):
            device_call.check_no_overlap(problem.func, cache, {"q": qc, "k": c.k_new, "v": c.v_new}, out_name=name)
    oc = None if out is None else call.output(out, problem.out_shape, problem.dtype, reads)
    o, lse = dispatch.run_forward(problem, qc, kc, vc, oc, call)
    return call.export(o, out=out), call.export(lse)


def backward_on(problem, operands, call) -> tuple:
    """A backward (fixed or packed: ``operands`` are ``(dout, q, k, v, out, lse)``) on ``call``'s
    device: every array imported, the dispatcher's backward launched, the gradients exported."""
    arrays = [call.import_array(x) for x in operands]
    grads = dispatch.run_backward(problem.on_device(call.import_array), *arrays, call)
    return tuple({n: call.export(x) for n, x in g.items()} if isinstance(g, dict) else call.export(g) for g in grads)


# --------------------------------------------------------------------------------------------
# planning without running (the explain functions)


def explain_forward(entry: Entry, operands: tuple, options: Options, arch, func: str, numpy_path: str) -> dict:
    """What :func:`run` would run for a forward ``entry`` (its operands ``(q, k, v, out)``, k and v
    the caches for a KV cache), without running it: steps 1-3 of the module docstring as
    :func:`run` takes them (the same validation, from metadata; the same backend rule), then the
    dispatcher's decisions (:func:`cuflash.kernels.dispatch.explain_forward`) for ``sm_<arch>``
    instead of a device call. Nothing is imported to a device, written or launched.

    ``arch`` None plans for the simulator's arch (``backend="sim"``) or the arrays' GPU; an
    ``arch`` with NumPy input on the NumPy path plans as the simulator would. ``numpy_path``
    describes the NumPy path when that is the answer. The result's keys are
    :func:`cuflash.explain`'s.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`run` would for the same call (``func`` named in the message).
    RuntimeError
        For GPU arrays with ``arch=None`` on a machine without a usable GPU.
    """
    host = interop.HostImport(func, entry.names, operands, options)
    problem = entry.validate(host.operands, host.options, func)
    chosen = resolve_backend(options.backend, problem.kind, func)
    if chosen == "numpy" and arch is not None:
        chosen = "sim"   # asking for an arch means asking what a device would run
    if chosen == "numpy":
        from cuflash.runtime import threads

        n = threads.num_threads()
        return {"backend": "numpy", "block_m": None, "block_n": None, "threads": n,
                "choice": f"NumPy path ({numpy_path}, {n} threads); pass arch=... or backend='sim' to see the "
                          "kernel a GPU would run"}
    check_kernel_dtype(problem, chosen)
    arch, sm_count = plan_arch(chosen, arch, problem, func)
    q, k, v, _ = host.operands
    arrays = (q, k, v) if problem.kind in ("numpy", "cupy") else None   # DLPack: shape-level checks only
    c = problem.kvcache
    if c is not None and arrays is not None:   # the append writes the caches while q and the new rows are read
        for name, cache in (("k_cache", k), ("v_cache", v)):
            device_call.check_no_overlap(func, cache, {"q": q, "k": c.k_new, "v": c.v_new}, out_name=name)
    return {"backend": chosen, "arch": arch, **dispatch.explain_forward(problem, arch, arrays, sm_count)}


def plan_arch(chosen: str, arch, problem, func: str) -> tuple:
    """``(arch, sm_count)`` an explain call plans for on backend ``chosen`` (``"sim"`` or
    ``"cuda"``): the given ``arch`` (the simulator's names for ``"sim"``, any compute capability
    otherwise), else the simulator's arch or the arrays' GPU; ``sm_count`` that GPU's, or the
    simulator's table's for its arches, else None.

    Raises
    ------
    ValueError
        For an ``arch`` that is not a compute capability (``func`` named in the message).
    RuntimeError
        For GPU arrays with ``arch=None`` on a machine without a usable GPU.
    """
    from cuflash import sim

    sm_count = None
    if arch is not None:
        arch = sim.parse_arch(arch, func) if chosen == "sim" else _parse_cc(arch, func)
    elif chosen == "sim":
        arch = sim.current_options().arch
    else:
        cupy = interop.require_cuda(func)
        dev = int(problem.device[1])
        arch = int(cupy.cuda.Device(dev).compute_capability)
        sm_count = device_call.cuda_sm_count(dev)
    if sm_count is None and arch in sim.ARCHS:
        sm_count = sim.sm_count(arch)   # the device the simulator's arch stands for
    return arch, sm_count


def _parse_cc(arch, func: str) -> int:
    """A compute capability from ``90``, ``"90"`` or ``"sm_90"`` (any arch: planning only)."""
    m = re.fullmatch(r"(?:sm_)?(\d+)", str(arch).strip())
    if isinstance(arch, bool) or m is None:
        raise ValueError(f"{func}: arch={arch!r} must be a compute capability such as 90 or 'sm_90'")
    return int(m.group(1))
