"""Every family is exact at r = 1 (drop and host) or refused when the cache is built, never run
wrong: a crash after construction or a silent difference fails its row. Under a device budget,
offload never changes a token, and recomputation either does not either or is refused."""

import pytest
import torch
from conftest import hf_generate, padded_batch

from alisa import AlisaCache, AlisaConfig
from alisa.model.adapter import model_shape
from experiments.architectures import EXACT, FAMILIES, build

NEW = 6
MODES = {
    "drop": AlisaConfig(),
    "host": AlisaConfig(policy="swa", caching_ratio=1.0, retention="host"),
    "int8": AlisaConfig(kv_bits=8, residual_tokens=64),
}
EXACT_FAMILIES = sorted(name for name, family in FAMILIES.items() if family.expected == EXACT)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_exact_or_refused_at_construction(name):
    family = FAMILIES[name]
    model = build(family)
    if family.expected != EXACT:
        with pytest.raises(ValueError, match=family.expected):
            AlisaCache(model, AlisaConfig())
        return
    ids, mask = padded_batch(lengths=(12, 7))
    reference = hf_generate(model, ids, mask, max_new_tokens=NEW)
    for mode, config in MODES.items():
        ours = hf_generate(model, ids, mask, AlisaCache(model, config), max_new_tokens=NEW)
        assert torch.equal(ours, reference), f"{name} differs from HF in mode {mode}"


def tier_budget(model) -> int:
    """Weights, working room and about 40 % of the prompts' KV: the rest leaves the device."""
    weights = sum(p.nbytes for p in model.parameters())
    kv_token = model_shape(model).kv_values_per_token * 4
    return weights + 20_000 + int(0.4 * 2 * (40 + NEW) * kv_token)


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_offload_is_exact_and_recompute_is_exact_or_refused(name):
    model = build(FAMILIES[name])
    if model_shape(model).hybrid:  # tiers are planned for full-attention layers only
        with pytest.raises(ValueError, match="sliding-window layers"):
            AlisaCache(model, AlisaConfig(gpu_memory=tier_budget(model)))
        return
    ids, mask = padded_batch(lengths=(40, 30))
    reference = hf_generate(model, ids, mask, max_new_tokens=NEW)
    for recompute in ("never", "auto", "always"):
        config = AlisaConfig(gpu_memory=tier_budget(model), recompute=recompute)
        try:
            cache = AlisaCache(model, config, max_new_tokens=NEW)
            ours = hf_generate(model, ids, mask, cache, max_new_tokens=NEW)
        except ValueError as error:
            # Only recomputation may be refused, and only because it would not be exact.
            assert recompute == "always", f"{name}, recompute={recompute}: {error}"
            assert "cannot recompute" in str(error) or "cannot be recomputed" in str(error)
            continue
        assert torch.equal(ours, reference), f"{name} differs with recompute={recompute}"
        tiers = cache.tier_tokens()
        assert tiers["host"] + tiers["recompute"] > 0, tiers  # the budget pushed KV out


def test_keys_the_recomputer_cannot_rebuild_are_refused_or_kept_on_the_host():
    """Qwen3 normalises keys before RoPE (k_norm), which the recomputer does not replay: with
    recompute="always" the cache says so at the prefill; with "auto" it offloads instead."""
    model = build(FAMILIES["qwen3"])
    ids, mask = padded_batch(lengths=(40, 30))
    reference = hf_generate(model, ids, mask, max_new_tokens=NEW)
    always = AlisaConfig(gpu_memory=tier_budget(model), recompute="always")
    with pytest.raises(ValueError, match=r"layer 0's keys .* cannot be recomputed exactly"):
        hf_generate(
            model, ids, mask, AlisaCache(model, always, max_new_tokens=NEW), max_new_tokens=NEW
        )
    auto = AlisaConfig(gpu_memory=tier_budget(model), recompute="auto")
    cache = AlisaCache(model, auto, max_new_tokens=NEW)
    assert torch.equal(hf_generate(model, ids, mask, cache, max_new_tokens=NEW), reference)
    tiers = cache.tier_tokens()
    assert tiers["recompute"] == 0 and tiers["host"] > 0


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen2-window"])
def test_sliding_layers_hold_their_window_and_the_ratio_applies_to_full_layers(name):
    """A sliding layer holds W - 1 tokens, as transformers' own cache, whatever the policy; a
    full layer of the same model keeps its policy's budget."""
    model = build(FAMILIES[name])
    shape = model_shape(model)
    ids, mask = padded_batch(lengths=(30, 21, 5))
    reference = hf_generate(model, ids, mask, max_new_tokens=20)
    config = AlisaConfig(policy="swa", caching_ratio=0.25, min_budget_tokens=4)
    cache = AlisaCache(model, config)
    ours = hf_generate(model, ids, mask, cache, max_new_tokens=20)
    for index, layer in enumerate(cache.layers):
        window = shape.window(index)
        if window is not None:
            assert layer.is_sliding and (layer.slots.kept == window - 1).all()
        else:
            seen = layer.slots.lengths()
            assert not layer.is_sliding
            assert (layer.slots.kept == layer.keeper.policy.budget(seen)).all()
    if all(shape.window(index) is not None for index in range(shape.num_layers)):
        assert torch.equal(ours, reference)  # every layer windowed: nothing else was dropped


def test_the_summary_line_says_what_sliding_layers_keep():
    from alisa.commands.generate import window_note

    assert window_note(model_shape(build(FAMILIES["gemma3"]))) == (
        "2 sliding layers keep their 8-token window; r applies to the 1 full-attention layer"
    )
    assert window_note(model_shape(build(FAMILIES["llama"]))) == ""


def test_batch_sizing_counts_a_sliding_layer_at_its_window():
    """Sizing and the cache agree on a hybrid model: full layers keep their budget, sliding
    layers W tokens (the window a step attends to), never the ratio of every token seen."""
    from alisa.jobs.sizing import kept_tokens
    from alisa.planning.spec import model_spec

    model = build(FAMILIES["gemma3"])
    spec = model_spec(model, model_shape(model))
    assert spec.windows == (8, 8, None)
    config = AlisaConfig(policy="swa", caching_ratio=0.25, min_budget_tokens=4)
    assert kept_tokens(config, 3, 100, spec.windows).tolist() == [8, 8, 25]
    assert kept_tokens(None, 3, 100, spec.windows).tolist() == [8, 8, 100]


def test_the_supported_models_report_runs_the_same_rows(capsys):
    from experiments.architectures import main

    main(["--families", "gpt_neox,bloom"])
    table = capsys.readouterr().out
    assert "| gpt_neox | `GPTNeoXForCausalLM` | yes / yes / yes |" in table
    assert (
        "| bloom | `BloomForCausalLM` | refused: its modeling code computes attention inline"
        in table
    )


def test_a_sliding_layer_allocates_its_window_and_no_more():
    """After a prompt longer than the window, each sliding layer's buffers shrink to exactly W
    slots (W - 1 held, one for the new token) and stay there while decoding."""
    model = build(FAMILIES["mistral"])
    ids = torch.randint(2, 500, (2, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    reference = hf_generate(model, ids, mask, max_new_tokens=12)
    cache = AlisaCache(model, AlisaConfig())
    assert torch.equal(hf_generate(model, ids, mask, cache, max_new_tokens=12), reference)
    assert all(layer.store.capacity == 8 for layer in cache.layers)


@pytest.mark.parametrize(
    ("name", "knob", "strong", "off"),
    [
        ("gemma2", "attn_logit_softcapping", 0.5, None),  # caps every logit to +-0.5
        ("gpt_oss", "sinks", 4.0, -1e4),  # a sink that takes most of the mass, or none
    ],
)
def test_soft_capping_and_sinks_change_the_tokens_and_alisa_applies_them(name, knob, strong, off):
    """A strong cap or sink changes HF's own tokens, and alisa matches HF with it: the rows
    above would pass even if alisa ignored a knob too weak to matter on a tiny model."""

    def with_knob(value):
        model = build(FAMILIES[name])
        for module in model.modules():
            if knob == "sinks" and isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.data.fill_(value)
            if knob == "attn_logit_softcapping" and hasattr(module, knob):
                setattr(module, knob, value)
                module.q_proj.weight.data *= 500  # logits of tens of units: the cap bites
        return model

    ids, mask = padded_batch(lengths=(12, 7))
    strong_model = with_knob(strong)
    reference = hf_generate(strong_model, ids, mask, max_new_tokens=NEW)
    plain = hf_generate(with_knob(off), ids, mask, max_new_tokens=NEW)
    assert not torch.equal(reference, plain), f"{knob}={strong} changes nothing: a weak test"
    for mode, config in MODES.items():
        cache = AlisaCache(strong_model, config)
        ours = hf_generate(strong_model, ids, mask, cache, max_new_tokens=NEW)
        assert torch.equal(ours, reference), f"{name} with {knob}={strong} differs in {mode}"


@pytest.mark.parametrize(
    ("name", "reason"),
    [("gemma3", "sliding-window layers"), ("gemma2-all-full", "soft-capping"), ("gpt_oss", "")],
)
def test_parallel_paths_refuse_what_their_own_attention_does_not_apply(name, reason):
    from conftest import byte_tokenizer

    from alisa.parallel import parallel_generate

    with pytest.raises(ValueError, match=reason or "sliding-window layers"):
        parallel_generate(build(FAMILIES[name]), byte_tokenizer(), "hello")
