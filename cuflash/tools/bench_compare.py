"""``python -m cuflash bench --compare BASE.json NEW.json``: a regression check on saved runs.

The files are pytest-benchmark's saved runs (``--benchmark-autosave`` or ``--benchmark-json``;
``tests/benchmarks/conftest.py`` stores them under ``.benchmarks/<machine>/``). Each cuflash
benchmark carries, in ``extra_info``, its time ratio to every baseline measured in the same run
(``time_ratio_to_naive_numpy``, ``time_ratio_to_torch_sdpa``, ``time_ratio_to_cuflash_simt``,
...: cuflash's time divided by the baseline's, lower is better), added when the run is saved
(:func:`add_time_ratios`, from ``tests/benchmarks/conftest.py``). Ratios are compared rather than absolute times because they
survive a busy or a different machine: a regression is a ratio that grew by more than the
tolerance (default 25%) over the baseline run's. pytest-benchmark's own
``--benchmark-compare-fail`` works on absolute times only (min, max, mean, median, ...), which is
the right check on a quiet, dedicated machine; the README shows both.
"""

from __future__ import annotations

import json
import sys

from cuflash.analysis import cli

DEFAULT_TOLERANCE = 0.25
#: implementations that are cuflash's own; every other ``impl`` of a group is a baseline
OURS = ("cuflash", "cuflash_bwd", "cuflash_fwd_bwd")


def machine_name() -> str:
    """A folder name for this machine's saved runs: the GPU's name when CuPy sees one (e.g.
    ``NVIDIA-H200``), else the CPU model and the CPUs this process may use (``AMD-EPYC-2cpu``);
    characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-``."""
    import os
    import platform
    import re

    from cuflash.runtime.interop import device_name, require_cuda

    try:
        name = device_name(require_cuda("cuflash bench").cuda.Device().id)
    except RuntimeError:  # no CuPy, no driver, no device: a CPU machine
        name = None
    if name is None:
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        model = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        name = f"{model}-{cpus}cpu"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "unknown-machine"


#: pytest-benchmark's default ``--benchmark-storage``
DEFAULT_STORAGE = "file://./.benchmarks"


def storage_per_machine(option) -> None:
    """Point pytest-benchmark's storage at ``.benchmarks/<machine>/`` (:func:`machine_name`) when
    a run is saved or compared, so runs of different machines are never compared by accident.
    ``option`` is pytest's ``config.option``; an explicit ``--benchmark-storage`` is left alone."""
    saving = getattr(option, "benchmark_autosave", False) or getattr(option, "benchmark_save", None)
    comparing = bool(getattr(option, "benchmark_compare", None))
    if (saving or comparing) and getattr(option, "benchmark_storage", None) == DEFAULT_STORAGE:
        option.benchmark_storage = f"{DEFAULT_STORAGE}/{machine_name()}"


def _seconds(bench: dict) -> float | None:
    """A benchmark's time: its CUDA-event median (``extra_info["ms"]``) when it has one, else
    pytest-benchmark's wall-clock median."""
    extra = bench.get("extra_info") or {}
    if isinstance(extra.get("ms"), (int, float)):
        return extra["ms"] * 1e-3
    stats = bench.get("stats") or {}
    return stats.get("median")


def add_time_ratios(benchmarks: list[dict]) -> None:
    """Put ``time_ratio_to_<baseline>`` into the ``extra_info`` of each of cuflash's benchmarks.

    Benchmarks are grouped by test function, case (``extra_info["case"]`` or ``["config"]``) and
    FLOP factor (forward, backward, forward + backward); within a group, each benchmark whose
    ``extra_info["impl"]`` is one of :data:`OURS` gets its time divided by every other impl's."""
    groups: dict = {}
    for bench in benchmarks:
        extra = bench.get("extra_info") or {}
        if "impl" not in extra:
            continue
        key = (bench["fullname"].split("[")[0], extra.get("case", extra.get("config")), extra.get("flops_factor"))
        groups.setdefault(key, []).append(bench)
    for members in groups.values():
        for ours in members:
            t = _seconds(ours)
            if ours["extra_info"]["impl"] not in OURS or not t:
                continue
            for other in members:
                base = _seconds(other)
                if other is not ours and base:
                    ours["extra_info"][f"time_ratio_to_{other['extra_info']['impl']}"] = t / base


def ratios(doc: dict) -> dict:
    """``{(benchmark fullname, ratio name): value}`` of a saved pytest-benchmark run."""
    found = {}
    for bench in doc.get("benchmarks", []):
        for key, value in (bench.get("extra_info") or {}).items():
            if key.startswith("time_ratio_to_") and isinstance(value, (int, float)):
                found[(bench["fullname"], key)] = float(value)
    return found


def compare(base: dict, new: dict, tolerance: float = DEFAULT_TOLERANCE) -> tuple[list[dict], list[str]]:
    """Rows of the comparison and the problems found.

    A problem is a ratio that grew by more than ``tolerance`` (a fraction), or a ratio of the
    base run missing from the new one (a benchmark lost counts as a failure, never as a pass).
    Ratios only in the new run are listed without a verdict.
    """
    b, n = ratios(base), ratios(new)
    rows, problems = [], []
    for key in sorted(set(b) | set(n)):
        name, which = key
        old, cur = b.get(key), n.get(key)
        if cur is None:
            problems.append(f"{name} {which}: in the base run ({old:.3f}) but missing from the new one")
            rows.append(dict(name=name, ratio=which, base=old, new=None, change=None, verdict="MISSING"))
            continue
        if old is None:
            rows.append(dict(name=name, ratio=which, base=None, new=cur, change=None, verdict="new"))
            continue
        change = cur / old - 1.0
        verdict = "REGRESSION" if change > tolerance else "ok"
        if verdict != "ok":
            problems.append(f"{name} {which}: {old:.3f} -> {cur:.3f} ({change:+.0%} > {tolerance:.0%})")
        rows.append(dict(name=name, ratio=which, base=old, new=cur, change=change, verdict=verdict))
    if not b:
        problems.append("the base run has no time_ratio_to_* entries (was it saved with --benchmark-enable, "
                        "with the baselines in the run?)")
    return rows, problems


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'benchmark':<44} {'ratio':<30} {'base':>7} {'new':>7} {'change':>8}  verdict"]
    for r in rows:
        def num(x):
            return f"{x:7.3f}" if x is not None else "      -"
        change = f"{r['change']:+8.0%}" if r["change"] is not None else "       -"
        lines.append(f"{r['name'].split('::')[-1]:<44} {r['ratio']:<30} {num(r['base'])} {num(r['new'])} {change}  {r['verdict']}")
    return "\n".join(lines)


def main(base_path: str, new_path: str, tolerance: float = DEFAULT_TOLERANCE, out=None) -> int:
    """Print the comparison; 0 when no ratio regressed, 1 otherwise, 2 for unreadable files."""
    out = out or sys.stdout
    docs = []
    for path in (base_path, new_path):
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            return cli.error("python -m cuflash bench", f"--compare: cannot read {path}: {exc}")
        if not isinstance(docs[-1], dict) or not isinstance(docs[-1].get("benchmarks"), list):
            return cli.error("python -m cuflash bench",
                             f"--compare: {path} is not a saved pytest-benchmark run (it has no "
                             f"'benchmarks' list); save runs with pytest's --benchmark-autosave or "
                             f"--benchmark-json (a 'bench --json' table cannot be compared)")
    rows, problems = compare(docs[0], docs[1], tolerance)
    print(format_rows(rows), file=out)
    if problems:
        print(f"{len(problems)} regression(s) beyond {tolerance:.0%}:", file=out)
        for p in problems:
            print(f"  {p}", file=out)
        return 1
    print(f"no ratio grew by more than {tolerance:.0%} ({len(rows)} compared)", file=out)
    return 0
