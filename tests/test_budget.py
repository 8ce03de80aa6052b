"""One budget rule: the cache, batch sizing and the planner count the same kept tokens."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.jobs.sizing import batch_memory, kept_tokens
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from scheduler import KeepRule, Workload, layers_kept

LAYERS = 6
CONFIGS = [
    AlisaConfig(policy="swa", caching_ratio=0.3),
    AlisaConfig(policy="streaming", caching_ratio=0.1),  # 4 sinks by default
    AlisaConfig(policy="h2o", caching_ratio=0.4, layer_schedule="pyramid", dense_layers=2),
    AlisaConfig(policy="tova", budget_tokens=9, sink_tokens=3, dense_layers=1),
    AlisaConfig(policy="dense"),
]


def cache_kept(config: AlisaConfig, prompt_len: int) -> list[int]:
    """Tokens each layer of a real ALISA cache holds after prefilling ``prompt_len`` tokens."""
    model = tiny_llama(num_hidden_layers=LAYERS)
    cache = AlisaCache(model, config)
    ids = torch.randint(10, 200, (1, prompt_len))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [int(layer.slots.kept[0]) for layer in cache.layers]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.policy}")
def test_cache_sizing_and_planner_agree(config):
    seen = 45
    rules = config.keep_rules(LAYERS)
    expected = layers_kept(rules, np.int64(seen)).tolist()
    assert cache_kept(config, seen) == expected
    assert kept_tokens(config, LAYERS, seen).tolist() == expected
    workload = Workload(batch=3, prompt_len=seen, gen_len=1, keep=rules)
    assert workload.kept_tokens(0) == 3 * math.ceil(sum(expected) / LAYERS)


def test_sinks_pyramid_and_dense_layers_are_counted():
    kept = kept_tokens(
        AlisaConfig(
            policy="swa", caching_ratio=0.1, sink_tokens=8, dense_layers=2, min_budget_tokens=0
        ),
        4,
        40,
    )
    assert kept.tolist() == [40, 40, 9, 9]  # dense layers keep all; sinks + newest beat r*n=4
    pyramid = kept_tokens(
        AlisaConfig(policy="swa", caching_ratio=0.5, layer_schedule="pyramid", min_budget_tokens=0),
        4,
        100,
    )
    assert pyramid[0] > 50 > pyramid[-1] and abs(pyramid.mean() - 50) <= 1


def test_halves_round_to_even_everywhere():
    # r * n = 2.5: the cache has always kept 2 (numpy.rint); sizing and planning now agree.
    config = AlisaConfig(policy="swa", caching_ratio=0.5, preset="paper")
    assert kept_tokens(config, 2, 5).tolist() == [2, 2]
    assert Workload(batch=1, prompt_len=5, gen_len=1, caching_ratio=0.5).kept_tokens(0) == 2
    assert KeepRule(caching_ratio=0.5).kept(np.array([5, 7])).tolist() == [2, 4]


def test_dense_layers_make_a_batch_bigger():
    spec = model_spec(tiny_llama(), model_shape(tiny_llama()))
    sparse = AlisaConfig(policy="swa", caching_ratio=0.2)
    assert (
        batch_memory(spec, sparse.with_overrides(dense_layers=1), 4, 512, 64).kv
        > batch_memory(spec, sparse, 4, 512, 64).kv
    )


def test_a_workload_needs_keep_rules():
    with pytest.raises(ValueError, match="keep"):
        Workload(batch=1, prompt_len=5, gen_len=1, keep=[KeepRule()])
