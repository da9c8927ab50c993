"""Public backward entry point: :func:`attention_backward` (exported as ``cuflash.attention_backward``)."""

from __future__ import annotations

from cuflash.api import pipeline
from cuflash.reference import backward as ref_backward
from cuflash.runtime import validation
from cuflash.runtime.options import DropoutOptions, ModifierOptions, Options

__all__ = ["attention_backward"]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       layout="bhsd", backend="auto", deterministic=False, dropout_p=0.0, dropout_seed=None,
                       dropout_offset=0, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None,
                       return_dbias=False, return_dsinks=False, return_dscore_mod=False, block_mask=None):
    """Gradients ``(dq, dk, dv)`` of :func:`cuflash.attention` from its output and log-sum-exp.

    The FlashAttention-2 backward (Dao 2023, Algorithm 2): ``P = exp(S - lse)`` is recomputed
    tile by tile from q, k and the forward's ``lse``, so the ``(Sq, Sk)`` matrices are never
    stored; with ``D = rowsum(dout * out)`` and ``dS = P * (dout v^T - D)``::

        dv = P^T dout,   dq = softmax_scale * dS k,   dk = softmax_scale * dS^T q

    accumulated in float32 (float64 for float64 input). With GQA/MQA, ``dk`` and ``dv`` of a kv
    head sum over the query heads that share it.

    Parameters
    ----------
    dout : array, shape and dtype of ``out``
        Gradient of the loss with respect to the forward's output; any strides with unit last axis.
    q, k, v : arrays
        The forward's inputs, exactly as :func:`cuflash.attention` takes them.
    out : array, q's dtype, shape ``q.shape[:-1] + (Dv,)`` ("bhsd") or ``(B, Sq, Hq, Dv)`` ("bshd")
        The forward's output.
    lse : array, float32 or float64, shape ``q.shape[:-1]`` ("bhsd") or ``(B, Hq, Sq)`` ("bshd")
        The forward's log-sum-exp (``cuflash.attention(..., return_lse=True)``); ``-inf`` marks a
        row that sees no key.
    causal, softmax_scale, window_size, layout
        The forward's options; they must be the ones the forward was called with.
    backend : {"auto", "numpy", "sim", "cuda"}
        Resolved as in :func:`cuflash.attention` ("auto" never moves data; ``CUFLASH_BACKEND``
        overrides "auto" only). "sim" and "cuda" run the Hopper backward on compute capability 9.0
        (``kernels_cu/attention_bwd_sm90.cu``: float16/bfloat16, D = Dv = 64, 96 or 128), else the tensor-core backward
        (``kernels_cu/attention_bwd_mma.cu``: float16/bfloat16 on sm_80+, head dims up to 256
        where a tile fits the shared memory, 16-byte-aligned rows) or else the portable one (``kernels_cu/attention_bwd_simt.cu``);
        :func:`cuflash.kernels.dispatch.backward_tier` chooses.
    deterministic : bool
        Bit-identical results run to run on the kernel backends ("sim", "cuda"): dQ is summed
        without atomics, each of a fixed number of splits (at most 16; a function of the shape
        only) accumulating its share of the key tiles, in order, into its own float32 partial
        buffer, which a final pass adds in split order. Costs: a float32 workspace of up to 16
        copies of dq (instead of one) and fewer, longer thread blocks when ``batch * kv heads``
        is small (expect a slower backward; the default, ``False``, adds dQ with atomics, whose
        order, and so the last bits of dq, may vary between runs). dk and dv are always
        deterministic. The NumPy path is always deterministic.
    dropout_p, dropout_seed, dropout_offset
        The forward's dropout (see :func:`cuflash.attention`); the mask is regenerated from them:
        ``dV = (P Z / (1 - p))^T dout``, ``dS = P (dout V^T Z / (1 - p) - D)``.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks
        The forward's score modifiers (see :func:`cuflash.attention`), exactly as it got them.
        Under a softcap, ``dS`` is multiplied by ``1 - tanh^2(s / softcap)`` before it meets q
        and k.
    score_mod, mask_mod
        The forward's traced functions (see :func:`cuflash.attention`): ``dS`` is multiplied by
        the symbolic derivative ``d score_mod / d score`` at the score score_mod received
        (before the bias gradient is taken and before the softcap's factor); captured arrays get
        a gradient only with ``return_dscore_mod``. At a kink the derivative takes a side (``abs``: 0 at 0; ``minimum``,
        ``maximum``: a tie goes to the first argument), and a pair whose ``dS`` is 0 (a hidden
        pair) stays 0 even where the derivative is not finite. On the NumPy path and in the
        tensor-core backward (float16/bfloat16; the derivative compiled beside the function),
        which does not take them together with ``return_dbias`` (``NotImplementedError``).
    block_mask : BlockMask, optional
        The forward's block mask (see :func:`cuflash.attention`): the backward visits, per key
        block, only the query blocks that see it (the block mask's transposed index), and
        evaluates ``mask_mod`` only on partial blocks.
    return_dbias : bool
        Also return ``d attn_bias``: ``dS`` summed over the axes the bias broadcasts over, in
        the bias's own shape and dtype (accumulated in float32, float64 for float64 input, and
        added in a fixed order: the same bits run to run). Needs ``attn_bias``.
    return_dsinks : bool
        Also return ``d sinks``, float32 ``(Hq,)`` (float64 for float64 input): ``-sum over
        batch and rows of exp(sink - lse) * rowsum(dout * out)``. Needs ``sinks``.
    return_dscore_mod : bool
        Also return the gradients of the score_mod's captured float arrays (float32/float64;
        every one the function captures, as FlexAttention gives for a learned table), as a dict
        from the array's variable name in the score_mod to its gradient (the array's shape and
        dtype, the arrays' kind): for each read ``a[i(b, h, q_idx, kv_idx), ...]``,
        ``d a[i] += dS * d score_mod / d read`` summed over every visible pair (the derivative
        is symbolic, :func:`cuflash.runtime.score_mod.array_derivatives`; a hidden pair adds
        nothing). Integer and bool arrays, and a mask_mod's arrays, get none. Needs
        ``score_mod``. On the NumPy path: float64 sums per block and float32 (float64 for
        float64 input) across blocks, added in a fixed order, so the same bits run to run. In
        the tensor-core backward (a variant compiled with the derivatives, float32 arrays):
        each visible pair adds its terms into a float32 workspace per array with ``atomicAdd``,
        whose order varies from run to run, so the last bits may differ between runs. With
        ``deterministic=True`` each term is added exactly instead, as signed integer parts
        (twelve 24-bit limbs from float32's least subnormal step, 64-bit integer atomics, 104
        bytes of workspace per array element), whose sum is the same in any order; it is
        rounded once to float32 after the kernel, so the result is bit-identical run to run,
        for any split of the key tiles (``NotImplementedError`` where an element could take
        2^39 terms or more, batch x query heads x Sq x Sk x reads; ``MemoryError`` naming the
        bytes where the workspace does not fit).

    Returns
    -------
    dq, dk, dv : arrays of q's kind and dtype, the shapes of q, k and v
    dbias : array, ``attn_bias.shape`` and dtype; only with ``return_dbias``
    dsinks : array ``(Hq,)``; only with ``return_dsinks`` (after ``dbias`` when both are asked for)
    dscore_mod : dict of str to array; only with ``return_dscore_mod`` (last)

    A row that sees no key (``lse = -inf``) has ``dq = 0`` there and adds nothing to ``dk``/``dv``.
    Non-finite input (in q, k, v, dout, or the NaN ``out``/``lse`` the forward made of it) travels
    only along visible (query, key) pairs: a gradient row is non-finite exactly where the float64
    oracle's is, except that the CUDA kernels may also form ``0 * NaN`` with a row of a tile they
    visit but whose pair is masked. CPU DLPack arrays (torch, JAX) run the NumPy path on
    zero-copy views and the gradients come back as their kind.

    Raises
    ------
    TypeError
        A non-array, an unsupported or mismatched dtype (``out`` must have q's dtype, ``dout``
        out's, ``lse`` float32/float64), mixed array kinds, a CPU DLPack array NumPy cannot
        import, a non-bool flag.
    ValueError
        Mismatched shapes of q/k/v, ``out``, ``dout`` or ``lse``; bad strides or options; an
        unknown backend or one that would move data; a bad modifier (as :func:`cuflash.attention`);
        ``return_dbias`` without ``attn_bias``, ``return_dsinks`` without ``sinks`` or
        ``return_dscore_mod`` without ``score_mod``.
    TypeError (gradients)
        Arrays that carry a gradient: torch tensors that require grad (with grad mode on) or JAX
        tracers. This function is a gradient and has none of its own (no double backward); for
        training, call :func:`cuflash.attention` on such arrays and let the framework run this
        backward (:mod:`cuflash.autodiff`).
    NotImplementedError
        A head dim above 256, or float64 on a kernel backend.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> q, k, v = (np.random.randn(1, 4, 16, 32).astype(np.float32) for _ in range(3))
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> dq.shape, dq.dtype
    ((1, 4, 16, 32), dtype('float32'))
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      backend=backend, deterministic=deterministic, return_dbias=return_dbias,
                      return_dsinks=return_dsinks, return_dscore_mod=return_dscore_mod,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod,
                                                block_mask))
    return pipeline.run(BACKWARD, (dout, q, k, v, out, lse), options)


def _validate(operands, options, func):
    return ref_backward.check_backward(*operands, options, func=func, max_head_dim=validation.MAX_HEAD_DIM)


def _numpy(problem, operands):
    return ref_backward.run_backward(problem, *operands)


#: :func:`attention_backward`'s steps
BACKWARD = pipeline.Entry("cuflash.attention_backward", ("dout", "q", "k", "v", "out", "lse"), _validate, _numpy,
                          pipeline.backward_on, lambda grads, problem: tuple(grads), like=1)
