"""Volta (sm_70, the V100) on the portable tier: the dispatcher and ``explain`` at arch 70, the
simulator's sm_70 against the float64 oracle, and the refusal under an NVRTC-13-only install
(CUDA 13 dropped sm_70; the compile gate's sm_70 rows are NVRTC 12.x's:
tests/kernels/test_compile_gate.py)."""

from __future__ import annotations

import numpy as np
import pytest
from support.grads import check_grads_close
from support.options import check_attention
from support.tolerance import check_close

import cuflash
from cuflash.kernels import attention_fwd_simt, dispatch
from cuflash.runtime import cuda_runner, dtypes, plan
from cuflash.sim import config


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, np.float32])
def test_arch70_runs_the_portable_tier_and_says_why(dtype):
    q = np.zeros((1, 2, 16, 64), dtype)
    info = cuflash.explain(q, q, q, backend="sim", arch=70)
    assert info["tier"] == "attention_fwd_simt", info
    assert info["choice"].startswith("sm_70: portable SIMT tier"), info["choice"]
    if dtype != np.float32:
        assert "tensor-core mma.sync tier not used: sm_70 has no mma.sync m16n8k8 or ldmatrix" in info["choice"]
    # the modifier forms too
    info = cuflash.explain(q, q, q, backend="sim", arch=70, attn_mask=np.ones((16, 16), bool))
    assert info["tier"] == "attention_fwd_simt" and info["variant"].endswith("_mods")


def test_the_simulator_emulates_a_v100():
    assert 70 in config.ARCHS and config.sm_count(70) == 80   # V100 SXM2: 80 SMs
    assert plan.max_dynamic_smem(70) == 96 * 1024             # 96 KB per block with the opt-in
    with cuflash.sim.options(arch="sm_70"):
        assert cuflash.sim.current_options().arch == 70


def test_nvrtc13_only_installs_refuse_sm70_naming_the_cuda12_extra(monkeypatch):
    q = np.zeros((1, 2, 16, 64), np.float32)
    p = check_attention(q, q, q)
    why = dispatch.compiler_reason(70, (13,))
    assert "CUDA 13 dropped sm_70" in why and "cuflash[cuda12]" in why and "nvidia-cuda-nvrtc-cu12" in why
    assert dispatch.compiler_reason(70, (12,)) is None and dispatch.compiler_reason(70, (12, 13)) is None
    assert dispatch.compiler_reason(75, (13,)) is None
    assert dispatch.compiler_reason(70, ()) is None   # a simulator-only install: not applied
    monkeypatch.setattr(cuda_runner, "nvrtc_majors", lambda: (13,))
    with pytest.raises(NotImplementedError, match=r"no kernel takes this call on sm_70: NVRTC 13.x cannot compile"):
        dispatch.forward_tier(p, 70, (q, q, q))
    with pytest.raises(NotImplementedError, match="cuda12"):
        cuflash.explain(q, q, q, backend="sim", arch=70)
    assert dispatch.forward_tier(p, 75, (q, q, q)) is attention_fwd_simt


def test_nvrtc13_cannot_compile_for_a_v100_and_says_what_to_install():
    from cuflash.runtime import nvrtc

    if nvrtc.find(13) is None or nvrtc.find(12) is None:
        pytest.fail("the test extra installs NVRTC 12.x and 13.x")
    assert cuda_runner.device_arch(70, 12) == 70
    with pytest.raises(RuntimeError, match=r"oldest arch is sm_75; CUDA 13 dropped sm_70.*cuda12"):
        cuda_runner.device_arch(70, 13)


def test_forward_on_the_simulated_v100(rng):
    q, k, v = (rng.standard_normal((2, 4, 37, 64)).astype(dtypes.float16) for _ in range(3))
    with cuflash.sim.options(arch="sm_70"):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
    check_close(out, q, k, v, causal=True, lse=lse)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, dtypes.bfloat16])
def test_every_feature_on_the_simulated_v100(dtype, rng):
    """Forward and backward at sm_70 with score modifiers and dropout (the ``_dropout_mods`` forms)
    and GQA, against the float64 oracle given the NumPy path's keep mask."""
    q = rng.standard_normal((2, 4, 45, 40)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 70, 40)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(causal=True, dropout_p=0.2, dropout_seed=7, dropout_offset=3, softcap=4.0,
              attn_bias=rng.standard_normal((4, 45, 70)).astype(np.float32), sinks=rng.standard_normal(4).astype(np.float32))
    with cuflash.sim.options(arch="sm_70"):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    check_close(out, q, k, v, lse=lse, **kw)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
