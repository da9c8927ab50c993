"""The pieces every ``python -m cuflash <command>`` shares, so the commands agree with each other.

* one dtype vocabulary (:data:`DTYPE_ALIASES`, :func:`canonical_dtype`, :func:`dtype_arg`):
  ``float16`` (``fp16``, ``half``, ``f16``, ``f2``), ``bfloat16`` (``bf16``), ``float32``
  (``fp32``, ``f32``, ``float``, ``single``, ``f4``) and ``float64`` (``fp64``, ``f64``,
  ``double``), case-insensitive (``f8`` is refused: NumPy reads it as float64, a reader may mean fp8);
* range-checked numbers for argparse (:func:`int_at_least`, :func:`float_above`), so
  ``--iters 0`` or ``--seqlen -5`` is an argparse error, never a traceback;
* one default device preset (:data:`DEFAULT_DEVICE`, the H200);
* one error form, argparse's own: ``python -m cuflash <command>: error: <message>`` on stderr
  (:func:`error`), and :func:`command`, which prints a cuflash ``TypeError``, ``ValueError`` or
  ``NotImplementedError`` raised inside a command in that form with exit status 2 (any other
  exception, or one whose message does not begin with ``cuflash``, is a bug and keeps its
  traceback);
* one progress display on stderr (:func:`progress`): tqdm when it is installed, else a counter
  line; nothing when stderr is not a terminal.

Imports: nothing of cuflash (the commands in :mod:`cuflash.analysis` and :mod:`cuflash.tools`
import it).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from typing import Callable, Iterable

__all__ = ["DEFAULT_DEVICE", "DTYPE_ALIASES", "DTYPES", "canonical_dtype", "command", "dtype_arg",
           "dtype_help", "error", "float_above", "int_at_least", "is_library_error", "progress"]

#: the device preset every command defaults to (``--device``)
DEFAULT_DEVICE = "h200"

#: canonical dtype names, in the order the commands list them
DTYPES = ("float16", "bfloat16", "float32", "float64")

#: the other spellings of each canonical name
DTYPE_ALIASES = {
    "float16": ("fp16", "half", "f16", "f2"),
    "bfloat16": ("bf16",),
    "float32": ("fp32", "f32", "float", "single", "f4"),
    "float64": ("fp64", "f64", "double"),
}

_CANONICAL = {alias: name for name, aliases in DTYPE_ALIASES.items() for alias in (name, *aliases)}


def canonical_dtype(name: str) -> str | None:
    """The canonical name (``"bfloat16"``) of a dtype spelling (``"BF16"``); None if unknown."""
    return _CANONICAL.get(str(name).strip().lower())


def dtype_help(supported=DTYPES) -> str:
    """``"float16 (fp16, half, f16, f2), bfloat16 (bf16), ..."`` for the names in ``supported``."""
    return ", ".join(f"{n} ({', '.join(DTYPE_ALIASES[n])})" for n in supported)


def dtype_arg(supported=DTYPES) -> Callable[[str], str]:
    """An argparse ``type=``: a dtype spelling in, its canonical name out; an argparse error for
    an unknown name or one outside ``supported``."""
    supported = tuple(supported)

    def parse(text: str) -> str:
        name = canonical_dtype(text)
        if name is None or name not in supported:
            what = "is not a dtype" if name is None else "is not supported here"
            raise argparse.ArgumentTypeError(f"{text!r} {what}; expected one of {dtype_help(supported)}")
        return name

    parse.__name__ = "dtype"
    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer ``>= minimum``."""
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_above(minimum: float, *, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number ``>= minimum`` (``> minimum`` with
    ``inclusive=False``)."""
    what = f"a number {'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def error(prog: str, message: str) -> int:
    """Print ``<prog>: error: <message>`` to stderr (argparse's form) and return 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def is_library_error(exc: BaseException) -> bool:
    """Whether ``exc`` is cuflash refusing its input (a ``TypeError``, ``ValueError`` or
    ``NotImplementedError`` whose message begins with ``cuflash``), not a bug."""
    return isinstance(exc, (TypeError, ValueError, NotImplementedError)) and str(exc).startswith("cuflash")


def _own_prefix(prog: str) -> re.Pattern:
    """The prefixes a command's own messages may carry: ``cuflash.<cmd>: ``, ``cuflash <cmd>: ``,
    ``cuflash <cmd> --flag: ``."""
    cmd = prog.rsplit(" ", 1)[-1]
    return re.compile(rf"^cuflash[ .]{re.escape(cmd)}(?: --[\w-]+)?: ")


def command(prog: str, rewrite: Callable[[str], str] | None = None):
    """Decorate a command's ``main(argv) -> int``: a cuflash ``TypeError``, ``ValueError`` or
    ``NotImplementedError`` raised inside it is printed as ``<prog>: error: <message>`` (the
    command's own name dropped from the message's start, then ``rewrite`` applied) and the
    command returns 2. argparse's own errors (``SystemExit(2)``) and every other exception pass
    through."""
    own = _own_prefix(prog)

    def decorate(main):
        @functools.wraps(main)
        def wrapper(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except (TypeError, ValueError, NotImplementedError) as exc:
                if not is_library_error(exc):
                    raise
                message = own.sub("", str(exc), count=1)
                return error(prog, rewrite(message) if rewrite else message)

        return wrapper

    return decorate


def progress(items: Iterable, desc: str, *, enabled: bool = True, total: int | None = None,
             label: Callable[[object], str] | None = None):
    """Iterate ``items`` showing progress on stderr when it is a terminal: a tqdm bar when tqdm
    is installed, else a ``desc: i/n label`` line rewritten in place. ``label(item)`` names the
    item being worked on. Nothing is shown when ``enabled`` is false or stderr is not a terminal."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    total = len(items) if total is None else total
    stream = sys.stderr
    if not enabled or not getattr(stream, "isatty", lambda: False)():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(items, desc=desc, total=total, file=stream, leave=False)
        for item in bar:
            if label:
                bar.set_postfix_str(label(item), refresh=False)
            yield item
        bar.close()
        return
    width = 0
    for i, item in enumerate(items):
        line = f"{desc}: {i + 1}/{total}" + (f" {label(item)}" if label else "")
        stream.write("\r" + line.ljust(width))
        stream.flush()
        width = len(line)
        yield item
    stream.write("\r" + " " * width + "\r")
    stream.flush()
