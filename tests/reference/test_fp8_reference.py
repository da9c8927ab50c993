"""fp8 (float8_e4m3fn) in the reference: saturating quantization, the descaled oracle, the fp8
accuracy rule (cuflash/reference/fp8.py, cuflash/reference/tolerance.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.reference import fp8 as rfp8
from cuflash.reference import tolerance

E4M3 = ml_dtypes.float8_e4m3fn


def _finite_e4m3_values():
    """Every finite e4m3 value, ascending, from the format's definition: sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent field 0 is subnormal (m * 2^-9); 0x7f / 0xff are NaN."""
    pos = [m * 2.0**-9 for m in range(8)]
    pos += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return np.array(sorted(set([-x for x in pos] + pos)))


def test_e4m3_values_round_trip_and_midpoints_round_to_even():
    vals = _finite_e4m3_values()
    assert vals.max() == 448.0 and len(vals) == 253   # 126 positive, 126 negative, one zero (as floats)
    got = rfp8.quantize_e4m3(vals.astype(np.float32)).astype(np.float64)
    np.testing.assert_array_equal(got, vals)
    lo, hi = vals[:-1], vals[1:]
    mid = (lo + hi) / 2   # exact in float32: one bit more than e4m3's mantissa
    # the even neighbour: the one whose 3-bit mantissa (its index among same-sign values) is even
    code = {v: i for i, v in enumerate(np.abs(vals[vals >= 0]))}
    even = np.where([code[abs(a)] % 2 == 0 for a in lo], lo, hi)
    np.testing.assert_array_equal(rfp8.quantize_e4m3(mid.astype(np.float32)).astype(np.float64), even)


def test_quantization_saturates_as_satfinite_and_keeps_nan():
    x = np.array([480.0, 449.0, 464.0, 1e6, np.inf, -480.0, -np.inf, np.nan, -np.nan, -1e-30], np.float32)
    got = rfp8.quantize_e4m3(x)
    np.testing.assert_array_equal(got.astype(np.float64)[:7], [448, 448, 448, 448, 448, -448, -448])
    assert got.view(np.uint8)[7] == got.view(np.uint8)[8] == 0x7F   # NaN: the canonical NaN byte
    assert got.view(np.uint8)[9] == 0x80   # a negative value rounding to zero keeps its sign
    # ml_dtypes' own cast, which the clipping avoids, turns the overflow into NaN
    assert np.isnan(np.float32(480).astype(E4M3).astype(np.float32))


def test_quantization_divides_by_the_descale_in_float32():
    x = np.array([[3.0, 7.5], [-100.0, 0.3]], np.float32)
    d = np.array([[0.5], [2.0]], np.float32)
    # -100 / 2 = -50 lies halfway between -48 (mantissa 100) and -52 (101): the even one; 0.15 is
    # nearest to 0.15625 (steps of 2**-6 in [0.125, 0.25))
    np.testing.assert_array_equal(rfp8.quantize_e4m3(x, d).astype(np.float64), [[6.0, 15.0], [-48.0, 0.15625]])


def _fp8_inputs(rng, shape_q, shape_kv, scale=3.0):
    q, k, v = (np.clip(rng.standard_normal(s) * scale, -448, 448).astype(E4M3) for s in (shape_q, shape_kv, shape_kv))
    return q, k, v


def _oracle_bhsd(q, k, v, qd, kd, vd, causal):
    """Float64 attention of the descaled values, written out head by head (independent of the
    package's dequantization): query head h uses kv head h // G's descales."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = hq // hk
    out = np.zeros((b, hq, sq, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            j = h // g
            qq = q[bi, h].astype(np.float64) * float(qd[bi, j])
            kk = k[bi, j].astype(np.float64) * float(kd[bi, j])
            vv = v[bi, j].astype(np.float64) * float(vd[bi, j])
            s = qq @ kk.T / np.sqrt(d)
            if causal:
                s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            out[bi, h] = (e / e.sum(axis=1, keepdims=True)) @ vv
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_the_rule_s_reference_is_the_float64_attention_of_the_descaled_values(causal):
    rng = np.random.default_rng(3)
    q, k, v = _fp8_inputs(rng, (2, 4, 7, 16), (2, 2, 11, 16))
    qd, kd, vd = (rng.uniform(0.25, 4, (2, 2)).astype(np.float32) for _ in range(3))
    ref, _ = tolerance.attention_rows(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    np.testing.assert_allclose(ref, _oracle_bhsd(q, k, v, qd, kd, vd, causal), rtol=1e-12, atol=1e-12)


def test_the_fp8_baseline_rounds_p_to_e4m3_and_the_rule_can_fail():
    rng = np.random.default_rng(4)
    q, k, v = _fp8_inputs(rng, (1, 2, 16, 32), (1, 2, 40, 32))
    qd, kd, vd = (np.full((1, 2), s, np.float32) for s in (0.5, 0.5, 2.0))
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    ref, _ = tolerance.attention_rows(q, k, v, **kw)
    naive, _ = tolerance.attention_rows(q, k, v, same_dtype=True, **kw)
    base = np.abs(naive - ref).max()
    # P rounded to e4m3 (relative 2**-4) costs far more than the bf16 output's rounding alone
    assert base > 2.0**-9 * np.abs(ref).max()
    bound = tolerance.rule_bound(q, k, v, **kw)
    assert bound == pytest.approx(2 * base + tolerance.floor_for(ml_dtypes.bfloat16))
    naive16, _ = tolerance.attention_rows(q, k, v, same_dtype=True, out_dtype="float16", **kw)
    base16 = np.abs(naive16 - ref).max()
    assert tolerance.rule_bound(q, k, v, out_dtype="float16", **kw) == pytest.approx(
        2 * base16 + tolerance.floor_for(np.float16))   # the floor of the result's type
    out = cuflash.attention(q, k, v, **kw)
    ok, msg, _ = tolerance.compare(out, q, k, v, **kw)
    assert ok, msg
    # judge: the same verdict with the bound it was held to and the error against the reference
    verdict = tolerance.judge(out, q, k, v, **kw)
    assert verdict.ok and verdict.bound == pytest.approx(2 * base + tolerance.floor_for(ml_dtypes.bfloat16))
    assert verdict.error == pytest.approx(np.abs(np.asarray(out, np.float64) - ref).max())
    # the same output read with a forgotten v_descale is far outside the rule
    ok, msg, _ = tolerance.compare(out, q, k, v, q_descale=qd, k_descale=kd)
    assert not ok and "max error" in msg
