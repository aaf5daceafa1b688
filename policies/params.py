"""Checks for policy parameters, so a bad YAML value fails at load time with the parameter's name."""

from __future__ import annotations


def positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer")
    return value


def non_negative(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a number >= 0")
    return float(value)


def positive(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a number > 0")
    return float(value)
