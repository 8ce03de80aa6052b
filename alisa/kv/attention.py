"""The ``alisa`` attention function, registered with transformers' ``AttentionInterface``.

Prefill runs HF's own SDPA path (so it is exact and never materialises L x L scores; a long
prompt in a sliding-window layer goes by blocks of queries against the keys their window sees,
:mod:`alisa.kv.banded`, with the same result), then seeds
the policy's attention sums from the last prompt queries. Decode runs over the kept slots
directly on the grouped KV heads (no ``repeat_kv``). Either way the function then hands the step
to the cache layer's :meth:`~alisa.kv.layer.AlisaLayer.after_attention` (its keeper evicts or
updates its history, the tiers prefetch):
it computes attention and nothing else. With any cache other than the ALISA cache, the function
is plain SDPA.

The cache layer reaches the attention function through a forward pre-hook on each attention
module, which adds ``alisa_layer`` to the keyword arguments that HF passes through to attention.
:func:`attach` installs it and switches the model to the ``alisa`` attention implementation;
:func:`detach` undoes both; :func:`attached` does both around a block. A model attached by an
``AlisaCache`` switches back to its previous implementation by itself at the first forward that
uses another cache, so a model used with an ``AlisaCache`` and then without gives HF's own
outputs. An ALISA cache is recognised by its layers' type (:class:`~alisa.kv.layer.AlisaLayer`,
or :class:`~alisa.kv.packed.PackedLayer` in a mixed forward), so this module does not import the
cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from alisa.kv.banded import banded_prefill
from alisa.kv.grouped import grouped_logits
from alisa.kv.layer import AlisaLayer
from alisa.kv.packed import PackedLayer, prompt_columns, running_columns
from alisa.kv.rest import RestColumn
from alisa.model.adapter import ModelAdapter, attention_modules, check_model
from alisa.model.routing import CACHE_KWARGS
from alisa.storage.store import Part

ATTENTION_NAME = "alisa"
# Score rows are computed in query chunks of about this many float32 values (32 MiB).
SEED_CHUNK_VALUES = 1 << 23


@dataclass(frozen=True)
class LogitOptions:
    """What a model adds to softmax(q k^T * scale), from the attention call's keywords.

    Attributes
    ----------
    softcap
        Gemma 2's logit soft-capping: logits become ``softcap * tanh(logits / softcap)`` before
        the mask (``softcap``; https://arxiv.org/abs/2408.00118).
    sinks
        (H,) GPT-OSS's learned sink logit per query head (``s_aux``): one extra softmax column
        that takes probability mass and contributes no value
        (https://arxiv.org/abs/2508.10925).
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def take(cls, kwargs: dict) -> LogitOptions:
        """The options in an attention call's ``kwargs``, removed from them."""
        return cls(softcap=kwargs.pop("softcap", None), sinks=kwargs.pop("s_aux", None))

    @property
    def plain(self) -> bool:
        """True when the softmax is the plain one (HF's SDPA path computes it)."""
        return self.softcap is None and self.sinks is None


PLAIN = LogitOptions()


def alisa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the ALISA cache's kept tokens (SDPA when no ALISA layer is attached).

    Parameters
    ----------
    query
        (B, H, q, D) queries.
    key, value
        (B, H_kv, q, D) what the cache layer returned: this call's new tokens.
    attention_mask
        HF's mask; used at prefill only (it also tells which prompt tokens are padding).

    Returns
    -------
    tuple
        ((B, q, H, D) output, None).
    """
    layer: AlisaLayer | PackedLayer | None = kwargs.pop("alisa_layer", None)
    options = LogitOptions.take(kwargs)  # HF's SDPA refuses or ignores them: applied here
    if isinstance(layer, PackedLayer):
        return _packed_attention(
            module, layer, query, key, value, scaling, dropout, options, kwargs
        )
    output = _attend(
        module, layer, query, key, value, attention_mask, scaling, dropout, options, kwargs
    )
    return output, None


def _attend(
    module: nn.Module,
    layer: AlisaLayer | None,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    options: LogitOptions,
    kwargs: dict,
) -> torch.Tensor:
    """:func:`alisa_attention` for one cache layer (or none): the (B, q, H, D) output.

    At a decode step ``key`` and ``value`` are not read (the layer's slots are).
    """
    window = kwargs.get("sliding_window")
    if layer is not None and window is not None and window != layer.keeper.window:
        raise ValueError(
            f"layer {layer.layer_idx} attends with sliding_window={window!r} but its cache "
            f"keeps window={layer.keeper.window!r}"
        )
    if layer is None or layer.prefilling:
        if options.plain:
            output = banded_prefill(
                module,
                query,
                key,
                value,
                attention_mask,
                window,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
            if output is None:  # not a long sliding-window prompt: HF's own call
                output, _ = sdpa_attention_forward(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    dropout=dropout,
                    scaling=scaling,
                    **kwargs,
                )
        else:
            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            output = _prefill_attention(query, key, value, attention_mask, scaling, options, window)
        if layer is not None:
            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            prefill_layer(layer, query, key, attention_mask, scaling, options)
        return output
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer.before_attention(query)
    rest = layer.rest(query, scaling, options.softcap)
    attended = layer.attend(query, scaling) if options.plain and rest is None else None
    if attended is None:
        parts = layer.parts(query)
        # The model's own window, as its mask has it: a model whose sliding layers pass none
        # (Moshi) masks causally only and, as HF's sliding cache, attends to what the layer
        # holds (the newest W - 1 tokens and the new ones); with one token either way is the same.
        visible = _visible(parts, layer.seen_now(), query.shape[2], window)
        attended = grouped_attention_parts(query, parts, visible, scaling, options, rest)
    output, probabilities = attended
    layer.after_attention(query, probabilities)
    return output


def _packed_attention(
    module: nn.Module,
    layer: PackedLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    dropout: float,
    options: LogitOptions,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """A mixed forward's attention (:mod:`alisa.kv.packed`): the (1, H, N, D) query's first B
    columns are a decode step of the running rows over their cache, the rest a newcomer's
    causal prefill over its own prompt; HF's mask is not read. Returns ((1, N, H, D), None)."""
    rows = layer.rows
    running = _attend(
        module,
        layer.running,
        running_columns(query, rows),
        None,
        None,
        None,
        scaling,
        dropout,
        options,
        kwargs,
    )
    prompt = _attend(
        module,
        layer.newcomer,
        prompt_columns(query, rows),
        prompt_columns(key, rows),
        prompt_columns(value, rows),
        None,  # one unpadded prompt: causal
        scaling,
        dropout,
        options,
        kwargs,
    )
    return torch.cat([running.transpose(0, 1), prompt], dim=1), None


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    options: LogitOptions,
    window: int | None,
) -> torch.Tensor:
    """Prefill attention with soft-capping or sinks, which SDPA cannot apply: the grouped
    softmax in query chunks of about :data:`SEED_CHUNK_VALUES` scores (B, q, H, D).

    A padding query sees no key: its row is zero instead of NaN, so no NaN reaches a later
    layer's values (HF's eager path gives such rows a uniform softmax; both are masked out).
    Each chunk reads only the keys from the first one a query of it sees to the last one
    (:func:`_chunk_bands`): a causal layer's chunk skips the keys after it, a sliding one's those
    before its window too, where every query of a chunk read the whole prompt before (masked
    keys add nothing to a softmax's sum or to the product with the values: only the sums'
    rounding can differ, 3e-7 at 4K tokens).
    """
    batch, heads, queries, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    visible = _prefill_visible(attention_mask, queries, length, window, key.device)
    chunk = max(1, SEED_CHUNK_VALUES // max(1, batch * heads * length))
    outputs = []
    for start, (low, high) in zip(
        range(0, queries, chunk), _chunk_bands(visible, chunk), strict=True
    ):
        stop = min(start + chunk, queries)
        probabilities = grouped_probabilities(
            query[:, :, start:stop],
            key[:, :, low:high],
            visible[:, :, start:stop, low:high],
            scaling,
            options,
        )
        probabilities = torch.nan_to_num(probabilities, nan=0.0).to(value.dtype)
        flat = probabilities.view(batch, kv_heads, -1, high - low)  # (B, Hkv, G*q, S')
        band = value[:, :, low:high]
        outputs.append(torch.matmul(flat, band).view(batch, heads, stop - start, head_dim))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _chunk_bands(visible: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    """For each chunk of ``chunk`` queries of a (B or 1, 1, q, S) boolean mask, the keys [low,
    high) from the first any of its queries sees to the last (all S for a chunk that sees none).

    Computed chunk by chunk where the mask is (no temporary larger than a chunk's rows: the mask
    itself is q x S), then read by the host once per layer's prefill.

    Returns
    -------
    list
        ceil(q / chunk) (low, high) pairs.
    """
    queries, length = visible.shape[-2:]
    bounds = []
    for start in range(0, queries, chunk):
        seen = visible[..., start : start + chunk, :].any(dim=-2).any(dim=1).any(dim=0)  # (S,)
        # argmax gives the first True; where there is none it gives 0 both ways: (0, S).
        marks = seen.to(torch.uint8)
        bounds.append(torch.stack([marks.argmax(), length - marks.flip(0).argmax()]))
    return [(low, high) for low, high in torch.stack(bounds).tolist()]


def _prefill_visible(
    attention_mask: torch.Tensor | None,
    queries: int,
    length: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """(B or 1, 1, q, S) bool: HF's boolean mask, or (None: no padding, plain causal) the
    causal pattern of the last ``queries`` of ``length`` positions, windowed in a sliding
    layer."""
    if attention_mask is not None:
        return attention_mask[..., -length:].bool()
    keys = torch.arange(length, device=device).view(1, -1)
    rows = torch.arange(length - queries, length, device=device).view(-1, 1)
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    return visible.view(1, 1, queries, length)


def grouped_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    options: LogitOptions = PLAIN,
) -> torch.Tensor:
    """Attention probabilities with H query heads sharing H_kv key heads, no ``repeat_kv``.

    Parameters
    ----------
    query
        (B, H, q, D).
    key
        (B, H_kv, S, D).
    visible
        (B, 1 or H_kv, q, S) bool: which slots each query may read.

    Returns
    -------
    torch.Tensor
        (B, H_kv, G, q, S) float32 probabilities (float64 for a float64 model), G = H / H_kv
        (query head h uses KV head h // G, as ``repeat_kv``).
    """
    return _masked_softmax(grouped_logits(query, key, scaling), visible, options)


def _masked_softmax(
    logits: torch.Tensor,
    visible: torch.Tensor,
    options: LogitOptions = PLAIN,
    rest: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax of (B, H_kv, G, q, S) logits over the slots ``visible`` (B, 1 or H_kv, q, S),
    soft-capped and with a sink column when ``options`` say so (the sink's share dropped).

    ``rest`` (B, H_kv, G, q): the logit of one more column, the tokens left out of the slots
    (:mod:`alisa.kv.rest`); its share is returned as column S of the result.
    """
    if options.softcap is not None:  # before the mask, as Gemma 2's eager attention
        logits = torch.tanh(logits / options.softcap) * options.softcap
    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
    dtype = logits.dtype  # float32, or float64 for a float64 model (grouped_logits)
    columns = [] if rest is None else [rest.to(dtype).unsqueeze(-1)]
    if options.sinks is not None:
        batch, kv_heads, groups, queries, _ = logits.shape
        # Query head h = kv * G + g, as grouped_logits lays them out.
        sink = options.sinks.to(dtype).view(1, kv_heads, groups, 1, 1)
        columns.append(sink.expand(batch, -1, -1, queries, 1))
    if not columns:
        return logits.softmax(dim=-1)
    combined = torch.cat([logits, *columns], dim=-1).softmax(dim=-1)
    return combined[..., : logits.shape[-1] + (rest is not None)]


def grouped_attention_parts(
    query: torch.Tensor,
    parts: list[Part],
    visible: torch.Tensor,
    scaling: float,
    options: LogitOptions = PLAIN,
    rest: RestColumn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys/values split in slot order (device, host, recomputed parts).

    One softmax over the concatenated logits (the same probabilities as one tensor), then the
    outputs of the parts summed; with ``rest``, one more column for the tokens left out of the
    slots, whose share multiplies their estimated value. Returns ((B, q, H, D) output,
    (B, H_kv, G, q, S) probabilities over the slots).
    """
    batch, heads, length, head_dim = query.shape
    logits = [grouped_logits(query, part.keys, scaling) for part in parts]
    logits = logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)  # one slot order
    slots = logits.shape[-1]
    probabilities = _masked_softmax(logits, visible, options, None if rest is None else rest.logit)
    kv_heads = probabilities.shape[1]
    flat = probabilities.view(batch, kv_heads, -1, probabilities.shape[-1])
    output, offset = None, 0
    for part in parts:
        width = part.values.shape[2]
        piece = torch.matmul(flat[..., offset : offset + width].to(part.values.dtype), part.values)
        output = piece if output is None else output + piece
        offset += width
    if rest is not None:  # (B, H_kv, G*q, 1) shares times (B, H_kv, 1, D) values
        output = output + (flat[..., slots:] * rest.value.unsqueeze(2)).to(output.dtype)
        probabilities = probabilities[..., :slots]
    output = output.view(batch, heads, length, head_dim).transpose(1, 2).contiguous()
    return output, probabilities


def _visible(
    parts: list[Part], seen: int | torch.Tensor, length: int, window: int | None
) -> torch.Tensor:
    """(B, Hs, q, S): a slot is visible when it holds a token no later than the query (and,
    in a sliding-window layer, within the query's window of ``window`` positions). ``seen``:
    tokens seen, a host int or (a static step's) (1,) device tensor."""
    if len(parts) == 1:
        positions = parts[0].positions
    else:
        positions = torch.cat([part.positions for part in parts], dim=-1)
    steps = torch.arange(length, device=positions.device)
    queries = (steps + (seen - length)).view(1, 1, -1, 1)
    slots = positions.unsqueeze(2)
    visible = (slots >= 0) & (slots <= queries)
    if window is not None:  # HF's sliding_window_overlay: positions (p - W, p]
        visible &= slots > queries - window
    return visible


def prefill_layer(
    layer: AlisaLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    options: LogitOptions = PLAIN,
) -> None:
    """What a prefill does to its cache layer besides computing the output.

    The prompt's padding is marked, the policy is seeded with the last prompt queries' attention,
    then the layer's keeper keeps its budget (a host keeper first writes the whole prompt to the
    host region). The layer must hold the prompt already (``layer.update(key, value)``). One
    prefill's (B, H, q, D) ``query`` and (B, H_kv, q, D) ``key`` can so fill several caches of
    different configs: the output is the same dense attention for all of them
    (``experiments.tasks.ruler.shared`` prefills once for every system it compares).
    """
    valid = _prompt_validity(attention_mask, key)
    if valid is not None:
        layer.mark_padding(valid)
    rows_wanted = layer.scored_rows_wanted()
    if rows_wanted != 0:
        _seed_scores(layer, query, key, valid, scaling, rows_wanted, options)
    layer.after_attention(query, None)


def _prompt_validity(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """(B, S) bool: non-padding prompt tokens, from HF's boolean 4D mask (None: no padding)."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return None
    # The last query sees every real token of its sequence and no padding.
    valid = attention_mask[:, 0, -1, -key.shape[2] :]
    return valid.expand(key.shape[0], -1)


def _seed_scores(
    layer: AlisaLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    rows_wanted: int | None,
    options: LogitOptions = PLAIN,
) -> None:
    """Feed the policy the attention rows of the last ``rows_wanted`` prompt queries (all: None).

    With an observation window the rows are one vote (summed, then pooled by the policy). Rows
    are computed in query chunks so the transient stays near 32 MiB; padding queries give
    zero rows.
    """
    batch, heads, queries, _ = query.shape
    length = key.shape[2]
    offset = length - queries  # a chunked prefill's queries are the last of the keys
    rows = queries if rows_wanted is None else min(rows_wanted, queries)
    positions = torch.arange(length, device=query.device)
    keys_valid = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    if valid is not None:
        keys_valid = valid.to(query.device)
    chunk = max(1, SEED_CHUNK_VALUES // max(1, batch * heads * length))
    vote = None  # an observation window's rows, summed over its chunks
    for start in range(queries - rows, queries, chunk):
        stop = min(start + chunk, queries)
        query_positions = torch.arange(start + offset, stop + offset, device=query.device)
        causal = positions.view(1, -1) <= query_positions.view(-1, 1)
        visible = (keys_valid.unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)  # (B, 1, q, S)
        probabilities = grouped_probabilities(
            query[:, :, start:stop], key, visible, scaling, options
        )
        # Padding queries see nothing: their softmax is NaN; they contribute no attention.
        probabilities = torch.nan_to_num(probabilities, nan=0.0)
        if not layer.observes_prompt:
            layer.account(probabilities)
            continue
        summed = probabilities.sum(dim=3, keepdim=True)
        vote = summed if vote is None else vote + summed
    if vote is not None:
        layer.account(vote, vote=True)


AttentionInterface.register(ATTENTION_NAME, alisa_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# Routing a model's attention through alisa and back (the hooks).


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
