"""RULER's scoring: case-insensitive string match of the references in the cleaned prediction.

RULER (https://arxiv.org/abs/2404.06654, ``scripts/eval/synthetic/constants.py``) scores the
needle, variable-tracking and word-extraction tasks with ``string_match_all`` (the share of the
references found) and its QA tasks with ``string_match_part`` (any reference found).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """The prediction as RULER's ``postprocess_pred`` leaves it: stripped, control characters
    (newlines and tabs included) turned into newlines."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of ``references`` that occur in ``prediction``, ignoring case (RULER's
    ``string_match_all`` for one sample, in [0, 1]).

    Raises
    ------
    ValueError
        ``references`` is empty (a sample with nothing to find cannot be scored).
    """
    if not references:
        raise ValueError("references=[] is empty: a sample needs at least one reference")
    found = clean_prediction(prediction).lower()
    return sum(str(reference).lower() in found for reference in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` occurs in ``prediction`` (ignoring case), else 0.0 (RULER's
    ``string_match_part`` for one sample).

    Raises
    ------
    ValueError
        ``references`` is empty.
    """
    if not references:
        raise ValueError("references=[] is empty: a sample needs at least one reference")
    found = clean_prediction(prediction).lower()
    return float(any(str(reference).lower() in found for reference in references))
