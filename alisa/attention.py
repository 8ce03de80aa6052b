"""The ``alisa`` attention function, registered with transformers' ``AttentionInterface``.

Prefill runs HF's own SDPA path (so it is exact and never materialises L x L scores), then seeds
the policy's attention sums from the last prompt queries. Decode runs over the kept slots
directly on the grouped KV heads (no ``repeat_kv``), hands the probabilities to the cache layer
and lets it evict. With any cache other than the ALISA cache, the function is plain SDPA.

The cache layer reaches the attention function through a forward pre-hook on each attention
module, which adds ``alisa_layer`` to the keyword arguments that HF passes through to attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from alisa.layer import AlisaLayer
from alisa.recall import recall_step

ATTENTION_NAME = "alisa"
# Score rows are computed in query chunks of about this many float32 values (32 MiB).
SEED_CHUNK_VALUES = 1 << 23
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sliding_window")


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
        (B, H_kv, S, D) what the cache layer returned: the prompt at prefill, the slots after.
    attention_mask
        HF's mask; used at prefill only (it also tells which prompt tokens are padding).

    Returns
    -------
    tuple
        ((B, q, H, D) output, None).
    """
    layer: AlisaLayer | None = kwargs.pop("alisa_layer", None)
    if layer is None or layer.prefilling:
        output, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        if layer is not None:
            _after_prefill(layer, query, key, attention_mask, scaling)
            layer.finish_prefill()
        return output, None
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attention option {name}={kwargs[name]!r} is not supported by alisa")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    visible = _decode_mask(layer, query.shape[2])
    parts = layer.parts() if getattr(layer.store, "takes_parts", False) else [(key, value)]
    output, probabilities = grouped_attention_parts(query, parts, visible, scaling)
    if layer.needs_attention:
        layer.add_attention(_group_rows(probabilities, layer.groups))
    layer.evict()
    following = layer.next_layer
    if following is not None and hasattr(following.store, "prefetch"):
        following.store.prefetch()  # overlaps the next layer's host copy with this layer's work
    layer.decode_steps += 1
    if layer.recall is not None and layer.decode_steps % layer.recall_every == 0:
        layer.recalled += recall_step(layer, query[:, :, -1:], scaling)
    return output, None


def grouped_probabilities(
    query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor, scaling: float
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
        (B, H_kv, G, q, S) float32 probabilities, G = H / H_kv (query head h uses KV head h // G,
        as ``repeat_kv``).
    """
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * length, head_dim)  # (B, Hkv, G*q, D)
    logits = torch.matmul(grouped, key.transpose(-1, -2)) * scaling  # (B, Hkv, G*q, S)
    logits = logits.view(batch, kv_heads, group, length, -1)
    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
    return logits.softmax(dim=-1, dtype=torch.float32)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: ((B, q, H, D) output, (B, H_kv, G, q, S) probabilities).

    Shapes as :func:`grouped_probabilities`; value is (B, H_kv, S, D).
    """
    batch, heads, length, head_dim = query.shape
    probabilities = grouped_probabilities(query, key, visible, scaling)
    flat = probabilities.view(batch, key.shape[1], -1, probabilities.shape[-1]).to(value.dtype)
    output = torch.matmul(flat, value)  # (B, Hkv, G*q, D)
    output = output.view(batch, heads, length, head_dim).transpose(1, 2).contiguous()
    return output, probabilities


def grouped_attention_parts(
    query: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    visible: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys/values split in slot order (device, host, recomputed parts).

    One softmax over the concatenated logits (the same probabilities as one tensor), then the
    outputs of the parts summed.
    """
    if len(parts) == 1:
        return grouped_attention(query, *parts[0], visible, scaling)
    batch, heads, length, head_dim = query.shape
    kv_heads = parts[0][0].shape[1]
    grouped = query.reshape(batch, kv_heads, -1, head_dim)
    logits = torch.cat([torch.matmul(grouped, k.transpose(-1, -2)) for k, _ in parts], dim=-1)
    logits = (logits * scaling).view(batch, kv_heads, heads // kv_heads, length, -1)
    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
    probabilities = logits.softmax(dim=-1, dtype=torch.float32)
    flat = probabilities.view(batch, kv_heads, -1, probabilities.shape[-1])
    output, offset = None, 0
    for _, values in parts:
        width = values.shape[2]
        piece = torch.matmul(flat[..., offset : offset + width].to(values.dtype), values)
        output = piece if output is None else output + piece
        offset += width
    output = output.view(batch, heads, length, head_dim).transpose(1, 2).contiguous()
    return output, probabilities


def _group_rows(probabilities: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, G, q, S) -> (B, Hs, q, S): heads summed within each KV group (and over groups)."""
    rows = probabilities.sum(dim=2)
    if groups == 1:
        rows = rows.sum(dim=1, keepdim=True)
    return rows


def _decode_mask(layer: AlisaLayer, length: int) -> torch.Tensor:
    """(B, Hs, q, width): a slot is visible when it holds a token no later than the query."""
    positions = layer.slot_positions()  # (B, Hs, width)
    queries = torch.arange(layer.seen - length, layer.seen, device=positions.device)
    return (positions.unsqueeze(2) >= 0) & (positions.unsqueeze(2) <= queries.view(1, 1, -1, 1))


def _after_prefill(
    layer: AlisaLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> None:
    valid = _prompt_validity(attention_mask, key)
    if valid is not None:
        layer.mark_padding(valid)
    rows_wanted = layer.scored_rows_wanted()
    if rows_wanted != 0:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        _seed_scores(layer, query, key, valid, scaling, rows_wanted)
    layer.evict()


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
) -> None:
    """Feed the policy the attention rows of the last ``rows_wanted`` prompt queries (all: None).

    Rows are computed in query chunks so the transient stays near 32 MiB; padding queries give
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
    for start in range(queries - rows, queries, chunk):
        stop = min(start + chunk, queries)
        query_positions = torch.arange(start + offset, stop + offset, device=query.device)
        causal = positions.view(1, -1) <= query_positions.view(-1, 1)
        visible = (keys_valid.unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)  # (B, 1, q, S)
        probabilities = grouped_probabilities(query[:, :, start:stop], key, visible, scaling)
        # Padding queries see nothing: their softmax is NaN; they contribute no attention.
        rows_chunk = _group_rows(torch.nan_to_num(probabilities, nan=0.0), layer.groups)
        layer.add_attention(rows_chunk)


def _is_attention_module(module: nn.Module) -> bool:
    return hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention")


def _inject_layer(module: nn.Module, args: tuple, kwargs: dict):
    from alisa.cache import AlisaCache

    cache = kwargs.get("past_key_values")
    if isinstance(cache, AlisaCache):
        layer = cache.layers[module.layer_idx]
        kwargs["alisa_layer"] = layer
        if layer.tiering is not None and layer.tiering.recompute_enabled:
            # The recompute tier keeps each token's attention input and RoPE position.
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            layer.inputs = (hidden, kwargs.get("position_ids"))
        return args, kwargs
    return None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a model, in layer order."""
    modules = [m for m in model.modules() if _is_attention_module(m)]
    return sorted(modules, key=lambda m: m.layer_idx)


def attach(model: nn.Module) -> None:
    """Route a model's attention through ``alisa`` (idempotent).

    Installs the forward pre-hooks that hand each attention call its ALISA cache layer and
    switches the attention implementation to ``alisa``, which is SDPA for any other cache, so the
    model keeps working as before with HF's caches.
    """
    for module in attention_modules(model):
        if _inject_layer not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_inject_layer, with_kwargs=True)
    if model.config._attn_implementation != ATTENTION_NAME:
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except (ValueError, ImportError) as error:
            raise ValueError(
                f"{type(model).__name__} cannot use attn_implementation={ATTENTION_NAME!r}: {error}"
            ) from error


def detach(model: nn.Module, attn_implementation: str = "sdpa") -> None:
    """Undo :func:`attach`: remove the hooks and restore an attention implementation."""
    for module in attention_modules(model):
        for handle_id, hook in list(module._forward_pre_hooks.items()):
            if hook is _inject_layer:
                del module._forward_pre_hooks[handle_id]
                module._forward_pre_hooks_with_kwargs.pop(handle_id, None)
    model.set_attn_implementation(attn_implementation)


AttentionInterface.register(ATTENTION_NAME, alisa_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
