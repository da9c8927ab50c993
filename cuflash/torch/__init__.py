"""PyTorch for cuflash: differentiable, ``torch.compile``-able attention on torch tensors.

Importing :mod:`cuflash` never imports torch; importing ``cuflash.torch`` does (torch >= 2.4).
The public functions, each with autograd through custom operators
(:func:`torch.library.custom_op`, with ``register_fake`` implementations so ``torch.compile``
traces through them without graph breaks):

* :func:`attention` (``cuflash::attention_fwd`` / ``_bwd``, and ``cuflash::attention_mod_fwd`` /
  ``_bwd`` when a score modifier is given): :mod:`cuflash.torch.attention`;
* :func:`attention_varlen` (``cuflash::attention_varlen_fwd`` / ``_bwd``): :mod:`cuflash.torch.varlen`;
* :func:`attention_with_kvcache` (``cuflash::attention_with_kvcache``, which mutates its caches;
  no backward): :mod:`cuflash.torch.kvcache`;
* :func:`softmax` (``cuflash::softmax_fwd``, :func:`cuflash.softmax`'s kernels with softmax's
  derivative in torch operations): :mod:`cuflash.torch.softmax`;
* :func:`scaled_dot_product_attention`, ``F.scaled_dot_product_attention``'s signature and
  semantics (:class:`SDPAError`, :class:`SDPADtypeError`): :mod:`cuflash.torch.sdpa`;
* context parallelism over ``torch.distributed``: :func:`ring_attention`,
  :func:`ulysses_attention`, :func:`zigzag_split`, :func:`zigzag_merge` and the differentiable
  :func:`merge_attention`: :mod:`cuflash.torch.context_parallel`.

:func:`attention`, :func:`attention_varlen`, :func:`attention_with_kvcache`, :func:`merge_attention`
and :func:`softmax` take every parameter of the :mod:`cuflash` function of the same name (same
names, defaults, meaning and return value; :func:`attention` and :func:`attention_varlen` also
take the backward's ``deterministic``), so ``cuflash.attention(q, k, v, **kw)`` on tensors that
require grad runs ``cuflash.torch.attention(q, k, v, **kw)``. Gradients reach every
differentiable input (q, k, v, ``attn_bias``, ``sinks``; every part of a merge); an option that
has no gradient (``out=``, ``alibi_slopes`` that requires grad, ``block_table`` in
:func:`attention_varlen`, the whole of :func:`attention_with_kvcache`) raises ``TypeError`` when
a tensor needs a gradient with grad mode on, never computing without it. A returned ``lse`` is
not differentiable. Meta tensors raise ``ValueError``.

Devices (``backend="auto"``): CPU tensors run the NumPy implementation on zero-copy NumPy views
(bfloat16 through an int16 view) and return tensors wrapping the results; CUDA tensors run the
CUDA kernels on torch's current stream (zero-copy DLPack views, outputs from ``torch.empty``).
``backend="sim"`` runs the CUDA kernels on CPU tensors through the simulator. Every operator runs the
public function's pipeline (:mod:`cuflash.api.pipeline`), so its validation and messages are the
public function's. A tensor whose last axis is not unit-stride (e.g. the stride-0 gradient
``out.sum()`` produces) is copied once with ``.contiguous()``; other strides are used as they are.

Imports: torch, :mod:`cuflash.api` and below (this is an adapter).
"""

import torch  # noqa: F401  (importing cuflash.torch imports torch)

from cuflash.torch.attention import attention
from cuflash.torch.context_parallel import (
    merge_attention,
    ring_attention,
    ulysses_attention,
    zigzag_merge,
    zigzag_split,
)
from cuflash.torch.kvcache import attention_with_kvcache
from cuflash.torch.sdpa import SDPADtypeError, SDPAError, scaled_dot_product_attention
from cuflash.torch.softmax import softmax
from cuflash.torch.varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "merge_attention", "softmax", "ring_attention",
           "ulysses_attention", "zigzag_split", "zigzag_merge", "scaled_dot_product_attention", "SDPAError",
           "SDPADtypeError"]
