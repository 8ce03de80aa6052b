"""The scheduler's view of a model and of a generation: ``ModelSpec`` and ``Workload``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from alisa.config import AlisaConfig
from alisa.model.adapter import ModelShape
from alisa.model.loading import context_length
from scheduler import ModelSpec, Workload
from scheduler.workload import fetch_share


def config_workload(
    config: AlisaConfig,
    num_layers: int,
    *,
    batch: int,
    prompt_len: int,
    gen_len: int,
    windows: Sequence[int | None] = (),
) -> Workload:
    """The scheduler's :class:`~scheduler.Workload` of generating with ``config``.

    Every layer's budget rule is the cache's own (:meth:`AlisaConfig.keep_rules`: sinks, floor,
    token budget, pyramid scales, dense layers, sliding ``windows``), r is 1 when nothing can be
    evicted, no recent window is pinned to the device (the runtime places kept tokens by slot,
    not by age), and ``retention="host"`` selects every ``config.host_reselect_every`` steps.

    Raises
    ------
    ValueError
        A ``batch``, ``prompt_len`` or ``gen_len`` below 1 (named by ``Workload``).
    """
    return Workload(
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        caching_ratio=1.0 if config.keeps_everything else config.caching_ratio,
        keep=config.keep_rules(num_layers, windows),
        kv_bits=config.kv_bits,
        recent_fraction=0.0,
        retention=config.retention,
        host_bits=config.host_bits,
        reselect_every=config.host_reselect_every,
        fetch_share=fetch_share(config.host_history_share),
    )


def model_spec(model: nn.Module, shape: ModelShape, name: str | None = None) -> ModelSpec:
    """The scheduler's view of a loaded (or empty-weights) model."""
    config = model.config.get_text_config(decoder=True)  # a composite model's text decoder
    known = context_length(model)
    parameters = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    element = parameters[0].element_size() if parameters else 2
    return ModelSpec(
        name=name or getattr(model.config, "_name_or_path", None) or type(model).__name__,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * shape.hidden_size,
        vocab_size=config.vocab_size,
        bytes_per_element=element,
        weight_bytes=sum(p.numel() * p.element_size() for p in parameters),
        windows=shape.windows,
        context_tokens=known[0] if known is not None else None,
    )


def empty_model_spec(spec: str, dtype: str = "bfloat16") -> tuple[ModelSpec, bool]:
    """(ModelSpec, recomputable) of a preset or a model spec, without loading any weights.

    Presets (``opt-13b``, ...) come from ``scheduler.MODEL_PRESETS``; anything else is resolved
    like ``load_model`` and instantiated on the meta device with accelerate's
    ``init_empty_weights``, so only the config is read.
    """
    from alisa.model.adapter import model_shape
    from alisa.model.loading import empty_model, resolve_dtype, resolve_model_path
    from alisa.storage.recompute import KVRecomputer
    from scheduler import MODEL_PRESETS

    if spec.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[spec.lower()], True
    model = empty_model(resolve_model_path(spec), resolve_dtype(dtype) or torch.bfloat16)
    model.tie_weights()
    shape = model_shape(model)
    try:
        KVRecomputer(model)
        recomputable = True
    except ValueError:
        recomputable = False
    unique = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in unique)
    return replace(model_spec(model, shape, name=spec), weight_bytes=weight_bytes), recomputable
