"""cuflash: FlashAttention for the CuPy ecosystem.

Exact scaled-dot-product attention computed by fused, tiled kernels with the online-softmax
recurrence (Milakov & Gimelshein 2018; Dao et al., FlashAttention, 2022), so the (Sq x Sk) score
matrix is never materialised. NumPy input runs the NumPy implementation of the same algorithm
(:mod:`cuflash.reference`); GPU arrays run CUDA C kernels JIT-compiled with NVRTC.
"""

__version__ = "0.1.0"

from cuflash import intensity, reference, sim
from cuflash.api.attention import attention, explain
from cuflash.api.backward import attention_backward
from cuflash.api.kvcache import attention_with_kvcache, merge_attention
from cuflash.api.softmax import softmax
from cuflash.api.varlen import attention_varlen, attention_varlen_backward
from cuflash.kernels.precompile import precompile

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "merge_attention", "softmax", "explain", "precompile", "reference", "intensity", "sim", "__version__"]
