"""Which decoder families alisa runs exactly, and why it refuses the others (README table).

    python -m tests.architectures                   # markdown table, then one JSON line
    python -m tests.architectures --families llama,bloom
    python -m tests.architectures --write docs/supported-models.md   # the doc, every row

Each model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is a row (:data:`FAMILIES`)
unless :data:`NOT_RUN` says why not; :data:`VARIANTS` add configs that matter (sliding windows on
and off). A row is built tiny from its config class with seeded random weights
(:func:`tiny_config`, then :data:`OVERRIDES`). It owes ``EXACT`` (see :data:`DOC_INTRO`) unless
:data:`REFUSED` lists it under the reason its refusal must name when the cache is built; anything
else fails ``tests/test_architectures.py``. The table groups the rows by outcome.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Size fields, set wherever the config has the field (None included: "derive it" often means
# "derive it from the full-size default", e.g. head_dim = hidden_size // heads of a huge model).
SIZES: dict[str, int] = {
    "vocab_size": 512,
    "hidden_size": 64,
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size"), 128),
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    # mixtures of experts
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_top_k"), 2),
    "n_shared_experts": 1,
    # multi-head latent attention (DeepSeek-V2/V3 and kin): head_dim is the rotary part
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 16),
    "qk_head_dim": 32,
    "v_head_dim": 16,
    # linear attention and state-space layers
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads"), 2),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "mamba_d_state"), 16),
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
    """A tiny config of ``model_type`` (a key of transformers' ``CONFIG_MAPPING``): its class
    defaults, shrunk, then ``overrides``. A composite config (text model plus vision or audio
    towers) has each part shrunk, ``overrides`` applied to its text config.

    Raises
    ------
    ValueError
        When ``model_type`` is unknown or its config class rejects the fields.
    """
    config_class = type(AutoConfig.for_model(model_type))
    default = config_class()
    text = default.get_text_config(decoder=True)
    fields = _shrunk(default) if text is default else _token_fields(default)
    for name in config_class.sub_configs:
        part = getattr(default, name, None)
        if isinstance(part, PretrainedConfig):
            fields[name] = _shrunk(part) | (dict(overrides or {}) if part is text else {})
    if text is default:
        fields |= overrides or {}
    return config_class(**fields)


def _shrunk(config: PretrainedConfig) -> dict[str, Any]:
    """The fields that make ``config`` (a default instance) tiny, named as the config names them
    (GPT-2's ``n_embd`` for ``hidden_size``) so that it derives everything else from them."""
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


def build_tiny(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` with seeded random weights, in eval mode; EOS is off in its
    generation config (every step is compared) and padding is id 0.

    Raises
    ------
    ValueError
        When the model would have more than :data:`MAX_PARAMETERS` parameters.
    """
    with torch.device("meta"):  # counted before any weight is allocated
        count = AutoModelForCausalLM.from_config(config).num_parameters()
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"{type(config).__name__} builds a model of {count:,} parameters, over the "
            f"{MAX_PARAMETERS:,} of a tiny one"
        )
    torch.manual_seed(seed)
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        log.setLevel(level)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = TOKENS["pad_token_id"]
    return model


EXACT = "exact"
# Why a family is refused: a part of the message alisa raises when the cache is built.
REFUSED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "computes attention inline": (
            *("big_bird", "bloom", "codegen", "cpmant", "falcon", "git", "got_ocr2", "gpt_neo"),
            *("gpt_neox_japanese", "gptj", "megatron-bert", "mpt", "openai-gpt", "reformer"),
            *("rembert", "roformer", "rwkv", "trocr", "xglm", "xlm", "xlnet"),
        ),
        "linear_attention (a recurrent or state-space state": (
            *("bailing_hybrid", "bamba", "falcon_mamba", "granitemoehybrid", "jamba"),
            *("kimi_linear", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid"),
            *("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"),
            "recurrent_gemma",
        ),
        "conv (a convolution state": ("lfm2", "lfm2_moe", "lfm3"),
        "hybrid (attention and a recurrent state in one layer)": (
            *("falcon_h1", "inkling2_text", "inkling_text", "zamba", "zamba2", "zaya"),
        ),
        "chunked_attention (attention within fixed chunks": ("llama4", "llama4_text"),
        "indexed_attention (keys the model's own indexer selects)": (
            *("axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4", "qwen4_exp"),
            "qwen4_exp_text",
        ),
        "compressed_sparse_attention": ("deepseek_v4",),
        "dummy (no cache of their own": ("gemma3n_text",),
        "multi-head latent attention latents": (
            *("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash"),
            *("minicpm3", "youtu"),
        ),
        "its layers differ in head_dim": (
            *("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"),
        ),
        "it has no attention layers": ("xlstm",),
        "its config has no num_hidden_layers": ("blt",),
        "alisa needs one self-attention module per layer": ("hrm_text",),
        "cross-attend to another input's states": ("mllama",),
        "calls the attention function 2 times per layer": ("diffllama",),
        "builds its own attention mask": ("doge",),
        "after the cache returns them": ("jetmoe",),
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
    """A row: the config to build (a key of transformers' ``CONFIG_MAPPING`` and fields over the
    generic tiny shrink) and the outcome alisa owes it (``EXACT``, or a part of the refusal's
    message naming the reason)."""

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


def families(model_types: tuple[str, ...] | None = None) -> dict[str, Family]:
    """Every row: each of ``model_types`` (default: transformers' causal-LM mapping) not in
    :data:`NOT_RUN`, named by its model type, then :data:`VARIANTS`."""
    rows = {}
    for model_type in model_types or tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        reasons = [reason for reason, types in REFUSED.items() if model_type in types]
        fields = OVERRIDES.get(model_type, {})
        if model_type not in NOT_RUN:
            rows[model_type] = Family(
                model_type=model_type, expected=reasons[0] if reasons else EXACT, fields=fields
            )
    return {**rows, **VARIANTS}


FAMILIES: Mapping[str, Family] = MappingProxyType(families())


def build(family: Family, seed: int = 0) -> torch.nn.Module:
    """The family's tiny seeded model in eval mode (EOS off, padding id 0)."""
    return build_tiny(tiny_config(family.model_type, family.fields), seed=seed)


STATUSES = (EXACT, "refused", "crash", "differs", "not built")  # see Outcome
MODES: Mapping[str, Mapping] = MappingProxyType(
    {
        "drop": {},
        # An unreached token budget: host retention runs (every token in the host region,
        # the sketch written) yet nothing leaves the device. At r = 1 the policy could evict
        # nothing, so the cache dropped instead and the mode tested nothing of its own.
        "host": {"policy": "swa", "budget_tokens": 10_000, "retention": "host"},
        "int8": {"kv_bits": 8, "residual_tokens": 64},
    }
)
NEW_TOKENS = 6
PROMPT_LENGTHS = (12, 7)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What happened to one row (``model``: the class built, "" when none was): ``status``
    ``EXACT``, ``"refused"`` (a ValueError when the cache is built), ``"crash"`` (after it, or
    at it with anything but a ValueError), ``"differs"`` (silently) or ``"not built"`` (the tiny
    model or HF's own ``generate`` on it failed: no judgement); ``detail``: the refusal's reason,
    the error, or the modes that differ."""

    family: str
    model: str
    status: str
    detail: str = ""

    def owed(self, family: Family) -> bool:
        """Whether this is the outcome ``family`` is owed."""
        if family.expected == EXACT:
            return self.status == EXACT
        return self.status == "refused" and family.expected in self.detail


def prompts(
    seed: int = 1, lengths: tuple[int, ...] = PROMPT_LENGTHS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded random token ids (3..511: no pad, EOS or BOS) and their mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, 512, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def run_family(
    name: str, family: Family, new_tokens: int = NEW_TOKENS, device: str | torch.device = "cpu"
) -> Outcome:
    """Build one row's model on ``device``, then each mode's exactness or the refusal's reason."""
    from alisa import AlisaCache, AlisaConfig

    try:
        model = build(family).to(device)
    except Exception as error:  # the config or its modeling code: the row cannot be judged
        return Outcome(family=name, model="", status="not built", detail=_error(error))
    row = {"family": name, "model": type(model).__name__}
    try:
        caches = {mode: AlisaCache(model, AlisaConfig(**fields)) for mode, fields in MODES.items()}
    except ValueError as error:
        return Outcome(**row, status="refused", detail=str(error).split(": ", 1)[-1])
    except Exception as error:
        return Outcome(**row, status="crash", detail=f"at construction: {_error(error)}")
    ids, mask = (tensor.to(device) for tensor in prompts())
    options = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=mask)
    with torch.inference_mode():
        try:
            reference = model.generate(ids, **options)
        except Exception as error:
            return Outcome(**row, status="not built", detail=f"HF's generate: {_error(error)}")
        differs = []
        for mode, cache in caches.items():
            try:
                tokens = model.generate(ids, past_key_values=cache, **options)
            except Exception as error:
                return Outcome(**row, status="crash", detail=f"{mode}: {_error(error)}")
            unseen = _layers_missing_tokens(cache, ids.shape[1] + new_tokens - 1)
            if not torch.equal(tokens, reference) or unseen:
                differs.append(mode + (f" (layers {unseen} missed tokens)" if unseen else ""))
    if differs:
        return Outcome(**row, status="differs", detail=", ".join(differs))
    return Outcome(**row, status=EXACT)


def _layers_missing_tokens(cache, tokens: int) -> list[int]:
    """Cache layers that did not see all ``tokens`` (the model bypassed them)."""
    return [index for index, layer in enumerate(cache.layers) if layer.get_seq_length() != tokens]


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def table(outcomes: list[Outcome], not_run: Mapping[str, str]) -> list[str]:
    """Markdown lines: a count line, then the rows grouped by outcome (largest group first),
    the model types not run last."""
    groups: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.status == EXACT:
            label = "exact at r = 1 (drop / host / INT8)"
        elif outcome.status == "refused":
            label = f"refused: {outcome.detail}"
        else:
            label = f"**{outcome.status}**: {outcome.detail}"
        groups.setdefault(label, []).append(outcome.family)
    for model_type, reason in not_run.items():
        groups.setdefault(f"not run: {reason}", []).append(model_type)
    counts = {status: sum(o.status == status for o in outcomes) for status in STATUSES}
    summary = ", ".join(f"{count} {status}" for status, count in counts.items())
    lines = [
        f"{len(outcomes)} rows (transformers {transformers.__version__}): {summary}; "
        f"{len(not_run)} model types not run.",
        "",
        "| outcome | families |",
        "|---|---|",
    ]
    for label, names in sorted(groups.items(), key=lambda g: (g[0][:7] == "not run", -len(g[1]))):
        lines.append(f"| {label} ({len(names)}) | {', '.join(f'`{n}`' for n in sorted(names))} |")
    return lines


def rows_table(outcomes: list[Outcome]) -> list[str]:
    """Markdown lines: one table row per family, in name order."""
    lines = ["| family | model class | outcome |", "|---|---|---|"]
    for outcome in sorted(outcomes, key=lambda outcome: outcome.family):
        cell = outcome.status if outcome.status == EXACT else f"{outcome.status}: {outcome.detail}"
        model = f"`{outcome.model}`" if outcome.model else ""
        lines.append(f"| `{outcome.family}` | {model} | {cell} |")
    return lines


DOC_INTRO = """\
# Supported models

Generated by `python -m tests.architectures --write docs/supported-models.md` (transformers
{transformers}, torch {torch}); `tests/test_architectures.py` asserts every row.

Each row is a model type of transformers' causal-LM auto mapping (or a variant of one: sliding
windows on and off), built tiny from its config class with seeded random weights
(`tests/architectures.py`). **Exact** means
token-identical to the model's own greedy `generate` at r = 1 on a left-padded batch of 2, in
drop, host-retention (at an unreached token budget) and INT8 modes, with every cache layer having
seen every token. Any other
family is **refused** with a `ValueError` when the `AlisaCache` is built, naming the reason;
a crash after construction or a silent difference fails the test. A model type a new
transformers release adds is a row owed exactness: it fails until alisa runs it exactly or
refuses it with its reason.
"""


def document(outcomes: list[Outcome], not_run: Mapping[str, str]) -> str:
    """The supported-models doc: the grouped table, then every row."""
    intro = DOC_INTRO.format(transformers=transformers.__version__, torch=torch.__version__)
    parts = [intro, "## By outcome", "", *table(outcomes, not_run), "", "## Row by row", ""]
    return "\n".join([*parts, *rows_table(outcomes), ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=None, help="comma list (default: all)")
    parser.add_argument("--write", default=None, metavar="PATH", help="also write the doc here")
    args = parser.parse_args(argv)
    names = args.families.split(",") if args.families else sorted(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {', '.join(sorted(FAMILIES))}")
    outcomes = [run_family(name, FAMILIES[name]) for name in names]
    not_run = {} if args.families else dict(NOT_RUN)
    print("\n".join(table(outcomes, not_run)))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(document(outcomes, not_run))
    rows = [asdict(outcome) for outcome in outcomes]
    print(json.dumps({"benchmark": "architectures", "rows": rows, "not_run": not_run}))


if __name__ == "__main__":
    main()
