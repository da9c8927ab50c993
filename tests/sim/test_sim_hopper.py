"""The simulator's sm_90a machinery (cuflash/sim/cusim_sm90.h) on the probes of kernels_cu/hopper_probe.cu
and the planted faults of tests/sim/kernels/hopper_hazards.cu.

Expectations come from math: products of small integers (exact in float32) for the TMA-fed wgmma
GEMMs and the warp-specialized pipeline, the PTX ISA's stmatrix fragment for stmatrix, and for
every planted fault the error kind the simulator must report. The GEMMs run in normal mode under
several seeds (wgmma results and TMA loads land early or late by the seed) and in checked mode
(the proxy model and the in-flight rules), so a probe passing here has no hazard the simulator
models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.kernels import hopper_probe as hp
from cuflash.runtime import source
from cuflash.runtime.plan import LaunchPlan, TensorMapArg
from cuflash.sim import launcher

SEEDS = (0, 1, 2, 3)
KERNELS = Path(__file__).parent / "kernels"


def probe_source(name: str) -> str:
    return source.build_text((KERNELS / name).read_text(), origin=name, search_dirs=[KERNELS])


def _module(**opts):
    with sim.options(arch=90, **opts) as o:
        return launcher.load_source(source.build_source(hp.VARIANT), origin=hp.VARIANT.source, options=o), o


@pytest.fixture(scope="module")
def probes():
    return _module()


@pytest.fixture(scope="module")
def probes_checked():
    return _module(checked=True)


def _run(mod_opts, plan_, seed=None):
    mod, o = mod_opts
    if seed is None:
        return mod.launch(plan_, o)
    with sim.options(arch=90, checked=o.checked, seed=seed) as o2:
        return mod.launch(plan_, o2)


@pytest.mark.parametrize("swizzle,nmajor,a_regs", hp.GEMMS,
                         ids=[f"{'rs' if r else 'ss'}-sw{s}-{'nmajor' if n else 'kmajor'}" for s, n, r in hp.GEMMS])
@pytest.mark.parametrize("m,k", [(100, 64), (64, 192)])
def test_wgmma_gemm_from_tma_matches_numpy(probes, swizzle, nmajor, a_regs, m, k):
    """Every swizzle, both layouts of B (K-major as K in Q K^T, N-major as V in P V), A from shared
    memory and from registers; M = 100 leaves rows past M to the maps' zero fill and dropped rows."""
    for seed in SEEDS:
        a, b, c, expected = hp.gemm_inputs(m, k, nmajor, seed=seed)
        _run(probes, hp.plan_gemm(a, b, c, swizzle=swizzle, nmajor=nmajor, a_regs=a_regs), seed)
        np.testing.assert_array_equal(c, expected, err_msg=f"seed {seed}")


@pytest.mark.parametrize("swizzle,nmajor,a_regs", [(0, False, False), (128, True, False), (128, False, True),
                                                   (64, True, False)])
@pytest.mark.checked
def test_wgmma_gemm_checked(probes_checked, swizzle, nmajor, a_regs):
    a, b, c, expected = hp.gemm_inputs(100, 128, nmajor, seed=3)
    _run(probes_checked, hp.plan_gemm(a, b, c, swizzle=swizzle, nmajor=nmajor, a_regs=a_regs))
    np.testing.assert_array_equal(c, expected)


@pytest.mark.parametrize("checked", [False, True], ids=["normal", "checked"])
def test_hopper_pipeline_producer_and_consumer_warpgroups(probes, probes_checked, checked):
    """A producer warpgroup (setmaxnreg.dec, elect.sync, TMA into a 2-stage ring) and two consumer
    warpgroups (setmaxnreg.inc, wgmma) through full/empty mbarriers over 4 k-tiles (the ring wraps
    twice: both parities of both stages), a named barrier and a TMA store of C; 200 rows, two
    blocks, the second half past M."""
    mod = probes_checked if checked else probes
    for seed in (SEEDS[:1] if checked else SEEDS):
        a, b, c, expected = hp.gemm_inputs(200, 256, False, seed=seed)
        _run(mod, hp.plan_pipeline(a, b, c), seed)
        np.testing.assert_array_equal(c, expected, err_msg=f"seed {seed}")


def test_stmatrix_fragments(probes, probes_checked):
    for mod in (probes, probes_checked):
        out = np.zeros((6, 16, 16), np.uint16)
        _run(mod, hp.plan_stmatrix(out))
        np.testing.assert_array_equal(out, hp.expected_stmatrix())


def test_elect_sync_elects_one_lane_per_warp_and_not_always_lane_0(probes):
    leaders = []
    for seed in SEEDS:
        leader = np.full(4, -1, np.int32)
        winners = np.zeros(128, np.int32)
        _run(probes, hp.plan_elect(leader, winners), seed)
        assert set(winners.tolist()) == {1}
        assert ((leader >= 0) & (leader < 32)).all()
        leaders += leader.tolist()
    assert len(set(leaders)) > 1   # the PTX ISA does not say which lane: the seed draws it


# ----------------------------------------------------------------------------- tensor maps
def _swizzle_model(off: np.ndarray, span: int) -> np.ndarray:
    """The 16-byte-chunk XOR of the PTX ISA's swizzle modes, written out per span: 128 B XORs the
    chunk index (bits 4-6) with the 128-byte row (bits 7-9) within each 1024-byte pattern, 64 B
    bits 4-5 with 7-8 (512-byte pattern), 32 B bit 4 with bit 7 (256-byte pattern)."""
    if span == 0:
        return off
    chunk, row = (off // 16) % (span // 16), (off // 128) % (span // 16)
    return off - chunk * 16 + (chunk ^ row) * 16


@pytest.mark.parametrize("span", [32, 64, 128])
def test_the_swizzle_model_is_a_permutation_within_each_pattern(span):
    off = np.arange(8 * span * 4)
    sw = _swizzle_model(off, span)
    pattern = 8 * span
    assert sorted(sw.tolist()) == off.tolist()
    assert ((sw // pattern) == (off // pattern)).all()
    assert ((sw % 16) == (off % 16)).all()   # 16-byte chunks move whole


def test_tensor_map_validation():
    from cuflash.runtime.tensor_map import TensorMap

    a = np.zeros((64, 64), np.float16)
    TensorMap.of(a, (64, 64), swizzle=128)
    with pytest.raises(ValueError, match="innermost stride"):
        TensorMap.of(a[:, ::2], (8, 8))
    with pytest.raises(ValueError, match="multiples of 16"):
        TensorMap.of(np.zeros((8, 9), np.float16), (8, 8))
    with pytest.raises(ValueError, match="box extents must be in 1..256"):
        TensorMap.of(np.zeros((512, 8), np.float16), (512, 8))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        TensorMap.of(a, (8, 4))
    with pytest.raises(ValueError, match="swizzle must be one of"):
        TensorMap.of(a, (8, 64), swizzle=16)
    with pytest.raises(ValueError, match="inner extent must be 128 bytes"):
        TensorMap.of(a, (8, 32), swizzle=128)
    with pytest.raises(ValueError, match="rank must be 1..5"):
        TensorMap.of(np.zeros((1,) * 6, np.float16), (1,) * 6)
    with pytest.raises(TypeError, match="box must hold integers, got 64.5"):
        TensorMap.of(a, (64.5, 64))
    with pytest.raises(TypeError, match="CUtensorMapDataType"):
        TensorMap.of(np.zeros((8, 8), np.complex64), (8, 8))
    with pytest.raises(ValueError, match="16-byte aligned"):
        TensorMap.of(a, (8, 64)).encode_sim(8)


def test_tensor_map_sim_encoding_fields():
    import struct

    from cuflash.runtime.tensor_map import TensorMap

    a = np.zeros((3, 40, 64), np.float32)
    blob = TensorMap.of(a, (1, 8, 32), swizzle=128).encode_sim(4096)
    magic, rank, eb, sw16, _, addr = struct.unpack_from("<IBBBBQ", blob)
    dims = struct.unpack_from("<5I", blob, 16)
    strides = struct.unpack_from("<4Q", blob, 40)
    box = struct.unpack_from("<5H", blob, 72)
    assert (magic, rank, eb, sw16, addr) == (0x50414D54, 3, 4, 8, 4096)
    assert dims == (64, 40, 3, 1, 1) and strides[:2] == (256, 40 * 256) and box == (32, 8, 1, 1, 1)
    assert len(blob) == 128


# ----------------------------------------------------------------------------- planted faults
@pytest.fixture(scope="module")
def hazards():
    with sim.options(arch=90) as o:
        normal = launcher.load_source(probe_source("hopper_hazards.cu"), origin="hopper_hazards.cu", options=o)
    with sim.options(arch=90, checked=True) as o:
        checked = launcher.load_source(probe_source("hopper_hazards.cu"), origin="hopper_hazards.cu", options=o)
    return normal, checked


def _hazard_plan(mode: int):
    import ml_dtypes

    a = (np.arange(64 * 64) % 7 - 3).reshape(64, 64).astype(ml_dtypes.bfloat16)
    o = np.zeros((64, 64), ml_dtypes.bfloat16)
    out = np.zeros(128 * 32, np.float32)
    args = (TensorMapArg.of("map_a", a, (64, 64), swizzle=128), TensorMapArg.of("map_o", o, (64, 64), swizzle=128,
                                                                                  writable=True), P(out), i32(mode))
    return LaunchPlan(None, "hopper_hazard", 1, 128, 96 * 1024, args), a, out


def _launch_hazard(hazards, mode, checked, seed=0):
    mod = hazards[1 if checked else 0]
    p, a, out = _hazard_plan(mode)
    with sim.options(arch=90, checked=checked, seed=seed) as o:
        mod.launch(p, o)
    return a, out


@pytest.mark.parametrize("checked", [False, True], ids=["normal", "checked"])
def test_hazard_probe_without_a_fault_computes_a_a_transpose(hazards, checked):
    a, out = _launch_hazard(hazards, 0, checked)
    a32 = a.astype(np.float32)
    s = a32 @ a32.T
    lane = np.arange(128)
    j, g, t = lane // 32, (lane % 32) // 4, lane % 4
    i = np.arange(32)
    rows = 16 * j[:, None] + g[:, None] + 8 * ((i[None, :] % 4) // 2)
    cols = 8 * (i[None, :] // 4) + 2 * t[:, None] + i[None, :] % 2
    np.testing.assert_array_equal(out.reshape(128, 32), s[rows, cols])


@pytest.mark.parametrize("mode,kind,match", [
    (1, "wgmma registers", "before any wgmma.fence"),
    (2, "wgmma registers", "accumulator register .* in flight"),
    (3, "cp.async in flight", "while a cp.async or TMA load"),
    (4, "proxy fence", "generic proxy with no fence.proxy.async"),
    (5, "async overlap", "unfinished wgmma or TMA store"),
    (6, "proxy fence", "TMA store|cp.async.bulk.tensor"),
    (7, "mbarrier object", "mbarrier object"),
    (12, "shared out-of-bounds", "outside every __shared__ variable"),
    (15, "async overlap", "unfinished wgmma or TMA store"),
    (16, "proxy fence", "fence.mbarrier_init"),
])
def test_planted_hazard_reports_its_kind(hazards, mode, kind, match):
    with pytest.raises(launcher.SimCheckError, match=match) as e:
        _launch_hazard(hazards, mode, True)
    assert e.value.kind == kind


@pytest.mark.parametrize("checked", [False, True], ids=["normal", "checked"])
@pytest.mark.parametrize("mode,match", [
    (8, r"deadlock: .* wait on the mbarrier __shared__ bar byte 0 for the phase of parity 0 \(its phase 0, 0 of 1 "
        r"arrivals pending, tx-count 16\)"),
    (9, "setmaxnreg.dec: 100 is not a multiple of 8 in 24..256"),
    (11, r"transaction count of mbarrier .* would reach 1048576"),
    (13, "inside row 1 of a 1024-byte swizzle atom"),
    (14, "bar.sync 1: thread count (64|128) differs"),
])
def test_planted_fault_is_a_sim_error(hazards, checked, mode, match):
    with pytest.raises(launcher.SimError, match=match):
        _launch_hazard(hazards, mode, checked)


def test_setmaxnreg_inc_that_no_dec_can_satisfy_is_a_deadlock(hazards):
    out = np.zeros(384, np.int32)
    with pytest.raises(launcher.SimError, match=r"setmaxnreg.inc for 240 registers per thread; only 1024 registers"):
        hazards[0].launch(plan("hopper_regs_hazard", 1, 384, P(out)))


def test_descriptor_beyond_the_shared_memory_is_an_error_in_normal_mode(hazards):
    # (checked mode reports mode 12 as an access outside every __shared__ variable, above); with
    # the 48 KB default limit the descriptor's address, 97 KB in, is not shared memory at all
    p, _, _ = _hazard_plan(12)
    small = LaunchPlan(None, p.entry, 1, 128, 9 * 1024, p.args)
    with pytest.raises(launcher.SimError, match="cvta.to.shared: .* is not in the block's shared memory"):
        hazards[0].launch(small)


# ------------------------------------------------------------------ fp8 (e4m3) wgmma


@pytest.mark.parametrize("a_regs", [False, True])
def test_wgmma_e4m3_gemm_matches_numpy(probes, probes_checked, a_regs):
    """wgmma m64n64k32 .e4m3.e4m3 (K-major operands; A from a descriptor or from registers, four
    e4m3 per register) against NumPy's product, exact: 100 rows (two blocks, the second partly
    past M), K = 96 (three k32 steps), e4m3's extremes and subnormals; checked mode too."""
    for mod, seed in ((probes, 0), (probes_checked, 3)):
        a, b, c, expected = hp.gemm_e4m3_inputs(100, 96, seed=seed)
        _run(mod, hp.plan_gemm_e4m3(a, b, c, a_regs=a_regs), seed)
        np.testing.assert_array_equal(c, expected)


def test_wgmma_e4m3_gemm_refuses_other_operands():
    a, b, c, _ = hp.gemm_e4m3_inputs(64, 64)
    with pytest.raises(ValueError, match=r"K a multiple of 32"):
        hp.plan_gemm_e4m3(a[:, :48], b[:, :48], c)
    with pytest.raises(TypeError, match=r"must be float8_e4m3fn"):
        hp.plan_gemm_e4m3(a.astype(np.float32), b, c)


@pytest.mark.slow
def test_a_planted_fault_in_the_e4m3_emulation_is_caught(tmp_path, monkeypatch):
    """The e4m3 probe GEMMs see a fault planted in the simulator's e4m3 wgmma (ptx.cuh's simulator
    branch, copied and edited): A's registers 1 and 2 swapped (rows g + 8 and columns 16.. mixed up)
    and, from shared memory, the A and B descriptors exchanged; each GEMM then differs from NumPy."""
    import shutil

    from cuflash.runtime import paths

    tree = tmp_path / "kernels"
    shutil.copytree(paths.kernels_dir(), tree)
    text = (tree / "ptx.cuh").read_text()
    planted = text.replace("cusim::wgmma_e4m3<N>(d, 0, a, desc_b, scale_d != 0);",
                           "const unsigned swapped[4] = {a[0], a[2], a[1], a[3]};\n"
                           "    cusim::wgmma_e4m3<N>(d, 0, swapped, desc_b, scale_d != 0);")
    planted = planted.replace("cusim::wgmma_e4m3<N>(d, desc_a, nullptr, desc_b, scale_d != 0);",
                              "cusim::wgmma_e4m3<N>(d, desc_b, nullptr, desc_a, scale_d != 0);")
    assert planted.count("swapped") == 2 and "d, desc_b, nullptr, desc_a" in planted
    (tree / "ptx.cuh").write_text(planted)
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    monkeypatch.setenv("CUFLASH_SIM_CACHE_DIR", str(tmp_path / "sim-cache"))
    mod = _module()
    for a_regs in (False, True):
        a, b, c, expected = hp.gemm_e4m3_inputs(100, 96)
        _run(mod, hp.plan_gemm_e4m3(a, b, c, a_regs=a_regs))
        assert not np.array_equal(c, expected), f"the planted fault went unseen (a_regs={a_regs})"
