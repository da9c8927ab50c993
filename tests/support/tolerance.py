"""The tests' assertion of the tolerance rule; the rule itself is the package's
(:mod:`cuflash.reference.tolerance`), which ``python -m cuflash check`` applies too."""

from __future__ import annotations

import numpy as np

from cuflash.reference import tolerance


def check_close(actual, q, k, v, *, layout="bhsd", large_logits=False, **kw):
    """Assert ``actual`` is within the tolerance rule for attention(q, k, v, **kw) (shape, no NaN,
    max error); return its max error. With ``large_logits`` the bound is at least
    :func:`cuflash.reference.tolerance.score_rounding_bound`."""
    ok, msg, err = tolerance.compare(actual, q, k, v, layout=layout, large_logits=large_logits, **kw)
    assert ok, msg
    return err


def check_lse(lse, q, k, v, **kw):
    """Assert ``lse`` equals the float64 oracle's: ``-inf`` exactly on the rows without a visible
    key, close elsewhere (relative 2e-5 of the largest magnitude)."""
    from cuflash import reference as ref

    _, lse_ref = ref.naive_attention(q, k, v, return_lse=True, **kw)
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty), "rows without a visible key must have lse = -inf"
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], rtol=2e-5,
                               atol=2e-5 * max(1.0, np.abs(lse_ref[~empty]).max(initial=0)))
    return empty


def check_packed_forward(out, lse, q, k, v, cq, ck, seqused, **kw):
    """Each sequence of a packed batch's ``(out, lse)`` within the rule of a fixed-shape call on
    its own slices (:func:`check_close`; the lse against float64). ALiBi slopes of shape
    ``(B, Hq)`` are sequence ``b``'s row for sequence ``b``; so are fp8 descales ``(B, Hk)`` (the
    fp8 rule; the lse against the float64 attention of the descaled values)."""
    from cuflash import reference as ref
    from support.inputs import sequences

    assert out.shape == q.shape[:2] + (v.shape[-1],) and lse.shape == (q.shape[1], q.shape[0])
    slopes = kw.get("alibi_slopes")
    scales = {n: kw.pop(n) for n in FP8_KEYS if n in kw}
    group = q.shape[1] // k.shape[1]
    for i, (rq, rk, _) in enumerate(sequences(cq, ck, seqused)):
        if rq.stop == rq.start:
            continue
        if slopes is not None and np.ndim(slopes) == 2:
            kw = dict(kw, alibi_slopes=slopes[i])
        row = {n: s if n == "out_dtype" or s is None else np.asarray(s)[i:i + 1] for n, s in scales.items()}
        qs, ks, vs = q[None, rq], k[None, rk], v[None, rk]
        check_close(out[None, rq], qs, ks, vs, layout="bshd", **kw, **row)
        q64, k64, v64 = (a.astype(np.float64) for a in (qs, ks, vs))
        for name, g in (("q", group), ("k", 1), ("v", 1)):   # fp8: the descaled values, (1, S, H, D)
            d = row.get(f"{name}_descale")
            if d is not None:
                f = np.repeat(np.asarray(d, np.float64), g, axis=-1)[:, None, :, None]
                q64, k64, v64 = (a * f if n == name else a for a, n in ((q64, "q"), (k64, "k"), (v64, "v")))
        _, lse64 = ref.naive_attention(q64, k64, v64, layout="bshd", return_lse=True, **kw)
        got = lse[:, rq]
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(lse64[0]))
        fin = np.isfinite(lse64[0])
        np.testing.assert_allclose(got[fin], lse64[0][fin], rtol=1e-3, atol=2e-3)


#: the fp8 call's arguments :func:`check_packed_forward` takes per sequence
FP8_KEYS = ("q_descale", "k_descale", "v_descale", "out_dtype")


def check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, seqused, **kw):
    """Each sequence's gradients within the gradient rule (:func:`support.grads.check_grads_close`);
    keys past ``seqused_k`` get ``dk = dv = 0``."""
    from support.grads import check_grads_close
    from support.inputs import sequences

    dq, dk, dv = grads
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for rq, rk, rall in sequences(cq, ck, seqused):
        unused = slice(rk.stop, rall.stop)
        assert (dk[unused] == 0).all() and (dv[unused] == 0).all(), "keys past seqused_k get dk = dv = 0"
        if rq.stop == rq.start or rk.stop == rk.start:
            assert (dq[rq] == 0).all() and (dk[rk] == 0).all() and (dv[rk] == 0).all()
            continue
        g = (dq[None, rq], dk[None, rk], dv[None, rk])
        check_grads_close(g, dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq],
                          np.ascontiguousarray(lse[None, :, rq]), layout="bshd", **kw)
