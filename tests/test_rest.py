"""Host retention's estimate of the tokens a step leaves on the host (alisa/kv/rest.py)."""

import math

import torch
from conftest import padded_batch, tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.kv.attention import LogitOptions, grouped_attention_parts
from alisa.kv.rest import RestColumn, rest_logit
from alisa.storage.store import Part

HOST = {"policy": "swa", "retention": "host"}


def test_the_rest_logit_is_the_log_mass_of_the_written_positions_not_held():
    """Brute force, position by position: padding (before ``first``), held positions and those
    past ``written`` (pending their page) are left out of the sum; soft-capping applies first."""
    torch.manual_seed(0)
    batch, heads, rows, capacity, written = 2, 3, 4, 40, 33
    logits = torch.randn(batch, heads, rows, capacity).to(torch.bfloat16)
    first = torch.tensor([0, 5])
    # Distinct positions per row, as slots hold them: some pending (>= 33), padding and empty
    # slots negative.
    held = torch.stack([torch.randperm(38)[:9] for _ in range(batch * heads)])
    held = held.view(batch, heads, 9)
    held = torch.where(held < first.view(-1, 1, 1), -1, held)
    for softcap in (None, 1.5):
        got = rest_logit(logits, held, first, written, 0.25, softcap)
        assert got.shape == (batch, heads, rows)
        for b in range(batch):
            for h in range(heads):
                kept = set(held[b, h].tolist())
                out = [p for p in range(first[b], written) if p not in kept]
                for r in range(rows):
                    values = [float(logits[b, h, r, p]) * 0.25 for p in out]
                    if softcap is not None:
                        values = [math.tanh(v / softcap) * softcap for v in values]
                    expected = math.log(sum(math.exp(v) for v in values))
                    assert math.isclose(float(got[b, h, r]), expected, rel_tol=1e-5)


def test_nothing_left_out_gives_a_column_of_no_mass():
    """Every written position held (or nothing written): the column's mass is nil beside the
    held positions' (the difference of two sums rounds to at most a few ulps of them)."""
    torch.manual_seed(2)
    logits = torch.randn(2, 1, 2, 16)
    held = torch.stack([torch.randperm(12), torch.arange(-2, 10)]).view(2, 1, 12)
    got = rest_logit(logits, held, torch.tensor([0, 0]), 10, 1.0, padded=False)
    every = torch.logsumexp(logits[..., :10], dim=-1)
    assert (got - every < math.log(1e-6)).all()
    nothing = rest_logit(logits, held, torch.tensor([0, 0]), 0, 1.0, padded=False)
    assert torch.equal(nothing, torch.full((2, 1, 2), float("-inf")))


def _parts(batch=2, kv_heads=2, slots=7, dim=8):
    torch.manual_seed(1)
    positions = torch.arange(slots).expand(batch, kv_heads, -1).clone()
    positions[0, 1, 3] = -1  # an empty slot
    split = 4  # two regions in slot order, as a tiered layer returns them
    keys, values = (
        torch.randn(batch, kv_heads, slots, dim),
        torch.randn(batch, kv_heads, slots, dim),
    )
    return [
        Part(keys[:, :, :split], values[:, :, :split], positions[:, :, :split]),
        Part(keys[:, :, split:], values[:, :, split:], positions[:, :, split:]),
    ], (keys, values, positions)


def test_attention_with_the_rest_is_one_softmax_with_one_more_column():
    """The rest's column takes its share of every query head's softmax (beside a GPT-OSS sink
    column, which takes its share and gives nothing) and contributes share x its value; the
    probabilities handed back cover the slots only."""
    parts, (keys, values, positions) = _parts()
    batch, kv_heads, slots, dim = keys.shape
    group = 3
    query = torch.randn(batch, kv_heads * group, 1, dim)
    visible = (positions >= 0).unsqueeze(2)  # (B, H_kv, q, S)
    rest = RestColumn(
        logit=torch.randn(batch, kv_heads, group, 1), value=torch.randn(batch, kv_heads, dim)
    )
    sinks = torch.randn(kv_heads * group)
    for options in (LogitOptions(), LogitOptions(sinks=sinks)):
        output, probabilities = grouped_attention_parts(query, parts, visible, 0.5, options, rest)
        assert probabilities.shape == (batch, kv_heads, group, 1, slots)
        for b in range(batch):
            for h in range(kv_heads * group):
                kv, g = divmod(h, group)
                logits = (keys[b, kv] @ query[b, h, 0]) * 0.5
                logits = logits.masked_fill(positions[b, kv] < 0, float("-inf"))
                extra = [rest.logit[b, kv, g, 0]]
                if options.sinks is not None:
                    extra.append(sinks[h])
                weights = torch.cat([logits, torch.stack(extra)]).softmax(-1)
                expected = weights[:slots] @ values[b, kv] + weights[slots] * rest.value[b, kv]
                torch.testing.assert_close(output[b, 0, h], expected)
                torch.testing.assert_close(probabilities[b, kv, g, 0], weights[:slots])


def test_a_column_of_no_mass_changes_nothing():
    parts, (keys, _, positions) = _parts()
    batch, kv_heads, _, dim = keys.shape
    query = torch.randn(batch, kv_heads, 1, dim)
    visible = (positions >= 0).unsqueeze(2)
    rest = RestColumn(
        logit=torch.full((batch, kv_heads, 1, 1), float("-inf")),
        value=torch.randn(batch, kv_heads, dim),
    )
    plain = grouped_attention_parts(query, parts, visible, 0.5)
    with_rest = grouped_attention_parts(query, parts, visible, 0.5, LogitOptions(), rest)
    for got, expected in zip(with_rest, plain, strict=True):
        torch.testing.assert_close(got, expected)


@torch.inference_mode()
def test_the_rest_is_estimated_once_a_selection_has_left_tokens_on_the_host():
    """Before the first selection every token is on the device (no column: attention is
    exactly dense); after it, the column is the sketch's estimate over the positions the slots
    do not hold, and the value the mean of every real position's value written (padding not
    counted); ``estimate_rest=False`` never adds one."""
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(60, 45))
    scaling = model.config.head_dim**-0.5 if hasattr(model.config, "head_dim") else None
    for estimate in (True, False):
        config = AlisaConfig(
            budget_tokens=20, min_budget_tokens=0, host_bits=16, estimate_rest=estimate, **HOST
        )
        unreached = AlisaCache(model, config.with_overrides(budget_tokens=1000))
        model(input_ids=ids, attention_mask=mask, past_key_values=unreached, use_cache=True)
        cache = AlisaCache(model, config)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for layer in (*unreached.layers, *cache.layers):
            query = torch.randn(2, 4, 1, 16)
            rest = layer.rest(query, scaling or 0.25)
            if layer in unreached.layers or not estimate:
                assert rest is None
                continue
            keeper = layer.keeper
            rows = query.view(2, 2, 2, 16)
            expected = rest_logit(
                keeper.sketch.logits(rows),
                layer.slots.positions,
                torch.as_tensor(layer.slots.first),
                keeper.flushed,
                scaling or 0.25,
            )
            torch.testing.assert_close(rest.logit, expected.view(2, 2, 2, 1))
            stored = keeper.pages.plain[1][:, :, : keeper.flushed]  # 16-bit host region: exact
            for row, first in enumerate(layer.slots.first):
                mean = stored[row, :, first:].mean(dim=1)
                torch.testing.assert_close(rest.value[row], mean)


def _thin_layer(estimate: bool):
    from alisa.kv.host import HostKeeper
    from alisa.kv.layer import AlisaLayer
    from alisa.policies import POLICIES

    policy = POLICIES["swa"](
        caching_ratio=1.0, budget_tokens=24, recent_fraction=0.25, sink_tokens=4
    )
    return AlisaLayer(HostKeeper(policy, 16, estimate_rest=estimate))


@torch.inference_mode()
def test_with_attention_spread_thinly_the_rest_brings_a_step_back_to_dense():
    """100 tokens with small random keys: dense attention is nearly uniform, so renormalising
    over the 24 held tokens averages their values alone, while the rest's column gives the
    other 76 their share at their mean value: the step's output is several times closer to
    dense attention's."""
    torch.manual_seed(3)
    dim, length = 16, 100
    keys, values = torch.randn(1, 1, length, dim) * 0.3, torch.randn(1, 1, length, dim)
    errors = {}
    for estimate in (False, True):
        layer = _thin_layer(estimate)
        layer.update(keys, values)
        layer.after_attention(torch.randn(1, 1, length, dim), None)
        new_key, new_value = torch.randn(1, 1, 1, dim) * 0.3, torch.randn(1, 1, 1, dim)
        layer.update(new_key, new_value)
        query = torch.randn(1, 1, 1, dim)
        layer.before_attention(query)
        parts = layer.parts(query)
        assert (parts[0].positions >= 0).sum() == 24  # the budget, the new token in it
        visible = (parts[0].positions >= 0).unsqueeze(2)
        rest = layer.rest(query, dim**-0.5)
        assert (rest is not None) == estimate
        output, _ = grouped_attention_parts(query, parts, visible, dim**-0.5, LogitOptions(), rest)
        every_key = torch.cat([keys, new_key], dim=2)[0, 0]
        every_value = torch.cat([values, new_value], dim=2)[0, 0]
        dense = ((every_key @ query[0, 0, 0]) * dim**-0.5).softmax(-1) @ every_value
        errors[estimate] = float((output[0, 0, 0] - dense).norm())
    assert errors[True] < errors[False] / 3


def test_value_totals_count_real_positions_and_follow_the_batch():
    from alisa.kv.rest import ValueTotals

    totals = ValueTotals(2, 1, 2, torch.device("cpu"))
    assert torch.equal(totals.mean(), torch.zeros(2, 1, 2))  # nothing counted yet: no NaN
    values = torch.arange(12.0).view(2, 1, 3, 2)
    totals.add(values, torch.tensor([[True, True, True], [False, True, True]]))  # row 1 padded
    torch.testing.assert_close(totals.mean()[0, 0], values[0, 0].mean(0))
    torch.testing.assert_close(totals.mean()[1, 0], values[1, 0, 1:].mean(0))
    other = ValueTotals(1, 1, 2, torch.device("cpu"))
    other.add(torch.ones(1, 1, 1, 2), torch.tensor([[True]]))
    totals.extend_rows(other)
    totals.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(totals.mean()[0, 0], torch.ones(2))
    torch.testing.assert_close(totals.mean()[1, 0], values[0, 0].mean(0))
