"""How an attention module routes the cache's keys and values, read from its source: the
routings alisa follows exactly, and a refusal naming each one it cannot."""

import pytest
from torch import nn
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention
from transformers.models.doge.modeling_doge import DogeAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention
from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mpt.modeling_mpt import MptAttention

from alisa.model.routing import INLINE_ATTENTION, routing, routing_reason

ALL_ATTENTION_FUNCTIONS = {}  # only its name matters: the routing is read, never run


class Plain(nn.Module):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        query, key, value = hidden_states, hidden_states, hidden_states
        key, value = past_key_values.update(key, value, 0)
        attention = ALL_ATTENTION_FUNCTIONS.get("sdpa")
        return attention(self, query, key, value, attention_mask, **kwargs)


class Inline(nn.Module):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None):
        key, value = past_key_values.update(hidden_states, hidden_states, 0)
        return (hidden_states @ key.T).softmax(-1) @ value


class Derived(nn.Module):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None):
        key, value = past_key_values.update(hidden_states, hidden_states, 0)
        half = value[..., ::2]
        attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return attention(self, hidden_states, key, half, attention_mask=attention_mask)


class OwnMask(nn.Module):
    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        key, value = layer_past.update(hidden_states, hidden_states, 0)
        bias = attention_mask + 1
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, hidden_states, key, value, bias)


class Aliased(nn.Module):
    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        current = layer_past
        if hasattr(layer_past, "self_attention_cache"):
            current = layer_past.self_attention_cache
        key, value = current.update(hidden_states, hidden_states, 0)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, hidden_states, key, value, attention_mask)


class Tiled(nn.Module):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None):
        key, value = past_key_values.update(hidden_states, hidden_states, 0)
        key = key.repeat(1, 2, 1, 1)  # the same names, other tensors
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, hidden_states, key, value, attention_mask)


class NeverStored(nn.Module):
    def forward(self, hidden_states, attention_mask=None, past_key_values=None):
        key = value = hidden_states
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, hidden_states, key, value, attention_mask)


class NoCache(nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return attention(self, hidden_states, hidden_states, hidden_states, attention_mask)


def test_the_routing_is_read_from_the_forward_source():
    found = routing(Plain)
    assert found.cache_kwarg == "past_key_values"
    assert found.updated == ("key", "value")
    assert found.calls == (("key", "value", "attention_mask"),)
    assert routing(OwnMask).cache_kwarg == "layer_past"
    # A name bound to the cache, or to a part of it, is the cache too (GPT-2, BERT, GPTBigCode).
    assert routing(Aliased).updated == ("key", "value")
    assert routing(NeverStored).updated is None


@pytest.mark.parametrize(
    "module_class",
    [Plain, Aliased, LlamaAttention, GPTNeoXAttention, GPTBigCodeAttention, GPT2Attention],
)
def test_the_cache_s_keys_values_and_transformers_mask_are_followed(module_class):
    assert routing_reason(module_class) is None


@pytest.mark.parametrize(
    ("module_class", "reason"),
    [
        (Inline, INLINE_ATTENTION),
        (MptAttention, INLINE_ATTENTION),
        (Derived, "Derived attends to key / half instead of the keys and values the cache"),
        (OwnMask, "OwnMask builds its own attention mask (bias)"),
        (DogeAttention, "DogeAttention builds its own attention mask (attn_mask)"),
        (DiffLlamaAttention, "DiffLlamaAttention calls the attention function 2 times per layer"),
        (Tiled, "Tiled changes key after the cache returns them"),
        (JetMoeAttention, "JetMoeAttention changes key_states / value_states after the cache"),
        (NoCache, "NoCache.forward takes no cache argument"),
        (NeverStored, "NeverStored.forward never stores its keys and values with the cache's"),
    ],
)
def test_each_routing_alisa_cannot_follow_is_named(module_class, reason):
    assert routing_reason(module_class).startswith(reason)


def test_a_module_without_source_is_refused_not_guessed():
    dynamic = type("Dynamic", (nn.Module,), {"forward": eval("lambda self, x: x")})
    assert "has no readable source" in routing_reason(dynamic)
