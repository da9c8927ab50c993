"""The benchmark tooling that needs no GPU: ``bench --cpu``, the time ratios of saved runs and
the regression check on them (``bench --compare``), and where runs are saved."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

import cuflash
from cuflash.tools import bench, bench_compare, cpu_bench


def _bench(fullname, impl, median, case="S=2048 full", **extra):
    return {"fullname": fullname, "extra_info": dict(impl=impl, case=case, **extra), "stats": {"median": median}}


def _run(times: dict, case="S=2048 full"):
    return [_bench(f"tests/b.py::test_forward[{impl}-{case}]", impl, t, case=case) for impl, t in times.items()]


def test_time_ratios_are_cuflash_over_each_baseline_of_its_group():
    benches = _run({"cuflash": 0.05, "naive_numpy": 0.10, "torch_sdpa": 0.04}) + _run(
        {"cuflash": 0.8, "naive_numpy": 3.2}, case="S=8192 full")
    benches.append(_bench("tests/g.py::test_forward[cuflash-x]", "cuflash", 1.0, case=None, config="bf16", ms=2.0))
    benches.append(_bench("tests/g.py::test_forward[cupy_naive-x]", "cupy_naive", 9.0, case=None, config="bf16", ms=8.0))
    bench_compare.add_time_ratios(benches)
    ours = benches[0]["extra_info"]
    assert ours["time_ratio_to_naive_numpy"] == pytest.approx(0.5)
    assert ours["time_ratio_to_torch_sdpa"] == pytest.approx(1.25)
    assert benches[3]["extra_info"]["time_ratio_to_naive_numpy"] == pytest.approx(0.25)  # its own case only
    assert "time_ratio_to_torch_sdpa" not in benches[3]["extra_info"]
    assert benches[5]["extra_info"]["time_ratio_to_cupy_naive"] == pytest.approx(0.25)  # CUDA-event ms, not wall
    assert not any(k.startswith("time_ratio") for k in benches[1]["extra_info"])  # baselines get none


def _doc(times, case="S=2048 full"):
    benches = _run(times, case)
    bench_compare.add_time_ratios(benches)
    return {"benchmarks": benches}


def test_compare_passes_noise_and_fails_a_slowdown_or_a_lost_benchmark(tmp_path, capsys):
    base = _doc({"cuflash": 0.05, "naive_numpy": 0.10})
    noisy = _doc({"cuflash": 0.11, "naive_numpy": 0.20})       # a busy machine: both 2x slower, ratio same
    slower = _doc({"cuflash": 0.08, "naive_numpy": 0.10})      # cuflash 60% slower
    rows, problems = bench_compare.compare(base, noisy)
    assert problems == [] and rows[0]["verdict"] == "ok"
    rows, problems = bench_compare.compare(base, slower)
    assert len(problems) == 1 and "+60% > 25%" in problems[0] and rows[0]["verdict"] == "REGRESSION"
    assert bench_compare.compare(base, slower, tolerance=0.7)[1] == []
    rows, problems = bench_compare.compare(base, {"benchmarks": []})
    assert "missing from the new one" in problems[0]
    assert "no time_ratio_to_* entries" in bench_compare.compare({"benchmarks": []}, base)[1][0]
    paths = []
    for name, doc in (("base", base), ("noisy", noisy), ("slower", slower)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    assert bench.main(["--compare", str(paths[0]), str(paths[1])]) == 0
    assert "no ratio grew by more than 25%" in capsys.readouterr().out
    assert bench.main(["--compare", str(paths[0]), str(paths[2])]) == 1
    assert "1 regression(s) beyond 25%" in capsys.readouterr().out
    assert bench.main(["--compare", str(paths[0]), str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    table = tmp_path / "table.json"          # what `bench --json` writes: rows, not a saved run
    table.write_text(json.dumps([{"impl": "cuflash", "ms": 1.0}]))
    for other in (table, tmp_path / "empty.json"):
        other.write_text(other.read_text() if other.exists() else "{}")
        assert bench.main(["--compare", str(other), str(other)]) == 2
        assert "is not a saved pytest-benchmark run" in capsys.readouterr().err


def test_machine_name_is_a_folder_name(monkeypatch):
    name = bench_compare.machine_name()
    assert name and all(c.isalnum() or c in "._-" for c in name)


def test_saved_runs_go_to_a_folder_named_for_the_machine(monkeypatch):
    monkeypatch.setattr(bench_compare, "machine_name", lambda: "Some-CPU-2cpu")

    def option(storage="file://./.benchmarks", autosave=True, compare=()):
        return types.SimpleNamespace(benchmark_storage=storage, benchmark_autosave=autosave, benchmark_save=None,
                                     benchmark_compare=list(compare))

    opt = option()
    bench_compare.storage_per_machine(opt)
    assert opt.benchmark_storage == "file://./.benchmarks/Some-CPU-2cpu"
    opt = option(autosave=False, compare=["0001"])
    bench_compare.storage_per_machine(opt)
    assert opt.benchmark_storage == "file://./.benchmarks/Some-CPU-2cpu"
    opt = option(storage="file:///elsewhere")
    bench_compare.storage_per_machine(opt)
    assert opt.benchmark_storage == "file:///elsewhere"  # an explicit storage is left alone
    opt = option(autosave=False)
    bench_compare.storage_per_machine(opt)
    assert opt.benchmark_storage == "file://./.benchmarks"  # nothing saved or compared: untouched


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", cpu_bench.IMPLS)
def test_cpu_runners_compute_attention(impl, causal, rng):
    if impl == "torch_sdpa" and not cpu_bench.have_torch():
        pytest.skip("torch is not installed")
    q, k, v = (rng.standard_normal((1, 2, 70, 16)).astype(np.float32) for _ in range(3))
    out = cpu_bench.runner(impl, q, k, v, causal)()
    np.testing.assert_allclose(out, cuflash.reference.naive_attention(q, k, v, causal=causal), atol=2e-5)


def test_cpu_table_says_how_much_faster_or_slower_cuflash_is(monkeypatch):
    """The table's last column is in words (a bare time ratio, lower = faster, reads as a speedup):
    from the seconds measured in the same run, cuflash against each baseline's row."""
    seconds = {"cuflash": 0.05, "naive_numpy": 0.10, "torch_sdpa": 0.04}
    monkeypatch.setattr(cpu_bench, "runner", lambda impl, *a: impl)
    monkeypatch.setattr(cpu_bench, "median_seconds", lambda impl, rounds, warmup: seconds[impl])
    records = cpu_bench.measure(cpu_bench.cases((16,), False), list(seconds), rounds=1)
    head, cols, *rows = cpu_bench.format_table(records, 2).splitlines()
    assert "cuflash against that row" in head and cols.split()[-2:] == ["cuflash", "is"]
    assert rows[0].split() == ["S=16", "full", "cuflash", "0.050", "0.0"]   # cuflash's own row: no words
    assert rows[1].endswith("2.00x faster") and rows[2].endswith("1.25x slower")
    assert [cpu_bench.versus(r) for r in (0.999, 1.0, float("nan"), 0.0)] == ["as fast", "as fast", "-", "-"]


def test_bench_cpu_prints_the_table(capsys):
    assert bench.main(["--cpu", "--seqlen", "128", "--iters", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "cuflash bench --cpu: B=1 H=8 D=64 float32" in out
    for case in ("S=128 full", "S=128 causal"):
        assert f"{case:<16} cuflash" in out and f"{case:<16} naive_numpy" in out
    with pytest.raises(ValueError, match="unknown implementation 'tpu'"):
        cpu_bench.runner("tpu", None, None, None, False)
