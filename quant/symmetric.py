"""Symmetric per-row INT8: x = scale * code, code in [-127, 127], one scale per row.

Used where a dot product is taken straight from the codes: with no zero point, ``q . x`` is
``scale * (q . code)``, so a product over integer codes (exact in bfloat16 up to 256) needs one
multiplication per row afterwards and no offset term that would cancel (an asymmetric code's
``z * sum(q)`` is large next to the logit it offsets). LLM.int8() (Dettmers et al., 2022,
https://arxiv.org/abs/2208.07339) quantizes rows the same way (absmax).
"""

from __future__ import annotations

import torch

LEVELS = 127  # symmetric: -127..127, so negation is exact and -128 is never used


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax INT8 codes and float32 scales of ``x`` (..., D), per row (last dimension).

    Every value comes back as ``code * scale`` within ``scale / 2`` of the original (a row of
    zeros has scale 0 and codes 0, as has a row whose ``max |x| / 127`` underflows float32: its
    values are below 127 x 2^-149). Where that scale is subnormal (``max |x|`` below 127 x
    2^-126), its own rounding to a multiple of 2^-149 adds to the error, at most 127 x 2^-150.
    Inputs must be finite (the caller's keys are).

    Returns
    -------
    codes
        (..., D) int8.
    scales
        (...) float32, ``max |x| / 127`` of each row.
    """
    if not x.is_floating_point():
        raise ValueError(f"dtype={x.dtype} is not supported; quantize a float tensor")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dimensional tensor")
    wide = x.float()
    scales = wide.abs().amax(dim=-1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = torch.round(wide / safe).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, scales
