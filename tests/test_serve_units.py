"""The parts of ``alisa serve`` without HTTP: the scheduler's cancel and progress, the engine
thread's groups and cancels, answers decoded as they come, request parsing and settings."""

from __future__ import annotations

import queue
import threading

import pytest
import serve_support
from conftest import byte_tokenizer, tiny_llama
from serve_support import load, model_dir, running_server, wait_for
from test_continuous import alisa_alone, prompts, requests
from test_preemption import Squeeze

from alisa import AlisaCache, AlisaConfig
from alisa.jobs.sizing import running_memory
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.requests import RowLimit
from alisa.runtime.sampling import SamplingOptions
from alisa.serve import ServeSettings
from alisa.serve.engine import Delta, Failed, Finished, Job, ServeEngine
from alisa.serve.errors import APIError
from alisa.serve.metrics import ServeMetrics
from alisa.serve.prepare import Prepared
from alisa.serve.protocol import parse_chat, parse_completion
from alisa.serve.text import TextStream

LENGTHS, NEW = (23, 6, 41), (12, 10, 9)

# ---- the scheduler's cancel and progress ------------------------------------------------


def scheduler_of(model, admission=None):
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    return ContinuousScheduler(engine, lambda: AlisaCache(model), admission or RowLimit(4))


def test_a_cancelled_running_row_frees_its_kv_now_and_the_others_go_on_as_alone():
    model, ids = tiny_llama(), prompts(LENGTHS)
    scheduler = scheduler_of(model)
    for request in requests(ids, NEW):
        scheduler.submit(request)
    while len(scheduler.rows) < 3:
        scheduler.step()
    held = scheduler.stats.kv_bytes
    assert scheduler.cancel(1)
    assert [row_id for row_id, _ in scheduler.progress()] == [0, 2]
    assert scheduler.stats.kv_bytes < held and scheduler.stats.running == 2
    assert not scheduler.cancel(1)  # gone: a second cancel finds nothing
    results = []
    while not scheduler.idle:
        results += scheduler.step()
    assert sorted(r.id for r in results) == [0, 2]
    for result in results:
        assert result.token_ids == alisa_alone(model, None, ids[result.id], NEW[result.id])


def test_cancelling_the_last_row_leaves_no_kv_and_a_queued_one_never_runs():
    model, ids = tiny_llama(), prompts(LENGTHS)
    scheduler = scheduler_of(model, RowLimit(1))
    for request in requests(ids, NEW):
        scheduler.submit(request)
    scheduler.step()
    assert scheduler.cancel(2)  # waiting in the queue
    assert scheduler.cancel(0)  # the only running row
    assert scheduler.stats.kv_bytes == 0 and scheduler.cache is None
    results = []
    while not scheduler.idle:
        results += scheduler.step()
    assert [r.id for r in results] == [1]


def test_a_paused_row_can_be_cancelled_and_the_others_resume_as_alone():
    model, ids = tiny_llama(), prompts(LENGTHS)
    squeeze = Squeeze(3)
    scheduler = scheduler_of(model, squeeze)
    for request in requests(ids, NEW):
        scheduler.submit(request)
    while len(scheduler.rows) < 3:
        scheduler.step()
    squeeze.squeezed = True
    scheduler.step()
    paused = [entry.row.request.id for entry in scheduler.paused]
    assert len(paused) == 2
    assert scheduler.cancel(paused[0]) and len(scheduler.paused) == 1
    squeeze.squeezed = False
    results = []
    while not scheduler.idle:
        results += scheduler.step()
    assert sorted(r.id for r in results) == sorted({0, 1, 2} - {paused[0]})
    for result in results:
        assert result.token_ids == alisa_alone(model, None, ids[result.id], NEW[result.id])


def test_progress_shows_each_running_rows_tokens_so_far():
    model, ids = tiny_llama(), prompts(LENGTHS)
    scheduler = scheduler_of(model)
    for request in requests(ids, NEW):
        scheduler.submit(request)
    seen: dict[int, list[int]] = {}
    results = []
    while not scheduler.idle:
        results += scheduler.step()
        for row_id, tokens in scheduler.progress():
            assert tokens[: len(seen.get(row_id, []))] == seen.get(row_id, [])
            seen[row_id] = list(tokens)
    for result in results:
        assert result.token_ids[: len(seen[result.id])] == seen[result.id]


# ---- the engine thread --------------------------------------------------------------------


@pytest.fixture
def engine():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    settings = ServeSettings(model_name="tiny")
    metrics = ServeMetrics(settings.config, settings.budgets)
    engine = ServeEngine(model, tokenizer, settings, metrics)
    engine.start()
    yield engine
    engine.stop(60)


def job(events: queue.Queue, name: str, max_tokens: int, **options) -> Job:
    ids = tuple(byte_tokenizer()(name)["input_ids"])
    prepared = Prepared(prompt_ids=ids, max_tokens=max_tokens, config=AlisaConfig())
    return Job(
        prepared=prepared,
        sampling=options.pop("sampling", SamplingOptions()),
        deliver=lambda event: events.put((name, event)),
        **options,
    )


def ends(events: queue.Queue, count: int) -> list[tuple[str, object]]:
    """The next ``count`` events that end a job, in order."""
    found = []
    while len(found) < count:
        name, event = events.get(timeout=60)
        if isinstance(event, Finished | Failed):
            found.append((name, event))
    return found


def test_a_cancel_takes_effect_before_the_next_step(engine):
    # The request is cancelled from its first token's delivery (on the engine thread, inside a
    # step): no step may run after that one.
    events: queue.Queue = queue.Queue()
    value = engine.metrics.registry.get_sample_value
    at_cancel = []

    def leave(event):
        if not at_cancel:
            at_cancel.append(value("alisa_scheduler_steps_total"))
            engine.cancel(running)
        events.put(event)

    running = job(events, "long", 1000, ignore_eos=True, stream=True)
    running.deliver = leave
    engine.submit(running)
    wait_for(lambda: value("alisa_requests_finished_total", {"reason": "cancelled"}) == 1)
    assert value("alisa_scheduler_steps_total") == at_cancel[0]
    assert value("alisa_kv_bytes", {"tier": "device"}) == 0 and engine.open_requests == 0
    assert value("alisa_generation_tokens_total") < 1000


def test_requests_of_another_setting_wait_for_the_running_group_to_finish(engine):
    events: queue.Queue = queue.Queue()
    sampled = SamplingOptions(do_sample=True, seed=1)
    first = job(events, "first", 30, ignore_eos=True, stream=True)
    engine.submit(first)
    assert isinstance(events.get(timeout=60)[1], Delta)  # the first's group runs
    engine.submit(job(events, "other", 2, sampling=sampled, ignore_eos=True))
    engine.submit(job(events, "later", 2, ignore_eos=True))  # the first's setting, but later
    order = ends(events, 3)
    assert [name for name, _ in order] == ["first", "other", "later"]
    assert [len(event.token_ids) for _, event in order] == [30, 2, 2]


def test_a_full_queue_is_refused_at_once():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    settings = ServeSettings(model_name="tiny", max_rows=1, max_queue=1)
    engine = ServeEngine(model, tokenizer, settings, ServeMetrics(settings.config, {}))
    engine.start()
    events: queue.Queue = queue.Queue()
    held = threading.Event()  # the running row's first delivery waits for it: nothing moves
    running = job(events, "running", 3, ignore_eos=True, stream=True)
    running.deliver = lambda event: (held.wait(60), events.put(("running", event)))
    try:
        engine.submit(running)
        wait_for(lambda: engine.waiting == 0)  # it started
        engine.submit(job(events, "waiting", 1))
        with pytest.raises(APIError, match="queue is full .*--max-queue 1") as caught:
            engine.submit(job(events, "refused", 1))
        assert caught.value.status == 503 and caught.value.code == "queue_full"
        held.set()
        assert sorted(name for name, _ in ends(events, 2)) == ["running", "waiting"]
    finally:
        held.set()
        engine.stop(60)


def test_the_model_computes_on_the_thread_that_runs_the_server(tmp_path):
    """The engine runs on the thread that calls ``AlisaServer.run`` (in ``alisa serve`` the main
    thread, which loaded the model), HTTP on another: a second thread computing would start a
    second OpenMP pool, and with two pools on a machine with no spare cores each operator waits
    for its workers to wake (a third slower a step, docs/results.md)."""
    model, tokenizer = load(model_dir(tmp_path))
    computed: set[int] = set()
    model.register_forward_pre_hook(lambda module, args: computed.add(threading.get_ident()))
    settings = ServeSettings(model_name="tiny", max_tokens=4)
    with running_server(model, tokenizer, settings) as served:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        status, answer = serve_support.request(served.port, "POST", "/v1/completions", body)
        runner = served.thread.ident
    assert status == 200, answer
    assert computed == {runner}


def test_every_scheduler_a_server_starts_goes_on_with_one_products_measurement():
    """A server starts a scheduler (and an engine) per group of requests, again after each idle
    spell: each goes on with the server's one measurement of the weights' product form rather
    than alternating the forms of its first steps afresh; a group whose kernels ask another
    form gets that form's."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    settings = ServeSettings(model_name="tiny")
    engine = ServeEngine(model, tokenizer, settings, ServeMetrics(settings.config, {}))
    first = engine._scheduler(settings.config, SamplingOptions(), False)
    later = engine._scheduler(settings.config, SamplingOptions(do_sample=True, seed=1), True)
    reference = engine._scheduler(AlisaConfig(kernels="reference"), SamplingOptions(), False)
    assert first.engine.products is later.engine.products
    assert first.engine.products.asked == "measured"
    assert reference.engine.products.asked == "standard"


def test_a_stopped_engine_refuses_requests():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    settings = ServeSettings(model_name="tiny")
    engine = ServeEngine(model, tokenizer, settings, ServeMetrics(settings.config, {}))
    events: queue.Queue = queue.Queue()
    with pytest.raises(APIError, match="not running"):
        engine.submit(job(events, "early", 1))
    engine.start()
    engine.stop(60)
    with pytest.raises(APIError, match="not running"):
        engine.submit(job(events, "late", 1))


def test_rows_paused_to_host_memory_stream_on_as_if_alone():
    # Three rows admitted with room for 2 more tokens each soon outgrow a budget that holds
    # three such rows only: the newest is paused (its KV swapped to host memory) and resumed,
    # and every streamed answer is still the one its prompt gets alone.
    model, tokenizer = tiny_llama(), byte_tokenizer()
    spec = model_spec(model, model_shape(model))
    kv = running_memory(spec, AlisaConfig(), [(10, 2)] * 3).kv
    settings = ServeSettings(model_name="tiny", kv_bytes=kv, max_rows=4, reserve_tokens=2)
    engine = ServeEngine(model, tokenizer, settings, ServeMetrics(settings.config, {}))
    engine.start()
    events: queue.Queue = queue.Queue()
    gate = threading.Event()  # holds the engine until every request is in: they start together
    names = [f"prompt {index:03d}" for index in range(4)]  # 10 byte tokens each
    jobs = [job(events, name, 12, ignore_eos=True, stream=True) for name in names]
    jobs[0].deliver = lambda event: (gate.wait(60), events.put((names[0], event)))
    try:
        for each in jobs:
            engine.submit(each)
        gate.set()
        streamed = {name: [] for name in names}
        finished = {}
        while len(finished) < 4:
            name, event = events.get(timeout=60)
            streamed[name] += event.token_ids if isinstance(event, Delta) else []
            if isinstance(event, Finished):
                finished[name] = list(event.token_ids)
        value = engine.metrics.registry.get_sample_value
        assert value("alisa_preemptions_total") >= 1
    finally:
        gate.set()
        engine.stop(60)
    for name in names:
        alone = alisa_alone(tiny_llama(), None, byte_tokenizer()(name)["input_ids"], 12)
        assert streamed[name] == finished[name] == alone, name


def test_sampling_stays_per_row_in_a_group(engine):
    # Two seeded requests of one setting share a batch; each draws what it draws alone.
    events: queue.Queue = queue.Queue()
    sampled = SamplingOptions(do_sample=True, temperature=0.9, seed=5)
    engine.submit(job(events, "one", 6, sampling=sampled, ignore_eos=True))
    engine.submit(job(events, "two", 6, sampling=sampled, ignore_eos=True))
    together = {name: event.token_ids for name, event in ends(events, 2)}
    assert [len(tokens) for tokens in together.values()] == [6, 6]
    for name in ("one", "two"):
        engine.submit(job(events, name, 6, sampling=sampled, ignore_eos=True))
        assert ends(events, 1)[0][1].token_ids == together[name]


# ---- answers decoded as they come ---------------------------------------------------------


def ids(text: str) -> list[int]:
    return byte_tokenizer()(text)["input_ids"]


def test_deltas_add_up_to_the_whole_decode_holding_back_partial_characters():
    stream = TextStream(byte_tokenizer())
    pieces = []
    for token in ids("a€b"):  # the euro sign is three byte tokens
        stream.add([token])
        pieces.append(stream.delta())
    assert pieces == ["a", "", "", "€", "b"]
    assert stream.delta(final=True) == "" and stream.text == "a€b"


def test_a_stop_string_cuts_the_text_even_across_tokens_and_never_leaks():
    stream = TextStream(byte_tokenizer(), stop=("END", "xyz"))
    sent = ""
    for token in ids("abcEN"):
        stream.add([token])
        sent += stream.delta()
    assert sent == "abc" and not stream.stopped  # "EN" may begin "END": held back
    stream.add(ids("Dmore"))
    assert stream.stopped and stream.text == "abc"
    assert sent + stream.delta(final=True) == "abc"
    stream.add(ids("later"))  # nothing counts after the stop
    assert stream.text == "abc"


def test_eos_is_not_text():
    stream = TextStream(byte_tokenizer(), eos_ids=frozenset({1}))
    stream.add([*ids("ok"), 1])
    assert stream.text == "ok" and stream.tokens[-1] == 1


# ---- request bodies and settings -------------------------------------------------------------


def test_temperature_zero_is_greedy_and_vllms_top_k_minus_one_is_no_limit():
    greedy = parse_completion({"prompt": "hi", "temperature": 0, "top_p": 0.5, "seed": 3})
    assert greedy.sampling == SamplingOptions()
    sampled = parse_completion({"prompt": "hi", "temperature": 0.7, "top_k": -1, "seed": 3})
    assert sampled.sampling == SamplingOptions(do_sample=True, temperature=0.7, top_k=0, seed=3)
    assert parse_completion({"prompt": "hi"}).sampling.do_sample  # the reference's default: 1


def test_chat_text_parts_join_and_max_completion_tokens_counts():
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}],
        "max_completion_tokens": 7,
    }
    parsed = parse_chat(body)
    assert parsed.messages == (("user", "a\na"),) and parsed.max_tokens == 7


def test_cache_settings_of_a_request_are_sorted_pairs():
    parsed = parse_completion({"prompt": "hi", "alisa": {"policy": "swa", "caching_ratio": 0.2}})
    assert parsed.cache == (("caching_ratio", 0.2), ("policy", "swa"))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"model_name": ""}, "model_name=''"),
        ({"max_queue": 0}, "max_queue=0"),
        ({"max_rows": True}, "max_rows=True"),
        ({"kv_bytes": 0}, "kv_bytes=0"),
        ({"reserve_tokens": -1}, "reserve_tokens=-1"),
        ({"config": AlisaConfig(gpu_memory="1GiB")}, "device_bytes"),
        ({"config": "swa"}, "config='swa'"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        ServeSettings(**{"model_name": "m", **options})


def test_an_error_status_must_be_one_of_the_apis():
    with pytest.raises(ValueError, match="status=418"):
        APIError(status=418, message="teapot")


def test_a_stop_string_in_the_first_token_ends_the_answer_there(engine):
    """Tour 17's S2: a stop string the first generated token completes was billed as two
    tokens (the step after it ran and counted): it ends the answer at that token."""
    events: queue.Queue = queue.Queue()
    value = engine.metrics.registry.get_sample_value
    for prompt in ("prompt", "hello", "abc", "xyz", "tour", "seventeen"):  # a first token
        engine.submit(job(events, prompt, 4, ignore_eos=True))  # that is a whole character
        ((_, free),) = ends(events, 1)
        first = byte_tokenizer().decode(free.token_ids[:1])
        if first.isascii() and first.strip():
            break
    before = (value("alisa_generation_tokens_total"), value("alisa_scheduler_steps_total"))
    engine.submit(job(events, prompt, 4, ignore_eos=True, stop=(first,)))
    ((_, stopped),) = ends(events, 1)
    assert stopped.finish_reason == "stop" and stopped.text == ""
    assert stopped.token_ids == free.token_ids[:1]
    assert value("alisa_generation_tokens_total") - before[0] == 1
    assert value("alisa_scheduler_steps_total") - before[1] == 1  # no step after the stop
