"""Source lowering for the simulator: ``__shared__`` declarations become per-block arena slots.

On a GPU a ``__shared__`` variable exists once per thread block. C++ has no storage class with that
lifetime, so before g++ sees the kernel text each declaration inside a function is rewritten (on
one line, so line numbers stay) into a reference into the running block's arena (cusim.h):

``__shared__ __align__(16) float tile[64][65];`` becomes ::

    using __cusim_sh_t3 = float[64][65]; static char __cusim_sh_k3;
    __cusim_sh_t3& tile = *static_cast<__cusim_sh_t3*>(::cusim::shared_static(&__cusim_sh_k3,
        sizeof(__cusim_sh_t3), 16 > alignof(__cusim_sh_t3) ? 16 : alignof(__cusim_sh_t3),
        ::cusim::site_info<__cusim_sh_t3>("tile")));

The ``static char`` is a key unique to the declaration site (and to each template
instantiation); the arena gives every (block, site) one slot. The variable's name and layout
(``site_info``) let checked mode (:mod:`cuflash.sim`) name the variable and element in reports.
``extern __shared__ T name[];`` becomes a pointer to the block's dynamic shared memory. The kernel's text in ``kernels_cu/`` is
untouched; only the simulator's copy is lowered. Unsupported forms (several declarators, an
initializer, file scope, inside a macro) raise ``ValueError`` naming the line.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\b__shared__\b")
_ALIGN = re.compile(r"__align__\s*\(\s*([^()]*)\s*\)")
_DECL = re.compile(r"^(?P<type>.*?[\w>*&)\s])\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\]]*\]\s*)*)$", re.S)
_MASK = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _masked(text: str) -> str:
    """``text`` with comments and literals blanked (same length, newlines kept)."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return _MASK.sub(blank, text)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _is_directive_line(masked: str, pos: int) -> bool:
    start = masked.rfind("\n", 0, pos) + 1
    # continuation lines of a multi-line macro
    while start > 1 and masked[start - 2] == "\\":
        start = masked.rfind("\n", 0, start - 1) + 1
    return masked[start:pos].lstrip().startswith("#")


def lower_shared(text: str, origin: str = "kernel") -> str:
    """Return ``text`` with every ``__shared__`` declaration lowered for the simulator.

    Raises
    ------
    ValueError
        For a declaration form the simulator does not support.
    """
    masked = _masked(text)
    out: list[str] = []
    pos = 0
    depth_pos, depth = 0, 0
    for n, m in enumerate(_TOKEN.finditer(masked)):
        start = m.start()
        line = _line_of(text, start)
        where = f"{origin}:{line}"
        if _is_directive_line(masked, start):
            raise ValueError(f"{where}: __shared__ inside a preprocessor directive is not supported by the simulator")
        # brace depth at the declaration (file scope = 0)
        depth += masked.count("{", depth_pos, start) - masked.count("}", depth_pos, start)
        depth_pos = start
        if depth <= 0:
            raise ValueError(f"{where}: file-scope __shared__ variables are not supported by the simulator; "
                             "declare them inside the kernel")
        # `extern` right before the token?
        before = masked[:start].rstrip()
        is_extern = before.endswith("extern") and not re.search(r"\w", before[-7:-6] or " ")
        decl_start = len(before) - len("extern") if is_extern else start
        end = masked.find(";", m.end())
        if end < 0:
            raise ValueError(f"{where}: __shared__ declaration without ';'")
        decl = masked[m.end() : end]
        aligns = [a.strip() for a in _ALIGN.findall(decl)]
        decl = _ALIGN.sub(" ", decl).strip()
        if re.search(r"[,={]", re.sub(r"\[[^\]]*\]", "", decl)):
            raise ValueError(f"{where}: only one __shared__ variable per declaration, without initializer, is supported")
        dm = _DECL.match(decl)
        if not dm:
            raise ValueError(f"{where}: cannot parse the __shared__ declaration {decl!r}")
        typ, name, dims = dm.group("type").strip(), dm.group("name"), re.sub(r"\s+", "", dm.group("dims"))
        t, k = f"__cusim_sh_t{n}", f"__cusim_sh_k{n}"
        if is_extern:
            if not dims.startswith("[]"):
                raise ValueError(f"{where}: extern __shared__ must be an array of unknown size, got {decl!r}")
            repl = (f"using {t} = {typ}{dims[2:]}; "
                    f"{t}* const {name} = static_cast<{t}*>(::cusim::shared_dynamic(::cusim::site_info<{t}[]>(\"{name}\")));")
        else:
            if "[]" in dims:
                raise ValueError(f"{where}: __shared__ array {name} needs a size (or extern for dynamic memory)")
            align = f"alignof({t})"
            for a in aligns:
                align = f"(({a}) > {align} ? ({a}) : {align})"
            repl = (f"using {t} = {typ}{dims}; static char {k}; "
                    f"{t}& {name} = *static_cast<{t}*>(::cusim::shared_static(&{k}, sizeof({t}), {align}, "
                    f"::cusim::site_info<{t}>(\"{name}\")));")
        newlines = text.count("\n", decl_start, end + 1)
        out.append(text[pos:decl_start])
        out.append(repl + "\n" * newlines)
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


_ENTRY = re.compile(r'extern\s+(?:"C"|\s{3})\s+__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:void\s+)?([A-Za-z_]\w*)\s*\(')


def find_entries(text: str) -> list[str]:
    """Names of the ``extern "C" __global__`` kernels written literally in ``text``."""
    return _ENTRY.findall(_masked(text))


def _balanced(text: str, open_pos: int) -> int:
    """Index of the ``)`` closing the ``(`` at ``open_pos``."""
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses")


def lower_launch_bounds(text: str) -> str:
    """``__launch_bounds__(N[, ...])`` of each kernel moved into its body as a run-time check,
    ``::cusim::check_launch_bounds(N)`` (so the compiler evaluates N in the branch of the text
    that is compiled, macros and all). Line numbers are kept."""
    masked = _masked(text)
    out, pos = [], 0
    for m in re.finditer(r"\b__launch_bounds__\s*\(", masked):
        if _is_directive_line(masked, m.start()):
            continue  # the macro's own definition, or a directive naming it
        open_pos = m.end() - 1
        close = _balanced(masked, open_pos)
        bound = text[open_pos + 1 : close].split(",", 1)[0].strip()
        params_open = masked.index("(", close + 1)
        body = masked.index("{", _balanced(masked, params_open) + 1)
        blank = re.sub(r"[^\n]", " ", text[m.start() : close + 1])
        out += [text[pos : m.start()], blank, text[close + 1 : body + 1],
                f" ::cusim::check_launch_bounds(unsigned({bound}), {bound!r:s});".replace("'", '"')]
        pos = body + 1
    out.append(text[pos:])
    return "".join(out)


def entry_restrict(text: str) -> dict[str, tuple[bool, ...]]:
    """For each ``extern "C" __global__`` kernel written in ``text`` (by its name as written, which
    may be a macro such as ``CUFLASH_ENTRY``), whether each parameter is a ``__restrict__``
    pointer; a name declared twice (``#if`` branches) with different flags is left out."""
    masked = _masked(text)
    found: dict = {}
    conflicting = set()
    for m in re.finditer(r'extern\s+(?:"C"|\s{3})\s+__global__\s+', masked):  # "C" is blanked in `masked`
        pos = m.end()
        head = re.match(r"(?:void\s+)?__launch_bounds__\s*\(", masked[pos:])
        if head:
            pos = _balanced(masked, pos + head.end() - 1) + 1
        name = re.match(r"\s*(?:void\s+)?([A-Za-z_]\w*)\s*\(", masked[pos:])
        if not name:
            continue
        open_pos = pos + name.end() - 1
        params = text[open_pos + 1 : _balanced(masked, open_pos)]
        flags = tuple("__restrict__" in p for p in params.split(",")) if params.strip() else ()
        if found.get(name.group(1), flags) != flags:
            conflicting.add(name.group(1))
        found[name.group(1)] = flags
    return {k: v for k, v in found.items() if k not in conflicting}
