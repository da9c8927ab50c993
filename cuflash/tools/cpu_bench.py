"""``python -m cuflash bench --cpu``: the CPU path against what a CPU user already has.

The seed's example size, B=1, H=8, D=64, float32, at S = 2048 and 8192, causal or not:
``cuflash.attention`` on NumPy arrays (the tiled NumPy path, threaded), naive NumPy attention
(S and P materialised in float32, what a user writes) and, when torch is importable, torch's CPU
``scaled_dot_product_attention`` (its math and flash CPU kernels; torch picks). Each is timed
with ``time.perf_counter`` after one warm-up call; the median of the rounds is reported, with
cuflash's ratio to each baseline measured in the same run (ratios survive a noisy machine where
absolute times do not). The same cases and runners serve the pytest-benchmark file
``tests/benchmarks/test_cpu_path.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np

B, H, D = 1, 8, 64
SEQLENS = (2048, 8192)
IMPLS = ("cuflash", "naive_numpy", "torch_sdpa")


@dataclasses.dataclass(frozen=True)
class CpuCase:
    seqlen: int
    causal: bool

    @property
    def label(self) -> str:
        return f"S={self.seqlen} {'causal' if self.causal else 'full'}"

    @property
    def flops(self) -> int:
        """``4 * B * H * S^2 * D``, halved for causal (flash-attn's convention)."""
        return 4 * B * H * self.seqlen**2 * D // (2 if self.causal else 1)


def cases(seqlens=SEQLENS) -> list[CpuCase]:
    return [CpuCase(s, c) for s in seqlens for c in (False, True)]


def make_inputs(case: CpuCase, seed: int = 2048):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, case.seqlen, D)).astype(np.float32) for _ in range(3))


def naive_numpy(q, k, v, causal: bool):
    """What a user writes in NumPy: S and P materialised in float32 (causal bottom-right)."""
    s = (q @ k.swapaxes(-1, -2)) * np.float32(1 / np.sqrt(q.shape[-1]))
    if causal:
        sq, sk = s.shape[-2:]
        s = np.where(np.tri(sq, sk, sk - sq, dtype=bool), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def runner(impl: str, q, k, v, causal: bool):
    """A no-argument callable computing attention with ``impl`` (one of :data:`IMPLS`)."""
    if impl == "cuflash":
        import cuflash

        return lambda: cuflash.attention(q, k, v, causal=causal)
    if impl == "naive_numpy":
        return lambda: naive_numpy(q, k, v, causal)
    if impl == "torch_sdpa":
        import torch

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

        def run():
            with torch.no_grad():  # top-left is_causal equals bottom-right for Sq == Sk
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).numpy()

        return run
    raise ValueError(f"cuflash bench --cpu: unknown implementation {impl!r}; expected one of {IMPLS}")


def median_seconds(fn, rounds: int) -> float:
    fn()  # warm-up: the pool, the BLAS library, torch's kernels
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(case_list, impls, rounds: int, progress=None) -> list[dict]:
    """One record per (case, impl): ``seconds`` (median), ``gflops``, and for cuflash
    ``time_ratio_to_<impl>`` (cuflash seconds / that baseline's, same run)."""
    records = []
    for case in case_list:
        q, k, v = make_inputs(case)
        rows = {}
        for impl in impls:
            sec = median_seconds(runner(impl, q, k, v, case.causal), rounds if case.seqlen <= 2048 else max(1, rounds // 2))
            rows[impl] = dict(case=case.label, seqlen=case.seqlen, causal=case.causal, impl=impl, seconds=sec,
                              gflops=case.flops / sec / 1e9)
            if progress:
                progress(f"  {case.label:<16} {impl:<12} {sec:8.3f} s")
        if "cuflash" in rows:
            for impl, r in rows.items():
                if impl != "cuflash":
                    rows["cuflash"][f"time_ratio_to_{impl}"] = rows["cuflash"]["seconds"] / r["seconds"]
        records.extend(rows.values())
    return records


def format_table(records: list[dict], threads: int) -> str:
    lines = [f"cuflash bench --cpu: B={B} H={H} D={D} float32, {threads} threads (CUFLASH_NUM_THREADS); "
             "median seconds, GFLOP/s (4*B*H*S^2*D, halved causal); ratio = cuflash / baseline, same run",
             f"{'case':<16} {'impl':<12} {'seconds':>9} {'GFLOP/s':>9} {'cuflash/this':>13}"]
    by_case: dict = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, rows in by_case.items():
        ours = rows.get("cuflash", {})
        for impl, r in rows.items():
            ratio = "" if impl == "cuflash" else f"{ours.get('time_ratio_to_' + impl, float('nan')):.2f}x"
            lines.append(f"{case:<16} {impl:<12} {r['seconds']:9.3f} {r['gflops']:9.1f} {ratio:>13}")
    return "\n".join(lines)


def main(seqlens=None, rounds: int = 5, no_baselines: bool = False, out=None) -> int:
    """Print the table; 0 on success. ``seqlens`` None means :data:`SEQLENS`."""
    from cuflash.runtime import threads

    out = out or sys.stdout
    impls = ["cuflash"]
    if not no_baselines:
        impls.append("naive_numpy")
        if have_torch():
            impls.append("torch_sdpa")
    case_list = cases(tuple(seqlens) if seqlens else SEQLENS)
    records = measure(case_list, impls, rounds, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(records, threads.num_threads()), file=out)
    if "torch_sdpa" not in impls and not no_baselines:
        print("(torch is not installed: no SDPA baseline)", file=out)
    return 0
