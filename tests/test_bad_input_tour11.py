"""The eleventh bad-input tour's findings (docs/bad-input-tour.md, "Eleventh tour"), each a
test (S1, an output in a missing folder, is in tests/test_bad_input_tour9.py)."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import config_notes, run_main

from alisa.cli import main


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (dict(budget_tokens=8), "below min_budget_tokens=64 (the default preset's), the floor"),
        (dict(budget_tokens=2, min_budget_tokens=10), "below min_budget_tokens=10, the floor"),
        (
            dict(budget_tokens=8, min_budget_tokens=0, sink_tokens=20),
            "below sink_tokens=20 plus the newest token",
        ),
    ],
)
def test_a_budget_under_the_floor_or_the_sinks_is_said_to_do_nothing(fields, said):
    """S2: an explicit ``budget_tokens`` under the floor (the preset's or one given) or the
    sinks kept the floor or the sinks, without a word."""
    notes = config_notes(policy="swa", **fields)
    assert len(notes) == 1 and notes[0].startswith(f"budget_tokens={fields['budget_tokens']}")
    assert said in notes[0]


def test_a_budget_above_the_floor_and_the_sinks_is_taken_silently():
    for fields in (
        dict(budget_tokens=64),  # the floor itself: it acts from there up
        dict(budget_tokens=8, min_budget_tokens=0),
        dict(budget_tokens=8, preset="paper"),  # no floor, the policy's own sinks
        dict(budget_tokens=8, min_budget_tokens=0, layer_schedule="pyramid"),
    ):
        assert config_notes(policy="swa", **fields) == [], fields


@pytest.mark.parametrize("policy", ["streaming", "local"])
def test_recent_fraction_of_a_policy_that_keeps_the_most_recent_anyway_is_warned(policy):
    """S3: ``recent_fraction`` under ``streaming`` and ``local`` (whose score is recency, so
    the rest of the budget goes to the next most recent tokens) changed nothing, unwarned."""
    assert config_notes(policy=policy, caching_ratio=0.2, recent_fraction=0.1) == [
        f"recent_fraction=0.1 has no effect with policy='{policy}', which keeps the most "
        "recent tokens anyway"
    ]
    # strided reads it: its on-stride tokens outrank the recent ones
    assert config_notes(policy="strided", caching_ratio=0.2, recent_fraction=0.1) == []


def test_plan_says_a_host_budget_its_plan_never_reads(capsys):
    """S4: ``alisa plan --host-memory`` on a plan that places nothing on the host."""
    argv = ["plan", "--model", "smollm2-135m", "--hardware", "a100-40gb"]
    code, err = run_main([*argv, "--host-memory", "1GiB"], capsys)
    assert code == 0
    assert "--host-memory 1GiB has no effect on this plan: it places nothing on the host" in err
    tight = ["--gpu-memory", "150MB", "--batch", "8", "--prompt-len", "2048"]
    code, err = run_main([*argv, "--host-memory", "1GiB", *tight], capsys)
    assert code == 0 and "has no effect" not in err  # the plan offloads: the budget bounds it


def test_a_reader_that_stops_early_ends_the_command_quietly(capsys, monkeypatch):
    """W1: ``alisa plan | head`` printed ``error: [Errno 32] Broken pipe`` and exited 1, the
    code of a bad input; now quiet, 141 (SIGPIPE's status, as other tools)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone
    closed = os.fdopen(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        code = main(["plan", "--model", "smollm2-135m", "--hardware", "a100-40gb"])
    finally:
        monkeypatch.undo()
        closed.close()
    assert code == 141
    assert "Broken pipe" not in capsys.readouterr().err


def test_the_new_notes_leave_the_others_as_they_were():
    """Each setting keeps its own reason beside the new ones (an ``elif`` once followed the
    new budget note instead of the attention one, and changed two reasons)."""
    assert config_notes(policy="h2o", budget_tokens=8, score_decay=True) == [
        "score_decay=True has no effect with policy='h2o', which has no score window of "
        "several decode steps to fade",
        "budget_tokens=8 has no effect below min_budget_tokens=64 (the default preset's), the "
        "floor every evicting layer keeps; lower the floor (0: none) for the budget to act",
    ]
    assert config_notes(policy="streaming", caching_ratio=0.5, score_decay=True) == [
        "score_decay=True has no effect with policy='streaming', which does not score tokens "
        "by attention"
    ]
