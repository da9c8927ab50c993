"""The T4 and V100 presets (``--device t4``, ``--device v100``) and how ``check`` and ``bench``
recognise a device from the description CUDA gives (its name and compute capability), with
faked descriptions: no GPU is needed."""

from __future__ import annotations

import sys

import pytest

from cuflash.analysis import intensity, roofline
from cuflash.runtime import cuda_runner
from cuflash.tools import bench, check


@pytest.mark.parametrize("key, arch, sms, tensor, fp32, gb_s, smem_kb", [
    ("t4", 75, 40, 65.0, 8.1, 320.0, 64),       # NVIDIA T4 datasheet; compute capability 7.5
    ("v100", 70, 80, 125.0, 15.7, 900.0, 96),   # NVIDIA V100 datasheet (SXM2); compute capability 7.0
])
def test_the_presets_carry_the_datasheet_figures_and_reproduce_its_peaks(key, arch, sms, tensor, fp32, gb_s, smem_kb):
    r = roofline.RATES[key]
    assert r.device is intensity.DEVICES[key]
    assert (r.arch, r.sms, r.device.fp16_tensor_tflops, r.device.fp32_tflops, r.device.hbm_gb_per_s) == (
        arch, sms, tensor, fp32, gb_s)
    assert r.smem_per_sm == smem_kb * 1024 and r.wgmma_macs == 0
    # the per-SM rates at the derived clock give back both datasheet peaks (8 tensor cores of 64
    # FP16 FMA and 64 FP32 lanes per SM): within 1%
    clock = r.clock_ghz * 1e9
    assert r.sms * 2 * r.mma_sync_macs * clock / 1e12 == pytest.approx(tensor, rel=1e-3)
    assert r.sms * 2 * r.fp32_lanes * clock / 1e12 == pytest.approx(fp32, rel=1e-2)
    with pytest.raises(ValueError, match="no TF32 tensor cores"):
        r.device.peak_tflops("float32", tf32=True)


@pytest.mark.parametrize("name, arch, want", [
    ("Tesla T4", 75, "t4"), ("Tesla V100-SXM2-16GB", 70, "v100"), ("Tesla V100-PCIE-32GB", 70, "v100"),
    ("NVIDIA H200", 90, "h200"), ("NVIDIA H100 80GB HBM3", 90, "h100"), ("NVIDIA A100-SXM4-80GB", 80, "a100"),
    ("NVIDIA GeForce RTX 2080 Ti", 75, None),   # sm_75 too, other rates
    ("Tesla T4", 80, None),                       # a name that does not match its compute capability
])
def test_a_device_is_recognised_by_name_and_compute_capability(name, arch, want):
    assert roofline.preset_for(name, arch) == want


def test_check_names_the_tiers_and_the_preset_of_a_t4():
    line = check.device_plan("Tesla T4", 75)
    # float16 forward on the tensor cores' sm_75 form; its backward has no head-dim-128 tile in 64 KB
    assert line.startswith("Tesla T4 (sm_75): float16: forward on the tensor-core mma.sync tier, backward on the "
                           "portable SIMT tier; bfloat16: forward on the portable SIMT tier"), line
    assert "roofline: python -m cuflash roofline --device t4 (T4: 65 TFLOP/s fp16 tensor, 8.1 fp32, 320 GB/s" in line


def test_check_says_a_v100_needs_the_cuda12_extra_under_cuda13(monkeypatch):
    monkeypatch.setattr(cuda_runner, "nvrtc_majors", lambda: (13,))
    line = check.device_plan("Tesla V100-SXM2-16GB", 70)
    assert "float16: no kernel (" in line and "install the cuda12 extra" in line, line
    assert "--device v100 (V100 SXM2: 125 TFLOP/s fp16 tensor, 15.7 fp32, 900 GB/s" in line
    monkeypatch.setattr(cuda_runner, "nvrtc_majors", lambda: (12, 13))
    assert "float16: forward on the portable SIMT tier" in check.device_plan("Tesla V100-SXM2-16GB", 70)


def test_the_device_section_logs_the_plan(monkeypatch):
    fake = {"name": "Tesla T4", "id": 0, "arch": 75, "total_gib": 15.0, "free_gib": 14.5, "cupy": "13.x",
            "runtime": 12080, "driver": 12080, "nvrtc": "12.9"}
    monkeypatch.setattr(check, "_device_info", lambda: fake)
    for mod in ("torch", "jax"):   # (as if absent: the section only names their versions)
        monkeypatch.setitem(sys.modules, mod, None)
    lines = []
    check.section_device(None, lines.append)
    assert check.device_plan("Tesla T4", 75) in lines


def test_bench_measures_the_peak_and_the_quick_bar_in_fp16_before_sm80():
    assert [bench.peak_dtype(a) for a in (70, 75, 80, 90)] == ["float16", "float16", "bfloat16", "bfloat16"]
    bar_fp16 = bench.Config("float16", 128, 8192, False)
    bar_bf16 = bench.Config("bfloat16", 128, 8192, False)
    assert bench.baselines_for(bar_fp16, True, 75) and not bench.baselines_for(bar_bf16, True, 75)
    assert bench.baselines_for(bar_bf16, True, 90) and not bench.baselines_for(bar_fp16, True, 90)


def test_roofline_prints_the_t4_ceiling_and_its_binding_pipe(capsys):
    """The tensor-core tier's sm_75 form (what a T4 runs in float16) from its sm_75 SASS with the
    T4's rates: a prediction, at most the fp16 tensor peak."""
    assert roofline.main(["--device", "t4", "--head-dim", "64", "--dtype", "fp16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "MODEL, not a measurement: per-SM rates of the T4 (sm_75, 40 SMs at 1.59 GHz)" in " ".join(out.split())
    (row,) = [ln for ln in out.splitlines() if ln.startswith("fwd_mma_f16_d64_")]
    assert row.startswith("fwd_mma_f16_d64_m128_n32_s1") and row.split()[2] == "2"   # two CTAs per SM
    bound, ceiling = row.split()[-2:]
    assert bound in ("tensor", "issue", "smem", "mufu", "fp32", "hbm") and 0 < float(ceiling) <= 65


def test_roofline_decode_refuses_a_device_without_the_kvcache_kernel(capsys):
    with pytest.raises(SystemExit):
        roofline.main(["--device", "v100", "--decode"])
    assert "--decode models the KV-cache kernel, which runs on sm_75 and newer; --device v100 is sm_70" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):   # the T4's is the sm_75 form: float16 only
        roofline.main(["--device", "t4", "--decode"])
    assert "its KV-cache kernel computes float16 (no bfloat16 tensor cores); add --dtype fp16" in capsys.readouterr().err
