"""argparse types the benchmark scripts share: a bad value stops a script with "argument --flag:
..." (argparse names the flag) before anything is built or spawned."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lightning_sdp4bit.simulation import parse_world

__all__ = ["at_least", "each_at_least", "simulated_world"]


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """A type for argparse: `kind(text)`, refused below `minimum`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text}")
        return value

    return parse


def each_at_least(minimum: int) -> Callable[[str], list[int]]:
    """A type for argparse: comma-separated integers ("1,2"), each refused below `minimum`."""
    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        return [int(one(item)) for item in text.split(",")]

    return parse


def simulated_world(text: str) -> str:
    """A type for argparse: a simulated job's "MxL" (lightning_sdp4bit.simulation.parse_world), kept as text."""
    try:
        parse_world(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
