"""Building the exact source text of one kernel variant.

The text handed to a compiler (NVRTC for the GPU, g++ for the simulator) is: the variant's
``#define`` prelude, then its ``kernels_cu/`` file with every ``#include "..."`` of our own
headers replaced by the header's text (once per header, as ``#pragma once`` would; the
generated ``ptx_wgmma.gen.cuh`` from :mod:`cuflash.runtime.ptx_gen`), with
``#line`` markers so diagnostics name the original files. Includes in angle brackets (the CUDA
toolkit's ``<cuda_fp16.h>``/``<cuda_bf16.h>``) stay: NVRTC finds them through ``-I``, the
simulator through its stand-ins. Because everything of ours is in the text, a cache keyed on the
text (CuPy's, the simulator's) can never serve a stale kernel.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from cuflash.runtime import paths, ptx_gen

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*$", re.MULTILINE)


def _expand(text: str, origin: str, dirs: tuple[Path, ...], seen: set[str]) -> str:
    out: list[str] = []
    pos = 0
    for m in _INCLUDE.finditer(text):
        out.append(text[pos : m.start()])
        name = m.group(1)
        line_after = text.count("\n", 0, m.end()) + 2
        if name in ptx_gen.GENERATED:  # generated text (the wgmma wrappers), pasted once
            if name not in seen:
                seen.add(name)
                out.append(f'#line 1 "{name}"\n' + ptx_gen.GENERATED[name]() + f'\n#line {line_after} "{origin}"')
            pos = m.end()
            continue
        path = next((d / name for d in dirs if (d / name).is_file()), None)
        if path is None:
            raise FileNotFoundError(
                f'cuflash: #include "{name}" in {origin} not found in ' + ", ".join(map(str, dirs))
            )
        key = str(path.resolve())
        if key not in seen:
            seen.add(key)
            body = _PRAGMA_ONCE.sub("", path.read_text(encoding="utf-8"))
            out.append(f'#line 1 "{name}"\n')
            out.append(_expand(body, name, (path.parent,) + dirs, seen))
            out.append(f'\n#line {line_after} "{origin}"')
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def prelude(defines: Iterable[tuple[str, str]]) -> str:
    """Return ``#define`` lines for ``(macro, value)`` pairs."""
    return "".join(f"#define {k} {v}\n" for k, v in defines)


def build_text(
    text: str,
    *,
    origin: str = "kernel.cu",
    defines: Iterable[tuple[str, str]] = (),
    search_dirs: Iterable[Path | str] = (),
) -> str:
    """Return the full source text for ``text``: prelude plus ``text`` with our headers pasted.

    Parameters
    ----------
    text : str
        CUDA C source.
    origin : str
        The file name used in ``#line`` markers and error messages.
    defines : iterable of (str, str)
        The ``#define`` prelude.
    search_dirs : iterable of path
        Folders searched for ``#include "..."`` before ``kernels_cu/``.

    Raises
    ------
    FileNotFoundError
        If an included header is in none of the folders.
    """
    dirs = tuple(Path(d) for d in search_dirs) + (paths.kernels_dir(),)
    body = _expand(text, origin, dirs, set())
    return f"// cuflash generated source: {origin}\n" + prelude(defines) + f'#line 1 "{origin}"\n' + body


def build_source(variant) -> str:
    """Return the exact source text of one :class:`cuflash.runtime.variants.Variant`."""
    return build_text(
        paths.kernel_source(variant.source), origin=variant.source, defines=variant.defines()
    )
