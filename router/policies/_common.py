"""Helpers shared by the policies: seeded RNG binding and argmin with random tie-breaking."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvroute.router.types import Policy, WorkerView

T = TypeVar("T")


class SeededPolicy(Policy):
    """A policy that owns a ``random.Random``; the Router seeds it through ``bind``."""

    def __init__(self) -> None:
        self.rng = random.Random()

    def bind(self, seed: int | None) -> None:
        # one stream per policy name, so two policies under the same Router seed do not correlate
        self.rng = random.Random(None if seed is None else f"{self.name}:{seed}")


def argmin_random(items: Sequence[T], key: Callable[[T], float], rng: random.Random, tol: float = 0.0) -> T:
    """The item with the smallest key; among items within ``tol`` of the minimum, one at random."""
    best = min(key(item) for item in items)
    ties = [item for item in items if key(item) <= best + tol]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def least_in_flight(views: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    return argmin_random(views, lambda v: v.in_flight, rng)
