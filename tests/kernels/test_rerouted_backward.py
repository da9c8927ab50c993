"""The backward calls the dispatcher sends to the portable tier because the tensor-core form
spills under the only NVRTC major in use (attention_bwd_mma.SPILLING_FORMS), run on the simulator against the float64 oracle: the
forward (tensor-core or Hopper) and the portable backward draw the same dropout keep bits and
apply the same modifiers. Which kernel runs is tests/api/test_explain_routes.py's (recorded
launches); here the numbers."""

from __future__ import annotations

import numpy as np
import pytest
from test_dropout import run_dropout_case
from test_modifiers_kernels import run_case

from cuflash.kernels import attention_bwd_mma, dispatch
from cuflash.runtime import validation
from cuflash.runtime.options import DropoutOptions, Options


def _backward_tier(arch, d, dtype, **kw):
    x = np.zeros((1, 2, 64, d), dtype)
    return dispatch.backward_tier(validation.check_attention(x, x, x, Options(**kw)), arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch, d, dtype_key", [("sm_80", 256, "f16"), ("sm_90", 192, "bf16")])
def test_dropout_backward_on_the_portable_tier(arch, d, dtype_key, rng, monkeypatch):
    monkeypatch.setenv("CUFLASH_NVRTC", "12" if arch == "sm_80" else "13")   # (the major that spills it)
    assert _backward_tier(int(arch[3:]), d, np.float16, dropout=DropoutOptions(0.3, 1, 0)).__name__.endswith("bwd_simt")
    run_dropout_case(rng, (70, 150), (4, 2), d, "causal", 0.3, dtype_key, arch)


@pytest.mark.slow
def test_modifier_backward_on_the_portable_tier(rng, monkeypatch):
    monkeypatch.setenv("CUFLASH_NVRTC", "12")   # (the major that spills it)
    assert attention_bwd_mma.spill_note(90, attention_bwd_mma.AttentionBwdMma("bf16", 192, 64, 64, 2, mods=True))
    run_case(rng, ("softcap", "attn_bias"), (70, 150), 192, (4, 2), "causal", "bf16", "full", arch=90,
             tier="attention_fwd_sm90")
