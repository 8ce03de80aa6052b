"""What every benchmark script shares in its command line and its tables: argparse types (a bad
count reads the same everywhere), a figure's cell and a markdown table."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """``"3"`` -> 3; anything else is an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_ints(text: str) -> list[int]:
    """``"2048,4096"`` -> [2048, 4096]; anything else is an argparse error naming the value."""
    try:
        return [positive_int(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        message = f"{text!r} is not a comma list of positive integers"
        raise argparse.ArgumentTypeError(message) from None


def figure(value: float | None, digits: int = 1) -> str:
    """A table cell: ``value`` to ``digits`` decimals, ``-`` where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: ``header``, its rule, then one line per row of cells."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (header, *rows)]
    lines.insert(1, "|" + "---|" * len(header))
    return lines
