"""Continuous batching: rows join and leave a running batch, each computing what it would alone."""

from itertools import pairwise

import pytest
import torch
from architectures import FAMILIES, build
from conftest import VOCAB, Forwards, byte_tokenizer, hf_generate, tiny_gpt2, tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.jobs.sizing import running_memory
from alisa.jobs.stream import ByteBudget, stream_generate
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import DecodeState, Engine
from alisa.runtime.requests import RowLimit, RowShape, StreamRequest
from alisa.storage.store import headroom

# Prompts of different lengths and lengths to generate: rows finish at different steps and
# waiting ones join a batch whose rows are longer, shorter, older and younger than they are.
LENGTHS = (23, 6, 41, 12, 30, 3, 17)
NEW_TOKENS = (9, 14, 4, 11, 6, 13, 8)


def prompts(lengths=LENGTHS, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def requests(ids: list[list[int]], new_tokens=NEW_TOKENS) -> list[StreamRequest]:
    return [
        StreamRequest(prompt_ids=p, max_new_tokens=n, id=i)
        for i, (p, n) in enumerate(zip(ids, new_tokens, strict=True))
    ]


def continuous(model, config, ids, *, max_rows=3, prefill_rows=2, new_tokens=NEW_TOKENS):
    """Every request's tokens through the scheduler, by id (EOS off: every step compared)."""
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(
        engine, lambda: AlisaCache(model, config), RowLimit(max_rows), prefill_rows=prefill_rows
    )
    results = list(scheduler.run(requests(ids, new_tokens)))
    assert sorted(r.id for r in results) == list(range(len(ids)))
    return {r.id: r.token_ids for r in results}


def hf_alone(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_generate(model, ids, torch.ones_like(ids), max_new_tokens=new_tokens)
    return out[0, len(prompt) :].tolist()


def alisa_alone(model, config, prompt: list[int], new_tokens: int) -> list[int]:
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    with torch.inference_mode():
        result = engine.run(
            DecodeState.start(torch.tensor([prompt])), AlisaCache(model, config), new_tokens
        )
    return result.token_ids[0]


EXACT_DENSE = {
    "drop r=1": AlisaConfig(),
    # A floor above every row's length: host retention never leaves a token out.
    "host unreached": AlisaConfig(
        policy="swa", caching_ratio=0.2, retention="host", min_budget_tokens=128
    ),
}
MODELS = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    # Sliding-window layers (window 8) next to full ones, and a model of window layers only.
    "gemma3-hybrid": lambda: build(FAMILIES["gemma3_text"]),
    "mistral-window": lambda: build(FAMILIES["mistral"]),
}


@pytest.mark.parametrize("name", sorted(EXACT_DENSE))
@pytest.mark.parametrize(
    ("model_name", "prefill_rows"),
    [("llama", 1), ("llama", 2), ("gpt2", 2), ("gemma3-hybrid", 2), ("mistral-window", 2)],
)
def test_each_row_is_token_identical_to_hf_generate_alone(name, model_name, prefill_rows):
    model = MODELS[model_name]()
    ids = prompts()
    tokens = continuous(model, EXACT_DENSE[name], ids, prefill_rows=prefill_rows)
    for index, prompt in enumerate(ids):
        assert tokens[index] == hf_alone(model, prompt, NEW_TOKENS[index]), index


SPARSE = {
    "swa drop r=0.2": AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=4),
    "h2o drop r=0.3": AlisaConfig(policy="h2o", caching_ratio=0.3, min_budget_tokens=4),
    "tova drop r=0.3": AlisaConfig(policy="tova", caching_ratio=0.3, min_budget_tokens=4),
    "swa int8 r=0.5": AlisaConfig(
        policy="swa", caching_ratio=0.5, min_budget_tokens=4, kv_bits=8, residual_tokens=4
    ),
    "swa host r=0.3": AlisaConfig(
        policy="swa", caching_ratio=0.3, retention="host", min_budget_tokens=4
    ),
}


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_each_sparse_row_is_token_identical_to_alisa_alone(name):
    # Budgets follow each row's own length and its positions are its own: eviction and host
    # selection decide for a row what they would decide alone.
    model, config = tiny_llama(), SPARSE[name]
    ids = prompts()
    tokens = continuous(model, config, ids)
    for index, prompt in enumerate(ids):
        assert tokens[index] == alisa_alone(model, config, prompt, NEW_TOKENS[index]), index


BUDGETED = {
    "dense": AlisaConfig(),
    "swa drop r=0.2": AlisaConfig(policy="swa", caching_ratio=0.2, min_budget_tokens=8),
    "swa host r=0.2": AlisaConfig(
        policy="swa", caching_ratio=0.2, retention="host", min_budget_tokens=8
    ),
    "swa int8 r=0.2": AlisaConfig(
        policy="swa", caching_ratio=0.2, min_budget_tokens=8, kv_bits=8, residual_tokens=8
    ),
}


@pytest.mark.parametrize("name", sorted(BUDGETED))
def test_admission_keeps_the_device_kv_within_the_byte_budget(name):
    model, config = tiny_llama(), BUDGETED[name]
    spec = model_spec(model, model_shape(model))
    lengths, new_tokens = (90, 12, 60, 33, 120, 8, 75, 40), (30, 50, 20, 44, 16, 60, 25, 36)
    ids = prompts(lengths)
    # Room for about three of the longest rows: rows must wait for others to leave.
    budget = running_memory(spec, config, [(120, 60)] * 3).kv
    admission = ByteBudget(spec=spec, config=config, kv_bytes=budget)
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(engine, lambda: AlisaCache(model, config), admission)
    for request in requests(ids, new_tokens):
        scheduler.submit(request)
    finished, widest = [], 0
    while not scheduler.idle:
        finished += scheduler.step()
        rows = [(len(row.request.prompt_ids), row.request.max_new_tokens) for row in scheduler.rows]
        predicted = running_memory(spec, config, rows).kv
        assert scheduler.stats.kv_bytes <= predicted <= budget
        widest = max(widest, len(rows))
    assert scheduler.stats.peak_kv_bytes <= budget
    assert 2 <= widest < len(ids)  # rows shared the batch, and the budget held some back
    assert sorted(r.id for r in finished) == list(range(len(ids)))
    assert [len(r.token_ids) for r in sorted(finished, key=lambda r: r.id)] == list(new_tokens)


def prefilled(model, config, prompt: list[int]) -> AlisaCache:
    cache = AlisaCache(model, config)
    with torch.inference_mode():
        Engine(model, None).forward(DecodeState.start(torch.tensor([prompt])), cache)
    return cache


def test_a_joining_row_is_placed_as_if_left_padded_and_leaving_rows_free_their_span():
    model, config = tiny_llama(), AlisaConfig(policy="swa", caching_ratio=0.5)
    long, short = prefilled(model, config, prompts((30,))[0]), prefilled(model, config, [5] * 8)
    long.extend(short)
    slots = long.layers[0].slots
    assert long.get_seq_length() == 30 and slots.first.tolist() == [0, 22]
    assert slots.lengths().tolist() == [30, 8]
    held = slots.positions[1][slots.positions[1] >= 0]
    assert held.min() >= 22 and held.max() == 29  # the newest token of both rows is at 29
    long.keep_rows(torch.tensor([1]))  # the long row leaves: the short one's span remains
    slots = long.layers[0].slots
    assert long.get_seq_length() == 8 and slots.first.tolist() == [0]
    layer = long.layers[0]  # its empty slots were returned
    assert layer.slots.width == 8 and layer.store.capacity == 8 + headroom(8)


def test_a_longer_newcomer_moves_the_running_rows_later():
    model, config = tiny_llama(), AlisaConfig(policy="swa", caching_ratio=0.2, retention="host")
    running, newcomer = prefilled(model, config, [7] * 20), prefilled(model, config, [9] * 50)
    running.extend(newcomer)
    layer = running.layers[1]
    assert running.get_seq_length() == 50 and layer.slots.first.tolist() == [30, 0]
    assert layer.keeper.pages.length == 50 and layer.keeper.flushed == 50
    assert layer.keeper.sketch.keys.shape[0] == 2


def test_caches_of_other_configs_or_not_prefilled_do_not_join():
    model = tiny_llama()
    running = prefilled(model, AlisaConfig(), [3] * 10)
    with pytest.raises(ValueError, match="different configs"):
        running.extend(prefilled(model, AlisaConfig(kv_bits=8), [3] * 10))
    with pytest.raises(ValueError, match="prefilled"):
        running.extend(AlisaCache(model, AlisaConfig()))


def test_tiered_caches_refuse_rows_joining():
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.5, gpu_memory="1GiB", host_memory="1GiB")
    with pytest.raises(ValueError, match="tiered caches"):
        prefilled(model, config, [3] * 10).extend(prefilled(model, config, [4] * 6))


def test_results_come_in_completion_order_with_their_own_ttft():
    model, config = tiny_llama(), AlisaConfig()
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(engine, lambda: AlisaCache(model, config), RowLimit(4))
    new_tokens = (12, 2, 7, 0)
    results = list(scheduler.run(requests(prompts((10, 20, 5, 8)), new_tokens)))
    # The zero-token request finishes at admission; the others in order of their lengths.
    assert [r.id for r in results] == [3, 1, 2, 0]
    assert [len(r.token_ids) for r in results] == [0, 2, 7, 12]
    assert all(r.finish_reason == "length" for r in results)
    assert all(0 < r.ttft_s <= r.latency_s for r in results if r.token_ids)
    assert scheduler.stats.generated_tokens == sum(new_tokens) and scheduler.stats.finished == 4


def test_a_request_too_large_even_alone_is_reported_not_run():
    model, config = tiny_llama(), AlisaConfig()
    spec = model_spec(model, model_shape(model))
    budget = running_memory(spec, config, [(20, 10)]).kv
    admission = ByteBudget(spec=spec, config=config, kv_bytes=budget)
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(engine, lambda: AlisaCache(model, config), admission)
    results = list(scheduler.run(requests(prompts((200, 10)), (10, 3))))
    assert [(r.id, r.finish_reason) for r in results] == [(0, "did_not_fit"), (1, "length")]
    assert "even alone" in results[0].error and results[0].token_ids == []


def test_stream_generate_completes_strings_and_stops_at_eos():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    texts = ["the cat sat", "a much longer prompt about dogs and cats", "hi"]
    results = list(stream_generate(model, tokenizer, texts, max_new_tokens=5, max_rows=2))
    assert sorted(r.id for r in results) == [0, 1, 2]
    assert all(r.finish_reason in ("stop", "length") and r.text is not None for r in results)
    assert model.config._attn_implementation == "sdpa"  # restored when the stream ended


def test_bad_requests_and_options_are_refused():
    with pytest.raises(ValueError, match="empty"):
        StreamRequest(prompt_ids=[], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        StreamRequest(prompt_ids=[4], max_new_tokens=-1)
    with pytest.raises(ValueError, match="prefill_rows"):
        ContinuousScheduler(Engine(tiny_llama()), lambda: None, prefill_rows=0)
    with pytest.raises(ValueError, match="prefill_tokens"):
        ContinuousScheduler(Engine(tiny_llama()), lambda: None, prefill_tokens=0)
    assert RowLimit(2).admits([RowShape(3, 4)], [RowShape(5, 6)])
    assert not RowLimit(2).admits([RowShape(3, 4)] * 2, [RowShape(5, 6)])


def test_prefill_tokens_bounds_each_prefill_forward_and_keeps_the_tokens():
    """Newcomers share a prefill only while rows x longest prompt fits prefill_tokens (the
    first always joins, however long), and the rows' tokens are those of unbounded prefills."""
    model, config, ids = tiny_llama(), AlisaConfig(), prompts()
    widths = []

    class Counting(Engine):
        def step(self, state, cache):
            if state.feed.shape[1] > 1:  # a prefill forward: the newcomers' padded prompts
                widths.append(tuple(state.feed.shape))
            return super().step(state, cache)

    def run(prefill_tokens):
        widths.clear()
        engine = Counting(model, byte_tokenizer(), stop_at_eos=False)
        scheduler = ContinuousScheduler(
            engine,
            lambda: AlisaCache(model, config),
            RowLimit(4),
            prefill_rows=4,
            prefill_tokens=prefill_tokens,
            packing=False,  # newcomers in prefill forwards of their own, as with a hybrid model
        )
        results = {r.id: r.token_ids for r in scheduler.run(requests(ids))}
        return results, list(widths)

    bounded, shapes = run(40)
    assert all(rows == 1 or rows * width <= 40 for rows, width in shapes)
    assert any(width > 40 for _, width in shapes)  # the 41-token prompt, alone
    assert sum(rows for rows, _ in shapes) == len(ids)
    unbounded, wide = run(None)
    assert max(rows for rows, _ in wide) > max(rows for rows, _ in shapes)
    assert bounded == unbounded


@pytest.mark.parametrize("name", ["drop r=1", "swa host r=0.3", "swa int8 r=0.5"])
def test_newcomers_joining_running_rows_ride_in_their_decode_step(name):
    """With rows running, each newcomer is prefilled in the running rows' next decode step (one
    (1, B + T) forward); every row's tokens are those of separate forwards, in fewer forwards."""
    model, ids = tiny_llama(), prompts()
    config = {**EXACT_DENSE, **SPARSE}[name]

    records = []  # (mixed forwards so far, tokens) at each record

    def run(packing):
        engine = Forwards(model, byte_tokenizer(), stop_at_eos=False)
        scheduler = ContinuousScheduler(
            engine,
            lambda: AlisaCache(model, config),
            RowLimit(3),
            packing=packing,
            on_step=lambda record: records.append((len(engine.mixed), record.tokens)),
        )
        results = {r.id: r.token_ids for r in scheduler.run(requests(ids))}
        return results, engine

    packed, mixed = run(True)
    # Every mixed forward is recorded as it happens (timelines and progress never stall).
    assert all(later - earlier <= 1 for (earlier, _), (later, _) in pairwise(records))
    assert sum(tokens for _, tokens in records) == sum(map(len, packed.values()))
    separate, plain = run(False)
    assert packed == separate
    assert not plain.mixed and mixed.mixed
    # Every prompt is prefilled once: alone in a mixed forward, or in a prefill forward (the
    # first ones, while nothing runs).
    prefilled = [rows for rows, width in mixed.plain if width > 1]
    assert len(mixed.mixed) + sum(prefilled) == len(ids)
    assert all(rows >= 1 for rows, _ in mixed.mixed)
    # Each mixed forward is also the running rows' decode step: fewer forwards in all.
    assert len(mixed.plain) + len(mixed.mixed) < len(plain.plain)


def test_models_a_mixed_forward_would_change_prefill_alone():
    from alisa.runtime.continuous import packs

    assert packs(tiny_llama())
    assert not packs(tiny_gpt2())  # learned positions
    assert not packs(MODELS["gemma3-hybrid"]())  # sliding-window layers
    assert not packs(MODELS["mistral-window"]())


def test_a_mixed_forward_needs_a_running_cache_and_an_empty_one_of_one_config():
    from alisa.kv.cache import PackedCache

    model = tiny_llama()
    running = AlisaCache(model, AlisaConfig())
    with torch.inference_mode():
        Engine(model, None).forward(DecodeState.start(torch.tensor([[5, 6, 7]])), running)
    with pytest.raises(ValueError, match="empty cache"):
        PackedCache(AlisaCache(model, AlisaConfig()), AlisaCache(model, AlisaConfig()), 1)
    with pytest.raises(ValueError, match="empty cache"):
        PackedCache(running, running, 1)
    other = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))
    with pytest.raises(ValueError, match="different configs"):
        PackedCache(running, other, 1)
