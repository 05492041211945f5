"""Prometheus metrics of the HTTP router (prometheus-client, one registry per app).

Counters and histograms are updated on the request path; the per-worker load gauges (in-flight, queued
prefill tokens, decayed load, health) and the prefix index size are read from ``Router.snapshot()`` at
scrape time by a custom collector, so the request path never touches a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)

# snapshot keys that are per-worker numbers exported as gauges
_WORKER_GAUGES = {
    "in_flight": "requests dispatched to the worker and not finished",
    "queued_prefill_tokens": "estimated prompt tokens dispatched and not yet prefilled",
    "load": "decayed queue load of the worker (LBGR's W_i), seconds",
}


class _SnapshotCollector(Collector):
    """Reads the router's state at scrape time (per-worker gauges + prefix index size)."""

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Mapping[str, float]]],
        health: Callable[[], Mapping[str, bool]],
    ) -> None:
        self._snapshot = snapshot
        self._health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        families = {
            key: GaugeMetricFamily(f"kvroute_router_worker_{key}", doc, labels=["worker"])
            for key, doc in _WORKER_GAUGES.items()
        }
        scalars: dict[str, float] = {}
        for name, entry in snap.items():
            if not isinstance(entry, Mapping):
                if isinstance(entry, int | float):
                    scalars[name] = float(entry)
                continue
            if "in_flight" not in entry:  # not a worker entry: the prefix index's own stats ("__index__")
                prefix = "prefix_index" if name == "__index__" else name
                for k, v in entry.items():
                    if isinstance(v, int | float):
                        scalars[f"{prefix}_{k}"] = float(v)
                continue
            for key, fam in families.items():
                if key in entry:
                    fam.add_metric([name], float(entry[key]))
        yield from families.values()
        healthy = GaugeMetricFamily(
            "kvroute_router_worker_healthy", "1 if the worker receives traffic", labels=["worker"]
        )
        for url, ok in self._health().items():
            healthy.add_metric([url], 1.0 if ok else 0.0)
        yield healthy
        for key, value in scalars.items():
            safe = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
            yield GaugeMetricFamily(f"kvroute_router_{safe}", f"router state: {key}", value=value)


class WorkerSeries:
    """The labelled children of one worker, resolved once (labels() costs a lock and a dict per call)."""

    __slots__ = ("requests", "ttft", "e2e")

    def __init__(self, metrics: RouterMetrics, worker: str) -> None:
        self.requests = {
            ep: metrics.requests.labels(worker, ep) for ep in ("completions", "chat", "generate")
        }
        self.ttft = metrics.ttft.labels(worker)
        self.e2e = metrics.e2e.labels(worker)


class RouterMetrics:
    """All metrics of one router app; ``render()`` produces the /metrics body."""

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Mapping[str, float]]],
        health: Callable[[], Mapping[str, bool]],
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvroute_router_requests",
            "requests dispatched, per worker and endpoint",
            ["worker", "endpoint"],
            registry=r,
        )
        self.errors = Counter(
            "kvroute_router_errors",
            "failed dispatches per worker and kind (connect, upstream_5xx, timeout, ...)",
            ["worker", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_router_rejected", "requests refused before dispatch, per reason", ["reason"], registry=r
        )
        self.retries = Counter("kvroute_router_retries", "dispatches retried on another worker", registry=r)
        self.client_disconnects = Counter(
            "kvroute_router_client_disconnects", "requests whose client went away before the end", registry=r
        )
        self.ttft = Histogram(
            "kvroute_router_ttft_seconds",
            "router-side time to first upstream byte",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_router_e2e_seconds",
            "router-side end-to-end latency",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "kvroute_router_decision_seconds",
            "time spent in Router.route",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        r.register(_SnapshotCollector(snapshot, health))
        self._series: dict[str, WorkerSeries] = {}

    def worker(self, worker: str) -> WorkerSeries:
        series = self._series.get(worker)
        if series is None:
            series = self._series[worker] = WorkerSeries(self, worker)
        return series

    def render(self) -> bytes:
        return generate_latest(self.registry)
