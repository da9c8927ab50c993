"""Locating the CUDA C sources (``kernels_cu/``) in every way cuflash can be run.

* wheel / regular install: ``setup.cfg`` maps ``kernels_cu/`` to the package ``cuflash.kernels_cu``,
  so the files sit in ``<site-packages>/cuflash/kernels_cu/``;
* editable install and a plain source tree run with ``PYTHONPATH=.``: ``cuflash/`` is the source
  folder and the sources are its sibling ``kernels_cu/``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

#: the ``cuflash`` package folder (this file is ``cuflash/runtime/paths.py``)
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def _candidates() -> list[Path]:
    return [
        _PACKAGE_DIR / "kernels_cu",  # wheel or regular install
        _PACKAGE_DIR.parent / "kernels_cu",  # source tree or editable install
    ]


@functools.lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """Return the folder that holds cuflash's ``.cu``/``.cuh`` sources.

    Raises
    ------
    FileNotFoundError
        If none of the known locations holds the sources (a broken install).
    """
    for path in _candidates():
        if path.is_dir() and any(path.glob("*.cuh")):
            return path
    tried = ", ".join(os.fspath(p) for p in _candidates())
    raise FileNotFoundError(f"cuflash: kernel sources not found; looked in {tried}")


def kernel_source(name: str) -> str:
    """Return the text of one file of ``kernels_cu/`` (e.g. ``"common.cuh"``)."""
    path = kernels_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"cuflash: kernel source {name!r} not found in {kernels_dir()}")
    return path.read_text(encoding="utf-8")
