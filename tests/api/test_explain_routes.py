"""What the dispatcher's accounts name against what the call launches: ``explain``'s account of the
backward (its ``backward`` line), the forms the dispatcher passes over because ptxas spills them
(the compile gate's KNOWN_SPILLS), and ``describe_choice`` for a KV-cache call. Each answer is
checked against the launches the real call makes on the simulator with its launcher replaced by
a recorder (nothing executes, no kernel compiles)."""

from __future__ import annotations

import numpy as np
import pytest
from support.tiers import without_tensor_cores

import cuflash
from cuflash import sim
from cuflash.kernels import attention_bwd_mma, attention_fwd_simt, dispatch, kvcache_run
from cuflash.runtime import cuda_runner
from cuflash.runtime.dtypes import bfloat16
from cuflash.sim.device import SimDevice


@pytest.fixture
def launches(monkeypatch):
    """The entries the real calls in the test launch on the simulator (none executed)."""
    recorded = []
    monkeypatch.setattr(SimDevice, "launch", lambda self, launch_plan: recorded.append(launch_plan.entry))
    return recorded


def _backward_main(launches) -> str:
    (main,) = [e for e in launches if "_main_" in e]
    return main


ONLY_12 = "; NVRTC 13.x, which compiles it without spills, is not in use"


@pytest.mark.parametrize("arch, d, dtype, mods, spills", [
    (80, 256, np.float16, dict(softcap=20.0), "36 bytes under NVRTC 12.x" + ONLY_12),
    (90, 192, bfloat16, dict(alibi_slopes=np.full(2, 0.1, np.float32)), "8 bytes under NVRTC 12.x" + ONLY_12),
    (90, 256, np.float16, dict(sinks=np.zeros(2, np.float32)), "60 bytes under NVRTC 12.x" + ONLY_12),
], ids=["sm80-d256-softcap", "sm90-d192-alibi", "sm90-d256-sinks"])
def test_a_backward_whose_only_tile_spills_runs_the_portable_tier_and_explain_says_why(arch, d, dtype, mods, spills,
                                                                                        launches, monkeypatch):
    """With only the NVRTC major that spills the tensor-core form in use (CUFLASH_NVRTC=12)."""
    monkeypatch.setenv("CUFLASH_NVRTC", "12")
    q = np.zeros((1, 2, 33, d), dtype)
    info = cuflash.explain(q, q, q, arch=arch, **mods)
    line = info["backward"]
    assert line.startswith(f"sm_{arch}: backward on the portable SIMT tier, cuflash_attn_bwd_simt_main_"), line
    assert line.endswith(f"tensor-core mma.sync tier not used: with score modifiers at head dim {d}, its only tile "
                         f"that fits sm_{arch} spills registers to local memory ({spills}); the portable backward "
                         "runs it without spills"), line
    lse = np.zeros((1, 2, 33), np.float32)
    with sim.options(arch=arch):
        cuflash.attention_backward(q, q, q, q, q, lse, backend="sim", **mods)
    assert line.split(", ")[1].split(";")[0] == _backward_main(launches)


@pytest.mark.parametrize("arch, d, dropout", [(80, 256, False), (90, 256, False), (90, 192, True)])
def test_a_form_that_spills_under_one_nvrtc_is_compiled_by_the_other(arch, d, dropout, monkeypatch, launches):
    """With both NVRTC majors installed (no CUFLASH_NVRTC), the tensor-core backward keeps the call,
    and nvrtc_for compiles its main stage with the major that does not spill it."""
    if set(cuda_runner.usable_nvrtc_majors(arch)) != {12, 13}:
        pytest.fail("the test extra installs NVRTC 12.x and 13.x; this test needs both")
    q = np.zeros((1, 2, 33, d), np.float16)
    kw = dict(dropout_p=0.1, dropout_seed=1) if dropout else dict(softcap=20.0)
    with sim.options(arch=arch):
        cuflash.attention_backward(q, q, q, q, q, np.zeros((1, 2, 33), np.float32), backend="sim", **kw)
    main = _backward_main(launches)
    assert main.startswith("cuflash_attn_bwd_mma_main_"), main
    (v,) = [v for v in attention_bwd_mma.all_variants(arch, dropout=dropout, mods=not dropout) if v.entry == main]
    spilling = v.spilling_nvrtc_majors(arch)
    assert len(spilling) == 1, (main, spilling)
    monkeypatch.delenv("CUFLASH_NVRTC", raising=False)
    assert cuda_runner.nvrtc_for(v, arch).major == ({12, 13} - set(spilling)).pop()


def test_a_traced_score_mod_keeps_the_tensor_core_backward():
    """Only the tensor-core backward compiles a traced score_mod, so it keeps that form."""
    q = np.zeros((1, 2, 33, 256), np.float16)
    line = cuflash.explain(q, q, q, arch=90, score_mod=lambda s, b, h, i, j: s * 0.5)["backward"]
    assert line.startswith("sm_90: backward on the tensor-core mma.sync tier, cuflash_attn_bwd_mma_main_f16_d256_m64_n64_s2_mods"), line


def test_the_tile_that_does_not_spill_stays_on_the_tensor_cores(launches):
    q = np.zeros((1, 2, 33, 128), np.float16)
    line = cuflash.explain(q, q, q, arch=90, softcap=20.0)["backward"]
    entry = "cuflash_attn_bwd_mma_main_f16_d128_m64_n64_s2_mods"
    assert line == (f"sm_90: backward on the tensor-core mma.sync tier, {entry}; Hopper wgmma tier not used: softcap "
                    "is not in the Hopper backward yet")
    with sim.options(arch=90):
        cuflash.attention_backward(q, q, q, q, q, np.zeros((1, 2, 33), np.float32), backend="sim", softcap=20.0)
    assert _backward_main(launches) == entry


@pytest.mark.parametrize("arch, d, major", [(80, 256, "12"), (90, 192, "13")])
def test_a_dropout_backward_whose_only_tile_spills_runs_the_portable_tier(arch, d, major, launches, monkeypatch):
    monkeypatch.setenv("CUFLASH_NVRTC", major)
    q = np.zeros((1, 2, 33, d), np.float16)
    with sim.options(arch=arch):
        cuflash.attention_backward(q, q, q, q, q, np.zeros((1, 2, 33), np.float32), backend="sim", dropout_p=0.1,
                                   dropout_seed=1)
    assert _backward_main(launches) == "cuflash_attn_bwd_simt_main_f16_d256_m8_n16_dropout"   # (bucket 256 holds 192)


def test_a_packed_backward_whose_only_tile_spills_runs_the_portable_tier(launches, monkeypatch):
    monkeypatch.setenv("CUFLASH_NVRTC", "13")
    cu = np.array([0, 5, 40], np.int32)
    q = np.zeros((40, 2, 192), np.float16)
    info = cuflash.explain_varlen(q, q, q, cu, cu, 35, 35, arch=90, softcap=5.0)
    assert "tensor-core mma.sync tier not used: with score modifiers at head dim 192 in a packed batch, its only tile " \
           "that fits sm_90 spills registers to local memory (12 bytes under NVRTC 13.x; NVRTC 12.x, which compiles it " \
           "without spills, is not in use)" in info["backward"]
    with sim.options(arch=90):
        cuflash.attention_varlen_backward(q, q, q, q, q, np.zeros((2, 40), np.float32), cu, cu, 35, 35, backend="sim",
                                          softcap=5.0)
    assert _backward_main(launches) == "cuflash_attn_bwd_simt_main_f16_d256_m8_n16_varlen_mods"
    assert info["backward"].split(", ")[1].split(";")[0] == _backward_main(launches)


@pytest.mark.parametrize("arch, d, dtype, entry, note", [
    (90, 256, np.float32, "cuflash_attn_fwd_simt_f32_d256_m8_n32_varlen_mods",
     "the plain packed form of head dim 256 spills registers to local memory under NVRTC 13.x (sm_75, sm_90); the "
     "score-modifier form, with every modifier off, runs it without spills"),
    (75, 64, np.float16, "cuflash_attn_fwd_simt_f16_d64_m32_n32_varlen",
     "the plain packed 32 x 64 tile spills registers to local memory on sm_75 under NVRTC 13.x (float16); 32 x 32 "
     "runs it without spills"),
], ids=["sm90-f32-d256", "sm75-f16-d64"])
def test_a_plain_packed_portable_forward_that_spills_runs_another_form(arch, d, dtype, entry, note, launches,
                                                                         monkeypatch):
    if arch == 75:   # (float16 on sm_75 goes to the tensor-core tier's sm_75 form first)
        without_tensor_cores(monkeypatch)
    cu = np.array([0, 5, 40], np.int32)
    q = np.zeros((40, 2, d), dtype)
    info = cuflash.explain_varlen(q, q, q, cu, cu, 35, 35, arch=arch)
    assert info["entry"] == entry and f"({note})" in info["choice"], info["choice"]
    with sim.options(arch=arch):
        cuflash.attention_varlen(q, q, q, cu, cu, 35, 35, backend="sim")
    assert launches == [entry]


def test_the_tables_name_what_they_replace():
    """Every form passed over is one the dispatcher would otherwise pick, and none is picked."""
    for arch in (75, 80, 90):
        for v in attention_fwd_simt.passed_over(arch):
            assert attention_fwd_simt.packed_form(v, arch) != v and v not in attention_fwd_simt.all_variants(arch, varlen=True)
    for arch in (80, 90):
        spilling = [v for vl in (False, True) for dr, m in ((True, False), (False, True))
                    for v in attention_bwd_mma.all_variants(arch, varlen=vl, dropout=dr, mods=m)
                    if v.spilling_nvrtc_majors(arch)]
        assert spilling
        for v in spilling:   # each spills under one major only, so one major always runs it on the tensor cores
            (major,) = v.spilling_nvrtc_majors(arch)
            assert attention_bwd_mma.spill_note(arch, v, (major,)) and attention_bwd_mma.spill_note(arch, v, (12, 13)) is None


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_describe_choice_names_the_kvcache_variant_the_launch_uses(paged, monkeypatch, launches):
    seen = []
    real = kvcache_run.run_kvcache
    monkeypatch.setattr(kvcache_run, "run_kvcache", lambda problem, *a: (seen.append(problem), real(problem, *a))[1])
    q = np.zeros((2, 1, 16, 128), np.float16)
    kw = dict(block_table=np.arange(64, dtype=np.int32).reshape(2, 32)) if paged else {}
    cache = np.zeros((64, 16, 2, 128) if paged else (2, 512, 2, 128), np.float16)
    with sim.options(arch=90):
        cuflash.attention_with_kvcache(q, cache, cache.copy(), np.array([500, 300], np.int32), backend="sim", **kw)
    (problem,) = seen
    line = dispatch.describe_choice(problem, 90, sm_count=sim.sm_count(90))
    (attention,) = [e for e in launches if "combine" not in e]
    assert "_kvcache" in attention and f": {attention}: " in line, (attention, line)
    splits = int(line.split(" key splits")[0].rsplit(" ", 1)[1]) if " key splits" in line else 1
    assert sum("combine" in e for e in launches) == (splits > 1)

