"""A sliding-window layer's prefill attention over the keys each query's window can see.

HF's SDPA path gives a sliding-window layer (Gemma 2/3, Mistral, GPT-OSS...) the full (L, L)
mask, so a prompt of L tokens costs the same L x L products in a layer that sees 512 keys per
query as in a global one: at 8K tokens on a CPU, Gemma-3-270M's fifteen sliding layers were two
thirds of its prefill (4.5 s each against 0.65 s banded). Here the queries go in blocks of
:data:`KEY_BLOCK`, each attending to the keys from the start of the block holding its first
query's window on: the keys left out are masked for every query of the block, so the result is
the same attention (Longformer's banded sliding window, https://arxiv.org/abs/2004.05150).

It is also the same arithmetic where SDPA runs flash attention over key blocks: PyTorch's CPU
kernel adds the keys of a row in blocks of 512 once a row has 512 or more (``kvSplitSize`` in
ATen's ``FlashAttentionKernel.cpp``) with an online softmax, where a fully masked block adds
nothing (its exponentials are 0 and the running maximum stays). A band that starts at a multiple
of 512 therefore adds the same blocks in the same order, and the output is bit-identical to the
full call's (``tests/test_banded.py`` checks it, so a kernel that changes this fails there).
On CUDA the kernels split a row's keys by other rules: on an H200 the banded bfloat16 output
differed from the full call's in 3 % of its elements (float32 matched; docs/gpu.md, sixth run),
so there the full call runs (:func:`alisa.ops.backends.bands_match_sdpa`); a GPU runs it fast.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from alisa.ops.backends import bands_match_sdpa

# Queries per block, and the alignment of each block's first key (see the module docstring).
KEY_BLOCK = 512


def banded_prefill(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int | None,
    *,
    scaling: float | None,
    dropout: float = 0.0,
    **kwargs,
) -> torch.Tensor | None:
    """The prefill attention of a sliding-window layer, block by block, or None where there is
    nothing to leave out (not a sliding layer, no boolean mask, a chunk after a past, a prompt
    shorter than two blocks past the window, a position bias, a query that sees a later key):
    the caller runs the full call.

    Parameters
    ----------
    query
        (B, H, L, D) the prompt's queries.
    key, value
        (B, H_kv, L, D) the prompt's keys and values (no past: a query's position is its index).
    attention_mask
        (B or 1, 1, L, L) HF's boolean sliding-window mask: query p sees no key before
        p - window + 1 (HF's window: positions (p - window, p]).
    window
        The layer's ``sliding_window``.
    scaling, dropout, kwargs
        As :func:`transformers.integrations.sdpa_attention.sdpa_attention_forward` takes them.

    Returns
    -------
    torch.Tensor or None
        (B, L, H, D) the attention output, as SDPA returns it.
    """
    length = query.shape[2]
    if (
        window is None
        or not bands_match_sdpa(query.device)
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or key.shape[2] != length
        or attention_mask.shape[-1] != length
        or length < 2 * KEY_BLOCK + window
        or kwargs.get("position_bias") is not None  # a bias over every key: not sliced here
    ):
        return None
    starts = range(0, length, KEY_BLOCK)
    # The band ends at the block's last query: a mask that shows a query a later key (Gemma 3's
    # bidirectional spans for image tokens, within the window) is left to the full call.
    later = [
        attention_mask[
            ..., start : start + KEY_BLOCK, start + KEY_BLOCK : start + KEY_BLOCK + window
        ]
        for start in starts
    ]
    if torch.stack([block.any() for block in later]).any():
        return None
    outputs = []
    for start in starts:
        stop = min(start + KEY_BLOCK, length)
        # The block's first query sees keys from start - window + 1 on; the later ones, later.
        low = max(0, start - window + 1) // KEY_BLOCK * KEY_BLOCK
        output, _ = sdpa_attention_forward(
            module,
            query[:, :, start:stop],
            key[:, :, low:stop],
            value[:, :, low:stop],
            attention_mask[..., start:stop, low:stop],
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        outputs.append(output)
    return torch.cat(outputs, dim=1)
