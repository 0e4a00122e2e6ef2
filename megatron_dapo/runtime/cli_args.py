"""argparse types for numeric flags that refuse what the command cannot use: non-numbers, NaN, infinity
and values outside the flag's range. argparse turns the refusal into `argument --flag: ...`, exit 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type = float, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Callable[[str], float | int]:
    """An argparse `type=`: `kind` (int or float) in [low, high], or (low, high] when `low_open`."""
    what = f"{'an integer' if kind is int else 'a finite number'} {_range_text(low, high, low_open)}".rstrip()

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and value > high
        if not math.isfinite(value) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _range_text(low: float | None, high: float | None, low_open: bool) -> str:
    text = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{text(low)}, {text(high)}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {text(low)}"
    return "" if high is None else f"<= {text(high)}"
