"""Per-worker router-side state: in-flight requests, queued prefill, decayed queue load, engine metrics.

Pure bookkeeping: the caller passes the time. Invariants (checked by tests):
- every dispatched request is recorded once and released once; after all requests finish, a worker's
  in-flight count, queued prefill tokens and queue load are exactly zero;
- the queue load of a worker equals the sum of its in-flight requests' decayed service-time
  contributions (seed 004, Algorithm 2: W_i += S_i on dispatch, W_i *= gamma every delta seconds,
  the remainder of a request's contribution released when it finishes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvroute.router.types import Request, WorkerView

#: seed 004 reference: the load decays by 31/32 every 20 ms
DEFAULT_DECAY_FACTOR = 31.0 / 32.0
DEFAULT_DECAY_INTERVAL_S = 0.020


class DecayedLoad:
    """A queue load that decays by ``factor`` at every multiple of ``interval_s`` on the clock.

    Decay is computed from elapsed time (number of interval boundaries crossed), exactly as a
    background thread ticking every ``interval_s`` would, but without a thread. Contributions are
    released individually via ``release(amount, added_at)``.
    """

    __slots__ = ("factor", "interval_s", "_value", "_tick", "_log_factor")

    def __init__(self, factor: float = DEFAULT_DECAY_FACTOR, interval_s: float = DEFAULT_DECAY_INTERVAL_S):
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"decay factor must be in (0, 1], got {factor!r}")
        if not interval_s > 0.0:
            raise ValueError(f"decay interval must be > 0 seconds, got {interval_s!r}")
        self.factor = float(factor)
        self.interval_s = float(interval_s)
        self._value = 0.0
        self._tick = 0
        self._log_factor = math.log(self.factor)

    def tick_of(self, now: float) -> int:
        return math.floor(now / self.interval_s)

    def _decay(self, ticks: int) -> float:
        if ticks <= 0:
            return 1.0
        return math.exp(self._log_factor * ticks)

    def value(self, now: float) -> float:
        """The load at ``now`` (does not change state; time never runs backwards here)."""
        return self._value * self._decay(self.tick_of(now) - self._tick)

    def _advance(self, now: float) -> int:
        tick = self.tick_of(now)
        if tick > self._tick:
            self._value *= self._decay(tick - self._tick)
            self._tick = tick
        return self._tick

    def add(self, amount: float, now: float) -> int:
        """Adds ``amount``; returns the tick it was added at (pass it to ``release``)."""
        tick = self._advance(now)
        self._value += amount
        return tick

    def remainder(self, amount: float, added_tick: int, now: float) -> float:
        return amount * self._decay(self.tick_of(now) - added_tick)

    def release(self, amount: float, added_tick: int, now: float) -> float:
        """Removes what is left of a contribution of ``amount`` added at ``added_tick``; returns it."""
        self._advance(now)
        rem = amount * self._decay(self._tick - added_tick)
        self._value = max(0.0, self._value - rem)
        return rem

    def reset(self) -> None:
        self._value = 0.0

    @property
    def last_value(self) -> float:
        """The load as of its last update (no decay applied since)."""
        return self._value


class CharsPerTokenEstimator:
    """Characters-per-token ratio learned from observed (prompt characters, prompt tokens) pairs.

    Exponentially weighted sums (each observation's weight decays by ``forgetting``), so the ratio
    follows a change of tokenizer or language. Before the first observation ``ratio`` is ``prior``.
    """

    __slots__ = ("prior", "forgetting", "_chars", "_tokens", "observations")

    def __init__(self, prior: float = 4.0, forgetting: float = 0.99) -> None:
        if not prior > 0:
            raise ValueError(f"chars-per-token prior must be > 0, got {prior!r}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        self.prior = float(prior)
        self.forgetting = float(forgetting)
        self._chars = 0.0
        self._tokens = 0.0
        self.observations = 0

    def observe(self, chars: int, tokens: int) -> None:
        if chars <= 0 or tokens <= 0:
            return  # nothing to learn from an empty prompt
        self._chars = self._chars * self.forgetting + chars
        self._tokens = self._tokens * self.forgetting + tokens
        self.observations += 1

    @property
    def ratio(self) -> float:
        if self._tokens <= 0.0:
            return self.prior
        return self._chars / self._tokens

    def tokens(self, chars: int) -> int:
        return int(round(chars / self.ratio))


def default_service_time(uncached_tokens: float, cached_tokens: float) -> float:
    """Seed 004's service time with its reference coefficients, in seconds.

    S = c_hit * h + c_miss * (L - h) per 1k tokens with c_hit = 0 ms and c_miss = 1000 ms per 1k tokens
    (fzwark/KVRouting, ``SLOPE_CACHED_MS`` / ``SLOPE_UNCACHED_MS``), floored at 1 ms.
    """
    return max(0.001, 0.0 * cached_tokens / 1000.0 + 1.0 * uncached_tokens / 1000.0)


@dataclass(slots=True)
class WorkerState:
    id: str
    load: DecayedLoad
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    requests: int = 0
    errors: int = 0
    metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(slots=True)
class Dispatch:
    """Everything the router remembers about one in-flight request."""

    request: Request
    worker: str
    state: WorkerState  # identity check: a worker removed and re-added must not absorb old releases
    dispatched_at: float
    service_s: float
    load_tick: int
    queued_tokens: int
    view: WorkerView
    first_token_at: float | None = None


_new_object = object.__new__
# Slot setters of the frozen WorkerView, bound once: building a view through them is ~3x faster than
# the dataclass __init__ (which goes through object.__setattr__ per field) — views are built per worker
# per routing decision, so this is on the hot path.
_set_view_fields = tuple(
    getattr(WorkerView, name).__set__
    for name in ("id", "in_flight", "queued_prefill_tokens", "load", "match_chars", "metrics", "index_chars")
)


def make_view(
    worker_id: str,
    in_flight: int,
    queued_prefill_tokens: int,
    load: float,
    match_chars: int,
    metrics: Mapping[str, float],
    index_chars: int,
) -> WorkerView:
    """Same result as ``WorkerView(...)`` (all fields set, instance frozen), built faster."""
    view = _new_object(WorkerView)
    s_id, s_inflight, s_queued, s_load, s_match, s_metrics, s_index = _set_view_fields
    s_id(view, worker_id)
    s_inflight(view, in_flight)
    s_queued(view, queued_prefill_tokens)
    s_load(view, load)
    s_match(view, match_chars)
    s_metrics(view, metrics)
    s_index(view, index_chars)
    return view


class ClusterState:
    """Per-worker counters and per-request dispatch records (see module docstring for invariants)."""

    def __init__(
        self,
        decay_factor: float = DEFAULT_DECAY_FACTOR,
        decay_interval_s: float = DEFAULT_DECAY_INTERVAL_S,
    ) -> None:
        DecayedLoad(decay_factor, decay_interval_s)  # validates the parameters early
        self._decay_factor = decay_factor
        self._decay_interval_s = decay_interval_s
        self._workers: dict[str, WorkerState] = {}
        self._inflight: dict[str, Dispatch] = {}

    # -- membership --------------------------------------------------------------------------------
    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        self._workers[worker_id] = WorkerState(
            worker_id, DecayedLoad(self._decay_factor, self._decay_interval_s)
        )

    def remove_worker(self, worker_id: str) -> None:
        """Forgets the worker; its in-flight records stay so a later ``finish`` remains a clean no-op."""
        if worker_id not in self._workers:
            raise ValueError(f"unknown worker {worker_id!r}")
        del self._workers[worker_id]

    def worker(self, worker_id: str) -> WorkerState:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise ValueError(f"unknown worker {worker_id!r}") from None

    # -- views ---------------------------------------------------------------------------------------
    def view(self, worker_id: str, now: float, match_chars: int = 0, index_chars: int = 0) -> WorkerView:
        w = self._workers[worker_id]
        return WorkerView(
            worker_id,
            w.in_flight,
            w.queued_prefill_tokens,
            w.load.value(now),
            match_chars,
            w.metrics,
            index_chars,
        )

    def views(
        self,
        worker_ids: Iterable[str],
        now: float,
        matches: Mapping[str, int],
        index_chars: Callable[[str], int],
    ) -> list[WorkerView]:
        """Views of ``worker_ids`` at ``now`` with their prefix matches (the per-decision hot path).

        Equivalent to ``[self.view(w, now, matches.get(w, 0), index_chars(w)) for w in worker_ids]``,
        with the view construction and the load decay inlined (no per-worker calls)."""
        out: list[WorkerView] = []
        append = out.append
        workers = self._workers
        get_match = matches.get
        new = _new_object
        s_id, s_inflight, s_queued, s_load, s_match, s_metrics, s_index = _set_view_fields
        tick_cache: dict[float, int] = {}
        exp = math.exp
        for wid in worker_ids:
            w = workers[wid]
            load = w.load
            interval = load.interval_s
            tick = tick_cache.get(interval)
            if tick is None:
                tick = tick_cache[interval] = math.floor(now / interval)
            value = load._value
            ticks = tick - load._tick
            if ticks > 0 and value:
                value *= exp(load._log_factor * ticks)
            view = new(WorkerView)
            s_id(view, wid)
            s_inflight(view, w.in_flight)
            s_queued(view, w.queued_prefill_tokens)
            s_load(view, value)
            s_match(view, get_match(wid, 0))
            s_metrics(view, w.metrics)
            s_index(view, index_chars(wid))
            append(view)
        return out

    # -- request lifecycle ---------------------------------------------------------------------------
    def in_flight_record(self, request_id: str) -> Dispatch | None:
        return self._inflight.get(request_id)

    def dispatch(
        self, request: Request, view: WorkerView, now: float, service_s: float, queued_tokens: int
    ) -> Dispatch:
        if request.id in self._inflight:
            raise ValueError(
                f"request {request.id!r} is already in flight; finish it before routing it again"
            )
        w = self._workers[view.id]
        tick = w.load.add(service_s, now)
        w.in_flight += 1
        w.queued_prefill_tokens += queued_tokens
        w.requests += 1
        record = Dispatch(request, view.id, w, now, service_s, tick, queued_tokens, view)
        self._inflight[request.id] = record
        return record

    def first_token(self, request_id: str, now: float) -> Dispatch | None:
        """Marks the first token; returns the record the first time, ``None`` when already marked/unknown."""
        record = self._inflight.get(request_id)
        if record is None or record.first_token_at is not None:
            return None
        record.first_token_at = now
        if self._workers.get(record.worker) is record.state:
            record.state.queued_prefill_tokens -= record.queued_tokens
        return record

    def finish(self, request_id: str, now: float, ok: bool) -> Dispatch | None:
        """Releases all state of the request; returns its record, or ``None`` if it was not in flight."""
        record = self._inflight.pop(request_id, None)
        if record is None:
            return None
        w = record.state
        if self._workers.get(record.worker) is not w:
            return record  # worker was removed meanwhile: nothing of it left to release
        if record.first_token_at is None:
            w.queued_prefill_tokens -= record.queued_tokens
        w.in_flight -= 1
        if not ok:
            w.errors += 1
        if w.in_flight == 0:
            w.load.reset()  # exact zero: the sum of all remainders, without float residue
        else:
            w.load.release(record.service_s, record.load_tick, now)
        return record

    def in_flight_ids(self) -> list[str]:
        return list(self._inflight)

    def update_metrics(self, worker_id: str, metrics: Mapping[str, float]) -> None:
        w = self.worker(worker_id)
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be str, got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"metric {key!r} must be a number, got {value!r}")
            clean[key] = float(value)
        w.metrics = MappingProxyType(clean)

    def snapshot(self, now: float) -> dict[str, dict[str, float]]:
        return {
            wid: {
                "in_flight": float(w.in_flight),
                "queued_prefill_tokens": float(w.queued_prefill_tokens),
                "load": w.load.value(now),
                "requests": float(w.requests),
                "errors": float(w.errors),
            }
            for wid, w in self._workers.items()
        }

    def workers_state(self) -> Iterable[WorkerState]:
        return self._workers.values()
