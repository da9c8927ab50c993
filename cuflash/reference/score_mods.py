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

from cuflash.runtime.score_mod import Expr, TracedMod, array_derivatives, derivative, float_slots

__all__ = ["evaluate", "ModTerms", "ArrayGrads"]

_NP = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "floordiv": np.floor_divide,
    "mod": np.mod, "min": np.minimum, "max": np.maximum, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh, "abs": np.abs, "not": np.logical_not,
}


def evaluate(expr: Expr, env: dict, arrays: tuple, memo: dict | None = None, xp=np):
    """The value of ``expr`` with ``env`` giving each argument (``"score"``, ``"b"``, ``"h"``,
    ``"q_idx"``, ``"kv_idx"``: arrays broadcastable to each other) and ``arrays`` the captured
    arrays (NumPy). ``memo`` (by canonical text) may be shared between expressions over the
    same ``env`` (the function and its derivative). Returns an array (or a scalar for a
    constant expression); invalid-value and overflow warnings are the caller's to silence.
    ``xp``: the array module of ``env`` and ``arrays`` (CuPy evaluates on the device with the
    same ufuncs)."""
    memo = {} if memo is None else memo
    ops = _NP if xp is np else {k: getattr(xp, f.__name__) for k, f in _NP.items()}

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
            r = xp.asarray(arrays[e.value])[tuple(ev(a) for a in e.args)]
        elif op == "where":
            r = xp.where(ev(e.args[0]), ev(e.args[1]), ev(e.args[2]))
        else:
            r = ops[op](*(ev(a) for a in e.args))
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
        self.d_arrays = []
        if score_mod is not None:
            d = derivative(score_mod.expr)
            self.d_score = None if (d.op == "const" and d.value == 1.0) else d
            self.d_arrays = array_derivatives(score_mod)

    def modify(self, s: np.ndarray, index: dict, want_grad: bool = False, want_arrays: bool = False):
        """Apply ``score_mod`` to ``s`` in place (``index``: the ``b``, ``h``, ``q_idx``,
        ``kv_idx`` arrays broadcastable to ``s``); with ``want_grad`` return ``d score_mod / d
        score`` at the scores given (an array of ``s``'s shape and type), or None where it is
        1 everywhere. With ``want_arrays`` as well, return ``(grad, terms)``: ``terms`` a list of
        ``(slot, index, d)`` per read of a captured float array (:func:`array_derivatives`):
        the read's index arrays and ``d score_mod / d read`` at the scores given, both
        broadcast to ``s``'s shape (for :meth:`ArrayGrads.add`)."""
        m = self.score_mod
        env = dict(index, score=s)
        memo: dict = {}
        terms = []
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            out = evaluate(m.expr, env, m.arrays, memo)
            grad = None
            if want_grad and self.d_score is not None:
                grad = np.broadcast_to(evaluate(self.d_score, env, m.arrays, memo), s.shape).astype(s.dtype)
            if want_arrays:
                for r, d in self.d_arrays:
                    idx = tuple(np.broadcast_to(evaluate(i, env, m.arrays, memo), s.shape) for i in r.args)
                    terms.append((r.value, idx, np.broadcast_to(evaluate(d, env, m.arrays, memo), s.shape)
                                  .astype(s.dtype)))
        s[...] = out
        return (grad, terms) if want_arrays else grad

    def keep(self, index: dict, shape: tuple):
        """``mask_mod``'s block (True = attend) of ``shape``."""
        m = self.mask_mod
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            k = evaluate(m.expr, index, m.arrays)
        return np.broadcast_to(np.asarray(k, dtype=bool), shape)


class ArrayGrads:
    """The gradients of a score_mod's captured float arrays (:func:`float_slots`), accumulated
    block by block: ``d array[idx] += sum dS * d score_mod / d read`` over the pairs of a block
    whose ``dS`` (the gradient of score_mod's result) is not 0, for each read of the array (a
    hidden pair adds nothing, even where the derivative is not finite). Sums go through
    ``numpy.bincount`` over the flattened index, in the pairs' row-major order: a fixed order, so
    the result depends only on the blocks' order (:meth:`partial` / :meth:`commit` let the tiled
    path keep one buffer per work item and add the items in a fixed order).

    Parameters
    ----------
    traced : TracedMod
        The score_mod.
    acc_t : numpy dtype
        The accumulation type.
    """

    def __init__(self, traced: TracedMod, acc_t):
        self.traced, self.acc_t = traced, np.dtype(acc_t)
        self.slots = float_slots(traced)
        self.shapes = {i: tuple(int(n) for n in traced.arrays[i].shape) for i in self.slots}
        self.buf = self.partial()

    def partial(self) -> dict:
        """Zeroed buffers, one per float array (slot -> flat array)."""
        return {i: np.zeros(int(np.prod(self.shapes[i], dtype=np.int64)), self.acc_t) for i in self.slots}

    def add(self, part: dict, ds: np.ndarray, terms: list) -> None:
        """Add one block: ``ds`` the gradient of score_mod's result, ``terms`` from
        :meth:`ModTerms.modify` (``want_arrays``)."""
        live = ds != 0
        if not live.any():
            return
        for slot, idx, d in terms:
            w = ds[live] * d[live]
            flat = np.ravel_multi_index(tuple(i[live] for i in idx), self.shapes[slot])
            part[slot] += np.bincount(flat, weights=w, minlength=part[slot].size).astype(self.acc_t, copy=False)

    def commit(self, part: dict) -> None:
        for i in self.slots:
            self.buf[i] += part[i]

    def result(self, dtype=None) -> dict:
        """``{name: gradient}``: each float array's gradient in its own shape and dtype (NumPy;
        ``dtype`` given: in that dtype)."""
        t = self.traced
        return {t.names[i]: self.buf[i].reshape(self.shapes[i]).astype(dtype or t.array_dtypes[i])
                for i in self.slots}
