"""The public functions of cuflash and the one pipeline they share.

* :mod:`~cuflash.api.pipeline`: the steps every entry point runs (host import, validation once,
  the target: NumPy, simulator or CUDA) and the device steps the CUDA and simulator targets share;
* :mod:`~cuflash.api.attention` (:func:`cuflash.attention`, :func:`cuflash.explain`),
  :mod:`~cuflash.api.backward` (:func:`cuflash.attention_backward`),
  :mod:`~cuflash.api.varlen` (:func:`cuflash.attention_varlen`, its backward and
  :func:`cuflash.explain_varlen`), :mod:`~cuflash.api.kvcache` (:func:`cuflash.attention_with_kvcache`,
  :func:`cuflash.explain_kvcache`, :func:`cuflash.merge_attention`) and :mod:`~cuflash.api.softmax` (:func:`cuflash.softmax`):
  each a flat public signature, an options object and its entry's steps.

Imports: :mod:`cuflash.kernels`, :mod:`cuflash.sim`, :mod:`cuflash.reference`,
:mod:`cuflash.runtime`; never the adapters or the tools.
"""
