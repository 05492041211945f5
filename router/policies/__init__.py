"""Routing policies, one per module; ``make_policy(name, **options)`` builds one by name.

Every policy is pure decision code (see ``kvroute.router.types.Policy``): it sees a ``Request``, the
eligible ``WorkerView``s and ``now``, and returns a worker id.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from kvroute.router.types import Policy

# name -> (module, class); modules are imported on first use
_REGISTRY: dict[str, tuple[str, str]] = {
    "random": ("random_policy", "RandomPolicy"),
    "round_robin": ("round_robin", "RoundRobinPolicy"),
    "least_load": ("least_load", "LeastLoadPolicy"),
    "power_of_two": ("power_of_two", "PowerOfTwoPolicy"),
    "prefix_hash": ("prefix_hash", "PrefixHashPolicy"),
    "cache_aware": ("cache_aware", "CacheAwarePolicy"),
    "lbgr": ("lbgr", "LBGRPolicy"),
    "lmetric": ("lmetric", "LMetricPolicy"),
    "lodestar": ("lodestar", "LodestarPolicy"),
    "br0": ("br0", "BR0Policy"),
}

POLICY_NAMES: list[str] = list(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}")
    module_name, class_name = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)


def policy_options(name: str) -> dict[str, Any]:
    """The options ``name`` accepts, with their defaults."""
    sig = inspect.signature(policy_class(name).__init__)
    return {
        p.name: p.default
        for p in sig.parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def make_policy(name: str, **options: Any) -> Policy:
    """Builds policy ``name``. Unknown names and unknown options raise ValueError listing the valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"policy name must be str, got {type(name).__name__}")
    cls = policy_class(name)
    valid = policy_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
        raise ValueError(f"policy {name!r} has no option(s) {unknown}; valid options: {listed}")
    return cls(**options)


__all__ = ["POLICY_NAMES", "make_policy", "policy_class", "policy_options"]
