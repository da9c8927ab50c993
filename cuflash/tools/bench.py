"""``python -m cuflash bench``: forward attention throughput on the local GPU.

The FA2/FA3 benchmark shape: 16k tokens per batch (``B = 16384 // S``) and ``H * D = 2048``,
seqlen 512 .. 16k, hdim 64/128/256, fp16 and bf16, causal or not. Each configuration runs
cuflash (the kernel the dispatcher picks for this device) and, as baselines in the same process,
cuflash's portable SIMT kernel, naive CuPy attention (matmul, softmax, matmul; S and P
materialised) and, when torch is importable with CUDA, PyTorch SDPA with the flash and the cuDNN
backends. ``--quick`` runs bf16/fp16, hdim 64/128, S 2k/8k, causal or not, with the baselines at
the bar shape only (bf16, hdim 128, S = 8192), in under 2 minutes on an H100/H200.

Method (docs/benchmarks.md): CUDA events around each call, after warm-up; the L2 cache is flushed
(a buffer twice its size is overwritten) before every timed call; the median is reported.
FLOPs: ``2*B*H*(D + Dv)*P`` over the visible pairs P (:func:`cuflash.intensity.attention_flops`),
and flash-attn's ``4*B*H*S^2*D`` (halved for causal) for comparison with published numbers.
A bf16 matmul (8192^3; fp16 before sm_80, where the --quick baselines' shape is fp16 too: a T4 or
V100 has no bf16 tensor cores) measured in the same run gives the "% of peak" column; the output
names the tiers the device runs and the roofline preset that models it
(:func:`cuflash.tools.check.device_plan`). Every cuflash
result is also checked against a float32 CuPy attention on a slice (max error column); a result
outside the tolerance makes the command exit 1.

``--fp8`` adds the fp8 measurements of :mod:`cuflash.tools.bench_fp8` (the fp8 KV-cache decode
beside an fp8 GEMM measured in the same run).

Without a CUDA GPU the command says so and exits 2: the simulator is not benchmarked and no
number is ever made up. Two modes need no GPU: ``--cpu`` times the CPU path
(:mod:`cuflash.tools.cpu_bench`), ``--compare BASE.json NEW.json`` checks two saved
pytest-benchmark runs for a regression (:mod:`cuflash.tools.bench_compare`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

from cuflash.analysis import cli
from cuflash.tools import cpu_bench

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")
BAR_SHAPE = ("bfloat16", 128, 8192, False)
#: tolerance of the correctness check (max abs error against float32 attention, V ~ N(0, 1))
CHECK_TOL = {"float16": 4e-3, "bfloat16": 3e-2}

IMPLS = ("cuflash", "cuflash_simt", "cupy_naive", "torch_sdpa_flash", "torch_sdpa_cudnn")
#: backward implementations (``--backward``): FLOPs are 2.5x the forward's (FA2's convention)
IMPLS_BWD = ("cuflash_bwd", "torch_sdpa_flash_bwd")


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    head_dim: int
    seqlen: int
    causal: bool

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim

    @property
    def label(self) -> str:
        return f"{self.dtype} d{self.head_dim} S{self.seqlen} {'causal' if self.causal else 'full'} (B={self.batch} H={self.heads})"

    def flops(self) -> int:
        from cuflash import intensity

        return intensity.attention_flops(self.seqlen, self.head_dim, batch=self.batch, heads=self.heads, causal=self.causal)

    def flops_flash_attn(self) -> int:
        from cuflash import intensity

        return intensity.flash_attn_flops(self.seqlen, self.head_dim, batch=self.batch, heads=self.heads, causal=self.causal)


def sweep(quick: bool = False, *, dtypes=None, head_dims=None, seqlens=None, causal=None) -> list[Config]:
    """The configurations of the full sweep or of ``--quick``, optionally filtered."""
    dts = dtypes or DTYPES
    hds = head_dims or ((64, 128) if quick else HEAD_DIMS)
    sls = seqlens or ((2048, 8192) if quick else SEQLENS)
    cs = (False, True) if causal is None else (causal,)
    return [Config(dt, d, s, c) for dt in dts for d in hds for s in sls for c in cs]


def peak_dtype(arch: int) -> str:
    """The dtype of the matmul that measures the peak and of the --quick baselines' shape on
    ``sm_<arch>``: bfloat16, or float16 before sm_80 (a T4 or V100 has no bfloat16 tensor cores)."""
    return "bfloat16" if arch >= 80 else "float16"


def baselines_for(cfg: Config, quick: bool, arch: int = 90) -> tuple[str, ...]:
    """Baselines run for ``cfg``: all of them in the full sweep, only at the bar shape in --quick
    (in :func:`peak_dtype`'s dtype on ``sm_<arch>``)."""
    if quick and (cfg.dtype, cfg.head_dim, cfg.seqlen, cfg.causal) != (peak_dtype(arch),) + BAR_SHAPE[1:]:
        return ()
    return IMPLS[1:]


# --------------------------------------------------------------------------------------------
# device and timing


def gpu_available() -> tuple[bool, str]:
    """``(True, device name)`` or ``(False, why not)``."""
    from cuflash.runtime.interop import device_name, require_cuda

    try:
        cupy = require_cuda("cuflash bench")
    except RuntimeError as e:
        return False, str(e).removeprefix("cuflash bench: ")
    return True, device_name(cupy.cuda.Device().id)


class Timer:
    """CUDA-event timing with the L2 flushed before every timed call."""

    def __init__(self, warmup: int = 3, iters: int = 10):
        import cupy

        self.cupy = cupy
        self.warmup, self.iters = warmup, iters
        dev = cupy.cuda.Device()
        l2 = int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrL2CacheSize, dev.id))
        self.flush_buf = cupy.empty(max(2 * l2, 1 << 20) // 4, dtype=cupy.int32)

    def flush(self) -> None:
        self.flush_buf.fill(0)

    def median_ms(self, fn) -> float:
        """Median milliseconds of ``fn()`` (which launches work on the current stream)."""
        cp = self.cupy
        for _ in range(self.warmup):
            fn()
        times = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(self.iters):
            self.flush()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return statistics.median(times)


def matmul_peak_tflops(timer: Timer, n: int = 8192, dtype: str = "bfloat16") -> tuple[float, str]:
    """Measured matmul TFLOP/s (n x n x n) in ``dtype`` (bfloat16, or float16: :func:`peak_dtype`),
    with torch if present, else CuPy."""
    cp = timer.cupy
    short = "bf16" if dtype == "bfloat16" else "fp16"
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
            b = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
            ms = timer.median_ms(lambda: torch.matmul(a, b))
            return 2 * n**3 / (ms * 1e-3) / 1e12, f"torch {short} matmul"
    except ImportError:
        pass
    a = cp.asarray(cp.random.standard_normal((n, n), dtype=cp.float32).astype(_cupy_dtype(dtype)))
    b = cp.asarray(cp.random.standard_normal((n, n), dtype=cp.float32).astype(_cupy_dtype(dtype)))
    ms = timer.median_ms(lambda: cp.matmul(a, b))
    return 2 * n**3 / (ms * 1e-3) / 1e12, f"cupy {short} matmul"


# --------------------------------------------------------------------------------------------
# implementations


def _cupy_dtype(name: str):
    from cuflash.runtime import dtypes

    return getattr(dtypes, name)


def make_inputs(cfg: Config, seed: int = 0):
    import cupy as cp

    rng = cp.random.default_rng(seed)
    shape = (cfg.batch, cfg.heads, cfg.seqlen, cfg.head_dim)
    return tuple(rng.standard_normal(shape, dtype=cp.float32).astype(_cupy_dtype(cfg.dtype)) for _ in range(3))


def cuflash_runner(q, k, v, causal: bool, *, tier: str = "auto"):
    """A no-argument callable running cuflash's forward on the current device, and a description
    of the kernel it runs. ``tier="simt"`` forces the portable kernel (the first kernel baseline)."""
    import cupy as cp

    from cuflash.kernels import attention_fwd_simt, dispatch
    from cuflash.runtime import device_call, validation
    from cuflash.runtime.options import Options

    problem = validation.check_attention(q, k, v, Options(causal=causal))
    arch = int(cp.cuda.Device().compute_capability)
    mod = attention_fwd_simt if tier == "simt" else dispatch.forward_tier(problem, arch, (q, k, v, None))
    v_ = dispatch.variant_for(mod, problem, arch)
    out = cp.empty(problem.out_shape, dtype=problem.dtype)
    device = device_call.CudaDevice("cuflash bench", int(cp.cuda.Device().id))

    def run():
        with device_call.DeviceCall("cuflash bench", device, q, out=out) as call:
            return mod.forward(problem, q, k, v, out, call)

    return run, v_.entry


def naive_runner(q, k, v, causal: bool):
    """Naive CuPy attention: S = q k^T, masked softmax, P v (S and P materialised)."""
    import cupy as cp

    scale = 1.0 / math.sqrt(q.shape[-1])
    s_len = q.shape[-2]
    mask = cp.triu(cp.ones((s_len, s_len), dtype=bool), 1) if causal else None

    def run():
        s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * scale
        if mask is not None:
            s[..., mask] = -cp.inf
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s, out=s)
        p /= p.sum(axis=-1, keepdims=True)
        return cp.matmul(p.astype(q.dtype), v)

    return run


def torch_runner(q, k, v, causal: bool, backend: str):
    """PyTorch SDPA with one backend (``"flash"`` or ``"cudnn"``) on the same memory (DLPack)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    f = torch.nn.functional.scaled_dot_product_attention

    def run():
        with sdpa_kernel(b):
            return f(tq, tk, tv, is_causal=causal)  # top-left = bottom-right here (Sq == Sk)

    return run


def cuflash_backward_runner(q, k, v, causal: bool):
    """A no-argument callable running cuflash's backward (dq, dk, dv) for a fixed dout."""
    import cupy as cp

    import cuflash

    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = cp.random.default_rng(1).standard_normal(out.shape, dtype=cp.float32).astype(out.dtype)

    def run():
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)[0]

    return run


def _backward_kernel_name(q, k, v, causal: bool) -> str:
    """The backward tier the dispatcher picks for these (aligned, contiguous) inputs."""
    import cupy as cp

    from cuflash.kernels import dispatch
    from cuflash.runtime import validation
    from cuflash.runtime.options import Options

    problem = validation.check_attention(q, k, v, Options(causal=causal))
    arch = int(cp.cuda.Device().compute_capability)
    return dispatch.backward_tier(problem, arch).__name__.rsplit(".", 1)[-1]


def torch_backward_runner(q, k, v, causal: bool, backend: str):
    """PyTorch SDPA's backward with one backend: ``torch.autograd.grad`` of a recorded forward."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(b):
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    do = torch.randn_like(o)

    def run():
        return torch.autograd.grad(o, (tq, tk, tv), do, retain_graph=True)[0]

    return run


def check_error(out, q, k, v, causal: bool, rows: int = 256) -> float:
    """Max abs error of the last ``rows`` query rows of head (0, 0) against float32 attention."""
    import cupy as cp

    s_len = q.shape[-2]
    r0 = max(0, s_len - rows)
    qf, kf, vf = (x[0, 0].astype(cp.float32) for x in (q, k, v))
    s = (qf[r0:] @ kf.T) / math.sqrt(q.shape[-1])
    if causal:
        i = cp.arange(r0, s_len)[:, None]
        s = cp.where(cp.arange(s_len)[None, :] <= i, s, -cp.inf)
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    ref = (p / p.sum(axis=-1, keepdims=True)) @ vf
    return float(cp.abs(out[0, 0, r0:].astype(cp.float32) - ref).max())


# --------------------------------------------------------------------------------------------
# the sweep


def _have_torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run_config(cfg: Config, timer: Timer, impls, peak: float) -> list[dict]:
    """Time every implementation in ``impls`` on ``cfg``; one record per implementation."""
    import cupy as cp

    q, k, v = make_inputs(cfg)
    flops, flops_fa = cfg.flops(), cfg.flops_flash_attn()
    records = []
    for impl in impls:
        rec = dict(impl=impl, **dataclasses.asdict(cfg), batch=cfg.batch, heads=cfg.heads, flops=flops,
                   flops_flash_attn=flops_fa, ms=None, tflops=None, tflops_flash_attn=None, pct_peak=None,
                   kernel=None, max_error=None, error=None)
        try:
            if impl.endswith("_bwd"):
                rec.update(flops=int(2.5 * flops), flops_flash_attn=int(2.5 * flops_fa))
            if impl == "cuflash_bwd":
                fn = cuflash_backward_runner(q, k, v, cfg.causal)
                rec["kernel"] = _backward_kernel_name(q, k, v, cfg.causal)
            elif impl == "torch_sdpa_flash_bwd":
                fn = torch_backward_runner(q, k, v, cfg.causal, "flash")
            elif impl == "cuflash" or impl == "cuflash_simt":
                fn, rec["kernel"] = cuflash_runner(q, k, v, cfg.causal, tier="simt" if impl == "cuflash_simt" else "auto")
            elif impl == "cupy_naive":
                fn = naive_runner(q, k, v, cfg.causal)
            else:
                fn = torch_runner(q, k, v, cfg.causal, impl.rsplit("_", 1)[1])
            out = fn()
            if impl.startswith("cuflash"):
                rec["max_error"] = check_error(out, q, k, v, cfg.causal)
            del out
            ms = timer.median_ms(fn)
            rec.update(ms=ms, tflops=rec["flops"] / (ms * 1e-3) / 1e12,
                       tflops_flash_attn=rec["flops_flash_attn"] / (ms * 1e-3) / 1e12)
            rec["pct_peak"] = 100.0 * rec["tflops"] / peak if peak else None
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run (OOM, no backend) is reported, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            cp.get_default_memory_pool().free_all_blocks()
        records.append(rec)
    cp.get_default_memory_pool().free_all_blocks()
    return records


def add_ratios(records: list[dict]) -> None:
    """``ratio_<baseline>``: cuflash's TFLOP/s over each baseline's at the same configuration."""
    key = lambda r: (r["dtype"], r["head_dim"], r["seqlen"], r["causal"])  # noqa: E731
    ours = {(key(r), r["impl"]): r for r in records if r["impl"] in ("cuflash", "cuflash_bwd")}
    for r in records:
        if r["impl"] in ("cuflash", "cuflash_bwd") or not r["tflops"]:
            continue
        o = ours.get((key(r), "cuflash_bwd" if r["impl"].endswith("_bwd") else "cuflash"))
        if o is not None and o["tflops"]:
            o[f"ratio_{r['impl']}"] = o["tflops"] / r["tflops"]


def _against(word: str, baseline: str) -> str:
    """:func:`cpu_bench.versus`'s ``word`` as a phrase naming ``baseline``: "1.17x slower than
    torch_sdpa_flash", "as fast as torch_sdpa_flash", "- (torch_sdpa_flash)" when a time is missing."""
    if word == "-":
        return f"- ({baseline})"
    return f"{word} {'as' if word == 'as fast' else 'than'} {baseline}"


def format_table(records: list[dict], peak: float, peak_src: str, device: str) -> str:
    lines = [f"cuflash bench on {device}: forward (and backward, *_bwd: 2.5x FLOPs), B*S = {TOKENS} tokens, H*D = {HIDDEN}; "
             f"bf16 matmul peak measured {peak:.0f} TFLOP/s ({peak_src})",
             f"{'config':<44} {'impl':<18} {'ms':>8} {'TFLOP/s':>8} {'FA-conv':>8} {'%peak':>6} {'err':>8}  cuflash against each baseline / note"]
    for r in records:
        cfg = Config(r["dtype"], r["head_dim"], r["seqlen"], r["causal"]).label
        if r["error"]:
            lines.append(f"{cfg:<44} {r['impl']:<18} {'-':>8} {'-':>8} {'-':>8} {'-':>6} {'-':>8}  {r['error']}")
            continue
        ratios = "  ".join(_against(cpu_bench.versus(1 / v), k[6:]) for k, v in r.items() if k.startswith("ratio_"))
        err = f"{r['max_error']:.1e}" if r["max_error"] is not None else "-"
        lines.append(f"{cfg:<44} {r['impl']:<18} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['tflops_flash_attn']:>8.1f} "
                     f"{r['pct_peak']:>6.1f} {err:>8}  {ratios}")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """TFLOP/s against seqlen, one line per implementation, one panel per (dtype, hdim, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in records})
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (dt, d, c) in zip(axes.flat, panels):
        for impl in IMPLS:
            pts = sorted((r["seqlen"], r["tflops"]) for r in records
                         if (r["dtype"], r["head_dim"], r["causal"], r["impl"]) == (dt, d, c, impl) and r["tflops"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dt} d{d} {'causal' if c else 'full'}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PROG = "python -m cuflash bench"

#: the GPU sweep's defaults and the CPU mode's (``--warmup``, ``--iters``)
GPU_WARMUP, GPU_ITERS = 3, 10
CPU_WARMUP, CPU_ITERS = 1, 5


def _parser() -> argparse.ArgumentParser:
    positive = cli.int_at_least(1)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Forward (and backward, decode) attention throughput on the local GPU: cuflash against "
                    "its SIMT kernel, naive CuPy and PyTorch SDPA, 16k tokens per batch, H*D = 2048; every "
                    "cuflash result checked. Without a GPU: --cpu times the CPU path, --compare checks two "
                    "saved runs for a regression.")
    p.add_argument("--quick", action="store_true", help="bf16/fp16, hdim 64/128, S 2k/8k; baselines at the bar shape only")
    p.add_argument("--dtype", type=cli.dtype_arg(), action="append",
                   help="only this dtype (repeatable): bfloat16 (bf16) or float16 (fp16, half) on the GPU; "
                        "float32 with --cpu")
    p.add_argument("--head-dim", type=positive, action="append", help="only this head dim (repeatable)")
    p.add_argument("--seqlen", type=positive, action="append", help="only this seqlen (repeatable)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="only causal (--causal) or only non-causal (--no-causal) configurations (default both)")
    p.add_argument("--no-baselines", action="store_true", help="time cuflash only")
    p.add_argument("--backward", action="store_true",
                   help="also time the backward (the kernel cuflash's dispatcher picks, and SDPA flash's with torch)")
    p.add_argument("--decode", action="store_true",
                   help="also time a paged decode step (attention_with_kvcache) against the copy bandwidth")
    p.add_argument("--fp8", action="store_true",
                   help="also time the fp8 KV-cache decode (and the fp8 forward when a kernel has it) beside an fp8 "
                        "GEMM (torch._scaled_mm) and cuDNN's fp8 attention where a framework exposes it")
    p.add_argument("--warmup", type=cli.int_at_least(0), default=None,
                   help=f"warm-up calls per measurement (default {GPU_WARMUP}; {CPU_WARMUP} with --cpu)")
    p.add_argument("--iters", type=positive, default=None,
                   help=f"timed calls per measurement; the median is reported (default {GPU_ITERS}; {CPU_ITERS} with "
                        "--cpu, half as many above S=2048)")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON to FILE ('-' for stdout, table on stderr)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="save throughput against seqlen (needs matplotlib: the bench extra)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar when stderr is a terminal; with --cpu a line per measurement)")
    p.add_argument("--cpu", action="store_true",
                   help=f"time the CPU path instead (no GPU needed): cuflash on NumPy vs naive NumPy and torch's "
                        f"CPU SDPA, B={cpu_bench.B} H={cpu_bench.H} D={cpu_bench.D} float32, S 2048/8192 (--seqlen, "
                        "--causal, --no-baselines, --warmup, --iters, --json, --plot, --no-progress apply)")
    p.add_argument("--compare", nargs=2, metavar=("BASE.json", "NEW.json"),
                   help="compare two saved pytest-benchmark runs by their ratios to the baselines; exit 1 on a "
                        "regression (no GPU needed)")
    p.add_argument("--tolerance", type=cli.float_above(0.0), default=None,
                   help="with --compare: how much a ratio may grow before it counts as a regression (default 0.25)")
    return p


def _given(parser: argparse.ArgumentParser, args) -> dict[str, object]:
    """The flags given on the command line (those whose value is not the default), by flag name."""
    flags = {}
    for action in parser._actions:
        if action.dest in ("help",) or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value != action.default:
            flag = action.option_strings[0]
            flags["--no-causal" if action.dest == "causal" and value is False else flag] = value
    return flags


def _check_mode(parser: argparse.ArgumentParser, args) -> None:
    """parser.error for a flag the chosen mode (--compare, --cpu, the GPU sweep) does not honour."""
    given = _given(parser, args)
    if args.compare:
        extra = [f for f in given if f not in ("--compare", "--tolerance")]
        if extra:
            parser.error(f"{extra[0]} with --compare: --compare only reads two saved runs (it takes --tolerance)")
        return
    if "--tolerance" in given:
        parser.error("--tolerance applies to --compare only")
    if args.cpu:
        for flag in ("--quick", "--backward", "--decode", "--fp8"):
            if flag in given:
                parser.error(f"{flag} with --cpu: the CPU mode times the forward of B={cpu_bench.B} H={cpu_bench.H} "
                             f"D={cpu_bench.D} float32 (it takes --seqlen, --causal, --no-baselines, --warmup, --iters, "
                             "--json, --plot, --no-progress)")
        if any(d != "float32" for d in args.dtype or ()):
            parser.error(f"--dtype {next(d for d in args.dtype if d != 'float32')} with --cpu: the CPU mode times "
                         "float32")
        if any(d != cpu_bench.D for d in args.head_dim or ()):
            parser.error(f"--head-dim {next(d for d in args.head_dim if d != cpu_bench.D)} with --cpu: the CPU mode "
                         f"times D={cpu_bench.D}")
        return
    bad = [d for d in args.dtype or () if d not in DTYPES]
    if bad:
        parser.error(f"--dtype {bad[0]}: the GPU benchmark times {' and '.join(DTYPES)} (float32 with --cpu)")


def _matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


@cli.command(PROG)
def main(argv: list[str] | None = None) -> int:
    """``python -m cuflash bench``: the GPU sweep, ``--cpu`` or ``--compare``.

    Returns
    -------
    int
        0 on success; 1 when a cuflash result failed its check (or ``--compare`` found a
        regression); 2 for invalid arguments or no GPU (``python -m cuflash bench: error: ...``).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _check_mode(parser, args)
    if args.compare:
        from cuflash.tools import bench_compare

        tolerance = bench_compare.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
        return bench_compare.main(*args.compare, tolerance=tolerance)
    if args.plot and _matplotlib_missing():
        return cli.error(PROG, "--plot needs matplotlib, which is not installed: pip install 'cuflash[bench]' "
                               "(from a source checkout: pip install '.[bench]')")
    if args.cpu:
        return cpu_bench.main(seqlens=args.seqlen, rounds=CPU_ITERS if args.iters is None else args.iters,
                              warmup=CPU_WARMUP if args.warmup is None else args.warmup,
                              no_baselines=args.no_baselines, causal=args.causal, progress=not args.no_progress,
                              json_path=args.json, plot_path=args.plot)
    ok, device = gpu_available()
    if not ok:
        return cli.error(PROG, f"{device}. The benchmark needs a GPU (the simulator is not benchmarked); nothing "
                               "was measured (--cpu times the CPU path)")
    configs = sweep(args.quick, dtypes=args.dtype, head_dims=args.head_dim, seqlens=args.seqlen, causal=args.causal)

    t0 = time.perf_counter()
    timer = Timer(GPU_WARMUP if args.warmup is None else args.warmup, GPU_ITERS if args.iters is None else args.iters)
    from cuflash.tools import check

    arch = int(timer.cupy.cuda.Device().compute_capability)
    plan_line = check.device_plan(device, arch)   # the tiers that run here and the roofline preset to compare with
    peak, peak_src = matmul_peak_tflops(timer, dtype=peak_dtype(arch))
    torch_ok = _have_torch_cuda()
    records: list[dict] = []
    for cfg in cli.progress(configs, "cuflash bench", enabled=not args.no_progress, label=lambda c: c.label):
        impls = ("cuflash",) + (() if args.no_baselines else baselines_for(cfg, args.quick, arch))
        if args.backward:
            impls += IMPLS_BWD[:1] if args.no_baselines else IMPLS_BWD
        if not torch_ok:
            impls = tuple(i for i in impls if not i.startswith("torch"))
        records.extend(run_config(cfg, timer, impls, peak))
    add_ratios(records)
    table = format_table(records, peak, peak_src, device)
    bad = [r for r in records if (r["impl"] in ("cuflash", "cuflash_simt") and
           (r["error"] or r["max_error"] is None or r["max_error"] > CHECK_TOL[r["dtype"]]))
           or (r["impl"] == "cuflash_bwd" and r["error"])]
    summary = (f"{len(configs)} configurations in {time.perf_counter() - t0:.0f} s; "
               + (f"{len(bad)} cuflash result(s) FAILED the correctness check or did not run" if bad
                  else "every cuflash result passed its correctness check"))
    if args.json:
        doc = dict(device=device, plan=plan_line, matmul_peak_tflops=peak, matmul_peak_source=peak_src, tokens=TOKENS,
                   hidden=HIDDEN, records=records)
        if args.json == "-":
            json.dump(doc, sys.stdout, indent=1)
            print(file=sys.stdout)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
    if args.plot:
        plot(records, args.plot)
    out = sys.stderr if args.json == "-" else sys.stdout
    if args.decode:
        from cuflash.tools import bench_decode

        print(bench_decode.format_table(bench_decode.run(timer), device), file=out)
    if args.fp8:
        from cuflash.tools import bench_fp8

        print(bench_fp8.format_table(bench_fp8.run(timer), device), file=out)
    print(plan_line, file=out)
    print(table, file=out)
    print(summary, file=out)
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
