"""``br0`` (seed 001, BalanceRoute BR-0, pool-bypass form of Appendix D.6).

Each worker's load L_i is its KV footprint: the prompt tokens of the requests dispatched to it and not
yet finished (the "virtual load" of the pool-bypass path, which counts running and dispatched requests
alike; decode growth is unknown to a prediction-free router). For a request of size s (its prompt
tokens) the safe margin is m_i = max_j L_j - L_i and the F-score

    F_i(s) = min(s, N * m_i - (N - 1) * s)

is the reduction of the max-minus-mean imbalance if the request goes to i: linear while it fits under
the heaviest worker, and penalised N-1 fold once it overflows. Route to the largest F (ties at random).
With one waiting request at a time (no prompt pool) Stage 2 collapses to Stage 1, as the paper notes.
``max_inflight`` optionally caps per-worker in-flight requests (the paper's dispatcher cap); capped
workers are skipped unless every worker is capped.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.policies._common import SeededPolicy
from kvroute.router.types import Request, WorkerView


class BR0Policy(SeededPolicy):
    name = "br0"

    def __init__(self, max_inflight: int | None = None) -> None:
        super().__init__()
        if max_inflight is not None and (isinstance(max_inflight, bool) or int(max_inflight) < 1):
            raise ValueError(f"br0: max_inflight must be a positive int or None, got {max_inflight!r}")
        self.max_inflight = max_inflight
        self._footprint: dict[str, float] = {}
        self._requests: dict[str, tuple[str, float]] = {}

    def footprint(self, worker_id: str) -> float:
        return self._footprint.get(worker_id, 0.0)

    @staticmethod
    def f_score(s: float, margin: float, n: int) -> float:
        return min(s, n * margin - (n - 1) * s)

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        pool = workers
        if self.max_inflight is not None:
            pool = [v for v in workers if v.in_flight < self.max_inflight] or workers
        loads = [self._footprint.get(v.id, 0.0) for v in pool]
        heaviest = max(loads)
        n = len(pool)
        s = float(max(1, request.est_tokens))
        scores = [self.f_score(s, heaviest - load, n) for load in loads]
        best = max(scores)
        ties = [i for i, f in enumerate(scores) if f == best]
        return pool[ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]].id

    def on_dispatch(self, request: Request, worker: WorkerView, now: float) -> None:
        size = float(max(1, request.est_tokens))
        self._footprint[worker.id] = self._footprint.get(worker.id, 0.0) + size
        self._requests[request.id] = (worker.id, size)

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
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        wid, size = entry
        if wid in self._footprint:
            left = self._footprint[wid] - size
            self._footprint[wid] = left if left > 1e-9 else 0.0

    def on_worker_added(self, worker_id: str) -> None:
        self._footprint.setdefault(worker_id, 0.0)

    def on_worker_removed(self, worker_id: str) -> None:
        self._footprint.pop(worker_id, None)
