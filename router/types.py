"""The values that cross the router's layers: requests, read-only worker views, the policy protocol.

Everything here is pure data or pure interface: no I/O, no threads, no clock. Time is always passed in
as seconds (float) by the caller — the simulator's virtual clock or the live router's monotonic clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_EMPTY_METRICS: Mapping[str, float] = MappingProxyType({})


class NoWorkerAvailable(ValueError):
    """No worker is eligible for a request (none registered, or all excluded)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the router sees it.

    ``text`` is what the prefix index matches (the prompt, or chat messages flattened);
    ``est_tokens`` the estimated prompt length in tokens (exact in the simulator, chars x learned ratio
    in the live router, see ``Router.estimate_tokens``).
    """

    id: str
    text: str
    est_tokens: int
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Request.id must be a non-empty str, got {self.id!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"Request.text must be str, got {type(self.text).__name__}")
        if isinstance(self.est_tokens, bool) or not isinstance(self.est_tokens, int) or self.est_tokens < 0:
            raise ValueError(f"Request.est_tokens must be an int >= 0, got {self.est_tokens!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"Request.max_tokens must be an int >= 0, got {self.max_tokens!r}")


@dataclass(frozen=True, slots=True)
class WorkerView:
    """Read-only snapshot of one worker, built per routing decision and handed to the policy.

    ``load`` is the decayed queue load (LBGR's W_i) in seconds; ``match_chars`` this request's prefix
    match on this worker in characters; ``index_chars`` how many characters the prefix index currently
    attributes to this worker (sglang-router's "tenant size"); ``metrics`` the last engine metrics.
    """

    id: str
    in_flight: int
    queued_prefill_tokens: int
    load: float
    match_chars: int
    metrics: Mapping[str, float] = field(default_factory=lambda: _EMPTY_METRICS)
    index_chars: int = 0


class Policy:
    """Base class of every routing policy.

    Contract: ``choose`` returns the id of one of the ``workers`` it was given (never an empty list: the
    Router raises ``NoWorkerAvailable`` before calling it). Policies keep only their own learned state;
    they do no I/O and never read the clock. Randomness comes from ``self.rng`` seeded by the Router.
    The lifecycle hooks are called by the Router exactly once per dispatched request, in order
    dispatch -> (first token) -> finish.
    """

    name: str = "base"

    def bind(self, seed: int | None) -> None:
        """Called once by the Router before use; policies that draw random numbers seed here."""

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        raise NotImplementedError

    def service_time(self, request: Request, match_chars: int) -> float | None:
        """Estimated service seconds of ``request`` on a worker that matches ``match_chars``.

        The Router adds this to the worker's decayed queue load on dispatch. ``None`` means "use the
        ClusterState's default cost model" (seed 004's service time with its default coefficients).
        """
        return None

    def on_dispatch(self, request: Request, worker: WorkerView, now: float) -> None:
        """``worker`` is the view the decision was made on (state before this dispatch)."""

    def on_first_token(self, request_id: str, worker_id: str, now: float, ttft: float) -> None:
        pass

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
        pass

    def on_worker_added(self, worker_id: str) -> None:
        pass

    def on_worker_removed(self, worker_id: str) -> None:
        pass
