"""``python -m cuflash check``'s fp8 section without a GPU: its case logic run with the simulator
as the device (the same comparison the GPU run makes), and shown to fail on a wrong output or a
wrong cache byte."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.tools import check

#: small enough for the simulator; bf16, head dim 64 (the fp8 form the KV-cache tests compile)
CASE = ([3, 150], 16, 8, 2, 64, 1, 2)


def _on_sim(q, kc8, vc8, seqlens, kw):
    kc, vc = kc8.copy(), vc8.copy()
    out = cuflash.attention_with_kvcache(q, kc, vc, seqlens, causal=True, backend="sim", **kw)
    return out, kc, vc


def test_the_fp8_case_passes_with_the_simulator_as_the_device():
    what, ratio = check.fp8_kvcache_case(np.random.default_rng(1), CASE, _on_sim)
    assert what == "fp8 cache [3, 150], page 16, Hq/Hk 8/2 d64" and 0 <= ratio <= 1


def test_the_fp8_case_fails_on_a_wrong_output_or_cache_byte():
    def off_output(*args):
        out, kc, vc = _on_sim(*args)
        return out.astype(np.float32) + 0.05, kc, vc

    def off_byte(*args):
        out, kc, vc = _on_sim(*args)
        kc.view(np.uint8)[np.unravel_index(np.argmax(np.isfinite(kc.astype(np.float32))), kc.shape)] ^= 1
        return out, kc, vc

    with pytest.raises(AssertionError, match=r"fp8 cache \[3, 150\].*: error .* > "):
        check.fp8_kvcache_case(np.random.default_rng(1), CASE, off_output)
    with pytest.raises(AssertionError, match=r"the device's fp8 cache differs from the NumPy path's"):
        check.fp8_kvcache_case(np.random.default_rng(1), CASE, off_byte)


def test_check_lists_the_fp8_section_after_the_kv_cache():
    assert check.SECTIONS.index("fp8") == check.SECTIONS.index("kvcache") + 1
    assert check.build_parser().parse_args(["--sections", "fp8"]).sections == "fp8"


#: the fp8 forward's check case, small: head dim 64, causal (the fp8 variant the Hopper fp8 tests compile)
FORWARD_CASE = (1, 4, 2, 150, 100, 64, True, (-1, -1))


def _forward_on_sim(q, k, v, kw):
    with cuflash.sim.options(arch="sm_90"):
        entry = cuflash.explain(q, k, v, backend="sim", **kw)["entry"]
        out, lse = cuflash.attention(q, k, v, backend="sim", return_lse=True, **kw)
    return out, lse, entry


def test_the_fp8_forward_case_passes_on_the_simulated_hopper_form_and_fails_off_it():
    what, ratio = check.fp8_forward_case(np.random.default_rng(2), FORWARD_CASE, _forward_on_sim)
    assert what == "fp8 forward B 1, Hq/Hk 4/2, Sq 150, Sk 100, d64, causal (cuflash_attn_fwd_sm90_bf16_d64_local_e4m3)"
    assert 0 <= ratio <= 1

    def off_output(*args):   # one output element off by a few bf16 steps of the largest value
        out, lse, entry = _forward_on_sim(*args)
        out = out.astype(np.float32)
        out[0, 0, -1, 0] += 0.05 * np.abs(out).max()
        return out, lse, entry

    with pytest.raises(AssertionError, match=r"fp8 forward B 1.*\(cuflash_attn_fwd_sm90_bf16_d64_local_e4m3\): max error"):
        check.fp8_forward_case(np.random.default_rng(2), FORWARD_CASE, off_output)


def test_the_sections_case_loop_logs_each_case_and_stops_when_the_clock_runs_out():
    class Clock:   # out after the first case
        def __init__(self):
            self.calls = 0

        def out(self):
            self.calls += 1
            return self.calls > 1

    logs = []
    done, worst = check._run_cases(Clock(), logs.append, [3, 4], lambda case: (f"case {case}", case / 8),
                                   lambda case: f" (#{case}): {{:.2f}} of the bound")
    assert (done, worst, logs) == (1, 3 / 8, ["  case 3 (#3): 0.38 of the bound"])


PACKED_CASE = (((40, 150), (0, 9), (1, 1), (130, 70)), 4, 2, 64, True)


def _packed_on_sim(q, k, v, cq, ck, mq, mk, kw):
    with cuflash.sim.options(arch="sm_90"):
        entry = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, backend="sim", **kw)["entry"]
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, backend="sim", return_lse=True, **kw)
    return out, lse, entry


def test_the_packed_fp8_case_passes_on_the_simulated_hopper_form_and_fails_off_it():
    what, ratio = check.fp8_packed_case(np.random.default_rng(3), PACKED_CASE, _packed_on_sim)
    assert what == "fp8 packed forward 4 sequences, Hq/Hk 4/2, d64, causal (cuflash_attn_fwd_sm90_bf16_d64_local_varlen_e4m3)"
    assert 0 <= ratio <= 1

    def off_output(*args):   # the last sequence's last row off by a few bf16 steps of the largest value
        out, lse, entry = _packed_on_sim(*args)
        out = out.astype(np.float32)
        out[-1, 0, 0] += 0.05 * np.abs(out).max()
        return out, lse, entry

    with pytest.raises(AssertionError, match=r"fp8 packed forward 4 sequences.*, sequence 3: max error"):
        check.fp8_packed_case(np.random.default_rng(3), PACKED_CASE, off_output)
