"""What the runtime needs to know about a model, and a clear error when it is not supported."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from alisa.attention import attention_modules


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Attention geometry of a decoder-only model.

    Attributes
    ----------
    num_layers, num_heads, num_kv_heads, head_dim, hidden_size
        As in the HF config (``num_kv_heads == num_heads`` for multi-head attention).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def kv_values_per_token(self) -> int:
        """Key plus value elements one token costs across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def model_shape(model: nn.Module) -> ModelShape:
    """Read the attention geometry from a model and check the runtime supports it.

    Raises
    ------
    ValueError
        Naming what is missing: a decoder-only config, one full-attention module per layer
        reached through HF's attention interface, no sliding-window or linear-attention layers.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model of type {type(model).__name__} has no HF config")
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; alisa supports decoder-only models")
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    missing = [
        field
        for field, value in (
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("hidden_size", hidden),
        )
        if not isinstance(value, int)
    ]
    if missing:
        raise ValueError(f"{name} config lacks {', '.join(missing)}")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(config, "sliding_window", None) and _uses_sliding_window(config):
        kinds = ", ".join(other) if other else "sliding_attention"
        raise ValueError(
            f"{name} has non-full-attention layers ({kinds}); "
            "alisa needs full attention in every layer"
        )
    modules = attention_modules(model)
    if len(modules) != layers:
        raise ValueError(
            f"{name}: found {len(modules)} attention modules with a layer_idx for {layers} layers; "
            "alisa needs one self-attention module per layer that calls HF's attention interface"
        )
    return ModelShape(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
    )


def _uses_sliding_window(config) -> bool:
    # Mistral-style configs carry sliding_window; Qwen2 keeps it but disables it by a flag.
    return getattr(config, "use_sliding_window", True)
