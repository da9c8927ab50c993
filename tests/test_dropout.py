"""Attention dropout (issue 24): Philox 4x32-10 against Random123's known answers in NumPy and in
the CUDA text on the simulator; the keep mask bit for bit across them; its statistics; dropout in
the forward and the backward against the float64 oracle given the same mask, on the NumPy path and
the simulator (normal and checked); the argument checks; torch's generator."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.kernels import dropout_mask as dm
from cuflash.reference import dropout as rd
from cuflash.sim import launcher

#: Random123 kat_vectors, the three philox4x32 10 lines: counter, key, output
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers_numpy(counter, key, want):
    assert tuple(int(w) for w in rd.philox4x32_10(counter, key)) == want


@pytest.mark.parametrize("checked", [False, True])
def test_philox_known_answers_cuda_text(checked):
    for counter, key, want in KAT:
        c = np.array([counter], np.uint32)
        w = np.zeros((1, 4), np.uint32)
        with cuflash.sim.options(checked=checked):
            launcher.run(dm.plan_raw(c, w, key))
        assert tuple(int(x) for x in w[0]) == want


@pytest.mark.parametrize("p,seed,offset", [(0.1, 0, 0), (0.5, 123456789, 7), (0.9, 2**32 - 1, 2**32 - 1)])
def test_mask_is_bit_identical_on_the_simulator(p, seed, offset):
    shape = (2, 3, 17, 45)
    want = rd.dropout_mask(shape, p, seed, offset, batch0=5)
    got = np.full(shape, 7, np.uint8)
    launcher.run(dm.plan_mask(got, 5, seed, offset, rd.keep_threshold(p)))
    assert np.array_equal(got.astype(bool), want) and set(np.unique(got)) <= {0, 1}


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75])
def test_kept_fraction_and_independence(p):
    """Kept fraction within 4 standard errors of 1 - p over 2**21 pairs; masks of other seeds and
    offsets agree with it no more than independent ones would (4 standard errors)."""
    shape = (2, 4, 256, 1024)
    n = int(np.prod(shape))
    m = rd.dropout_mask(shape, p, 42, 0)
    se = np.sqrt(p * (1 - p) / n)
    assert abs(m.mean() - (1 - p)) < 4 * se
    for other in (rd.dropout_mask(shape, p, 43, 0), rd.dropout_mask(shape, p, 42, 1)):
        both = (m & other).mean()
        expect = (1 - p) ** 2
        assert abs(both - expect) < 4 * np.sqrt(expect * (1 - expect) / n)
    assert rd.keep_threshold(0.0) == 2**32 - 1 and rd.keep_threshold(0.5) == 2**31
