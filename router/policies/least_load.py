"""``least_load``: the worker with the fewest router-side in-flight requests (shortest queue, as
sglang-router's imbalanced branch); ties broken at random. ``by`` picks the load measure."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy, argmin_random
from kvroute.router.types import Request, WorkerView

LOAD_MEASURES = ("in_flight", "queued_prefill_tokens", "load")


class LeastLoadPolicy(SeededPolicy):
    name = "least_load"

    def __init__(self, by: str = "in_flight") -> None:
        super().__init__()
        if by not in LOAD_MEASURES:
            raise ValueError(f"least_load: by must be one of {list(LOAD_MEASURES)}, got {by!r}")
        self.by = by

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        by = self.by
        return argmin_random(workers, lambda v: getattr(v, by), self.rng).id
