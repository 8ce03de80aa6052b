"""What the runtime needs to know about a model, and a clear error when it is not supported.

:class:`ModelAdapter` inspects a model once (attention modules in layer order, geometry, rotary
embedding, key/value projections, softmax scales); the cache, the recomputer and
:func:`alisa.kv.hooks.attach` read it instead of probing the model themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


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


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a model, in layer order."""
    modules = [m for m in model.modules() if _is_attention_module(m)]
    return sorted(modules, key=lambda m: m.layer_idx)


def _is_attention_module(module: nn.Module) -> bool:
    return hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention")


@dataclass(frozen=True, eq=False)
class ModelAdapter:
    """One inspection of a supported model: what the runtime reads from it.

    Attributes
    ----------
    shape
        Attention geometry (checked supported).
    modules
        The self-attention modules, in layer order.
    scalings
        Softmax scale of each layer's attention.
    rotary
        The base model's rotary embedding module, or None (learned positions, as GPT-2).
    apply_rotary
        The modeling file's ``apply_rotary_pos_emb`` (None without rotary or when missing).
    projection
        How K/V are projected from an attention input: ``"separate"`` (``k_proj``/``v_proj``),
        ``"fused"`` (GPT-2's ``c_attn``), or None (unknown: K/V cannot be recomputed).
    """

    shape: ModelShape
    modules: tuple[nn.Module, ...]
    scalings: tuple[float, ...]
    rotary: nn.Module | None
    apply_rotary: Callable | None
    projection: str | None

    @classmethod
    def of(cls, model: nn.Module) -> ModelAdapter:
        """Inspect ``model`` (raises ValueError as :func:`model_shape` when unsupported)."""
        shape = model_shape(model)
        modules = tuple(attention_modules(model))
        first = modules[0]
        projection = None
        if hasattr(first, "k_proj") and hasattr(first, "v_proj"):
            projection = "separate"
        elif hasattr(first, "c_attn"):
            projection = "fused"
        rotary = _find_rotary(model)
        apply_rotary = None
        if rotary is not None:
            apply_rotary = getattr(
                sys.modules[type(first).__module__], "apply_rotary_pos_emb", None
            )
        scalings = tuple(getattr(m, "scaling", shape.head_dim**-0.5) for m in modules)
        return cls(
            shape=shape,
            modules=modules,
            scalings=scalings,
            rotary=rotary,
            apply_rotary=apply_rotary,
            projection=projection,
        )

    def project_kv(self, layer_idx: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values (B, H_kv, n, D) of attention inputs (B, n, hidden)."""
        module = self.modules[layer_idx]
        batch, length, _ = hidden.shape
        if self.projection == "separate":
            keys, values = module.k_proj(hidden), module.v_proj(hidden)
        else:
            _, keys, values = module.c_attn(hidden).split(module.split_size, dim=2)
        head_dim = self.shape.head_dim
        keys = keys.view(batch, length, -1, head_dim).transpose(1, 2)
        values = values.view(batch, length, -1, head_dim).transpose(1, 2)
        return keys, values


def _find_rotary(model: nn.Module) -> nn.Module | None:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and name.split(".")[-2:-1] != ["self_attn"]:
            return module
    return None


def _uses_sliding_window(config) -> bool:
    # Mistral-style configs carry sliding_window; Qwen2 keeps it but disables it by a flag.
    return getattr(config, "use_sliding_window", True)
