"""The public functions as ``cuflash`` exports them: a call whose arrays need a framework's
autograd or tracing runs through that framework's adapter, every other call through the
pipeline directly.

NumPy, CuPy and DLPack arrays carry no gradients, so :func:`cuflash.attention` and the other
public functions compute on them and return the same kind. Two kinds of input carry more, and
dropping it would lose a gradient without a word:

* **torch tensors that require grad** (with grad mode on), and any torch tensor while
  ``torch.compile`` traces: the call runs :mod:`cuflash.torch`'s function of the same name, with
  the same arguments. It runs the same kernels through custom operators with an autograd
  formula (the FlashAttention-2 backward, Dao 2023, Algorithm 2), so ``loss.backward()`` reaches
  q, k, v and the differentiable modifiers. Where an option has no gradient there,
  :mod:`cuflash.torch` raises ``TypeError`` naming the option.
* **JAX tracers** (inside ``jax.jit``, ``jax.grad``, ``jax.vmap``): the call runs
  :mod:`cuflash.jax`'s function of the same name (``jax.custom_vjp`` over the same kernels).

An entry point without such a form (the explicit backward functions have no gradient of their
own) raises ``TypeError`` for such input instead, naming the argument and what to do.

Imports: :mod:`cuflash.api`; :mod:`cuflash.torch` and :mod:`cuflash.jax` only when a call is
routed to them (so importing cuflash imports neither torch nor JAX).
"""

from __future__ import annotations

import functools
import sys

from cuflash.api.attention import attention as _attention
from cuflash.api.backward import attention_backward as _attention_backward
from cuflash.api.kvcache import attention_with_kvcache as _attention_with_kvcache
from cuflash.api.kvcache import merge_attention as _merge_attention
from cuflash.api.softmax import softmax as _softmax
from cuflash.api.varlen import attention_varlen as _attention_varlen
from cuflash.api.varlen import attention_varlen_backward as _attention_varlen_backward

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache", "merge_attention", "softmax", "framework_needed"]


def _arrays(args, kwargs):
    """``(name, value)`` for every argument, the items of list and tuple arguments included
    (``merge_attention``'s ``outs`` and ``lses``), and the values a ``score_mod``/``mask_mod``
    captures (its closure cells and the globals its code names: a learned table that requires
    grad routes the call as q would)."""
    for name, x in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                yield f"{name}[{i}]", y
        else:
            yield name, x
    for name in ("score_mod", "mask_mod"):
        yield from ((name, y) for y in _captured(kwargs.get(name)))


def _captured(fn):
    """The values a Python function closes over or names as globals (nothing is called)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:   # an empty cell
            continue
    glb = getattr(fn, "__globals__", {})
    for n in code.co_names:
        if n in glb:
            yield glb[n]


def framework_needed(args, kwargs):
    """``("torch", index or name)`` when a torch tensor among the arguments requires grad with
    grad mode on (or any torch tensor while ``torch.compile`` traces), ``("jax", ...)`` for a JAX
    tracer, None otherwise (the call needs no framework's machinery). Neither framework is
    imported: a framework that is not imported has no arrays to find."""
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    if torch is not None:
        tensors = [(n, x) for n, x in _arrays(args, kwargs) if isinstance(x, torch.Tensor)]
        if tensors:
            compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)()
            if compiling:
                return "torch", tensors[0][0]
            if torch.is_grad_enabled():
                for n, x in tensors:
                    if x.requires_grad:
                        return "torch", n
    if jax is not None:
        tracer = getattr(getattr(jax, "core", None), "Tracer", None)
        if tracer is not None:
            for n, x in _arrays(args, kwargs):
                if isinstance(x, tracer):
                    return "jax", n
    return None


def _arg_name(func, which) -> str:
    """The parameter name of positional argument ``which`` of ``func`` (a keyword stays itself)."""
    if isinstance(which, str):
        return which
    import inspect

    names = list(inspect.signature(func).parameters)
    return names[which] if which < len(names) else f"argument {which}"


def _routed(core, name: str, torch_name: str | None, jax_name: str | None, no_form: str = ""):
    """``core`` (a public function of :mod:`cuflash.api`), with calls that need torch's autograd
    or JAX's tracing sent to ``cuflash.torch.<torch_name>`` / ``cuflash.jax.<jax_name>``; None
    means that framework has no such form (``no_form`` says why, in the ``TypeError``)."""

    def target(need):
        if need is None:
            return core
        framework, which = need
        arg = _arg_name(core, which.split("[")[0] if isinstance(which, str) else which)
        if isinstance(which, str) and "[" in which:
            arg += which[which.index("["):]
        routed = torch_name if framework == "torch" else jax_name
        if routed is None:
            what = ("requires grad (with grad mode on)" if framework == "torch"
                    else "is a JAX tracer (inside jax.jit, jax.grad or jax.vmap)")
            raise TypeError(f"{name}: {arg} {what}, and cuflash.{framework} has no differentiable form of "
                            f"{name}{no_form}")
        if framework == "torch":
            import cuflash.torch as adapter
        else:
            import cuflash.jax as adapter
        return getattr(adapter, routed)

    @functools.wraps(core)
    def call(*args, **kwargs):
        return target(framework_needed(args, kwargs))(*args, **kwargs)

    return call


_NO_DOUBLE = ("; it is itself a gradient and has no gradient of its own (no double backward): call it on "
              "detached arrays (torch: under torch.no_grad() or with .detach(); JAX: call cuflash.jax.attention "
              "and let jax.grad compute the backward)")

attention = _routed(_attention, "cuflash.attention", "attention", "attention")
attention_varlen = _routed(_attention_varlen, "cuflash.attention_varlen", "attention_varlen", "attention_varlen")
attention_with_kvcache = _routed(
    _attention_with_kvcache, "cuflash.attention_with_kvcache", "attention_with_kvcache", None,
    " (it appends to the caches in place, and JAX arrays are immutable): call it on concrete arrays outside "
    "jax.jit, or use cuflash.jax.attention over the cache")
merge_attention = _routed(_merge_attention, "cuflash.merge_attention", "merge_attention", "merge_attention")
softmax = _routed(_softmax, "cuflash.softmax", "softmax", "softmax")
attention_backward = _routed(_attention_backward, "cuflash.attention_backward", None, None, _NO_DOUBLE)
attention_varlen_backward = _routed(_attention_varlen_backward, "cuflash.attention_varlen_backward", None, None,
                                    _NO_DOUBLE)
