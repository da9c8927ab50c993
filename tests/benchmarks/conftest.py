"""pytest-benchmark hooks of the benchmark files: time ratios to the baselines in saved runs."""

from __future__ import annotations


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Each cuflash benchmark's ``time_ratio_to_<baseline>`` (same run) goes into its
    ``extra_info``, so a saved run can be compared on ratios (``python -m cuflash bench --compare``)."""
    from cuflash.tools import bench_compare

    bench_compare.add_time_ratios(output_json["benchmarks"])
