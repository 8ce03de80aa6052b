"""A static AlisaCache (alisa.kv.static): one traced decode step for every step, the eager
step's tokens, and a clear refusal where a mode has no static step."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from architectures import FAMILIES, build, prompts
from conftest import byte_tokenizer, tiny_llama
from torch._dynamo.utils import counters

from alisa import AlisaCache, AlisaConfig, generate
from alisa.runtime.compiled import last_logits

# Modes with a static step: dense, SWA's default preset (decayed sums, per KV head, head max),
# SWA's exact window (the paper's: snapshots of the sums), TOVA's last step, H2O's
# whole-history sums over one index set, recency only, a fixed budget with sinks, strides.
MODES = {
    "dense": {"caching_ratio": 1.0},
    "swa": {"policy": "swa", "caching_ratio": 0.3},
    "swa-exact-window": {"policy": "swa", "caching_ratio": 0.3, "score_decay": False},
    "swa-paper": {"policy": "swa", "caching_ratio": 0.3, "preset": "paper"},
    "tova": {"policy": "tova", "caching_ratio": 0.3},
    "h2o-one-set": {"policy": "h2o", "caching_ratio": 0.4, "per_head": False},
    "streaming": {"policy": "streaming", "budget_tokens": 9},
    "local": {"policy": "local", "caching_ratio": 0.5},
    "strided": {"policy": "strided", "caching_ratio": 0.4},
    # Host retention: SWA's decayed history share and H2O's whole-history sums over an INT8
    # host region (the default), TOVA's one-step window (the sums erased every step) and the
    # sketch alone over a 16-bit one.
    "host": {"policy": "swa", "caching_ratio": 0.3, "retention": "host"},
    "host-h2o": {"policy": "h2o", "caching_ratio": 0.3, "retention": "host"},
    "host-tova": {"policy": "tova", "caching_ratio": 0.3, "retention": "host", "host_bits": 16},
    "host-sketch": {
        "policy": "swa",
        "caching_ratio": 0.2,
        "retention": "host",
        "host_bits": 16,
        "history_share": 0.0,
    },
    # KV coded to INT8 (one scale a row, the full-precision ring of the newest 64 tokens) and
    # to INT4 in groups of 4 with a ring of 5 that wraps while evictions empty its slots.
    "int8": {"policy": "swa", "caching_ratio": 0.3, "kv_bits": 8},
    # Host retention over INT8 device KV: fetched rows' codes copied from the INT8 host region.
    "host-int8": {"policy": "swa", "caching_ratio": 0.3, "retention": "host", "kv_bits": 8},
    "int4": {
        "policy": "h2o",
        "caching_ratio": 0.4,
        "per_head": False,
        "kv_bits": 4,
        "quant_group_size": 4,
        "residual_tokens": 5,
    },
}


def config(mode: str, kernels: str = "reference") -> AlisaConfig:
    return AlisaConfig(kernels=kernels, **MODES[mode])


def widened(model, mode: str):
    """``model`` in float64 (a copy) where ``mode`` takes it, else ``model``: codes are made of
    float32 (or narrower) keys only, and an INT8 host region's static step takes float32 models
    only. float32 sums in another order can part a near tie of evictions."""
    chosen = config(mode)
    if chosen.kv_bits == 16 and (chosen.host_bits != 8 or chosen.retention != "host"):
        return copy.deepcopy(model).to(torch.float64)
    return model


def greedy(model, cache, ids, mask, steps: int, forward) -> torch.Tensor:
    """(B, steps + 1) greedy tokens: an eager prefill (through the model's hooks), then
    ``steps`` decode steps through ``forward`` (the model's, or its traced twin), each after
    the cache's host half (:meth:`AlisaCache.begin_forward`, which the hook runs eagerly)."""
    return decode(model, cache, ids, mask, steps, forward)[0]


def decode(model, cache, ids, mask, steps: int, forward, forced=None):
    """:func:`greedy`'s tokens and the (B, steps + 1, V) logits they came from; ``forced``
    (B, steps + 1): feed these tokens instead of the argmax (teacher forcing, so that two
    caches are compared step by step on the same inputs)."""
    batch, width = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = [last_logits(model, ids, positions, mask, cache)]
        tokens = [logits[-1].argmax(-1)]
        for step in range(steps):
            mask = torch.cat(
                [mask, torch.ones(batch, 1, dtype=mask.dtype, device=mask.device)], dim=1
            )
            position = positions[:, -1:] + step + 1
            feed = (tokens[-1] if forced is None else forced[:, step])[:, None]
            if forward is model:  # the hook writes the step's numbers
                logits.append(last_logits(model, feed, position, mask, cache))
            else:
                cache.begin_forward(batch, 1, mask, model=model)
                padded = torch.nn.functional.pad(mask, (0, cache.get_max_length() - mask.shape[1]))
                logits.append(last_logits(forward, feed, position, padded, cache))
            tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


def traced(model):
    """The model's forward traced by dynamo in one graph, run without code generation (the
    graph, its guards and its recompiles are inductor's; only the kernels are not)."""
    return torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)


def traced_equals_eager(
    model, mode: str, ids, mask, steps: int, kernels: str = "reference"
) -> torch.Tensor:
    """Assert that ``steps`` traced static steps give the eager static step's tokens from one
    graph (a recompile is an error); returns them."""
    longest = ids.shape[1] + steps + 1
    eager_cache = AlisaCache(model, config(mode, kernels), max_cache_len=longest)
    eager = greedy(model, eager_cache, ids, mask, steps, model)
    static = AlisaCache(model, config(mode, kernels), max_cache_len=longest)
    assert static.is_compileable
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = greedy(model, static, ids, mask, steps, traced(model))
    assert torch.equal(tokens, eager)
    assert counters["stats"]["unique_graphs"] == 1
    return tokens


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("mode", list(MODES))
def test_three_hundred_traced_steps_replay_one_graph_of_the_eager_step(mode, kernels):
    """Padded rows, 300 decode steps across budget growth, evictions and the whole fixed slot
    space: the traced static step gives every token of the eager static step, from one graph
    (a recompile is an error); r = 1 gives HF's dense tokens too (100 of them). With the CPU's
    kernels as operators (attention and eviction) the eager tokens are PyTorch's operators'
    too, in float64 where the mode takes it."""
    model = tiny_llama()
    ids, mask = prompts(lengths=(20, 11, 16))
    tokens = traced_equals_eager(model, mode, ids, mask, 300, kernels)
    if kernels == "cpu":
        # Against PyTorch's operators in float64 where the mode takes it (widened): the CPU's
        # attention sums its dot products in an order that follows the CPU's vector width, and
        # on an AVX2 CPU a 1e-7 difference parted a near tie of SWA's exact window (snapshots
        # subtracted) at step 111 of one row in float32. The eviction operator still runs
        # (its sums are float32 whatever the model's dtype).
        wide = widened(model, mode)
        longest = ids.shape[1] + 301
        reference = AlisaCache(wide, config(mode, "reference"), max_cache_len=longest)
        expected = greedy(wide, reference, ids, mask, 300, wide)
        if wide is not model:  # in float32 the eager CPU step's tokens are ``tokens`` already
            cpu = AlisaCache(wide, config(mode, "cpu"), max_cache_len=longest)
            tokens = greedy(wide, cpu, ids, mask, 300, wide)
        assert torch.equal(tokens, expected)
        return
    if mode == "dense":  # HF's SDPA sums in another order: a near tie of this random
        # model's logits parts them at step 194 of the first row, eager cache or static
        with torch.inference_mode():
            hf = model.generate(ids, attention_mask=mask, max_new_tokens=100)
        assert torch.equal(tokens[:, :100], hf[:, ids.shape[1] :])


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_static_step_keeps_what_the_growing_cache_keeps(mode, kernels):
    """The static step's rule is the eager cache's: 200 steps of padded rows give its tokens.
    In float64, since the two lay their slots out differently and float32 sums in another
    order can part a near tie of evictions (SWA's exact window subtracts snapshots: at step
    111 of one row in float32 here, never in float64)."""
    model = widened(tiny_llama(), mode)
    ids, mask = prompts(lengths=(20, 11, 16))
    steps = 200
    growing = greedy(model, AlisaCache(model, config(mode, kernels)), ids, mask, steps, model)
    static = AlisaCache(model, config(mode, kernels), max_cache_len=ids.shape[1] + steps + 1)
    assert torch.equal(greedy(model, static, ids, mask, steps, model), growing)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("name", ["mistral", "gemma3_text", "qwen2-window", "gpt2", "qwen3", "opt"])
@pytest.mark.parametrize("mode", ["dense", "swa", "int8"])
def test_each_family_traces_its_static_step_to_the_eager_tokens(name, mode, kernels):
    """Sliding-window layers (Mistral, Gemma 3's hybrid, Qwen2's window), GPT-2's fused
    projections, Qwen3's norms, OPT's ``get_seq_length()`` in every forward (a host count
    there recompiled every step; a traced step now reads a device count, as HF's
    ``StaticLayer`` gives), over 16-bit or INT8 KV: the traced static step is the eager
    step, in one graph, with
    PyTorch's operators or the CPU's (whose attention then masks a sliding layer's window:
    PyTorch's tokens)."""
    model, (ids, mask) = build(FAMILIES[name]), prompts()
    tokens = traced_equals_eager(model, mode, ids, mask, 24, kernels)
    if kernels == "cpu":
        cache = AlisaCache(model, config(mode), max_cache_len=ids.shape[1] + 25)
        assert torch.equal(tokens, greedy(model, cache, ids, mask, 24, model))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_coded_kv_of_a_16_bit_model_traces_to_the_eager_tokens(mode, dtype):
    """A 16-bit model's codes decode in the dtype the eager store decodes them in (float16
    scales of float16 keys in float16, the rest in float32): the traced step's tokens are the
    eager static step's, and the growing cache's."""
    model = tiny_llama().to(dtype)
    ids, mask = prompts(lengths=(20, 11, 16))
    tokens = traced_equals_eager(model, mode, ids, mask, 60)
    growing = greedy(model, AlisaCache(model, config(mode)), ids, mask, 60, model)
    assert torch.equal(tokens, growing)


@pytest.mark.parametrize("mode", ["dense", "swa", "host", "int8"])
def test_generate_compiles_a_static_cache_to_the_eager_tokens(mode):
    """``generate(compile="on")`` builds the static cache itself and runs inductor's code: the
    eager tokens, one graph, its compile time reported."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    prompts_ = ["a longer prompt than the others", "short", "middle one"]
    run = dict(config=config(mode), max_new_tokens=20, stop_at_eos=False)
    eager = generate(model, tokenizer, prompts_, **run)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, tokenizer, prompts_, compile="on", **run)
    assert compiled.token_ids == eager.token_ids
    assert counters["stats"]["unique_graphs"] == 1
    assert compiled.compile_s > 0 and eager.compile_s is None


@pytest.mark.parametrize("mode", ["dense", "swa", "swa-exact-window", "int8"])
def test_the_buffers_a_static_step_writes_keep_their_addresses_and_say_so(mode):
    """CUDA graphs replay a step that writes the cache in place only if those buffers have
    fixed addresses (else they skip the graph, as they would for HF's StaticCache without
    ``mark_static_address``): every buffer a static step writes (the keys and values, the
    slot positions, the attention sums and their snapshots, the step's numbers) is marked
    static at the first decode step and keeps its address for every later one."""
    model = tiny_llama()
    ids, mask = prompts(lengths=(20, 11, 16))
    cache = AlisaCache(model, config(mode), max_cache_len=ids.shape[1] + 40)

    def written():
        for layer in cache.layers:
            yield from layer.store.static_buffers()
            yield from layer.slots.static_buffers()
            yield from layer.keeper.static_buffers()
        yield cache._pack.values

    addresses = []

    def forward(**inputs):  # the eager step, then where its buffers are
        logits = model.forward(**inputs)
        addresses.append([tensor.data_ptr() for tensor in written()])
        return logits

    greedy(model, cache, ids, mask, 30, forward)
    assert len(addresses) == 30 and len(addresses[0]) >= 3 * len(cache.layers) + 1
    assert all(step == addresses[0] for step in addresses)
    assert all(tensor._dynamo_static_input_type == "unguarded" for tensor in written())


def test_every_layer_runs_the_same_compiled_kernels():
    """Each layer reads its numbers of the step from a view of its own (StepPack), not at a
    constant offset into one buffer, which inductor bakes into the code: every layer then
    compiled copies of its kernels (100 kernels for SmolLM2's 30 layers, 18 now; a cold compile
    of its dropping step took 143 s, now 98 s, HF's StaticCache 59 s: docs/compile.md).
    Inductor's code for the step of a 6-layer model holds no more kernels than a 4-layer
    model's."""
    from torch._inductor.utils import run_and_get_code

    def kernels(layers: int) -> list[str]:
        model = tiny_llama(num_hidden_layers=layers)
        ids, mask = prompts(lengths=(20, 11, 16))
        cache = AlisaCache(model, config("swa"), max_cache_len=ids.shape[1] + 3)
        forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        torch._dynamo.reset()
        _, code = run_and_get_code(greedy, model, cache, ids, mask, 2, forward)
        assert len(code) == 1  # one graph
        return re.findall(r"^(cpp_fused_\w+) = ", code[0], re.M)

    four = kernels(4)
    assert four and len(kernels(6)) == len(four)


def test_the_static_slot_space_is_fixed_and_bounded_by_the_budget():
    """After the prefill every layer holds the budget at max_cache_len plus one slot (and the
    slot space never changes), whatever the prompt; a dense layer holds max_cache_len."""
    model = tiny_llama()
    ids, mask = prompts(lengths=(90, 60))  # past the preset's 64-token floor: evicted
    longest = ids.shape[1] + 60
    static = AlisaCache(model, config("swa"), max_cache_len=longest)
    dense = AlisaCache(model, config("dense"), max_cache_len=longest)
    greedy(model, static, ids, mask, 1, model)
    greedy(model, dense, ids, mask, 1, model)
    budget = max(round(longest * 0.3), static.layers[0].keeper.policy.min_budget_tokens)
    assert budget + 1 < ids.shape[1]  # the prompt's slots were given back
    assert {layer.store.capacity for layer in static.layers} == {budget + 1}
    assert {layer.store.capacity for layer in dense.layers} == {longest}
    static.reset()
    greedy(model, static, ids, mask, 50, model)
    assert {layer.store.capacity for layer in static.layers} == {budget + 1}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"kv_bits": 4, "policy": "swa", "caching_ratio": 0.3, "retention": "host"},
            "kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
            "has no static (compiled) decode step yet",
        ),
        ({"gpu_memory": "1GiB"}, "gpu_memory='1GiB' has no static (compiled) decode step: its"),
        (
            {"policy": "swa", "caching_ratio": 0.3, "retention": "host", "host_bits": 4},
            "retention='host' with host_bits=4 has no static (compiled) decode step yet",
        ),
        (
            {**MODES["host"], "estimate_rest": True},
            "retention='host' with estimate_rest=True has no static (compiled) decode step",
        ),
        (
            {**MODES["host"], "reselect_every": 2},
            "retention='host' with reselect_every=2 has no static (compiled) decode step",
        ),
    ],
    ids=["int8", "tiers", "host-int4", "host-rest", "host-reselect"],
)
def test_modes_without_a_static_step_are_refused_when_built(fields, needle):
    model = tiny_llama()
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        AlisaCache(model, AlisaConfig(**fields), max_cache_len=64)


def test_an_int8_host_region_of_a_model_not_in_float32_is_refused_when_built():
    """Its rows are decoded as the eager region's only for float32 keys: a bfloat16 model's
    static host step is refused, naming the setting, the dtype and what has one."""
    model = tiny_llama().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"host_bits=8 for a bfloat16 model \(float32 has\)"):
        AlisaCache(model, config("host"), max_cache_len=64)
    assert AlisaCache(model, config("host-tova"), max_cache_len=64).is_compileable


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "64"])
def test_a_bad_max_cache_len_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"max_cache_len={value!r} must be an integer >= 1"):
        AlisaCache(tiny_llama(), AlisaConfig(), max_cache_len=value)


def test_a_static_cache_refuses_to_outgrow_max_cache_len():
    model = tiny_llama()
    ids, mask = prompts()
    cache = AlisaCache(model, config("swa"), max_cache_len=ids.shape[1] + 3)
    greedy(model, cache, ids, mask, 3, model)
    with pytest.raises(ValueError, match="max_cache_len=15: this static cache holds 15 tokens"):
        greedy_step(model, cache, ids.shape[0], ids.shape[1] + 3)


def greedy_step(model, cache, batch: int, seen: int) -> None:
    """One more eager decode step of ``batch`` rows that have ``seen`` tokens."""
    feed = torch.zeros(batch, 1, dtype=torch.long)
    mask = torch.ones(batch, seen + 1, dtype=torch.long)
    with torch.inference_mode():
        last_logits(model, feed, torch.full((batch, 1), seen), mask, cache)


def test_the_speed_benchmark_runs_alisa_compiled_beside_eager():
    """``bench_speed``'s ``alisa-compiled:...`` system: the eager system's tokens, its compile
    time reported from the warm-up, whose graph the timed steps replay."""
    from experiments.interleave import interleaved_rows

    model, tokenizer = tiny_llama(), byte_tokenizer()
    fields = "policy=swa,caching_ratio=0.3"
    systems = [f"alisa:{fields},kernels=reference", f"alisa-compiled:{fields}"]
    prompts_ = ["a longer prompt than the others", "short", "middle one"]
    torch._dynamo.reset()
    counters.clear()
    rows = interleaved_rows(model, tokenizer, prompts_, systems, 8, 2, systems[0])
    assert rows[0]["token_ids"] == rows[1]["token_ids"]
    assert rows[0]["compile_s"] is None and rows[1]["compile_s"] > 0
    assert counters["stats"]["unique_graphs"] == 1


def test_a_compiled_model_call_runs_the_host_half_between_graphs():
    """HF's generate compiles ``model.__call__`` (hooks included, ``fullgraph=False``) for its
    decode steps with a cache that says it is compileable (its prefill runs eager): the
    cache's host half then runs eagerly between graphs (never traced as constants), and the
    tokens are the eager ones."""
    model = tiny_llama()
    ids, mask = prompts()
    runs = []
    for call in (model.__call__, torch.compile(model.__call__, backend="eager")):
        cache = AlisaCache(model, config("swa"), max_cache_len=ids.shape[1] + 21)
        seen, tokens = mask, []
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=seen, past_key_values=cache).logits
            tokens.append(logits[:, -1].argmax(-1))
            for _ in range(20):
                seen = torch.cat([seen, torch.ones(len(ids), 1, dtype=seen.dtype)], dim=1)
                position = (seen.cumsum(-1) - 1)[:, -1:]
                feed = tokens[-1][:, None]
                logits = call(
                    input_ids=feed,
                    attention_mask=seen,
                    position_ids=position,
                    past_key_values=cache,
                ).logits
                tokens.append(logits[:, -1].argmax(-1))
        runs.append(torch.stack(tokens, dim=1))
    assert torch.equal(*runs)


def test_a_forward_without_positions_places_the_token_where_the_growing_cache_does():
    """A model given no ``position_ids`` derives them from ``get_seq_length()``, read during
    the forward, after the host half counted the step's token ahead: it still answers the
    count before the step (RoPE places the token as with the growing cache)."""
    model = tiny_llama()
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    runs, counts = [], []
    for longest in (None, 30):
        cache = AlisaCache(model, config("swa"), max_cache_len=longest)
        with torch.inference_mode():
            tokens = [model(input_ids=ids, past_key_values=cache).logits[:, -1].argmax(-1)]
            for _ in range(8):
                logits = model(input_ids=tokens[-1][:, None], past_key_values=cache).logits
                tokens.append(logits[:, -1].argmax(-1))
        runs.append(torch.stack(tokens, dim=1))
        counts.append(cache.get_seq_length())
    assert torch.equal(*runs)
    assert counts == [18, 18]
    static = AlisaCache(model, config("swa"), max_cache_len=30)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=static)
        static.begin_forward(1, 1, None, model=model)
    assert static.get_seq_length() == 10  # planned, not stored yet


def test_the_first_free_slot_is_below_the_width_or_the_width():
    """:func:`alisa.kv.slots.first_free`: the first empty slot below ``width`` per row; a row
    whose empty slots are all at or past ``width`` gets ``width`` (the frontier)."""
    from alisa.kv.slots import first_free
    from alisa.ops.reference import FREE

    positions = torch.tensor([[[5, FREE, 7, FREE], [4, 6, 8, FREE], [FREE, 1, 2, 3]]])
    assert first_free(positions, 3).squeeze(-1).tolist() == [[1, 3, 0]]
    assert first_free(positions, 4).squeeze(-1).tolist() == [[1, 3, 0]]
    assert first_free(positions[..., 1:], 3).squeeze(-1).tolist() == [[0, 2, 3]]


def test_a_float64_models_decode_attention_is_float64():
    """A float64 model's logits and probabilities stay float64 (float32 only for narrower
    dtypes): in float32 their rounding, whose order follows the CPU's vector width and the slot
    layout, parted the growing and the static cache's evictions on an AVX-512 CPU (above)."""
    from transformers import DynamicCache

    model = tiny_llama().to(torch.float64)
    ids, mask = prompts(lengths=(20, 11, 16))
    tokens, logits = decode(model, AlisaCache(model, config("dense")), ids, mask, 3, model)
    _, reference = decode(model, DynamicCache(), ids, mask, 3, model, forced=tokens)
    assert (logits - reference).abs().max() < 1e-12
