"""A step's budgets, computed once for the layers sharing a policy (alisa.policies.BudgetBook)."""

import numpy as np
import pytest
from conftest import tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.config import policy_for_layer
from alisa.policies import BudgetBook


def policy(**options):
    settings = {"policy": "swa", "caching_ratio": 0.3, **options}
    return policy_for_layer(AlisaConfig(**settings), 0, 4)


def test_the_book_gives_the_policys_own_numbers_once_per_lengths():
    book, swa = BudgetBook(), policy()
    lengths = np.array([100, 37])
    shares = book.shares(swa, lengths)
    budget = swa.budget(lengths)
    assert np.array_equal(shares.budget, budget)
    assert np.array_equal(shares.recent, swa.recent(budget))
    assert np.array_equal(shares.window, swa.steps_scored(budget))
    assert book.shares(swa, lengths.copy()) is shares  # the same lengths: not computed again
    with pytest.raises(ValueError, match="read-only"):
        shares.budget[0] = 1  # shared by every layer: nobody writes to it
    later = book.shares(swa, lengths + 1)
    assert later is not shares and np.array_equal(later.budget, swa.budget(lengths + 1))


def test_equal_policies_that_are_distinct_objects_get_their_own_entries():
    book, first, other = BudgetBook(), policy(), policy(caching_ratio=0.5)
    twin = policy()
    assert twin == first and twin is not first
    lengths = np.array([200])
    assert book.shares(twin, lengths) is not book.shares(first, lengths)
    assert book.shares(other, lengths).budget[0] == other.budget(lengths)[0] == 100


def test_a_derived_number_is_made_once_per_name_and_lengths():
    book, swa, calls = BudgetBook(), policy(), []

    def make(name):
        def made(shares):
            calls.append(name)
            return int(shares.budget.sum()), name

        return made

    lengths = np.array([900, 600])
    total = int(swa.budget(lengths).sum())  # 270 + 180
    assert book.derived(swa, lengths, "a", make("a")) == (total, "a")
    assert book.derived(swa, lengths, "a", make("a")) == (total, "a")
    assert book.derived(swa, lengths, "b", make("b")) == (total, "b")
    assert book.derived(swa, lengths + 100, "a", make("a")) == (total + 60, "a")
    assert calls == ["a", "b", "a"]


@pytest.mark.parametrize("retention", ["drop", "host"])
def test_a_caches_layers_share_one_book_and_each_reads_its_own_policy(retention):
    """Pyramid budgets differ per layer; equal policies are one object, read from one book."""
    model = tiny_llama()
    for schedule in ("uniform", "pyramid"):
        config = AlisaConfig(
            policy="swa", caching_ratio=0.3, layer_schedule=schedule, retention=retention
        )
        cache = AlisaCache(model, config)
        keepers = [layer.keeper for layer in cache.layers]
        assert all(keeper.budgets is keepers[0].budgets for keeper in keepers)
        lengths = np.array([500, 321])
        for index, keeper in enumerate(keepers):
            own = policy_for_layer(config, index, len(keepers))
            assert keeper.policy == own
            budget = keeper.budgets.shares(keeper.policy, lengths).budget
            assert np.array_equal(budget, own.budget(lengths))
        distinct = {id(keeper.policy) for keeper in keepers}
        assert len(distinct) == len({keeper.policy for keeper in keepers})
        assert (len(distinct) == 1) == (schedule == "uniform")
