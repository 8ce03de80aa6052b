"""Rebuild keys and values from stored attention inputs (ALISA phase III, recomputation).

The recompute tier keeps, per token, the input of a layer's attention (after the layer norm) and
the RoPE position it was encoded at; K and V come back through the layer's own projections and
rotary embedding, so nothing is forked: the modules of the loaded model do the work. Supported:
separate ``k_proj``/``v_proj`` (Llama, Mistral, Qwen2, OPT, ...; RoPE applied when the base model
has ``rotary_emb``) and GPT-2's fused ``c_attn`` (see :class:`~alisa.model.adapter.ModelAdapter`).
"""

from __future__ import annotations

import torch
from torch import nn

from alisa.model.adapter import ModelAdapter


class KVRecomputer:
    """K/V of any tokens of any layer from their attention inputs.

    Parameters
    ----------
    model
        The HF model whose attention modules produced the cache.
    adapter
        Its :class:`~alisa.model.adapter.ModelAdapter`, when already built.

    Raises
    ------
    ValueError
        When the attention modules have neither ``k_proj``/``v_proj`` nor ``c_attn``, or the
        model has rotary embeddings without ``apply_rotary_pos_emb``.
    """

    def __init__(self, model: nn.Module, *, adapter: ModelAdapter | None = None) -> None:
        self.adapter = adapter or ModelAdapter.of(model)
        self.modules = self.adapter.modules
        first = self.modules[0]
        if self.adapter.projection is None:
            raise ValueError(
                f"{type(first).__name__} has neither k_proj/v_proj nor c_attn: alisa cannot "
                "recompute its keys and values (use offload only)"
            )
        if self.adapter.rotary is not None and self.adapter.apply_rotary is None:
            raise ValueError(
                f"{type(first).__module__} has rotary embeddings but no apply_rotary_pos_emb"
            )

    @torch.no_grad()
    def __call__(
        self, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H_kv, n, D) of n tokens.

        Parameters
        ----------
        hidden
            (B, n, hidden) attention inputs, as the layer received them.
        positions
            (B, n) RoPE positions the tokens were encoded at.
        """
        keys, values = self.adapter.project_kv(layer_idx, hidden)
        if self.adapter.rotary is not None:
            cos, sin = self.adapter.rotary(hidden, position_ids=positions)
            keys, _ = self.adapter.apply_rotary(keys, keys, cos, sin)
        return keys, values
