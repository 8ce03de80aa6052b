"""``alisa.generate``: batched prefill + decode with the ALISA cache, timed step by step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from alisa.cache import AlisaCache
from alisa.config import AlisaConfig
from alisa.hooks import attached
from alisa.memory import PeakMemory, tensor_bytes

# HF GenerationConfig defaults, used when the model's own generation config leaves them unset.
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How the next token is picked; HF argument names and defaults.

    Parameters
    ----------
    do_sample
        False: greedy (argmax). True: multinomial sampling after temperature, top-k, top-p.
    temperature, top_k, top_p
        As in HF ``generate``; ``None`` takes the model's generation config (HF defaults:
        1.0, 50, 1.0).
    seed
        Seeds a private generator for sampling (the global RNG is untouched); ``None`` uses the
        global RNG, as HF does.
    """

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 0):
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")


@dataclass(kw_only=True)
class GenerationOutput:
    """What one ``generate`` call produced and what it cost.

    Attributes
    ----------
    texts
        Decoded completions (prompt excluded, stopped at EOS).
    token_ids
        Generated token ids per prompt, EOS included when emitted.
    prompt_tokens
        Prompt length in tokens per prompt (padding excluded).
    finish_reasons
        ``"stop"`` (EOS) or ``"length"`` (max_new_tokens reached) per prompt.
    ttft_s
        Time to first token: prefill plus picking the first token, seconds.
    step_times_s
        Wall time of each later decode step, seconds.
    kv_bytes, peak_kv_bytes
        KV bytes the cache held at the end, and at most after any step.
    peak_memory_bytes
        Peak resident memory of the process (CPU) or peak CUDA allocation (GPU) during the call.
    """

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: list[int]
    finish_reasons: list[str]
    ttft_s: float
    step_times_s: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    peak_kv_bytes: int = 0
    peak_memory_bytes: int = 0

    @property
    def generated_tokens(self) -> int:
        """Tokens generated over all prompts."""
        return sum(len(ids) for ids in self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the decode steps after the first token (all sequences)."""
        decode_time = sum(self.step_times_s)
        later_tokens = self.generated_tokens - len(self.token_ids)
        return later_tokens / decode_time if decode_time > 0 else 0.0

    @property
    def total_s(self) -> float:
        """Prefill plus decode time."""
        return self.ttft_s + sum(self.step_times_s)


def cache_kv_bytes(cache) -> int:
    """KV bytes held by an ALISA cache or any HF cache (quantized layers' packed data included)."""
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        total += tensor_bytes((layer.keys, layer.values))
        for name in ("_quantized_keys", "_quantized_values"):
            total += _nested_bytes(getattr(layer, name, None))
    return total


def _nested_bytes(value, depth: int = 3) -> int:
    """Bytes of the tensors inside a backend's quantized object (quanto/hqq/fp8 layouts differ)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.nbytes
    # Tensor subclasses (quanto's QTensor) report their logical size: count what they wrap.
    if depth == 0 or value is None:
        return 0
    if isinstance(value, tuple | list):
        return sum(_nested_bytes(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return sum(_nested_bytes(v, depth - 1) for v in value.values())
    inner = getattr(value, "__dict__", None)
    return sum(_nested_bytes(v, depth - 1) for v in inner.values()) if inner else 0


@torch.inference_mode()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: str | Sequence[str],
    config: AlisaConfig | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingOptions | None = None,
    past_key_values=None,
    prune_finished: bool = False,
    stop_at_eos: bool = True,
) -> GenerationOutput:
    """Generate completions for a batch of prompts with the ALISA cache.

    Parameters
    ----------
    model, tokenizer
        From :func:`alisa.load_model` or any HF causal LM and its tokenizer.
    prompts
        One prompt or a list; different lengths are left-padded into one batch.
    config
        KV policy and storage (default: dense, every token kept).
    max_new_tokens
        Tokens to generate per prompt (>= 0); a sequence also stops at EOS.
    sampling
        Greedy by default; see :class:`SamplingOptions`.
    past_key_values
        A ready cache to use instead of a new ``AlisaCache`` (e.g. HF ``DynamicCache`` to compare).
    stop_at_eos
        False generates exactly ``max_new_tokens`` per prompt (benchmarks of equal work).
    prune_finished
        Drop sequences from the batch once they emit EOS (faster for batch jobs; the remaining
        rows then run in a smaller batch, which can change float rounding).

    Returns
    -------
    GenerationOutput
        Texts, token ids, TTFT, per-step times, KV bytes and peak memory.
    """
    prompt_list = _check_prompts(prompts)
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    sampling = sampling or SamplingOptions()
    device = next(model.parameters()).device
    batch = tokenizer(prompt_list, return_tensors="pt", padding=True).to(device)
    cache = past_key_values
    if cache is None:
        cache = AlisaCache(model, config, max_new_tokens=max_new_tokens)
    decoder = _Decoder(model, tokenizer, sampling, device, stop_at_eos)
    with attached(model), PeakMemory(device) as memory:  # the model's attention is restored
        result = decoder.run(
            batch["input_ids"], batch["attention_mask"], cache, max_new_tokens, prune_finished
        )
    result.peak_memory_bytes = memory.peak_bytes
    return result


def _check_prompts(prompts: str | Sequence[str]) -> list[str]:
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompt_list:
        raise ValueError("prompts=[] is empty; give at least one prompt")
    for index, prompt in enumerate(prompt_list):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompts[{index}]={prompt!r} is empty or not a string")
    return prompt_list


class _Decoder:
    """The prefill/decode loop of one call; kept apart so ``generate`` stays a thin front."""

    def __init__(
        self, model, tokenizer, sampling: SamplingOptions, device: torch.device, stop_at_eos: bool
    ):
        self.model, self.tokenizer, self.sampling, self.device = model, tokenizer, sampling, device
        self.processors = _warpers(model, sampling)
        self.generator = None
        if sampling.do_sample and sampling.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_ids = eos_ids if stop_at_eos else []
        self.eos = torch.tensor(eos_ids, device=device, dtype=torch.long)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)

    def run(
        self, input_ids, attention_mask, cache, max_new_tokens: int, prune: bool = False
    ) -> GenerationOutput:
        batch = input_ids.shape[0]
        prompt_tokens = attention_mask.sum(dim=1).tolist()
        generated = torch.full(
            (batch, max_new_tokens), self.pad, dtype=torch.long, device=self.device
        )
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        active = torch.arange(batch, device=self.device)  # original row of each batch row
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        step_times, peak_kv, ttft, steps = [], 0, 0.0, 0
        feed, feed_positions = input_ids, positions
        for step in range(max_new_tokens):
            start = self._clock()
            logits = self.model(
                input_ids=feed,
                attention_mask=attention_mask,
                position_ids=feed_positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
            tokens = self._pick(input_ids, logits)
            tokens = torch.where(finished, self.pad, tokens)
            generated[active, step] = tokens
            finished |= torch.isin(tokens, self.eos)
            elapsed = self._clock() - start
            if step == 0:
                ttft = elapsed
            else:
                step_times.append(elapsed)
            steps = step + 1
            peak_kv = max(peak_kv, cache_kv_bytes(cache))
            if bool(finished.all()):
                break
            if prune and bool(finished.any()):
                # Drop finished sequences: later steps only compute for the others.
                keep = (~finished).nonzero(as_tuple=True)[0]
                cache.batch_select_indices(keep)
                active, finished, tokens = active[keep], finished[keep], tokens[keep]
                input_ids, attention_mask = input_ids[keep], attention_mask[keep]
                feed_positions = feed_positions[keep]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1
            )
            feed, feed_positions = tokens[:, None], feed_positions[:, -1:] + 1
        return self._output(
            generated[:, :steps], prompt_tokens, ttft, step_times, cache, peak_kv, max_new_tokens
        )

    def _pick(self, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.sampling.do_sample:
            return logits.argmax(dim=-1)
        scores = self.processors(sequences, logits.float())
        probabilities = scores.softmax(dim=-1)
        return torch.multinomial(probabilities, 1, generator=self.generator).squeeze(1)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _output(self, generated, prompt_tokens, ttft, step_times, cache, peak_kv, limit):
        token_ids, texts, reasons = [], [], []
        eos = set(self.eos.tolist())
        for row in generated.tolist():
            stop = next((i for i, token in enumerate(row) if token in eos), None)
            kept = row if stop is None else row[: stop + 1]
            token_ids.append(kept)
            text_ids = kept if stop is None else kept[:-1]
            texts.append(self.tokenizer.decode(text_ids, skip_special_tokens=True))
            reasons.append("stop" if stop is not None else "length")
        return GenerationOutput(
            texts=texts,
            token_ids=token_ids,
            prompt_tokens=[int(n) for n in prompt_tokens],
            finish_reasons=reasons,
            ttft_s=ttft,
            step_times_s=step_times,
            kv_bytes=cache_kv_bytes(cache),
            peak_kv_bytes=peak_kv,
        )


def _warpers(model, sampling: SamplingOptions) -> LogitsProcessorList:
    """Temperature, top-k, top-p in HF's order, with the model's defaults where unset."""
    defaults = model.generation_config

    def option(name: str):
        value = getattr(sampling, name)
        if value is None:
            value = getattr(defaults, name, None)
        return HF_SAMPLING_DEFAULTS[name] if value is None else value

    temperature, top_k, top_p = option("temperature"), option("top_k"), option("top_p")
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers
