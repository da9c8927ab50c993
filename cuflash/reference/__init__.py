"""NumPy implementations of attention and softmax: the test oracle and the CPU path.

Every algorithm cuflash's kernels implement has its NumPy form here, vectorised over batch and heads:

* :func:`naive_attention` materialises ``S = scale * Q K^T`` and ``P = softmax(S)`` in float64;
  it is the ground truth every kernel is checked against.
* :func:`softmax` is the three-pass softmax (max, sum of exponentials, normalise).
* :func:`online_softmax` is the block-wise online normaliser of Milakov & Gimelshein,
  "Online normalizer calculation for softmax" (2018), eq. (1)-(3): one pass keeps a running
  maximum ``m`` and a running sum ``l`` that is rescaled by ``exp(m_old - m_new)`` whenever the
  maximum grows; a second pass normalises.
* :func:`flash_attention` is the fused tiled forward of FlashAttention (Dao et al., 2022,
  Algorithm 1; FlashAttention-2, Dao 2023, Algorithm 1 for the single final division): Br x Bc
  tiles, running ``m`` and ``l`` per query row, a rescaled accumulator, one division after the
  K/V loop. Its extra memory is O(batch * heads * Br * Bc), never O(Sq * Sk). It is what
  :func:`cuflash.attention` runs on NumPy input.

Two slips common in textbook write-ups of these algorithms are avoided here (docs/kernels.md,
"Corrections to the textbook algorithm"): a standalone online softmax that scales the block's
local sum twice and never rescales the values of earlier blocks (rows do not sum to 1), and a
fused forward that gives NaN for a tile in which a row sees no key (``exp(-inf - -inf)``) and writes O inside the
K/V loop. Here a row whose running maximum is still ``-inf`` uses 0 as its shift, so masked
entries contribute ``exp(-inf) = 0`` and nothing becomes NaN.

Conventions (shared with every cuflash backend)
-----------------------------------------------
* Layout ``"bhsd"``: q ``(..., Sq, D)``, k ``(..., Sk, D)``, v ``(..., Sk, Dv)``; the axis -3
  (when present) holds heads. Layout ``"bshd"``: q ``(B, Sq, H, D)``.
* GQA/MQA: ``Hq % Hk == 0`` and query head ``h`` reads kv head ``h // (Hq // Hk)``.
* Causal masks are aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
  ``window_size=(left, right)`` keeps keys with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
  (-1 = unbounded); ``causal=True`` sets ``right = 0``.
* ``lse`` is the natural-log log-sum-exp of the scaled scores of each query row.
* A query row that sees no key gets output 0 and ``lse = -inf`` (``lse = sink`` with ``sinks``).
* Score modifiers, in this order after the scale: softcap, ALiBi and ``attn_bias``,
  ``score_mod``, the masks (causal/window, ``attn_mask`` and ``mask_mod``), the softmax with the
  sink in its denominator (:mod:`~cuflash.reference.modifiers`); the lse includes the sink.

Layout
------
:mod:`~cuflash.reference.forward` (naive and tiled forward), :mod:`~cuflash.reference.backward`
(naive and tiled backward), :mod:`~cuflash.reference.normalize` (three-pass and online softmax),
:mod:`~cuflash.reference.masks` (the masking rule and the tile ranges it implies),
:mod:`~cuflash.reference.views` (zero-copy canonical and per-group views),
:mod:`~cuflash.reference.dropout` (Philox 4x32-10 and the dropout keep mask, :func:`dropout_mask`),
:mod:`~cuflash.reference.kvcache` (rotary, the KV-cache append and gather, the LSE merge),
:mod:`~cuflash.reference.modifiers` (softcap, ALiBi, attn_bias, attn_mask and sinks, block by block,
and their gradients), :mod:`~cuflash.reference.score_mods` (traced score_mod/mask_mod evaluated on
NumPy blocks),
:mod:`~cuflash.reference.tolerance` (the accuracy rule every backend is held to),
:mod:`~cuflash.reference.memory` (the working-memory estimate every tiled function checks before it
allocates, ``CUFLASH_MEMORY_LIMIT``, and the checks that read a broadcast view's distinct elements).
Imports: :mod:`cuflash.runtime` only.
"""

from cuflash.reference.backward import attention_backward, flash_attention_backward
from cuflash.reference.dropout import dropout_mask
from cuflash.reference.forward import flash_attention, naive_attention
from cuflash.reference.masks import visible_mask
from cuflash.reference.normalize import online_softmax, softmax

__all__ = ["naive_attention", "softmax", "online_softmax", "flash_attention", "attention_backward",
           "flash_attention_backward", "visible_mask", "dropout_mask"]
