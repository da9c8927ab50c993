"""cuflash: FlashAttention for the CuPy ecosystem.

Exact scaled-dot-product attention computed by fused, tiled kernels with the online-softmax
recurrence (Milakov & Gimelshein 2018; Dao et al., FlashAttention, 2022), so the (Sq x Sk) score
matrix is never materialised. NumPy input runs the NumPy implementation of the same algorithm
(:mod:`cuflash.reference`); GPU arrays run CUDA C kernels JIT-compiled with NVRTC. torch tensors
that require grad, and JAX tracers, run through :mod:`cuflash.torch` / :mod:`cuflash.jax` (the
same kernels, with their autograd): see :mod:`cuflash.autodiff`.
"""

__version__ = "0.1.0"

from cuflash import intensity, mods, reference, sim
from cuflash.api.attention import explain
from cuflash.api.kvcache import explain_kvcache
from cuflash.api.varlen import explain_varlen
from cuflash.autodiff import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_with_kvcache,
    merge_attention,
    softmax,
)
from cuflash.kernels.precompile import precompile
from cuflash.reference.block_mask import create_block_mask
from cuflash.runtime.block_mask import BlockMask
from cuflash.runtime.interop import fp8_view

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "merge_attention", "softmax", "create_block_mask", "BlockMask", "explain", "explain_varlen", "explain_kvcache", "precompile", "fp8_view", "mods",
           "reference", "intensity", "sim", "__version__"]
