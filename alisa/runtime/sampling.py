"""How the next token is picked: greedy, or HF-style sampling with temperature, top-k, top-p."""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from alisa.checks import check_field_types
from alisa.settings import IgnoredSettingWarning

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
        Seeds a private generator per row for sampling (the global RNG is untouched), so a
        row's tokens do not depend on the rows batched with it; in [0, 2**64) as torch's
        generators take it; ``None`` uses the global RNG, as HF does.
    """

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self)  # do_sample="no" is a string, and a string would sample
        if self.temperature is not None and not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number > 0")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # torch would fail, or wrap
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**64)")

    @property
    def ignored(self) -> tuple[str, ...]:
        """The fields set that greedy decoding ignores (all of them unless ``do_sample``)."""
        if self.do_sample:
            return ()
        names = ("temperature", "top_k", "top_p", "seed")
        return tuple(name for name in names if getattr(self, name) is not None)


def sampling_or_default(sampling: SamplingOptions | None) -> SamplingOptions:
    """``sampling``, or greedy ``SamplingOptions()`` for None; anything else (a dict) is a
    ``ValueError`` naming it, and fields greedy decoding ignores are an
    :class:`~alisa.settings.IgnoredSettingWarning`."""
    if sampling is None:
        return SamplingOptions()
    if not isinstance(sampling, SamplingOptions):
        raise ValueError(
            f"sampling={sampling!r} must be a SamplingOptions, e.g. "
            "SamplingOptions(do_sample=True, temperature=0.7) (None: greedy)"
        )
    if sampling.ignored:  # as HF's generate warns: a setting accepted and ignored is said
        given = ", ".join(f"{name}={getattr(sampling, name)!r}" for name in sampling.ignored)
        warnings.warn(
            f"sampling: {given} ignored without do_sample=True (greedy decoding)",
            IgnoredSettingWarning,
            stacklevel=4,  # the caller of generate() (past it and torch's inference_mode)
        )
    return sampling


class RepeatedPrompts:
    """Says, once, that a prompt repeats an earlier one under one ``seed``: each row draws
    from a generator of its own seeded with it (so a row's tokens do not depend on its batch),
    so their samples are identical. ``generate`` shows it every prompt at once, a stream each
    as it comes; None (greedy, or sampling without a seed): nothing to say."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._first: dict[Hashable, int] | None = None if seed is None else {}

    def see(self, prompt: Hashable, index: int) -> None:
        """Note ``prompt`` (text or token ids) at ``index``; warn if it repeats an earlier one
        and nothing was said yet."""
        if self._first is None:
            return
        first = self._first.setdefault(prompt, index)
        if first == index:
            return
        self._first = None  # once
        warnings.warn(
            f"prompts[{index}] repeats prompts[{first}], sampled with seed={self.seed}: every "
            "row draws from its own generator seeded with it (so a row's tokens do not depend "
            "on its batch), so their samples are identical; for several samples of one prompt, "
            "give each run its own seed, or seed=None",
            UserWarning,
            stacklevel=4,  # past this method and its caller: the user's call
        )


class TokenPicker:
    """Picks one token per row from last-position logits, as HF ``generate`` would.

    Parameters
    ----------
    model
        Supplies the generation-config defaults and the device of the private generator.
    sampling
        Greedy or sampling options.
    """

    def __init__(self, model: nn.Module, sampling: SamplingOptions) -> None:
        self.sampling = sampling
        self.processors = _warpers(model, sampling)
        self.device = next(model.parameters()).device

    def row_generators(self, rows: int) -> list[torch.Generator] | None:
        """A generator per row, each seeded with the seed (None when not sampling with one).

        Each row draws from its own stream, so a request's tokens are those it gets alone,
        whatever it shares a batch with (rows joining and leaving included).
        """
        seed = self.sampling.seed
        if not self.sampling.do_sample or seed is None:
            return None
        return [torch.Generator(device=self.device).manual_seed(seed) for _ in range(rows)]

    def __call__(
        self,
        sequences: torch.Tensor,
        logits: torch.Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """(B,) next tokens from ``logits`` (B, V); ``sequences`` (B, L) feeds HF processors;
        ``generators`` (one per row, :meth:`row_generators`) or None for the global RNG."""
        if not self.sampling.do_sample:
            return logits.argmax(dim=-1)
        scores = self.processors(sequences, logits.float())
        probabilities = scores.softmax(dim=-1)
        # A temperature so small that the float32 logits divided by it overflow (1e-300 is 0 in
        # float32: x / 0) gives inf - inf = NaN in the softmax, where its limit is greedy: such a
        # row takes its argmax (HF's sampler raises instead). Other rows are HF's, bit for bit.
        broken = probabilities.isnan().any(dim=-1, keepdim=True)  # (B, 1)
        probabilities.masked_fill_(broken, 0.0).scatter_add_(
            -1, logits.argmax(dim=-1, keepdim=True), broken.to(probabilities.dtype)
        )
        if generators is None:
            return torch.multinomial(probabilities, 1).squeeze(1)
        rows = zip(probabilities, generators, strict=True)
        return torch.cat([torch.multinomial(row, 1, generator=draw) for row, draw in rows])


def _warpers(model: nn.Module, sampling: SamplingOptions) -> LogitsProcessorList:
    """Temperature, top-k, top-p in HF's order, with the model's defaults where unset."""
    defaults = model.generation_config

    def option(name: str):
        value = getattr(sampling, name)
        if value is None:
            value = getattr(defaults, name, None)  # HF's GenerationConfig, not our object
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
