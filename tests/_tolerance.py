"""The tests' assertion of the tolerance rule; the rule itself is the package's
(:mod:`cuflash.reference.tolerance`), which ``python -m cuflash check`` applies too."""

from __future__ import annotations

from cuflash.reference import tolerance


def check_close(actual, q, k, v, *, layout="bhsd", large_logits=False, **kw):
    """Assert ``actual`` is within the tolerance rule for attention(q, k, v, **kw) (shape, no NaN,
    max error); return its max error. With ``large_logits`` the bound is at least
    :func:`cuflash.reference.tolerance.score_rounding_bound`."""
    ok, msg, err = tolerance.compare(actual, q, k, v, layout=layout, large_logits=large_logits, **kw)
    assert ok, msg
    return err
