"""RULER's task families (https://arxiv.org/abs/2404.06654), generated offline, and its scoring.

A sample comes from a seed and a haystack text (RULER's essays and ``wonderwords`` lists are
downloads; here one text the user chooses, WikiText-2's test split by default), at a token length
measured with the model's tokenizer, in its prompt format (the chat template of an instruct
model, else plain continuation), the answer prefix last. A family draws its random choices first
(a :class:`Draft`), renderable at any haystack size, so :func:`fit` grows the haystack to the
length without moving the needles. Templates and rules: RULER's ``scripts/data/synthetic``.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np

from alisa.model.loading import chat_prompt, context_length
from experiments.extras import bench_module

# A sentence ends at ., ! or ? followed by whitespace (headings merge into the next sentence).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
_WORD = re.compile(r"\b[a-z]{4,12}\b")
_CONTROL = re.compile(r"[\x00-\x1f]")
# The most frequent words of a text are mostly function words ("that", "with"): a list of them
# would test the model's prior, not its memory of the context.
FREQUENT_WORDS_SKIPPED = 200
MIN_SENTENCES = 8
SIZE_LIMIT = 1 << 24  # haystack units: far beyond any context a model has

DEPTHS = tuple(float(d) / 100 for d in np.round(np.linspace(0, 100, num=40)).astype(int))
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_TASK = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\nWhat are all the special magic "
    "{kind} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TASK = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} "
    "variables are assigned the value {query}, they are: "
)
# VT's solved example's haystack fills up to 1/10 of the length (RULER: about 500 tokens).
EXAMPLE_SHARE = 10
CWE_TASK = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TASK = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
SHORT_LENGTH = 4096  # RULER repeats CWE's words less below this length
CWE_COMMON, CWE_EXAMPLE_WORDS = 10, 40  # words to find; words of the solved example


@dataclass(frozen=True, eq=False)
class Haystack:
    """A text's sentences, their token counts (no special tokens) and its distinct lowercase
    words of 4-12 letters (sorted, the :data:`FREQUENT_WORDS_SKIPPED` most frequent left out)."""

    sentences: tuple[str, ...]
    sentence_tokens: np.ndarray
    words: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str, tokenizer, *, source: str = "haystack") -> Haystack:
        """Cut ``text`` into sentences and words; fewer than :data:`MIN_SENTENCES` sentences
        are a ValueError naming ``source``."""
        sentences = tuple(s for s in _SENTENCE_END.split(re.sub(r"\s+", " ", text).strip()) if s)
        if len(sentences) < MIN_SENTENCES:
            raise ValueError(
                f"{source} has {len(sentences)} sentence(s); a haystack needs at least "
                f"{MIN_SENTENCES} (sentences end with '.', '!' or '?')"
            )
        counts = tokenizer(list(sentences), add_special_tokens=False)["input_ids"]
        frequency = Counter(_WORD.findall(text.lower()))
        common = {word for word, _ in frequency.most_common(FREQUENT_WORDS_SKIPPED)}
        return cls(
            sentences=sentences,
            sentence_tokens=np.array([len(ids) for ids in counts], dtype=np.int64),
            words=tuple(sorted(set(frequency) - common)),
        )

    def require_words(self, count: int, purpose: str) -> None:
        """Refuse a task that needs more distinct words than the text has (naming both)."""
        if count > len(self.words):
            raise ValueError(
                f"{purpose} needs {count} distinct words; the haystack has {len(self.words)} "
                f"(lowercase, 4-12 letters, its {FREQUENT_WORDS_SKIPPED} most frequent left out): "
                "use a longer text or a shorter length"
            )


def uses_chat(tokenizer, chat: bool | str = "auto") -> bool:
    """Whether prompts go through the tokenizer's chat template (``"auto"``: when it has one;
    True for a tokenizer without one is a ValueError)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is True and not has_template:
        raise ValueError("chat=true: this tokenizer has no chat template (a base model?)")
    return has_template if chat == "auto" else bool(chat)


def fit(
    render: Callable[[int], str],
    count: Callable[[str], int],
    budget: int,
    *,
    smallest: int = 1,
    largest: int | None = None,
    what: str = "prompt",
) -> tuple[int, str]:
    """(n, ``render(n)``) for the largest size n in [``smallest``, ``largest``] whose rendering
    has at most ``budget`` tokens: doubling, then bisection, every candidate tokenized in full
    (merges across sentence boundaries included; tokens grow with n). A ValueError naming
    ``what`` when even ``smallest`` does not fit or ``largest`` still leaves room."""
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
    return low, render(low)


@dataclass(frozen=True, kw_only=True)
class Request:
    """What every sample of one (family, length) shares. ``chat``: the task is a user turn of
    the tokenizer's chat template; ``length``: prompt plus tokens to generate (RULER's
    ``max_seq_length``); ``samples`` per (family, length): the grid spaces its depths over them."""

    haystack: Haystack
    tokenizer: object
    chat: bool
    length: int
    samples: int
    seed: int = 0

    def render(self, task: str, answer_prefix: str) -> str:
        return (chat_prompt(self.tokenizer, task) if self.chat else task) + answer_prefix

    def encode(self, prompt: str) -> list[int]:
        """Ids as the model gets them (a chat template has its own special tokens)."""
        return self.tokenizer(prompt, add_special_tokens=not self.chat)["input_ids"]

    def count(self, prompt: str) -> int:
        return len(self.encode(prompt))


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One prompt, the ``references`` RULER's string match looks for, the ``depths`` of its
    needles or chain links (shares of the context's tokens) and ``new_tokens`` to generate."""

    family: str
    index: int
    prompt: str
    input_ids: list[int]
    references: tuple[str, ...]
    depths: tuple[float, ...]
    new_tokens: int


@dataclass(frozen=True, kw_only=True)
class Draft:
    """A sample's random choices, renderable at any haystack size (sentences or words)."""

    task: Callable[[int], str]
    prefix: str
    references: tuple[str, ...]
    depths: Callable[[int], tuple[float, ...]] = lambda size: ()
    smallest: int = 1
    largest: int | None = None  # None: the haystack repeats, any size renders


@dataclass(frozen=True, kw_only=True)
class Family:
    """A task family: its name, its default answer budget and how it drafts a sample."""

    name: str
    new_tokens: int
    draft: Callable[[Request, random.Random, int], Draft]

    def sample(self, request: Request, index: int, new_tokens: int | None = None) -> Sample:
        """Sample ``index`` at ``request.length`` tokens (prompt + ``new_tokens``, default the
        family's), deterministic in (seed, family, length, index); a ValueError when the length
        cannot hold the smallest prompt or the haystack has too few words."""
        budget = new_tokens or self.new_tokens
        rng = random.Random(f"ruler:{request.seed}:{self.name}:{request.length}:{index}")
        draft = self.draft(request, rng, index)
        size, prompt = fit(
            lambda size: request.render(draft.task(size), draft.prefix),
            request.count,
            request.length - budget,
            smallest=draft.smallest,
            largest=draft.largest,
            what=f"{self.name} at length={request.length}",
        )
        return Sample(
            family=self.name,
            index=index,
            prompt=prompt,
            input_ids=request.encode(prompt),
            references=draft.references,
            depths=draft.depths(size),
            new_tokens=budget,
        )


def insert_at_depths(
    haystack: Haystack, start: int, size: int, items: list[str], depths: list[float]
) -> tuple[str, tuple[float, ...]]:
    """``size`` haystack sentences from ``start`` (wrapping around: a text shorter than the
    context repeats, as RULER repeats its essays) with ``items[i]`` at the sentence boundary
    nearest to ``depths[i]`` of their tokens (items sharing a boundary keep their order);
    returns (context, the depth each item reached)."""
    index = (start + np.arange(size)) % len(haystack.sentences)
    bounds = np.concatenate([[0], np.cumsum(haystack.sentence_tokens[index])])
    total = max(1, int(bounds[-1]))
    slots = [int(np.abs(bounds - depth * total).argmin()) for depth in depths]
    pieces: list[str] = []
    for slot in range(size + 1):
        pieces += [item for item, at in zip(items, slots, strict=True) if at == slot]
        if slot < size:
            pieces.append(haystack.sentences[index[slot]])
    return " ".join(pieces), tuple(float(bounds[slot]) / total for slot in slots)


def needles(
    request: Request, rng: random.Random, index: int, *, keys=1, values=1, queries=1, grid=False
) -> Draft:
    """Needle retrieval: ``keys`` keys (two haystack words joined by '-'; RULER: adjective-noun
    pairs) with ``values`` 7-digit values each, ``queries`` of them asked, at depths drawn from
    40 evenly spaced percentages; ``grid``: one needle at depth index / (samples - 1)."""
    request.haystack.require_words(2, "needle keys")
    taken: set[str] = set()
    names = [_key(rng, request.haystack.words, taken) for _ in range(keys)]
    numbers = [[str(rng.randint(10**6, 10**7 - 1)) for _ in range(values)] for _ in names]
    pairs = zip(names, numbers, strict=True)
    hidden = [NEEDLE.format(key=k, value=v) for k, row in pairs for v in row]
    rng.shuffle(hidden)
    if grid:
        depths = [index / (request.samples - 1) if request.samples > 1 else 0.5]
    else:
        depths = sorted(rng.sample(DEPTHS, len(hidden)))
    start = rng.randrange(len(request.haystack.sentences))
    asked = rng.sample(range(keys), queries)
    query = _listing([names[i] for i in asked])
    one = queries * values == 1
    kind = "number" if one else "numbers"
    task, prefix = _singular(NIAH_TASK, one), _singular(NIAH_PREFIX, one)

    def context(size: int) -> tuple[str, tuple[float, ...]]:
        return insert_at_depths(request.haystack, start, size, hidden, depths)

    return Draft(
        task=lambda size: task.format(kind=kind, context=context(size)[0], query=query),
        prefix=prefix.format(kind=kind, query=query),
        references=tuple(v for i in asked for v in numbers[i]),
        depths=lambda size: context(size)[1],
    )


def _key(rng: random.Random, words: tuple[str, ...], taken: set[str]) -> str:
    while True:
        key = "-".join(rng.sample(words, 2))
        if key not in taken:
            taken.add(key)
            return key


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _singular(text: str, one: bool) -> str:
    """RULER's wording when one value is asked: 'A special magic number ... is'."""
    if not one:
        return text
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is")


def variable_tracking(request: Request, rng: random.Random, index: int, *, hops=4) -> Draft:
    """``VAR A = 12345``, ``VAR B = VAR A``, ... (``hops + 1`` variables from one 5-digit
    value), the links at random depths, after a solved example."""
    example, chain = _chain(rng, hops), _chain(rng, hops)
    depths = sorted(rng.sample(DEPTHS, hops + 1))
    start = rng.randrange(len(request.haystack.sentences))
    example_start = rng.randrange(len(request.haystack.sentences))
    spread = [i / (hops + 1) for i in range(hops + 1)]

    def solved(size: int) -> str:
        context, _ = insert_at_depths(request.haystack, example_start, size, example.links, spread)
        return example.task(context) + example.prefix + " ".join(example.names)

    budget = request.length // EXAMPLE_SHARE
    shot = solved(0)  # the bare chain when even that exceeds the example's share
    if request.count(shot) < budget:
        shot = fit(solved, request.count, budget, smallest=0, what="vt example")[1]

    def context(size: int) -> tuple[str, tuple[float, ...]]:
        return insert_at_depths(request.haystack, start, size, chain.links, depths)

    return Draft(
        task=lambda size: shot + "\n" + chain.task(context(size)[0]),
        prefix=chain.prefix,
        references=tuple(chain.names),
        depths=lambda size: context(size)[1],
    )


class _Links(NamedTuple):
    names: list[str]
    value: str
    links: list[str]

    def task(self, context: str) -> str:
        return VT_TASK.format(context=context, query=self.value)

    @property
    def prefix(self) -> str:
        return VT_PREFIX.format(count=len(self.names), query=self.value)


def _chain(rng: random.Random, hops: int) -> _Links:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    links = [f"VAR {names[0]} = {value}."]
    links += [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    return _Links(names, value, links)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def common_words(request: Request, rng: random.Random, index: int) -> Draft:
    """CWE: a numbered list where :data:`CWE_COMMON` words appear 30 times and the others 3
    (6 and 1 below 4,096 tokens), after one solved example; the haystack size is the number of
    distinct words."""
    request.haystack.require_words(CWE_COMMON + 1 + CWE_EXAMPLE_WORDS, "cwe")
    pool = list(request.haystack.words)
    rng.shuffle(pool)
    example = pool[-CWE_EXAMPLE_WORDS:]
    order_seed = rng.random()
    short = request.length < SHORT_LENGTH
    repeats = (6, 1) if short else (30, 3)
    shown = _cwe_listing(example[: 20 if short else None], (3, 1) if short else (10, 3))
    solved = CWE_TASK.format(context=shown) + CWE_PREFIX + " " + _numbered(example[:CWE_COMMON])

    def task(size: int) -> str:
        listing = _cwe_listing(pool[:size], repeats, order_seed)
        return solved + "\n" + CWE_TASK.format(context=listing)

    return Draft(
        task=task,
        prefix=CWE_PREFIX,
        references=tuple(pool[:CWE_COMMON]),
        smallest=CWE_COMMON + 1,
        largest=len(pool) - CWE_EXAMPLE_WORDS,  # the example's words stay out of the list
    )


def _cwe_listing(words: list[str], repeats: tuple[int, int], seed: float = 0.0) -> str:
    listed = words[:CWE_COMMON] * repeats[0] + words[CWE_COMMON:] * repeats[1]
    random.Random(seed).shuffle(listed)
    return _numbered(listed)


def frequent_words(
    request: Request, rng: random.Random, index: int, *, alpha=2.0, word_length=6, answers=3
) -> Draft:
    """FWE: coded words of ``word_length`` random letters, one per 50 tokens of the length, with
    counts n * k^-alpha / zeta(alpha) for rank k (the haystack size n is the number of words);
    the most frequent is replaced by '...' and the answer is the next ``answers``. No single
    token holds the answer: every occurrence counts."""
    zeta = bench_module("scipy.special").zeta
    size = max(answers + 2, request.length // 50)
    vocabulary: list[str] = []
    seen: set[str] = set()
    while len(vocabulary) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=word_length))
        if word not in seen:
            seen.add(word)
            vocabulary.append(word)
    vocabulary[0] = "..."  # the most frequent word is noise, as in RULER
    order_seed = rng.random()
    ranks = np.arange(1, size + 1)

    def task(words: int) -> str:
        counts = (words * ranks**-alpha / zeta(alpha)).astype(int)
        text = [w for w, n in zip(vocabulary, counts, strict=True) for _ in range(n)]
        random.Random(order_seed).shuffle(text)
        return FWE_TASK.format(context=" ".join(text))

    # At this many words the answers' counts differ from each other and from the next rank.
    distinct = int(np.ceil(zeta(alpha) * (answers + 2) ** alpha * 4))
    return Draft(
        task=task,
        prefix=FWE_PREFIX,
        references=tuple(vocabulary[1 : 1 + answers]),
        smallest=distinct,
    )


# ``new_tokens``, each family's answer budget: RULER's for VT (30) and FWE (50); 32 / 64 for one /
# four needle values and 64 for CWE's ten words, where RULER allows 128 / 120 (the answer prefix
# ends right before the answer, so the shorter budgets hold every answer and spare CPU time).
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(name="niah_single", new_tokens=32, draft=needles),
        Family(name="niah_multikey", new_tokens=32, draft=partial(needles, keys=4)),
        Family(name="niah_multivalue", new_tokens=64, draft=partial(needles, values=4)),
        Family(name="niah_multiquery", new_tokens=64, draft=partial(needles, keys=4, queries=4)),
        Family(name="vt", new_tokens=30, draft=variable_tracking),
        Family(name="cwe", new_tokens=64, draft=common_words),
        Family(name="fwe", new_tokens=50, draft=frequent_words),
        Family(name="niah_grid", new_tokens=32, draft=partial(needles, grid=True)),
    )
}


def generate_samples(
    tokenizer,
    haystack: Haystack,
    name: str,
    length: int,
    options,
    model=None,
    indices: Sequence[int] | None = None,
) -> list[Sample]:
    """The ``options.samples`` samples (:class:`~.options.RulerOptions`) of family ``name`` at
    ``length`` tokens, or those at ``indices`` (the same as in the whole set); a ValueError
    naming an unknown family or a length past the model's context."""
    limit = context_length(model, tokenizer) if model is not None else None
    if limit is not None and length > limit[0]:
        raise ValueError(
            f"length={length} is longer than the model's context of {limit[0]} tokens ({limit[1]})"
        )
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is unknown; valid: {', '.join(FAMILIES)}")
    request = Request(
        haystack=haystack,
        tokenizer=tokenizer,
        chat=uses_chat(tokenizer, options.chat),
        length=length,
        samples=options.samples,
        seed=options.seed,
    )
    chosen = range(options.samples) if indices is None else indices
    return [FAMILIES[name].sample(request, i, options.new_tokens) for i in chosen]


def clean_prediction(text: str) -> str:
    """The prediction as RULER's ``postprocess_pred`` leaves it: stripped, control characters
    (newlines and tabs included) turned into newlines."""
    return _CONTROL.sub("\n", text.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[bool]:
    if not references:
        raise ValueError("references=[] is empty: a sample needs at least one reference")
    found = clean_prediction(prediction).lower()
    return [str(reference).lower() in found for reference in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of ``references`` in ``prediction``, ignoring case: RULER's score (its
    ``scripts/eval/synthetic/constants.py``) of these families; none is a ValueError."""
    found = _found(prediction, references)
    return sum(found) / len(found)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is in ``prediction`` (ignoring case), else 0.0: RULER's
    score of its QA tasks; none is a ValueError."""
    return float(any(_found(prediction, references)))
