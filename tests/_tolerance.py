"""The tests' assertion of the tolerance rule; the rule itself is the package's
(:mod:`cuflash.reference.tolerance`), which ``python -m cuflash check`` applies too."""

from __future__ import annotations

import numpy as np

from cuflash import reference as ref
from cuflash.reference import tolerance


def check_close(actual, q, k, v, *, layout="bhsd", large_logits=False, **kw):
    """Assert ``actual`` is within the tolerance rule for attention(q, k, v, **kw); return its error.

    With ``large_logits`` the bound is the larger of the rule and
    :func:`cuflash.reference.tolerance.score_rounding_bound`.
    """
    expected = ref.naive_attention(q, k, v, layout=layout, **kw)
    baseline = tolerance.naive_same_dtype(q, k, v, layout=layout, **kw)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = np.asarray(actual, dtype=np.float64)
    assert not np.isnan(a).any(), "NaN in the output of finite input"
    err = np.max(np.abs(a - expected), initial=0.0)
    base_err = np.max(np.abs(baseline - expected), initial=0.0)
    bound = tolerance.bound(q.dtype, base_err, q=q, k=k, v=v, softmax_scale=kw.get("softmax_scale"),
                            large_logits=large_logits)
    assert err <= bound, f"max error {err:.3g} exceeds the bound {bound:.3g} (same-dtype naive error {base_err:.3g})"
    return err
