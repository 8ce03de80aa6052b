"""Which decoder families alisa runs exactly, and why it refuses the others (README table).

    python -m experiments.architectures            # markdown table, then one JSON line

One entry per family (or per variant of a family's config): the model type, the config fields
that make a tiny seeded random-weight model of it, and what alisa owes it, ``EXACT``
(token-identical to HF's greedy ``generate`` at r = 1 in drop, host and INT8 modes) or the words
of its refusal when the cache is built. ``tests/test_architectures.py`` asserts every row; this
script runs the same models and reports what happened, refusals quoted.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

EXACT = "exact"
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)
INLINE = "computes attention inline"
LINEAR = "layers of kind linear_attention"
WINDOW = {"sliding_window": 8}
UNSET = object()  # a field of TINY the family's config does not take
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Family:
    """A config to build and the outcome alisa owes it."""

    model_type: str
    expected: str = EXACT
    fields: dict = field(default_factory=dict)


FAMILIES = {
    "llama": Family("llama"),
    "gpt2": Family("gpt2"),
    "opt": Family("opt"),
    "phi": Family("phi"),
    "phi3": Family("phi3"),
    "stablelm": Family("stablelm"),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "mixtral": Family("mixtral", fields={"num_local_experts": 2, "num_experts_per_tok": 1}),
    "olmo2": Family("olmo2"),
    "granite": Family("granite"),
    "cohere": Family("cohere"),
    "glm4": Family("glm4"),
    "smollm3": Family("smollm3"),
    "starcoder2": Family("starcoder2"),
    # The cache reaches attention as `layer_past` (GPTBigCode: one KV head, multi-query).
    "gpt_neox": Family("gpt_neox"),
    "gpt_bigcode": Family("gpt_bigcode"),
    "ctrl": Family("ctrl"),
    # A window that no layer uses is full attention (Qwen2's max_window_layers, as Dots1's default).
    "qwen2-window-unused": Family(
        "qwen2", fields={"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}
    ),
    "mistral-no-window": Family("mistral", fields={"sliding_window": None}),
    "gemma3-all-full": Family("gemma3_text", fields={"layer_types": ["full_attention"] * 2}),
    # Refused at construction, with the true reason.
    "falcon": Family("falcon", INLINE, {"head_dim": UNSET}),
    "bloom": Family("bloom", INLINE),
    "mpt": Family("mpt", INLINE),
    "gptj": Family("gptj", INLINE, {"rotary_dim": 8}),
    "codegen": Family("codegen", INLINE, {"rotary_dim": 8}),
    "gpt_neo": Family(
        "gpt_neo", INLINE, {"attention_types": [[["global", "local"], 1]], "num_layers": 2}
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        "multi-head latent attention",
        {
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "head_dim": 8,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            **MOE,
        },
    ),
    # Sliding-window layers keep HF's window exactly (8 tokens: prompts and answers outgrow it).
    "mistral": Family("mistral", fields=WINDOW),
    "ministral": Family("ministral", fields=WINDOW),
    "qwen2-window": Family(
        "qwen2", fields={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    ),
    "gemma3": Family(
        "gemma3_text",
        fields={
            **WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
    "cohere2": Family("cohere2", fields=WINDOW),
    # Gemma 2's logit soft-capping and GPT-OSS's learned sinks, applied by alisa's attention.
    "gemma2-all-full": Family("gemma2", fields={"layer_types": ["full_attention"] * 2}),
    "gemma2": Family("gemma2", fields=WINDOW),
    "gpt_oss": Family(
        "gpt_oss", fields={"num_local_experts": 2, "num_experts_per_tok": 1, **WINDOW}
    ),
    "olmo3": Family("olmo3", fields=WINDOW),
    "exaone4": Family("exaone4", fields=WINDOW),
    "jamba": Family(
        "jamba",
        LINEAR,
        {
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 4,
            "num_experts": 2,
        },
    ),
    "qwen3_next": Family("qwen3_next", LINEAR, {"num_hidden_layers": 4, "num_experts": 2, **MOE}),
}


def build(family: Family, seed: int = 0):
    """The family's tiny model in eval mode, its generation config's pad/eos set."""
    options = {**TINY, **family.fields}
    options = {key: value for key, value in options.items() if value is not UNSET}
    config = type(AutoConfig.for_model(family.model_type))(**options)
    torch.manual_seed(seed)
    quiet = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        logging.getLogger("transformers").setLevel(quiet)
    model.generation_config.eos_token_id = TINY["eos_token_id"]
    model.generation_config.pad_token_id = TINY["pad_token_id"]
    return model


MODES = {
    "drop": {},
    "host": {"policy": "swa", "caching_ratio": 1.0, "retention": "host"},
    "int8": {"kv_bits": 8, "residual_tokens": 64},
}


def prompts(seed: int = 1, lengths: tuple[int, ...] = (12, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded random token ids and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), TINY["pad_token_id"], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(
            2, TINY["vocab_size"], (length,), generator=generator
        )
        mask[row, width - length :] = 1
    return ids, mask


def outcome(name: str, family: Family, new_tokens: int = 6) -> dict:
    """Run one family: each mode's exactness, or the refusal's message."""
    from alisa import AlisaCache, AlisaConfig

    model = build(family)
    ids, mask = prompts()
    options = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=mask)
    row = {"family": name, "model": type(model).__name__}
    try:
        caches = {mode: AlisaCache(model, AlisaConfig(**fields)) for mode, fields in MODES.items()}
    except ValueError as error:
        return {**row, "supported": False, "reason": str(error).split(": ", 1)[-1]}
    with torch.inference_mode():
        reference = model.generate(ids, **options)
        exact = {
            mode: bool(
                torch.equal(model.generate(ids, past_key_values=cache, **options), reference)
            )
            for mode, cache in caches.items()
        }
    return {**row, "supported": True, "exact": exact}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=None, help="comma list (default: all)")
    args = parser.parse_args(argv)
    names = args.families.split(",") if args.families else sorted(FAMILIES)
    rows = [outcome(name, FAMILIES[name]) for name in names]
    print("| family | model class | exact at r = 1 (drop / host / INT8) or why refused |")
    print("|---|---|---|")
    for row in rows:
        if row["supported"]:
            cell = " / ".join("yes" if row["exact"][mode] else "**NO**" for mode in MODES)
        else:
            cell = f"refused: {row['reason']}"
        print(f"| {row['family']} | `{row['model']}` | {cell} |")
    print(json.dumps({"benchmark": "architectures", "rows": rows}))


if __name__ == "__main__":
    main()
