"""Which decoder families alisa runs exactly, and why it refuses the others (README table).

    python -m experiments.architectures                   # markdown table, then one JSON line
    python -m experiments.architectures --families llama,bloom
    python -m experiments.architectures --write docs/supported-models.md   # the doc, every row

Runs every row of :mod:`experiments.architecture_table` (each model type of transformers'
causal-LM mapping, built tiny from its config): ``EXACT`` when it is token-identical to HF's
greedy ``generate`` at r = 1 in drop, host and INT8 modes (a left-padded batch of 2, every
cache layer having seen every token), else the words of its refusal when the cache is built,
or the crash or the silent difference (``tests/test_architectures.py`` fails on those). The
table groups the rows by outcome.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

import torch
import transformers

from experiments.architecture_table import EXACT, FAMILIES, NOT_RUN, Family, build

__all__ = ["EXACT", "FAMILIES", "Family", "Outcome", "build", "main", "run_family"]

REFUSED = "refused"
CRASH = "crash"
DIFFERS = "differs"
NOT_BUILT = "not built"
STATUSES = (EXACT, REFUSED, CRASH, DIFFERS, NOT_BUILT)
MODES: Mapping[str, Mapping] = MappingProxyType(
    {
        "drop": {},
        # An unreached token budget: host retention runs (every token in the host region,
        # the sketch written) yet nothing leaves the device. At r = 1 the policy could evict
        # nothing, so the cache dropped instead and the mode tested nothing of its own.
        "host": {"policy": "swa", "budget_tokens": 10_000, "retention": "host"},
        "int8": {"kv_bits": 8, "residual_tokens": 64},
    }
)
NEW_TOKENS = 6
PROMPT_LENGTHS = (12, 7)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What happened to one row.

    Attributes
    ----------
    family, model
        The row's name and the model class built ("" when none was).
    status
        ``EXACT``; ``"refused"`` (a ValueError when the cache is built); ``"crash"`` (after
        construction, or at it with anything but a ValueError); ``"differs"`` (a silent
        difference); ``"not built"`` (the tiny model, or HF's own ``generate`` on it, failed:
        the row cannot be judged).
    detail
        The refusal's reason, the error, or the modes that differ.
    """

    family: str
    model: str
    status: str
    detail: str = ""

    def owed(self, family: Family) -> bool:
        """Whether this is the outcome ``family`` is owed."""
        if family.expected == EXACT:
            return self.status == EXACT
        return self.status == REFUSED and family.expected in self.detail


def prompts(
    seed: int = 1, lengths: tuple[int, ...] = PROMPT_LENGTHS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded random token ids (3..511: no pad, EOS or BOS) and their mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, 512, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def run_family(
    name: str, family: Family, new_tokens: int = NEW_TOKENS, device: str | torch.device = "cpu"
) -> Outcome:
    """Build one row's model on ``device``, then each mode's exactness or the refusal's reason."""
    from alisa import AlisaCache, AlisaConfig

    try:
        model = build(family).to(device)
    except Exception as error:  # the config or its modeling code: the row cannot be judged
        return Outcome(family=name, model="", status=NOT_BUILT, detail=_error(error))
    row = {"family": name, "model": type(model).__name__}
    try:
        caches = {mode: AlisaCache(model, AlisaConfig(**fields)) for mode, fields in MODES.items()}
    except ValueError as error:
        return Outcome(**row, status=REFUSED, detail=str(error).split(": ", 1)[-1])
    except Exception as error:
        return Outcome(**row, status=CRASH, detail=f"at construction: {_error(error)}")
    ids, mask = (tensor.to(device) for tensor in prompts())
    options = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=mask)
    with torch.inference_mode():
        try:
            reference = model.generate(ids, **options)
        except Exception as error:
            return Outcome(**row, status=NOT_BUILT, detail=f"HF's generate: {_error(error)}")
        differs = []
        for mode, cache in caches.items():
            try:
                tokens = model.generate(ids, past_key_values=cache, **options)
            except Exception as error:
                return Outcome(**row, status=CRASH, detail=f"{mode}: {_error(error)}")
            unseen = _layers_missing_tokens(cache, ids.shape[1] + new_tokens - 1)
            if not torch.equal(tokens, reference) or unseen:
                differs.append(mode + (f" (layers {unseen} missed tokens)" if unseen else ""))
    if differs:
        return Outcome(**row, status=DIFFERS, detail=", ".join(differs))
    return Outcome(**row, status=EXACT)


def _layers_missing_tokens(cache, tokens: int) -> list[int]:
    """Cache layers that did not see all ``tokens`` (the model bypassed them)."""
    return [index for index, layer in enumerate(cache.layers) if layer.get_seq_length() != tokens]


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def table(outcomes: list[Outcome], not_run: Mapping[str, str]) -> list[str]:
    """Markdown lines: a count line, then one table row per outcome (rows with the same
    outcome grouped, largest group first), the model types not run last."""
    groups: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.status == EXACT:
            label = "exact at r = 1 (drop / host / INT8)"
        elif outcome.status == REFUSED:
            label = f"refused: {outcome.detail}"
        else:
            label = f"**{outcome.status}**: {outcome.detail}"
        groups.setdefault(label, []).append(outcome.family)
    for model_type, reason in not_run.items():
        groups.setdefault(f"not run: {reason}", []).append(model_type)
    counts = {status: sum(o.status == status for o in outcomes) for status in STATUSES}
    summary = ", ".join(f"{count} {status}" for status, count in counts.items())
    lines = [
        f"{len(outcomes)} rows (transformers {transformers.__version__}): {summary}; "
        f"{len(not_run)} model types not run.",
        "",
        "| outcome | families |",
        "|---|---|",
    ]
    ordered = sorted(
        groups.items(), key=lambda item: (item[0].startswith("not run"), -len(item[1]))
    )
    for label, names in ordered:
        lines.append(f"| {label} ({len(names)}) | {', '.join(f'`{n}`' for n in sorted(names))} |")
    return lines


def rows_table(outcomes: list[Outcome]) -> list[str]:
    """Markdown lines: one table row per family, in name order."""
    lines = ["| family | model class | outcome |", "|---|---|---|"]
    for outcome in sorted(outcomes, key=lambda outcome: outcome.family):
        cell = outcome.status if outcome.status == EXACT else f"{outcome.status}: {outcome.detail}"
        model = f"`{outcome.model}`" if outcome.model else ""
        lines.append(f"| `{outcome.family}` | {model} | {cell} |")
    return lines


DOC_INTRO = """\
# Supported models

Generated by `python -m experiments.architectures --write docs/supported-models.md` (transformers
{transformers}, torch {torch}); `tests/test_architectures.py` asserts every row.

Each row is a model type of transformers' causal-LM auto mapping (or a variant of one: sliding
windows on and off), built tiny from its config class with seeded random weights
(`experiments/tiny_models.py`, `experiments/architecture_table.py`). **Exact** means
token-identical to the model's own greedy `generate` at r = 1 on a left-padded batch of 2, in
drop, host-retention (at an unreached token budget) and INT8 modes, with every cache layer having
seen every token. Any other
family is **refused** with a `ValueError` when the `AlisaCache` is built, naming the reason;
a crash after construction or a silent difference fails the test. A model type a new
transformers release adds is a row owed exactness: it fails until alisa runs it exactly or
refuses it with its reason.
"""


def document(outcomes: list[Outcome], not_run: Mapping[str, str]) -> str:
    """The supported-models doc: the grouped table, then every row."""
    intro = DOC_INTRO.format(transformers=transformers.__version__, torch=torch.__version__)
    parts = [intro, "## By outcome", "", *table(outcomes, not_run), ""]
    parts += ["## Row by row", "", *rows_table(outcomes), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=None, help="comma list (default: all)")
    parser.add_argument("--write", default=None, metavar="PATH", help="also write the doc here")
    args = parser.parse_args(argv)
    names = args.families.split(",") if args.families else sorted(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {', '.join(sorted(FAMILIES))}")
    outcomes = [run_family(name, FAMILIES[name]) for name in names]
    not_run = {} if args.families else dict(NOT_RUN)
    print("\n".join(table(outcomes, not_run)))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(document(outcomes, not_run))
    rows = [asdict(outcome) for outcome in outcomes]
    print(json.dumps({"benchmark": "architectures", "rows": rows, "not_run": not_run}))


if __name__ == "__main__":
    main()
