"""The compiled decode step (alisa.runtime.compiled): exact, one graph, refused where it cannot."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, tiny_llama
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

from alisa import AlisaCache, AlisaConfig, generate
from alisa.cli import main
from alisa.runtime.compiled import CompileChoice, choose_compile, settle_compile
from alisa.runtime.generate import new_cache

PROMPTS = ["a longer prompt than the others", "short", "middle one"]
NEW = 12


def static_cache(model, tokenizer) -> StaticCache:
    """A StaticCache for PROMPTS (left-padded to the longest) and NEW tokens."""
    width = tokenizer(PROMPTS, return_tensors="pt", padding=True)["input_ids"].shape[1]
    return StaticCache(config=model.config, max_cache_len=width + NEW)


def test_compiled_steps_equal_eager_ones_in_one_graph(caplog):
    """Padded rows, a StaticCache: the compiled decode gives the eager tokens (and HF's dense
    cache's), compiles one graph for all its steps and reports its compile time; the first
    step of the shape says it compiles (minutes on a CPU, which looked like a hang)."""
    caplog.set_level("INFO", logger="alisa")
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run = dict(max_new_tokens=NEW, stop_at_eos=False)
    dense = generate(model, tokenizer, PROMPTS, past_key_values=DynamicCache(), **run)
    eager = generate(
        model, tokenizer, PROMPTS, past_key_values=static_cache(model, tokenizer), **run
    )
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(
        model,
        tokenizer,
        PROMPTS,
        past_key_values=static_cache(model, tokenizer),
        compile="on",
        **run,
    )
    assert compiled.token_ids == eager.token_ids == dense.token_ids
    assert counters["stats"]["unique_graphs"] == 1  # every decode step replayed the first graph
    assert eager.compile_s is None and compiled.compile_s > 0
    said = [r.getMessage() for r in caplog.records if "compiling the decode step" in r.getMessage()]
    assert len(said) == 1 and "for 3 rows of" in said[0], said  # once: one shape
    again = generate(
        model,
        tokenizer,
        PROMPTS,
        past_key_values=static_cache(model, tokenizer),
        compile="on",
        **run,
    )
    assert again.token_ids == eager.token_ids
    assert counters["stats"]["unique_graphs"] == 1  # a new cache of the same shape: no recompile


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"compile": "yes"}, "compile='yes' must be one of 'auto', 'on', 'off'"),
        ({"compile": True}, "compile=True must be one of"),
        ({"compile": "on", "past_key_values": "alisa"}, "AlisaCache's decode step cannot be"),
        ({"compile": "on", "past_key_values": DynamicCache()}, "DynamicCache's decode step"),
        (
            {
                "compile": "on",
                "config": AlisaConfig(kv_bits=4, policy="swa", caching_ratio=0.3, retention="host"),
            },
            "kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
            "has no static (compiled) decode step yet",
        ),
        (
            {"compile": "on", "prune_finished": True},
            "compile='on' runs one static batch, and prune_finished=True drops",
        ),
    ],
    ids=["unknown", "bool", "growing-alisa-cache", "dynamic-cache", "int8", "prune"],
)
def test_compile_refused_naming_the_value_and_the_cache(options, needle):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    if options.get("past_key_values") == "alisa":  # built without max_cache_len: it grows
        options = {**options, "past_key_values": AlisaCache(model, AlisaConfig())}
    if "past_key_values" not in options:
        options = {"config": AlisaConfig(), **options}
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        generate(model, tokenizer, PROMPTS, max_new_tokens=2, **options)


def test_an_alisa_cache_says_whether_it_can_be_compiled():
    """The cache interface's own answer, which HF's generate reads before it auto-compiles:
    only a static cache (built with max_cache_len) says yes."""
    model = tiny_llama()
    assert AlisaCache(model, AlisaConfig()).is_compileable is False
    assert AlisaCache(model, AlisaConfig(), max_cache_len=64).is_compileable is True


def test_the_static_anchors_decode_in_turns_as_hf_dynamic_does():
    """``bench_speed --interleave``'s HF anchors: StaticCache eager and compiled give
    DynamicCache's tokens; only the compiled one reports a compile time (from its warm-up, so
    the timed steps replay the graph)."""
    from experiments.interleave import interleaved_rows

    model, tokenizer = tiny_llama(), byte_tokenizer()
    systems = ["hf-dynamic", "hf-static", "hf-static-compiled"]
    torch._dynamo.reset()
    counters.clear()
    rows = interleaved_rows(model, tokenizer, PROMPTS, systems, 6, 2, "hf-dynamic")
    tokens = {row["system"]: row["token_ids"] for row in rows}
    assert tokens["hf-static"] == tokens["hf-static-compiled"] == tokens["hf-dynamic"]
    assert [row["compile_s"] is None for row in rows] == [True, True, False]
    assert counters["stats"]["unique_graphs"] == 1  # warm-up and timed run share one graph


def test_auto_compiles_on_cuda_and_runs_eager_on_a_cpu():
    """``"auto"`` reads the device (a CPU: eager, its compile time outweighs a call's saving);
    ``"on"`` and ``"off"`` are the user's."""
    cpu, cuda = choose_compile("auto", "cpu"), choose_compile("auto", torch.device("cuda"))
    assert (cpu.compiled, cuda.compiled) == (False, True)
    assert cpu.describe().startswith("off (auto: a CPU") and cuda.reason.startswith("auto: CUDA")
    assert choose_compile("on", "cpu") == CompileChoice(asked="on", compiled=True, reason="asked")
    assert choose_compile("off", "cuda").describe() == "off (asked)"


def test_auto_on_cuda_captures_a_step_that_frees_slots():
    """On CUDA ``"auto"`` captures every mode with a static step, the dropping one too: its
    capture at 16 x 8K stopped at a device-side assert in the sixth GPU run (an inductor
    ``argmax`` of an int8 mask gave an index past the row), fixed by
    :func:`alisa.kv.slots.first_free` and captured at 2.9x HF's StaticCache in the seventh
    (docs/gpu.md)."""
    cuda = choose_compile("auto", torch.device("cuda"))
    model = tiny_llama()  # the choice is the device's; the cache is built on this CPU model
    for config in (AlisaConfig(policy="swa", caching_ratio=0.3), AlisaConfig(caching_ratio=1.0)):
        cache, settled = new_cache(model, config, 8, 40, cuda)
        assert cache.max_cache_len == 128 and settled == cuda  # 40 tokens' capacity bucket


def test_auto_settles_eager_where_the_cache_cannot_compile_and_on_refuses():
    """A mode without a static step, or a growing cache given: ``"auto"`` runs eager and says
    why; ``"on"`` is refused naming the setting."""
    model = tiny_llama()
    wants = CompileChoice(asked="auto", compiled=True, reason="auto: CUDA")
    cache, settled = new_cache(
        model,
        AlisaConfig(kv_bits=4, policy="swa", caching_ratio=0.3, retention="host"),
        4,
        16,
        wants,
    )
    assert cache.max_cache_len is None and not cache.is_compileable
    assert settled.describe() == (
        "off (auto: kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
        "has no static (compiled) decode step yet (kv_bits=8 over host_bits=8, one scale a row, "
        "has))"
    )
    cache, settled = new_cache(model, AlisaConfig(policy="swa", caching_ratio=0.5), 4, 16, wants)
    assert cache.max_cache_len == 128 and settled == wants
    with pytest.raises(
        ValueError,
        match="kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
        "has no static",
    ):
        new_cache(
            model,
            AlisaConfig(kv_bits=4, policy="swa", caching_ratio=0.3, retention="host"),
            4,
            16,
            CompileChoice(**{**vars(wants), "asked": "on"}),
        )
    settled = settle_compile(wants, DynamicCache())
    assert settled.describe() == "off (auto: DynamicCache's step changes shape)"
    with pytest.raises(ValueError, match="DynamicCache's decode step cannot be compiled"):
        settle_compile(CompileChoice(asked="on", compiled=True, reason="asked"), DynamicCache())


def test_generate_says_whether_its_steps_ran_compiled():
    """The default is ``"auto"``: on a CPU the eager tokens, reported as such."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run = dict(max_new_tokens=3, stop_at_eos=False)
    auto = generate(model, tokenizer, PROMPTS, **run)
    off = generate(model, tokenizer, PROMPTS, compile="off", **run)
    assert auto.token_ids == off.token_ids and auto.compile_s is None
    assert auto.compile.describe().startswith("off (auto: a CPU")
    assert off.compile == CompileChoice(asked="off", compiled=False, reason="asked")


def test_the_cli_takes_compile_and_shows_what_it_settled(tmp_path, capsys):
    """``--compile`` is checked by the parser; ``--show-config`` and the [alisa] line say
    whether the steps ran compiled."""
    tiny_llama().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    argv = ["generate", "hello", "--model", str(tmp_path), "--max-new-tokens", "2"]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--compile", "maybe"])
    assert (
        stopped.value.code == 2 and "--compile: invalid choice: 'maybe'" in capsys.readouterr().err
    )
    assert main([*argv, "--show-config"]) == 0
    err = capsys.readouterr().err
    assert "\ncompile: off (auto: a CPU" in err
    assert "| compile off (auto)" in err.split("[alisa]")[1]
    host = ["--kv-bits", "4", "--retention", "host", "--policy", "swa", "--caching-ratio", "0.3"]
    assert main([*argv, "--compile", "on", *host]) == 1
    assert (
        "kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
        "has no static (compiled) decode step yet" in capsys.readouterr().err
    )


def test_a_compiled_step_after_another_caches_forward_attends_with_alisa():
    """An HF cache's forward on the same model switches its attention back to the one it had
    (the attachment's hook); a compiled step, which calls ``model.forward`` without hooks,
    switches it to alisa's again (it was refused: "attn_implementation='sdpa' is incompatible
    with AlisaCache", whenever ``bench_speed --interleave`` ran an HF system just before a
    compiled one)."""
    from experiments.interleave import interleaved_rows

    model, tokenizer = tiny_llama(), byte_tokenizer()
    systems = ["hf-static", "alisa-compiled:caching_ratio=1.0"]
    rows = interleaved_rows(model, tokenizer, PROMPTS, systems, 6, 2, "hf-static")
    tokens = {row["system"]: row["token_ids"] for row in rows}
    assert tokens["alisa-compiled:caching_ratio=1.0"] == tokens["hf-static"]
