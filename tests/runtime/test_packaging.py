"""The kernel sources are found in a wheel, an editable install and a plain source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import cuflash
from cuflash.runtime import paths

REPO = Path(__file__).resolve().parents[2]
PROBE = "import cuflash, cuflash.runtime.paths as p; print(p.kernels_dir()); print(cuflash.__file__)"
KERNEL_FILES = sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))


def _run(args, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _pip(*args, cwd):
    # pip and the build backend may write caches and tool settings under $HOME (~/.cache/pip,
    # ~/.rustup from a probed toolchain shim): point HOME at the test's folder, no pip cache
    home = Path(cwd) / "home"
    home.mkdir(exist_ok=True)
    return _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], cwd=cwd,
                env_extra={"HOME": str(home), "PIP_NO_CACHE_DIR": "1"})


@pytest.fixture
def repo_copy(tmp_path):
    """The project's sources copied into a temporary folder: builds write their ``build/`` and
    ``*.egg-info`` there, never into the checkout, and nothing stale from an earlier build can be
    packaged."""
    dst = tmp_path / "repo"
    dst.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for name in ("cuflash", "kernels_cu"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _installed_cuflash() -> list[str]:
    """What the running environment's site-packages holds of cuflash (its dist-info and, for an
    editable install, the finder), by file name."""
    return sorted(p.name for p in Path(sysconfig.get_path("purelib")).glob("*cuflash*"))


def test_kernel_sources_exist():
    assert "common.cuh" in KERNEL_FILES
    assert paths.kernel_source("common.cuh").startswith("// cuflash")
    with pytest.raises(FileNotFoundError, match="kernel source 'nope.cu' not found"):
        paths.kernel_source("nope.cu")


def test_source_tree_with_pythonpath(tmp_path):
    kernels, module = _run([sys.executable, "-c", PROBE], cwd=tmp_path, env_extra={"PYTHONPATH": str(REPO)}).split()
    assert Path(kernels) == REPO / "kernels_cu"
    assert Path(module).parent == REPO / "cuflash"


def test_wheel_ships_kernels_as_package_data(tmp_path, repo_copy):
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(repo_copy), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("cuflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in KERNEL_FILES:
        assert f"cuflash/kernels_cu/{name}" in names
    # every module, subpackage and data file of the source tree is in the wheel (setup.cfg lists
    # the subpackages and their package data by hand)
    tree = {str(f.relative_to(repo_copy)) for f in (repo_copy / "cuflash").rglob("*")
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"}
    assert tree - names == set(), f"missing from the wheel: {sorted(tree - names)}"
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), str(wheel), cwd=tmp_path)
    kernels, module = _run([sys.executable, "-c", PROBE], cwd=tmp_path, env_extra={"PYTHONPATH": str(site)}).split()
    assert Path(kernels) == site / "cuflash" / "kernels_cu"
    assert Path(module).parent == site / "cuflash"
    assert sorted(p.name for p in Path(kernels).iterdir()) == KERNEL_FILES


def test_editable_install(tmp_path, repo_copy):
    # an editable install of a copy of the sources into a throwaway prefix; --ignore-installed
    # keeps pip from uninstalling the cuflash of the environment running these tests
    before = _installed_cuflash()
    prefix = tmp_path / "prefix"
    _pip("install", "--no-deps", "--no-build-isolation", "--ignore-installed", "--prefix", str(prefix),
         "-e", str(repo_copy), cwd=tmp_path)
    purelib = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    # -S, then the throwaway prefix before the running environment's site-packages (numpy, and
    # possibly an installed cuflash, whose editable finder must not win)
    probe = (f"import site; site.addsitedir({purelib!r}); site.addsitedir({sysconfig.get_path('purelib')!r}); "
             + PROBE)
    kernels, module = _run([sys.executable, "-S", "-c", probe], cwd=tmp_path).split()
    assert Path(kernels) == repo_copy / "kernels_cu"
    assert Path(module).parent == repo_copy / "cuflash"
    assert _installed_cuflash() == before, "the install changed the environment running the tests"


def test_import_without_cupy(tmp_path):
    # `import cuflash` and the CPU path work where CuPy is absent: block its import.
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import numpy as np, cuflash\n"
        "x = np.ones((1, 2, 3, 4), np.float32)\n"
        "print(cuflash.attention(x, x, x).shape)\n"
    )
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env_extra={"PYTHONPATH": str(REPO)})
    assert out.strip() == "(1, 2, 3, 4)"
    assert cuflash.__version__
