"""Tiny seeded random-weight models of any causal-LM family, built from its config class.

The builder starts from the family's config class defaults (``AutoConfig.for_model``), shrinks
every size field the config has (hidden size, layers, heads, KV heads, head_dim, vocab,
intermediate, experts, latent ranks, state sizes...: :data:`SIZES`, by field name), keeps each
layer kind of the default pattern once (``layer_types``), then applies the family's own
overrides. A model that would still be large is refused before any weight is allocated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

# Size fields, set wherever the config has the field (None included: "derive it" often means
# "derive it from the full-size default", e.g. head_dim = hidden_size // heads of a huge model).
SIZES: dict[str, int] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "n_shared_experts": 1,
    # multi-head latent attention (DeepSeek-V2/V3 and kin): head_dim is the rotary part
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": 16,
    # linear attention and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_ssm": 128,
    # per-layer input embeddings (Gemma 3n / 4)
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
}
# Sizes of optional features, shrunk only where the default turns the feature on (and is larger).
OPTIONAL_SIZES: dict[str, int] = {
    "sliding_window": 8,  # prompts and answers outgrow it: the window is exercised
    "attention_chunk_size": 8,
    "max_position_embeddings": 2048,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
}
TOKENS: dict[str, int] = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
# Flags set wherever the config has them: an encoder family's causal LM is its decoder.
FLAGS: dict[str, bool] = {"is_decoder": True}
MAX_PARAMETERS = 20_000_000


def tiny_config(model_type: str, overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """A tiny config of ``model_type``: its class defaults, shrunk, then ``overrides``.

    A composite config (text model plus vision or audio towers) has its text config shrunk.

    Parameters
    ----------
    model_type
        A key of transformers' ``CONFIG_MAPPING`` (``"llama"``, ``"gemma3_text"``, ...).
    overrides
        Fields set last, over the shrunk defaults.

    Raises
    ------
    ValueError
        When ``model_type`` is unknown or its config class rejects the fields.
    """
    config_class = type(AutoConfig.for_model(model_type))
    default = config_class()
    text = default.get_text_config(decoder=True)
    fields = shrunk_fields(default) if text is default else _token_fields(default)
    for name in config_class.sub_configs:  # the text model and any tower, each shrunk
        part = getattr(default, name, None)
        if isinstance(part, PretrainedConfig):
            fields[name] = shrunk_fields(part) | (dict(overrides or {}) if part is text else {})
    if text is default:
        fields |= overrides or {}
    return config_class(**fields)


def shrunk_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The fields that make ``config`` (a default instance) tiny, by field name.

    Names are the config's own (``attribute_map`` resolved: GPT-2's ``n_embd`` for
    ``hidden_size``), so that ``__post_init__`` derives everything else from the tiny sizes.
    """
    fields = {name: value for name, value in {**SIZES, **FLAGS}.items() if _settable(config, name)}
    fields |= {
        name: value
        for name, value in OPTIONAL_SIZES.items()
        if _settable(config, name) and _larger(getattr(config, name), value)
    }
    kinds = getattr(config, "layer_types", None) if _settable(config, "layer_types") else None
    if isinstance(kinds, list) and len(set(kinds)) > 1:
        # Each kind of the default pattern once, in the order first seen.
        fields["layer_types"] = list(dict.fromkeys(kinds))
        fields["num_hidden_layers"] = len(fields["layer_types"])
    fields |= _token_fields(config)
    return {config.attribute_map.get(name, name): value for name, value in fields.items()}


def _larger(default: Any, tiny: int) -> bool:
    return isinstance(default, int) and default > tiny


def _token_fields(config: PretrainedConfig) -> dict[str, int]:
    return {
        name: value
        for name, value in TOKENS.items()
        if _settable(config, name) and getattr(config, name) is not None
    }


def _settable(config: PretrainedConfig, name: str) -> bool:
    """Whether ``config`` has a field ``name`` its constructor takes (not a derived property)."""
    attribute = getattr(type(config), config.attribute_map.get(name, name), None)
    if isinstance(attribute, property) and attribute.fset is None:
        return False
    try:
        getattr(config, name)
    except Exception:  # absent, or a property that refuses (XLNet's unbounded length)
        return False
    return True


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the causal LM built from ``config``, counted without allocating them."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def build_tiny(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` with seeded random weights, in eval mode; EOS is off in its
    generation config (every step is compared) and padding is id 0.

    Raises
    ------
    ValueError
        When the model would have more than :data:`MAX_PARAMETERS` parameters.
    """
    count = parameter_count(config)
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"{type(config).__name__} builds a model of {count:,} parameters, over the "
            f"{MAX_PARAMETERS:,} of a tiny one"
        )
    torch.manual_seed(seed)
    transformers_log = logging.getLogger("transformers")
    level = transformers_log.level
    transformers_log.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        transformers_log.setLevel(level)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = TOKENS["pad_token_id"]
    return model
