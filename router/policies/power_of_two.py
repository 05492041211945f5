"""``power_of_two``: sample two distinct workers at random, take the one with fewer in-flight requests
(Mitzenmacher's power of two choices; sglang-router ``power_of_two``). Ties at random."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy
from kvroute.router.types import Request, WorkerView


class PowerOfTwoPolicy(SeededPolicy):
    name = "power_of_two"

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        if len(workers) == 1:
            return workers[0].id
        i, j = self.rng.sample(range(len(workers)), 2)
        a, b = workers[i], workers[j]
        if a.in_flight != b.in_flight:
            return (a if a.in_flight < b.in_flight else b).id
        return (a if self.rng.random() < 0.5 else b).id
