"""The commands of ``python -m cuflash`` agree with each other: one spelling per flag, one dtype
vocabulary, one default device, range-checked numbers, one error form, ``--version``, a quiet
closed pipe; and what each command does with its flags (``bench --cpu``'s, ``roofline``'s
progress, width and combinations, ``demo --generate`` on a one-token text). Everything runs
in-process on tiny sizes, except one subprocess for the closed pipe."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash import __main__ as dispatch
from cuflash.analysis import intensity, roofline
from cuflash.tools import bench, check, cpu_bench, demo, smollm2

REPO_ROOT = Path(__file__).resolve().parents[2]

PARSERS = {"bench": bench._parser, "intensity": intensity._parser, "roofline": roofline._parser,
           "demo": demo.build_parser, "check": check.build_parser}
MAINS = {"bench": bench.main, "intensity": intensity.main, "roofline": roofline.main, "demo": demo.main,
         "check": check.main}


def _options(name: str) -> set[str]:
    return {o for a in PARSERS[name]()._actions for o in a.option_strings}


def _refused(capsys, command: str, argv: list[str]) -> str:
    """The argparse-style error of ``command argv`` (exit status 2), without the usage lines."""
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command](argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"python -m cuflash {command}: error: "), err
    return line.removeprefix(f"python -m cuflash {command}: error: ")


# --------------------------------------------------------------------------------------------
# one spelling per flag, one vocabulary, one default


def test_shared_flags_have_one_spelling():
    for name in PARSERS:
        opts = _options(name)
        assert not opts & {"--hdim", "--headdim", "--headdim-v", "--head_dim"}, name
        assert PARSERS[name]().allow_abbrev is False, name   # no prefix spellings either
    for name in ("bench", "intensity", "roofline"):
        assert "--head-dim" in _options(name) and "--seqlen" in _options(name) and "--dtype" in _options(name)
    for name in ("bench", "intensity"):
        assert {"--causal", "--no-causal"} <= _options(name)
    for name in ("bench", "roofline"):
        assert {"--json", "--no-progress"} <= _options(name)
    assert "--json" in _options("intensity")
    for name in ("intensity", "roofline"):
        assert "--device" in _options(name)
    assert bench._parser().parse_args(["--head-dim", "64", "--head-dim", "128"]).head_dim == [64, 128]
    assert intensity._parser().parse_args(["--head-dim", "96", "--head-dim-v", "32"]).head_dim_v == 32


def test_abbreviations_are_refused(capsys):
    assert "unrecognized arguments: --no-base" in _refused(capsys, "bench", ["--cpu", "--no-base"])
    assert "unrecognized arguments: --back" in _refused(capsys, "intensity", ["--back"])


@pytest.mark.parametrize("spelling, name", [
    ("float16", "float16"), ("fp16", "float16"), ("half", "float16"), ("F16", "float16"),
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"),
    ("float32", "float32"), ("fp32", "float32"), ("f32", "float32"),
])
def test_every_command_reads_the_same_dtype_names(spelling, name):
    assert bench._parser().parse_args(["--dtype", spelling]).dtype == [name]
    assert intensity._parser().parse_args(["--dtype", spelling]).dtype == name
    assert roofline._parser().parse_args(["--dtype", spelling]).dtype == name
    assert intensity.element_bytes(spelling) == {"float16": 2, "bfloat16": 2, "float32": 4}[name]


def test_bench_takes_bf16_and_says_which_dtypes_it_times(capsys, monkeypatch):
    monkeypatch.setattr(bench, "gpu_available", lambda: (False, "no GPU here"))
    assert bench.main(["--dtype", "bf16", "--head-dim", "64", "--seqlen", "512"]) == 2   # accepted: fails on the GPU
    assert capsys.readouterr().err.startswith("python -m cuflash bench: error: no GPU here.")
    assert "the GPU benchmark times bfloat16 and float16" in _refused(capsys, "bench", ["--dtype", "fp32"])
    assert "'int7' is not a dtype" in _refused(capsys, "bench", ["--dtype", "int7"])
    # NumPy's "f8" is float64, but a reader of an fp8 library may mean float8: neither is guessed
    assert "'f8' is not a dtype" in _refused(capsys, "intensity", ["--dtype", "f8"])


def test_the_default_device_is_the_h200(capsys):
    assert intensity._parser().parse_args([]).device == "h200"
    assert roofline._parser().parse_args([]).device == "h200"
    assert intensity.main(["--seqlen", "256", "--head-dim", "32"]) == 0
    assert "device H200 SXM: " in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# the dispatcher: --version, errors, a closed pipe


def test_version(capsys):
    assert dispatch.main(["--version"]) == 0
    assert capsys.readouterr().out == f"cuflash {cuflash.__version__}\n" == "cuflash 0.1.0\n"


def test_dispatcher_errors_have_the_argparse_form(capsys):
    assert dispatch.main(["benchmark"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("python -m cuflash: error: unknown command 'benchmark' (choose from demo, "
                                    "bench, intensity, roofline, check)")
    assert dispatch.main([]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "python -m cuflash: error: a command is required"


def test_a_closed_pipe_ends_quietly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "cuflash", "intensity"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # the reader is gone before the command writes (as `| head -3` after 3 lines)
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=60)
    assert err == ""   # no BrokenPipeError traceback
    assert status == 141   # 128 + SIGPIPE, what a shell reports for a closed pipe


# --------------------------------------------------------------------------------------------
# range checks and combinations that mean nothing


@pytest.mark.parametrize("command, argv, message", [
    ("bench", ["--cpu", "--iters", "0"], "argument --iters: expected a positive integer, got 0"),
    ("bench", ["--cpu", "--warmup", "-1"], "argument --warmup: expected a non-negative integer, got -1"),
    ("bench", ["--cpu", "--seqlen", "0"], "argument --seqlen: expected a positive integer, got 0"),
    ("bench", ["--cpu", "--seqlen", "-5"], "argument --seqlen: expected a positive integer, got -5"),
    ("bench", ["--head-dim", "0"], "argument --head-dim: expected a positive integer, got 0"),
    ("bench", ["--compare", "a", "b", "--tolerance", "-1"], "argument --tolerance: expected a number >= 0, got -1"),
    ("intensity", ["--seqlen", "0"], "argument --seqlen: expected a positive integer, got 0"),
    ("intensity", ["--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    ("intensity", ["--no-l2", "--block-m", "0"], "argument --block-m: expected a positive integer, got 0"),
    ("roofline", ["--seqlen", "0"], "argument --seqlen: expected a positive integer, got 0"),
    ("roofline", ["--decode", "--rows", "0"], "argument --rows: expected a positive integer, got 0"),
    ("roofline", ["--head-dim", "-64"], "argument --head-dim: expected a positive integer, got -64"),
    ("check", ["--budget", "0"], "argument --budget: expected a number > 0, got 0"),
    ("demo", ["--generate", "-1"], "argument --generate: expected a non-negative integer, got -1"),
])
def test_numbers_are_range_checked(capsys, command, argv, message):
    assert _refused(capsys, command, argv) == message


@pytest.mark.parametrize("command, argv, flags", [
    ("roofline", ["--decode", "--backward"], ("--backward", "--decode")),
    ("roofline", ["--decode", "--forward-and-backward"], ("--forward-and-backward", "--decode")),
    ("roofline", ["--decode", "--seqlen", "4096"], ("--seqlen", "--decode")),
    ("roofline", ["--backward", "--forward-and-backward"], ("--backward", "--forward-and-backward")),
    ("roofline", ["--rows", "8"], ("--rows", "--decode")),
    ("roofline", ["--head-dim-v", "64"], ("--head-dim-v", "--head-dim")),
    ("intensity", ["--tf32", "--dtype", "float16"], ("--tf32", "--dtype float16")),
    ("intensity", ["--tf32", "--dtype", "bf16"], ("--tf32", "--dtype bfloat16")),
    ("intensity", ["--block-m", "64"], ("--block-m", "--no-l2")),
    ("intensity", ["--no-l2", "--block-n", "64"], ("--block-n", "--backward")),
    ("intensity", ["--causal", "--window", "4", "8"], ("--window", "--causal")),
    ("bench", ["--tolerance", "0.5"], ("--tolerance", "--compare")),
    ("bench", ["--compare", "a.json", "b.json", "--cpu"], ("--cpu", "--compare")),
    ("bench", ["--cpu", "--quick"], ("--quick", "--cpu")),
    ("bench", ["--cpu", "--backward"], ("--backward", "--cpu")),
    ("bench", ["--cpu", "--decode"], ("--decode", "--cpu")),
    ("bench", ["--cpu", "--dtype", "fp16"], ("--dtype float16", "--cpu")),
    ("bench", ["--cpu", "--head-dim", "128"], ("--head-dim 128", "--cpu")),
])
def test_combinations_that_mean_nothing_are_refused(capsys, command, argv, flags):
    message = _refused(capsys, command, argv)
    assert all(flag in message for flag in flags), message


# --------------------------------------------------------------------------------------------
# one error form, library errors included; bugs keep their traceback


def test_library_errors_print_in_the_argparse_form_with_status_2(capsys, monkeypatch):
    assert roofline.main(["--head-dim", "1000"]) == 2      # cuflash.attention's validation, reworded
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash roofline: error: head_dim=1000, head_dim_v=1000: ") and "\n" == err[-1]
    assert roofline.main(["--decode", "--dtype", "float32", "--head-dim", "64"]) == 2   # NotImplementedError
    assert capsys.readouterr().err.startswith("python -m cuflash roofline: error: cuflash: the tensor-core kernel")
    monkeypatch.setattr(demo, "gpu_available", lambda: False)
    assert demo.main(["--embedded", "--backend", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("python -m cuflash demo: error: --backend cuda needs CuPy")
    monkeypatch.setattr(check, "gpu_status", lambda: (False, "no GPU here"))
    assert check.main(["--sections", "device"]) == 2
    assert capsys.readouterr().err.startswith("python -m cuflash check: error: nothing was checked: no GPU here.")
    assert check.main(["--sections", "grid,gird"]) == 2
    assert capsys.readouterr().err.startswith("python -m cuflash check: error: --sections: unknown section(s) gird;")
    assert bench.main(["--compare", "/nonexistent/a.json", "/nonexistent/b.json"]) == 2
    assert capsys.readouterr().err.startswith("python -m cuflash bench: error: --compare: cannot read")


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(*args, **kwargs):
        return None + 1

    monkeypatch.setattr(intensity, "naive_attention_cost", broken)
    with pytest.raises(TypeError, match="unsupported operand"):
        intensity.main([])


# --------------------------------------------------------------------------------------------
# bench --cpu honours its flags


def test_bench_cpu_writes_json_and_honours_warmup_iters_causal(tmp_path, capsys, monkeypatch):
    calls = []
    real_runner = cpu_bench.runner

    def counting(impl, q, k, v, causal):
        fn = real_runner(impl, q, k, v, causal)
        return lambda: calls.append((impl, causal, q.shape[-2])) or fn()

    monkeypatch.setattr(cpu_bench, "runner", counting)
    path = tmp_path / "cpu.json"
    argv = ["--cpu", "--seqlen", "24", "--no-causal", "--no-baselines", "--warmup", "3", "--iters", "2",
            "--json", str(path), "--no-progress"]
    assert bench.main(argv) == 0
    assert calls == [("cuflash", False, 24)] * (3 + 2)           # 3 warm-up calls, 2 timed
    out, err = capsys.readouterr()
    assert "S=24 full" in out and "S=24 causal" not in out and f"records written to {path}" in out and err == ""
    doc = json.loads(path.read_text())
    assert (doc["mode"], doc["batch"], doc["heads"], doc["head_dim"], doc["dtype"]) == ("cpu", 1, 8, 64, "float32")
    [rec] = doc["records"]
    assert (rec["impl"], rec["seqlen"], rec["causal"]) == ("cuflash", 24, False)
    assert rec["gflops"] == pytest.approx(4 * 1 * 8 * 24**2 * 64 / rec["seconds"] / 1e9)


def test_bench_cpu_json_dash_is_json_on_stdout_and_the_table_on_stderr(capsys):
    assert bench.main(["--cpu", "--seqlen", "16", "--causal", "--no-baselines", "--iters", "1", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [(r["impl"], r["seqlen"], r["causal"]) for r in doc["records"]] == [("cuflash", 16, True)]
    assert "cuflash bench --cpu: B=1 H=8 D=64 float32" in err and "S=16 causal" in err


def test_bench_plot_without_matplotlib_names_the_extra_before_measuring(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if it were not installed
    monkeypatch.setattr(cpu_bench, "measure", lambda *a, **k: pytest.fail("measured before refusing --plot"))
    assert bench.main(["--cpu", "--seqlen", "16", "--plot", "out.png"]) == 2
    assert capsys.readouterr().err == ("python -m cuflash bench: error: --plot needs matplotlib, which is not "
                                       "installed: pip install 'cuflash[bench]' (from a source checkout: "
                                       "pip install '.[bench]')\n")
    assert not Path("out.png").exists()


def test_bench_cpu_writes_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "cpu.png"
    assert bench.main(["--cpu", "--seqlen", "16", "--seqlen", "32", "--no-baselines", "--iters", "1",
                       "--plot", str(path), "--no-progress"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# intensity --json


def test_intensity_json_holds_the_counts(tmp_path, capsys):
    n, d = 256, 32
    path = tmp_path / "i.json"
    assert intensity.main(["--seqlen", str(n), "--head-dim", str(d), "--backward", "--json", str(path)]) == 0
    assert "fused fwd" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert [(r["algorithm"], r["pass"]) for r in doc["records"]] == [
        ("naive", "forward"), ("fused", "forward"), ("naive", "backward"), ("fused", "backward")]
    fused = doc["records"][1]
    # fp32, B = H = 1, Sq = Sk = N: Q, K, V read and O written once (4*N*d bytes each), LSE 4*N bytes
    assert fused["bytes"] == 4 * (4 * n * d) + 4 * n and fused["flops"] == 4 * n * n * d
    assert fused["bytes"] == sum(b for _, b in fused["traffic"])
    assert fused["intensity"] == pytest.approx(n * d / (4 * d + 1))
    assert doc["device"]["preset"] == "h200" and doc["problem"]["head_dim"] == d
    assert intensity.main(["--seqlen", str(n), "--head-dim", str(d), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["records"][1]["bytes"] == fused["bytes"] and "fused fwd" in err


# --------------------------------------------------------------------------------------------
# roofline: progress, 100 columns, --json -


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _record(entry: str, *, inner: bool = False, occupancy: bool = False) -> roofline.Roofline:
    """A model record of a made-up loop (no compile): large counts, so the numbers are wide."""
    c = roofline.Counts(instructions=99999, tensor=640, macs=640 * 4096, smem_read=999999, smem_write=99999,
                        global_read=0, global_write=0, mufu=999, fp32=9999, barriers=2)
    k = roofline.Kernel(entry, "bwd" if "bwd" in entry else "fwd", 128, 128, 256, 256, 256, 255, 0,
                        (300 if occupancy else 100) * 1024, 2, inner_loops=int(inner))
    return roofline.model(c, c, k, rates=roofline.RATES["h200"])


def _longest_entries() -> list[str]:
    from cuflash.kernels import attention_fwd_mma
    from cuflash.runtime import dtypes

    names = {v.entry for arch in (90, 80) for varlen in (False, True) for v in roofline.variants(arch, varlen=varlen)}
    decode = {attention_fwd_mma.choose_variant(dt, d, d, arch, kvcache=True).entry
              for arch in (90, 80) for dt in (dtypes.float16, dtypes.bfloat16)
              for d in attention_fwd_mma.HEAD_DIM_BUCKETS}
    return sorted(names, key=len)[-3:], sorted(decode, key=len)[-2:]


def test_roofline_tables_fit_100_columns_and_wide_has_everything():
    entries, decode = _longest_entries()
    rows = [_record(e, inner=True, occupancy=i == 0) for i, e in enumerate(entries)]
    narrow, wide = roofline.format_table(rows), roofline.format_table(rows, wide=True)
    assert max(map(len, narrow.splitlines())) <= 100 < max(map(len, wide.splitlines()))
    for r in rows:
        assert r.entry.removeprefix("cuflash_attn_") + "*" in narrow and r.entry in wide
    assert "occupancy" in narrow and all(p in wide.splitlines()[0] for p in ("mufu", "hbm", "spill", "regs"))
    d = [roofline.DecodeRoofline(
        entry=e, device="H200 SXM", arch=90, cache=cache, rows=4, block_m=64, block_n=64, head_dim=256,
        head_dim_v=256, warps=4, active_warps=1, registers=255, spills=0, smem_bytes=99999, ctas_per_sm=3,
        cache_bytes_per_tile=65536, cache_reads_per_kv_head=1,
        pipes=dict(tensor=9999.0, smem=9999.0, mufu=0.0, fp32=0.0, issue=9999.0, hbm=9999.0), bound="occupancy",
        hbm_fraction=1.0, predicted_gb_per_s=4800.0) for e in decode for cache in ("paged", "contiguous")]
    narrow, wide = roofline.format_decode_table(d), roofline.format_decode_table(d, wide=True)
    assert max(map(len, narrow.splitlines())) <= 100 < max(map(len, wide.splitlines()))


def _fake_variants(monkeypatch):
    names = ["cuflash_attn_fwd_mma_bf16_d64_m128_n64", "cuflash_attn_bwd_mma_main_bf16_d64_m64_n128_s2"]
    monkeypatch.setattr(roofline, "variants", lambda *a, **k: [types.SimpleNamespace(entry=n) for n in names])
    monkeypatch.setattr(roofline, "analyze", lambda v, device, **k: _record(v.entry))
    return names


def test_roofline_shows_progress_on_a_terminal_and_its_table_fits(capsys, monkeypatch):
    names = _fake_variants(monkeypatch)
    monkeypatch.setitem(sys.modules, "tqdm", None)   # the plain counter (tqdm draws a bar when installed)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert roofline.main([]) == 0
    out = capsys.readouterr().out
    progress = terminal.getvalue()
    assert f"roofline: 1/2 {names[0]}" in progress and f"roofline: 2/2 {names[1]}" in progress
    assert max(map(len, out.splitlines())) <= 100 and "\nfwd_mma_bf16_d64_m128_n64 " in out
    terminal.truncate(0)
    assert roofline.main(["--no-progress", "--wide"]) == 0
    assert terminal.getvalue() == "" and f"\n{names[1]} " in capsys.readouterr().out


def test_roofline_json_dash_prints_json_on_stdout(capsys, monkeypatch):
    names = _fake_variants(monkeypatch)
    assert roofline.main(["--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert [r["entry"] for r in json.loads(out)] == names
    assert "MODEL, not a measurement" in err and not Path("-").exists()


# --------------------------------------------------------------------------------------------
# demo: --generate on a one-token text, --transformers without torch


class _Tokenizer:
    """Words of a tiny vocabulary, one token each."""

    words = ["Hello", "world", "and", "the", "cat", "sat", "on", "a", "mat", "too", "yes"]

    def encode(self, text):
        return types.SimpleNamespace(ids=[self.words.index(w) for w in text.split()])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(" " + self.words[i] for i in ids)


def _tiny_model() -> smollm2.SmolLM2:
    rng = np.random.default_rng(7)
    cfg = smollm2.ModelConfig(name="tiny", n_layers=2, hidden_size=16, n_heads=2, n_kv_heads=1, head_dim=8,
                              ffn_size=24, vocab_size=len(_Tokenizer.words), rope_base=1e4, rms_eps=1e-5,
                              eos_id=-1)   # no end-of-text: every step generates

    def w(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    layers = [smollm2.LayerWeights(attn_norm=1 + w(16), wq=w(16, 16), wk=w(8, 16), wv=w(8, 16), wo=w(16, 16),
                                   ffn_norm=1 + w(16), w_gate=w(24, 16), w_up=w(24, 16), w_down=w(16, 24))
              for _ in range(cfg.n_layers)]
    return smollm2.SmolLM2(cfg, w(cfg.vocab_size, 16), layers, 1 + w(16), _Tokenizer())


def test_demo_generates_from_a_one_token_text_and_skips_the_loss(capsys, monkeypatch):
    model = _tiny_model()
    monkeypatch.setattr(smollm2, "find_gguf", lambda: Path("/nonexistent/tiny.gguf"))
    monkeypatch.setattr(smollm2, "load_tokenizer", lambda path: model.tokenizer)
    monkeypatch.setattr(smollm2.SmolLM2, "load", classmethod(lambda cls, path, tokenizer=None: model))
    assert demo.main(["--text", "Hello", "--generate", "4"]) == 0
    out = capsys.readouterr().out
    assert "next-token loss: skipped (the text is 1 token: there is no next token to score)" in out
    # the greedy continuation, recomputed without a cache on float64 attention, one token at a time
    ids = [0]
    for _ in range(4):
        hidden = model.forward(ids, lambda layer, q, k, v: cuflash.reference.naive_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True).astype(np.float32))
        ids.append(int(np.argmax(model.logits(hidden[-1:])[0])))
    assert f"  Hello[{model.decode(ids[1:])}]" in out
    with pytest.raises(ValueError, match=r"at least 2 tokens \(the loss predicts each next token; with --generate"):
        demo.run_demo(text="Hello", use_embedded=False, out=lambda line: None)
    with pytest.raises(ValueError, match=r"at least 1 token \(--generate continues it\), got 0"):
        demo.run_demo(text="", generate=3, use_embedded=False, out=lambda line: None)


def test_demo_transformers_without_torch_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # as if torch were not installed
    assert demo.main(["--transformers"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash demo: error: the transformers demo needs torch")
    assert "pip install torch" in err and "pip install 'cuflash[transformers]'" in err
    assert "pip install '.[transformers]'" in err


# --------------------------------------------------------------------------------------------
# words


def test_check_docstring_lists_exactly_its_sections():
    listed = re.findall(r"^``(\w+)``\s", check.__doc__, re.M)
    assert listed == list(check.SECTIONS)


def test_no_project_history_in_the_commands_text():
    paths = [REPO_ROOT / "cuflash" / "__main__.py", REPO_ROOT / "cuflash" / "intensity.py",
             *sorted((REPO_ROOT / "cuflash" / "tools").glob("*.py")),
             *sorted((REPO_ROOT / "cuflash" / "analysis").glob("*.py"))]
    history = re.compile(r"\bthe seed\b|\bseed's\b|seed write-up|\bseed section|\bissue \d+|\bthe issue\b"
                         r"|as the seed|seed/0", re.I)
    found = [f"{p.name}:{i}: {line.strip()}" for p in paths
             for i, line in enumerate(p.read_text().splitlines(), 1) if history.search(line)]
    assert found == []
