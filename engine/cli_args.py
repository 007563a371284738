"""argparse types for the commands and examples: a number that cannot mean anything is the
flag's own error (argparse names the flag), never a traceback nor a value that means something
else (0 requests, a negative rate)."""

from __future__ import annotations

import argparse
import math


def number(kind: type, low: float, *, strict: bool = False, high: float = math.inf):
    """A finite `kind` (int or float) >= low (> low when strict) and <= high."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{'an integer' if kind is int else 'a number'} expected, "
                                             f"got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:,}, got {text}")
        return value

    return parse


def numbers(kind: type, low: float):
    """Comma-separated `number(kind, low)`s ("" = none)."""
    one = number(kind, low)

    def parse(text: str) -> list:
        return [one(v) for v in text.split(",") if v]

    return parse


positive_int = number(int, 1)
