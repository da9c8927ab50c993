"""How a covering design splits between the default run and ``-m slow``."""

from __future__ import annotations

import pytest


def default_share(cases, ids=None, *, args=lambda c: (c,), key=lambda c: c, every=8):
    """``pytest.param`` of each case of a design: the default run takes, in order, every case
    that brings a value of some axis not seen yet (so every value of every axis runs at least
    once) and every ``every``-th case besides (a share of the pairs); the rest of the design
    runs under ``slow``.

    ``args(case)`` are the test's arguments (default: the case itself), ``key(case)`` the axes'
    values (default: the case), ``ids`` the cases' test ids."""
    seen: set = set()
    params = []
    for i, case in enumerate(cases):
        values = {(axis, repr(v)) for axis, v in enumerate(key(case))}
        marks = () if values - seen or i % every == 0 else (pytest.mark.slow,)
        seen |= values
        params.append(pytest.param(*args(case), id=None if ids is None else ids[i], marks=marks))
    return params


def case_id(case) -> str:
    """A grid case's test id: its fields joined by ``-``, a list or tuple field by ``_``."""
    return "-".join("_".join(map(str, x)) if isinstance(x, (list, tuple)) else str(x) for x in case)
