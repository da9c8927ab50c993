"""``python -m cuflash bench --cpu``: the CPU path against what a CPU user already has.

A small forward problem, B=1, H=8, D=64, float32, at S = 2048 and 8192, causal or not:
``cuflash.attention`` on NumPy arrays (the tiled NumPy path, threaded), naive NumPy attention
(S and P materialised in float32, what a user writes) and, when torch is importable, torch's CPU
``scaled_dot_product_attention`` (its math and flash CPU kernels; torch picks). Each is timed
with ``time.perf_counter`` after warm-up calls (one by default); the median of the rounds is
reported, with how much faster or slower cuflash is than each baseline in the same run (ratios
survive a noisy machine where absolute times do not). The records can be saved as JSON (:func:`document`) and
drawn as GFLOP/s against the sequence length (:func:`plot`, matplotlib). The same cases and runners serve the pytest-benchmark file
``tests/benchmarks/test_cpu_path.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
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


def cases(seqlens=SEQLENS, causal: bool | None = None) -> list[CpuCase]:
    """Every ``(seqlen, causal)`` case; ``causal`` None means both masks."""
    masks = (False, True) if causal is None else (causal,)
    return [CpuCase(s, c) for s in seqlens for c in masks]


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


def median_seconds(fn, rounds: int, warmup: int = 1) -> float:
    """Median seconds of ``rounds`` timed calls of ``fn()`` after ``warmup`` untimed ones (the
    thread pool, the BLAS library, torch's kernels)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(case_list, impls, rounds: int, progress=None, warmup: int = 1) -> list[dict]:
    """One record per (case, impl): ``seconds`` (median of ``rounds`` calls, half as many above
    S = 2048), ``gflops``, and for cuflash ``time_ratio_to_<impl>`` (cuflash seconds / that
    baseline's, same run)."""
    records = []
    for case in case_list:
        q, k, v = make_inputs(case)
        rows = {}
        for impl in impls:
            sec = median_seconds(runner(impl, q, k, v, case.causal),
                                 rounds if case.seqlen <= 2048 else max(1, rounds // 2), warmup)
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


def versus(time_ratio: float) -> str:
    """cuflash against a baseline in words, from ``time_ratio`` (cuflash's seconds over the
    baseline's): ``"2.00x faster"`` for 0.5, ``"1.25x slower"`` for 1.25, ``"as fast"`` when
    they round alike, ``"-"`` when either time is missing."""
    if not math.isfinite(time_ratio) or time_ratio <= 0:
        return "-"
    if f"{time_ratio:.2f}" == "1.00" and f"{1 / time_ratio:.2f}" == "1.00":
        return "as fast"
    return f"{1 / time_ratio:.2f}x faster" if time_ratio < 1 else f"{time_ratio:.2f}x slower"


def format_table(records: list[dict], threads: int) -> str:
    """The table :func:`main` prints: one row per (case, impl); a baseline's row says how cuflash
    compares with it (:func:`versus`), from the median seconds of the same run."""
    lines = [f"cuflash bench --cpu: B={B} H={H} D={D} float32, {threads} threads (CUFLASH_NUM_THREADS); "
             "median seconds, GFLOP/s (4*B*H*S^2*D, halved causal); last column: cuflash against that row, "
             "from the seconds of the same run",
             f"{'case':<16} {'impl':<12} {'seconds':>9} {'GFLOP/s':>9}  cuflash is"]
    by_case: dict = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, rows in by_case.items():
        ours = rows.get("cuflash", {})
        for impl, r in rows.items():
            words = "" if impl == "cuflash" else versus(ours.get("time_ratio_to_" + impl, float("nan")))
            lines.append(f"{case:<16} {impl:<12} {r['seconds']:9.3f} {r['gflops']:9.1f}  {words}".rstrip())
    return "\n".join(lines)


def document(records: list[dict], threads: int) -> dict:
    """The JSON document of a run: the problem, the thread count and the records."""
    return dict(mode="cpu", batch=B, heads=H, head_dim=D, dtype="float32", threads=threads,
                flops="4*B*H*S^2*D, halved causal", records=records)


def plot(records: list[dict], path: str) -> None:
    """GFLOP/s against the sequence length, one line per implementation, one panel per mask
    (matplotlib, written to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    masks = sorted({r["causal"] for r in records})
    fig, axes = plt.subplots(1, len(masks), figsize=(4.6 * len(masks), 3.6), squeeze=False)
    for ax, causal in zip(axes.flat, masks):
        for impl in IMPLS:
            pts = sorted((r["seqlen"], r["gflops"]) for r in records if (r["causal"], r["impl"]) == (causal, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"B={B} H={H} D={D} float32, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("GFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(seqlens=None, rounds: int = 5, no_baselines: bool = False, out=None, *, warmup: int = 1,
         causal: bool | None = None, progress: bool = True, json_path: str | None = None,
         plot_path: str | None = None) -> int:
    """Measure and print the table; 0 on success.

    ``seqlens`` None means :data:`SEQLENS`; ``causal`` None both masks; ``progress`` prints a
    line per measurement to stderr; ``json_path`` writes :func:`document` there (``"-"``: to
    stdout, the table then going to stderr); ``plot_path`` writes :func:`plot` there.
    """
    from cuflash.runtime import threads

    out = out or (sys.stderr if json_path == "-" else sys.stdout)
    impls = ["cuflash"]
    if not no_baselines:
        impls.append("naive_numpy")
        if have_torch():
            impls.append("torch_sdpa")
    case_list = cases(tuple(seqlens) if seqlens else SEQLENS, causal)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else None
    records = measure(case_list, impls, rounds, progress=say, warmup=warmup)
    # the files first: the text may go to a reader that stops early (| head)
    if json_path is not None:
        text = json.dumps(document(records, threads.num_threads()), indent=1)
        if json_path == "-":
            print(text)
        else:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if plot_path is not None:
        plot(records, plot_path)
    print(format_table(records, threads.num_threads()), file=out)
    if "torch_sdpa" not in impls and not no_baselines:
        print("(torch is not installed: no SDPA baseline)", file=out)
    for what, path in (("records", json_path), ("plot", plot_path)):
        if path not in (None, "-"):
            print(f"{what} written to {path}", file=out)
    return 0
