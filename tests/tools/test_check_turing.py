"""``python -m cuflash check``'s turing section without a GPU: its case logic run with the simulator
(sm_90) as the device, the Turing kernels built for it (the same comparison the GPU run makes), and
shown to fail on a wrong output."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import sim
from cuflash.tools import check


def _on_sim(fn, arrays, kw):
    with sim.options(arch="sm_90"):
        return fn(*arrays, backend="sim", **kw)


def test_check_lists_the_turing_section_before_the_hopper_probes():
    assert check.SECTIONS.index("turing") + 1 == check.SECTIONS.index("hopper")
    assert check.build_parser().parse_args(["--sections", "turing"]).sections == "turing"


@pytest.mark.slow
def test_the_turing_case_passes_with_the_simulator_as_the_device():
    entry, ratio = check.turing_case(np.random.default_rng(2), dict(check.TURING_CASES[0], Hq=2, Hk=1, Sq=40, Sk=33),
                                     90, _on_sim)
    assert entry == "cuflash_attn_fwd_mma_f16_d64_m128_n32_s1_sm75form" and 0 <= ratio <= 1

    def off(fn, arrays, kw):
        got = _on_sim(fn, arrays, kw)
        return (got[0].astype(np.float32) + 0.05, *got[1:])

    with pytest.raises(AssertionError, match=r"out: error .* > "):
        check.turing_case(np.random.default_rng(2), dict(check.TURING_CASES[0], Hq=2, Hk=1, Sq=40, Sk=33), 90, off)
