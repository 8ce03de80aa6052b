"""``[options.ruler]``: what the RULER task reads besides its sweep point (no torch here: the
config checker imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RulerOptions:
    """``samples`` per family and length (RULER's ``num_samples``), the base ``seed``, the
    ``haystack`` text file (None: WikiText-2's test split), ``chat`` (``"auto"``: the chat
    template when the tokenizer has one) and ``new_tokens`` per sample (None: each family's)."""

    samples: int = 10
    seed: int = 0
    haystack: str | None = None
    chat: bool | str = "auto"
    new_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("seed", 0), ("new_tokens", 1)):
            value = getattr(self, name)
            if value is None and name == "new_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"options.ruler.{name}={value!r} must be an integer >= {low}")
        if self.haystack is not None and not (isinstance(self.haystack, str) and self.haystack):
            raise ValueError(f"options.ruler.haystack={self.haystack!r} must be a file path")
        if not (self.chat == "auto" or isinstance(self.chat, bool)):
            raise ValueError(f"options.ruler.chat={self.chat!r} must be 'auto', true or false")

    @classmethod
    def read(cls, table: dict) -> RulerOptions:
        """From an ``[options.ruler]`` table (TOML has no null: ``"none"`` is a default)."""
        return cls(**{key: None if value == "none" else value for key, value in table.items()})
