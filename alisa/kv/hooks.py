"""Routing a model's attention through ``alisa`` and back.

:func:`attach` installs a forward pre-hook on each attention module, which hands the attention
function its ALISA cache layer (and, for tiers that recompute, the attention input), and switches
the model to the ``alisa`` attention implementation. :func:`detach` undoes both;
:func:`attached` does both around a block. A model attached by an ``AlisaCache`` switches back to
its previous implementation by itself at the first forward that uses another cache, so a model
used with an ``AlisaCache`` and then without gives HF's own outputs.

An ALISA cache is recognised by its layers' type (:class:`~alisa.kv.layer.AlisaLayer`, or
:class:`~alisa.kv.packed.PackedLayer` in a mixed forward), so this module does not import the
cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from alisa.kv.attention import ATTENTION_NAME
from alisa.kv.layer import AlisaLayer
from alisa.kv.packed import PackedLayer
from alisa.model.adapter import ModelAdapter, attention_modules, check_model
from alisa.model.routing import CACHE_KWARGS


def _alisa_layer(cache, layer_idx: int) -> AlisaLayer | PackedLayer | None:
    if not isinstance(cache, Cache) or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    return layer if isinstance(layer, AlisaLayer | PackedLayer) else None


def _inject_layer(module: nn.Module, args: tuple, kwargs: dict):
    cache = next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)
    layer = _alisa_layer(cache, module.layer_idx)
    if layer is None:
        return None
    kwargs["alisa_layer"] = layer
    layer.receive_inputs(
        kwargs.get("hidden_states", args[0] if args else None), kwargs.get("position_ids")
    )
    return args, kwargs


class _Attachment:
    """The model-level pre-hook: which implementation to restore, and when.

    At a forward with another cache (or none) while the model runs ``alisa``, the previous
    implementation comes back; at a forward with an ALISA cache after such a restore, ``alisa``
    does. A user's own switch (say to eager) while an ALISA cache is in use is left alone, and
    the cache refuses it.
    """

    def __init__(self, previous: str) -> None:
        self.previous = previous
        self.restored = False

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict):
        cache = kwargs.get("past_key_values")
        if cache is None:
            cache = next((arg for arg in args if isinstance(arg, Cache)), None)
        first = _alisa_layer(cache, 0)
        uses_alisa = first is not None
        # AlisaLayers are an AlisaCache's (a mixed forward's PackedCache has PackedLayers,
        # whose rows its scheduler lays out itself): refused before any layer stores a token,
        # and a static cache's step numbers written (AlisaCache.begin_forward).
        inputs = _forward_inputs(model, args, kwargs) if isinstance(first, AlisaLayer) else None
        if inputs is not None:
            cache.begin_forward(*inputs, model=model)
        self.route(model, uses_alisa=uses_alisa)
        return None

    def route(self, model: nn.Module, *, uses_alisa: bool) -> None:
        """Attention for a forward with an alisa cache (``uses_alisa``) or another one: alisa's
        back where another cache's forward had restored the previous implementation, and that
        one back for another cache."""
        current = model.config._attn_implementation
        if uses_alisa and self.restored and current == self.previous:
            _switch(model, ATTENTION_NAME)
            self.restored = False
        elif not uses_alisa and current == ATTENTION_NAME and self.previous != ATTENTION_NAME:
            model.set_attn_implementation(self.previous)
            self.restored = True


def _forward_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """(rows, new tokens per row, attention mask or None) of a causal LM's forward call, or
    None when it has neither ``input_ids`` nor ``inputs_embeds``."""
    if len(args) > 1:  # rare: more than input_ids passed by position
        kwargs = {**inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments}
    elif args:
        kwargs = {**kwargs, "input_ids": args[0]}
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return None
    return inputs.shape[0], inputs.shape[1], kwargs.get("attention_mask")


def route_to_alisa(model: nn.Module) -> None:
    """What the attachment's hook does before a forward with an alisa cache, for a caller that
    runs ``model.forward`` itself, without hooks (a compiled decode step): another cache's
    forward on the same model may have switched its attention back to the previous one."""
    attachment = _attachment(model)
    if attachment is not None:
        attachment.route(model, uses_alisa=True)


def _attachment(model: nn.Module) -> _Attachment | None:
    hooks = model._forward_pre_hooks.values()
    return next((hook for hook in hooks if isinstance(hook, _Attachment)), None)


def attach(model: nn.Module, *, adapter: ModelAdapter | None = None) -> None:
    """Route a model's attention through ``alisa`` (idempotent).

    The implementation in use before is remembered; it comes back at the first forward with
    another cache, or with :func:`detach`. ``adapter``: the model's inspection, when already
    made (the cache's); else the attention modules are looked up.
    """
    check_model(model)
    modules = adapter.modules if adapter is not None else attention_modules(model)
    for module in modules:
        if _inject_layer not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_inject_layer, with_kwargs=True)
    attachment = _attachment(model)
    if attachment is None:
        attachment = _Attachment(model.config._attn_implementation)
        model.register_forward_pre_hook(attachment, with_kwargs=True)
    attachment.restored = False
    if model.config._attn_implementation != ATTENTION_NAME:
        _switch(model, ATTENTION_NAME)


def detach(model: nn.Module, attn_implementation: str | None = None) -> None:
    """Undo :func:`attach`: remove the hooks and restore an attention implementation.

    ``attn_implementation`` defaults to the one in use before :func:`attach`.
    """
    check_model(model)
    attachment = _attachment(model)
    restore = attn_implementation or (attachment.previous if attachment else "sdpa")
    for module in [model, *attention_modules(model)]:
        for handle_id, hook in list(module._forward_pre_hooks.items()):
            if hook is _inject_layer or isinstance(hook, _Attachment):
                del module._forward_pre_hooks[handle_id]
                module._forward_pre_hooks_with_kwargs.pop(handle_id, None)
    if model.config._attn_implementation != restore:
        model.set_attn_implementation(restore)


@contextmanager
def attached(model: nn.Module) -> Iterator[nn.Module]:
    """``with attached(model):`` runs the block with ``alisa`` attention, then restores the
    model as it was before any attaching (hooks removed, previous implementation back)."""
    attach(model)
    try:
        yield model
    finally:
        detach(model)


def _switch(model: nn.Module, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError) as error:
        raise ValueError(
            f"{type(model).__name__} cannot use attn_implementation={name!r}: {error}"
        ) from error
