"""The ``Router`` facade: ClusterState + PrefixIndex + one Policy, with all dispatch bookkeeping.

Pure: no I/O, no threads, no clock — every call is told ``now`` (seconds). The simulator and the live
HTTP router drive the very same object. Lifecycle of a request::

    worker = router.route(request, now)            # choose + bookkeeping
    router.first_token(request.id, now)            # optional
    router.finish(request.id, now, ok=True, prompt_tokens=..., cached_tokens=...)

Retry on another worker: ``finish(id, now, ok=False)`` then ``route(same_request, now, exclude={failed})``.
``finish`` is idempotent; it releases every piece of per-request state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from kvroute.cython_ext.prefix_index import PrefixIndex
from kvroute.router.policies import make_policy
from kvroute.router.state import CharsPerTokenEstimator, ClusterState, default_service_time
from kvroute.router.types import NoWorkerAvailable, Policy, Request, WorkerView

MAX_WORKERS = 256  # PrefixIndex worker slots
# Default prefix-index bound per worker, in characters: ~3x the text of a 200k-token KV pool (~4 chars a
# token), and the 10M-character total the router had at its default 4 workers.
INDEX_CHARS_PER_WORKER = 2_500_000


class Router:
    """One routing domain: the workers, their state, the shared prefix index, and the policy."""

    def __init__(
        self,
        policy: str | Policy,
        workers: Iterable[str] = (),
        *,
        max_index_chars: int | None = None,
        seed: int | None = None,
        **policy_options: Any,
    ) -> None:
        if isinstance(policy, str):
            self.policy: Policy = make_policy(policy, **policy_options)
        elif isinstance(policy, Policy):
            if policy_options:
                raise ValueError(
                    f"policy options {sorted(policy_options)} given with a ready-made policy object; "
                    "pass them to make_policy instead"
                )
            self.policy = policy
        else:
            raise TypeError(f"policy must be a name or a Policy, got {type(policy).__name__}")
        if max_index_chars is not None and (
            isinstance(max_index_chars, bool) or not isinstance(max_index_chars, int) or max_index_chars <= 0
        ):
            raise ValueError(f"max_index_chars must be a positive int or None, got {max_index_chars!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self.policy.bind(seed)
        # None: INDEX_CHARS_PER_WORKER per worker, following membership (as sglang-router bounds each
        # worker's share of its tree); an int: that many characters in all
        self.fixed_index_chars = max_index_chars
        self.index = PrefixIndex(max_index_chars or INDEX_CHARS_PER_WORKER)
        self.state = ClusterState()
        # learned from finished requests' prompt_tokens; used for est_tokens and queued prefill estimates
        self.chars_per_token = CharsPerTokenEstimator()
        self.workers: list[str] = []
        for worker_id in workers:
            self.add_worker(worker_id)

    # -- membership --------------------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker id must be a non-empty str, got {worker_id!r}")
        if len(self.workers) >= MAX_WORKERS and worker_id not in self.workers:
            raise ValueError(
                f"a Router holds at most {MAX_WORKERS} workers (the prefix index's worker slots)"
            )
        self.state.add_worker(worker_id)  # raises on a duplicate
        self.workers.append(worker_id)
        self._size_index()
        self.policy.on_worker_added(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forgets the worker and frees its share of the prefix index; its in-flight requests can
        still be finished (a no-op for state that no longer exists)."""
        self.state.remove_worker(worker_id)  # raises on an unknown worker
        self.workers.remove(worker_id)
        self.index.remove_worker(worker_id)
        self._size_index()
        self.policy.on_worker_removed(worker_id)

    def _size_index(self) -> None:
        if self.fixed_index_chars is None:
            self.index.set_max_chars(INDEX_CHARS_PER_WORKER * max(1, len(self.workers)))

    # -- requests -----------------------------------------------------------------------------------
    def estimate_tokens(self, text: str) -> int:
        """Prompt tokens estimated from characters with the learned chars-per-token ratio."""
        return max(1, self.chars_per_token.tokens(len(text))) if text else 0

    def route(self, request: Request, now: float, exclude: Collection[str] = ()) -> str:
        """Chooses a worker for ``request`` and records the dispatch; returns the worker id.

        Raises ``NoWorkerAvailable`` when no worker is eligible, ``ValueError`` if the request id is
        still in flight (finish it first).
        """
        view = self._decide(request, now, exclude)
        self._dispatch(request, view, now)
        return view.id

    def decide(self, request: Request, now: float, exclude: Collection[str] = ()) -> str:
        """The worker ``route`` would choose, without dispatching: no request, load or index state
        changes. The policy's own decision state may advance (its random stream, round_robin's cursor),
        exactly as in a ``route`` call."""
        return self._decide(request, now, exclude).id

    def _decide(self, request: Request, now: float, exclude: Collection[str]) -> WorkerView:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__}")
        if self.state.in_flight_record(request.id) is not None:
            raise ValueError(
                f"request {request.id!r} is already in flight; finish it before routing it again"
            )
        if isinstance(exclude, str):
            raise TypeError("exclude must be a collection of worker ids, not a single str")
        eligible = [w for w in self.workers if w not in exclude] if exclude else self.workers
        if not eligible:
            raise NoWorkerAvailable(
                "no worker available"
                + (f" (excluded: {sorted(exclude)})" if exclude else " (none registered)")
            )
        matches = self.index.match(request.text) if request.text else {}
        views = self.state.views(eligible, now, matches, self.index.worker_chars)
        chosen = self.policy.choose(request, views, now)
        for view in views:
            if view.id == chosen:
                return view
        raise RuntimeError(f"policy {self.policy.name!r} chose {chosen!r}, not an eligible worker")

    def _dispatch(self, request: Request, view: WorkerView, now: float) -> None:
        cached_tokens = min(request.est_tokens, self._chars_to_tokens(view.match_chars, request))
        service_s = self.policy.service_time(request, view.match_chars)
        if service_s is None:
            service_s = default_service_time(request.est_tokens - cached_tokens, cached_tokens)
        if request.text:  # first: the only step that can fail (MemoryError) leaves no half-recorded dispatch
            self.index.insert(request.text, view.id, now)
        self.state.dispatch(request, view, now, float(service_s), request.est_tokens - cached_tokens)
        self.policy.on_dispatch(request, view, now)

    def _chars_to_tokens(self, chars: int, request: Request) -> int:
        if chars <= 0:
            return 0
        if self.chars_per_token.observations == 0 and request.est_tokens > 0 and request.text:
            # nothing learned yet: the request's own estimate is the best ratio we have
            return int(round(chars * request.est_tokens / len(request.text)))
        return self.chars_per_token.tokens(chars)

    def first_token(self, request_id: str, now: float) -> None:
        """Marks the first token of an in-flight request (no-op if unknown or already marked)."""
        record = self.state.first_token(request_id, now)
        if record is not None:
            self.policy.on_first_token(request_id, record.worker, now, max(0.0, now - record.dispatched_at))

    def finish(
        self,
        request_id: str,
        now: float,
        ok: bool,
        *,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Ends a request: releases its load, in-flight slot and queued tokens. Idempotent."""
        for name, value in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        record = self.state.finish(request_id, now, ok)
        if record is None:
            return
        text_len = len(record.request.text)
        if ok and prompt_tokens:
            self.chars_per_token.observe(text_len, prompt_tokens)
        # clamp at 0: a caller's clock that steps back must not feed negative latencies to learning policies
        ttft = (
            None if record.first_token_at is None else max(0.0, record.first_token_at - record.dispatched_at)
        )
        self.policy.on_finish(
            request_id,
            record.worker,
            now,
            ok,
            ttft,
            max(0.0, now - record.dispatched_at),
            prompt_chars=text_len,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )

    # -- metrics / introspection ---------------------------------------------------------------------
    def update_metrics(self, worker_id: str, metrics: Mapping[str, float]) -> None:
        self.state.update_metrics(worker_id, metrics)

    def in_flight(self) -> list[str]:
        return self.state.in_flight_ids()

    def worker_of(self, request_id: str) -> str | None:
        record = self.state.in_flight_record(request_id)
        return None if record is None else record.worker

    def snapshot(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """Per worker: in_flight, queued_prefill_tokens, load (at ``now``; at the last known time if
        omitted), requests, errors, index_chars; plus ``"__index__"``: stored_chars, nodes, max_chars,
        chars_per_token."""
        t = 0.0 if now is None else now
        snap = self.state.snapshot(t) if now is not None else self._snapshot_no_time()
        for wid, entry in snap.items():
            entry["index_chars"] = float(self.index.worker_chars(wid))
        snap["__index__"] = {
            "stored_chars": float(self.index.stored_chars),
            "nodes": float(self.index.node_count),
            "max_chars": float(self.index.max_chars),
            "chars_per_token": self.chars_per_token.ratio,
        }
        return snap

    def _snapshot_no_time(self) -> dict[str, dict[str, float]]:
        # without a time, report each load as of its last update (no further decay applied)
        out: dict[str, dict[str, float]] = {}
        for w in self.state.workers_state():
            out[w.id] = {
                "in_flight": float(w.in_flight),
                "queued_prefill_tokens": float(w.queued_prefill_tokens),
                "load": w.load.last_value,
                "requests": float(w.requests),
                "errors": float(w.errors),
            }
        return out
