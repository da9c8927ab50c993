"""The options of one call: a frozen object built once at the public face and handed down.

The public functions keep flash-attn's flat signatures; each builds one :class:`Options` from
its arguments and hands it to the pipeline (:mod:`cuflash.api.pipeline`), which validates it
once (:mod:`cuflash.runtime.validation` turns it and the arrays into an ``AttentionProblem``)
and gives both to the target that runs the call. No option travels in ``**kwargs`` or a dict.

Array-valued options (the score modifiers, a packed batch's index, a KV cache's indices and
new keys) are fields like the scalars; :meth:`Options.map_arrays` applies one function to every
one of them (the CPU DLPack import, for instance), so no step has to list them again.

Imports: nothing of cuflash (the bottom layer).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Options", "DropoutOptions", "ModifierOptions", "Fp8Options", "PackedOptions", "CacheOptions", "SAME_KIND",
           "INDEX"]

#: an array option that must be of q's kind and device (a modifier, a cache's new keys)
SAME_KIND = "same kind"
#: an index array option (int32): NumPy with device q is allowed (copied to the device)
INDEX = "index"


def _array(role: str, default=None):
    return dataclasses.field(default=default, metadata={"array": role})


class _MapsArrays:
    """``map_arrays`` for the option groups: every field marked as an array, recursively."""

    def map_arrays(self, fn: Callable[[Any, str, str], Any]):
        """A copy with ``fn(value, name, role)`` for every array field that is not None (``role``:
        :data:`SAME_KIND` or :data:`INDEX`); nested option groups are mapped too."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, _MapsArrays):
                changes[f.name] = value.map_arrays(fn)
            elif "array" in f.metadata and value is not None and not isinstance(value, int):
                changes[f.name] = fn(value, f.name, f.metadata["array"])
        return dataclasses.replace(self, **changes) if changes else self

    def arrays(self) -> list[tuple[str, Any, str]]:
        """``(name, value, role)`` of every array field that is not None, in field order."""
        found: list = []

        def note(value, name, role):
            found.append((name, value, role))
            return value

        self.map_arrays(note)
        return found


@dataclasses.dataclass(frozen=True)
class DropoutOptions(_MapsArrays):
    """Attention dropout: ``dropout_p``, ``dropout_seed``, ``dropout_offset`` (see
    :func:`cuflash.attention`)."""

    p: Any = 0.0
    seed: Any = None
    offset: Any = 0


@dataclasses.dataclass(frozen=True)
class ModifierOptions(_MapsArrays):
    """The score modifiers as given: ``softcap``, the arrays ``alibi_slopes``, ``attn_bias``,
    ``attn_mask``, ``sinks``, the functions ``score_mod`` and ``mask_mod``, and a ``block_mask``
    (see :func:`cuflash.attention`)."""

    softcap: Any = 0.0
    alibi_slopes: Any = _array(SAME_KIND)
    attn_bias: Any = _array(SAME_KIND)
    attn_mask: Any = _array(SAME_KIND)
    sinks: Any = _array(SAME_KIND)
    score_mod: Any = None
    mask_mod: Any = None
    block_mask: Any = None


@dataclasses.dataclass(frozen=True)
class Fp8Options(_MapsArrays):
    """fp8 (float8_e4m3fn) input: the descales ``q_descale``, ``k_descale``, ``v_descale`` (FA3's
    names) and the result type ``out_dtype`` (see :func:`cuflash.attention`)."""

    q_descale: Any = _array(SAME_KIND)
    k_descale: Any = _array(SAME_KIND)
    v_descale: Any = _array(SAME_KIND)
    out_dtype: Any = None


@dataclasses.dataclass(frozen=True)
class PackedOptions(_MapsArrays):
    """A packed variable-length batch (:func:`cuflash.attention_varlen`): the sequence index and,
    for chunked prefill, the block table of a paged KV cache and the split-KV count
    (``num_splits``, 1 unless given)."""

    cu_seqlens_q: Any = _array(INDEX)
    cu_seqlens_k: Any = _array(INDEX)
    max_seqlen_q: Any = 0
    max_seqlen_k: Any = 0
    seqused_k: Any = _array(INDEX)
    block_table: Any = _array(INDEX)
    num_splits: Any = 1


@dataclasses.dataclass(frozen=True)
class CacheOptions(_MapsArrays):
    """KV-cache attention (:func:`cuflash.attention_with_kvcache`): where the keys are and what is
    appended (``k``/``v`` are the new keys and values; the caches are the call's operands)."""

    cache_seqlens: Any = _array(INDEX)
    k: Any = _array(SAME_KIND)
    v: Any = _array(SAME_KIND)
    rotary_cos: Any = _array(SAME_KIND)
    rotary_sin: Any = _array(SAME_KIND)
    rotary_interleaved: Any = True
    cache_batch_idx: Any = _array(INDEX)
    cache_leftpad: Any = _array(INDEX)
    block_table: Any = _array(INDEX)
    num_splits: Any = 0


@dataclasses.dataclass(frozen=True)
class Options(_MapsArrays):
    """Every option of a cuflash call, as the caller gave it (validation happens once, in
    :mod:`cuflash.runtime.validation`; the fields keep flash-attn's and SDPA's names).

    Attributes
    ----------
    causal, softmax_scale, window_size, layout, return_lse, backend, deterministic
        As :func:`cuflash.attention` and :func:`cuflash.attention_backward` take them.
    return_dbias, return_dsinks, return_dscore_mod
        The backward's requests for the modifier gradients (``return_dscore_mod``: the
        score_mod's captured float arrays').
    axis
        :func:`cuflash.softmax`'s axis.
    dropout, modifiers, fp8
        :class:`DropoutOptions`, :class:`ModifierOptions`, :class:`Fp8Options`.
    packed
        :class:`PackedOptions` for a packed batch, else None.
    cache
        :class:`CacheOptions` for KV-cache attention, else None.
    """

    causal: Any = False
    softmax_scale: Any = None
    window_size: Any = (-1, -1)
    layout: Any = "bhsd"
    return_lse: Any = False
    backend: Any = "auto"
    deterministic: Any = False
    return_dbias: Any = False
    return_dsinks: Any = False
    return_dscore_mod: Any = False
    axis: Any = -1
    dropout: DropoutOptions = DropoutOptions()
    modifiers: ModifierOptions = ModifierOptions()
    fp8: Fp8Options = Fp8Options()
    packed: PackedOptions | None = None
    cache: CacheOptions | None = None
