"""Checks of arguments shared by every package (the base layer: imports nothing of megafp8)."""
from __future__ import annotations


def check_integer(name: str, value, minimum: int = 1, note: str = "") -> int:
    """`value` if it is an int >= `minimum`, else ValueError naming `name` (and `note` after the
    value). bool is an int subclass, but True as a size is a mistake, not 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}{note}")
    return value
