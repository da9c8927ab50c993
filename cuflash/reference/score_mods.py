"""``score_mod`` and ``mask_mod`` evaluated on NumPy blocks: the NumPy twin of the traced tree.

:func:`evaluate` computes a traced expression (:mod:`cuflash.runtime.score_mod`) elementwise
over broadcastable index arrays, each distinct subexpression once. The operations follow
NumPy's (and Python's) semantics: ``//`` floors and ``%`` takes the divisor's sign,
``minimum``/``maximum`` propagate NaN, integer arguments are int64, captured arrays are read
as they are (float32 slopes stay float32; the result is cast to the block's type by the
caller). Imports: :mod:`cuflash.runtime` only.
"""

from __future__ import annotations

import numpy as np

from cuflash.runtime.score_mod import Expr, TracedMod, derivative

__all__ = ["evaluate", "ModTerms"]

_NP = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "floordiv": np.floor_divide,
    "mod": np.mod, "min": np.minimum, "max": np.maximum, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh, "abs": np.abs, "not": np.logical_not,
}


def evaluate(expr: Expr, env: dict, arrays: tuple, memo: dict | None = None):
    """The value of ``expr`` with ``env`` giving each argument (``"score"``, ``"b"``, ``"h"``,
    ``"q_idx"``, ``"kv_idx"``: arrays broadcastable to each other) and ``arrays`` the captured
    arrays (NumPy). ``memo`` (by canonical text) may be shared between expressions over the
    same ``env`` (the function and its derivative). Returns an array (or a scalar for a
    constant expression); invalid-value and overflow warnings are the caller's to silence."""
    memo = {} if memo is None else memo

    def ev(e: Expr):
        k = e.key
        if k in memo:
            return memo[k]
        op = e.op
        if op in env:
            r = env[op]
        elif op == "const":
            r = e.value
        elif op == "read":
            r = np.asarray(arrays[e.value])[tuple(ev(a) for a in e.args)]
        elif op == "where":
            r = np.where(ev(e.args[0]), ev(e.args[1]), ev(e.args[2]))
        else:
            r = _NP[op](*(ev(a) for a in e.args))
        memo[k] = r
        return r

    return ev(expr)


class ModTerms:
    """A traced ``score_mod`` and ``mask_mod`` of one problem, evaluated block by block.

    Parameters
    ----------
    score_mod, mask_mod : TracedMod or None
    """

    def __init__(self, score_mod: TracedMod | None, mask_mod: TracedMod | None):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.d_score = None
        if score_mod is not None:
            d = derivative(score_mod.expr)
            self.d_score = None if (d.op == "const" and d.value == 1.0) else d

    def modify(self, s: np.ndarray, index: dict, want_grad: bool = False):
        """Apply ``score_mod`` to ``s`` in place (``index``: the ``b``, ``h``, ``q_idx``,
        ``kv_idx`` arrays broadcastable to ``s``); with ``want_grad`` return ``d score_mod / d
        score`` at the scores given (an array of ``s``'s shape and type), or None where it is
        1 everywhere."""
        m = self.score_mod
        env = dict(index, score=s)
        memo: dict = {}
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            out = evaluate(m.expr, env, m.arrays, memo)
            grad = None
            if want_grad and self.d_score is not None:
                grad = np.broadcast_to(evaluate(self.d_score, env, m.arrays, memo), s.shape).astype(s.dtype)
        s[...] = out
        return grad

    def keep(self, index: dict, shape: tuple):
        """``mask_mod``'s block (True = attend) of ``shape``."""
        m = self.mask_mod
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            k = evaluate(m.expr, index, m.arrays)
        return np.broadcast_to(np.asarray(k, dtype=bool), shape)
