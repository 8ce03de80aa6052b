"""Rebuild keys and values from stored attention inputs (ALISA phase III, recomputation).

The recompute tier keeps, per token, the input of a layer's attention (after the layer norm) and
the RoPE position it was encoded at; K and V come back through the layer's own projections and
rotary embedding, so nothing is forked: the modules of the loaded model do the work. Supported:
separate ``k_proj``/``v_proj`` (Llama, Mistral, Qwen2, OPT, ...; RoPE applied when the base model
has ``rotary_emb``) and GPT-2's fused ``c_attn``.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from alisa.attention import attention_modules


class KVRecomputer:
    """K/V of any tokens of any layer from their attention inputs.

    Parameters
    ----------
    model
        The HF model whose attention modules produced the cache.

    Raises
    ------
    ValueError
        When the attention modules have neither ``k_proj``/``v_proj`` nor ``c_attn``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = attention_modules(model)
        self.rotary = _find_rotary(model)
        first = self.modules[0]
        if hasattr(first, "k_proj") and hasattr(first, "v_proj"):
            self.kind = "separate"
        elif hasattr(first, "c_attn"):
            self.kind = "fused"
        else:
            raise ValueError(
                f"{type(first).__name__} has neither k_proj/v_proj nor c_attn: alisa cannot "
                "recompute its keys and values (use offload only)"
            )
        self.apply_rotary = None
        if self.rotary is not None:
            module = sys.modules[type(first).__module__]
            self.apply_rotary = getattr(module, "apply_rotary_pos_emb", None)
            if self.apply_rotary is None:
                raise ValueError(
                    f"{module.__name__} has rotary embeddings but no apply_rotary_pos_emb"
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
        module = self.modules[layer_idx]
        batch, length, _ = hidden.shape
        head_dim = module.head_dim
        if self.kind == "separate":
            keys, values = module.k_proj(hidden), module.v_proj(hidden)
        else:
            _, keys, values = module.c_attn(hidden).split(module.split_size, dim=2)
        keys = keys.view(batch, length, -1, head_dim).transpose(1, 2)
        values = values.view(batch, length, -1, head_dim).transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary(hidden, position_ids=positions)
            keys, _ = self.apply_rotary(keys, keys, cos, sin)
        return keys, values


def _find_rotary(model: nn.Module) -> nn.Module | None:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and name.split(".")[-2:-1] != ["self_attn"]:
            return module
    return None
