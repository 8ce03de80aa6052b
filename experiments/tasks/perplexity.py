"""The WikiText-2 tasks: perplexity in the decode regime, attention statistics, batch throughput.

Perplexity feeds tokens one by one, the KV policy active at every step, under one of two
protocols (:data:`PROTOCOLS`): ``streaming`` compresses from the first token, as ALISA measures
accuracy (its sparse mask applies to every row); ``prefill`` feeds the first part of each segment
densely, compresses it to the budget, then scores the rest token by token, as H2O's lm-eval
simulation and kvpress's benchmarks do. A one-shot prefill over the whole text would hide the
policy, since prefill attention is dense. The attention statistics are ALISA's motivation
figures (Fig. 3 sparsity, Fig. 4 Spearman), from full attention matrices: the model runs once
with HF's eager attention and ``output_attentions`` (then switches back).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from alisa import AlisaCache, AlisaConfig
from alisa.model.adapter import model_shape
from alisa.settings import evicts_nothing_note
from experiments import data
from experiments.extras import bench_module

PROTOCOLS = ("streaming", "prefill")
# The caches the throughput task can run its batch job with (sweep.system).
THROUGHPUT_SYSTEMS = ("alisa", "hf-dynamic", "hf-quantized")


def check_throughput_system(system: str) -> None:
    """Refuse a ``sweep.system`` the throughput task cannot run (a ValueError naming it)."""
    if system not in THROUGHPUT_SYSTEMS:
        valid = ", ".join(THROUGHPUT_SYSTEMS)
        raise ValueError(f"system={system!r} is unknown to throughput; valid: {valid}")


@dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """Mean negative log-likelihood over the scored tokens and its exponential."""

    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def text_segments(tokenizer, text: str, segment_tokens: int, segments: int) -> torch.Tensor:
    """(segments, segment_tokens) token ids: consecutive windows from the start of the text."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    needed = segment_tokens * segments
    if ids.numel() < needed:
        raise ValueError(
            f"text has {ids.numel()} tokens; {segments} segments of {segment_tokens} need {needed}"
        )
    return ids[:needed].view(segments, segment_tokens)


def protocol_prefill(protocol: str, length: int, prefill_share: float = 0.5) -> int:
    """Tokens of a segment fed as the first (dense) call under ``protocol``: 1 for
    ``streaming``; for ``prefill``, the first ``prefill_share`` of the segment.

    Raises
    ------
    ValueError
        An unknown protocol, or a share outside (0, 1).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is unknown; valid: {', '.join(PROTOCOLS)}")
    if protocol == "streaming":
        return 1
    if not 0.0 < prefill_share < 1.0:
        raise ValueError(f"prefill_share={prefill_share!r} must be in (0, 1)")
    return min(max(1, round(length * prefill_share)), length - 1)


@torch.inference_mode()
def decode_perplexity(
    model,
    segments: torch.Tensor,
    config: AlisaConfig,
    *,
    prefill_tokens: int = 1,
    progress: bool = True,
) -> PerplexityResult:
    """Mean NLL over the B * (L - P) predictions of tokens P .. L-1 of the (B, L) ``segments``
    (one batch): the first P = ``prefill_tokens`` are fed in one call (dense attention, then
    compressed to the budget; 1 is the streaming protocol), then one token per step, the
    ``config``'s policy active throughout (its budget is round(n * r) of the n seen);
    ``progress``: a progress bar of the steps.

    Raises
    ------
    ValueError
        ``prefill_tokens`` outside [1, L - 1].
    """
    device = next(model.parameters()).device
    segments = segments.to(device)
    batch, length = segments.shape
    if not 1 <= prefill_tokens < length:
        raise ValueError(f"prefill_tokens={prefill_tokens!r} must be in [1, {length - 1}]")
    note = evicts_nothing_note(config, model_shape(model).num_layers, length)
    if note is not None:  # a result equal to dense must not pass for the policy's
        print(f"experiments: warning: {note}", file=sys.stderr)
    cache = AlisaCache(model, config)
    total = torch.zeros((), dtype=torch.float64, device=device)
    steps = [0, *range(prefill_tokens, length - 1)]
    label = f"ppl {config.policy} r={config.caching_ratio:g}"
    for start in tqdm(steps, desc=label, disable=not progress, leave=False):
        stop = prefill_tokens if start == 0 else start + 1
        logits = model(
            input_ids=segments[:, start:stop],
            position_ids=torch.arange(start, stop, device=device).expand(batch, -1),
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        nll = torch.nn.functional.cross_entropy(logits.float(), segments[:, stop], reduction="sum")
        total += nll.double()
    count = batch * (length - prefill_tokens)
    return PerplexityResult(nll=float(total) / count, tokens=count)


def _segments(context, options: dict, rows: int, task: str) -> torch.Tensor:
    """(rows, segment_tokens) WikiText-2 windows; the errors name the task's options."""
    length = options.get("segment_tokens", 512)
    _check_context(context, length, f"options.{task}.segment_tokens={length}")
    text = data.load_wikitext2(context.data_root)
    try:
        return text_segments(context.tokenizer, text, length, rows)
    except ValueError as error:
        rows_from = "sweep.batch" if task == "perplexity" else "one segment"
        raise ValueError(
            f"{error} (options.{task}.segment_tokens={length}, rows from {rows_from}): lower "
            "them or give a longer wikitext2 test file"
        ) from None


def _check_context(context, tokens: int, what: str) -> None:
    """Refuse ``tokens`` past the model's context (positions past it are garbage), naming the
    option that asked for them."""
    from alisa.model.loading import check_prompt_length

    check_prompt_length(context.model, context.tokenizer, tokens, f" ({what})")


def perplexity(context, point: dict, options: dict) -> dict:
    """The ``perplexity`` task: under the point's ``protocol`` (a sweep key; else the option,
    else ``streaming``), named in the row with the tokens it prefilled."""
    segments = _segments(context, options, point.get("batch", 2), "perplexity")
    protocol = point.get("protocol", options.get("protocol", "streaming"))
    prefill = protocol_prefill(protocol, segments.shape[1], options.get("prefill_share", 0.5))
    result = decode_perplexity(
        context.model, segments, context.config, prefill_tokens=prefill, progress=False
    )
    return {
        "perplexity": result.perplexity,
        "nll": result.nll,
        "tokens": result.tokens,
        "protocol": protocol,
        "prefill_tokens": prefill,
    }


@torch.inference_mode()
def attention_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """(H, L, L) float32 attention probabilities of each layer for one (1, L) prompt."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids.to(next(model.parameters()).device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return [a[0].float().cpu() for a in out.attentions]


def attention_sparsity(context, point: dict, options: dict) -> dict:
    """Per layer and on average: the share of causal attention weights below ``threshold`` x
    their row's maximum."""
    threshold = options.get("threshold", 0.01)
    per_layer, segment = [], _segments(context, options, 1, "attention_sparsity")
    for attention in attention_maps(context.model, segment):
        length = attention.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        row_max = attention.amax(dim=-1, keepdim=True)
        small = (attention < threshold * row_max) & causal
        per_layer.append(float(small.sum() / (causal.sum() * attention.shape[0])))
    return {"per_layer": per_layer, "mean": sum(per_layer) / len(per_layer)}


def spearman(context, point: dict, options: dict) -> dict:
    """Spearman rho of predicted vs actual token importance, averaged over layers and the last
    ``rows`` rows. Actual importance of the tokens before step n is row n of the heads-summed
    attention. Predictions: ``local`` ranks by recency, ``strided`` puts every stride-th token
    first (stride round(2 / r - 1)), ``swa`` sums the attention rows of the last k = round(n r /
    2) steps (ALISA's local sum), r = ``ratio``."""
    spearmanr = bench_module("scipy.stats").spearmanr
    ratio, rows = options.get("ratio", 0.2), options.get("rows", 32)
    stride = max(1, round(2 / ratio - 1))
    scores = {"local": [], "strided": [], "swa": []}
    for attention in attention_maps(context.model, _segments(context, options, 1, "spearman")):
        summed = attention.sum(dim=0).numpy()  # (L, L)
        length = summed.shape[0]
        for n in range(length - rows, length):
            actual = summed[n, :n]
            window = max(1, round(n * ratio / 2))
            predictions = {
                "local": np.arange(n, dtype=float),
                "strided": (np.arange(n) % stride == 0) * 1e6 + np.arange(n),
                "swa": summed[max(0, n - window) : n, :n].sum(axis=0),
            }
            for name, predicted in predictions.items():
                rho = spearmanr(predicted, actual).statistic
                if np.isfinite(rho):
                    scores[name].append(rho)
    return {name: float(np.mean(values)) for name, values in scores.items()}


def throughput(context, point: dict, options: dict) -> dict:
    """Generated tokens/s of `alisa batch` under a fixed KV byte budget (``system``: the cache)."""
    from transformers import DynamicCache, QuantizedCache

    from alisa import BatchJob, run_batch
    from alisa.sizes import parse_bytes
    from experiments.worker import windows_of_length

    batch, tokens = point.get("batch", 8), options.get("prompt_tokens", 128)
    new_tokens = options.get("new_tokens", 64)
    what = f"options.throughput.prompt_tokens={tokens} and new_tokens={new_tokens}"
    _check_context(context, tokens + new_tokens, what)
    count = batch * options.get("waves", 2)
    ids = context.tokenizer(data.load_wikitext2(context.data_root))["input_ids"]
    if (available := len(ids) - tokens + 1) < count:
        raise ValueError(
            f"sweep.batch={batch} x options.throughput.waves={options.get('waves', 2)} needs "
            f"{count} different prompts of {tokens} tokens; the wikitext2 text gives {available}"
        )
    prompts = windows_of_length(context.tokenizer, ids, tokens, count)
    kv_budget = parse_bytes(options.get("kv_budget", "128MiB"))
    system = point.get("system", "alisa")
    check_throughput_system(system)  # as the config was checked: before any work
    factories = {
        "alisa": None,
        "hf-dynamic": DynamicCache,
        "hf-quantized": lambda: QuantizedCache(
            backend="quanto", config=context.model.config, nbits=4
        ),
    }
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "in.jsonl"
        source.write_text(
            "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts))
        )
        job = BatchJob(
            input=str(source),
            output=str(Path(folder) / "out.jsonl"),
            config=context.config,
            kv_memory=kv_budget,
            max_new_tokens=new_tokens,
            max_batch=batch,
            stop_at_eos=False,
            progress=False,
        )
        summary = run_batch(context.model, context.tokenizer, job, cache_factory=factories[system])
    if summary.did_not_fit:  # a rate of the prompts that did fit would be no figure of the budget
        raise ValueError(
            f"{len(summary.did_not_fit)} of {count} prompts do not fit options.throughput."
            f"kv_budget={options.get('kv_budget', '128MiB')} even alone "
            f"({summary.errors[summary.did_not_fit[0]]['error']}); raise it or lower "
            "options.throughput.prompt_tokens"
        )
    return {
        "tokens_per_s": summary.tokens_per_s,
        "largest_batch": max(summary.batches, default=0),
        "batches": len(summary.batches),
        "ttft_s": summary.mean_ttft_s,
        "peak_kv_bytes": summary.peak_kv_bytes,
        "peak_memory_bytes": summary.peak_memory_bytes,
        "kv_budget_bytes": kv_budget,
    }
