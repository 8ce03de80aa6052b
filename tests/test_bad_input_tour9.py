"""The ninth bad-input tour's findings (docs/bad-input-tour.md, "Ninth tour"), each a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from architectures import FAMILIES, build
from conftest import byte_tokenizer, config_notes, run_main, tiny_llama

from alisa import AlisaCache, AlisaConfig, load_model
from alisa.jobs.runner import BatchJob, run_batch

REPO = Path(__file__).resolve().parent.parent


def test_a_filled_cache_refuses_another_model_of_the_same_shapes():
    """S1: an empty cache refused another model, a filled one ran it on the first model's keys
    and values (another model of the same shapes returned tokens without a word)."""
    model, other = tiny_llama(seed=0), tiny_llama(seed=1)
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))
    ids = torch.tensor([[5, 6, 7]])
    model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache)
    held = cache.get_seq_length()
    unhooked = r"was built for .*without passing through that model"
    for longer in (ids, torch.tensor([[5, 6, 7, 8, 9, 10]])):
        with pytest.raises(ValueError, match=unhooked):
            other.generate(longer, max_new_tokens=2, do_sample=False, past_key_values=cache)
        assert cache.get_seq_length() == held  # refused before anything was stored
    AlisaCache(other, AlisaConfig(policy="swa", caching_ratio=0.5))  # now hooked: named
    with pytest.raises(ValueError, match=r"was built for .* and is given to another model"):
        other.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache)
    assert cache.get_seq_length() == held
    # Its own model still continues it.
    longer = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = model.generate(longer, max_new_tokens=1, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 7)


def test_an_output_in_a_missing_folder_is_refused(tmp_path, capsys):
    """S2 (and the eleventh tour's S1): ``-o`` into a folder that did not exist made it
    without a word (a typo in the folder starts a new tree, and a re-run under the right name
    redoes every row). Now refused, from the CLI, from Python and for a profile, and nothing
    is made."""
    model_dir = _saved(tmp_path, "llama")
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "hello", "max_new_tokens": 2}) + "\n")
    missing = tmp_path / "typo" / "deeper"
    argv = ["batch", str(source), "-o", str(missing / "x.jsonl"), "--model", str(model_dir)]
    code, err = run_main(argv, capsys)
    assert code == 1 and f"its folder '{missing}' does not exist" in err
    model, tokenizer = load_model(str(model_dir))
    job = BatchJob(input=str(source), output=str(missing / "y.jsonl"), progress=False)
    with pytest.raises(ValueError, match=r"its folder .* does not exist; make it first"):
        run_batch(model, tokenizer, job)
    argv = ["profile", "--model", "none", "--output", str(missing / "p.json")]
    code, err = run_main(argv, capsys)
    assert code == 1 and f"its folder '{missing}' does not exist" in err
    assert not (tmp_path / "typo").exists()
    missing.mkdir(parents=True)  # made by the user: taken
    assert run_batch(model, tokenizer, job).completed == 1


def test_a_preset_under_dense_is_said_to_do_nothing():
    """S3: ``preset='paper'`` with ``policy='dense'`` was taken silently, while the other
    eviction settings under dense are warned."""
    assert config_notes(policy="dense", preset="paper") == [
        "preset='paper' has no effect with policy='dense', which keeps every token"
    ]
    assert config_notes(policy="dense") == []


def test_an_evicting_policy_with_nothing_to_evict_is_said_to_run_dense():
    """S4: ``policy='swa'`` at the default ``caching_ratio=1`` and no ``budget_tokens`` ran
    as dense without a word, and so did its eviction settings (``recent_fraction``)."""
    notes = config_notes(policy="swa", recent_fraction=0.3)
    assert notes[0].startswith(
        "policy='swa' has no effect at caching_ratio=1 with no budget_tokens: every token is "
        "kept (dense attention); set caching_ratio below 1 or budget_tokens"
    )
    assert notes[1] == (
        "recent_fraction=0.3 has no effect with policy='swa' at caching_ratio=1 with no "
        "budget_tokens, which keeps every token"
    )
    for evicting in (
        dict(caching_ratio=0.5),
        dict(budget_tokens=128),  # above the floor
        dict(layer_schedule="pyramid"),  # r = 1 on average: some layers evict
    ):
        assert config_notes(policy="swa", **evicting) == []


def test_the_cli_warns_an_evicting_policy_that_evicts_nothing(tmp_path, capsys):
    """S4 from the CLI: ``--policy swa --stride 3`` at the default ratio warned of
    ``--stride`` only; now also that the run is dense."""
    argv = ["generate", "hi", "--model", str(_saved(tmp_path, "llama")), "--max-new-tokens", "2"]
    code, err = run_main([*argv, "--policy", "swa", "--stride", "3"], capsys)
    assert code == 0
    assert "policy='swa' has no effect at caching_ratio=1 with no budget_tokens" in err
    code, err = run_main([*argv, "--policy", "swa", "--caching-ratio", "0.5"], capsys)
    assert code == 0 and "has no effect" not in err


def test_gemma2_loads_with_eager_attention_and_sdpa_is_refused_in_our_words(tmp_path, capsys):
    """U1: Gemma 2, which transformers gives no SDPA, failed to load with the defaults in
    transformers' words, pointing at a keyword the CLI lacks."""
    model_dir = _saved(tmp_path, "gemma2")
    model, _ = load_model(str(model_dir))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"^attn_implementation='sdpa': Gemma2ForCausalLM has no"):
        load_model(str(model_dir), attn_implementation="sdpa")
    argv = ["generate", "hi", "--model", str(model_dir), "--max-new-tokens", "2"]
    code, err = run_main([*argv, "--policy", "h2o", "--caching-ratio", "0.5"], capsys)
    assert code == 0, err
    llama, _ = load_model(str(_saved(tmp_path, "llama")))
    assert llama.config._attn_implementation == "sdpa"  # where transformers has it


def _saved(tmp_path, family: str):
    model_dir = tmp_path / family
    build(FAMILIES[family]).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    return model_dir


def test_batch_stopped_by_sigterm_says_so_and_keeps_its_rows(tmp_path):
    """Noted by the ninth tour: ``alisa batch`` stopped by SIGTERM (a scheduler's kill) exited
    143 without a word, where Ctrl-C says ``interrupted``. It now says it, after its ``finally``
    blocks closed the output, and every row written stays whole."""
    model_dir = _saved(tmp_path, "llama")
    source = tmp_path / "in.jsonl"
    rows = [{"id": str(i), "prompt": f"row {i}", "max_new_tokens": 200} for i in range(40)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "alisa", "batch", str(source), "-o", str(output)]
    command += ["--model", str(model_dir), "--no-progress", "--threads", "1", "--max-batch", "1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and output.read_bytes().count(b"\n") >= 1):
            assert process.poll() is None and time.monotonic() < deadline, "no row written"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert "alisa batch: stopped by SIGTERM" in err and "Traceback" not in err
    written = output.read_text().splitlines()
    assert 1 <= len(written) < 40 and all(json.loads(line)["id"] for line in written)
