"""The package's layers (DESIGN.md §2) and the one direction of imports between them.

Every module of ``cuflash/`` gets a layer from where it lives; every import it makes (at module
level, inside functions, and module names handed to ``importlib`` as strings) must go to its own
layer or one below it:

    tools -> adapters -> api -> kernels -> sim, reference -> runtime

``sim`` and ``reference`` are side by side: neither imports the other. The import graph also has
no circle. The checker is tested on a copy of the tree with planted faults, so it cannot pass
vacuously.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

import cuflash

PACKAGE_DIR = Path(cuflash.__file__).resolve().parent

#: layer -> the layers it may import (itself included)
ALLOWED = {
    "runtime": {"runtime"},
    "reference": {"reference", "runtime"},
    "sim": {"sim", "runtime"},
    "kernels": {"kernels", "sim", "reference", "runtime"},
    "api": {"api", "kernels", "sim", "reference", "runtime"},
    "adapters": {"adapters", "api", "kernels", "sim", "reference", "runtime"},
    "tools": {"tools", "adapters", "api", "kernels", "sim", "reference", "runtime"},
}
#: the layers' folders and the layer of everything in them (analysis sits beside the public
#: functions: both stand on the kernels)
SUBPACKAGE_LAYERS = {"runtime": "runtime", "reference": "reference", "sim": "sim", "kernels": "kernels",
                     "api": "api", "analysis": "api", "tools": "tools"}
#: the package's surface: every module (or package) at the top that is not a layer's folder is a
#: face or an adapter, at most this many of them (the package face, thin faces of documented
#: import paths, the framework adapters)
MAX_TOP_LEVEL = 10
#: importlib entry points whose first argument is a module name
IMPORT_CALLS = {"import_module", "__import__", "find_spec"}


def module_name(root: Path, path: Path) -> str:
    """``cuflash.kernels.dispatch`` for ``<root>/kernels/dispatch.py`` (``<root>`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["cuflash", *parts])


def layer_of(root: Path, path: Path) -> str | None:
    """The layer of the module at ``path``, from where it lives: a layer's folder gives its layer;
    every other module at the top (and every package there that is not a layer's folder) is the
    package's surface, the adapters' layer, except ``__main__``, the command line, which is the
    tools' layer. None for a module in a folder below the top that is no layer's."""
    rel = path.relative_to(root).parts
    if len(rel) == 1:
        return "tools" if Path(rel[0]).stem == "__main__" else "adapters"
    if rel[0] in SUBPACKAGE_LAYERS:
        return SUBPACKAGE_LAYERS[rel[0]]
    return "adapters" if (root / rel[0] / "__init__.py").is_file() and len(rel) >= 2 else None


def scan(root: Path):
    """``(modules, imports)``: module name -> (path, layer); and a list of
    ``(importer, imported module, line, how)`` for every import of a cuflash module."""
    modules = {module_name(root, p): (p, layer_of(root, p)) for p in sorted(root.rglob("*.py"))}
    is_package = {m: p.name == "__init__.py" for m, (p, _) in modules.items()}

    def resolve(name: str) -> str | None:
        """The module an absolute dotted name imports (its longest existing prefix)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in modules:
                return cand
        return None

    imports, seen = [], set()
    for mod, (path, _) in modules.items():
        package = mod if is_package[mod] else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        in_tables = {id(e) for n in ast.walk(tree) if isinstance(n, (ast.Tuple, ast.List, ast.Set))
                     for e in n.elts} | {id(e) for n in ast.walk(tree) if isinstance(n, ast.Dict) for e in n.values}
        for node in ast.walk(tree):
            targets: list[tuple[str, str]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, "import") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for a in node.names:
                    sub = f"{origin}.{a.name}"
                    targets.append((sub if sub in modules else origin, "from-import"))
            elif isinstance(node, ast.Call):
                fn = node.func
                fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if fname in IMPORT_CALLS and node.args and isinstance(node.args[0], ast.Constant) \
                        and isinstance(node.args[0].value, str):
                    targets = [(node.args[0].value, f"{fname}() string")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules \
                    and node.value != "cuflash" and id(node) in in_tables:
                targets = [(node.value, "module-name string")]  # a command table for importlib
            for name, how in targets:
                if name == "cuflash" or name.startswith("cuflash."):
                    target = resolve(name)
                    line = getattr(node, "lineno", 0)
                    if target is not None and target != mod and (mod, target, line) not in seen:
                        seen.add((mod, target, line))
                        imports.append((mod, target, line, how))
    return modules, imports


def violations(root: Path) -> list[str]:
    """Modules without a layer, and imports that go up a layer, as ``file:line: ...`` lines."""
    modules, imports = scan(root)
    out = [f"{p.relative_to(root.parent)}: module {m} has no layer (place it in a layer's folder)"
           for m, (p, layer) in modules.items() if layer is None]
    for src, dst, line, how in imports:
        (path, s_layer), (_, d_layer) = modules[src], modules[dst]
        if s_layer and d_layer and d_layer not in ALLOWED[s_layer]:
            out.append(f"{path.relative_to(root.parent)}:{line}: {src} ({s_layer}) imports {dst} ({d_layer}) "
                       f"by {how}; {s_layer} may import only {sorted(ALLOWED[s_layer])}")
    return out


def cycles(root: Path) -> list[list[str]]:
    """Import circles among the modules (every import counted, lazy ones too)."""
    modules, imports = scan(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _, _ in imports:
        graph[src].add(dst)
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_every_module_has_a_layer_and_imports_only_downwards():
    bad = violations(PACKAGE_DIR)
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    found = cycles(PACKAGE_DIR)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_the_scan_sees_the_package():
    modules, imports = scan(PACKAGE_DIR)
    assert {"cuflash.runtime.plan", "cuflash.kernels.dispatch", "cuflash.sim.launcher",
            "cuflash.reference.forward", "cuflash.tools.check", "cuflash.api.pipeline"} <= set(modules)
    edges = {(s, d) for s, d, _, _ in imports}
    assert ("cuflash.api.pipeline", "cuflash.sim.device") in edges  # a function-level import
    assert ("cuflash.__main__", "cuflash.tools.check") in edges  # a module-name string for importlib


def top_level(root: Path) -> list[str]:
    """The package's surface: modules at the top and packages that are no layer's folder."""
    return sorted([p.name for p in root.glob("*.py")] + [p.name for p in root.iterdir() if p.is_dir()
                                                           and (p / "__init__.py").is_file()
                                                           and p.name not in SUBPACKAGE_LAYERS])


def test_top_level_is_the_package_surface():
    top = top_level(PACKAGE_DIR)
    assert len(top) <= MAX_TOP_LEVEL, top
    assert set(top) >= {"__init__.py", "__main__.py", "torch", "jax.py", "transformers.py", "intensity.py",
                        "torch_sdpa.py"}


def test_documented_import_paths_keep_working():
    import cuflash.intensity
    import cuflash.torch_sdpa
    from cuflash.analysis import intensity
    from cuflash.torch import sdpa

    assert cuflash.intensity is intensity and cuflash.torch_sdpa is sdpa
    assert callable(cuflash.torch_sdpa.top_left_causal) and callable(cuflash.intensity.fused_attention_cost)


def test_every_kernel_source_has_a_host_module():
    kernels_cu = cuflash.runtime.paths.kernels_dir()
    hosts = {p.stem for p in (PACKAGE_DIR / "kernels").glob("*.py")}
    for cu in sorted(kernels_cu.glob("*.cu")):
        assert cu.stem in hosts, f"kernels_cu/{cu.name} has no host module cuflash/kernels/{cu.stem}.py"


def test_every_subpackage_says_what_it_may_import():
    for sub in SUBPACKAGE_LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / sub / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, f"cuflash/{sub}/__init__.py: its docstring must say what it may import"


@pytest.fixture
def tree_copy(tmp_path):
    dst = tmp_path / "cuflash"
    shutil.copytree(PACKAGE_DIR, dst, ignore=shutil.ignore_patterns("__pycache__", "*.npz", "*.h", "*.S"))
    assert not violations(dst) and not cycles(dst)
    return dst


def _plant(path: Path, text: str) -> None:
    path.write_text(path.read_text() + "\n\n" + text)


def test_a_planted_upward_import_inside_a_function_fails(tree_copy):
    _plant(tree_copy / "runtime" / "dtypes.py", "def _lazy():\n    from cuflash.tools import check\n    return check\n")
    bad = violations(tree_copy)
    assert len(bad) == 1 and "cuflash/runtime/dtypes.py:" in bad[0] and "imports cuflash.tools.check (tools)" in bad[0], bad


def test_a_planted_importlib_string_fails(tree_copy):
    _plant(tree_copy / "sim" / "lower.py",
           "def _lazy():\n    import importlib\n    return importlib.import_module('cuflash.kernels.dispatch')\n")
    bad = violations(tree_copy)
    assert len(bad) == 1 and "cuflash/sim/lower.py:" in bad[0] and "cuflash.kernels.dispatch (kernels)" in bad[0], bad


def test_a_planted_sideways_import_between_sim_and_reference_fails(tree_copy):
    _plant(tree_copy / "reference" / "masks.py", "from cuflash.sim import launcher  # noqa: E402\n")
    bad = violations(tree_copy)
    assert len(bad) == 1 and "cuflash.reference.masks (reference) imports cuflash.sim.launcher (sim)" in bad[0], bad


def test_a_planted_circle_fails(tree_copy):
    # source.py imports paths.py; paths.py importing source.py closes a circle inside one layer
    _plant(tree_copy / "runtime" / "paths.py", "def _lazy():\n    from cuflash.runtime import source\n    return source\n")
    assert not violations(tree_copy)
    found = cycles(tree_copy)
    assert found and any({"cuflash.runtime.paths", "cuflash.runtime.source"} <= set(c) for c in found), found


def test_a_module_outside_every_layer_fails(tree_copy):
    (tree_copy / "helpers").mkdir()
    (tree_copy / "helpers" / "x.py").write_text("X = 1\n")   # a folder that is no package and no layer
    bad = violations(tree_copy)
    assert len(bad) == 1 and "cuflash.helpers.x has no layer" in bad[0], bad


def test_a_planted_upward_import_from_an_adapter_fails(tree_copy):
    _plant(tree_copy / "jax.py", "def _lazy():\n    from cuflash.tools import check\n    return check\n")
    bad = violations(tree_copy)
    assert len(bad) == 1 and "cuflash.jax (adapters) imports cuflash.tools.check (tools)" in bad[0], bad


# --------------------------------------------------------------------------------------------
# functions: parameters and options

#: a function of the package takes at most this many parameters, public signatures aside
MAX_PARAMS = 12
#: the modules whose ``__all__`` is public API (their flat, flash-attn-style signatures may be long)
PUBLIC_MODULES = ("cuflash", "cuflash.api.", "cuflash.reference.", "cuflash.analysis.intensity", "cuflash.torch.",
                  "cuflash.jax", "cuflash.transformers")


def _public_names(tree) -> set:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def _is_op_or_fake(fn) -> bool:
    """A ``torch.library.custom_op`` (a public operator schema) or its ``register_fake``, which
    must take the operator's parameters."""
    for d in fn.decorator_list:
        text = ast.unparse(d)
        if "custom_op" in text or text.endswith(".register_fake"):
            return True
    return False


def _params(fn) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    n = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
    return n + (a.vararg is not None) + (a.kwarg is not None)


def long_signatures(root: Path) -> list[str]:
    """Functions with more than :data:`MAX_PARAMS` parameters that are not public API."""
    out = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        public = _public_names(tree) if mod == "cuflash" or mod.startswith(PUBLIC_MODULES) else set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _params(fn) > MAX_PARAMS:
                if fn.name not in public and not _is_op_or_fake(fn):
                    out.append(f"{path.relative_to(root.parent)}:{fn.lineno}: {fn.name} takes {_params(fn)} parameters")
    return out


def options_in_kwargs(root: Path) -> list[str]:
    """Functions taking ``**kwargs`` that do more than pass them on: options travel in the options
    object, so a ``**name`` may only be forwarded whole to one call (a wrapper), be the ``kwargs``
    of a protocol method NumPy calls (``__array_ufunc__``), or be a framework's calling convention
    in a public function (transformers hands its attention functions keyword arguments). A router
    (``cuflash.autodiff``) also shows them to :func:`cuflash.autodiff.framework_needed`, which looks
    at the arrays' kinds only, before it forwards them whole."""
    out = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        public = _public_names(tree) if mod == "cuflash" or mod.startswith(PUBLIC_MODULES) else set()
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.args.kwarg is None:
                continue
            name = fn.args.kwarg.arg
            uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name]
            forwarded = [k.value for c in ast.walk(fn) if isinstance(c, ast.Call) for k in c.keywords
                         if k.arg is None and isinstance(k.value, ast.Name) and k.value.id == name]
            shown = [a for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                     and c.func.id == "framework_needed" for a in c.args if isinstance(a, ast.Name) and a.id == name]
            uses = [u for u in uses if all(u is not s for s in shown)]
            protocol = (fn.name.startswith("__") and fn.name.endswith("__")) or fn.name in public
            if not protocol and (len(forwarded) != 1 or len(uses) != 1):
                out.append(f"{path.relative_to(root.parent)}:{fn.lineno}: {fn.name} reads **{name}")
    return out


def test_no_function_takes_more_than_twelve_parameters_public_signatures_aside():
    bad = long_signatures(PACKAGE_DIR)
    assert not bad, "\n".join(bad)


def test_options_do_not_travel_in_kwargs():
    bad = options_in_kwargs(PACKAGE_DIR)
    assert not bad, "\n".join(bad)


def test_the_signature_rules_can_fail(tree_copy):
    _plant(tree_copy / "kernels" / "dispatch.py", "def _wide(a, b, c, d, e, f, g, h, i, j, k, l, m):\n    return a\n")
    _plant(tree_copy / "runtime" / "dtypes.py", "def _bag(x, **options):\n    return options.get('causal', x)\n")
    assert [b.split(": ")[-1] for b in long_signatures(tree_copy)] == ["_wide takes 13 parameters"]
    assert [b.split(": ")[-1] for b in options_in_kwargs(tree_copy)] == ["_bag reads **options"]


_EXCLUSIONS = r"""
import json, sys
from pathlib import Path
import coverage
config, root = sys.argv[1], Path(sys.argv[2])
cov = coverage.Coverage(config_file=config, data_file=None)
bare = coverage.Coverage(config_file=False, data_file=None)   # no exclusions: every statement
bare.config.exclude_list = []
include = cov.config.report_include
files = sorted({p for pattern in include for p in root.glob(pattern.replace("*/cuflash/", "cuflash/"))})
print(json.dumps({str(p): sorted(set(bare.analysis2(str(p))[1]) - set(cov.analysis2(str(p))[1])) for p in files}))
"""


def _coverage_exclusions(config: Path) -> dict:
    """``{file: excluded statements}`` of the CUDA host path coverage.py reports on, with the
    exclusions of ``config``: coverage.py's own analysis, in a fresh interpreter (a second
    Coverage object inside a measured process would discard that process's data)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE")}
    done = subprocess.run([sys.executable, "-c", _EXCLUSIONS, str(config), str(PACKAGE_DIR.parent)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    found = {Path(p): lines for p, lines in json.loads(done.stdout).items()}
    assert found, "the report's include patterns match no file"
    return found


def test_what_only_a_gpu_runs_is_excluded_by_name_at_most_40_statements_each_with_its_reason():
    config = PACKAGE_DIR.parent / "setup.cfg"
    excluded = _coverage_exclusions(config)
    total = sum(len(lines) for lines in excluded.values())
    assert 0 < total <= 40, {str(p.name): len(x) for p, x in excluded.items() if x}
    text = config.read_text(encoding="utf-8")
    block = text[text.index("[coverage:report]"):]
    patterns = [ln.strip() for ln in block.split("exclude_also =", 1)[1].splitlines()[1:] if ln.startswith("    ")]
    reasons = block.split("exclude_also =", 1)[0]
    for pattern in patterns:
        name = pattern.split()[-1]
        assert re.search(rf"#\s.*\b{re.escape(name)}\b.*:", reasons), f"no reason given for excluding {name}"


def test_collection_runs_without_torch(tmp_path):
    """Without torch every test module still collects (the torch tests then report as skipped):
    a fresh pytest, with ``import torch`` made to fail, collects the whole suite without error."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None   # import torch fails\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUFLASH_SKIP_REPORT", "COVERAGE"))}
    env["PYTHONPATH"] = str(tmp_path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    root = PACKAGE_DIR.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "", str(root / "tests")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.splitlines()[-1].lower(), done.stdout[-3000:]
