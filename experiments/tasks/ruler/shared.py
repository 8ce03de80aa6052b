"""The runner's ``ruler`` and ``ruler_cost`` tasks (RULER: https://arxiv.org/abs/2404.06654).

``ruler`` runs the points of one (model, family, length, batch) that differ only in their system
together. Every system's prefill is the same dense attention and a long prompt's prefill is most
of a sample's CPU time (SmolLM2, 8K tokens: 28 s against about 3 s of decoding), so it runs once:
the ``alisa_fanout`` attention hands each layer's (query, key, value) to every cache. Each system
then decodes alone from the shared logits, token-identical to ``alisa.generate``
(``tests/test_ruler.py``). ``ruler_cost``: one system alone in a fresh process
(:mod:`experiments.worker`), for peak memory and speed.
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from alisa import AlisaCache, AlisaConfig
from alisa.kv.attention import LogitOptions, alisa_attention, attached, prefill_layer
from alisa.memory import PeakMemory
from alisa.runtime.engine import (
    DecodeState,
    Engine,
    GenerationOutput,
    cache_kv_bytes,
    device_clock,
)
from alisa.settings import IgnoredSettingWarning
from experiments.data import load_text
from experiments.systems import HF_QUANTIZED, make_cache, parse_alisa, point_overrides, system_name
from experiments.tasks.ruler.families import (
    Haystack,
    Sample,
    generate_samples,
    string_match_all,
    uses_chat,
)
from experiments.tasks.ruler.options import RulerOptions

FANOUT_ATTENTION = "alisa_fanout"
FANOUT_KEYWORD = "fanout_caches"
PREDICTION_CHARS = 200  # what a row keeps of each prediction (enough to see why it failed)


def fanout_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Dense prefill attention (B, q, H, D) that also fills every cache in
    ``kwargs["fanout_caches"]`` with this layer's (B, H_kv, q, D) keys and values."""
    caches = kwargs.pop(FANOUT_KEYWORD, None) or []
    options = LogitOptions.take(dict(kwargs))  # alisa_attention takes its own copy from kwargs
    window = kwargs.get("sliding_window")
    output, _ = alisa_attention(
        module, query, key, value, attention_mask, scaling, dropout, **kwargs
    )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    for cache in caches:
        if not isinstance(cache, AlisaCache):
            cache.update(key, value, module.layer_idx)
            continue
        layer = cache.layers[module.layer_idx]
        if window != layer.keeper.window:
            raise ValueError(
                f"layer {module.layer_idx} attends with sliding_window={window!r} but its cache "
                f"keeps window={layer.keeper.window!r}"
            )
        layer.update(key, value)
        prefill_layer(layer, query, key, attention_mask, scaling, options)
    return output, None


AttentionInterface.register(FANOUT_ATTENTION, fanout_attention)
AttentionMaskInterface.register(FANOUT_ATTENTION, sdpa_mask)


def _is_alisa(system: str) -> bool:
    return system == "alisa" or system.startswith("alisa:")


def _overridden(config: AlisaConfig, overrides: dict | None) -> AlisaConfig:
    """``config`` with the sweep's fields: quietly, as the runner builds its points' configs (a
    sweep crosses every system with every value by design; the base config's floor given to the
    dense system is not a mistake)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredSettingWarning)
        return config.with_overrides(**(overrides or {}))


def check_system(system: str, overrides: dict | None = None) -> None:
    """Refuse (a ValueError naming it), before any work, a system :func:`system_cache` would
    refuse: an unknown one, AlisaConfig ``overrides`` for an HF cache, or device/host tiers."""
    if _is_alisa(system):
        config = _overridden(parse_alisa(system), overrides)
        if config.gpu_memory is not None or config.host_memory is not None:
            raise ValueError(
                f"system {system_name(config)!r}: gpu_memory/host_memory tiers are not measured "
                "by the shared prefill (a tier that recomputes needs each layer's attention "
                "input, which it does not hand over); leave them out"
            )
    elif system != "hf-dynamic" and system not in HF_QUANTIZED:
        raise ValueError(
            f"unknown system {system!r}; use hf-dynamic, {', '.join(HF_QUANTIZED)} or alisa:..."
        )
    elif overrides:
        raise ValueError(
            f"system {system!r} is an HF cache: AlisaConfig fields {sorted(overrides)} do not "
            "apply to it (name alisa systems in sweep.system instead)"
        )


def system_cache(system: str, model, *, max_new_tokens: int, overrides: dict | None = None):
    """An empty cache for ``system`` (an :mod:`experiments.systems` name), AlisaConfig fields in
    ``overrides`` applied to an ``alisa`` one; refused as :func:`check_system` refuses."""
    check_system(system, overrides)
    cache, config = make_cache(system, model)
    if config is None:
        return cache
    config = _overridden(config, overrides)
    return AlisaCache(model, config, max_new_tokens=max_new_tokens)


def system_label(system: str, overrides: dict | None = None) -> str:
    """The canonical name of a system (``hf-...`` as given, an ``alisa`` one with every
    non-default field, overrides applied) that :func:`system_cache` reads back."""
    if not _is_alisa(system):
        return system
    return system_name(parse_alisa(system).with_overrides(**(overrides or {})))


@torch.inference_mode()
def shared_prefill(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, caches: Sequence[Cache]
) -> tuple[torch.Tensor, float]:
    """Prefill (B, L) ``input_ids`` once into every empty cache of ``caches``: ((B, V) logits
    of the last prompt position, seconds of the forward pass)."""
    state = DecodeState.start(input_ids, attention_mask)
    previous = model.config._attn_implementation
    device = input_ids.device
    model.set_attn_implementation(FANOUT_ATTENTION)
    try:
        start = device_clock(device)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=state.positions,
            use_cache=False,
            logits_to_keep=1,
            **{FANOUT_KEYWORD: list(caches)},
        ).logits[:, -1, :]
        return logits, device_clock(device) - start
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def decode_after_prefill(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache,
    logits: torch.Tensor,
    *,
    max_new_tokens: int,
    prefill_s: float = 0.0,
    prune: bool = False,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """Greedy decode from a prefilled ``cache`` and its prefill's (B, V) ``logits``, as
    :func:`alisa.generate` decodes (EOS stops a row; step times, KV bytes per tier, peak memory
    of the decode). ``prune``: finished rows leave the batch (``generate(prune_finished=True)``).
    ``observe``: shown each step's (B, V) logits before its tokens are chosen."""
    engine = Engine(model, tokenizer)
    state = DecodeState.start(input_ids, attention_mask)
    with attached(model), PeakMemory(input_ids.device) as memory:
        result = engine.run(
            state,
            cache,
            max_new_tokens,
            prune=prune,
            prefill_logits=logits,
            prefill_s=prefill_s,
            observe=observe,
        )
    result.peak_memory_bytes = memory.peak_bytes
    return result


@dataclass
class Tally:
    """One system's outcomes over the samples of a (family, length)."""

    system: str
    records: list[dict] = field(default_factory=list)
    device_bytes: list[float] = field(default_factory=list)
    host_bytes: list[float] = field(default_factory=list)
    peak_kv_bytes: float = 0.0
    later_tokens: int = 0
    decode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)

    def add(self, chunk: list[Sample], result: GenerationOutput, held: dict[str, int]) -> None:
        """Score one batch's predictions; count the KV bytes ``held`` per tier after its prefill
        (per sequence) and its decode steps."""
        rows = len(chunk)
        for sample, text, generated in zip(chunk, result.texts, result.token_ids, strict=True):
            self.records.append(
                {
                    "index": sample.index,
                    "score": string_match_all(text, sample.references),
                    "depths": [round(d, 4) for d in sample.depths],
                    "prompt_tokens": len(sample.input_ids),
                    "new_tokens": len(generated),
                    "references": list(sample.references),
                    "prediction": text[:PREDICTION_CHARS],
                }
            )
        self.device_bytes += [held.get("device", 0) / rows] * rows
        self.host_bytes += [held.get("host", 0) / rows] * rows
        self.peak_kv_bytes = max(self.peak_kv_bytes, result.peak_kv_bytes / rows)
        self.later_tokens += result.generated_tokens - rows
        self.decode_s += sum(result.step_times_s)
        self.step_s += result.step_times_s

    def metrics(self) -> dict:
        scores = [r["score"] for r in self.records]
        median = statistics.median(self.step_s) if self.step_s else None
        return {
            "system": self.system,
            "score": sum(scores) / len(scores),
            "samples": len(scores),
            "kv_device_bytes": sum(self.device_bytes) / len(self.device_bytes),
            "kv_host_bytes": sum(self.host_bytes) / len(self.host_bytes),
            "peak_kv_bytes": self.peak_kv_bytes,
            "decode_tokens_per_s": self.later_tokens / self.decode_s if self.decode_s else 0.0,
            "decode_s": round(self.decode_s, 3),
            # The median step is robust to a step slowed by other work (the mean is not).
            "median_step_ms": round(1000 * median, 3) if median is not None else None,
            # Timings depend on what else runs: the 1-minute load average when this ended.
            "load_average": round(os.getloadavg()[0], 2),
            "per_sample": self.records,
        }


def evaluate_systems(
    model,
    tokenizer,
    samples: list[Sample],
    systems: list[tuple[str, dict]],
    *,
    batch: int = 1,
    progress: bool = False,
) -> tuple[list[dict], float]:
    """Each system's :meth:`Tally.metrics` on ``samples`` (``batch`` per shared prefill) and the
    seconds of the shared prefills; ``systems``: (name, AlisaConfig overrides) each."""
    tallies = [Tally(system=system_label(name, extra)) for name, extra in systems]
    prefill_total = 0.0
    chunks = [samples[i : i + batch] for i in range(0, len(samples), batch)]
    for chunk in tqdm(chunks, desc="ruler", unit="batch", disable=not progress, leave=False):
        input_ids, mask = _padded(tokenizer, chunk, next(model.parameters()).device)
        new_tokens = max(sample.new_tokens for sample in chunk)
        caches = [
            system_cache(name, model, max_new_tokens=new_tokens, overrides=extra)
            for name, extra in systems
        ]
        logits, prefill_s = shared_prefill(model, input_ids, mask, caches)
        prefill_total += prefill_s
        for index, tally in enumerate(tallies):
            cache, caches[index] = caches[index], None  # freed once decoded
            # KV bytes per tier before finished rows leave a batch (an HF cache: the device).
            held = (
                cache.tier_bytes()
                if isinstance(cache, AlisaCache)
                else {"device": cache_kv_bytes(cache), "host": 0}
            )
            # A batch decodes until its longest answer: finished rows leave it, as in alisa batch.
            result = decode_after_prefill(
                model,
                tokenizer,
                input_ids,
                mask,
                cache,
                logits,
                max_new_tokens=new_tokens,
                prune=len(chunk) > 1,
            )
            tally.add(chunk, result, held)
    return [tally.metrics() for tally in tallies], prefill_total


def _padded(
    tokenizer, chunk: list[Sample], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) left-padded ids and their mask (None for one sample: nothing is padded)."""
    if len(chunk) == 1:
        return torch.tensor([chunk[0].input_ids], device=device), None
    ids = {"input_ids": [sample.input_ids for sample in chunk]}
    batch = tokenizer.pad(ids, padding_side="left", return_tensors="pt")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def ruler_points(context, points: list[dict], options: dict) -> list[dict]:
    """The ``ruler`` task for points that differ only in their system: one metrics dict each."""
    settings = RulerOptions.read(options)
    first = points[0]
    text, source = load_text(context.data_root, settings.haystack)
    haystack = Haystack.from_text(text, context.tokenizer, source=source)
    samples = generate_samples(
        context.tokenizer, haystack, first["family"], first["length"], settings, context.model
    )
    systems = [(point.get("system", "alisa"), point_overrides(point)) for point in points]
    results, prefill_s = evaluate_systems(
        context.model,
        context.tokenizer,
        samples,
        systems,
        batch=first.get("batch", 1),
        progress=context.progress,
    )
    chat = uses_chat(context.tokenizer, settings.chat)
    for metrics in results:
        # The prefill is shared: each row carries the whole, its cost is one prefill per batch.
        metrics.update(format="chat" if chat else "plain", prefill_s=round(prefill_s, 3))
    return results


def ruler(context, point: dict, options: dict) -> dict:
    """One RULER point alone (the runner groups a point's systems: :func:`ruler_points`)."""
    return ruler_points(context, [point], options)[0]


def ruler_cost(context, point: dict, options: dict) -> dict:
    """The ``ruler_cost`` task: one system alone in a fresh process at ``length`` tokens
    (prompt + ``new_tokens``): peak memory, decode speed and KV bytes, no other cache alive."""
    from experiments.worker import run_in_subprocess

    new_tokens = options.get("new_tokens", 32)
    if new_tokens >= point["length"]:
        raise ValueError(
            f"options.ruler_cost.new_tokens={new_tokens} leaves no prompt at length="
            f"{point['length']}"
        )
    system = system_label(point.get("system", "alisa"), point_overrides(point))
    result = run_in_subprocess(
        system,
        {
            "model": point.get("model", "smollm2-135m"),
            "dtype": str(next(context.model.parameters()).dtype).removeprefix("torch."),
            "batch": point.get("batch", 1),
            "prompt_tokens": point["length"] - new_tokens,
            "new_tokens": new_tokens,
            "threads": torch.get_num_threads(),
            "data_dir": str(context.data_root) if context.data_root is not None else None,
            "text": options.get("haystack"),
        },
    )
    result.pop("token_ids", None)
    result["load_average"] = round(os.getloadavg()[0], 2)
    return result
