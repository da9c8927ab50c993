"""The dispatcher's tier lists narrowed for a test of one tier."""

from __future__ import annotations

from cuflash.kernels import attention_bwd_mma, attention_fwd_mma, dispatch


def without_tensor_cores(mp) -> None:
    """Take the tensor-core tiers (forward and backward, ``attention_*_mma``) out of the
    dispatcher's lists with the monkeypatch ``mp``: for the grids of the portable tier on sm_75,
    whose float16 calls the tensor-core tier's sm_75 form takes first."""
    mp.setattr(dispatch, "TIERS", tuple(t for t in dispatch.TIERS if t[1] is not attention_fwd_mma))
    mp.setattr(dispatch, "BACKWARD_TIERS", tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_mma))
