"""Prompts in the model's own format, fitted to a token budget with the model's tokenizer.

RULER (https://arxiv.org/abs/2404.06654) wraps each task in the model's template and appends the
task's answer prefix after it, so the model's first tokens are the answer; the haystack is grown
until the prompt plus the tokens to generate fill the requested length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from alisa.model.loading import chat_prompt

SIZE_LIMIT = 1 << 24  # haystack units: far beyond any context a model has


@dataclass(frozen=True)
class PromptFormat:
    """How a task's text reaches the model.

    Attributes
    ----------
    chat
        True: the task is one user turn in the tokenizer's chat template (instruct models) and
        the answer prefix opens the assistant's turn; False: plain continuation (base models).
    """

    chat: bool

    def render(self, tokenizer, task: str, answer_prefix: str) -> str:
        """The full prompt text: the task (in the chat template when ``chat``), then the answer
        prefix."""
        return (chat_prompt(tokenizer, task) if self.chat else task) + answer_prefix

    def encode(self, tokenizer, prompt: str) -> list[int]:
        """The prompt's token ids as the model receives them (a chat template carries its own
        special tokens; a plain prompt gets the tokenizer's, such as a BOS)."""
        return tokenizer(prompt, add_special_tokens=not self.chat)["input_ids"]


def prompt_format(tokenizer, chat: bool | str = "auto") -> PromptFormat:
    """The format for ``tokenizer``: ``"auto"`` uses the chat template when there is one.

    Raises
    ------
    ValueError
        ``chat`` is not one of ``"auto"``, True, False, or True for a tokenizer without a chat
        template.
    """
    if not (chat == "auto" or isinstance(chat, bool)):
        raise ValueError(f"chat={chat!r} must be 'auto', true or false")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is True and not has_template:
        raise ValueError("chat=true: this tokenizer has no chat template (a base model?)")
    return PromptFormat(chat=has_template if chat == "auto" else bool(chat))


@dataclass(frozen=True, kw_only=True)
class Fitted:
    """The largest haystack size whose prompt fits the budget, its prompt and token count."""

    size: int
    prompt: str
    tokens: int


def fit(
    render: Callable[[int], str],
    count: Callable[[str], int],
    budget: int,
    *,
    smallest: int = 1,
    largest: int | None = None,
    what: str = "prompt",
) -> Fitted:
    """The largest size n in [``smallest``, ``largest``] whose ``render(n)`` has at most
    ``budget`` tokens.

    Tokens grow with n (more sentences or words), so the bound is found by doubling and then
    bisection, every candidate tokenized in full (merges across sentence boundaries included).

    Raises
    ------
    ValueError
        Even ``smallest`` does not fit, or ``largest`` still leaves room (the source is too
        small for the length); ``what``, the budget and the tokens are named.
    """
    limit = SIZE_LIMIT if largest is None else largest
    tokens = count(render(smallest))
    if tokens > budget:
        raise ValueError(
            f"{what}: the smallest prompt has {tokens} tokens, more than the {budget} the length "
            "leaves for it; raise the length"
        )
    low, high = smallest, min(limit, smallest * 2 + 1)
    while count(render(high)) <= budget:
        if high == limit:
            raise ValueError(
                f"{what}: {limit} units of the source make only {count(render(high))} tokens, "
                f"fewer than the {budget} the length asks for; use a longer source text or a "
                "shorter length"
            )
        low, high = high, min(limit, high * 2)
    while high - low > 1:  # render(low) fits, render(high) does not
        middle = (low + high) // 2
        if count(render(middle)) <= budget:
            low = middle
        else:
            high = middle
    prompt = render(low)
    return Fitted(size=low, prompt=prompt, tokens=count(prompt))
