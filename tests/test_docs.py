"""The user documentation (README.md and docs/*.md) says only what is true, and keeps saying it.

* Every fenced ``python`` block runs, as written, in a fresh namespace inside a temporary
  directory; a ``text`` block right after it is its output, compared with what it prints.
  Signatures are fenced as ``text`` and not run. A block that imports CuPy runs with NumPy in its
  place and ``CUFLASH_BACKEND=sim`` (the CUDA kernels on the simulator); a block that starts a
  ``torch.distributed`` group runs as a world of one on gloo. ``<!-- doc-test: slow -->`` before a
  block puts it under the ``slow`` marker (the transformers example: loading SmolLM2 takes tens
  of seconds; tests/adapters/test_transformers.py runs that block in the default run).
* The README is at most 300 lines; no page carries the project's history; every relative link
  points at a file (and heading) that exists; the pages and sections the package's docstrings
  cite exist; the environment-variable table of docs/gpu.md names every variable the package
  reads.
* Every roofline figure quoted is recomputed from the model (:mod:`cuflash.analysis.roofline`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}


@dataclass
class Block:
    path: Path
    line: int                      # 1-based line of the opening fence
    lang: str
    code: str
    markers: list = field(default_factory=list)   # the HTML comments right above the fence
    output: str | None = None      # the text block right after a python block
    end: int = 0                   # the line after the closing fence

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: the fence opened here is never closed")
        markers, k = [], start - 1
        while k >= 0 and lines[k].startswith("<!--"):
            markers.insert(0, lines[k])
            k -= 1
        block = Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n", markers, end=j + 1)
        if lang == "text" and blocks and blocks[-1].lang == "python" and blocks[-1].output is None \
                and all(not x.strip() for x in lines[blocks[-1].end:start]):
            blocks[-1].output = block.code
        blocks.append(block)
        i = j + 1
    return blocks


ALL_BLOCKS = [b for p in PAGES for b in parse_blocks(p)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _param(block: Block):
    marks = [pytest.mark.slow] if any("doc-test: slow" in m for m in block.markers) else []
    return pytest.param(block, id=block.name, marks=marks)


def test_pages_exist_and_blocks_are_fenced_with_a_known_language():
    assert [p.name for p in PAGES[1:]] == sorted(
        ["api.md", "benchmarks.md", "conventions.md", "gpu.md", "kernels.md", "layout.md", "roofline.md",
         "simulator.md", "testing.md"])
    odd = [f"{b.name} ({b.lang or 'no language'})" for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not odd, f"fence every block as one of {sorted(LANGUAGES)} (signatures as text): {odd}"


@pytest.mark.parametrize("block", [_param(b) for b in PYTHON_BLOCKS])
def test_python_block_runs_and_prints_what_is_shown(block, tmp_path, monkeypatch):
    code = block.code
    if "import cupy" in code:   # a GPU example: NumPy arrays, the CUDA kernels on the simulator
        assert "import cupy as cp" in code, f"{block.name}: import CuPy as 'import cupy as cp'"
        code = code.replace("import cupy as cp", "import numpy as cp")
        monkeypatch.setenv("CUFLASH_BACKEND", "sim")
    distributed = "init_process_group" in code
    if distributed:   # a world of one on gloo, in this process
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                            ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, block.name, "exec"), {"__name__": "__main__"})   # noqa: S102 - the page's example
    finally:
        if distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    if block.output is not None:
        got = [x.rstrip() for x in printed.getvalue().strip().splitlines()]
        want = [x.rstrip() for x in block.output.strip().splitlines()]
        assert got == want, f"{block.name} prints {got}, the page shows {want}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300 (the rest goes to docs/)"
    text = "\n".join(lines)
    for marker in ("<!-- demo-command -->\n```bash\n", "<!-- test-command -->\n```bash\n"):
        assert marker in text, f"README.md lost {marker.splitlines()[0]} (.ci/run reads the command after it)"


#: the project's history: its seed write-up, issue and round numbers, dates (an option named
#: ``seed``, ``seed=3`` in code or `seed` in inline code, is the simulator's and not history)
HISTORY = [r"\bseeds?\b(?!\s*=)", r"\bissues? \d+", r"\bround \d", r"\bbefore issue", r"\b20\d\d-\d\d(-\d\d)?\b"]


def test_no_project_history_in_the_pages():
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            prose = re.sub(r"`[^`]*`", "", line)
            found += [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for pat in HISTORY
                      if re.search(pat, prose, re.I)]
    assert not found, "the pages describe the product, not its history:\n" + "\n".join(found)


#: history in the text ``help()`` shows (docstrings); narrower than HISTORY, since a dropout seed
#: is the product's own word there
DOCSTRING_HISTORY = [r"\bseed write-?up", r"\b(a|this|the next|an earlier) session\b", r"\bissues? #?\d+",
                     r"\bround \d", r"\bstop \d+", r"\bwritten on\b"]


def test_no_project_history_in_the_docstrings():
    found = []
    for path in sorted((ROOT / "cuflash").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node) or ""
                found += [f"{path.relative_to(ROOT)}: {getattr(node, 'name', '<module>')}: {m.group(0)!r}"
                          for pat in DOCSTRING_HISTORY for m in re.finditer(pat, text, re.I)]
    assert not found, "help() describes the product, not its history:\n" + "\n".join(found)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    return re.sub(r"[^\w\s-]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    out = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_pages_and_sections_the_package_cites_exist():
    cited = set()
    for folder in ("cuflash", "kernels_cu"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".cu", ".cuh", ".h"}:
                text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
                for page, section in re.findall(r'docs/(\w+\.md)(?:, "([^"]+)")?', text):
                    cited.add((page, section))
    assert cited, "the package cites no docs/ page: has the citation style changed?"
    missing = []
    for page, section in sorted(cited):
        path = ROOT / "docs" / page
        if not path.exists():
            missing.append(page)
        elif section and _anchor(section) not in _anchors(path):
            missing.append(f'{page}, "{section}"')
    assert not missing, f"the package's docstrings cite pages or sections that do not exist: {missing}"


def _variables_the_package_reads() -> set:
    """The ``CUFLASH_*``/``CUPY_*`` names the package reads from ``os.environ`` (``get``, ``[...]``,
    ``getenv``), directly or through a module-level constant, plus the simulator's option table."""
    from cuflash.sim import config

    names = set(config._ENV.values())
    for path in (ROOT / "cuflash").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "environ" not in text and "getenv" not in text:
            continue
        tree = ast.parse(text)
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            arg = None
            if isinstance(node, ast.Call) and node.args:
                f = node.func
                if isinstance(f, ast.Attribute) and (f.attr == "getenv" or (
                        f.attr in {"get", "pop"} and "environ" in ast.unparse(f.value))):
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
                arg = node.slice
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in constants:
                names.add(constants[arg.id])
    return {n for n in names if re.fullmatch(r"(CUFLASH|CUPY)_[A-Z0-9_]+", n)}


def test_environment_table_names_every_variable_the_package_reads():
    read = _variables_the_package_reads()
    assert {"CUFLASH_BACKEND", "CUFLASH_SIM_CXX", "CUFLASH_NVRTC", "CUFLASH_SIM_CHECKED", "CUPY_CACHE_DIR"} <= read
    table = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8").split("## Environment variables", 1)[1]
    documented = set(re.findall(r"^\| `((?:CUFLASH|CUPY)_[A-Z0-9_]+)`", table, re.M))
    documented |= set(re.findall(r"^\| `[A-Z_]+`, `((?:CUFLASH|CUPY)_[A-Z0-9_]+)`", table, re.M))
    assert not read - documented, f"docs/gpu.md's table lacks {sorted(read - documented)}"


def _documented_commands():
    """``(block name, argv)`` of every ``python -m cuflash ...`` command in the pages' bash blocks
    (after ``&&``, and after ``VAR=value`` prefixes)."""
    for block in ALL_BLOCKS:
        if block.lang != "bash":
            continue
        for line in block.code.splitlines():
            tokens = shlex.split(line, comments=True)
            segment: list = []
            for token in tokens + ["&&"]:
                if token != "&&":
                    segment.append(token)
                    continue
                while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", segment[0]):
                    segment.pop(0)
                if len(segment) >= 3 and segment[0].endswith("python") and segment[1:3] == ["-m", "cuflash"]:
                    yield block.name, segment[3:]
                segment = []


class _Parsed(Exception):
    """Raised instead of running a command once its arguments parsed."""


def test_documented_commands_parse(monkeypatch):
    """Each command the pages show is accepted by that command's parser (nothing is run)."""
    import argparse

    from cuflash import __main__ as cli

    commands = list(_documented_commands())
    assert len(commands) >= 10 and any(argv[:1] == ["roofline"] for _, argv in commands)
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    refused = []
    for name, argv in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                status = cli.main(argv)
        except _Parsed:
            continue
        except SystemExit as e:
            status = e.code
        if status != 0:
            refused.append(f"{name}: python -m cuflash {shlex.join(argv)}: {err.getvalue().strip()[-300:]}")
    assert not refused, "commands the pages show that their parsers refuse:\n" + "\n".join(refused)


# --------------------------------------------------------------------------------------------
# roofline figures
# --------------------------------------------------------------------------------------------

def _ceiling(direction: str, head_dim: int, *, tier: str = "dispatch", nvrtc: str | None = None):
    """The model's record for the bf16 variant at ``head_dim`` on the H200: the one the dispatcher
    picks (``tier="dispatch"``) or the tensor-core tier's (``tier="mma"``)."""
    from cuflash.analysis import roofline

    backward = direction == "backward"
    if tier == "dispatch":
        variant = roofline.variants(90, backward=backward, dtype="bf16", head_dim=head_dim)[0]
    else:
        variant = next(v for v in roofline.variants(90, backward=backward, dtype="bf16")
                       if f"_{tier}_" in v.entry and v.head_dim_max == head_dim and "_mods" not in v.entry)
    with pytest.MonkeyPatch.context() as mp:
        if nvrtc:
            mp.setenv("CUFLASH_NVRTC", nvrtc)
        roofline.compile_sass.cache_clear()
        try:
            return roofline.analyze(variant, "h200")
        finally:
            roofline.compile_sass.cache_clear()


def _call_mix_row(*flags) -> str:
    """docs/roofline.md's --call-mix row of our bf16 d128 forward at S = 8192 (one compile)."""
    from cuflash.analysis import roofline

    args = roofline._parser().parse_args(["--call-mix", "--head-dim", "128", "--seqlen", "8192", *flags])
    mix = roofline.call_mix(args, roofline.RATES["h200"])
    t, n = mix.walk.tiles, mix.per_warp
    masked = [p for p in ("right", "left", "both") if t[p]]
    cell = ", ".join(f"{t[p]} x {n[p].instructions} (`{p}`)" for p in masked) or f"0 ({n['right'].instructions})"
    return f"{t['steady']} x {n['steady'].instructions} | {cell} | {mix.total(first=False):,} | {mix.total():,}"


#: every figure the pages quote, as (page, the sentence with {} for the number, how to recompute it)
QUOTED = [
    ("README.md", "{} TFLOP/s for the Hopper-tier forward at head dim 128 on an H200 (bf16)",
     lambda: round(_ceiling("forward", 128).ceiling_tflops)),
    # the datasheet rates of the T4 and V100 presets, as the model holds them
    ("docs/roofline.md", "NVIDIA T4 datasheet: {} TFLOP/s fp16 tensor", lambda: _rate("T4", "fp16_tensor_tflops")),
    ("docs/roofline.md", "fp16 tensor, {} TFLOP/s fp32, 320 GB/s, 40 SMs", lambda: _rate("T4", "fp32_tflops")),
    ("docs/roofline.md", "SXM2: {} TFLOP/s fp16 tensor", lambda: _rate("V100", "fp16_tensor_tflops")),
    ("docs/roofline.md", "fp16 tensor, {} TFLOP/s fp32, 900 GB/s, 80 SMs", lambda: _rate("V100", "fp32_tflops")),
    # the datasheet rates of the --what-if forms, as the presets and the forms hold them
    ("docs/roofline.md", "| A100 SXM 80GB | {} (`tf32`) |", lambda: _form_rate_row("A100", "a100", "tf32")),
    ("docs/roofline.md", "| H100 SXM, H200 SXM | {} (`tf32`) |", lambda: _form_rate_row("H100", "h200", "tf32")),
    ("docs/roofline.md", "| V100 SXM2 | {} (`m8n8k4`", lambda: _form_rate_row("V100", "v100", "m8n8k4")),
]
#: the figures of docs/roofline.md, recomputed under ``slow`` (one NVRTC compile each)
QUOTED_SLOW = [
    ("docs/roofline.md", "| forward | Hopper (`wgmma`) | 128 x 128 | tensor | {} |",
     lambda: round(_ceiling("forward", 128).ceiling_tflops)),
    ("docs/roofline.md", "| forward | tensor cores (`mma.sync`) | 128 x 64 | tensor | {} |",
     lambda: round(_ceiling("forward", 128, tier="mma").ceiling_tflops)),
    ("docs/roofline.md", "| backward | tensor cores (`mma.sync`) | 64 x 128 | smem | {} |",
     lambda: round(_ceiling("backward", 128).ceiling_tflops)),
    ("docs/roofline.md", "spills {} bytes under NVRTC 13.5",
     lambda: _ceiling("backward", 128, nvrtc="13").spills),
    ("docs/roofline.md", "| cuflash sm90, causal | {} |", lambda: _call_mix_row("--causal")),
    ("docs/roofline.md", "| cuflash sm90, no mask | {} |", lambda: _call_mix_row()),
    ("docs/roofline.md", "| TF32, A100 | 64 | {} |", lambda: _what_if_row("tf32", "a100", 64)),
    ("docs/roofline.md", "| TF32, A100 | 128 | {} |", lambda: _what_if_row("tf32", "a100", 128)),
    ("docs/roofline.md", "| TF32, A100 | 256 | {} |", lambda: _what_if_row("tf32", "a100", 256)),
    ("docs/roofline.md", "| TF32, H200 | 64 | {} |", lambda: _what_if_row("tf32", "h200", 64)),
    ("docs/roofline.md", "| TF32, H200 | 128 | {} |", lambda: _what_if_row("tf32", "h200", 128)),
    ("docs/roofline.md", "| TF32, H200 | 256 | {} |", lambda: _what_if_row("tf32", "h200", 256)),
    ("docs/roofline.md", "| m8n8k4, V100 | 64 | {} |", lambda: _what_if_row("m8n8k4", "v100", 64)),
    ("docs/roofline.md", "| m8n8k4, V100 | 128 | {} |", lambda: _what_if_row("m8n8k4", "v100", 128)),
    ("docs/roofline.md", "| m8n8k4, V100 | 256 | {} |", lambda: _what_if_row("m8n8k4", "v100", 256)),
]


def _form_rate_row(device: str, preset: str, form: str) -> str:
    """A row of docs/roofline.md's --what-if rate table: the preset's dense FP16 tensor, TF32
    tensor and FP32 peaks, and the form's MACs per cycle per SM (the H100 row's wgmma figure)."""
    from cuflash.analysis import intensity, roofline

    dev, rates = getattr(intensity, device), roofline.RATES[preset]
    macs = roofline.WHAT_IF_FORMS[form].macs_per_cycle(rates)
    if rates.wgmma_macs:
        macs = macs * rates.wgmma_macs / rates.mma_sync_macs
    tf32 = f"{dev.tf32_tensor_tflops:g}" if dev.tf32_tensor_tflops else "none"
    cells = [f"{dev.fp16_tensor_tflops:g}", tf32, f"{dev.fp32_tflops:g}", f"{macs:.0f}"]
    if rates.wgmma_macs:
        cells[-1] += (f" for `wgmma`; `mma.sync` at the same {rates.mma_sync_macs / rates.wgmma_macs:.0%} of it as in "
                      f"the 16-bit form: {roofline.WHAT_IF_FORMS[form].macs_per_cycle(rates):.0f}")
    return " | ".join(cells)


def _what_if_row(form: str, device: str, head_dim: int) -> str:
    """A row of docs/roofline.md's --what-if table, from the model (two NVRTC compiles)."""
    from cuflash.analysis import roofline

    w = roofline.what_if(form, device, head_dim)
    m = w.model
    return (f"{m.block_m} x {m.block_n} ({w.stages}) | {m.bound} | {m.ceiling_tflops:.0f} | {w.today.bound}, "
            f"{w.today.ceiling_tflops:.0f} | {w.gain:.1f}")


def _rate(device: str, field: str) -> str:
    """A device preset's rate as the pages print it (65.0 -> '65')."""
    from cuflash.analysis import intensity

    return f"{getattr(getattr(intensity, device), field):g}"


def _check_quoted(quoted):
    for page, sentence, recompute in quoted:
        text = re.sub(r"\s+", " ", (ROOT / page).read_text(encoding="utf-8"))
        want = sentence.format(recompute())
        assert want in text, f"{page} must quote the model's figure: {want!r}"


def test_every_tflops_figure_is_one_the_model_recomputes():
    """Each 'N TFLOP/s' in the pages is one of the quoted figures below (so a new figure needs its
    recomputation here), and the README's figure is the model's."""
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for m in re.finditer(r"(\d[\d,.]*) ?TFLOP/s", text):
            context = text[max(0, m.start() - 200):m.end() + 200]
            ok = any(p == str(page.relative_to(ROOT)) and re.search(
                re.escape(s).replace(r"\{\}", re.escape(m.group(1))), context) for p, s, _ in QUOTED + QUOTED_SLOW)
            assert ok, f"{page.name}: '{m.group(0)}' is not a figure tests/test_docs.py recomputes ({context!r})"
    _check_quoted(QUOTED)


@pytest.mark.slow
def test_roofline_page_figures_are_the_models():
    _check_quoted(QUOTED_SLOW)
