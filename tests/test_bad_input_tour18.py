"""The eighteenth bad-input tour's silent findings (an independent tester's tour 92: S1, S2),
each a test."""

from __future__ import annotations

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaConfig
from alisa.jobs.stream import stream_generate


@pytest.mark.parametrize("value", [1.5, 2.0])
def test_stream_generate_refuses_a_row_count_that_is_not_an_integer(value):
    """S1: ``max_rows=1.5`` was accepted; ``prefill_rows=2.5`` and ``BatchJob(max_batch=1.5)``
    were refused."""
    with pytest.raises(ValueError, match=rf"max_rows={value} must be an integer >= 1"):
        next(stream_generate(tiny_llama(), byte_tokenizer(), "hi", max_rows=value))


def test_estimate_rest_false_without_host_retention_is_refused_as_true_is():
    """S2: ``estimate_rest=False`` (``--no-estimate-rest``) with ``retention='drop'`` changed
    nothing, unsaid; ``True`` was refused."""
    for value in (True, False):
        with pytest.raises(ValueError, match=rf"estimate_rest={value} needs retention='host'"):
            AlisaConfig(policy="swa", caching_ratio=0.5, estimate_rest=value)
    AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", estimate_rest=False)


def test_plan_past_the_context_says_its_defaults_and_what_fits():
    """U1: ``alisa plan`` on a model of context under 640 failed on its own defaults (512 +
    128) without saying they were defaults or what to pass."""
    from types import SimpleNamespace

    from alisa.commands.options import CommandError
    from alisa.commands.plan import _check_context

    spec = SimpleNamespace(context_tokens=256, name="gpt2")
    with pytest.raises(CommandError) as caught:
        _check_context(spec, 512, 128)
    text = str(caught.value)
    assert "(unset, they are 512 and 128), e.g. --prompt-len 192 --gen-len 64" in text
    _check_context(spec, 192, 64)
