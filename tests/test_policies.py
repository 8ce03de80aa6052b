"""Policy arithmetic and selection on hand-made scores (no model)."""

from dataclasses import dataclass, fields

import numpy as np
import pytest
import torch

from alisa import AlisaConfig, get_policy
from alisa.config import policy_for_layer
from alisa.ops.reference import protected_slots
from alisa.policies import POLICIES, layer_budget_scale


def test_registry_error_lists_valid_names():
    with pytest.raises(ValueError) as error:
        get_policy("nope")
    for name in POLICIES:
        assert name in str(error.value)


@pytest.mark.parametrize("seen", [1, 2, 5, 7, 101, 2048])
def test_ratio_one_keeps_every_token(seen):
    for name in POLICIES:
        policy = get_policy(name, caching_ratio=1.0)
        assert policy.budget(np.array([seen]))[0] == seen


def test_swa_splits_the_budget_into_recent_and_dynamic_halves():
    policy = get_policy("swa", caching_ratio=0.2)
    budget = policy.budget(np.array([2048]))
    assert budget[0] == round(2048 * 0.2)
    recent = policy.recent(budget)
    assert recent[0] == round(budget[0] / 2)
    # Default window w = k, the number of recent tokens (Alg. 1 sums the last k rows).
    assert policy.score_window(recent)[0] == recent[0]


def test_a_decayed_swa_window_is_four_k_unless_set():
    recent = np.array([10, 3])
    assert get_policy("swa", score_decay=True).score_window(recent).tolist() == [40, 12]
    assert get_policy("swa", score_decay=True, window=5).score_window(recent).tolist() == [5, 5]
    default = policy_for_layer(AlisaConfig(policy="swa", caching_ratio=0.2), 0, 2)
    paper = policy_for_layer(AlisaConfig(policy="swa", caching_ratio=0.2, preset="paper"), 0, 2)
    assert default.score_window(recent).tolist() == [40, 12]
    assert paper.score_window(recent).tolist() == [10, 3]


def test_query_heads_combine_by_sum_or_by_their_max():
    probabilities = torch.tensor([[[[[0.9, 0.1]], [[0.0, 0.6]]]]])  # (B=1, Hkv=1, G=2, q=1, S=2)
    summed = get_policy("swa").combine_heads(probabilities, groups=1)
    largest = get_policy("swa", head_max=True).combine_heads(probabilities, groups=1)
    assert torch.allclose(summed, torch.tensor([[[[0.9, 0.7]]]]))
    assert torch.allclose(largest, torch.tensor([[[[0.9, 0.6]]]]))
    # The observation window's vote sums its query heads whatever head_max says (SnapKV).
    vote = get_policy("swa", head_max=True).combine_heads(probabilities, 1, vote=True)
    assert torch.allclose(vote, summed)


def test_fixed_budget_caps_but_never_exceeds_what_was_seen():
    policy = get_policy("h2o", budget_tokens=100)
    assert policy.budget(np.array([50, 100, 500])).tolist() == [50, 100, 100]


def test_protected_tokens_are_sinks_and_recent():
    policy = get_policy("streaming", caching_ratio=0.5, sink_tokens=2, recent_fraction=1.0)
    positions = torch.arange(3, 20).view(1, 1, -1)  # 3 padding slots before position 3
    first = torch.tensor([3])
    recent = torch.tensor([4])
    protected = protected_slots(positions, first, 20, recent, policy.sink_tokens)
    kept = positions[protected].tolist()
    assert kept == [3, 4, 16, 17, 18, 19]


def test_strided_prefers_tokens_on_the_stride():
    policy = get_policy("strided", caching_ratio=0.2, stride=4)
    positions = torch.arange(12).view(1, 1, -1)
    scores = policy.score(positions, None, torch.tensor([0]))
    top = torch.topk(scores[0, 0], 3).indices.sort().values.tolist()
    assert top == [0, 4, 8]
    assert get_policy("strided", caching_ratio=0.2).effective_stride() == 9


def test_pyramid_budgets_average_to_one_and_decrease():
    scales = [layer_budget_scale(i, 30, "pyramid", 0) for i in range(30)]
    assert pytest.approx(sum(scales) / 30) == 1.0
    assert scales == sorted(scales, reverse=True)
    assert layer_budget_scale(5, 30, "uniform", 0) == 1.0


def test_dense_layers_get_the_dense_policy():
    config = AlisaConfig(policy="swa", caching_ratio=0.2, dense_layers=2)
    assert policy_for_layer(config, 0, 4).name == "dense"
    assert policy_for_layer(config, 1, 4).name == "dense"
    assert policy_for_layer(config, 2, 4).name == "swa"


def test_config_options_reach_the_policy():
    config = AlisaConfig(policy="swa", caching_ratio=0.3, score_window=7, sink_tokens=2)
    policy = policy_for_layer(config, 0, 2)
    assert policy.window == 7 and policy.sink_tokens == 2 and policy.caching_ratio == 0.3
    assert policy_for_layer(AlisaConfig(policy="strided", stride=3), 0, 2).stride == 3


@pytest.mark.parametrize("seen", [1, 3, 5, 6, 20])
def test_sinks_survive_small_ratio_budgets(seen):
    policy = get_policy("streaming", caching_ratio=0.1, sink_tokens=4, recent_fraction=1.0)
    budget = policy.budget(np.array([seen]))
    assert budget[0] == min(seen, max(5, round(seen * 0.1)))
    positions = torch.arange(seen).view(1, 1, -1)
    recent = torch.as_tensor(policy.recent(budget))
    protected = protected_slots(positions, torch.tensor([0]), seen, recent, policy.sink_tokens)
    assert int(protected.sum()) <= budget[0]
    assert protected[0, 0, : min(4, seen)].all()


def test_own_options_are_declared_fields_of_the_policy_and_of_the_config():
    settings = {f.name for f in fields(AlisaConfig)}
    for cls in POLICIES.values():
        assert set(cls.config_fields) <= settings
        assert set(cls.config_fields.values()) <= {f.name for f in fields(cls)}


def test_a_wrong_option_declaration_is_caught():
    @dataclass(frozen=True, kw_only=True)
    class Broken(POLICIES["swa"]):
        config_fields = {"score_window": "windw"}

    with pytest.raises(TypeError, match="windw"):
        Broken.own_options({"score_window": 3})


@pytest.mark.parametrize(("name", "option"), [("swa", "window"), ("strided", "stride")])
@pytest.mark.parametrize("value", [0, 2.0, True])
def test_policies_check_their_own_options(name, option, value):
    with pytest.raises(ValueError, match=option):
        get_policy(name, **{option: value})


def test_dense_keeps_everything_whatever_its_budget_options():
    policy = get_policy("dense", caching_ratio=0.2)  # AlisaConfig refuses it; the class keeps all
    assert not policy.can_evict()
    assert policy.budget(np.array([0, 7, 100])).tolist() == [1, 7, 100]


def test_the_observation_window_vote_is_pooled_and_ranks_the_first_eviction():
    from alisa.kv.drop import DropKeeper
    from alisa.kv.slots import SlotMap

    policy = get_policy("swa", caching_ratio=0.25, observation_window=4)
    slots = SlotMap(1, 2, 40, 48, torch.device("cpu"))
    eviction = DropKeeper(policy, per_head=True)
    keys = torch.zeros(1, 2, 40, 8)
    eviction.start(slots, keys, keys)
    assert eviction.observes and eviction.rows_wanted(slots) == 4
    vote = torch.zeros(1, 2, 48)
    vote[0, 0, 10] = 1.0  # head 0's question looks at token 10, head 1's at token 20
    vote[0, 1, 20] = 1.0
    eviction.account(vote.view(1, 2, 1, 1, 48), slots, vote=True)
    chosen, taken, excess = eviction.victims(slots)
    assert excess.tolist() == [30]  # budget 10: 5 recent + 5 by the vote
    for group, spike in ((0, 10), (1, 20)):
        gone = set(chosen[0, group][taken[0, group]].tolist())
        kept = set(range(40)) - gone
        # The pooled vote keeps the spike's neighbours (kernel 5) with it; the recent half stays.
        assert kept == set(range(spike - 2, spike + 3)) | set(range(35, 40))
    paper = get_policy("swa", caching_ratio=0.25)
    assert not DropKeeper(paper).observes
