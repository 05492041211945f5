"""``lmetric`` (seed 002, LMetric): score_i = P_i x BS_i, lowest wins, no tunable weights.

P_i ("P-token") = new prefill tokens if routed to i: this request's uncached tokens on i plus the
prefill tokens already queued on i (dispatched, no first token yet). BS_i = batch size of i: requests
running + queued there (router-side in-flight count).

Zero factors (the paper does not say): a raw product is 0 for every idle worker whatever its cache
state, and 0 for a full cache hit however loaded the worker is. We therefore count the request being
routed in both factors — BS_i + 1 (the batch it would join) and max(P_i, 1) (an engine always
recomputes at least the last prompt token) — so an idle worker still ranks by P-tokens, and a cached
worker still pays for its batch. Exact ties are broken at random. The paper's hotspot detector
(two-phase filter for KV$ hotspots) is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy, argmin_random
from kvroute.router.state import CharsPerTokenEstimator
from kvroute.router.types import Request, WorkerView


class LMetricPolicy(SeededPolicy):
    name = "lmetric"

    def __init__(self, chars_per_token_prior: float = 4.0) -> None:
        super().__init__()
        self.chars_per_token = CharsPerTokenEstimator(chars_per_token_prior)

    def _hit_tokens(self, request: Request, match_chars: int) -> float:
        if match_chars <= 0:
            return 0.0
        if self.chars_per_token.observations == 0 and request.est_tokens > 0 and request.text:
            return match_chars * request.est_tokens / len(request.text)
        return match_chars / self.chars_per_token.ratio

    def score(self, request: Request, view: WorkerView) -> float:
        uncached = max(0.0, request.est_tokens - self._hit_tokens(request, view.match_chars))
        p_tokens = max(1.0, uncached + view.queued_prefill_tokens)
        return p_tokens * (view.in_flight + 1)

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        return argmin_random(workers, lambda v: self.score(request, v), self.rng).id

    def on_finish(
        self,
        request_id: str,
        worker_id: str,
        now: float,
        ok: bool,
        ttft: float | None,
        e2e: float,
        *,
        prompt_chars: int,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        if ok and prompt_tokens:
            self.chars_per_token.observe(prompt_chars, prompt_tokens)
