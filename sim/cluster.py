"""Discrete-event simulation of a cluster: a workload, the live router's ``Router``, N ``EngineModel``s.

The loop runs on a virtual clock. Events: a request arrives (the router routes it with exactly the calls
the live HTTP router makes, the chosen engine queues it) and an engine step ends (its first tokens and
finished requests are reported to the router with ``first_token`` / ``finish(prompt_tokens=,
cached_tokens=)``, then the engine starts its next step if it has work). Engine gauges are pushed to the
router with ``update_metrics`` every ``metrics_interval_s`` of virtual time, like a scrape.

Invariants: every request of the workload gets exactly one record; at the end the router holds no
request in flight and every engine is idle with nothing locked.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.router import Request, Router
from kvroute.sim.cost_model import CostModel, get_preset
from kvroute.sim.engine import EngineModel, StepResult


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in seconds on the virtual clock)."""

    id: str
    arrival_s: float
    worker: str
    prompt_tokens: int
    max_tokens: int
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "worker": self.worker,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "ok": True,
        }


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    workers: list[str]
    worker_stats: dict[str, dict[str, float]]
    makespan_s: float  # virtual time from the first arrival to the last finish
    wall_s: float
    events: int
    config: dict[str, Any] = field(default_factory=dict)


# event kinds, in the order they are handled at equal times: a step that ends at t frees load before an
# arrival at t is routed, and metrics are scraped last
_STEP_END, _ARRIVAL, _SCRAPE = 0, 1, 2


class ClusterSim:
    """A cluster of simulated engines behind the router.

    ``policy`` is a policy name (with ``policy_options``) or a ready ``Router``-compatible policy object;
    ``workers`` a count or a list of worker ids. Every engine gets the same preset, capacity and
    eviction policy; the per-engine seeds derive from ``seed``.
    """

    def __init__(
        self,
        *,
        policy: Any = "round_robin",
        workers: int | Sequence[str] = 4,
        eviction: str = "lru",
        preset: str | CostModel = "l40-llama3.1-8b",
        kv_capacity_tokens: int = 200_000,
        max_running: int | None = None,
        chunk_budget: int | None = None,
        seed: int = 0,
        metrics_interval_s: float = 1.0,
        policy_options: Mapping[str, Any] | None = None,
        router_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(workers, bool):
            raise TypeError("workers must be a count or a list of worker ids")
        if isinstance(workers, int):
            if workers < 1:
                raise ValueError(f"workers must be >= 1, got {workers}")
            worker_ids = [f"w{i}" for i in range(workers)]
        else:
            worker_ids = [str(w) for w in workers]
            if not worker_ids or len(set(worker_ids)) != len(worker_ids):
                raise ValueError(f"workers must be distinct non-empty ids, got {workers!r}")
        if not metrics_interval_s > 0:
            raise ValueError(f"metrics_interval_s must be > 0, got {metrics_interval_s!r}")
        self.cost = get_preset(preset)
        self.worker_ids = worker_ids
        self.engines: dict[str, EngineModel] = {
            w: EngineModel(
                preset=self.cost,
                kv_capacity_tokens=kv_capacity_tokens,
                eviction=eviction,
                max_running=max_running,
                chunk_budget=chunk_budget,
                seed=seed * 1000 + i,
            )
            for i, w in enumerate(worker_ids)
        }
        self.router = Router(
            policy, worker_ids, seed=seed, **dict(router_options or {}), **dict(policy_options or {})
        )
        self.metrics_interval_s = float(metrics_interval_s)
        self.config = {
            "policy": policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__),
            "policy_options": dict(policy_options or {}),
            "eviction": eviction,
            "workers": len(worker_ids),
            "preset": self.cost.name,
            "kv_capacity_tokens": kv_capacity_tokens,
            "max_running": self.engines[worker_ids[0]].max_running,
            "chunk_budget": self.engines[worker_ids[0]].chunk_budget,
            "seed": seed,
        }

    def run(self, workload: Sequence[Any], progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``workload`` (WorkloadRequest-like: id, arrival_s, text, tokens, max_tokens) to the end.

        ``progress(n)`` is called with the number of requests finished so far, now and then.
        """
        wall0 = time.perf_counter()
        arrivals = sorted(workload, key=lambda r: r.arrival_s)
        records: dict[str, RequestRecord] = {}
        for req in arrivals:
            if req.id in records:
                raise ValueError(f"duplicate request id {req.id!r} in the workload")
            records[req.id] = RequestRecord(req.id, float(req.arrival_s), "", len(req.tokens), req.max_tokens)
        router, engines = self.router, self.engines
        busy = dict.fromkeys(self.worker_ids, False)
        heap: list[tuple[float, int, int, Any]] = []
        seq = 0
        for i, req in enumerate(arrivals):
            heap.append((float(req.arrival_s), _ARRIVAL, i, req))
        heapq.heapify(heap)
        seq = len(arrivals)
        if arrivals:
            heapq.heappush(heap, (float(arrivals[0].arrival_s), _SCRAPE, seq, None))
            seq += 1
        finished = 0
        events = 0
        now = 0.0
        last_progress = 0

        def start_step(worker: str, t: float) -> None:
            nonlocal seq
            result = engines[worker].step(t)
            if result.duration > 0.0:
                busy[worker] = True
                heapq.heappush(heap, (result.end, _STEP_END, seq, (worker, result)))
                seq += 1
            else:
                busy[worker] = False

        while heap:
            now, kind, _, payload = heapq.heappop(heap)
            events += 1
            if kind == _ARRIVAL:
                req = payload
                chosen = router.route(Request(req.id, req.text, len(req.tokens), req.max_tokens), now)
                records[req.id].worker = chosen
                meta = getattr(req, "meta", None)
                output = meta.get("output") if meta else None
                engines[chosen].submit(req.id, req.tokens, req.max_tokens, now, output=output)
                if not busy[chosen]:
                    start_step(chosen, now)
            elif kind == _STEP_END:
                worker, result = payload
                self._deliver(result, now, records)
                finished += len(result.finished)
                if engines[worker].has_work():
                    start_step(worker, now)
                else:
                    busy[worker] = False
                if progress is not None and finished - last_progress >= 64:
                    progress(finished)
                    last_progress = finished
            else:  # scrape engine gauges; keep scraping while anything is left to do
                for w in self.worker_ids:
                    router.update_metrics(w, engines[w].metrics())
                if finished < len(arrivals):
                    heapq.heappush(heap, (now + self.metrics_interval_s, _SCRAPE, seq, None))
                    seq += 1
        if progress is not None:
            progress(finished)
        if finished != len(arrivals):
            raise RuntimeError(f"simulation ended with {len(arrivals) - finished} unfinished requests")
        makespan = (max(r.finish_s for r in records.values()) - arrivals[0].arrival_s) if arrivals else 0.0
        return SimResult(
            records=[records[r.id] for r in arrivals],
            workers=list(self.worker_ids),
            worker_stats={w: self._engine_stats(e) for w, e in engines.items()},
            makespan_s=makespan,
            wall_s=time.perf_counter() - wall0,
            events=events,
            config=dict(self.config),
        )

    def _deliver(self, result: StepResult, now: float, records: dict[str, RequestRecord]) -> None:
        router = self.router
        for req_id in result.first_tokens:
            records[req_id].first_token_s = now
            router.first_token(req_id, now)
        for fin in result.finished:
            rec = records[fin.req_id]
            rec.finish_s = now
            rec.cached_tokens = fin.cached_tokens
            rec.output_tokens = fin.output_tokens
            router.finish(
                fin.req_id, now, ok=True, prompt_tokens=fin.prompt_tokens, cached_tokens=fin.cached_tokens
            )

    @staticmethod
    def _engine_stats(engine: EngineModel) -> dict[str, float]:
        return {
            "requests": float(engine.finished_requests),
            "prompt_tokens": float(engine.prompt_tokens),
            "cached_tokens": float(engine.cached_tokens),
            "prefill_tokens_computed": float(engine.prefill_tokens_computed),
            "decode_tokens_computed": float(engine.decode_tokens_computed),
            "busy_s": engine.busy_s,
            "steps": float(engine.steps),
            "evicted_tokens": float(engine.evicted_tokens),
            "peak_kv_used_tokens": float(engine.peak_kv_used_tokens),
            "kv_capacity_tokens": float(engine.kv_capacity_tokens),
        }


def simulate(workload: Sequence[Any], **options: Any) -> SimResult:
    """Convenience: ``ClusterSim(**options).run(workload)``."""
    return ClusterSim(**options).run(workload)
