"""What the runtime needs to know about a model, and a clear error when it is not supported.

:class:`ModelAdapter` inspects a model once (attention modules in layer order, geometry, rotary
embedding, key/value projections, softmax scales); the cache, the recomputer and
:func:`alisa.kv.attention.attach` read it instead of probing the model themselves.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike

import torch
from torch import nn

from alisa.model.routing import INLINE_ATTENTION, routing_reason


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Attention geometry of a decoder-only model.

    Attributes
    ----------
    num_layers, num_heads, num_kv_heads, head_dim, hidden_size
        As in the HF config (``num_kv_heads == num_heads`` for multi-head attention).
    windows
        Per layer, the sliding window W of a ``sliding_attention`` layer, None for a full one
        (empty: every layer full).
    extras
        What the attention adds to a plain softmax (:func:`attention_extras`), e.g.
        ``("soft-capping",)``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    windows: tuple[int | None, ...] = ()
    extras: tuple[str, ...] = ()

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window W (None: full attention)."""
        return self.windows[layer_idx] if self.windows else None

    @property
    def hybrid(self) -> bool:
        """Whether any layer is a sliding-window layer."""
        return any(window is not None for window in self.windows)

    @property
    def kv_values_per_token(self) -> int:
        """Key plus value elements one token costs across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


# Layer kinds (transformers' ``layer_types``) whose attention the ALISA cache reproduces exactly.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# What the other kinds of transformers' cache layers hold, for the refusal's message.
LAYER_KIND_NOTES = {
    "linear_attention": "a recurrent or state-space state instead of keys and values",
    "conv": "a convolution state instead of keys and values",
    "hybrid": "attention and a recurrent state in one layer",
    "hybrid_sliding": "windowed attention and a recurrent state in one layer",
    "chunked_attention": "attention within fixed chunks of the sequence",
    "indexed_attention": "keys the model's own indexer selects",
    "dummy": "no cache of their own: another layer's keys and values, or no attention",
}
# Config fields that must be one value for every layer (one head size, one KV head count).
GEOMETRY_FIELDS = ("head_dim", "num_attention_heads", "num_key_value_heads", "hidden_size")


def model_shape(model: nn.Module) -> ModelShape:
    """Read the attention geometry from a model and check the runtime supports it.

    Every reason a model cannot run exactly is found here, when the cache is built, never at a
    later forward (:func:`unsupported_reason`). A composite model (a text decoder with vision or
    audio towers) is read from its text config.

    Raises
    ------
    ValueError
        Naming what is missing: a decoder-only config, one self-attention module per layer
        reached through HF's attention interface and handed the cache, per-head keys and values.
    """
    check_model(model)
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; alisa supports decoder-only models")
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{name} is not supported: {reason}")
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
    windows = layer_windows(model)
    return ModelShape(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        windows=windows if any(window is not None for window in windows) else (),
        extras=attention_extras(attention_modules(model)[0]),
    )


def check_model(model: object) -> None:
    """Refuse what is not a Hugging Face torch model before anything reads its modules or config.

    Raises
    ------
    ValueError
        Naming ``model``: not a ``torch.nn.Module``, or one without an HF config.
    """
    if not isinstance(model, nn.Module):
        shown = repr(model)
        if len(shown) > 80:  # a tokenizer's repr runs to kilobytes: its type says enough
            shown = f"<{type(model).__name__} ...>"
        hint = " (load_model returns one)"
        if isinstance(model, str | bytes | PathLike):  # a name or path: not loaded yet
            hint = f"; load it first: model, tokenizer = alisa.load_model({str(model)!r})"
        elif callable(getattr(model, "encode", None)):  # a tokenizer where the model goes
            hint = "; it looks like a tokenizer: pass the model here (load_model returns both)"
        raise ValueError(f"model={shown} must be a torch model{hint}")
    if getattr(model, "config", None) is None:
        raise ValueError(f"model of type {type(model).__name__} has no HF config")


def meta_parameters(model: nn.Module) -> int:
    """How many of ``model``'s parameters have no data (accelerate's meta placeholders)."""
    return sum(1 for parameter in model.parameters() if parameter.is_meta)


def check_loaded(model: nn.Module) -> None:
    """Refuse a model whose weights are not loaded: parameters on the meta device (built under
    ``torch.device("meta")``, or left on disk by a ``device_map``) cannot run. (A model's shape
    alone, as ``alisa plan`` reads it, needs no weights: only what runs checks this.)

    Raises
    ------
    ValueError
        Naming the model's type and how many parameters have no data.
    """
    unloaded = meta_parameters(model)
    if unloaded:
        raise ValueError(
            f"model of type {type(model).__name__} has {unloaded} parameters on the meta device: "
            "its weights are not loaded (built under torch.device('meta'), or offloaded to "
            "disk by a device_map); load them first (alisa.load_model)"
        )


def check_model_and_tokenizer(model: object, tokenizer: object) -> None:
    """:func:`check_model` and :func:`check_loaded`, and a callable tokenizer (the two
    swapped are named as such).

    Raises
    ------
    ValueError
        Naming ``model`` or ``tokenizer``.
    """
    check_model(model)
    check_loaded(model)
    if not callable(tokenizer):
        raise ValueError(f"tokenizer={tokenizer!r} must be an HF tokenizer (as load_model gives)")


def layer_types(model: nn.Module) -> list[str]:
    """Each layer's attention kind as transformers' own ``DynamicCache`` sees it
    (``full_attention``, ``sliding_attention``, ``linear_attention``, ...)."""
    return list(_layer_kinds(model)[0])


def layer_windows(model: nn.Module) -> tuple[int | None, ...]:
    """Per layer, the sliding window W of a ``sliding_attention`` layer, else None (as
    transformers' ``DynamicCache`` sizes its ``DynamicSlidingWindowLayer``)."""
    kinds, options = _layer_kinds(model)
    return tuple(
        option.get("sliding_window") if kind == "sliding_attention" else None
        for kind, option in zip(kinds, options, strict=True)
    )


def _layer_kinds(model: nn.Module) -> tuple[list[str], list[dict]]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run exactly with the ALISA cache, or None when it can.

    Checked without running the model (https://huggingface.co/docs/transformers/attention_interface):
    attention must go through transformers' attention interface (the ``alisa`` function then
    sees every query), every layer must be full or sliding-window attention of one geometry,
    the cache must receive per-head keys and values (not multi-head latent attention's latents),
    each layer must have one self-attention module, handed the cache, that gives the attention
    function the cache's keys and values and transformers' mask
    (:func:`alisa.model.routing.routing_reason`).
    """
    config = model.config.get_text_config(decoder=True)
    if not type(model)._can_set_attn_implementation():
        return INLINE_ATTENTION
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        parts = ", ".join(getattr(type(config), "sub_configs", None) or ())
        return (
            f"its config has no num_hidden_layers{f' (its layers are in {parts})' if parts else ''}"
            "; alisa needs one stack of decoder layers"
        )
    kinds = sorted({kind for kind in layer_types(model) if kind not in SUPPORTED_LAYER_TYPES})
    if kinds:
        described = ", ".join(
            f"{kind} ({LAYER_KIND_NOTES[kind]})" if kind in LAYER_KIND_NOTES else kind
            for kind in kinds
        )
        return (
            f"it has layers of kind {described}; alisa runs full-attention and sliding-window "
            "attention layers"
        )
    rank = getattr(config, "kv_lora_rank", None)
    if rank:
        return (
            f"it caches multi-head latent attention latents (kv_lora_rank={rank}), not per-head "
            "keys and values"
        )
    per_layer = set(getattr(config, "per_layer_attributes", None) or ())
    varying = sorted(per_layer & set(GEOMETRY_FIELDS))
    if varying:
        return (
            f"its layers differ in {', '.join(varying)} (a per-layer config); alisa needs one "
            "attention geometry for every layer"
        )
    return _modules_reason(attention_modules(model), layers)


def _modules_reason(modules: list[nn.Module], layers: int) -> str | None:
    """What in the attention modules alisa cannot follow, or None."""
    if not modules:
        return (
            "it has no attention layers (a recurrent or state-space model): no keys and values "
            "reach a cache"
        )
    cross = sorted(
        {module.layer_idx for module in modules if "CrossAttention" in type(module).__name__}
    )
    if cross:
        return (
            f"layers {cross} cross-attend to another input's states (e.g. image features), "
            "which the cache holds instead of the tokens' keys and values"
        )
    if len(modules) != layers:
        return (
            f"found {len(modules)} attention modules with a layer_idx for {layers} layers; "
            "alisa needs one self-attention module per layer"
        )
    for module_class in dict.fromkeys(type(module) for module in modules):
        reason = routing_reason(module_class)
        if reason is not None:
            return reason
    return None


def attention_extras(module: nn.Module) -> tuple[str, ...]:
    """What an attention module's call adds to softmax(q k^T * scale): ``"soft-capping"``
    (Gemma 2: ``softcap``) and ``"learned sinks"`` (GPT-OSS: ``s_aux``, one logit per query head).

    alisa's attention applies both (the keyword arguments reach it); the multi-process paths,
    which compute attention themselves, refuse models that use them.
    """
    source = inspect.getsource(type(module).forward)
    extras = []
    if "softcap=" in source and getattr(module, "attn_logit_softcapping", None) is not None:
        extras.append("soft-capping")
    if "s_aux=" in source and getattr(module, "sinks", None) is not None:
        extras.append("learned sinks")
    return tuple(extras)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a model's text decoder, in layer order (a vision or audio
    tower's are not the cache's)."""
    modules = [m for m in _decoder(model).modules() if _is_attention_module(m)]
    return sorted(modules, key=lambda m: m.layer_idx)


def _decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a (composite) model; the model itself when it names no decoder model
    (``get_decoder`` of a masked-LM family returns its output layer)."""
    from transformers import PreTrainedModel

    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, PreTrainedModel) else model


def _is_attention_module(module: nn.Module) -> bool:
    named = type(module).__name__.endswith("Attention")
    return named and isinstance(getattr(module, "layer_idx", None), int)


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
