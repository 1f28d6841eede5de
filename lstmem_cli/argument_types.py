"""argparse types of the ``lstmem`` command's options: each value checked where it is parsed, a bad
one a one-line usage error naming what was expected."""

from __future__ import annotations

import argparse


def _integer(text: str, minimum: int, what: str, bound: str) -> int:
    """``text`` as an integer of at least ``minimum``, or argparse's usage error: ``expected {what}``
    when it is not an integer, ``expected {bound}`` when it is below the minimum."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {bound}, got {value}")
    return value


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "a whole number", "a whole number >= 0")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer", "a positive integer")


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value
