"""retention="host": nothing is lost; each decode step attends to the best tokens per KV head."""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from architectures import FAMILIES, build
from conftest import hf_generate, padded_batch, tiny_gpt2, tiny_llama

from alisa import AlisaCache, AlisaConfig, generate
from alisa.jobs.sizing import batch_memory
from alisa.kv.drop import DropKeeper
from alisa.kv.host import HostKeeper
from alisa.kv.layer import AlisaLayer
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.policies import POLICIES
from alisa.runtime.engine import DecodeState, Engine
from alisa.storage.pages import PAGE_TOKENS, FetchedRows
from alisa.storage.quantized import QuantizedStore

HOST = {"retention": "host"}


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2-mha"])
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(AlisaConfig(policy="swa", caching_ratio=1.0, **HOST), id="r1"),
        pytest.param(AlisaConfig(policy="swa", budget_tokens=10_000, **HOST), id="unreached"),
        pytest.param(
            AlisaConfig(policy="swa", budget_tokens=10_000, history_share=0.5, **HOST),
            id="history-share",
        ),
        pytest.param(
            AlisaConfig(policy="h2o", budget_tokens=10_000, host_bits=4, **HOST), id="int4-host"
        ),
        pytest.param(
            AlisaConfig(policy="swa", budget_tokens=10_000, kv_bits=8, residual_tokens=0, **HOST),
            id="int8-device",
        ),
        pytest.param(
            AlisaConfig(policy="swa", budget_tokens=10_000, estimate_rest=True, **HOST),
            id="estimate-rest",
        ),
    ],
)
def test_unreached_budgets_match_dense_generate(make, config):
    model = make()
    ids, mask = padded_batch(lengths=(50, 41, 23))
    expected = hf_generate(model, ids, mask, max_new_tokens=12)
    cache = AlisaCache(model, config)
    got = hf_generate(model, ids, mask, cache, max_new_tokens=12)
    if config.kv_bits != 16:  # INT8 on the device: the same as dropping mode with INT8
        drop = AlisaCache(model, config.with_overrides(retention="drop"))
        expected = hf_generate(model, ids, mask, drop, max_new_tokens=12)
    assert torch.equal(got, expected)


def test_unreached_budget_matches_dense_sampling():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(50, 41, 23))
    options = {"do_sample": True, "top_k": 20, "temperature": 0.8}
    torch.manual_seed(3)
    expected = hf_generate(model, ids, mask, max_new_tokens=12, **options)
    cache = AlisaCache(model, AlisaConfig(policy="swa", budget_tokens=10_000, **HOST))
    torch.manual_seed(3)
    got = hf_generate(model, ids, mask, cache, max_new_tokens=12, **options)
    assert torch.equal(got, expected)


def decoded_cache(config, lengths=(120, 100, 60), steps=20, model=None):
    model = model or tiny_llama()
    ids, mask = padded_batch(lengths=lengths)
    cache = AlisaCache(model, config)
    hf_generate(model, ids, mask, cache, max_new_tokens=steps)
    return cache, mask


def test_every_token_stays_on_the_host_and_the_device_holds_the_budget_per_head():
    # Selecting at every step: the device holds exactly the budget after each one.
    config = AlisaConfig(
        policy="swa", caching_ratio=0.2, min_budget_tokens=16, reselect_every=1, **HOST
    )
    cache, mask = decoded_cache(config)
    lengths = mask.sum(1).numpy() + 20 - 1  # the last token is not yet written
    for layer in cache.layers:
        slots, retention = layer.slots, layer.keeper
        # Every position, padding included, is in the host region or waits (at most a page)
        # for its page to fill; the waiting ones are the newest, held on the device by every head.
        pending = sum(keys.shape[2] for keys, _ in retention.pending)
        assert retention.pages.length == retention.flushed == slots.seen - pending
        assert 0 <= pending < PAGE_TOKENS
        waiting = set(range(retention.flushed, slots.seen))
        for row in range(3):
            for head in range(slots.groups):
                assert waiting <= set(slots.positions[row, head].tolist())
        budget = layer.keeper.policy.budget(lengths)
        for row in range(3):
            first = int(slots.first[row])
            for head in range(slots.groups):
                held = slots.positions[row, head]
                held = sorted(held[held >= 0].tolist())
                assert len(held) == budget[row]
                assert held[0] >= first  # no padding on the device
                # sinks and the newest token are always attended
                assert set(range(first, first + 4)) <= set(held)
                assert slots.seen - 1 in held
        assert retention.steps > 0 and retention.fetched > 0


@pytest.mark.parametrize(("policy", "share"), [("swa", 0.0), ("tova", 0.0), ("h2o", 0.5)])
def test_a_token_off_the_device_is_always_in_the_host_region(policy, share):
    """New tokens are coded a page at a time; a selection that could leave one out (TOVA has no
    recent window) codes them first, so no token is ever only on the device when it leaves."""
    config = AlisaConfig(
        policy=policy, caching_ratio=0.2, min_budget_tokens=16, history_share=share, **HOST
    )
    cache, _ = decoded_cache(config)
    for layer in cache.layers:
        slots, retention = layer.slots, layer.keeper
        for row in range(3):
            for head in range(slots.groups):
                held = set(slots.positions[row, head].tolist())
                gone = set(range(int(slots.first[row]), slots.seen)) - held
                assert all(position < retention.flushed for position in gone)


def test_selection_differs_between_kv_heads():
    config = AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=16, **HOST)
    cache, _ = decoded_cache(config)
    differs = False
    for layer in cache.layers:
        positions = layer.slots.positions
        sets = [
            set(positions[0, h][positions[0, h] >= 0].tolist()) for h in range(positions.shape[1])
        ]
        differs |= any(a != sets[0] for a in sets[1:])
    assert differs


def test_tier_bytes_split_the_total_and_the_host_region_is_int8():
    config = AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=16, **HOST)
    cache, _ = decoded_cache(config)
    tiers = cache.tier_bytes()
    assert cache.kv_bytes() == tiers["device"] + tiers["host"] + tiers["recompute"]
    assert cache.kv_bytes(tier="device") == tiers["device"]
    assert cache.kv_bytes(tier="host") == tiers["host"] > 0
    layer = cache.layers[0]
    batch, heads, capacity = layer.keeper.pages.pair.data.shape[1:4]
    head_dim = cache.shape.head_dim
    dense_fp32 = 2 * batch * heads * capacity * head_dim * 4
    # INT8 codes plus an fp16 scale and zero point per token, K and V (0.27 at head_dim 64)
    expected = (head_dim + 4) / (4 * head_dim)
    assert layer.keeper.pages.nbytes() / dense_fp32 == pytest.approx(expected)
    with pytest.raises(ValueError, match="tier='disk'"):
        cache.kv_bytes(tier="disk")


def synthetic_layer(retention: bool, budget: int = 24, history_share: float = 0.0) -> AlisaLayer:
    policy = POLICIES["swa"](
        caching_ratio=1.0, budget_tokens=budget, recent_fraction=0.25, sink_tokens=4
    )
    keeper = HostKeeper(policy, 16, history_share) if retention else DropKeeper(policy)
    return AlisaLayer(keeper)


def test_the_history_share_keeps_what_attention_favoured_after_the_query_moves_on():
    """Token 40 is attended for five steps, then the queries look elsewhere: ranked by the key
    sketch alone it leaves the device at once; with the free budget given to the attention
    history (SWA's window of recent steps) it stays while its decayed sum still leads."""
    torch.manual_seed(0)
    dim, length = 16, 100
    keys = torch.randn(1, 1, length, dim) * 0.1
    needle = torch.zeros(dim)
    needle[0] = 4.0
    keys[0, 0, 40] = needle
    query_needle = needle.view(1, 1, 1, dim)
    query_away = torch.zeros(1, 1, 1, dim)
    query_away[..., 1] = 4.0
    held = {}
    for share in (0.0, 1.0):
        layer = synthetic_layer(True, history_share=share)
        layer.update(keys, torch.randn(1, 1, length, dim))
        layer.after_attention(query_needle.expand(1, 1, length, dim), None)
        for step in range(8):
            layer.update(torch.randn(1, 1, 1, dim) * 0.1, torch.randn(1, 1, 1, dim))
            query = query_needle if step < 5 else query_away
            layer.before_attention(query)
            parts = layer.parts(query)
            layer.after_attention(query, _probabilities(query, parts, dim))
        held[share] = set(parts[0].positions[0].flatten().tolist())
        assert (layer.keeper.history is not None) == (share > 0)
    assert 40 not in held[0.0]
    assert 40 in held[1.0]


def test_a_token_an_evicting_policy_lost_comes_back():
    """A passkey in miniature: token 40's key is unlike the others; later queries ignore it
    (so drop-mode SWA evicts it), then one query asks for it."""
    torch.manual_seed(0)
    dim, length = 16, 100
    keys = torch.randn(1, 1, length, dim) * 0.1
    values = torch.randn(1, 1, length, dim)
    needle = torch.zeros(dim)
    needle[0] = 4.0
    keys[0, 0, 40] = needle
    layers = {"drop": synthetic_layer(False), "host": synthetic_layer(True)}
    query_away = torch.zeros(1, 1, 1, dim)
    query_away[..., 1] = 4.0  # attends to nothing in particular
    query_needle = needle.view(1, 1, 1, dim)
    for name, layer in layers.items():
        layer.update(keys, values)
        layer.after_attention(query_away.expand(1, 1, length, dim), None)
        for step in range(10):
            new_key = torch.randn(1, 1, 1, dim) * 0.1
            layer.update(new_key, torch.randn(1, 1, 1, dim))
            query = query_needle if step == 9 else query_away
            layer.before_attention(query)
            parts = layer.parts(query)
            probabilities = _probabilities(query, parts, dim)
            layer.after_attention(query, probabilities)
        held = set(parts[0].positions[0].flatten().tolist())
        if name == "drop":
            assert 40 not in held  # evicted for good
        else:
            assert 40 in held  # fetched back from the host region
            slot = (parts[0].positions[0, 0] == 40).nonzero()[0, 0]
            assert torch.equal(parts[0].keys[0, 0, slot], needle)  # 16-bit host: exact
            assert layer.keeper.fetched > 0


def _probabilities(query, parts, dim):
    positions = parts[0].positions
    logits = torch.matmul(query, parts[0].keys.transpose(-1, -2)) * dim**-0.5
    logits = logits.masked_fill(positions.unsqueeze(2) < 0, float("-inf"))
    return logits.softmax(-1).unsqueeze(2)  # (B, H_kv, G=1, q, S)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retention": "disk"}, "retention='disk'"),
        ({"retention": "host", "host_bits": 3}, "host_bits=3"),
        ({"retention": "host", "gpu_memory": "1GiB"}, "gpu_memory"),
        ({"min_budget_tokens": -1}, "min_budget_tokens=-1"),
        ({"retention": "host", "policy": "swa", "history_share": 1.5}, "history_share=1.5"),
        ({"policy": "swa", "history_share": 0.5}, "history_share=0.5 needs retention='host'"),
        ({"retention": "host", "policy": "streaming", "history_share": 0.5}, "policy='streaming'"),
        ({"retention": "host", "policy": "swa", "reselect_every": 0}, "reselect_every=0"),
        ({"policy": "swa", "reselect_every": 2}, "reselect_every=2 needs retention='host'"),
        ({"policy": "swa", "estimate_rest": True}, "estimate_rest=True needs retention='host'"),
    ],
)
def test_bad_retention_settings_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        AlisaConfig(**options)


def test_the_history_share_defaults_to_half_for_attention_scored_host_retention():
    assert AlisaConfig(policy="swa", **HOST).host_history_share == 0.5
    assert AlisaConfig(policy="h2o", preset="paper", **HOST).host_history_share == 0.5
    assert AlisaConfig(policy="swa", history_share=0.0, **HOST).host_history_share == 0.0
    assert AlisaConfig(policy="streaming", **HOST).host_history_share == 0.0
    assert AlisaConfig(policy="swa").host_history_share == 0.0  # drop: scores rank every token
    cache = AlisaCache(tiny_llama(), AlisaConfig(policy="swa", caching_ratio=0.2, **HOST))
    assert all(layer.keeper.history_share == 0.5 for layer in cache.layers)


def test_the_rest_is_estimated_only_when_asked_and_only_with_host_retention():
    from alisa.settings import ESTIMATE_REST, describe_settings

    assert AlisaConfig(policy="swa", **HOST).host_estimate_rest is ESTIMATE_REST
    assert AlisaConfig(policy="swa", estimate_rest=True, **HOST).host_estimate_rest
    assert not AlisaConfig(policy="swa").host_estimate_rest  # dropping: nothing to estimate
    config = AlisaConfig(policy="swa", caching_ratio=0.2, estimate_rest=True, **HOST)
    assert all(layer.keeper.estimate_rest for layer in AlisaCache(tiny_llama(), config).layers)
    shown = describe_settings(AlisaConfig(policy="swa", **HOST), 2).splitlines()
    assert f"estimate_rest {ESTIMATE_REST} *" in [" ".join(line.split()) for line in shown]


def test_reselect_every_defaults_for_host_retention_only():
    from alisa.settings import RESELECT_EVERY, describe_settings

    assert AlisaConfig(policy="swa", **HOST).host_reselect_every == RESELECT_EVERY
    assert AlisaConfig(policy="swa", reselect_every=1, **HOST).host_reselect_every == 1
    assert AlisaConfig(policy="swa").host_reselect_every == 1  # dropping never selects again
    shown = describe_settings(AlisaConfig(policy="swa", **HOST), 2).splitlines()
    assert f"reselect_every {RESELECT_EVERY} *" in [" ".join(line.split()) for line in shown]


@torch.inference_mode()
def test_between_selections_the_last_choice_and_the_new_tokens_are_attended():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(60, 60))
    config = AlisaConfig(
        policy="swa", budget_tokens=24, min_budget_tokens=0, reselect_every=3, **HOST
    )
    cache = AlisaCache(model, config)
    output = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    held = []
    for _ in range(7):
        token = output.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        output = model(input_ids=token, attention_mask=mask, past_key_values=cache)
        held.append(int(layer.slots.kept[0]))
        assert (layer.slots.positions >= 0).sum(-1).eq(held[-1]).all()  # every KV head
    # The prefill chooses 24; steps 3 and 6 choose again; the others add their new token.
    assert held == [25, 26, 24, 25, 26, 24, 25]
    assert layer.keeper.steps == 3


def test_the_floor_keeps_small_budgets_useful():
    config = AlisaConfig(policy="swa", caching_ratio=0.1, **HOST)
    rule = config.keep_rules(4)[0]
    assert rule.kept(10) == 10 and rule.kept(100) == 64 and rule.kept(1000) == 100
    paper = AlisaConfig(policy="swa", caching_ratio=0.1, preset="paper")
    assert paper.keep_rules(4)[0].kept(100) == 10


def test_generate_reports_device_and_host_bytes(tokenizer):
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=16, **HOST)
    result = generate(model, tokenizer, ["a long prompt " * 12], config, max_new_tokens=6)
    tiers = result.kv_tier_bytes
    assert tiers["host"] > 0 and tiers["device"] > 0
    assert result.kv_bytes == sum(tiers.values())
    dense = generate(model, tokenizer, ["a long prompt " * 12], max_new_tokens=6)
    assert dense.kv_tier_bytes["host"] == 0


@pytest.mark.parametrize("retention", ["drop", "host"])
def test_static_batch_sizing_covers_the_device_kv_every_step_holds(retention):
    """``alisa batch --static`` sizes its batches by ``batch_memory``: its KV must cover what the
    device holds at every step. Host retention holds more than its budget (every token's key
    sketch, the page being filled); sizing it as kept tokens plus the sketch under-counted it
    when its slots spanned up to 1.5x the kept tokens before compacting (they no longer do:
    the next test)."""
    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    config = AlisaConfig(policy="swa", caching_ratio=0.2, retention=retention)
    batch, prompt, new_tokens = 4, 200, 150
    cache = AlisaCache(model, config, max_new_tokens=new_tokens)
    engine = Engine(model, None, stop_at_eos=False)
    state = DecodeState.start(torch.randint(5, 200, (batch, prompt), generator=torch.Generator()))
    peak = 0
    with torch.inference_mode():
        for _ in range(new_tokens):
            state.advance(engine.step(state, cache))
            peak = max(peak, cache.tier_bytes()["device"])
    predicted = batch_memory(spec, config, batch, prompt, new_tokens).kv
    assert peak <= predicted < 1.5 * peak
    if retention == "host":
        drop = config.with_overrides(retention="drop")
        extra = predicted - batch_memory(spec, drop, batch, prompt, new_tokens).kv
        assert extra >= batch * (prompt + new_tokens) * spec.sketch_bytes_per_token()


@pytest.mark.parametrize("retention", ["drop", "host"])
def test_new_tokens_refill_the_slots_a_selection_freed(retention):
    """A decode step's token takes a slot freed by the last eviction or selection before it
    appends, so a layer's slots never span more than its kept tokens and the new one (padding
    aside): host retention needs no compaction slack, and its rows size as dropping's do."""
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.2, retention=retention)
    cache = AlisaCache(model, config, max_new_tokens=120)
    engine = Engine(model, None, stop_at_eos=False)
    ids, mask = padded_batch(lengths=(150, 97, 120))
    state = DecodeState.start(ids, mask)
    with torch.inference_mode():
        for _ in range(120):
            state.advance(engine.step(state, cache))
            for layer in cache.layers:
                slots = layer.slots
                assert slots.width <= int((slots.kept + slots.dead).max()) + 1
    fetched = sum(layer.keeper.fetched for layer in cache.layers)
    assert retention == "drop" or fetched > 0  # host selections did move tokens


def test_a_short_padded_prompt_shapes_its_sketch_with_its_sinks_not_its_padding():
    """The sketch's channels come from real, non-sink keys; a sequence that has only sinks so far
    (3 real tokens padded to a long batch) counts those, never its padding."""
    retention = HostKeeper(POLICIES["swa"](sink_tokens=4), host_bits=8)
    slots = SimpleNamespace(first=np.array([0, 97]))
    counted = retention._counted(torch.arange(100), slots)
    assert counted[0].tolist() == [False] * 4 + [True] * 96
    assert counted[1].tolist() == [False] * 97 + [True] * 3


def test_each_step_holds_the_protections_and_the_best_estimates_per_head():
    """Unpadded batch (protections are two slices, only the positions between them ranked): the
    device holds exactly the sinks, the recent window and the best sketch estimates of the rest,
    max over each KV head's query heads."""
    torch.manual_seed(0)
    batch, kv_heads, group, dim, length = 2, 2, 2, 16, 100
    layer = synthetic_layer(True)  # budget 24: 4 sinks, 6 recent, 14 ranked
    layer.update(
        torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    )
    query = torch.randn(batch, kv_heads * group, 1, dim)
    layer.after_attention(query.expand(-1, -1, length, -1), None)
    for _ in range(3):
        layer.update(torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim))
        query = torch.randn(batch, kv_heads * group, 1, dim)
        layer.before_attention(query)
        held = layer.parts(query)[0].positions
        seen = layer.slots.seen
        budget = int(layer.keeper.policy.budget(layer.slots.lengths())[0])
        recent = int(layer.keeper.policy.recent(np.array([budget]))[0])
        logits = layer.keeper.sketch.logits(query.view(batch, kv_heads, group, dim))
        estimate = logits.float().amax(dim=2)[..., : layer.keeper.flushed]
        middle = estimate[..., 4 : seen - recent]
        best = middle.topk(budget - 4 - recent, dim=-1).indices + 4
        for row in range(batch):
            for head in range(kv_heads):
                expected = set(range(4)) | set(range(seen - recent, seen))
                expected |= set(best[row, head].tolist())
                got = held[row, head]
                assert set(got[got >= 0].tolist()) == expected


@pytest.mark.parametrize("host_bits", [8, 4])
def test_an_int8_device_region_takes_int8_host_codes_as_they_are(host_bits, monkeypatch):
    """A token fetched into an INT8 device region from an INT8 host region keeps its host codes
    bit for bit and is never decoded on the way (no dequantize-requantize); from INT4 codes it is
    decoded and coded again. Either way every held token is its value to the precision of both
    roundings."""
    decoded = []
    original = FetchedRows.decoded
    monkeypatch.setattr(FetchedRows, "decoded", lambda rows: decoded.append(1) or original(rows))
    torch.manual_seed(0)
    dim, length = 16, 100
    policy = POLICIES["swa"](
        caching_ratio=1.0, budget_tokens=24, recent_fraction=0.25, sink_tokens=4
    )
    store = partial(QuantizedStore, bits=8, group_size=dim, residual_tokens=0)
    layer = AlisaLayer(HostKeeper(policy, host_bits), store_factory=store)
    keys, values = torch.randn(1, 1, length, dim), torch.randn(1, 1, length, dim)
    layer.update(keys, values)
    layer.after_attention(torch.randn(1, 1, length, dim), None)
    for _ in range(4):
        new = torch.randn(1, 1, 1, dim), torch.randn(1, 1, 1, dim)
        keys, values = torch.cat([keys, new[0]], 2), torch.cat([values, new[1]], 2)
        layer.update(*new)
        layer.before_attention(torch.randn(1, 1, 1, dim))
    retention = layer.keeper
    assert retention.fetched > 0
    assert bool(decoded) == (host_bits == 4)
    device, host = layer.store.codes, retention.pages.pair
    held = layer.slots.positions[0, 0]
    slots = (held >= 0) & (held < retention.flushed)
    positions = held[slots]
    stored = [t[:, 0, 0, slots] for t in device.tensors()]
    if host_bits == 8:
        kept = [t[:, 0, 0, positions] for t in host.tensors()]
        for a, b in zip(stored, kept, strict=True):
            assert torch.equal(a, b)
    for got, want in zip(device.decode(*stored), (keys, values), strict=True):
        want = want[0, 0, positions]
        spread = want.amax(-1, keepdim=True) - want.amin(-1, keepdim=True)
        tolerance = spread / 2 / (2**host_bits - 1) + spread / 2 / 255 + 1e-2
        assert ((got - want).abs() <= tolerance).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_planner_counts_the_sketch_bytes_the_cache_holds(family, dtype):
    """``ModelSpec.sketch_bytes_per_token`` is what each allocated position of the layers' key
    sketches takes: bfloat16 for a float32 model, INT8 codes and a scale for a 16-bit one; only
    full-attention layers have one (a hybrid's sliding layers keep their window)."""
    model = (tiny_llama() if family == "llama" else build(FAMILIES[family])).to(dtype)
    spec = model_spec(model, model_shape(model))
    config = AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=16, **HOST)
    cache = AlisaCache(model, config)
    ids = torch.tensor([[5 + i % 50 for i in range(80)]])
    model(input_ids=ids, past_key_values=cache)
    hosts = [layer.keeper for layer in cache.layers if isinstance(layer.keeper, HostKeeper)]
    assert len(hosts) == spec.full_layers
    assert (spec.full_layers == spec.num_layers) == (family == "llama")  # the hybrid has fewer
    sketches = [keeper.sketch for keeper in hosts]
    per_position = sum((s.nbytes() - s.channels.nbytes) / s.capacity for s in sketches)
    assert per_position == spec.sketch_bytes_per_token()
    assert {s.keys.dtype for s in sketches} == {
        torch.bfloat16 if dtype == torch.float32 else torch.int8
    }
