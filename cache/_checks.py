"""Argument checks shared by the Cython-backed cache and the pure-Python reference (no I/O)."""

from __future__ import annotations

from numbers import Integral

POLICIES = ("lru", "rlt", "rlt-leaf", "opt")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError/ValueError naming ``name`` otherwise."""
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if not isinstance(seed, Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return int(seed)


def check_policy(policy: object) -> str:
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string, got {type(policy).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
    return policy
