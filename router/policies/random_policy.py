"""``random``: uniform choice among the eligible workers (sglang-router ``random``; seed 004 baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy
from kvroute.router.types import Request, WorkerView


class RandomPolicy(SeededPolicy):
    name = "random"

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        return workers[self.rng.randrange(len(workers))].id
