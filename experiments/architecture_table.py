"""Every decoder family of transformers' causal-LM auto mapping, and what alisa owes it.

Each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is a row, built tiny from its config
class (:mod:`experiments.tiny_models`; :data:`OVERRIDES` where the generic shrink does not build
a model that shows the family's attention), unless :data:`NOT_RUN` says why it cannot be (an
encoder-decoder model, a drafter that needs its target model, a wrapper whose tower needs a
library alisa does not install or does not build small); :data:`VARIANTS` add configs that
matter (sliding windows on and off). A row owes ``EXACT`` (token-identical to HF's greedy
``generate`` at r = 1 in every mode) unless :data:`REFUSED` lists it under the reason its
refusal must name when the cache is built. A model type a new transformers release adds is a
row owing ``EXACT``: it fails until it is exact, or listed here with the reason alisa gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from experiments.tiny_models import build_tiny, tiny_config

EXACT = "exact"

# Why a family is refused: a part of the message alisa raises when the cache is built.
INLINE = "computes attention inline"
LINEAR = "linear_attention (a recurrent or state-space state"
CONV = "conv (a convolution state"
HYBRID = "hybrid (attention and a recurrent state in one layer)"
CHUNKED = "chunked_attention (attention within fixed chunks"
INDEXED = "indexed_attention (keys the model's own indexer selects)"
COMPRESSED = "compressed_sparse_attention"
SHARED_KV = "dummy (no cache of their own"
MLA = "multi-head latent attention latents"
PER_LAYER_GEOMETRY = "its layers differ in head_dim"
NO_ATTENTION = "it has no attention layers"
SUB_MODELS = "its config has no num_hidden_layers"
MODULE_PER_LAYER = "alisa needs one self-attention module per layer"
CROSS_ATTENTION = "cross-attend to another input's states"
TWO_CALLS = "calls the attention function 2 times per layer"
OWN_MASK = "builds its own attention mask"

REFUSED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        INLINE: (
            *("big_bird", "bloom", "codegen", "cpmant", "falcon", "git", "got_ocr2", "gpt_neo"),
            *("gpt_neox_japanese", "gptj", "megatron-bert", "mpt", "openai-gpt", "reformer"),
            *("rembert", "roformer", "rwkv", "trocr", "xglm", "xlm", "xlnet"),
        ),
        LINEAR: (
            *("bailing_hybrid", "bamba", "falcon_mamba", "granitemoehybrid", "jamba"),
            *("kimi_linear", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid"),
            *("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"),
            "recurrent_gemma",
        ),
        CONV: ("lfm2", "lfm2_moe", "lfm3"),
        HYBRID: ("falcon_h1", "inkling2_text", "inkling_text", "zamba", "zamba2", "zaya"),
        CHUNKED: ("llama4", "llama4_text"),
        INDEXED: (
            *("axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4", "qwen4_exp"),
            "qwen4_exp_text",
        ),
        COMPRESSED: ("deepseek_v4",),
        SHARED_KV: ("gemma3n_text",),
        MLA: (
            *("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash"),
            *("minicpm3", "youtu"),
        ),
        PER_LAYER_GEOMETRY: ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"),
        NO_ATTENTION: ("xlstm",),
        SUB_MODELS: ("blt",),
        MODULE_PER_LAYER: ("hrm_text",),
        CROSS_ATTENTION: ("mllama",),
        TWO_CALLS: ("diffllama",),
        OWN_MASK: ("doge",),
    }
)

# Why a model type of the mapping is not a row.
ENCODER_DECODER = "an encoder-decoder model (its causal LM is the decoder half)"
DRAFTER = (
    "a speculative-decoding drafter: it attends to its target model's keys and values "
    "(shared_kv_states) and does not generate alone"
)
NOT_RUN: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                *("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian"),
                *("mbart", "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart"),
                *("prophetnet", "whisper"),
            ),
            ENCODER_DECODER,
        ),
        "dots3_note": (
            "a multimodal wrapper whose mixture-of-experts vision tower does not build at tiny "
            "sizes; its text decoder is the dots3_note_text row"
        ),
        "gemma3n": (
            "a multimodal wrapper whose vision tower needs the timm library, which alisa does "
            "not install; its text decoder is the gemma3n_text row"
        ),
        "gemma4_assistant": DRAFTER,
        "gemma4_unified_assistant": DRAFTER,
    }
)

# Fields over the generic shrink, only where it does not build a model that shows the family.
CONV_LAYERS = ["conv", "full_attention"]
DOTS3_WINDOW_LAYERS = {
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4,
    "swa_q_lora_rank": 16,
    "swa_kv_lora_rank": 16,
    "swa_head_dim": 32,
    "swa_qk_nope_head_dim": 16,
    "swa_v_head_dim": 16,
}
QWEN4_INDEXER = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    "ngram_vocab_size_base": 512,
}
OVERRIDES: Mapping[str, Mapping] = MappingProxyType(
    {
        # Default configs that do not build a model in transformers 5.23.
        "cohere_compass_text": {
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
        },
        "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0}},
        "lfm2_moe": {"layer_types": CONV_LAYERS},
        "qwen4_exp": QWEN4_INDEXER,
        "qwen4_exp_text": QWEN4_INDEXER,
        "xmod": {"default_language": "en_XX"},
        # Layer patterns that two layers cannot show.
        "gemma3_text": {  # several sliding layers per full one, as Gemma 3's 5:1
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
        "gemma3n_text": {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "activation_sparsity_pattern": [0.0] * 4,
        },
        "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
        "jamba": {
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 4,
        },
        "lfm2": {"layer_types": CONV_LAYERS},  # its default makes every layer attention
        "mllama": {"cross_attention_layers": [1]},  # its layers that see image features
        "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
        "zamba": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2},
        # Fields the shrink does not know by name.
        "blt": {"encoder_hash_byte_group_vocab": 512},
        "dots3_note_text": DOTS3_WINDOW_LAYERS,
        "mamba2": {"num_heads": 8},
        "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [32, 64]},
        "roc_bert": {"shape_vocab_size": 512, "pronunciation_vocab_size": 512},
        "xlnet": {"d_head": 16},
        "zaya": {"num_experts_per_tok": 1},
    }
)


@dataclass(frozen=True, kw_only=True)
class Family:
    """A config to build and the outcome alisa owes it.

    Attributes
    ----------
    model_type
        A key of transformers' ``CONFIG_MAPPING``.
    expected
        ``EXACT``, or a part of the refusal's message naming the reason.
    fields
        Config fields over the generic tiny shrink.
    """

    model_type: str
    expected: str = EXACT
    fields: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_type or not self.expected:
            raise ValueError(f"Family needs a model_type and an expected outcome: {self!r}")


# Configs that matter besides each family's default (sliding windows on and off).
VARIANTS: Mapping[str, Family] = MappingProxyType(
    {
        # A window that no layer uses is full attention (Qwen2's max_window_layers, as Dots1's).
        "qwen2-window-unused": Family(
            model_type="qwen2",
            fields={"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        ),
        "qwen2-window": Family(
            model_type="qwen2",
            fields={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        ),
        "mistral-no-window": Family(model_type="mistral", fields={"sliding_window": None}),
        "gemma2-all-full": Family(
            model_type="gemma2", fields={"layer_types": ["full_attention"] * 2}
        ),
        "gemma3_text-all-full": Family(
            model_type="gemma3_text",
            fields={"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2},
        ),
    }
)


def expected_outcome(model_type: str) -> str:
    """What alisa owes a model type: ``EXACT`` or the reason its refusal names."""
    reasons = [reason for reason, types in REFUSED.items() if model_type in types]
    return reasons[0] if reasons else EXACT


def families(model_types: tuple[str, ...] | None = None) -> dict[str, Family]:
    """Every row: each model type of the causal-LM mapping not in :data:`NOT_RUN` (named by
    its model type), then :data:`VARIANTS`.

    Parameters
    ----------
    model_types
        The mapping's model types (default: transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
    """
    model_types = model_types or tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = {
        model_type: Family(
            model_type=model_type,
            expected=expected_outcome(model_type),
            fields=OVERRIDES.get(model_type, {}),
        )
        for model_type in model_types
        if model_type not in NOT_RUN
    }
    return {**rows, **VARIANTS}


FAMILIES: Mapping[str, Family] = MappingProxyType(families())


def build(family: Family, seed: int = 0) -> torch.nn.Module:
    """The family's tiny seeded model in eval mode (EOS off, padding id 0)."""
    return build_tiny(tiny_config(family.model_type, family.fields), seed=seed)
