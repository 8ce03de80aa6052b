"""Issue 67, fourth tour: resuming an ``alisa batch`` output with other settings.

A re-run with another ``--max-new-tokens``, policy or model reported the rows already there as
done and exited 0: the output mixed rows of two runs as if of one. Every row now records what
decided its tokens (``settings``: the default length, chat, EOS, sampling, the cache settings
that differ from the defaults, and the model), and a resume with other settings is refused,
naming each difference, with the output byte-identical. Placement (where KV lives, which
kernels run) never changes a token and may differ.
"""

from __future__ import annotations

import json

import pytest
import test_bad_input
from test_bad_input import ERR, OK, run_cli

models = test_bad_input.models  # the tiny models saved, as a user's would be

ROWS = b'{"id": "a", "prompt": "Hi"}\n{"id": "b", "prompt": "Yo"}\n'


def _batch(tmp_path, models, capsys, monkeypatch, *flags, model="model"):
    argv = ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    return run_cli([*argv, "--model", models[model], *flags], capsys, monkeypatch, None)


@pytest.mark.parametrize(
    ("first", "again", "needles"),
    [
        (
            ("--max-new-tokens", "2"),
            ("--max-new-tokens", "7"),
            ("max_new_tokens: 2 there, 7 now",),
        ),
        (
            ("--max-new-tokens", "2"),
            ("--max-new-tokens", "2", "--policy", "swa", "--caching-ratio", "0.3"),
            ("cache.caching_ratio: 1.0 there, 0.3 now", "cache.policy: dense there, swa now"),
        ),
        (
            ("--max-new-tokens", "2"),
            ("--max-new-tokens", "2", "--chat"),
            ("chat: False there, True now",),
        ),
    ],
    ids=["max-new-tokens", "policy", "chat"],
)
def test_a_resume_with_other_settings_is_refused(
    first, again, needles, tmp_path, models, capsys, monkeypatch
):
    (tmp_path / "in.jsonl").write_bytes(ROWS)
    assert _batch(tmp_path, models, capsys, monkeypatch, *first)[0] == OK
    before = (tmp_path / "o.jsonl").read_bytes()
    code, _, err = _batch(tmp_path, models, capsys, monkeypatch, *again)
    assert code == ERR and "Traceback" not in err
    assert "holds finished rows made with other settings" in err
    for needle in needles:
        assert needle in err
    assert (tmp_path / "o.jsonl").read_bytes() == before


def test_a_resume_with_another_model_is_refused(tmp_path, models, capsys, monkeypatch):
    (tmp_path / "in.jsonl").write_bytes(ROWS)
    assert _batch(tmp_path, models, capsys, monkeypatch, "--max-new-tokens", "2")[0] == OK
    before = (tmp_path / "o.jsonl").read_bytes()
    code, _, err = _batch(
        tmp_path, models, capsys, monkeypatch, "--max-new-tokens", "2", model="short"
    )
    assert code == ERR and "model: LlamaForCausalLM (" in err and "short) now" in err
    assert (tmp_path / "o.jsonl").read_bytes() == before


def test_a_resume_with_the_same_settings_finishes_the_output(tmp_path, models, capsys, monkeypatch):
    """The same settings (placement aside) resume: the rows record what made them."""
    (tmp_path / "in.jsonl").write_bytes(ROWS[: ROWS.index(b"\n") + 1])
    assert _batch(tmp_path, models, capsys, monkeypatch, "--max-new-tokens", "2")[0] == OK
    (tmp_path / "in.jsonl").write_bytes(ROWS)
    code, _, err = _batch(
        tmp_path, models, capsys, monkeypatch, "--max-new-tokens", "2", "--kernels", "reference"
    )
    assert code == OK and "1 already done before" in err
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["a", "b"]
    first, second = ({k: v for k, v in r["settings"].items() if k != "prompt_sha256"} for r in rows)
    assert first == second  # but for each row's own prompt
    assert rows[0]["settings"]["max_new_tokens"] == 2
    assert rows[0]["settings"]["model"].startswith("LlamaForCausalLM (")


def test_rows_of_an_older_alisa_resume_as_before(tmp_path, models, capsys, monkeypatch):
    """Rows without a record of their settings cannot be compared: they resume."""
    (tmp_path / "in.jsonl").write_bytes(ROWS)
    old = b'{"id": "a", "text": "x", "tokens": 1, "finish_reason": "length"}\n'
    (tmp_path / "o.jsonl").write_bytes(old)
    code, _, err = _batch(tmp_path, models, capsys, monkeypatch, "--max-new-tokens", "2")
    assert code == OK and "1 already done before" in err
