"""``cache_aware``: sglang-router's cache-aware load balancing (``policies/cache_aware.rs``, 0.3.2).

Loads are router-side in-flight request counts. If the cluster is imbalanced —
``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min`` — route to the least
loaded worker. Otherwise find the longest prefix match over all workers; if
``matched_chars / len(text) > cache_threshold`` route to the worker holding it, else to the worker whose
share of the prefix index is smallest ("smallest tenant": most free cache, by sglang's estimate).

Presets: ``sglang-0.3.2`` (default; 0.3 / 64 / 1.5) and ``sglang-0.1.4`` (0.5 / 32 / 1.0001, the
version seed 004 ran as its Cache-Aware baseline). Explicit thresholds override the preset. Where
sglang picks an arbitrary worker among equals (DashMap iteration order), we pick one at random (seeded).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy, argmin_random
from kvroute.router.types import Request, WorkerView

PRESETS: dict[str, tuple[float, int, float]] = {
    # name: (cache_threshold, balance_abs_threshold, balance_rel_threshold)
    "sglang-0.3.2": (0.3, 64, 1.5),
    "sglang-0.1.4": (0.5, 32, 1.0001),
}
FALLBACKS = ("smallest_tree", "least_load")


class CacheAwarePolicy(SeededPolicy):
    name = "cache_aware"

    def __init__(
        self,
        preset: str = "sglang-0.3.2",
        cache_threshold: float | None = None,
        balance_abs_threshold: int | None = None,
        balance_rel_threshold: float | None = None,
        fallback: str = "smallest_tree",
    ) -> None:
        super().__init__()
        if preset not in PRESETS:
            raise ValueError(f"cache_aware: unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
        if fallback not in FALLBACKS:
            raise ValueError(f"cache_aware: fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
        ct, abs_t, rel_t = PRESETS[preset]
        self.preset = preset
        self.cache_threshold = float(ct if cache_threshold is None else cache_threshold)
        self.balance_abs_threshold = int(abs_t if balance_abs_threshold is None else balance_abs_threshold)
        self.balance_rel_threshold = float(rel_t if balance_rel_threshold is None else balance_rel_threshold)
        self.fallback = fallback
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_aware: cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("cache_aware: balance thresholds must be >= 0")

    def is_imbalanced(self, workers: Sequence[WorkerView]) -> bool:
        loads = [v.in_flight for v in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        rng = self.rng
        if self.is_imbalanced(workers):
            return argmin_random(workers, lambda v: v.in_flight, rng).id
        best = max(v.match_chars for v in workers)
        text_len = len(request.text)
        match_rate = best / text_len if text_len else 0.0
        if match_rate > self.cache_threshold:
            holders = [v for v in workers if v.match_chars == best]
            return holders[rng.randrange(len(holders))].id if len(holders) > 1 else holders[0].id
        if self.fallback == "least_load":
            return argmin_random(workers, lambda v: v.in_flight, rng).id
        return argmin_random(workers, lambda v: v.index_chars, rng).id
