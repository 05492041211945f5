"""Worker membership and health: which registered workers receive traffic.

A registered worker is either *in rotation* (present in ``Router.workers``) or *ejected* (kept in the
registry and probed, but never routed to). Active checks probe ``GET /health`` every interval; passive
checks count connection failures seen by the proxy. ``fail_threshold`` consecutive failures eject a
worker; ``recover_threshold`` consecutive successful probes readmit it. While probing, the checker also
scrapes the worker's ``/metrics`` (engine gauges such as running/queued requests) into
``Router.update_metrics`` and reads ``/v1/models`` to learn the served model names.

Invariant: ``worker.in_rotation`` is True exactly when the URL is in ``router.workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvroute.router.health")


def normalize_worker_url(url: str) -> str:
    """'http://host:port/' -> 'http://host:port'; raises ValueError on anything that is not an http URL."""
    if not isinstance(url, str) or not url:
        raise ValueError("worker url must be a non-empty string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker url must look like http://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"worker url must not carry a query or fragment: {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in worker url {url!r}") from exc
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass
class WorkerHealth:
    url: str
    in_rotation: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    last_probe: float | None = None  # wall clock (time.time) of the last probe
    models: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.in_rotation,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_probe": self.last_probe,
            "models": list(self.models),
        }


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets} for gauges and counters only."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("gauge", "counter"):
            continue
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


class HealthChecker:
    """Registry of workers + the probe loop. All mutation happens on the event loop thread."""

    def __init__(
        self,
        router: Any,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 2.0,
        probe_timeout_s: float = 2.0,
        fail_threshold: int = 2,
        recover_threshold: int = 1,
        scrape_metrics: bool = True,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"health interval must be > 0 seconds, got {interval_s}")
        if fail_threshold < 1 or recover_threshold < 1:
            raise ValueError("fail_threshold and recover_threshold must be >= 1")
        self.router = router
        self.session = session
        self.interval_s = interval_s
        self.probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self.fail_threshold = fail_threshold
        self.recover_threshold = recover_threshold
        self.scrape_metrics = scrape_metrics
        self.workers: dict[str, WorkerHealth] = {}
        self._task: asyncio.Task[None] | None = None

    # ---- membership -------------------------------------------------------------------------------
    async def add(self, url: str, *, probe: bool = True) -> WorkerHealth:
        """Register a worker; it enters rotation now if its probe succeeds (or probe=False), else later."""
        url = normalize_worker_url(url)
        if url in self.workers:
            raise KeyError(url)
        w = WorkerHealth(url)
        self.workers[url] = w
        if probe:
            await self.probe(w)
            if not w.in_rotation and w.consecutive_failures == 0:  # probe ok but below recover threshold
                self._admit(w)
        else:
            self._admit(w)
        return w

    def remove(self, url: str) -> WorkerHealth:
        url = normalize_worker_url(url)
        w = self.workers.pop(url)  # KeyError when unknown
        self._eject(w, "removed")
        return w

    def healthy_urls(self) -> list[str]:
        return [u for u, w in self.workers.items() if w.in_rotation]

    def health_map(self) -> dict[str, bool]:
        return {u: w.in_rotation for u, w in self.workers.items()}

    def known_models(self) -> set[str]:
        return {m for w in self.workers.values() if w.in_rotation for m in w.models}

    def _admit(self, w: WorkerHealth) -> None:
        if not w.in_rotation and self.workers.get(w.url) is w:
            self.router.add_worker(w.url)
            w.in_rotation = True
            log.info("worker %s admitted", w.url)

    def _eject(self, w: WorkerHealth, reason: str) -> None:
        if w.in_rotation:
            self.router.remove_worker(w.url)
            w.in_rotation = False
            log.warning("worker %s ejected: %s", w.url, reason)

    # ---- passive checks (called by the proxy) ------------------------------------------------------
    def report_failure(self, url: str, reason: str) -> None:
        w = self.workers.get(url)
        if w is None:
            return
        w.consecutive_failures += 1
        w.consecutive_successes = 0
        w.last_error = reason
        if w.consecutive_failures >= self.fail_threshold:
            self._eject(w, reason)

    def report_success(self, url: str) -> None:
        w = self.workers.get(url)
        if w is not None and w.in_rotation:
            w.consecutive_failures = 0

    # ---- active checks ------------------------------------------------------------------------------
    async def probe(self, w: WorkerHealth) -> bool:
        """One probe of /health (+ /v1/models when unknown, + /metrics); updates rotation; returns health."""
        w.last_probe = time.time()
        try:
            async with self.session.get(f"{w.url}/health", timeout=self.probe_timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                reason = None if ok else f"/health returned HTTP {resp.status}"
            if ok and not w.models:
                w.models = await self._models(w.url)
            if ok and self.scrape_metrics:
                await self._scrape(w.url)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
        if self.workers.get(w.url) is not w:  # removed while probing
            return ok
        if ok:
            w.consecutive_failures = 0
            w.consecutive_successes += 1
            w.last_error = None
            if not w.in_rotation and w.consecutive_successes >= self.recover_threshold:
                self._admit(w)
        else:
            self.report_failure(w.url, reason or "probe failed")
        return ok

    async def _models(self, url: str) -> list[str]:
        try:
            async with self.session.get(f"{url}/v1/models", timeout=self.probe_timeout) as resp:
                if resp.status != 200:
                    return []
                data = await resp.json(content_type=None)
            return [str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, AttributeError):
            return []  # a worker without /v1/models (e.g. a bare SGLang /generate server) serves any name

    async def _scrape(self, url: str) -> None:
        try:
            async with self.session.get(f"{url}/metrics", timeout=self.probe_timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
            metrics = parse_engine_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return  # metrics are advisory; health is decided by /health alone
        if url in self.router.workers:
            self.router.update_metrics(url, metrics)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # never let one bad probe kill the loop
                log.exception("health check round failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
