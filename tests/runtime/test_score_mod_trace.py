"""Tracing ``score_mod`` / ``mask_mod`` (cuflash.runtime.score_mod): the tree, its canonical
text, the spellings that work, every refusal by name, the symbolic derivative against finite
differences, and the index-range check of captured-array reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import mods
from cuflash.reference.score_mods import evaluate
from cuflash.runtime.score_mod import check_reads, derivative, index_bounds, trace

SLOPES = np.array([0.5, 0.25], np.float32)
DOC = np.array([0, 0, 1, 1, 1], np.int32)


def _key(fn, role="score_mod"):
    return trace(fn, role).key


# ------------------------------------------------------------------------------------------ the tree


def test_tree_and_canonical_text():
    def mod(score, b, h, q_idx, kv_idx):
        return score - SLOPES[h] * abs(q_idx - kv_idx)

    t = trace(mod, "score_mod")
    assert t.key == "score_mod(float32[1]) (sub score (mul (read 0 h) (abs (sub q_idx kv_idx))))"
    assert t.arrays[0] is SLOPES and t.names == ("SLOPES",)


def test_key_ignores_names_and_values_but_not_structure():
    other = np.array([9.0, 1.0], np.float32)

    def a(score, b, h, q_idx, kv_idx):
        return score - SLOPES[h]

    def b_(s, bb, hh, qi, ki):
        return s - other[hh]

    def c(score, b, h, q_idx, kv_idx):
        return score + SLOPES[h]

    assert _key(a) == _key(b_) != _key(c)
    # dtype and rank of a captured array are in the key, its shape is not
    f64, table, wide = SLOPES.astype(np.float64), np.zeros((2, 2), np.float32), np.zeros(7, np.float32)
    assert _key(lambda s, b, h, i, j: s - f64[h]) != _key(a)
    assert _key(lambda s, b, h, i, j: s - table[h, 0]) != _key(a)
    assert _key(lambda s, b, h, i, j: s - wide[h]) == _key(a)


def test_captured_arrays_from_closure_globals_and_lambdas():
    def make(table):
        return lambda s, b, h, i, j: s + table[h, j]

    t = trace(make(np.zeros((2, 5), np.float32)), "score_mod")
    assert t.key.endswith("(add score (read 0 h kv_idx))") and t.names == ("table",)
    t = trace(mods.document_mask(DOC), "mask_mod")
    assert t.key == "mask_mod(int32[1]) (eq (read 0 q_idx) (read 0 kv_idx))"
    t = trace(lambda b, h, i, j: DOC[i] == DOC[j], "mask_mod")   # a module global
    assert t.names == ("DOC",) and len(t.arrays) == 1


def test_unused_captured_array_is_dropped():
    unused = np.zeros(3, np.float32)

    def mod(score, b, h, q_idx, kv_idx):
        _ = unused
        return score * 2

    t = trace(mod, "score_mod")
    assert t.arrays == () and t.key == "score_mod() (mul score 2)"


@pytest.mark.parametrize("spelling", ["mods", "numpy", "method"])
def test_spellings_agree(spelling):
    def mods_(s, b, h, i, j):
        return mods.where(i >= j, mods.tanh(s) + mods.exp(s) - mods.log(mods.absolute(s) + 1),
                          mods.minimum(s, mods.maximum(s, 0.5)) + mods.clamp(s, -1.0, 1.0))

    def numpy_(s, b, h, i, j):
        return np.where(i >= j, np.tanh(s) + np.exp(s) - np.log(np.abs(s) + 1),
                        np.minimum(s, np.maximum(s, 0.5)) + np.clip(s, -1.0, 1.0))

    def method_(s, b, h, i, j):
        return mods.where(i >= j, s.tanh() + s.exp() - (abs(s) + 1).log(),
                          mods.minimum(s, mods.maximum(s, 0.5)) + s.clamp(-1.0, 1.0))

    fn = {"mods": mods_, "numpy": numpy_, "method": method_}[spelling]
    assert _key(fn) == _key(mods_)


def test_torch_spellings():
    torch = pytest.importorskip("torch")

    def flex(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, 20.0 * torch.tanh(score / 20.0), torch.clamp(score, min=-1.0, max=1.0))

    def ours(score, b, h, q_idx, kv_idx):
        return mods.where(q_idx >= kv_idx, 20.0 * mods.tanh(score / 20.0), mods.clamp(score, -1.0, 1.0))

    assert _key(flex) == _key(ours)


def test_kinds():
    assert trace(lambda s, b, h, i, j: (i - j) // 3 + i % 4, "score_mod").expr.kind == "i"
    assert trace(lambda s, b, h, i, j: i / 2, "score_mod").expr.kind == "f"
    assert trace(lambda b, h, i, j: (i >= j) & ~(j > 3) | (b == 0), "mask_mod").expr.kind == "b"
    assert trace(lambda b, h, i, j: True, "mask_mod").key == "mask_mod() true"


# ------------------------------------------------------------------------------------------ refusals


def _refused(fn, role, *words, exc=TypeError):
    with pytest.raises(exc) as info:
        trace(fn, role, "cuflash.attention")
    msg = str(info.value)
    assert msg.startswith("cuflash.attention: "), msg
    for w in words:
        assert w in msg, msg
    return msg


def _if(s, b, h, i, j):
    if s > 0:
        return s
    return -s


def _and(b, h, i, j):
    return i >= j and j > 0


REFUSALS = [
    (_if, "score_mod", ("`if`", "where")),
    (_and, "mask_mod", ("`and`", "&")),
    (lambda s, b, h, i, j: min(s, 1.0), "score_mod", ("min()", "minimum")),
    (lambda s, b, h, i, j: math.exp(s), "score_mod", ("float()", "math.")),
    (lambda s, b, h, i, j: s ** 2, "score_mod", ("** (power)",)),
    (lambda s, b, h, i, j: s + (i << 1), "score_mod", ("<< (shift)",)),
    (lambda s, b, h, i, j: np.sin(s), "score_mod", ("numpy.sin",)),
    (lambda s, b, h, i, j: np.sum(s), "score_mod", ("numpy.sum",)),
    (lambda s, b, h, i, j: s // 2, "score_mod", ("//", "integers")),
    (lambda s, b, h, i, j: s + (i % 0), "score_mod", ("% by the constant 0",)),
    (lambda s, b, h, i, j: s + (i > j), "score_mod", ("+ on a bool", "where")),
    (lambda b, h, i, j: i & j, "mask_mod", ("& on numbers",)),
    (lambda b, h, i, j: ~i, "mask_mod", ("~ on a number",)),
    (lambda s, b, h, i, j: s + SLOPES[h:], "score_mod", ("slicing", "SLOPES")),
    (lambda s, b, h, i, j: s + SLOPES[h, i], "score_mod", ("SLOPES", "2 index(es)")),
    (lambda s, b, h, i, j: s + SLOPES[s], "score_mod", ("SLOPES", "with a float")),
    (lambda s, b, h, i, j: s + SLOPES.sum(), "score_mod", ("SLOPES.sum",)),
    (lambda s, b, h, i, j: s * SLOPES, "score_mod", ("whole captured array", "SLOPES")),
    (lambda s, b, h, i, j: s + [1.0, 2.0][h], "score_mod", ("Python index",)),
    (lambda s, b, h, i, j: s + "x", "score_mod", ("type str",)),
    (lambda s, b, h, i, j: i >= j, "score_mod", ("must return a number",)),
    (lambda b, h, i, j: i - j, "mask_mod", ("must return a bool",)),
    (lambda s, b, h, i, j: mods.where(s, 1.0, 0.0), "score_mod", ("condition that is not a bool",)),
    (lambda s, b, h, i, j: s + sum(x for x in s), "score_mod", ("iterating",)),
    (lambda s, b, h, i, j: s if s > 0 else -s, "score_mod", ("`if`", "data-dependent")),   # a conditional expression
    (lambda s, b, h, i, j: s + sum(1.0 for _ in range(i)), "score_mod", ("Python index", "range")),   # a loop bound
    (lambda s, b, h, i, j: s + sum(x for x in SLOPES), "score_mod", ("iterating over the captured array",)),
    (lambda s, b, h, i, j: s + SLOPES(h), "score_mod", ("calling the captured array",)),
]


@pytest.mark.parametrize("fn,role,words", REFUSALS, ids=[w[0] for _, _, w in REFUSALS])
def test_refusals_name_the_operation(fn, role, words):
    _refused(fn, role, role, *words)


def test_len_of_a_captured_array_is_its_static_size():
    t = trace(lambda s, b, h, i, j: s + SLOPES[mods.minimum(h, len(SLOPES) - 1)], "score_mod")
    assert t.key == "score_mod(float32[1]) (add score (read 0 (min h 1)))"


def test_refused_signatures_and_non_functions():
    _refused(lambda s, b, h, i: s, "score_mod", "5 positional arguments", "(score, b, h, q_idx, kv_idx)")
    _refused(lambda s, b, h, i, j: s, "mask_mod", "4 positional arguments", "(b, h, q_idx, kv_idx)")
    _refused(lambda *, s: s, "score_mod", "positional")
    _refused(3.0, "score_mod", "must be a function", "float")
    trace(lambda s, b, h, i, j, extra=1: s * extra, "score_mod")   # extra defaulted parameters are fine


@pytest.mark.parametrize("arr,words", [
    (np.zeros(3, np.float16), ("float16",)),
    (np.zeros(3, np.uint8), ("uint8",)),
    (np.zeros((), np.float32), ("no axes",)),
])
def test_refused_captured_arrays(arr, words):
    _refused(lambda s, b, h, i, j: s + arr[h], "score_mod", "'arr'", *words)


# ------------------------------------------------------------------------------------------ the derivative


DERIV_CASES = [
    lambda s, b, h, i, j: 3.0 * mods.tanh(s / 3.0),
    lambda s, b, h, i, j: mods.where(s > 0.2, s * s * SLOPES[h], mods.exp(s) / (1.0 + abs(s))),
    lambda s, b, h, i, j: mods.log(1.0 + mods.exp(s)) - mods.minimum(s, 0.1 * (i - j)) + mods.maximum(-s, 0.0),
    lambda s, b, h, i, j: (s - 1.5) / (s * s + 2.0) + s / SLOPES[h] - abs(s - 0.3),
]


@pytest.mark.parametrize("case", range(len(DERIV_CASES)))
def test_derivative_matches_finite_differences(case, rng):
    t = trace(DERIV_CASES[case], "score_mod")
    d = derivative(t.expr)
    s = rng.standard_normal((2, 6, 7)) * 2
    env = {"b": np.int64(0), "h": np.arange(2)[:, None, None], "q_idx": np.arange(6)[None, :, None],
           "kv_idx": np.arange(7)[None, None, :]}
    eps = 1e-6
    fd = (evaluate(t.expr, dict(env, score=s + eps), t.arrays)
          - evaluate(t.expr, dict(env, score=s - eps), t.arrays)) / (2 * eps)
    got = np.broadcast_to(evaluate(d, dict(env, score=s), t.arrays), s.shape)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7)


def test_derivative_is_constant_zero_or_one_where_it_should_be():
    assert derivative(trace(lambda s, b, h, i, j: s + SLOPES[h] * (i - j), "score_mod").expr).key == "1.0"
    assert derivative(trace(lambda s, b, h, i, j: SLOPES[h] * 1.0, "score_mod").expr).key == "0.0"


# ------------------------------------------------------------------------------------------ index ranges


def test_index_bounds():
    ranges = {"b": (0, 1), "h": (0, 3), "q_idx": (0, 9), "kv_idx": (0, 19)}
    sub = trace(lambda s, b, h, i, j: s + SLOPES[mods.where(i > j, h, b - 2)], "score_mod").reads()[0].args[0]
    assert index_bounds(sub, ranges) == (-2, 3)
    sub = trace(lambda s, b, h, i, j: s + SLOPES[(j - i) % 7], "score_mod").reads()[0].args[0]
    assert index_bounds(sub, ranges) == (0, 6)
    sub = trace(lambda s, b, h, i, j: s + SLOPES[(j - i) // 4], "score_mod").reads()[0].args[0]
    assert index_bounds(sub, ranges) == (-3, 4)   # floor(-9 / 4), floor(19 / 4)
    sub = trace(lambda s, b, h, i, j: s + SLOPES[mods.clamp(j - i, -3, 3) + 3], "score_mod").reads()[0].args[0]
    assert index_bounds(sub, ranges) == (0, 6)
    sub = trace(lambda s, b, h, i, j: s + SLOPES[abs(i - j) * 2 - h], "score_mod").reads()[0].args[0]
    assert index_bounds(sub, ranges) == (-3, 38)
    sub = trace(lambda s, b, h, i, j: s + SLOPES[DOC[i]], "score_mod").reads()[1].args[0]
    assert index_bounds(sub, ranges) == (-math.inf, math.inf)


def test_check_reads_refuses_an_index_that_may_stray():
    t = trace(mods.relative_position_bias(np.zeros((2, 7), np.float32), 3), "score_mod")
    check_reads(t, {"b": 1, "h": 2, "q_idx": 10, "kv_idx": 20}, "f")   # clamped: fine at any length
    with pytest.raises(ValueError, match=r"f: score_mod reads table\[\.\.\.\] with index h on axis 0, which may "
                                         r"take values in \[0, 2\] .* table.shape\[0\]=2"):
        check_reads(t, {"b": 1, "h": 3, "q_idx": 10, "kv_idx": 20}, "f")
    t = trace(lambda s, b, h, i, j: s + SLOPES[DOC[i]], "score_mod")
    with pytest.raises(ValueError, match=r"SLOPES\[\.\.\.\] with index \(read 1 q_idx\) .* \[-inf, inf\]"):
        check_reads(t, {"b": 1, "h": 2, "q_idx": 5, "kv_idx": 5}, "f")
    check_reads(t, {"b": 1, "h": 2, "q_idx": 0, "kv_idx": 5}, "f")   # nothing is evaluated


def test_array_derivatives_one_term_per_float_read():
    from cuflash.runtime.score_mod import array_derivatives, float_slots

    t = trace(lambda s, b, h, i, j: mods.tanh(s * SLOPES[h]) + mods.where(DOC[i] == 1, SLOPES[0], 0.0) + DOC[j],
              "score_mod")
    terms = {r.key: d.key for r, d in array_derivatives(t)}
    assert float_slots(t) == (0,)   # DOC (int32) gets no gradient
    th = "(tanh (mul score (read 0 h)))"
    assert terms == {"(read 0 h)": f"(mul (sub 1.0 (mul {th} {th})) score)",
                     "(read 0 0)": "(where (eq (read 1 q_idx) 1) 1.0 0.0)"}
    assert array_derivatives(trace(lambda b, h, i, j: SLOPES[h] > 0, "mask_mod")) == []
