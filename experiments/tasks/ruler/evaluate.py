"""The runner's ``ruler`` and ``ruler_cost`` tasks: accuracy per system, and what it costs.

``ruler``: the points of one (model, family, length, batch) that differ only in their system
run together: the samples are generated once, each batch of them is prefilled once for every
system (:mod:`experiments.tasks.ruler.shared`), then each system decodes greedily and is scored
as RULER scores it (https://arxiv.org/abs/2404.06654). Each system's row carries its score, the
KV bytes it held per tier (per sequence) and its decode speed. ``ruler_cost``: one system alone
in a fresh process (:mod:`experiments.worker`), for peak memory and decode speed free of the
other systems' caches.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from alisa.model.loading import context_length
from experiments.data import load_text
from experiments.systems import point_overrides
from experiments.tasks.ruler.families import family
from experiments.tasks.ruler.haystack import Haystack
from experiments.tasks.ruler.options import RulerOptions
from experiments.tasks.ruler.prompts import prompt_format
from experiments.tasks.ruler.sample import Request, Sample
from experiments.tasks.ruler.scoring import string_match_all
from experiments.tasks.ruler.shared import (
    decode_after_prefill,
    shared_prefill,
    system_cache,
    system_label,
    tier_bytes,
)

PREDICTION_CHARS = 200  # what a row keeps of each prediction (enough to see why it failed)


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

    def add(self, chunk: list[Sample], result, held: dict[str, int]) -> None:
        """Score one batch's predictions; count the KV bytes ``held`` per tier after its prefill
        (per sequence) and its decode steps."""
        rows = len(chunk)
        outcomes = zip(chunk, result.texts, result.token_ids, strict=True)
        for sample, text, generated in outcomes:
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
            "median_step_ms": _median_ms(self.step_s),
            # Timings depend on what else runs: the 1-minute load average when this ended.
            "load_average": round(os.getloadavg()[0], 2),
            "per_sample": self.records,
        }


def _median_ms(seconds: list[float]) -> float | None:
    return round(1000 * statistics.median(seconds), 3) if seconds else None


def evaluate_systems(
    model,
    tokenizer,
    samples: list[Sample],
    systems: list[tuple[str, dict]],
    *,
    batch: int = 1,
    progress: bool = False,
) -> tuple[list[dict], float]:
    """Score every system on ``samples``, ``batch`` samples per shared prefill.

    Parameters
    ----------
    systems
        (name, AlisaConfig overrides) per system: ``hf-dynamic``, ``alisa:...`` (see
        :mod:`experiments.systems`).

    Returns
    -------
    tuple
        (each system's metrics, as :meth:`Tally.metrics`; seconds of the shared prefills).
    """
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
            held = tier_bytes(cache)  # before finished rows leave a batch
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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(sample.input_ids) for sample in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, sample in enumerate(chunk):
        ids[row, width - len(sample.input_ids) :] = torch.tensor(sample.input_ids)
        mask[row, width - len(sample.input_ids) :] = 1
    return ids.to(device), mask.to(device)


def generate_samples(
    tokenizer,
    haystack: Haystack,
    name: str,
    length: int,
    options: RulerOptions,
    model=None,
    indices: Sequence[int] | None = None,
) -> list[Sample]:
    """``options.samples`` samples of family ``name`` at ``length`` tokens, or only those at
    ``indices`` (each the same as in the whole set: a sample depends on its index, the seed and
    ``options.samples``, not on which others are generated).

    Raises
    ------
    ValueError
        An unknown family, or a length past the model's context (both named).
    """
    limit = context_length(model, tokenizer) if model is not None else None
    if limit is not None and length > limit[0]:
        raise ValueError(
            f"length={length} is longer than the model's context of {limit[0]} tokens ({limit[1]})"
        )
    request = Request(
        haystack=haystack,
        tokenizer=tokenizer,
        format=prompt_format(tokenizer, options.chat),
        length=length,
        samples=options.samples,
        seed=options.seed,
    )
    chosen = family(name)
    chosen_indices = range(options.samples) if indices is None else indices
    return [chosen.sample(request, i, options.new_tokens) for i in chosen_indices]


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
    chat = prompt_format(context.tokenizer, settings.chat).chat
    for metrics in results:
        # The prefill is shared: each row carries the whole, its cost is one prefill per batch.
        metrics.update(format="chat" if chat else "plain", prefill_s=round(prefill_s, 3))
    return results


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
