"""``round_robin``: cycle through the eligible workers in registration order (sglang-router
``round_robin``: a counter taken modulo the number of workers)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.types import Policy, Request, WorkerView


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        worker = workers[self._counter % len(workers)]
        self._counter += 1
        return worker.id
