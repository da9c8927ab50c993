"""User score and mask functions traced into an expression tree: ``score_mod`` and ``mask_mod``.

A ``score_mod(score, b, h, q_idx, kv_idx)`` returns a new score for one (query, key) pair; a
``mask_mod(b, h, q_idx, kv_idx)`` returns True where the pair is attended. :func:`trace` calls
the function once with symbolic stand-ins (:class:`Expr`) for its arguments and records what it
computes as a tree of the operation set below; nothing else is accepted, and whatever falls
outside is refused while tracing, with the operation named.

The stand-ins and their meaning:

* ``score``: the scaled score ``softmax_scale * q_i . k_j`` after the built-in modifiers (softcap,
  ALiBi, ``attn_bias``), float;
* ``b``: the batch index (the row-major linear index over every batch axis), int;
* ``h``: the query head, int in ``[0, Hq)``;
* ``q_idx``, ``kv_idx``: the query row in ``[0, Sq)`` and the key in ``[0, Sk)``, int (no
  causal alignment is applied: bottom-right alignment is ``q_idx + Sk - Sq``).

The operation set (each spelling works on the stand-ins):

=====================  =====================================================================
arithmetic             ``+ - *`` and unary ``-``; ``/`` (true division, float result);
                       ``//`` and ``%`` on integers (floor division and Python's modulo)
comparisons            ``< <= > >= == !=`` (bool result); ``&``, ``|``, ``~`` on bools
functions              ``where(cond, a, b)``, ``exp``, ``log``, ``tanh``, ``abs``,
                       ``minimum``, ``maximum``, ``clamp(x, lo, hi)``: from
                       :mod:`cuflash.mods`, or NumPy's (``np.where``, ``np.tanh``, ...,
                       ``np.clip``), or torch's (``torch.where``, ``torch.tanh``, ...,
                       ``torch.clamp``); also ``abs(x)`` and the methods ``x.exp()``,
                       ``x.log()``, ``x.tanh()``, ``x.abs()``, ``x.clamp(lo, hi)``
captured arrays        an array the function closes over (a closure variable or a module
                       global it names), read with one integer index per axis:
                       ``slopes[h]``, ``doc_id[q_idx]``, ``table[h, kv_idx - q_idx + 7]``;
                       float32, float64, int32, int64 or bool; its values are run-time
                       arguments (new values change no compiled code)
constants              Python and NumPy scalars (``float("-inf")`` masks a pair)
=====================  =====================================================================

Refused while tracing (``TypeError`` naming the operation): ``if``/``and``/``or``/``not`` or
``bool()`` on a traced value (data-dependent Python control flow: use ``where``, ``&``, ``|``,
``~``), ``min()``/``max()`` builtins (use ``minimum``/``maximum``), ``int()``/``float()``
(``math.*`` functions), ``**`` and the bit operations, any other NumPy or torch function,
indexing an array that was not captured, slicing a captured array or indexing it with a float,
a function with the wrong number of arguments, a ``mask_mod`` not returning a bool or a
``score_mod`` returning one. A captured array of an unsupported dtype or with no axes is a
``TypeError`` too; an index that may fall outside its array is a ``ValueError`` raised by
:func:`check_reads` once the problem's sizes are known (the index range is computed by
interval arithmetic, so clamp an index with ``minimum``/``maximum`` where it can stray).

The tree's canonical text (:attr:`TracedMod.key`) names operations, constants (``repr``) and the
captured arrays by position, dtype and rank, never by value or variable name: it is the cache
key of the compiled variant. :func:`derivative` gives ``d score_mod / d score`` as another tree
(for the backward; reads of captured arrays are constants to it), and
:func:`array_derivatives` ``d score_mod / d read`` for each read of a captured float array (the
arrays' gradients, ``return_dscore_mod``).

Imports: nothing of cuflash (the bottom layer).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import types

import numpy as np

__all__ = ["Expr", "TracedMod", "TraceRefused", "trace", "bind", "derivative", "array_derivatives", "float_slots", "where", "exp", "log", "tanh", "absolute",
           "minimum", "maximum", "clamp", "check_reads", "index_bounds", "emit_c", "kernel_refusal",
           "kernel_texts", "array_grad_c", "SCORE_ARGS",
           "MASK_ARGS"]

#: the arguments of a score_mod and of a mask_mod, in order
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = SCORE_ARGS[1:]
#: the most nodes a traced expression may have
MAX_NODES = 4096

#: captured array dtypes -> the kind of value a read gives ("f" float, "i" int, "b" bool)
ARRAY_KINDS = {"float32": "f", "float64": "f", "int32": "i", "int64": "i", "bool": "b"}
_KIND_NAMES = {"f": "float", "i": "int", "b": "bool"}

_UNARY = ("neg", "exp", "log", "tanh", "abs", "not")
_BINARY = ("add", "sub", "mul", "div", "floordiv", "mod", "min", "max", "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


class TraceRefused(TypeError):
    """A traced function did something outside the operation set (the message names it)."""


def _refuse(what: str):
    raise TraceRefused(what)


class Expr:
    """One node of a traced expression (and the symbolic stand-in the traced function receives).

    Attributes
    ----------
    op : str
        ``"score"``, ``"b"``, ``"h"``, ``"q_idx"``, ``"kv_idx"`` (the arguments), ``"const"``,
        ``"read"`` (a captured array read), a unary or binary operation, or ``"where"``.
    args : tuple of Expr
        The operands (the indices of a read).
    kind : {"f", "i", "b"}
        Float, integer or bool.
    value : object
        The constant (``"const"``), or the captured array's position (``"read"``).
    """

    __slots__ = ("op", "args", "kind", "value", "_key", "_size")
    __hash__ = None   # == builds an expression

    def __init__(self, op: str, args: tuple = (), kind: str = "f", value=None):
        self.op, self.args, self.kind, self.value = op, tuple(args), kind, value
        self._key = None
        self._size = 1 + sum(a._size for a in self.args)
        if self._size > MAX_NODES:
            _refuse(f"the expression grew past {MAX_NODES} operations")

    # -- canonical text ---------------------------------------------------------------------
    @property
    def key(self) -> str:
        """The canonical text: ``(op arg ...)``; constants by ``repr``, reads as ``(read N i ...)``."""
        if self._key is None:
            if self.op == "const":
                v = self.value
                self._key = ("true" if v else "false") if self.kind == "b" else repr(v)
            elif not self.args:
                self._key = self.op
            elif self.op == "read":
                self._key = f"(read {self.value} {' '.join(a.key for a in self.args)})"
            else:
                self._key = f"({self.op} {' '.join(a.key for a in self.args)})"
        return self._key

    def __repr__(self) -> str:
        return f"Expr<{_KIND_NAMES[self.kind]}>{self.key}"

    # -- arithmetic -------------------------------------------------------------------------
    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("sub", self, o)
    def __rsub__(self, o): return _binary("sub", o, self)
    def __mul__(self, o): return _binary("mul", self, o)
    def __rmul__(self, o): return _binary("mul", o, self)
    def __truediv__(self, o): return _binary("div", self, o)
    def __rtruediv__(self, o): return _binary("div", o, self)
    def __floordiv__(self, o): return _binary("floordiv", self, o)
    def __rfloordiv__(self, o): return _binary("floordiv", o, self)
    def __mod__(self, o): return _binary("mod", self, o)
    def __rmod__(self, o): return _binary("mod", o, self)
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    def __lt__(self, o): return _binary("lt", self, o)
    def __le__(self, o): return _binary("le", self, o)
    def __gt__(self, o): return _binary("gt", self, o)
    def __ge__(self, o): return _binary("ge", self, o)
    def __eq__(self, o): return _binary("eq", self, o)   # noqa: PLE0307 (builds an expression)
    def __ne__(self, o): return _binary("ne", self, o)
    def __and__(self, o): return _binary("and", self, o)
    def __rand__(self, o): return _binary("and", o, self)
    def __or__(self, o): return _binary("or", self, o)
    def __ror__(self, o): return _binary("or", o, self)
    def __invert__(self): return _unary("not", self)

    # -- method spellings (torch's) ---------------------------------------------------------
    def exp(self): return _unary("exp", self)
    def log(self): return _unary("log", self)
    def tanh(self): return _unary("tanh", self)
    def abs(self): return _unary("abs", self)
    def clamp(self, min=None, max=None): return clamp(self, min, max)   # noqa: A002 (torch's names)

    # -- what is refused --------------------------------------------------------------------
    def __bool__(self):
        _refuse("`if`, `and`, `or`, `not`, `bool()` or the builtins min()/max() on a traced value (data-dependent "
                "Python control flow); use cuflash.mods.where(cond, a, b), &, |, ~, cuflash.mods.minimum/maximum")

    def __float__(self):
        _refuse("float() on a traced value (math.* functions call it); use cuflash.mods.exp/log/tanh/...")

    def __int__(self):
        _refuse("int() on a traced value; integer arguments are already ints, use // for integer division")

    def __index__(self):
        _refuse("a traced value used as a Python index (an array the function does not capture directly, or a "
                "list/range); capture the array in the function's closure or as a module global and index it there")

    def __complex__(self): _refuse("complex() on a traced value")
    def __round__(self, n=None): _refuse("round() on a traced value")
    def __trunc__(self): _refuse("math.trunc() on a traced value")
    def __floor__(self): _refuse("math.floor() on a traced value; use // on integers")
    def __ceil__(self): _refuse("math.ceil() on a traced value")
    def __pow__(self, o, m=None): _refuse("** (power); write the product, e.g. x * x")
    def __rpow__(self, o): _refuse("** (power)")
    def __lshift__(self, o): _refuse("<< (shift)")
    def __rlshift__(self, o): _refuse("<< (shift)")
    def __rshift__(self, o): _refuse(">> (shift)")
    def __rrshift__(self, o): _refuse(">> (shift)")
    def __xor__(self, o): _refuse("^ (exclusive or); use (a | b) & ~(a & b)")
    def __rxor__(self, o): _refuse("^ (exclusive or)")
    def __matmul__(self, o): _refuse("@ (matrix product)")
    def __rmatmul__(self, o): _refuse("@ (matrix product)")
    def __divmod__(self, o): _refuse("divmod(); use // and %")
    def __rdivmod__(self, o): _refuse("divmod(); use // and %")
    def __getitem__(self, i): _refuse("indexing a traced value (only captured arrays are indexed)")
    def __iter__(self): _refuse("iterating over a traced value")
    def __len__(self): _refuse("len() of a traced value")

    # -- NumPy's and torch's spellings ------------------------------------------------------
    __array_priority__ = 1000

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        name = getattr(ufunc, "__name__", str(ufunc))
        op = _NUMPY_UFUNCS.get(name)
        if method != "__call__" or kwargs or op is None:
            _refuse(f"numpy.{name}{'' if method == '__call__' else '.' + method}"
                    f"{' with ' + ', '.join(kwargs) if kwargs else ''}")
        return op(*inputs)

    def __array_function__(self, func, types_, args, kwargs):
        name = getattr(func, "__name__", str(func))
        if name == "where" and not kwargs and len(args) == 3:
            return where(*args)
        if name == "clip" and len(args) + len(kwargs) == 3:
            a = list(args) + [kwargs.get(n) for n in ("a_min", "a_max", "min", "max") if n in kwargs]
            return clamp(*a)
        _refuse(f"numpy.{name}")

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func)).split(".")[-1]
        if name == "clamp" or name == "clip":
            lo = kwargs.pop("min", args[1] if len(args) > 1 else None)
            hi = kwargs.pop("max", args[2] if len(args) > 2 else None)
            if not kwargs:
                return clamp(args[0], lo, hi)
        op = _TORCH_FUNCS.get(name)
        if op is None or kwargs:
            _refuse(f"torch.{name}{' with ' + ', '.join(kwargs) if kwargs else ''}")
        return op(*args)


def _const(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, CapturedArray):
        _refuse(f"arithmetic on the whole captured array {x.name!r}; read one element, e.g. {x.name}[h]")
    if isinstance(x, (bool, np.bool_)):
        return Expr("const", kind="b", value=bool(x))
    if isinstance(x, numbers.Integral):
        return Expr("const", kind="i", value=int(x))
    if isinstance(x, numbers.Real):
        return Expr("const", kind="f", value=float(x))
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.name in ARRAY_KINDS:
        return _const(x[()])
    _refuse(f"an operand of type {type(x).__name__} ({x!r:.60}); only traced values, Python/NumPy scalars and "
            f"elements of captured arrays take part")


def _numeric(a: Expr, op: str) -> None:
    if a.kind == "b":
        _refuse(f"{_OP_TEXT[op]} on a bool; use cuflash.mods.where(cond, a, b) to turn a condition into a number")


def _unary(op: str, a) -> Expr:
    a = _const(a)
    if op == "not":
        if a.kind != "b":
            _refuse("~ on a number (bitwise not); ~ is the logical not of a condition")
        return Expr("not", (a,), "b")
    _numeric(a, op)
    kind = "f" if op in ("exp", "log", "tanh") else a.kind
    return Expr(op, (a,), kind)


def _binary(op: str, a, b) -> Expr:
    a, b = _const(a), _const(b)
    if op in ("and", "or"):
        if a.kind != "b" or b.kind != "b":
            _refuse(f"{_OP_TEXT[op]} on numbers (bitwise); & and | combine conditions (bools)")
        return Expr(op, (a, b), "b")
    if op in ("eq", "ne") and a.kind == "b" and b.kind == "b":
        return Expr(op, (a, b), "b")
    _numeric(a, op)
    _numeric(b, op)
    if op in _COMPARE:
        return Expr(op, (a, b), "b")
    if op in ("floordiv", "mod"):
        if a.kind != "i" or b.kind != "i":
            _refuse(f"{_OP_TEXT[op]} on a float; integer division and modulo take integers")
        if b.op == "const" and b.value == 0:
            _refuse(f"{_OP_TEXT[op]} by the constant 0")
        return Expr(op, (a, b), "i")
    kind = "f" if op == "div" or "f" in (a.kind, b.kind) else "i"
    return Expr(op, (a, b), kind)


_OP_TEXT = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "min": "minimum",
            "max": "maximum", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&",
            "or": "|", "neg": "unary -", "exp": "exp", "log": "log", "tanh": "tanh", "abs": "abs", "not": "~"}


# ------------------------------------------------------------------------------------------
# the functions (cuflash.mods re-exports them)


def where(cond, a, b) -> Expr:
    """``a`` where ``cond`` holds, else ``b`` (elementwise, as ``numpy.where``); ``cond`` a bool
    expression, ``a`` and ``b`` both numbers (float if either is) or both bools."""
    cond, a, b = _const(cond), _const(a), _const(b)
    if cond.kind != "b":
        _refuse("where() with a condition that is not a bool (compare it, e.g. where(x > 0, ...))")
    if (a.kind == "b") != (b.kind == "b"):
        _refuse("where() mixing a bool and a number in its branches")
    kind = "b" if a.kind == "b" else ("f" if "f" in (a.kind, b.kind) else "i")
    return Expr("where", (cond, a, b), kind)


def exp(x) -> Expr:
    """``e ** x`` (float)."""
    return _unary("exp", x)


def log(x) -> Expr:
    """The natural logarithm (float; ``log(0) = -inf``)."""
    return _unary("log", x)


def tanh(x) -> Expr:
    """The hyperbolic tangent (float)."""
    return _unary("tanh", x)


def absolute(x) -> Expr:
    """``|x|`` (of x's kind); ``abs(x)`` works as well."""
    return _unary("abs", x)


def minimum(a, b) -> Expr:
    """The smaller of ``a`` and ``b`` (float if either is)."""
    return _binary("min", a, b)


def maximum(a, b) -> Expr:
    """The larger of ``a`` and ``b`` (float if either is)."""
    return _binary("max", a, b)


def clamp(x, lo=None, hi=None) -> Expr:
    """``minimum(maximum(x, lo), hi)``; None leaves that side open."""
    x = _const(x)
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


_NUMPY_UFUNCS = {
    "add": lambda a, b: _binary("add", a, b), "subtract": lambda a, b: _binary("sub", a, b),
    "multiply": lambda a, b: _binary("mul", a, b), "true_divide": lambda a, b: _binary("div", a, b),
    "divide": lambda a, b: _binary("div", a, b), "floor_divide": lambda a, b: _binary("floordiv", a, b),
    "remainder": lambda a, b: _binary("mod", a, b), "mod": lambda a, b: _binary("mod", a, b),
    "negative": lambda a: _unary("neg", a), "absolute": absolute, "abs": absolute, "exp": exp, "log": log,
    "tanh": tanh, "minimum": minimum, "maximum": maximum, "fmin": minimum, "fmax": maximum,
    "less": lambda a, b: _binary("lt", a, b), "less_equal": lambda a, b: _binary("le", a, b),
    "greater": lambda a, b: _binary("gt", a, b), "greater_equal": lambda a, b: _binary("ge", a, b),
    "equal": lambda a, b: _binary("eq", a, b), "not_equal": lambda a, b: _binary("ne", a, b),
    "logical_and": lambda a, b: _binary("and", a, b), "logical_or": lambda a, b: _binary("or", a, b),
    "logical_not": lambda a: _unary("not", a), "bitwise_and": lambda a, b: _binary("and", a, b),
    "bitwise_or": lambda a, b: _binary("or", a, b), "invert": lambda a: _unary("not", a),
}
_TORCH_FUNCS = {
    "where": where, "exp": exp, "log": log, "tanh": tanh, "abs": absolute, "absolute": absolute,
    "minimum": minimum, "maximum": maximum, "fmin": minimum, "fmax": maximum,
    "logical_and": _NUMPY_UFUNCS["logical_and"], "logical_or": _NUMPY_UFUNCS["logical_or"],
    "logical_not": _NUMPY_UFUNCS["logical_not"], "neg": _NUMPY_UFUNCS["negative"],
    "negative": _NUMPY_UFUNCS["negative"],
    # torch.Tensor's operator slots, reached when a captured element meets a torch scalar
    "__add__": _NUMPY_UFUNCS["add"], "__radd__": lambda a, b: _binary("add", b, a),
    "__sub__": _NUMPY_UFUNCS["subtract"], "__rsub__": lambda a, b: _binary("sub", b, a),
    "__mul__": _NUMPY_UFUNCS["multiply"], "__rmul__": lambda a, b: _binary("mul", b, a),
}


# ------------------------------------------------------------------------------------------
# captured arrays


class CapturedArray:
    """The stand-in for an array a traced function captures: reading ``a[i, j]`` (one integer
    expression per axis) records a ``read`` node. ``shape``, ``ndim`` and ``dtype`` are the
    array's, and ``len()`` its first axis's (a shape used in the expression becomes a constant
    of it)."""

    def __init__(self, array, name: str, slot: int):
        self.array, self.name, self.slot = array, name, slot
        self.shape = tuple(int(n) for n in array.shape)
        self.ndim = len(self.shape)
        self.dtype = array.dtype
        self.kind = ARRAY_KINDS[_dtype_name(array)]

    def __getitem__(self, index) -> Expr:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.ndim:
            _refuse(f"reading the captured array {self.name!r} (shape {self.shape}) with {len(index)} index(es); "
                    f"give one integer index per axis ({self.ndim})")
        args = []
        for axis, i in enumerate(index):
            if isinstance(i, (slice, type(Ellipsis), type(None))) or (isinstance(i, np.ndarray) and i.ndim):
                _refuse(f"slicing the captured array {self.name!r} (axis {axis}: {i!r}); read one element per call")
            e = _const(i)
            if e.kind != "i":
                _refuse(f"indexing the captured array {self.name!r} with a {_KIND_NAMES[e.kind]} on axis {axis}; "
                        f"indices are integers")
            args.append(e)
        return Expr("read", args, self.kind, self.slot)

    def __bool__(self):
        _refuse(f"bool() of the captured array {self.name!r}")

    def __len__(self):   # a static size, as .shape[0]
        return self.shape[0]

    def __iter__(self):
        _refuse(f"iterating over the captured array {self.name!r}; read one element per index, e.g. "
                f"{self.name}[h]")

    def __call__(self, *args, **kwargs):
        _refuse(f"calling the captured array {self.name!r}; read it with [...]")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _refuse(f"numpy.{getattr(ufunc, '__name__', ufunc)} on the whole captured array {self.name!r}; "
                f"read one element, e.g. {self.name}[h]")

    def __getattr__(self, name):
        _refuse(f"{self.name}.{name} on the captured array {self.name!r}; only reading one element "
                f"({self.name}[...]) and .shape/.ndim/.dtype are traceable")


def _dtype_name(x) -> str:
    dt = getattr(x, "dtype", None)
    name = getattr(dt, "name", None) or str(dt)
    return name.replace("torch.", "")


def _is_array(x) -> bool:
    if isinstance(x, (np.generic, numbers.Number, str, bytes, type, types.ModuleType)) or callable(x):
        return False
    return hasattr(x, "shape") and hasattr(x, "dtype") and (
        hasattr(x, "__array__") or hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"))


# ------------------------------------------------------------------------------------------
# tracing


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A traced ``score_mod`` or ``mask_mod``.

    Attributes
    ----------
    role : {"score_mod", "mask_mod"}
    expr : Expr
        The result: a float expression (``score_mod``; an integer result is converted) or a bool
        (``mask_mod``).
    arrays : tuple
        The captured arrays in slot order (``(read N ...)`` reads ``arrays[N]``), as the
        function holds them (NumPy, CuPy or a DLPack array).
    names : tuple of str
        Their variable names, for messages.
    key : str
        The canonical text: the role, each array's dtype and rank, and the expression. Two
        functions with the same key compile to the same code.
    fn : callable
        The function traced.
    """

    role: str
    expr: Expr
    arrays: tuple
    names: tuple
    key: str
    fn: object

    @property
    def array_dtypes(self) -> tuple:
        return tuple(_dtype_name(a) for a in self.arrays)

    def reads(self):
        """Every distinct read node of the expression, in canonical-text order."""
        return _collect(self.expr, lambda e: e.op == "read")


def _collect(expr: Expr, pred) -> list:
    seen, out = {}, []

    def walk(e):
        if e.key in seen:
            return
        seen[e.key] = True
        for a in e.args:
            walk(a)
        if pred(e):
            out.append(e)

    walk(expr)
    return out


def _with_stand_ins(fn, role):
    """``(function, arrays, names)``: ``fn`` rebuilt with its captured arrays (closure cells and
    the module globals its code names) replaced by :class:`CapturedArray` stand-ins; the user's
    function itself is not touched."""
    arrays, names = [], []

    def stand_in(value, name):
        if not _is_array(value):
            return value
        dt = _dtype_name(value)
        if dt not in ARRAY_KINDS:
            _refuse(f"the captured array {name!r} has dtype {dt}; captured arrays must be one of "
                    f"{', '.join(ARRAY_KINDS)}")
        if len(getattr(value, "shape", ())) == 0:
            _refuse(f"the captured array {name!r} has no axes (0-d); capture a Python number instead, or a "
                    f"1-element array read as {name}[0]")
        arrays.append(value)
        names.append(name)
        return CapturedArray(value, name, len(arrays) - 1)

    code = fn.__code__
    closure = None
    if fn.__closure__:
        cells = []
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                value = cell.cell_contents
            except ValueError:   # an empty cell (a name bound later)
                cells.append(cell)
                continue
            cells.append(types.CellType(stand_in(value, name)))
        closure = tuple(cells)
    glb = fn.__globals__
    wanted = _global_names(code)
    if any(_is_array(glb.get(n)) for n in wanted):
        glb = dict(glb)
        for n in wanted:
            if n in glb:
                glb[n] = stand_in(glb[n], n)
    new = types.FunctionType(code, glb, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new, tuple(arrays), tuple(names)


def _global_names(code) -> list:
    names = list(code.co_names)
    for c in code.co_consts:   # nested lambdas and comprehensions
        if isinstance(c, types.CodeType):
            names += _global_names(c)
    return list(dict.fromkeys(names))


def trace(fn, role: str, func: str = "cuflash") -> TracedMod:
    """Trace ``fn`` as a ``score_mod`` (``role="score_mod"``) or ``mask_mod``.

    Parameters
    ----------
    fn : callable or TracedMod
        ``score_mod(score, b, h, q_idx, kv_idx) -> float`` or ``mask_mod(b, h, q_idx, kv_idx) ->
        bool`` written with the operation set of the module docstring (a :class:`TracedMod` of
        ``role`` is returned as it is). A Python function (its
        closure and globals are searched for captured arrays), or any callable (then arrays
        must reach it some other traceable way; a plain callable object captures none).
    role : {"score_mod", "mask_mod"}
    func : str
        The public function's name, for messages.

    Returns
    -------
    TracedMod

    Raises
    ------
    TypeError
        ``fn`` not callable or not taking the arguments positionally, an operation outside the
        set (named), a captured array of an unsupported dtype or with no axes, a ``mask_mod``
        that does not return a bool, a ``score_mod`` that returns one.
    """
    params = SCORE_ARGS if role == "score_mod" else MASK_ARGS
    sig_text = f"({', '.join(params)})"
    if isinstance(fn, TracedMod):   # traced already (the framework adapters trace once, then pass it on)
        if fn.role != role:
            raise TypeError(f"{func}: {role} must be a function {sig_text}, got a traced {fn.role}")
        return fn
    if not callable(fn):
        raise TypeError(f"{func}: {role} must be a function {sig_text}, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(*params)
        except TypeError:
            raise TypeError(f"{func}: {role} must take {len(params)} positional arguments {sig_text}, got a function "
                            f"with signature {sig}") from None
    stand_ins = [Expr(p, kind="f" if p == "score" else "i") for p in params]
    try:
        target, arrays, names = (_with_stand_ins(fn, role) if isinstance(fn, types.FunctionType)
                                 else (fn, (), ()))
        result = target(*stand_ins)
        expr = _const(result)
    except TraceRefused as e:
        raise TypeError(f"{func}: {role} is not traceable: {e}") from None
    if role == "mask_mod" and expr.kind != "b":
        raise TypeError(f"{func}: mask_mod must return a bool (a comparison, or conditions joined with & and |), "
                        f"got a {_KIND_NAMES[expr.kind]} expression {expr.key}")
    if role == "score_mod" and expr.kind == "b":
        raise TypeError(f"{func}: score_mod must return a number (the new score), got a bool expression "
                        f"{expr.key}; a mask is a mask_mod, or where(cond, score, float('-inf'))")
    used = sorted({e.value for e in _collect(expr, lambda e: e.op == "read")})
    if used != list(range(len(arrays))):   # drop captured arrays the result does not read; renumber
        remap = {old: new for new, old in enumerate(used)}
        expr = _renumber(expr, remap, {})
        arrays, names = tuple(arrays[i] for i in used), tuple(names[i] for i in used)
    header = " ".join(f"{_dtype_name(a)}[{len(a.shape)}]" for a in arrays)
    key = f"{role}({header}) {expr.key}"
    return TracedMod(role, expr, tuple(arrays), tuple(names), key, fn)


def bind(traced: TracedMod, name: str, value: int) -> TracedMod:
    """``traced`` with the integer argument ``name`` (``"b"``, ``"h"``, ...) replaced by the
    constant ``value`` everywhere (the packed batch's NumPy path runs sequence ``b`` as a
    one-entry batch and binds ``b`` to the sequence's index)."""
    const = Expr("const", kind="i", value=int(value))
    memo: dict = {}

    def sub(e: Expr) -> Expr:
        if e.key in memo:
            return memo[e.key]
        out = const if e.op == name else Expr(e.op, tuple(sub(a) for a in e.args), e.kind, e.value)
        memo[e.key] = out
        return out

    expr = sub(traced.expr)
    header = traced.key.split(")", 1)[0] + ")"
    return dataclasses.replace(traced, expr=expr, key=f"{header} {expr.key}")


def _renumber(e: Expr, remap: dict, memo: dict) -> Expr:
    if e.key in memo:
        return memo[e.key]
    args = tuple(_renumber(a, remap, memo) for a in e.args)
    value = remap[e.value] if e.op == "read" else e.value
    out = Expr(e.op, args, e.kind, value)
    memo[e.key] = out
    return out


# ------------------------------------------------------------------------------------------
# the derivative


def _zero(e):
    return e is None


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return _binary("add", a, b)


def _mul(a, b):
    """``a * b`` with None as 0 and the constant 1 dropped."""
    if a is None or b is None:
        return None
    if a.op == "const" and a.value == 1:
        return b
    if b.op == "const" and b.value == 1:
        return a
    return _binary("mul", a, b)


def _neg(a):
    return None if a is None else _unary("neg", a)


def _or_zero(a):
    return Expr("const", kind="f", value=0.0) if a is None else a


def derivative(expr: Expr, wrt: Expr | None = None) -> Expr:
    """``d expr / d score`` as an expression (float; the constant 0.0 when it does not depend on
    the score). Reads of captured arrays, integers and bools are constants to it. At a kink the
    derivative takes a side: ``abs`` has 0 at 0, ``minimum``/``maximum`` give a tie to their
    first argument, ``where`` differentiates the branch it takes.

    With ``wrt`` (a float ``read`` node of ``expr``), ``d expr / d wrt`` instead: that one read
    is the variable (the same array read at another index is another variable, a constant
    here) and the score is a constant (:func:`array_derivatives`)."""
    memo: dict = {}
    var = "score" if wrt is None else wrt.key

    def d(e: Expr):
        if e.kind != "f":
            return None
        if e.key in memo:
            return memo[e.key]
        a = e.args
        op = e.op
        if e.key == var:
            r = Expr("const", kind="f", value=1.0)
        elif op in ("const", "read", "score", "b", "h", "q_idx", "kv_idx"):
            r = None
        elif op == "add":
            r = _add(d(a[0]), d(a[1]))
        elif op == "sub":
            r = _add(d(a[0]), _neg(d(a[1])))
        elif op == "neg":
            r = _neg(d(a[0]))
        elif op == "mul":
            r = _add(_mul(d(a[0]), a[1]), _mul(a[0], d(a[1])))
        elif op == "div":
            da, db = d(a[0]), d(a[1])
            r = _add(None if da is None else _binary("div", da, a[1]),
                     None if db is None else _neg(_binary("div", _mul(e, db), a[1])))
        elif op == "exp":
            r = _mul(e, d(a[0]))
        elif op == "log":
            da = d(a[0])
            r = None if da is None else _binary("div", da, a[0])
        elif op == "tanh":
            r = _mul(_binary("sub", 1.0, _binary("mul", e, e)), d(a[0]))
        elif op == "abs":
            da = d(a[0])
            r = None if da is None else where(a[0] > 0, da, where(a[0] < 0, _unary("neg", da), 0.0))
        elif op in ("min", "max"):
            da, db = d(a[0]), d(a[1])
            if da is None and db is None:
                r = None
            else:
                first = (a[0] <= a[1]) if op == "min" else (a[0] >= a[1])
                r = where(first, _or_zero(da), _or_zero(db))
        elif op == "where":
            da, db = d(a[1]), d(a[2])
            r = None if da is None and db is None else where(a[0], _or_zero(da), _or_zero(db))
        else:   # pragma: no cover - every float-valued op is listed above
            raise AssertionError(op)
        memo[e.key] = r
        return r

    return _or_zero(d(expr))


def array_derivatives(traced: TracedMod) -> list:
    """The gradient terms of a score_mod's captured float arrays: ``[(read, d), ...]``, one per
    distinct float ``read`` node of the expression (canonical-text order), ``d`` the expression
    ``d score_mod / d read`` (:func:`derivative` with ``wrt``). The gradient of captured array
    ``N`` is, over every (b, h, q_idx, kv_idx) pair, ``sum dS * d`` scattered at the read's
    index, summed over the reads of array ``N`` (``dS`` the gradient of score_mod's result).
    Reads whose derivative is 0 everywhere are left out; a mask_mod has none (its result is a
    bool)."""
    if traced.role != "score_mod":
        return []
    out = []
    for r in traced.reads():
        if r.kind != "f":
            continue
        d = derivative(traced.expr, r)
        if not (d.op == "const" and d.value == 0.0):
            out.append((r, d))
    return out


def float_slots(traced: TracedMod) -> tuple:
    """The slots of a score_mod's captured float arrays (float32/float64): the arrays that get a
    gradient (``return_dscore_mod``); ``()`` for a mask_mod."""
    if traced is None or traced.role != "score_mod":
        return ()
    return tuple(i for i, dt in enumerate(traced.array_dtypes) if ARRAY_KINDS[dt] == "f")


# ------------------------------------------------------------------------------------------
# index ranges of captured-array reads


def index_bounds(e: Expr, ranges: dict) -> tuple:
    """``(lo, hi)`` bounds of the integer expression ``e`` (``+-inf`` where unknown), by interval
    arithmetic from ``ranges`` (``{"b": (0, B - 1), ...}``)."""
    inf = math.inf
    op, a = e.op, e.args
    if op in ranges:
        return ranges[op]
    if op == "const":
        return (e.value, e.value)
    if op == "read":
        return (-inf, inf)
    if op == "where":
        (l1, h1), (l2, h2) = index_bounds(a[1], ranges), index_bounds(a[2], ranges)
        return (min(l1, l2), max(h1, h2))
    if op == "neg":
        lo, hi = index_bounds(a[0], ranges)
        return (-hi, -lo)
    if op == "abs":
        lo, hi = index_bounds(a[0], ranges)
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in ("add", "sub", "mul", "min", "max", "floordiv", "mod"):
        (l1, h1), (l2, h2) = index_bounds(a[0], ranges), index_bounds(a[1], ranges)
        if op == "add":
            return (l1 + l2, h1 + h2)
        if op == "sub":
            return (l1 - h2, h1 - l2)
        if op == "min":
            return (min(l1, l2), min(h1, h2))
        if op == "max":
            return (max(l1, l2), max(h1, h2))
        if op == "mul":
            if any(math.isinf(x) for x in (l1, h1, l2, h2)):
                return (-inf, inf)
            p = (l1 * l2, l1 * h2, h1 * l2, h1 * h2)
            return (min(p), max(p))
        if l2 == h2 and l2 > 0:   # // and % by a positive constant
            c = l2
            if op == "mod":
                return (0, c - 1) if math.isinf(l1) or math.isinf(h1) or h1 - l1 >= c or (l1 % c) > (h1 % c) \
                    else (l1 % c, h1 % c)
            return (-inf if math.isinf(l1) else l1 // c, inf if math.isinf(h1) else h1 // c)
        return (-inf, inf)
    return (-inf, inf)


def check_reads(traced: TracedMod, extents: dict, func: str) -> None:
    """Refuse a read that may fall outside its captured array, given the problem's sizes
    ``extents`` (``{"b": B, "h": Hq, "q_idx": Sq, "kv_idx": Sk}``; B the number of batch
    entries). Nothing is checked when a size is 0 (nothing is evaluated).

    Raises
    ------
    ValueError
        Naming the array, the axis, the index expression, its possible range and the axis's
        extent.
    """
    if any(n == 0 for n in extents.values()):
        return
    ranges = {k: (0, n - 1) for k, n in extents.items()}
    for r in traced.reads():
        arr = traced.arrays[r.value]
        name = traced.names[r.value]
        for axis, (i, n) in enumerate(zip(r.args, arr.shape)):
            lo, hi = index_bounds(i, ranges)
            if lo < 0 or hi > int(n) - 1:
                raise ValueError(
                    f"{func}: {traced.role} reads {name}[...] with index {i.key} on axis {axis}, which may take "
                    f"values in [{lo}, {hi}] for b < {extents['b']}, h < {extents['h']}, q_idx < "
                    f"{extents['q_idx']}, kv_idx < {extents['kv_idx']}, but {name}.shape[{axis}]={int(n)}; pass a "
                    f"larger array or clamp the index with cuflash.mods.clamp/minimum/maximum")


# ------------------------------------------------------------------------------------------
# CUDA C


#: the most captured arrays, and axes of one, that the kernels' parameter list carries
#: (kernels_cu/score_mods.cuh: UserArrays)
MAX_KERNEL_ARRAYS = 4
MAX_KERNEL_RANK = 3
_C_TYPES = {"float32": "float", "int32": "int", "bool": "unsigned char"}
_C_BINARY = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
             "ne": "!=", "and": "&&", "or": "||"}
_C_FLOAT_FUNCS = {"exp": "expf", "log": "logf", "tanh": "tanhf"}


def _c_float(v: float) -> str:
    if math.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(v):
        return "(-CUFLASH_NEG_INF)" if v > 0 else "CUFLASH_NEG_INF"
    return f"{v!r}f" if ("." in repr(v) or "e" in repr(v)) else f"{v!r}.0f"


def kernel_refusal(traced: TracedMod) -> str | None:
    """Why the kernels cannot take ``traced`` (more than :data:`MAX_KERNEL_ARRAYS` captured
    arrays, one of more than :data:`MAX_KERNEL_RANK` axes, or of a dtype the kernels do not
    read), or None."""
    if len(traced.arrays) > MAX_KERNEL_ARRAYS:
        return f"{traced.role} with {len(traced.arrays)} captured arrays (the kernels take {MAX_KERNEL_ARRAYS})"
    for name, a, dt in zip(traced.names, traced.arrays, traced.array_dtypes):
        if len(a.shape) > MAX_KERNEL_RANK:
            return f"{traced.role}'s captured array {name!r} has {len(a.shape)} axes (the kernels take {MAX_KERNEL_RANK})"
        if dt not in _C_TYPES:
            return f"{traced.role}'s captured array {name!r} is {dt} (the kernels read {', '.join(_C_TYPES)})"
    return None


def emit_c(traced: TracedMod, first_slot: int = 0) -> str:
    """One CUDA C expression computing ``traced`` (kernels_cu/score_mods.cuh: the body of the
    ``CUFLASH_SCORE_MOD(score, b, h, q_idx, kv_idx, A)`` / ``CUFLASH_MASK_MOD(b, h, q_idx, kv_idx,
    A)`` macros): float arithmetic in float32, integers in ``long long`` (NumPy's int64),
    ``//`` and ``%`` floored as in Python, ``minimum``/``maximum`` propagating NaN as NumPy's,
    captured array ``N`` read as ``A.p[first_slot + N]`` with element strides ``A.s[...]``.
    A score_mod's value is float, a mask_mod's bool."""

    text = _c_expr(traced, traced.expr, first_slot)
    return f"((float){text})" if traced.role == "score_mod" else f"((bool){text})"


def _c_expr(traced: TracedMod, expr: Expr, first_slot: int = 0) -> str:
    """The CUDA C of ``expr``, a tree over ``traced``'s arguments and arrays (:func:`emit_c`)."""

    def c(e: Expr) -> str:
        op, a = e.op, e.args
        if op == "score":
            return "(score)"
        if op in ("b", "h", "q_idx", "kv_idx"):
            return f"((long long)({op}))"
        if op == "const":
            if e.kind == "b":
                return "true" if e.value else "false"
            return f"{e.value}LL" if e.kind == "i" else _c_float(e.value)
        if op == "read":
            slot = first_slot + e.value
            dt = traced.array_dtypes[e.value]
            off = " + ".join(f"{c(i)} * A.s[{slot}][{axis}]" for axis, i in enumerate(a))
            val = f"static_cast<const {_C_TYPES[dt]}*>(A.p[{slot}])[{off}]"
            if dt == "bool":
                return f"({val} != 0)"
            return f"((long long){val})" if dt == "int32" else f"({val})"
        if op == "where":
            x, y = c(a[1]), c(a[2])
            if e.kind == "f":
                x, y = f"(float){x}", f"(float){y}"
            return f"({c(a[0])} ? {x} : {y})"
        if op == "neg":
            return f"(-{c(a[0])})"
        if op == "not":
            return f"(!{c(a[0])})"
        if op in _C_FLOAT_FUNCS:
            return f"{_C_FLOAT_FUNCS[op]}((float){c(a[0])})"
        if op == "abs":
            return f"fabsf({c(a[0])})" if e.kind == "f" else f"cuflash_abs_ll({c(a[0])})"
        if op == "div":
            return f"((float){c(a[0])} / (float){c(a[1])})"
        if op in ("floordiv", "mod"):
            return f"cuflash_{op}_ll({c(a[0])}, {c(a[1])})"
        if op in ("min", "max"):
            if e.kind == "f":
                return f"cuflash_{op}_f((float){c(a[0])}, (float){c(a[1])})"
            return f"cuflash_{op}_ll({c(a[0])}, {c(a[1])})"
        if e.kind == "f" and op in ("add", "sub", "mul"):
            x, y = c(a[0]), c(a[1])
            x = x if a[0].kind == "f" else f"(float){x}"
            y = y if a[1].kind == "f" else f"(float){y}"
            return f"({x} {_C_BINARY[op]} {y})"
        if op in ("lt", "le", "gt", "ge", "eq", "ne") and "f" in (a[0].kind, a[1].kind):
            return f"((float){c(a[0])} {_C_BINARY[op]} (float){c(a[1])})"
        return f"({c(a[0])} {_C_BINARY[op]} {c(a[1])})"

    return c(expr)


def kernel_texts(score: TracedMod | None, mask: TracedMod | None, grad: bool = False) -> tuple[str, str, str]:
    """``(score_c, mask_c, grad_c)``: the CUDA C of a traced score_mod, of a mask_mod (its arrays
    in the slots after the score_mod's) and, with ``grad``, of ``d score_mod / d score``
    (:func:`derivative`); ``""`` for each one absent (``grad_c`` also when the derivative is 1)."""
    n = 0 if score is None else len(score.arrays)
    score_c = "" if score is None else emit_c(score)
    mask_c = "" if mask is None else emit_c(mask, n)
    grad_c = ""
    if grad and score is not None:
        d = derivative(score.expr)
        if not (d.op == "const" and d.value == 1.0):
            grad_c = emit_c(dataclasses.replace(score, expr=d))
    return score_c, mask_c, grad_c


#: at most this many gradient terms whose index is the same for a whole thread block (a function of
#: ``b`` and ``h`` only) are summed in registers and across the warp before one atomic add
#: (kernels_cu/score_mods.cuh: ``CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP``); the others add per pair
MAX_UNIFORM_TERMS = 4


def _block_uniform(e: Expr) -> bool:
    """Whether the integer expression ``e`` depends on ``b``, ``h`` and constants only (the same
    value for every pair a thread block's tile iteration visits)."""
    return not _collect(e, lambda x: x.op in ("score", "q_idx", "kv_idx", "read"))


def array_grad_c(score: TracedMod | None) -> tuple[str, str]:
    """``(pair_c, warp_c)``: the CUDA C statements of the captured float arrays' gradients
    (kernels_cu/score_mods.cuh). ``pair_c`` is the body of ``CUFLASH_SCORE_MOD_ARRAY_GRAD(score,
    b, h, q_idx, kv_idx, A, G, ds, U)``, one pair's share: for each term of
    :func:`array_derivatives`, ``ds * d`` (``ds`` the gradient of score_mod's result for the
    pair, ``d`` evaluated at the pair's ``score``), added with ``atomicAdd`` into the float32
    workspace ``G.p[N]`` of array ``N`` at the read's index (element strides ``G.s[N][axis]``),
    or, for the first :data:`MAX_UNIFORM_TERMS` terms whose index depends on ``b`` and ``h``
    only (a per-head slope), summed into the register ``U[u]``. ``warp_c`` is the body of
    ``CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP(b, h, A, G, U)``: each ``U[u]`` summed across the warp
    and added once (``cuflash_warp_atomic_add``). ``""`` for a part without terms (and both
    without a score_mod)."""
    if score is None:
        return ("", "")
    pair, warp = [], []
    for read, d in array_derivatives(score):
        slot = read.value
        off = " + ".join(f"{_c_expr(score, i)} * G.s[{slot}][{axis}]" for axis, i in enumerate(read.args))
        term = f"(ds) * (float){_c_expr(score, d)}"
        if len(warp) < MAX_UNIFORM_TERMS and all(_block_uniform(i) for i in read.args):
            pair.append(f"U[{len(warp)}] += {term};")
            warp.append(f"cuflash_warp_atomic_add(G.p[{slot}] + ({off}), U[{len(warp)}]);")
        else:
            pair.append(f"atomicAdd(G.p[{slot}] + ({off}), {term});")
    return " ".join(pair), " ".join(warp)
