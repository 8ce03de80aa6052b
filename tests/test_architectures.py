"""Every family is exact at r = 1 (drop, host, INT8) or refused when the cache is built, never
run wrong: a crash after construction or a silent difference fails its row, and so does a model
type of transformers' causal-LM mapping that is neither exact nor listed. Under a device budget,
offload never changes a token, and recomputation either does not either or is refused."""

import pytest
import torch
from architectures import (
    EXACT,
    FAMILIES,
    NOT_RUN,
    OVERRIDES,
    REFUSED,
    VARIANTS,
    build,
    families,
    run_family,
)
from conftest import Forwards, hf_generate, padded_batch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from alisa import AlisaCache, AlisaConfig
from alisa.model.adapter import model_shape

NEW = 6
MODES = {
    "drop": AlisaConfig(),
    "host": AlisaConfig(policy="swa", budget_tokens=10_000, retention="host"),  # runs HostKeeper
    "int8": AlisaConfig(kv_bits=8, residual_tokens=64),
}
EXACT_FAMILIES = sorted(name for name, family in FAMILIES.items() if family.expected == EXACT)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_exact_or_refused_at_construction(name):
    family = FAMILIES[name]
    outcome = run_family(name, family)
    assert outcome.owed(family), (
        f"{name} ({outcome.model}): {outcome.status} {outcome.detail!r}; owed {family.expected!r}"
    )


def test_every_model_type_of_the_mapping_is_a_row_or_says_why_not():
    mapping = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = {family.model_type for name, family in FAMILIES.items() if name not in VARIANTS}
    assert rows | set(NOT_RUN) == mapping and not rows & set(NOT_RUN)
    # No stale entry: every table names model types transformers still has.
    listed = [model_type for types in REFUSED.values() for model_type in types]
    assert set(listed) | set(OVERRIDES) <= mapping
    assert len(listed) == len(set(listed)) and not set(listed) & set(NOT_RUN)
    assert {family.model_type for family in VARIANTS.values()} <= rows


def test_a_model_type_a_new_release_adds_is_a_row_owed_exactness():
    rows = families(("llama", "bart", "brand_new_model"))
    assert rows["brand_new_model"].expected == EXACT  # run, so it fails until exact or listed
    assert "bart" not in rows  # listed in NOT_RUN with its reason
    assert rows["llama"].expected == EXACT


def test_a_refused_row_owes_the_reason_not_just_any_refusal():
    from architectures import Outcome

    family = FAMILIES["bloom"]
    right = Outcome(family="bloom", model="", status="refused", detail=family.expected + " ...")
    wrong = Outcome(family="bloom", model="", status="refused", detail="config lacks hidden_size")
    crash = Outcome(family="llama", model="", status="crash", detail="drop: RuntimeError")
    assert right.owed(family) and not wrong.owed(family)
    assert not crash.owed(FAMILIES["llama"])


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


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_continuous_batching_mixes_forwards_only_where_that_changes_no_token(name):
    """A newcomer rides in the running rows' decode step (one mixed forward) exactly for the
    families :func:`packs` accepts, and every row's tokens are those of separate forwards."""
    from alisa.runtime.continuous import ContinuousScheduler, packs
    from alisa.runtime.requests import RowLimit, StreamRequest

    model = build(FAMILIES[name])
    generator = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (12, 7, 9)]

    def run(packing: bool) -> tuple[dict, Forwards]:
        engine = Forwards(model, None, stop_at_eos=False)
        scheduler = ContinuousScheduler(
            engine, lambda: AlisaCache(model, AlisaConfig()), RowLimit(2), packing=packing
        )
        stream = [
            StreamRequest(prompt_ids=p, max_new_tokens=n, id=i)
            for i, (p, n) in enumerate(zip(ids, (5, 2, 4), strict=True))
        ]
        return {r.id: r.token_ids for r in scheduler.run(stream)}, engine

    mixed, engine = run(True)
    separate, _ = run(False)
    assert mixed == separate
    assert bool(engine.mixed) == packs(model)


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


@pytest.mark.parametrize("name", ["mistral", "gemma3_text", "qwen2-window"])
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

    assert window_note(model_shape(build(FAMILIES["gemma3_text"]))) == (
        "2 sliding layers keep their 8-token window; r applies to the 1 full-attention layer"
    )
    assert window_note(model_shape(build(FAMILIES["llama"]))) == ""


def test_batch_sizing_counts_a_sliding_layer_at_its_window():
    """Sizing and the cache agree on a hybrid model: full layers keep their budget, sliding
    layers W tokens (the window a step attends to), never the ratio of every token seen."""
    from alisa.jobs.sizing import kept_tokens
    from alisa.planning.spec import model_spec

    model = build(FAMILIES["gemma3_text"])
    spec = model_spec(model, model_shape(model))
    assert spec.windows == (8, 8, None)
    config = AlisaConfig(policy="swa", caching_ratio=0.25, min_budget_tokens=4)
    assert kept_tokens(config, 3, 100, spec.windows).tolist() == [8, 8, 25]
    assert kept_tokens(None, 3, 100, spec.windows).tolist() == [8, 8, 100]


def test_the_supported_models_report_groups_the_rows_by_outcome(capsys, tmp_path):
    from architectures import main

    doc = tmp_path / "supported-models.md"
    main(["--families", "gpt_neox,bloom,llama", "--write", str(doc)])
    table = capsys.readouterr().out
    assert "3 rows (transformers " in table and ": 2 exact, 1 refused, 0 crash, 0 differs" in table
    assert "| exact at r = 1 (drop / host / INT8) (2) | `gpt_neox`, `llama` |" in table
    assert "| refused: its modeling code computes attention inline" in table
    assert table.splitlines()[-1].startswith('{"benchmark": "architectures"')
    written = doc.read_text()
    assert (
        written.startswith("# Supported models\n") and "--write docs/supported-models.md" in written
    )
    assert "| `gpt_neox` | `GPTNeoXForCausalLM` | exact |" in written
    assert (
        "| `bloom` | `BloomForCausalLM` | refused: its modeling code computes attention" in written
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
    [
        ("gemma3_text", "sliding-window layers"),
        ("gemma2-all-full", "soft-capping"),
        ("gpt_oss", ""),
    ],
)
def test_parallel_paths_refuse_what_their_own_attention_does_not_apply(name, reason):
    from conftest import byte_tokenizer

    from alisa.parallel import parallel_generate

    with pytest.raises(ValueError, match=reason or "sliding-window layers"):
        parallel_generate(build(FAMILIES[name]), byte_tokenizer(), "hello")


def test_the_host_mode_runs_host_retention():
    """The matrix's host mode builds host retention on every full-attention layer (at r = 1 a
    policy evicts nothing, so the cache would drop instead and the mode test nothing new)."""
    from architectures import MODES as MATRIX_MODES
    from conftest import tiny_llama

    from alisa.kv.host import HostKeeper

    model = tiny_llama()
    for config in (MODES["host"], AlisaConfig(**MATRIX_MODES["host"])):
        cache = AlisaCache(model, config)
        assert all(isinstance(layer.keeper, HostKeeper) for layer in cache.layers)
