"""``python -m cuflash check``: the GPU self-check (docs/testing.md, "GPU checks").

One command for a machine with a GPU, runnable from a source tree with nothing installed
(``PYTHONPATH=. python -m cuflash check``). It runs these sections in this order, each timed
with its share of the time budget (``--budget``, default 170 s) and isolated (an exception or
an overrun fails that section only, the others still run); ``--sections`` picks a subset:

``device``       the device, compute capability, memory, CuPy / CUDA runtime and driver / NVRTC
                 versions, torch and JAX versions
``compile``      every kernel variant this arch may run, compiled and loaded (timed each)
``grid``         the forward on the GPU against the float64 oracle: dtypes, head dims 8..256
                 (incl. 40/72/96/160/192 and Dv != D), odd lengths, GQA/MQA, causal/windows,
                 empty rows and query tiles, layouts, strided/cache/broadcast views, large
                 logits, ``out=`` poisoned, LSE, non-finite input
``large``        S = 8192 (a spread of rows checked), batch*heads > 65535, element offsets past
                 2**31 (when memory allows)
``softmax``      ``cuflash.softmax`` on the GPU against the float64 softmax
``backward``     dq, dk, dv against the float64 gradients; with torch on CUDA, autograd through
                 ``cuflash.torch`` against torch's float64 autograd
``kvcache``      ``attention_with_kvcache`` (paged decode with append and rotary, split-KV,
                 device indices) against the NumPy path, caches byte-identical; a decode step
                 replayed from a CUDA graph
``fp8``          ``attention_with_kvcache`` over fp8 (float8_e4m3fn) caches with per-head descales
                 (paged decode with append, values near 448, split-KV) against the NumPy path,
                 caches byte-identical after the append; on compute capability 9.0, the fp8
                 forward (head dims 64, 128, 256, causal, a window, GQA) and its packed form
                 (attention_varlen with device indices) against the fp8 rule
``dropout``      the mask kernel's bits equal to the NumPy generator's; forward and backward
                 with dropout against the NumPy path on the same mask
``modifiers``    softcap, ALiBi, a broadcast bias, a boolean mask with fully masked rows and
                 tiles, sinks: forward and backward (with d attn_bias and d sinks)
``sim``          GPU output against the CUDA simulator's on the same small inputs
``turing``       (compute capability 8.0 and newer) the tensor-core tier's sm_75 (Turing) form
                 (two m16n8k8 per m16n8k16, register-staged copies) built for this GPU, whose
                 instructions it has: fp16 forward and backward against the float64 oracle. A
                 check of the T4 kernel's results only: its speed here says nothing about a T4's
``hopper``       (compute capability 9.0) the sm_90a probes of kernels_cu/hopper_probe.cu:
                 TMA-fed wgmma GEMMs for every swizzle and both B layouts, A from registers, the
                 e4m3 (fp8) wgmma, the warp-specialized pipeline, stmatrix, elect.sync; each exact,
                 and equal to the simulator's result
``torch``        torch CUDA round-trip (types, devices, torch-allocated outputs, side streams)
``distributed``  ring and Ulysses attention over NCCL with a world of one, equal to plain
                 attention, forward and gradients
``jax``          JAX GPU round-trip
``graph``        CUDA-graph capture of a call, replayed on new inputs
``demo``         the demo's GPU path on its embedded data

A section whose requirement is absent (torch, JAX, an sm_90 device) is skipped, saying why. A
short pass/fail table is printed last. Exit status: 0 all passed (or skipped), 1 a section
failed, 2 no usable GPU or invalid arguments (nothing is run and nothing is reported as passed).

The tolerance rule is docs/testing.md's, implemented here on its own: the error against the
float64 reference may be at most twice the error of a naive same-dtype implementation (scores
and output rounded to the dtype, float32 softmax) plus a floor (one unit roundoff for the 16-bit
types, 2**-18 for float32); with large logits, at least the float32 score-rounding bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
import traceback

import numpy as np

from cuflash import reference
from cuflash.analysis import cli
from cuflash.reference import tolerance

PROG = "python -m cuflash check"

#: seconds the whole check may take by default (under 3 minutes)
DEFAULT_BUDGET_S = 170.0

SECTIONS = ("device", "compile", "grid", "large", "softmax", "backward", "kvcache", "fp8", "dropout", "modifiers", "sim",
            "turing", "hopper", "torch", "distributed", "jax", "graph", "demo")

#: share of the budget each section may use at most (soft: sections stop between cases)
_SHARE = {"device": 0.05, "compile": 0.45, "grid": 0.35, "large": 0.25, "softmax": 0.1, "backward": 0.15, "kvcache": 0.1, "fp8": 0.1, "dropout": 0.1, "modifiers": 0.15, "sim": 0.3, "turing": 0.1, "hopper": 0.15,
          "torch": 0.1, "distributed": 0.1, "jax": 0.15, "graph": 0.1, "demo": 0.1}



class Skip(Exception):
    """A section (or case) that cannot run here, with the reason."""


@dataclasses.dataclass
class Result:
    section: str
    status: str  # "PASS", "FAIL", "SKIP"
    seconds: float
    detail: str


# --------------------------------------------------------------------------------------------
# the grid


def _dtype(name: str):
    from cuflash.runtime import dtypes

    return {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}[name]


def grid_cases() -> list[dict]:
    """The correctness grid: a covering design (every value of every axis appears, cycled at
    coprime strides so pairs mix), plus explicit edge cases. Small enough to run in seconds."""
    dtypes = ("f16", "bf16", "f32")
    dims = ((32, 32), (40, 40), (64, 64), (72, 72), (96, 96), (128, 128), (160, 160), (192, 192),
            (256, 256), (64, 32), (8, 8), (128, 256))
    lengths = ((1, 1), (17, 33), (128, 128), (127, 200), (200, 127), (255, 257), (64, 1000), (1, 513), (33, 17))
    heads = ((1, 1, 1), (2, 8, 2), (1, 4, 1), (3, 3, 3), (2, 6, 3))  # (B, Hq, Hk)
    masks = ((False, (-1, -1)), (True, (-1, -1)), (False, (32, 0)), (False, (16, 16)), (True, (64, -1)))
    layouts = ("bhsd", "bshd")
    views = ("contiguous", "cache", "padded", "broadcast")
    cases = []
    n = 48
    for i in range(n):
        (B, Hq, Hk), (sq, sk), (d, dv) = heads[(i * 3) % len(heads)], lengths[(i * 5) % len(lengths)], dims[i % len(dims)]
        causal, window = masks[(i * 7) % len(masks)]
        cases.append(dict(dtype=dtypes[i % 3], B=B, Hq=Hq, Hk=Hk, Sq=sq, Sk=sk, D=d, Dv=dv, causal=causal,
                          window=window, layout=layouts[(i // 3) % 2], view=views[(i * 11) % len(views)],
                          logits=1.0, lse=i % 2 == 0, poison=i % 4 == 1))
    for dt in dtypes:  # large logits: the online-softmax rescaling under stress
        cases.append(dict(dtype=dt, B=1, Hq=2, Hk=2, Sq=100, Sk=300, D=64, Dv=64, causal=False, window=(-1, -1),
                          layout="bhsd", view="contiguous", logits=12.0, lse=True, poison=False))
    cases.append(dict(dtype="f16", B=1, Hq=2, Hk=1, Sq=9, Sk=0, D=32, Dv=32, causal=False, window=(-1, -1),
                      layout="bhsd", view="contiguous", logits=1.0, lse=True, poison=True))  # no key at all
    cases.append(dict(dtype="bf16", B=2, Hq=4, Hk=2, Sq=300, Sk=40, D=96, Dv=96, causal=True, window=(-1, -1),
                      layout="bshd", view="contiguous", logits=1.0, lse=True, poison=True))  # many empty rows
    edge = dict(B=1, Hq=2, Hk=1, layout="bhsd", view="contiguous", logits=1.0, lse=True, poison=True)
    for dt, d in (("f16", 64), ("bf16", 128)):  # query tiles that see no key (tensor-core tier)
        cases.append(dict(edge, dtype=dt, Sq=146, Sk=1, D=d, Dv=d, causal=True, window=(-1, -1)))
        cases.append(dict(edge, dtype=dt, Sq=256, Sk=64, D=d, Dv=d, causal=False, window=(-1, 0)))
    for window in ((2**31 - 1, 2**31 - 1), (-1, 2**40)):  # flash-attn's "unbounded" and past 2^31
        cases.append(dict(edge, dtype="f16", Sq=200, Sk=120, D=64, Dv=64, causal=False, window=window))
    for name, causal in (("q", False), ("k", True), ("v", False)):  # non-finite input: the oracle's rows
        cases.append(dict(edge, dtype="bf16", Sq=150, Sk=130, D=64, Dv=64, causal=causal, window=(-1, -1),
                          nonfinite=name))
    return cases


def _case_name(c: dict) -> str:
    mask = "causal" if c["causal"] else ""
    if c["window"] != (-1, -1):
        mask += f"win{c['window']}"
    return (f"{c['dtype']} B{c['B']} H{c['Hq']}/{c['Hk']} S{c['Sq']}x{c['Sk']} D{c['D']}/{c['Dv']} "
            f"{mask or 'full'} {c['layout']} {c['view']}" + (f" logits*{c['logits']:g}" if c["logits"] != 1 else "")
            + (f" NaN in {c['nonfinite']}" if c.get("nonfinite") else ""))


def _host_inputs(c: dict, rng):
    dt = _dtype(c["dtype"])
    B, Hq, Hk, Sq, Sk, D, Dv = (c[x] for x in ("B", "Hq", "Hk", "Sq", "Sk", "D", "Dv"))
    q = (rng.standard_normal((B, Hq, Sq, D)) * c["logits"]).astype(dt)
    k = (rng.standard_normal((B, Hk, Sk, D)) * c["logits"]).astype(dt)
    v = rng.standard_normal((B, Hk, Sk, Dv)).astype(dt)
    if c["view"] == "broadcast":
        k = np.ascontiguousarray(np.broadcast_to(k[:1], k.shape))
        v = np.ascontiguousarray(np.broadcast_to(v[:1], v.shape))
    return q, k, v


def _to_device(cupy, c: dict, q, k, v):
    """Device arrays in the case's layout and view; each is a view, never a copy of the host
    layout (except for the transposition into "bshd" memory order)."""
    bshd = c["layout"] == "bshd"

    def place(x, pad_seq=0, pad_dim=0, poison_tail=False):
        B, H, S, D = x.shape
        shape = (B, S + pad_seq, H, D + pad_dim) if bshd else (B, H, S + pad_seq, D + pad_dim)
        buf = cupy.full(shape, np.nan if poison_tail else 0, dtype=x.dtype)
        host = x.transpose(0, 2, 1, 3) if bshd else x
        view = buf[:, :S, :, :D] if bshd else buf[:, :, :S, :D]
        view[...] = cupy.asarray(np.ascontiguousarray(host))
        return view

    view = c["view"]
    if view == "cache":  # K/V: views of a longer cache whose tail is NaN
        return place(q), place(k, pad_seq=37, poison_tail=True), place(v, pad_seq=37, poison_tail=True)
    if view == "padded":  # rows with a stride larger than the head dim
        return place(q, pad_dim=8), place(k, pad_dim=24), place(v, pad_dim=8)
    if view == "broadcast":  # stride-0 batch for K/V
        kd, vd = place(k[:1]), place(v[:1])
        return (place(q), cupy.broadcast_to(kd, (k.shape[0],) + kd.shape[1:]),
                cupy.broadcast_to(vd, (v.shape[0],) + vd.shape[1:]))
    return place(q), place(k), place(v)


def run_case(c: dict, rng, *, rows=None) -> tuple[bool, str]:
    """Run one grid case on the GPU and compare it with the oracle."""
    import cupy

    import cuflash

    q, k, v = _host_inputs(c, rng)
    if c.get("nonfinite"):  # one NaN: query row 37, or key/value row 60 (causal: rows >= 80 see it)
        {"q": q, "k": k, "v": v}[c["nonfinite"]][0, 0, 37 if c["nonfinite"] == "q" else 60, 3] = np.nan
    qd, kd, vd = _to_device(cupy, c, q, k, v)
    out = None
    if c["poison"]:
        shape = (c["B"], c["Sq"], c["Hq"], c["Dv"]) if c["layout"] == "bshd" else (c["B"], c["Hq"], c["Sq"], c["Dv"])
        out = cupy.full(shape, np.nan, dtype=q.dtype)
    res = cuflash.attention(qd, kd, vd, causal=c["causal"], window_size=c["window"], layout=c["layout"],
                            return_lse=c["lse"], out=out)
    o, lse = res if c["lse"] else (res, None)
    if out is not None and o is not out:
        return False, "out= was not returned"
    if not isinstance(o, cupy.ndarray) or o.dtype != q.dtype:
        return False, f"result is {type(o).__name__} {getattr(o, 'dtype', '?')}, expected cupy {q.dtype}"
    oh = cupy.asnumpy(o)
    if c["layout"] == "bshd":
        oh = oh.transpose(0, 2, 1, 3)
    lh = None if lse is None else cupy.asnumpy(lse)
    if lh is not None and lse.dtype != np.float32:
        return False, f"lse dtype {lse.dtype}, expected float32"
    if c.get("nonfinite"):  # docs/conventions.md: non-finite rows exactly where the float64 oracle's are
        from cuflash.reference import naive_attention

        o64, l64 = naive_attention(q, k, v, causal=c["causal"], window_size=c["window"], return_lse=True)
        want, got = ~np.isfinite(o64).all(-1), ~np.isfinite(oh.astype(np.float64)).all(-1)
        if not np.array_equal(got, want) or not np.array_equal(np.isnan(lh), np.isnan(l64)):
            return False, (f"non-finite rows differ from the oracle's: {int(got.sum())} rows vs {int(want.sum())} "
                           f"(lse NaN {int(np.isnan(lh).sum())} vs {int(np.isnan(l64).sum())})")
        return True, f"{int(want.sum())} non-finite rows, as the oracle"
    if rows is not None:
        oh, lh = oh[:, :, rows], (None if lh is None else lh[:, :, rows])
    ok, msg, _ = tolerance.compare(oh, q, k, v, causal=c["causal"], window_size=c["window"], rows=rows, lse=lh,
                         large_logits=c["logits"] > 4)
    return ok, msg


# --------------------------------------------------------------------------------------------
# sections: each returns a detail string, raises Skip, or raises AssertionError/other to fail


class _Clock:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def out(self) -> bool:
        return self.left() <= 0


def _device_info() -> dict:
    import cupy

    from cuflash.runtime.interop import device_name

    dev = cupy.cuda.Device()
    name = device_name(dev.id)
    free, total = cupy.cuda.runtime.memGetInfo()
    try:
        from cuflash.runtime import cuda_runner

        installed = ", ".join(lib.version_string for lib in cuda_runner.available_nvrtcs())
        nvrtc = f"{cuda_runner.default_nvrtc().version_string} (installed: {installed})"
    except Exception as exc:  # noqa: BLE001
        nvrtc = f"? ({exc})"
    return {"name": name, "id": dev.id, "arch": int(dev.compute_capability), "total_gib": total / 2**30,
            "free_gib": free / 2**30, "cupy": cupy.__version__, "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "driver": cupy.cuda.runtime.driverGetVersion(), "nvrtc": nvrtc}


def device_plan(name: str, arch: int) -> str:
    """What cuflash runs on the device ``name`` (as CUDA reports it) of compute capability
    ``arch``, and the roofline preset it compares with, in one line: the tier of a float16 and a
    bfloat16 forward and backward at head dim 128 (the dispatcher's choice, or its refusal, e.g.
    sm_70 without the ``cuda12`` extra), and ``python -m cuflash roofline --device KEY`` where a
    preset models this device (:func:`cuflash.analysis.roofline.preset_for`: T4, V100, A100,
    H100, H200). No device is touched: a faked description plans the same."""
    from cuflash.analysis import roofline
    from cuflash.kernels import dispatch
    from cuflash.runtime import dtypes, validation
    from cuflash.runtime.options import Options

    tiers = []
    for label, dt in (("float16", dtypes.float16), ("bfloat16", dtypes.bfloat16)):
        x = np.zeros((1, 1, 128, 128), dt)
        problem = validation.check_attention(x, x, x, Options())
        try:
            names = [dict((m, n) for n, m in table)[pick(problem, arch)] for table, pick in
                     ((dispatch.TIERS, dispatch.forward_tier), (dispatch.BACKWARD_TIERS, dispatch.backward_tier))]
        except NotImplementedError as e:
            tiers.append(f"{label}: no kernel ({str(e).split(': ', 1)[-1]})")
            continue
        tiers.append(f"{label}: forward on the {names[0]} tier, backward on the {names[1]} tier")
    preset = roofline.preset_for(name, arch)
    if preset is None:
        model = (f"no roofline preset models this device (presets: {', '.join(sorted(roofline.RATES))}); the "
                 "kernel figures of `python -m cuflash roofline` are per arch")
    else:
        dev = roofline.RATES[preset].device
        model = (f"roofline: python -m cuflash roofline --device {preset} ({dev.name}: {dev.fp16_tensor_tflops:g} "
                 f"TFLOP/s fp16 tensor, {dev.fp32_tflops:g} fp32, {dev.hbm_gb_per_s:g} GB/s; a model, not a "
                 "measurement)")
    return f"{name} (sm_{arch}): " + "; ".join(tiers) + "; " + model


def section_device(clock, log) -> str:
    info = _device_info()
    extra = []
    for mod in ("torch", "jax"):
        try:
            m = __import__(mod)
            extra.append(f"{mod} {m.__version__}")
        except Exception:  # noqa: BLE001
            extra.append(f"{mod} absent")
    log(f"device {info['id']}: {info['name']}, sm_{info['arch']}, {info['total_gib']:.1f} GiB "
        f"({info['free_gib']:.1f} free); CuPy {info['cupy']}, CUDA runtime {info['runtime']}, driver "
        f"{info['driver']}, NVRTC {info['nvrtc']}; {', '.join(extra)}; CUPY_CACHE_DIR="
        f"{os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
    log(device_plan(info["name"], info["arch"]))
    return f"{info['name']} sm_{info['arch']}, CuPy {info['cupy']}, NVRTC {info['nvrtc']}"


def section_compile(clock, log) -> str:
    import cupy

    from cuflash.kernels import catalog
    from cuflash.runtime import cuda_runner

    dev = cupy.cuda.Device()
    arch = int(dev.compute_capability)
    variants = catalog.variants_for_arch(arch)
    times = []
    failed = []
    for v in variants:
        if clock.out():
            raise AssertionError(f"out of time after {len(times)}/{len(variants)} variants")
        start = time.perf_counter()
        try:
            cuda_runner.get_module(v, dev.id).get_function(v.entry)
        except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
            failed.append(v.entry)
            log(f"  FAIL {v.entry}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        times.append((time.perf_counter() - start, v.entry))
        log(f"  {v.entry:<44} {times[-1][0]:6.2f} s")
    if failed:
        raise AssertionError(f"{len(failed)}/{len(variants)} variants failed: {', '.join(failed)}")
    slow = max(times)
    return f"{len(variants)} variants for sm_{arch} in {sum(t for t, _ in times):.1f} s (slowest {slow[1]} {slow[0]:.1f} s)"


def section_grid(clock, log) -> str:
    rng = np.random.default_rng(2024)
    cases = grid_cases()
    bad = []
    done = 0
    for c in cases:
        if clock.out():
            raise AssertionError(f"out of time after {done}/{len(cases)} cases; {len(bad)} failed")
        ok, msg = run_case(c, rng)
        done += 1
        if not ok:
            bad.append(_case_name(c))
            log(f"  FAIL {_case_name(c)}: {msg}")
    if bad:
        raise AssertionError(f"{len(bad)}/{len(cases)} cases failed (first: {bad[0]})")
    return f"{len(cases)} cases"


def _spread_rows(n: int, count: int) -> np.ndarray:
    return np.unique(np.concatenate([np.linspace(0, n - 1, count).astype(int), [0, 1, n - 2, n - 1]]).clip(0, n - 1))


def section_large(clock, log) -> str:
    import cupy

    import cuflash

    rng = np.random.default_rng(7)
    notes = []
    # S = 8192, checked on a spread of rows (the oracle of all rows would take minutes)
    for c in (dict(dtype="f16", B=1, Hq=4, Hk=1, Sq=8192, Sk=8192, D=128, Dv=128, causal=True, window=(-1, -1),
                   layout="bhsd", view="contiguous", logits=1.0, lse=True, poison=False),
              dict(dtype="bf16", B=1, Hq=2, Hk=2, Sq=8191, Sk=8192, D=64, Dv=64, causal=False, window=(-1, -1),
                   layout="bshd", view="contiguous", logits=1.0, lse=False, poison=True)):
        ok, msg = run_case(c, rng, rows=_spread_rows(c["Sq"], 40))
        log(f"  {_case_name(c)}: {msg}")
        if not ok:
            raise AssertionError(f"{_case_name(c)}: {msg}")
    notes.append("S=8192 ok")
    # batch * heads > 65535: the grid must not use gridDim.y/z for it
    H, S, D = 70000, 16, 32
    q = rng.standard_normal((1, H, S, D)).astype(np.float16)
    k = rng.standard_normal((1, H, S, D)).astype(np.float16)
    v = rng.standard_normal((1, H, S, D)).astype(np.float16)
    o = cupy.asnumpy(cuflash.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True))
    heads = np.array([0, 1, 65534, 65535, 65536, H - 1])
    ok, msg, _ = tolerance.compare(o[:, heads], q[:, heads], k[:, heads], v[:, heads], causal=True)
    log(f"  B*H={H} S={S} D={D} (heads {heads.tolist()} checked): {msg}")
    if not ok:
        raise AssertionError(f"B*H={H}: {msg}")
    notes.append(f"B*H={H} ok")
    del q, k, v, o
    if clock.out():
        raise AssertionError("out of time before the 2**31-offset case")
    # element offsets past 2**31 inside one tensor, and a view starting past 2**31 elements
    Hk, Sk, Dk = 128, 262153, 64  # Hk * Sk * Dk > 2**31
    n = Hk * Sk * Dk
    need = 2 * (2 * n + 2**20) * 2 * 1.1
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < need:
        notes.append(f"2**31 offsets skipped ({free / 2**30:.1f} GiB free, {need / 2**30:.1f} needed)")
        log(f"  {notes[-1]}")
        return "; ".join(notes)
    buf = cupy.empty(2 * n + 2**20, dtype=cupy.float16)
    gen = cupy.random.default_rng(3)
    step = 2**27
    for start in range(0, buf.size, step):
        stop = min(start + step, buf.size)
        buf[start:stop] = gen.standard_normal(stop - start, dtype=cupy.float32).astype(cupy.float16)
    kd = buf[:n].reshape(1, Hk, Sk, Dk)
    vd = buf[n + 2**20:].reshape(1, Hk, Sk, Dk)  # starts past 2**31 elements into the buffer
    qd = cupy.asarray(rng.standard_normal((1, Hk, 16, Dk)).astype(np.float16))
    od, lse = cuflash.attention(qd, kd, vd, return_lse=True)
    check = [0, Hk // 2, Hk - 1]
    oh, lh, qh = cupy.asnumpy(od)[:, check], cupy.asnumpy(lse)[:, check], cupy.asnumpy(qd)[:, check]
    kh = cupy.asnumpy(kd[:, check])
    vh = cupy.asnumpy(vd[:, check])
    ok, msg, _ = tolerance.compare(oh, qh, kh, vh, lse=lh)
    log(f"  K/V {Hk}x{Sk}x{Dk} fp16 (offsets up to {n + 2**20 + n:,} elements; heads {check}): {msg}")
    del buf, kd, vd
    cupy.get_default_memory_pool().free_all_blocks()
    if not ok:
        raise AssertionError(f"2**31 offsets: {msg}")
    notes.append("offsets > 2**31 ok")
    return "; ".join(notes)


def section_softmax(clock, log) -> str:
    import cupy

    import cuflash
    from cuflash.runtime import dtypes

    rng = np.random.default_rng(5)
    worst = 0.0
    for dt in (dtypes.float16, dtypes.bfloat16, dtypes.float32):
        for shape, axis in (((7, 4097), -1), ((33, 100), -1), ((5, 64, 3), 1), ((1, 1), -1)):
            x = (rng.standard_normal(shape) * 4).astype(dt)
            y = cuflash.softmax(cupy.asarray(x), axis=axis)
            if not isinstance(y, cupy.ndarray) or y.dtype != dt or y.shape != x.shape:
                raise AssertionError(f"softmax {dt} {shape}: got {type(y).__name__} {y.dtype} {y.shape}")
            ref = cuflash.reference.softmax(x.astype(np.float64), axis=axis)
            err = float(np.abs(cupy.asnumpy(y).astype(np.float64) - ref).max())
            tol = 2 * float(np.abs(ref.astype(dt).astype(np.float64) - ref).max()) + tolerance.floor_for(dt)
            worst = max(worst, err / tol)
            if err > tol:
                raise AssertionError(f"softmax {dt} {shape} axis={axis}: error {err:.3g} > {tol:.3g}")
    return f"12 cases, worst error {worst:.2f} of the bound"


def section_backward(clock, log) -> str:
    """dq, dk, dv on the GPU against the float64 gradients; the bound is twice the error of the
    NumPy tiled backward on the same low-precision inputs (the same algorithm, float32
    accumulation) plus a floor at the gradient's scale. With torch on CUDA, also autograd end to
    end through cuflash.torch against torch's own float64 autograd of the same attention."""
    import cupy

    import cuflash

    rng = np.random.default_rng(13)
    cases = [dict(dtype="f16", B=1, Hq=8, Hk=2, Sq=257, Sk=300, D=64, Dv=64, causal=True, window=(-1, -1)),
             dict(dtype="bf16", B=2, Hq=4, Hk=4, Sq=130, Sk=130, D=128, Dv=128, causal=False, window=(33, 7)),
             dict(dtype="f32", B=1, Hq=7, Hk=1, Sq=97, Sk=61, D=40, Dv=72, causal=True, window=(-1, -1)),
             # the tensor-core backward's 64 x 64 buckets (192, 256) and several query tiles per key tile
             dict(dtype="bf16", B=1, Hq=4, Hk=2, Sq=300, Sk=200, D=256, Dv=256, causal=True, window=(-1, -1)),
             dict(dtype="f16", B=2, Hq=2, Hk=1, Sq=150, Sk=333, D=176, Dv=128, causal=False, window=(40, 40)),
             dict(dtype="bf16", B=1, Hq=2, Hk=2, Sq=520, Sk=520, D=128, Dv=128, causal=True, window=(-1, -1),
                  deterministic=True)]
    worst = 0.0
    for c in cases:
        if clock.out():
            raise AssertionError("out of time")
        c = dict(c, layout="bhsd", view="contiguous", logits=1.0)
        q, k, v = _host_inputs(c, rng)
        kw = dict(causal=c["causal"], window_size=c["window"])
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)  # the NumPy forward
        dout = rng.standard_normal(out.shape).astype(q.dtype)
        dev = [cupy.asarray(x) for x in (dout, q, k, v, out, lse)]
        det = bool(c.get("deterministic"))
        grads = [cupy.asnumpy(g) for g in cuflash.attention_backward(*dev, deterministic=det, **kw)]
        if det:   # bit-identical on a second run
            again = [cupy.asnumpy(g) for g in cuflash.attention_backward(*dev, deterministic=True, **kw)]
            if not all(a.tobytes() == b.tobytes() for a, b in zip(grads, again)):
                raise AssertionError(f"{_case_name(c)}: deterministic=True gave different bits on a second run")
        cpu = cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw)
        x64 = [x.astype(np.float64) for x in (dout, q, k, v)]
        o64, l64 = reference.naive_attention(*x64[1:], return_lse=True, **kw)
        exact = reference.attention_backward(x64[0], *x64[1:], o64, l64, **kw)
        for name, g, gc, ge in zip(("dq", "dk", "dv"), grads, cpu, exact):
            worst = max(worst, _held_to_rule(f"{_case_name(c)} {name}", g, gc, ge, q.dtype))
        log(f"  backward {_case_name(c)}: ok")
    worst = max(worst, _check_varlen(cupy, rng, log))
    note = (f"{len(cases)} cases (head dims to 256, one deterministic, bit-identical twice) and a packed "
            f"variable-length batch (device indices), worst error {worst:.2f} of the bound")
    try:
        import torch
    except ImportError:
        return note + "; torch not installed"
    if not torch.cuda.is_available():
        return note + "; torch without CUDA"
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 4, 65, 64, device="cuda", generator=g, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 2, 90, 64, device="cuda", generator=g, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 2, 90, 64, device="cuda", generator=g, dtype=torch.float16, requires_grad=True)
    w = torch.randn(2, 4, 65, 64, device="cuda", generator=g, dtype=torch.float16)
    (ct.attention(q, k, v, causal=True) * w).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = qd @ kd.repeat_interleave(2, dim=1).transpose(-1, -2) / 8.0
    i = torch.arange(65, device="cuda")[:, None]
    j = torch.arange(90, device="cuda")[None, :]
    s = s.masked_fill(j > i + 90 - 65, float("-inf"))  # bottom-right causal, built explicitly
    ((torch.softmax(s, -1) @ vd.repeat_interleave(2, dim=1)) * w.double()).sum().backward()
    for name, a, b in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        err = float((a.double() - b).abs().max())
        if not err <= 2e-2 * max(1.0, float(b.abs().max())):
            raise AssertionError(f"torch autograd {name}: error {err:.3g} against float64 autograd")
    return note + "; torch autograd (fp16, GQA, causal) matches float64 autograd"


def _held_to_rule(what: str, got, numpy_ref, exact, dtype) -> float:
    """The GPU result ``got`` (host array) against the float64 ``exact``: its max error may be at
    most twice the NumPy path's (``numpy_ref``) plus the dtype's floor at the result's scale.
    Returns the error as a fraction of that bound; raises AssertionError (naming ``what``) beyond
    it or on a non-finite value."""
    got = np.asarray(got, dtype=np.float64)
    err = float(np.abs(got - exact).max(initial=0.0))
    tol = 2 * float(np.abs(np.asarray(numpy_ref, np.float64) - exact).max(initial=0.0)) + \
        tolerance.floor_for(dtype) * max(1.0, float(np.abs(exact).max(initial=0.0)))
    if not np.isfinite(got).all() or err > tol:
        raise AssertionError(f"{what}: error {err:.3g} > {tol:.3g}")
    return err / tol


def _check_varlen(cupy, rng, log) -> float:
    """cuflash.attention_varlen and its backward on the GPU with device-resident indices (the
    path the host cannot check), against the NumPy path on the same inputs; the bound is twice
    the NumPy path's error against float64 plus the floor, per output. Returns the worst ratio."""
    import cuflash

    lengths = [(70, 90), (0, 5), (1, 1), (300, 256), (17, 0)]
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lengths])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lengths])]).astype(np.int32)
    used = np.array([90, 3, 1, 200, 0], np.int32)
    dt = _dtype("bf16")
    q = rng.standard_normal((int(cq[-1]), 8, 128)).astype(dt)
    k = rng.standard_normal((int(ck[-1]), 2, 128)).astype(dt)
    v = rng.standard_normal((int(ck[-1]), 2, 128)).astype(dt)
    kw = dict(causal=True, seqused_k=used)
    mq, mk = max(a for a, _ in lengths), max(b for _, b in lengths)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    o64, l64 = cuflash.attention_varlen(*x64, cq, ck, mq, mk, return_lse=True, **kw)
    o_np, l_np = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **kw)
    dev = [cupy.asarray(x) for x in (q, k, v, cq, ck)]
    o, l_ = cuflash.attention_varlen(*dev[:3], dev[3], dev[4], mq, mk, return_lse=True, causal=True,
                                     seqused_k=cupy.asarray(used))
    dout = rng.standard_normal(o_np.shape).astype(dt)
    g64 = cuflash.attention_varlen_backward(dout.astype(np.float64), *x64, o64, l64, cq, ck, mq, mk, **kw)
    g_np = cuflash.attention_varlen_backward(dout, q, k, v, o_np, l_np, cq, ck, mq, mk, **kw)
    g = cuflash.attention_varlen_backward(cupy.asarray(dout), *dev[:3], cupy.asarray(o_np), cupy.asarray(l_np),
                                          dev[3], dev[4], mq, mk, causal=True, seqused_k=cupy.asarray(used))
    worst = 0.0
    for name, a, ref_np, exact in (("out", o, o_np, o64), ("dq", g[0], g_np[0], g64[0]), ("dk", g[1], g_np[1], g64[1]),
                                   ("dv", g[2], g_np[2], g64[2])):
        worst = max(worst, _held_to_rule(f"attention_varlen {name}", cupy.asnumpy(a), ref_np, exact, q.dtype))
    if not np.array_equal(np.isneginf(cupy.asnumpy(l_)), np.isneginf(l64)):
        raise AssertionError("attention_varlen: rows without keys differ from the oracle's (lse -inf)")
    log("  backward attention_varlen (5 sequences, device indices, seqused_k): ok")
    return worst


def _kvcache_inputs(rng, lengths, page, hq, hk, d, snew, sq=1):
    """A paged bf16 cache (NaN in every row the call must not read), new rows and rotary tables."""
    dt = _dtype("bf16")
    per_seq = [-(-(n + snew) // page) for n in lengths]
    num_pages = sum(per_seq) + 3
    ids = rng.permutation(num_pages).astype(np.int32)
    bt = np.full((len(lengths), max(per_seq) + 1), -1, np.int32)
    at = 0
    for b, n in enumerate(per_seq):
        bt[b, :n], at = ids[at:at + n], at + n
    kc = np.full((num_pages, page, hk, d), np.nan, dt)
    vc = np.full((num_pages, page, hk, d), np.nan, dt)
    for b, n in enumerate(lengths):
        p = np.arange(n)
        kc[bt[b, p // page], p % page] = rng.standard_normal((n, hk, d))
        vc[bt[b, p // page], p % page] = rng.standard_normal((n, hk, d))
    angle = np.outer(np.arange(max(lengths) + snew + sq), 1.0 / 10000 ** (np.arange(0, d // 2) / (d // 2)))
    kw = dict(k=rng.standard_normal((len(lengths), snew, hk, d)).astype(dt),
              v=rng.standard_normal((len(lengths), snew, hk, d)).astype(dt), block_table=bt,
              rotary_cos=np.cos(angle).astype(np.float32), rotary_sin=np.sin(angle).astype(np.float32))
    q = rng.standard_normal((len(lengths), sq, hq, d)).astype(dt)
    return q, kc, vc, np.array(lengths, np.int32), kw


def section_kvcache(clock, log) -> str:
    """attention_with_kvcache on the GPU (paged decode with append and rotary, split-KV, device
    indices) against the NumPy path on the same inputs: outputs within twice the NumPy path's
    error against float64 plus the floor, the caches identical byte for byte; a decode step
    captured in a CUDA graph and replayed."""
    import cupy

    import cuflash

    rng = np.random.default_rng(23)
    worst = 0.0
    for lengths, page, hq, hk, d, snew, sq, splits in (([1, 300, 0, 77], 16, 32, 8, 128, 1, 1, 0),
                                                         ([5, 1000], 3, 8, 1, 64, 2, 7, 3),
                                                         ([2000], 16, 16, 2, 256, 1, 1, 8)):
        if clock.out():
            break
        q, kc, vc, seqlens, kw = _kvcache_inputs(rng, lengths, page, hq, hk, d, snew, sq)
        host = {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
        k64, v64 = kc.astype(np.float64), vc.astype(np.float64)
        kc_np, vc_np = kc.copy(), vc.copy()
        o_np, l_np = cuflash.attention_with_kvcache(q, kc_np, vc_np, seqlens, causal=True, return_lse=True, **host)
        hk64 = {n: (x.astype(np.float64) if n in ("k", "v", "rotary_cos", "rotary_sin") else x) for n, x in kw.items()}
        o64, _ = cuflash.attention_with_kvcache(q.astype(np.float64), k64, v64, seqlens, causal=True, return_lse=True,
                                                **hk64)
        dev = {n: cupy.asarray(x) for n, x in kw.items()}
        kc_d, vc_d = cupy.asarray(kc), cupy.asarray(vc)
        o, l_ = cuflash.attention_with_kvcache(cupy.asarray(q), kc_d, vc_d, cupy.asarray(seqlens), causal=True,
                                               num_splits=splits, return_lse=True, **dev)
        ratio = _held_to_rule(f"attention_with_kvcache {lengths}, page {page}", cupy.asnumpy(o), o_np, o64, q.dtype)
        if cupy.asnumpy(kc_d).tobytes() != kc_np.tobytes() or cupy.asnumpy(vc_d).tobytes() != vc_np.tobytes():
            raise AssertionError(f"attention_with_kvcache {lengths}, page {page}: the GPU's cache differs from the "
                                 "NumPy path's after the append")
        worst = max(worst, ratio)
        log(f"  kvcache B={len(lengths)} page {page} Hq/Hk {hq}/{hk} d{d} Sq {sq} splits {splits}: "
            f"{ratio:.2f} of the bound, caches identical")
    # a decode step (split-KV, append, rotary) captured in a CUDA graph: no host synchronization
    q, kc, vc, seqlens, kw = _kvcache_inputs(rng, [700, 20], 16, 8, 2, 128, 1)
    dev = {n: cupy.asarray(x) for n, x in kw.items()}
    qd, sl = cupy.asarray(q), cupy.asarray(seqlens)
    out = cupy.empty(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        base_k, base_v = cupy.asarray(kc), cupy.asarray(vc)
        kc_d, vc_d = base_k.copy(), base_v.copy()
        cuflash.attention_with_kvcache(qd, kc_d, vc_d, sl, causal=True, num_splits=4, out=out, **dev)  # warm
        stream.synchronize()
        kc_d[...], vc_d[...] = base_k, base_v
        stream.begin_capture()
        cuflash.attention_with_kvcache(qd, kc_d, vc_d, sl, causal=True, num_splits=4, out=out, **dev)
        graph = stream.end_capture()
        kc_d[...], vc_d[...] = base_k, base_v
        out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        got = out.copy()
        k2, v2 = base_k.copy(), base_v.copy()
        want = cuflash.attention_with_kvcache(qd, k2, v2, sl, causal=True, num_splits=4, **dev)
        stream.synchronize()
    if not bool(cupy.array_equal(got, want)) or not bool(cupy.array_equal(kc_d, k2)):
        raise AssertionError("a captured decode step replays differently from a direct call")
    return f"3 paged decode/prefill cases within the rule (worst {worst:.2f} of the bound); CUDA-graph replay identical"


#: the fp8 section's cases: (cache lengths, page size, Hq, Hk, head dim, new rows, key splits)
FP8_CASES = (([1, 300, 0, 77], 16, 32, 8, 128, 1, 0), ([5, 1000], 3, 8, 1, 64, 2, 3))


def fp8_kvcache_case(rng, case, device_call) -> tuple[str, float]:
    """One fp8 KV-cache case: bf16 q and new rows over e4m3 caches (values up to +-448, NaN in every
    row the call must not read, per-(sequence, kv head) descales), run by ``device_call(q, kc, vc,
    seqlens, kw)`` (returns the output and both caches after the append, on the host) and by the
    NumPy path. The caches must be byte-identical; the output is held to twice the NumPy path's
    error against the float64 attention of the dequantized cache, plus the floor. Returns a label
    and the error as a fraction of the bound."""
    import ml_dtypes

    import cuflash

    lengths, page, hq, hk, d, snew, splits = case
    q, kc, vc, seqlens, kw = _kvcache_inputs(rng, lengths, page, hq, hk, d, snew)
    kw.pop("rotary_cos"), kw.pop("rotary_sin")
    kc8, vc8 = (np.clip(c.astype(np.float32) * 60, -448, 448).astype(ml_dtypes.float8_e4m3fn) for c in (kc, vc))
    kd = rng.uniform(1 / 90, 1 / 30, (len(lengths), hk)).astype(np.float32)
    vd = rng.uniform(1 / 90, 1 / 30, (len(lengths), hk)).astype(np.float32)
    kw.update(k_descale=kd, v_descale=vd, num_splits=splits)
    what = f"fp8 cache {lengths}, page {page}, Hq/Hk {hq}/{hk} d{d}"
    kc_np, vc_np = kc8.copy(), vc8.copy()
    o_np = cuflash.attention_with_kvcache(q, kc_np, vc_np, seqlens, causal=True, **kw)
    # the float64 oracle over the cache the append left, dequantized page by page (a page belongs to
    # one sequence), the new rows now part of it
    bt = kw["block_table"]
    k64, v64 = kc_np.astype(np.float64), vc_np.astype(np.float64)
    for b, n in enumerate(seqlens + snew):
        pages = bt[b, :-(-int(n) // page)]
        k64[pages] *= kd[b][None, None, :, None]
        v64[pages] *= vd[b][None, None, :, None]
    o64 = cuflash.attention_with_kvcache(q.astype(np.float64), k64, v64, seqlens + snew, causal=True, block_table=bt)
    got, kc_dev, vc_dev = device_call(q, kc8, vc8, seqlens, kw)
    if kc_dev.view(np.uint8).tobytes() != kc_np.view(np.uint8).tobytes() or \
            vc_dev.view(np.uint8).tobytes() != vc_np.view(np.uint8).tobytes():
        raise AssertionError(f"{what}: the device's fp8 cache differs from the NumPy path's after the append")
    return what, _held_to_rule(what, got, o_np, o64, q.dtype)


#: the fp8 forward's cases: (B, Hq, Hk, Sq, Sk, head dim, causal, window_size)
FP8_FORWARD_CASES = ((2, 16, 4, 1000, 1000, 128, True, (-1, -1)), (1, 8, 8, 300, 2100, 256, False, (-1, -1)),
                     (2, 8, 2, 777, 500, 64, True, (256, -1)))


def fp8_forward_case(rng, case, device_call) -> tuple[str, float]:
    """One fp8 forward case: float8_e4m3fn q, k, v (values up to +-448) with per-(batch, kv head)
    descales, run by ``device_call(q, k, v, kw)`` (returns the output and its lse on the host, and
    the name of the kernel that ran) and held to the fp8 rule of
    :mod:`cuflash.reference.tolerance` (the float64 attention of the descaled values; the bound
    from a float32 baseline that rounds P to e4m3, as the kernel must). Returns a label and the
    error as a fraction of the bound; raises AssertionError (naming the case) beyond it."""
    import ml_dtypes

    b, hq, hk, sq, sk, d, causal, window = case
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k = (np.clip(rng.standard_normal((b, h, s, d)) * 3, -448, 448).astype(e4m3) for h, s in ((hq, sq), (hk, sk)))
    v = np.clip(rng.standard_normal((b, hk, sk, d)) * 60, -448, 448).astype(e4m3)
    kw = dict(causal=causal, window_size=window, q_descale=rng.uniform(0.02, 0.08, (b, hk)).astype(np.float32),
              k_descale=rng.uniform(0.02, 0.08, (b, hk)).astype(np.float32),
              v_descale=rng.uniform(0.25, 4.0, (b, hk)).astype(np.float32))
    what = f"fp8 forward B {b}, Hq/Hk {hq}/{hk}, Sq {sq}, Sk {sk}, d{d}" + (", causal" if causal else "") + (
        f", window {window}" if window != (-1, -1) else "")
    out, lse, entry = device_call(q, k, v, kw)
    verdict = tolerance.judge(np.asarray(out, np.float64), q, k, v, lse=lse, **kw)
    if not verdict.ok:
        raise AssertionError(f"{what} ({entry}): {verdict.message}")
    return f"{what} ({entry})", verdict.error / verdict.bound


#: the packed fp8 forward's cases: (sequences' (query, key) lengths, Hq, Hk, head dim, causal)
FP8_PACKED_CASES = ((((700, 900), (0, 50), (1, 1), (300, 2000), (129, 64)), 16, 4, 128, True),
                    (((64, 700), (513, 100), (0, 0), (77, 333)), 8, 8, 256, False),
                    (((1000, 1000), (5, 7), (200, 40)), 8, 2, 64, True))


def fp8_packed_case(rng, case, device_call) -> tuple[str, float]:
    """One packed fp8 forward case (``attention_varlen``): float8_e4m3fn q, k, v (values up to
    +-448) of sequences of the case's lengths, descales per (sequence, kv head), run by
    ``device_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw)`` (returns
    the output and its lse ``(Hq, total_q)`` on the host, and the kernel's name); each sequence
    held to the fp8 rule of a fixed-shape call on its slices with its descale row. Returns a label
    and the worst sequence's error as a fraction of its bound; raises AssertionError (naming the
    case and sequence) beyond it."""
    import ml_dtypes

    lengths, hq, hk, d, causal = case
    e4m3 = ml_dtypes.float8_e4m3fn
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lengths])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lengths])]).astype(np.int32)
    q, k = (np.clip(rng.standard_normal((int(n), h, d)) * 3, -448, 448).astype(e4m3) for n, h in ((cq[-1], hq), (ck[-1], hk)))
    v = np.clip(rng.standard_normal((int(ck[-1]), hk, d)) * 60, -448, 448).astype(e4m3)
    nb = len(lengths)
    kw = dict(causal=causal, q_descale=rng.uniform(0.02, 0.08, (nb, hk)).astype(np.float32),
              k_descale=rng.uniform(0.02, 0.08, (nb, hk)).astype(np.float32),
              v_descale=rng.uniform(0.25, 4.0, (nb, hk)).astype(np.float32))
    what = f"fp8 packed forward {nb} sequences, Hq/Hk {hq}/{hk}, d{d}" + (", causal" if causal else "")
    out, lse, entry = device_call(q, k, v, cq, ck, max(a for a, _ in lengths), max(b for _, b in lengths), kw)
    worst = 0.0
    for b in range(nb):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.stop == rq.start:
            continue
        row = {n: (x[b:b + 1] if n.endswith("descale") else x) for n, x in kw.items()}
        verdict = tolerance.judge(np.asarray(out[rq], np.float64)[None], q[None, rq], k[None, rk], v[None, rk],
                                  lse=np.ascontiguousarray(lse[None, :, rq]), layout="bshd", **row)
        if not verdict.ok:
            raise AssertionError(f"{what} ({entry}), sequence {b}: {verdict.message}")
        worst = max(worst, verdict.error / verdict.bound)
    return f"{what} ({entry})", worst


def _run_cases(clock, log, cases, run_one, tail) -> tuple[int, float]:
    """Run ``run_one(case)`` (returns a label and an error as a fraction of its bound) for each case
    until ``clock`` runs out, logging ``label + tail(case).format(ratio)``; returns how many ran and
    the worst fraction."""
    done, worst = 0, 0.0
    for case in cases:
        if clock.out():
            break
        what, ratio = run_one(case)
        done, worst = done + 1, max(worst, ratio)
        log(f"  {what}" + tail(case).format(ratio))
    return done, worst


def section_fp8(clock, log) -> str:
    """attention_with_kvcache over fp8 caches on the GPU (the tensor-core KV-cache kernel's
    fp8-cache form) against the NumPy path (:func:`fp8_kvcache_case`); on compute capability 9.0,
    also the fp8 forward (the Hopper forward's e4m3 form) against the fp8 rule
    (:func:`fp8_forward_case`)."""
    import cupy

    import cuflash
    from cuflash.runtime.interop import fp8_view

    def on_gpu(q, kc8, vc8, seqlens, kw):
        kb, vb = cupy.asarray(kc8.view(np.uint8)), cupy.asarray(vc8.view(np.uint8))
        dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
        o = cuflash.attention_with_kvcache(cupy.asarray(q), fp8_view(kb), fp8_view(vb), cupy.asarray(seqlens),
                                           causal=True, **dev)
        return cupy.asnumpy(o), cupy.asnumpy(kb), cupy.asnumpy(vb)

    rng = np.random.default_rng(31)
    done, worst = _run_cases(clock, log, FP8_CASES, lambda case: fp8_kvcache_case(rng, case, on_gpu),
                             lambda case: f" splits {case[-1]}: {{:.2f}} of the bound, caches identical")
    summary = f"{done} fp8 paged decode cases within the rule (worst {worst:.2f} of the bound), caches identical"
    if int(cupy.cuda.Device().compute_capability) != 90:
        return summary + "; the fp8 forward runs on compute capability 9.0 only (not run here)"

    def forward_on_gpu(q, k, v, kw):
        dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
        q8, k8, v8 = (fp8_view(cupy.asarray(x.view(np.uint8))) for x in (q, k, v))
        entry = cuflash.explain(q8, k8, v8, **dev)["entry"]
        o, lse = cuflash.attention(q8, k8, v8, return_lse=True, **dev)
        return cupy.asnumpy(o), cupy.asnumpy(lse), entry

    fdone, fworst = _run_cases(clock, log, FP8_FORWARD_CASES, lambda case: fp8_forward_case(rng, case, forward_on_gpu),
                               lambda case: ": {:.2f} of the bound")

    def packed_on_gpu(q, k, v, cq, ck, mq, mk, kw):
        dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
        q8, k8, v8 = (fp8_view(cupy.asarray(x.view(np.uint8))) for x in (q, k, v))
        cqd, ckd = cupy.asarray(cq), cupy.asarray(ck)
        entry = cuflash.explain_varlen(q8, k8, v8, cqd, ckd, mq, mk, **dev)["entry"]
        o, lse = cuflash.attention_varlen(q8, k8, v8, cqd, ckd, mq, mk, return_lse=True, **dev)
        return cupy.asnumpy(o), cupy.asnumpy(lse), entry

    pdone, pworst = _run_cases(clock, log, FP8_PACKED_CASES, lambda case: fp8_packed_case(rng, case, packed_on_gpu),
                               lambda case: ": {:.2f} of the bound (worst sequence)")
    return summary + (f"; {fdone} fp8 forward cases within the rule (worst {fworst:.2f} of the bound); {pdone} packed "
                      f"fp8 cases (worst {pworst:.2f})")


def section_dropout(clock, log) -> str:
    """Dropout on the GPU: the mask kernel's bits equal the NumPy generator's; the forward and the
    backward with dropout within the rule of the NumPy path's error against float64 (the same mask)."""
    import cupy

    import cuflash
    from cuflash.kernels import dropout_mask as dm
    from cuflash.reference import dropout as rd
    from cuflash.runtime import cuda_runner

    shape, p, seed, offset = (2, 8, 300, 517), 0.2, 2024, 11
    keep = cupy.zeros(shape, np.uint8)
    cuda_runner.launch(dm.plan_mask(keep, 3, seed, offset, rd.keep_threshold(p)))
    if not np.array_equal(cupy.asnumpy(keep).astype(bool), rd.dropout_mask(shape, p, seed, offset, batch0=3)):
        raise AssertionError("the GPU's dropout mask differs from the NumPy generator's")
    rng = np.random.default_rng(31)
    dt = _dtype("bf16")
    q = rng.standard_normal((2, 8, 333, 128)).astype(dt)
    k = rng.standard_normal((2, 2, 517, 128)).astype(dt)
    v = rng.standard_normal((2, 2, 517, 128)).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    kw = dict(causal=True, dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    o64, l64 = cuflash.attention(*x64, return_lse=True, **kw)
    o_np, l_np = cuflash.attention(q, k, v, return_lse=True, **kw)
    g64 = cuflash.attention_backward(dout.astype(np.float64), *x64, o64, l64, **kw)
    g_np = cuflash.attention_backward(dout, q, k, v, o_np, l_np, **kw)
    dev = [cupy.asarray(x) for x in (q, k, v, dout)]
    o, l_ = cuflash.attention(*dev[:3], return_lse=True, **kw)
    g = cuflash.attention_backward(dev[3], *dev[:3], o, l_, **kw)
    worst = 0.0
    for name, a, ref_np, exact in (("out", o, o_np, o64), ("dq", g[0], g_np[0], g64[0]), ("dk", g[1], g_np[1], g64[1]),
                                   ("dv", g[2], g_np[2], g64[2])):
        ratio = _held_to_rule(f"dropout {name}", cupy.asnumpy(a), ref_np, exact, q.dtype)
        worst = max(worst, ratio)
        log(f"  dropout {name}: {ratio:.2f} of the bound")
    return f"mask bit-identical to NumPy's; forward and backward within the rule (worst {worst:.2f} of the bound)"


#: the modifiers section's (B, Hq, Hk, Sq, Sk, D): odd lengths, three key tiles of 128 masked out
MODIFIERS_SHAPE = (2, 8, 2, 333, 517, 128)


def section_modifiers(clock, log) -> str:
    """The score modifiers on the GPU (the kernels' ``_mods`` forms): softcap, ALiBi, a broadcast
    float32 bias, a boolean mask with fully masked rows and key tiles, and sinks, forward (the
    dispatcher's tier: Hopper on sm_90) and backward with d attn_bias and d sinks, each within the
    rule of the NumPy path's error against float64."""
    import cupy

    import cuflash

    rng = np.random.default_rng(37)
    dt = _dtype("bf16")
    b, hq, hk, sq, sk, d = MODIFIERS_SHAPE
    q = rng.standard_normal((b, hq, sq, d)).astype(dt)
    k = rng.standard_normal((b, hk, sk, d)).astype(dt)
    v = rng.standard_normal((b, hk, sk, d)).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    mask = rng.random((b, 1, sq, sk)) > 0.3
    mask[:, :, 7, :] = False
    mask[:, :, :, 128:256] = False   # a fully masked key tile (rows 7: a fully masked row)
    mods = dict(softcap=20.0, alibi_slopes=rng.uniform(0.01, 0.1, hq).astype(np.float32),
                attn_bias=rng.standard_normal((1, hq, 1, sk)).astype(np.float32), attn_mask=mask,
                sinks=rng.standard_normal(hq).astype(np.float32))
    asks = dict(return_dbias=True, return_dsinks=True)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    m64 = dict(mods, attn_bias=mods["attn_bias"].astype(np.float64))
    o64, l64 = cuflash.attention(*x64, causal=True, return_lse=True, **m64)
    o_np, l_np = cuflash.attention(q, k, v, causal=True, return_lse=True, **mods)
    g64 = cuflash.attention_backward(dout.astype(np.float64), *x64, o64, l64, causal=True, **m64, **asks)
    g_np = cuflash.attention_backward(dout, q, k, v, o_np, l_np, causal=True, **mods, **asks)
    dev = [cupy.asarray(x) for x in (q, k, v, dout)]
    dmods = {n: (cupy.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in mods.items()}
    info = cuflash.explain(*dev[:3], causal=True, **dmods)
    tier = info.get("tier", info["backend"])
    o, l_ = cuflash.attention(*dev[:3], causal=True, return_lse=True, **dmods)
    g = cuflash.attention_backward(dev[3], *dev[:3], o, l_, causal=True, **dmods, **asks)
    worst = 0.0
    for name, a, ref_np, exact in zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), (o, *g), (o_np, *g_np),
                                      (o64, *g64)):
        ratio = _held_to_rule(f"modifiers {name}", cupy.asnumpy(a), ref_np, exact, q.dtype)
        worst = max(worst, ratio)
        log(f"  modifiers {name}: {ratio:.2f} of the bound")
    return f"forward on {tier}, backward with dbias and dsinks: within the rule (worst {worst:.2f} of the bound)"


def section_sim(clock, log) -> str:
    import cupy

    import cuflash
    from cuflash import sim

    rng = np.random.default_rng(11)
    arch = int(cupy.cuda.Device().compute_capability)
    sim_arch = arch if arch in sim.ARCHS else max(a for a in sim.ARCHS if a <= arch)
    cases = [dict(dtype="f16", B=1, Hq=2, Hk=1, Sq=19, Sk=45, D=64, Dv=64, causal=True, window=(-1, -1)),
             dict(dtype="bf16", B=1, Hq=1, Hk=1, Sq=33, Sk=20, D=40, Dv=40, causal=False, window=(8, 8)),
             dict(dtype="f32", B=2, Hq=2, Hk=2, Sq=8, Sk=70, D=128, Dv=128, causal=False, window=(-1, -1))]
    lines = []
    for c in cases:
        if clock.out():
            raise AssertionError(f"out of time after {len(lines)} cases")
        c = dict(c, layout="bhsd", view="contiguous", logits=1.0)
        q, k, v = _host_inputs(c, rng)
        gpu = cupy.asnumpy(cuflash.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                             causal=c["causal"], window_size=c["window"]))
        with sim.options(arch=f"sm_{sim_arch}"):
            cpu = cuflash.attention(q, k, v, causal=c["causal"], window_size=c["window"], backend="sim")
        diff = float(np.abs(gpu.astype(np.float64) - cpu.astype(np.float64)).max())
        same = float(np.mean(gpu.view(np.uint8) == cpu.view(np.uint8)))
        ok, msg, _, tol = tolerance.judge(gpu, q, k, v, causal=c["causal"], window_size=c["window"])
        ok2, msg2, _ = tolerance.compare(cpu, q, k, v, causal=c["causal"], window_size=c["window"])
        log(f"  {_case_name(c)}: GPU vs sim_{sim_arch} max|diff| {diff:.2e} (bound {tol:.2e}), "
            f"{same:.0%} of bytes identical; GPU {msg}; sim {msg2}")
        if not (ok and ok2) or diff > tol:
            raise AssertionError(f"{_case_name(c)}: GPU vs simulator differ by {diff:.3g} > {tol:.3g} "
                                 f"(GPU: {msg}; sim: {msg2})")
        lines.append(diff)
    x = (rng.standard_normal((5, 1500)) * 3).astype(np.float16)
    gpu_sm = cupy.asnumpy(cuflash.softmax(cupy.asarray(x)))
    with sim.options(arch=f"sm_{sim_arch}"):
        sim_sm = cuflash.softmax(x, backend="sim")
    sdiff = float(np.abs(gpu_sm.astype(np.float32) - sim_sm.astype(np.float32)).max())
    if sdiff > 2.0**-10:
        raise AssertionError(f"softmax GPU vs simulator differ by {sdiff:.3g}")
    return f"{len(cases)} attention cases + softmax agree with sim_{sim_arch} (max|diff| {max(lines):.1e})"


#: the sm_75 form's cases (fp16; every tile shape of its forward, and its backward's bucket 64)
TURING_CASES = [dict(dtype="f16", B=1, Hq=4, Hk=2, Sq=150, Sk=130, D=64, Dv=64, causal=True, window=(-1, -1)),
                dict(dtype="f16", B=2, Hq=2, Hk=2, Sq=97, Sk=200, D=128, Dv=128, causal=False, window=(20, 10)),
                dict(dtype="f16", B=1, Hq=2, Hk=1, Sq=70, Sk=90, D=192, Dv=160, causal=True, window=(-1, -1)),
                dict(dtype="f16", B=1, Hq=2, Hk=2, Sq=33, Sk=129, D=256, Dv=256, causal=False, window=(-1, -1))]


def turing_case(rng, c: dict, arch: int, device_call) -> tuple[str, float]:
    """One case of the sm_75 form built for ``sm_<arch>`` (8.0 or newer): ``device_call(fn, arrays,
    kw)`` runs the cuflash function ``fn`` on the device with host ``arrays`` and returns host
    arrays. The forward (and, at head dim 64, the backward) in
    :func:`cuflash.kernels.attention_fwd_mma.sm75_form` are held to the rule against the float64
    oracle; the entry chosen must be an ``_sm75form`` build. Returns the entry and the worst error
    as a fraction of the bound."""
    import cuflash
    from cuflash.kernels import attention_fwd_mma

    c = dict(c, layout="bhsd", view="contiguous", logits=1.0)
    q, k, v = _host_inputs(c, rng)
    kw = dict(causal=c["causal"], window_size=c["window"])
    with attention_fwd_mma.sm75_form():
        entry = cuflash.explain(q, k, v, arch=arch, **kw)["entry"]
        if not entry.endswith("_sm75form"):
            raise AssertionError(f"{_case_name(c)}: the sm_75 form was not chosen ({entry})")
        out, lse = device_call(cuflash.attention, (q, k, v), dict(kw, return_lse=True))
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    o64, l64 = reference.naive_attention(*x64, return_lse=True, **kw)
    worst = _held_to_rule(f"{_case_name(c)} out", out, cuflash.attention(q, k, v, **kw), o64, q.dtype)
    if c["D"] <= 64:   # the backward's sm_75 form (bucket 64)
        dout = rng.standard_normal(out.shape).astype(q.dtype)
        with attention_fwd_mma.sm75_form():
            grads = device_call(cuflash.attention_backward, (dout, q, k, v, out, lse), kw)
        cpu = cuflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw)
        exact = reference.attention_backward(dout.astype(np.float64), *x64, o64, l64, **kw)
        for name, g, gc, ge in zip(("dq", "dk", "dv"), grads, cpu, exact):
            worst = max(worst, _held_to_rule(f"{_case_name(c)} {name}", g, gc, ge, q.dtype))
    return entry, worst


def section_turing(clock, log) -> str:
    """The tensor-core tier's sm_75 (Turing) form on a newer GPU (:func:`turing_case` over
    :data:`TURING_CASES`). Its speed here says nothing about a T4's, so none is reported."""
    import cupy

    from cuflash.kernels import attention_fwd_mma

    arch = int(cupy.cuda.Device().compute_capability)
    if arch < attention_fwd_mma.MIN_ARCH:
        raise Skip(f"compute capability {arch // 10}.{arch % 10}: the other sections run this device's own form")

    def on_gpu(fn, arrays, kw):
        return tuple(cupy.asnumpy(x) for x in fn(*(cupy.asarray(a) for a in arrays), **kw))

    rng = np.random.default_rng(75)
    worst, done = 0.0, 0
    for c in TURING_CASES:
        if clock.out():
            raise AssertionError(f"out of time after {done} cases")
        entry, ratio = turing_case(rng, c, arch, on_gpu)
        log(f"  {_case_name(dict(c, layout='bhsd', view='contiguous', logits=1.0))}: {entry}, {ratio:.2f} of the bound")
        worst, done = max(worst, ratio), done + 1
    return (f"{done} fp16 cases of the T4 kernels built for sm_{arch} (forward, and backward at head dim 64) "
            f"within the rule (worst {worst:.2f} of the bound); a check of their results, not of a T4's speed")


def section_hopper(clock, log) -> str:
    import cupy

    from cuflash import sim
    from cuflash.kernels import hopper_probe as hp
    from cuflash.runtime import cuda_runner, source
    from cuflash.sim import launcher

    cc = int(cupy.cuda.Device().compute_capability)
    why = hp.VARIANT.unsupported_device_reason(cc)
    if why:
        raise Skip(why)
    import ml_dtypes

    def gpu(plan_fn, *arrays, **kw):
        dev = [cupy.asarray(x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x) for x in arrays]
        cuda_runner.launch(plan_fn(*dev, **kw))
        cupy.cuda.Device().synchronize()
        return cupy.asnumpy(dev[-1] if plan_fn is not hp.plan_elect else dev[0]), dev

    def on_sim(plan_fn, *arrays, **kw):
        arrays = [x.copy() for x in arrays]
        with sim.options(arch=90) as o:
            sim_mod = launcher.load_source(source.build_source(hp.VARIANT), origin=hp.VARIANT.source, options=o)
            sim_mod.launch(plan_fn(*arrays, **kw), o)
        return arrays[-1]

    done = []
    for sw, nm, regs in hp.GEMMS:
        if clock.out():
            raise AssertionError(f"out of time after {len(done)} probes")
        a, b, c, want = hp.gemm_inputs(100, 128, nm, seed=len(done))
        got, _ = gpu(hp.plan_gemm, a, b, c, swizzle=sw, nmajor=nm, a_regs=regs)
        emu = on_sim(hp.plan_gemm, a, b, c, swizzle=sw, nmajor=nm, a_regs=regs)
        name = hp.gemm_entry(sw, nm, regs)
        bad = int(np.sum(got != want))
        log(f"  {name}: {bad} of {got.size} elements differ from A B (exact); the simulator "
            f"{'agrees' if np.array_equal(emu, got) else 'DIFFERS'}")
        if bad or not np.array_equal(emu, got):
            raise AssertionError(f"{name}: the GPU result differs from the exact product in {bad} elements, or from "
                                 "the simulator's")
        done.append(name)
    for regs in (False, True):   # wgmma m64n64k32 .e4m3 (fp8), A from shared memory, then from registers
        a, b, c, want = hp.gemm_e4m3_inputs(100, 96, seed=len(done))
        a8, b8 = a.view(np.uint8), b.view(np.uint8)   # (CuPy holds the fp8 bytes as uint8)
        got, _ = gpu(hp.plan_gemm_e4m3, a8, b8, c, a_regs=regs)
        emu = on_sim(hp.plan_gemm_e4m3, a8, b8, c, a_regs=regs)
        name = f"hopper_gemm_e4m3_{'rs' if regs else 'ss'}"
        bad = int(np.sum(got != want))
        log(f"  {name}: {bad} of {got.size} elements differ from A B^T (exact); the simulator "
            f"{'agrees' if np.array_equal(emu, got) else 'DIFFERS'}")
        if bad or not np.array_equal(emu, got):
            raise AssertionError(f"{name}: the GPU result differs from the exact product in {bad} elements, or from "
                                 "the simulator's")
        done.append(name)
    a, b, c, want = hp.gemm_inputs(200, 256, False, seed=7)
    got, _ = gpu(hp.plan_pipeline, a, b, c)
    if not np.array_equal(got, want):
        raise AssertionError(f"hopper_pipeline: {int(np.sum(got != want))} elements differ from A B")
    out = np.zeros((6, 16, 16), np.uint16)
    got, _ = gpu(hp.plan_stmatrix, out)
    if not np.array_equal(got, hp.expected_stmatrix()):
        raise AssertionError("stmatrix_probe: the tiles differ from the PTX ISA's fragment")
    leader, winners = np.full(4, -1, np.int32), np.zeros(128, np.int32)
    got, dev = gpu(hp.plan_elect, leader, winners)
    if set(cupy.asnumpy(dev[1]).tolist()) != {1}:
        raise AssertionError("elect_probe: a warp elected other than exactly one lane")
    log(f"  elect.sync leaders per warp: {got.tolist()}")
    return f"{len(done)} wgmma GEMMs, the pipeline, stmatrix and elect.sync exact and equal to the simulator"


def section_torch(clock, log) -> str:
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed") from None
    if not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} has no CUDA")
    import cuflash

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    notes = []
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        q = torch.randn(2, 77, 6, 64, device=dev, dtype=dt, generator=gen)  # bshd memory, used as bhsd view
        k = torch.randn(2, 100, 2, 64, device=dev, dtype=dt, generator=gen)
        v = torch.randn(2, 100, 2, 64, device=dev, dtype=dt, generator=gen)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # produce and consume on a side stream: ordering by stream
            q2 = q * 1.0
            before = torch.cuda.memory_allocated(dev)
            o, lse = cuflash.attention(q2.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                       return_lse=True)
            grown = torch.cuda.memory_allocated(dev) - before
        torch.cuda.current_stream(dev).wait_stream(side)
        if not (isinstance(o, torch.Tensor) and o.device == dev and o.dtype == dt and lse.dtype == torch.float32):
            raise AssertionError(f"{dt}: got {type(o).__name__} {getattr(o, 'dtype', '?')} on {getattr(o, 'device', '?')}")
        if grown < o.numel() * o.element_size():
            raise AssertionError(f"{dt}: outputs not allocated by torch (memory_allocated grew by {grown} bytes)")
        to64 = lambda t: t.float().cpu().numpy()  # noqa: E731
        qh, kh, vh = (x.transpose(1, 2).contiguous().cpu() for x in (q, k, v))
        npdt = {torch.float16: np.float16, torch.float32: np.float32}.get(dt)
        if npdt is None:
            import ml_dtypes

            npdt = ml_dtypes.bfloat16
        qn, kn, vn = (to64(x).astype(npdt) for x in (qh, kh, vh))
        ok, msg, _ = tolerance.compare(to64(o), qn, kn, vn, causal=True, lse=to64(lse))
        log(f"  torch {dt}: {msg}")
        if not ok:
            raise AssertionError(f"torch {dt}: {msg}")
        out = torch.empty_like(o)
        r = cuflash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, out=out)
        if r is not out or not torch.equal(out, o):
            raise AssertionError(f"torch {dt}: out= not returned or differs")
    try:
        import cuflash.torch as ct

        q = torch.randn(1, 4, 33, 64, device=dev, dtype=torch.float16, generator=gen)
        o2 = ct.attention(q, q, q, causal=True)
        ref = cuflash.attention(q, q, q, causal=True)
        if not torch.equal(o2, ref):
            raise AssertionError("cuflash.torch.attention (custom op) differs from cuflash.attention")
        notes.append("cuflash.torch forward ok")
    except ImportError as exc:
        notes.append(f"cuflash.torch not importable ({exc})")
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return "fp16/bf16/fp32 round-trips on a side stream, torch-allocated outputs, out=; " + "; ".join(notes)


def section_distributed(clock, log) -> str:
    """Ring and Ulysses attention on CUDA tensors over NCCL with a world of one (one GPU cannot
    host two NCCL ranks): equal to plain attention, forward and gradients, bit for bit."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise Skip(f"torch is not installed ({e})")
    if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
        raise Skip("torch has no CUDA or no NCCL here")
    if dist.is_initialized():
        raise Skip("a process group is already initialised in this process")
    import socket

    import cuflash.torch as ct

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        shapes = ((2, 1000, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128))
        q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes)
        for causal in (False, True):
            base = [x.clone().requires_grad_() for x in (q, k, v)]
            want = ct.attention(*base, causal=causal, layout="bshd", deterministic=True)   # dQ bits fixed
            want.float().square().sum().backward()
            for fn in (ct.ring_attention, ct.ulysses_attention):
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                got = fn(*leaves, causal=causal, deterministic=True)
                got.float().square().sum().backward()
                if not torch.equal(got, want) or not all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, base)):
                    raise AssertionError(f"{fn.__name__} (causal={causal}) on one NCCL rank differs from attention")
            log(f"  NCCL world of 1, causal={causal}: ring and Ulysses equal plain attention (out, dq, dk, dv)")
    finally:
        dist.destroy_process_group()
    return "ring and Ulysses over NCCL (world 1) bit for bit equal to plain attention, forward and backward"


def section_jax(clock, log) -> str:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to the others
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise Skip("JAX is not installed") from None
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        raise Skip(f"JAX {jax.__version__} has no GPU backend")
    import cuflash

    rng = np.random.default_rng(13)
    for name in ("float16", "bfloat16", "float32"):
        dt = _dtype({"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[name])
        q, k, v = (rng.standard_normal((2, 4, 50, 64)).astype(dt) for _ in range(3))
        qj, kj, vj = (jax.device_put(jnp.asarray(x), gpus[0]) for x in (q, k, v))
        qj = qj * 1  # pending JAX work: the DLPack stream handshake must order it
        o = cuflash.attention(qj, kj, vj, causal=True)
        if not isinstance(o, jax.Array) or str(o.dtype) != name:
            raise AssertionError(f"JAX {name}: got {type(o).__name__} {getattr(o, 'dtype', '?')}")
        oh = np.asarray(o)
        ok, msg, _ = tolerance.compare(oh, q, k, v, causal=True)
        log(f"  JAX {name}: {msg}")
        if not ok:
            raise AssertionError(f"JAX {name}: {msg}")
    return "fp16/bf16/fp32 round-trips (result is a jax.Array; ordering through the DLPack stream handshake)"


def section_graph(clock, log) -> str:
    import cupy

    import cuflash

    rng = np.random.default_rng(17)
    shape_q, shape_kv = (2, 4, 100, 64), (2, 2, 130, 64)
    q = cupy.asarray(rng.standard_normal(shape_q).astype(np.float16))
    k = cupy.asarray(rng.standard_normal(shape_kv).astype(np.float16))
    v = cupy.asarray(rng.standard_normal(shape_kv).astype(np.float16))
    out = cupy.empty(shape_q, np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, causal=True, out=out, return_lse=True)  # warm: compile, pool blocks
        stream.synchronize()
        stream.begin_capture()
        _, lse = cuflash.attention(q, k, v, causal=True, out=out, return_lse=True)
        graph = stream.end_capture()
        for trial in range(2):
            q[...] = cupy.asarray(rng.standard_normal(shape_q).astype(np.float16))  # new inputs, same buffers
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            expect, expect_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            stream.synchronize()
            if not bool(cupy.array_equal(out, expect)) or not bool(cupy.array_equal(lse, expect_lse)):
                raise AssertionError(f"graph replay {trial} differs from a direct call "
                                     f"(max|diff| {float(cupy.abs(out.astype(cupy.float32) - expect.astype(cupy.float32)).max()):.3g})")
    ok, msg, _ = tolerance.compare(cupy.asnumpy(out), cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(v), causal=True)
    if not ok:
        raise AssertionError(f"graph replay: {msg}")
    return "captured on a side stream, replayed twice on new inputs: identical to direct calls"


def section_demo(clock, log) -> str:
    from cuflash.tools import demo

    lines: list[str] = []
    result = demo.run_demo(backend="cuda", use_embedded=True, out=lines.append)
    for line in lines:
        log("  " + line)
    if result["backend"] != "cuda" or not any("GPU path" in line for line in lines):
        raise AssertionError(f"the demo ran backend={result['backend']!r}, not the GPU path")
    data = demo.load_embedded()
    for rec in result["layers"]:
        q, k, v = data["layers"][rec["layer"]]
        tol = tolerance.rule_bound(q, k, v, causal=True)
        if rec["max_abs_err"] > tol:
            raise AssertionError(f"demo layer {rec['layer']}: error {rec['max_abs_err']:.3g} > {tol:.3g}")
    worst = max(r["max_abs_err"] for r in result["layers"])
    return f"{len(result['layers'])} layers on the GPU, worst max|err| {worst:.1e}"


_FUNCS = {name: globals()[f"section_{name}"] for name in SECTIONS}


# --------------------------------------------------------------------------------------------
# driver


def gpu_status() -> tuple[bool, str]:
    """``(True, description)`` when a CUDA device is usable, else ``(False, reason)``."""
    from cuflash.runtime.interop import require_cuda

    try:
        cupy = require_cuda("cuflash check")
        dev = cupy.cuda.Device()
        return True, f"device {dev.id}, sm_{dev.compute_capability}"
    except RuntimeError as exc:
        return False, str(exc).removeprefix("cuflash check: ")


def _run_section(name: str, budget: float, log) -> Result:
    clock = _Clock(budget)
    box: dict = {}

    def target():
        try:
            box["detail"] = _FUNCS[name](clock, log)
            box["status"] = "PASS"
        except Skip as exc:
            box["status"], box["detail"] = "SKIP", str(exc)
        except BaseException as exc:  # noqa: BLE001 - report every failure, keep going
            box["status"] = "FAIL"
            box["detail"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log("".join(traceback.format_exception(exc))[-3000:])

    start = time.perf_counter()
    worker = threading.Thread(target=target, name=f"cuflash-check-{name}", daemon=True)
    worker.start()
    worker.join(budget + 15.0)  # hard limit: a hung section is reported and left behind
    seconds = time.perf_counter() - start
    if worker.is_alive():
        return Result(name, "FAIL", seconds, f"timed out after {seconds:.0f} s (limit {budget:.0f} s)")
    return Result(name, box.get("status", "FAIL"), seconds, box.get("detail", "no result"))


def format_table(results: list[Result]) -> list[str]:
    """The pass/fail table printed last."""
    w = max([len(r.section) for r in results] + [7])
    lines = [f"{'section':<{w}}  status  {'time':>7}  detail", f"{'-' * w}  ------  {'-' * 7}  {'-' * 40}"]
    for r in results:
        lines.append(f"{r.section:<{w}}  {r.status:<6}  {r.seconds:6.1f}s  {r.detail}")
    passed = sum(r.status == "PASS" for r in results)
    failed = sum(r.status == "FAIL" for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    lines.append(f"{passed} passed, {failed} failed, {skipped} skipped in {sum(r.seconds for r in results):.0f} s"
                 + ("" if not failed else "  -> FAIL"))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="GPU self-check: compile every kernel variant, run the correctness grid against a "
                    "float64 oracle (also at S=8192, batch*heads > 65535, offsets past 2**31), torch and "
                    "JAX round-trips, a CUDA-graph capture, the demo's GPU path, GPU vs simulator; "
                    "backward, KV cache, dropout, score modifiers, distributed and Hopper probes. "
                    "Prints a pass/fail table last. Exit status 0 pass, 1 fail, 2 no GPU or bad arguments.")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--budget", type=cli.float_above(0.0, inclusive=False), default=DEFAULT_BUDGET_S, metavar="S",
                   help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--quiet", action="store_true", help="print only the table")
    return p


@cli.command(PROG)
def main(argv: list[str] | None = None) -> int:
    """``python -m cuflash check [--sections a,b] [--budget S] [--quiet]``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown or not wanted:
        return cli.error(PROG, f"--sections: unknown section(s) {', '.join(unknown)}; choose from "
                               f"{', '.join(SECTIONS)}" if unknown else
                               f"--sections: no section named; choose from {', '.join(SECTIONS)}")
    ok, why = gpu_status()
    if not ok:
        return cli.error(PROG, f"nothing was checked: {why}. This command checks a GPU; on a machine without "
                               "one run the test suite (python -m pytest), whose CPU tiers cover validation, the "
                               "NVRTC compile gate and the simulator")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    def log(text: str) -> None:
        if not args.quiet:
            print(text, flush=True)

    start = time.monotonic()
    results = []
    log(f"cuflash check: {why}; budget {args.budget:.0f} s")
    for name in wanted:
        left = args.budget - (time.monotonic() - start)
        if left <= 1:
            results.append(Result(name, "FAIL", 0.0, "not run: the time budget was spent"))
            continue
        log(f"== {name}")
        share = _SHARE.get(name, 0.1) * args.budget
        results.append(_run_section(name, max(1.0, min(left, share)), log))
        log(f"   {results[-1].status} {results[-1].detail}")
    print()
    for line in format_table(results):
        print(line)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
