"""Attention masks: checked, and brought into the layout the kernels read.

One meaning everywhere: a boolean mask is True where a query *may attend* to a
key; a float mask is added to the scaled scores (``-inf`` forbids).  Used by
scaled dot-product attention (and through it by ``attention``) and by
multi-head attention, which canonicalises its mask once for all heads.
"""
from __future__ import annotations

import numpy as np

from . import _kernels
from ._validation import as_array

__all__ = ["MASK_NONE", "MASK_BOOL", "MASK_ADD", "MASK_NAMES", "check_attn_mask", "kernel_mask"]

MASK_NONE = _kernels.MASK_NONE
MASK_BOOL = _kernels.MASK_BOOL
MASK_ADD = _kernels.MASK_ADD
MASK_NAMES = {MASK_NONE: "none", MASK_BOOL: "bool", MASK_ADD: "additive"}


def check_attn_mask(attn_mask, Lq, Lk, cdt):
    """``(mask, kind, leading_dims)`` for a user's ``attn_mask``.

    ``None`` gives ``(None, MASK_NONE, ())``.  Otherwise the mask must be bool
    or a real float dtype and its last two dims broadcastable to ``(Lq, Lk)``
    (a 0-d or 1-d mask is read as ``(1, 1)`` / ``(1, Lk)``); it comes back
    through :func:`kernel_mask`, with the leading dims that take part in the
    batch broadcast.
    """
    if attn_mask is None:
        return None, MASK_NONE, ()
    mask = as_array(attn_mask, "attn_mask")
    if mask.dtype == np.bool_:
        kind = MASK_BOOL
    elif mask.dtype.kind == "f" and mask.dtype.itemsize <= 8:
        kind = MASK_ADD
    else:
        raise TypeError(
            "attn_mask: expected a bool mask (True = may attend) or a float mask "
            f"(added to the scores), got dtype {mask.dtype}"
        )
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    mq, mk = mask.shape[-2:]
    if mq not in (1, Lq) or mk not in (1, Lk):
        raise ValueError(
            f"attn_mask: expected a shape broadcastable to (..., Lq={Lq}, Lk={Lk}), "
            f"got {mask.shape}"
        )
    return kernel_mask(mask, kind, Lk, cdt), kind, mask.shape[:-2]


def kernel_mask(mask, mask_kind, Lk, cdt):
    """A validated mask (bool, or float of kind MASK_ADD; at least 2-D, last two
    dims broadcastable to (Lq, Lk)) as the kernel reads it: additive masks in the
    compute dtype, the key axis spelled out and contiguous, aligned memory."""
    if mask_kind == MASK_ADD and mask.dtype != cdt:
        mask = mask.astype(cdt)
    if mask.shape[-1] != Lk:  # one value for every key: spell it out along the key axis
        mask = np.broadcast_to(mask, mask.shape[:-1] + (Lk,))
    if (Lk > 1 and mask.strides[-1] != mask.itemsize) or not mask.flags.aligned:
        mask = np.array(mask, order="C")  # a fresh, aligned, contiguous copy
    return mask
