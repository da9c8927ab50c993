"""Public entry points :func:`attention` and :func:`explain` (exported as ``cuflash.attention``
and ``cuflash.explain``)."""

from __future__ import annotations

import math

from cuflash.api import pipeline
from cuflash.reference import forward as ref_forward
from cuflash.reference import fp8 as ref_fp8
from cuflash.runtime import interop, validation
from cuflash.runtime.options import DropoutOptions, Fp8Options, ModifierOptions, Options

__all__ = ["attention", "explain"]


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False, layout="bhsd",
              out=None, backend="auto", dropout_p=0.0, dropout_seed=None, dropout_offset=0, softcap=0.0,
              alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None, block_mask=None):
    """Exact scaled-dot-product attention, ``softmax(softmax_scale * q k^T + mask) v``, fused.

    The ``(Sq, Sk)`` score matrix is never materialised: keys and values are streamed in tiles
    with the online-softmax recurrence (running maximum and sum per query row, rescaled float32
    accumulator, one division at the end; FlashAttention, Dao et al. 2022, Algorithm 1, and
    FlashAttention-2, Dao 2023, Algorithm 1).

    Parameters
    ----------
    q : array, shape ``(..., Sq, D)`` for layout "bhsd", ``(B, Sq, Hq, D)`` for "bshd"
    k : array, shape ``(..., Sk, D)`` / ``(B, Sk, Hk, D)``
    v : array, shape ``(..., Sk, Dv)`` / ``(B, Sk, Hk, Dv)``
        NumPy arrays, CuPy arrays, or DLPack arrays (torch, JAX, any producer); all of one kind,
        dtype and device. CPU DLPack arrays run the NumPy path on zero-copy views
        (``numpy.from_dlpack``) and the results come back as their kind (a bare producer gets
        NumPy). dtypes: float16, bfloat16 (``ml_dtypes.bfloat16``), float32; float64
        on the NumPy path; fp8 ``float8_e4m3fn`` (``ml_dtypes.float8_e4m3fn``,
        ``torch.float8_e4m3fn``; CuPy bytes through :func:`cuflash.fp8_view`) with the descales
        below, forward only. Leading (batch) dims must be equal, except the head axis (-3 for
        "bhsd", 2 for "bshd"), where ``Hq % Hk == 0`` (GQA/MQA: query head ``h`` reads kv head
        ``h // (Hq // Hk)``). 2-D "bhsd" input is one head. Any strides with unit stride on the
        last axis (slices of a packed qkv buffer, transposed views, stride-0 broadcast K/V);
        ``1 <= D, Dv <= 256``.
    causal : bool
        Causal mask aligned to the bottom-right corner (flash-attn >= 2.1): query ``i`` sees key
        ``j`` iff ``j <= i + Sk - Sq``. For ``Sq=2, Sk=5``::

            causal:       k0 k1 k2 k3 k4
                    q0 [  1  1  1  1  0 ]
                    q1 [  1  1  1  1  1 ]

        PyTorch SDPA's ``is_causal`` aligns top-left instead; the two agree when ``Sq == Sk``.
    softmax_scale : float, optional
        Scale applied to ``q k^T``; None means ``1/sqrt(D)``. ``0.0`` is valid (uniform weights).
    window_size : (int, int)
        ``(left, right)``: query ``i`` sees keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``;
        -1 means unbounded on that side. With ``causal=True`` the right bound is 0. Any int
        >= -1: a bound of ``Sq + Sk`` or more (e.g. flash-attn's ``2**31 - 1``) excludes nothing.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores (natural log).
    layout : {"bhsd", "bshd"}
        "bhsd" (SDPA's, the default) or "bshd" (flash-attn's).
    out : array, optional
        Output buffer: the result's shape and q's dtype and kind, unit last-axis stride, not
        overlapping q, k or v.
    backend : {"auto", "numpy", "sim", "cuda"}
        "auto" never moves data: NumPy input runs the NumPy implementation
        (:func:`cuflash.reference.flash_attention`, threaded: ``CUFLASH_NUM_THREADS``), GPU
        arrays run the CUDA kernels. The
        ``CUFLASH_BACKEND`` environment variable overrides "auto" only.
    dropout_p : float
        Attention dropout probability in ``[0, 1)`` (0: none, the kernel without dropout): P is
        multiplied by ``Z / (1 - p)`` after the softmax, ``Z`` the keep mask of
        :func:`cuflash.reference.dropout_mask` (Philox 4x32-10, the same bits on every backend).
        The LSE is the undropped softmax's.
    dropout_seed, dropout_offset : int
        The mask's Philox key, each in ``[0, 2**32)``; the seed is required with ``dropout_p >
        0``, and the backward must get the same pair to regenerate the mask.
    softcap : float
        Logit soft-capping (Gemma 2, Gemma Team 2024): scores become ``softcap * tanh(s /
        softcap)`` after the scale; 0 (default) is off; must be finite and >= 0.
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ALiBi (Press et al., "Train Short, Test Long", 2022): adds ``-slope * |i + Sk - Sq - j|``
        (aligned bottom-right, as flash-attn) to the score of query ``i`` and key ``j``. With
        several batch dims (layout "bhsd") the batched form is ``(*batch, Hq)``.
    attn_bias : array, optional
        Additive bias of q's dtype or float32, broadcastable (NumPy's rules) to ``(B, Hq, Sq,
        Sk)`` (``(*batch, Hq, Sq, Sk)``; in both layouts: for "bshd" too the bias is indexed
        by (batch, head, query, key), as SDPA and flash-attn do); any strides (stride 0 on
        broadcast axes, never materialised). ``-inf`` entries hide a pair.
    attn_mask : bool array, optional
        Broadcastable likewise; True = attend (SDPA's meaning). A row left with no key gets 0
        and ``lse = -inf``.
    sinks : float32 array ``(Hq,)``, optional
        Attention sinks (as gpt-oss uses them; OpenAI, gpt-oss model card, 2025): one learned
        logit per head that joins each row's softmax denominator and attends to nothing, so
        ``lse = log(sum_j exp(s_j) + exp(sink))`` and a row with no key gets 0 and ``lse = sink``.
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> new score`` (FlexAttention's form): ``score``
        the scaled score after softcap, ALiBi and bias, ``b`` the batch index (row-major over
        the batch axes), ``h`` the query head, ``q_idx``/``kv_idx`` the rows of q and k (from
        0, no causal offset). Traced once into an expression of a fixed operation set
        (arithmetic, comparisons, ``where``, ``exp``/``log``/``tanh``/``abs``/``minimum``/
        ``maximum``, ``//`` and ``%`` on integers, reads of captured arrays by index; see
        :mod:`cuflash.mods`); anything else is a ``TypeError`` naming the operation. Runs on
        the NumPy path and in the tensor-core forward (float16/bfloat16; compiled once per
        canonical text, the captured arrays passed at run time: at most 4, float32, int32 or
        bool, of at most 3 axes); other tiers raise ``NotImplementedError`` naming it.
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = attend; joins the causal/window mask
        and ``attn_mask`` (a row left with no key gets 0 and ``lse = -inf``). Traced likewise.
    block_mask : BlockMask, optional
        ``mask_mod``'s block-sparse summary (:func:`cuflash.create_block_mask`, built for
        ``(Sq, Sk)``, ``B`` 1 or the flattened batch, ``H`` 1 or ``Hq``; NumPy for NumPy and
        simulator calls, device arrays for device calls): blocks it lists as empty are skipped,
        full ones run without evaluating ``mask_mod``, partial ones evaluate it per pair. The
        result is the dense ``mask_mod``'s. ``mask_mod`` may be left out (the block mask's is
        used) or must be the function it was built from (``ValueError`` otherwise). Runs on
        the NumPy path and in the tensor-core forward; other tiers raise ``NotImplementedError``.
    q_descale, k_descale, v_descale : float32 arrays ``(B, Hk)``, optional
        fp8 input only (FA3's names and shapes; ``(*batch, Hk)`` with several batch dims): the
        fp8 arrays stand for ``q * q_descale``, ``k * k_descale``, ``v * v_descale``, one factor
        per batch entry and kv head (query head ``h`` uses ``h // (Hq // Hk)``'s); None is 1. A
        stride-0 view (``numpy.broadcast_to(s, (B, Hk))``) is one per-tensor scale. Host values
        must be finite and > 0 (device descales are checked for dtype and shape only). The NumPy
        path computes in float32 on the descaled values; on compute capability 9.0 the Hopper
        forward's fp8 form runs it (fixed shapes: fp8 wgmma, P rounded to e4m3, V copied
        key-contiguous on the device first; docs/kernels.md), elsewhere a kernel backend raises
        ``NotImplementedError`` naming the tier and arch. fp8 has no dropout and no backward
        (:func:`attention_backward` refuses it: the fp8 forward is for inference).
    out_dtype : {None, "bfloat16", "float16"}
        The result's dtype for fp8 input (None: bfloat16, FA3's); only with fp8 input.

        The order is: scale, softcap, ALiBi and bias, score_mod, the masks (causal/window,
        attn_mask and mask_mod), softmax (with the sink), dropout. On the NumPy path every dtype; float64 input may take
        float64 slopes and sinks. On the kernel backends ("sim", "cuda") the Hopper and tensor-core
        tiers' modifier forms run them (float16/bfloat16); float32 (the SIMT tier) and dropout
        together with a modifier raise ``NotImplementedError`` naming the modifier.

    Returns
    -------
    out : array of q's kind and dtype (``out_dtype`` for fp8 input), shape ``q.shape[:-1] + (Dv,)``
        ("bhsd") or ``(B, Sq, Hq, Dv)``
    lse : array, float32 (float64 for float64 input), shape ``q.shape[:-1]`` ("bhsd") or
        ``(B, Hq, Sq)`` ("bshd"); only when ``return_lse=True``. With ``sinks`` it includes the
        sink term.

    A query row that sees no key (e.g. causal with ``Sq > Sk``, or ``Sk = 0``) gets output 0 and
    ``lse = -inf``. Empty inputs (a zero batch dim or ``Sq = 0``) compute nothing. Non-finite
    input is never hidden (docs/conventions.md): a NaN or inf in query row ``i``, or in a key or value
    that row ``i`` sees, makes row ``i``'s output (and, through q or k, its lse) non-finite, as
    in the float64 oracle; no warning is raised. The CUDA kernels may also turn a row NaN for a
    NaN value row inside a tile it visits but does not see (``0 * NaN``).

    Raises
    ------
    TypeError
        A non-array, an unsupported dtype or non-native byte order, mixed dtypes or array kinds,
        ``numpy.matrix`` or a masked array, a CPU DLPack array NumPy cannot import, a non-bool
        flag.
    ValueError
        Mismatched shapes, non-unit last-axis or negative strides, an unknown layout or backend
        (argument or ``CUFLASH_BACKEND``), a malformed ``window_size``, a non-finite
        ``softmax_scale``, a bad ``out=``, arrays on different devices, or a backend that would
        move data; a negative or non-finite ``softcap``; slopes or sinks of the wrong shape; a
        bias or mask that does not broadcast to ``(B, Hq, Sq, Sk)``; descales of the wrong
        shape or strides, non-positive or non-finite (host) descales, descales or ``out_dtype``
        without fp8 input, an ``out_dtype`` other than bfloat16/float16 (``TypeError`` for
        descales that are not float32). (``TypeError`` for slopes
        or sinks that are not float32, a bias not of q's dtype or float32, a mask not bool, or
        a modifier array of another kind than q.) ``score_mod``/``mask_mod``: ``TypeError`` for
        a function that is not traceable (the operation named), the wrong signature, a captured
        array of an unsupported dtype or another kind than q; ``ValueError`` for a read of a
        captured array whose index may fall outside it.
    TypeError (gradients)
        An option that has no gradient, given with torch tensors that require grad (named by
        :mod:`cuflash.torch`, e.g. ``out=``, or ``alibi_slopes`` that requires grad).
    NotImplementedError
        A head dim above 256, or a valid call that has no kernel on the chosen backend: fp8
        input on "sim"/"cuda" off compute capability 9.0, or one the Hopper fp8 form does not
        take (packed, score modifiers, D not a multiple of 16; the message names each tier and
        the arch), fp8 with dropout.
    RuntimeError
        GPU arrays on a machine where CuPy or a usable CUDA device is missing (raised after
        validation, before any device work).

    Notes
    -----
    Gradients are never dropped: torch tensors that require grad (grad mode on) run through
    :func:`cuflash.torch.attention` (the same kernels, through custom operators with the
    FlashAttention-2 backward), so ``loss.backward()`` reaches q, k, v, ``attn_bias`` and
    ``sinks``; JAX tracers (``jax.jit``, ``jax.grad``, ``jax.vmap``) run through
    :func:`cuflash.jax.attention`. The returned ``lse`` carries no gradient in torch; under JAX its
    cotangent is honoured. See :mod:`cuflash.autodiff`.

    GPU arrays run on their own device, asynchronously (the host is never synchronized):

    * CuPy: on CuPy's current stream (``with stream: cuflash.attention(...)``); the outputs come
      from CuPy's memory pool.
    * torch CUDA tensors: on torch's current stream of that device (through
      ``cupy.cuda.Stream.from_external``); q, k, v (any strides) are viewed zero-copy through
      DLPack and the outputs are allocated with ``torch.empty``, so torch's caching allocator
      and memory statistics see them. The result is ordered after the work that produced the
      inputs and before later work on that stream, as for any torch operator.
    * JAX (or another CUDA DLPack producer): inputs are imported with ``cupy.from_dlpack``,
      which passes CuPy's current stream to ``__dlpack__(stream=...)`` (JAX makes that stream
      wait until the arrays are ready); the kernel runs on that stream, the result (in CuPy
      memory) is returned with ``jax.numpy.from_dlpack``, which makes JAX's stream wait for the
      kernel. JAX exposes no stream of its own to run on, and its arrays cannot be ``out=``.

    A launch allocates only its outputs and never synchronizes, so with ``out=`` passed (and a
    warmed-up compile cache, see :func:`cuflash.precompile`) a call can be captured in a CUDA
    graph (``stream.begin_capture()`` ... ``stream.end_capture()``).

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> q = np.random.randn(2, 8, 128, 64).astype(np.float32)
    >>> k = np.random.randn(2, 2, 256, 64).astype(np.float32)   # GQA: 8 query heads, 2 kv heads
    >>> v = np.random.randn(2, 2, 256, 64).astype(np.float32)
    >>> cuflash.attention(q, k, v, causal=True).shape
    (2, 8, 128, 64)
    """
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      return_lse=return_lse, backend=backend,
                      dropout=DropoutOptions(dropout_p, dropout_seed, dropout_offset),
                      modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod,
                                                block_mask),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    return pipeline.run(FORWARD, (q, k, v, out), options)


def _validate(operands, options, func):
    q, k, v, out = operands
    return validation.check_attention(q, k, v, options, func=func, out=out, fp8=True)


def _numpy(problem, operands):
    q, k, v, out = operands
    if problem.fp8 is not None:
        return ref_fp8.run_forward_fp8(problem, q, k, v, out)
    return ref_forward.run_forward(problem, q, k, v, out)


#: :func:`attention`'s steps
FORWARD = pipeline.Entry("cuflash.attention", ("q", "k", "v", "out"), _validate, _numpy, pipeline.forward_on,
                         pipeline.lse_pair, out=3)


def explain(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bhsd", backend="auto",
            arch=None, softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, score_mod=None, mask_mod=None, q_descale=None,
            k_descale=None, v_descale=None, out_dtype=None, block_mask=None) -> dict:
    """What :func:`attention` would run for these arguments, without running it.

    Validates exactly as :func:`attention` does (from metadata only, so fake or CPU-side
    descriptions of device arrays work) and asks the dispatcher which kernel tier and variant
    serve the call on ``sm_<arch>``.

    Parameters
    ----------
    q, k, v, causal, softmax_scale, window_size, layout, backend
        As for :func:`attention`.
    softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod, block_mask
        As for :func:`attention` (validated the same way; a kernel tier that does not take a
        modifier says so, and with none left ``NotImplementedError`` names it).
    q_descale, k_descale, v_descale, out_dtype
        As for :func:`attention` (fp8 input: the Hopper forward's fp8 form on arch 90, named in
        ``choice``; elsewhere ``NotImplementedError`` names the tiers and the arch).
    arch : int or str, optional
        Compute capability to plan for (``90``, ``"sm_80"``). Default: the simulator's arch
        (:func:`cuflash.sim.options`) for ``backend="sim"``, the arrays' device for CUDA arrays
        (which needs a GPU). With NumPy input and an ``arch``, the answer is what a device of
        that arch would run (as ``backend="sim"`` plans it).

    Returns
    -------
    dict
        ``backend``; for the kernel backends also ``arch``, ``tier`` (module name), ``variant``
        (its name), ``entry`` (kernel symbol), ``block_m``/``block_n`` (tile), ``threads``,
        ``smem_bytes`` (dynamic shared memory), ``blocks`` (thread blocks over all launches) and
        ``choice`` (the dispatcher's one-line account, with why faster tiers were passed over),
        ``backward`` (the same account of the backward of this call, without dropout:
        :func:`cuflash.kernels.dispatch.describe_backward`);
        for the NumPy path ``block_m``/``block_n`` of its tiles (per kv head, the group's
        query heads stacked) and ``threads`` (its pool size).

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`attention`.
    RuntimeError
        For CUDA arrays with ``arch=None`` on a machine without a usable GPU.
    """
    from cuflash.kernels import dispatch

    func = "cuflash.explain"
    options = Options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, layout=layout,
                      backend=backend, modifiers=ModifierOptions(softcap, alibi_slopes, attn_bias, attn_mask, sinks, score_mod, mask_mod,
                                                                 block_mask),
                      fp8=Fp8Options(q_descale, k_descale, v_descale, out_dtype))
    host = interop.HostImport(func, FORWARD.names, (q, k, v, None), options)
    q, k, v, _ = host.operands
    problem = _validate(host.operands, host.options, func)
    chosen = pipeline.resolve_backend(backend, problem.kind, func)
    if chosen == "numpy" and arch is not None:
        # asking for an arch means asking what a device would run: plan as the simulator does
        chosen = "sim"
    if chosen == "numpy":
        from cuflash.runtime import threads

        block_m, block_n = ref_forward.cpu_tiles(problem)
        return {"backend": "numpy", "block_m": block_m, "block_n": block_n, "threads": threads.num_threads(),
                "choice": f"NumPy path (cuflash.reference.flash_attention, {block_m} x {block_n} tiles per kv "
                          f"head, {threads.num_threads()} threads); pass arch=... or "
                          "backend='sim' to see the kernel a GPU would run"}
    pipeline.check_kernel_dtype(problem, chosen)
    arch, _ = pipeline.plan_arch(chosen, arch, problem, func)
    arrays = (q, k, v) if problem.kind in ("numpy", "cupy") else None  # DLPack: shape-level checks only
    tier = dispatch.forward_tier(problem, arch, arrays)
    variant = dispatch.variant_for(tier, problem, arch)
    block_m = getattr(variant, "block_m", None)
    blocks = dispatch.forward_blocks(problem, variant)
    return {
        "backend": chosen, "arch": arch, "tier": tier.__name__.rsplit(".", 1)[-1],
        "variant": variant.name, "entry": variant.entry, "block_m": block_m,
        "block_n": getattr(variant, "block_n", None), "threads": math.prod(variant.block),
        "smem_bytes": getattr(variant, "smem_bytes", None), "blocks": blocks,
        "choice": dispatch.describe_choice(problem, arch, arrays),
        "backward": dispatch.describe_backward(problem, arch),
    }
