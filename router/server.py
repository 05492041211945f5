"""``kvroute router``: the HTTP router (uvloop + httptools) in front of running SGLang / vLLM / sim workers.

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/generate`` (routed and proxied, streaming or
not), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and the admin API ``/workers`` (GET list,
POST ``{"url": ...}`` add, DELETE ``?url=...`` remove), guarded by ``--admin-token`` (Bearer).

Every response carries ``X-Request-Id`` (the client's own when it sent a sane one). Every error is JSON in
the OpenAI error shape. Membership can also change through :class:`RouterService` methods (the Ray
watcher uses them); all of them run on the event loop thread. The HTTP layer is
:mod:`kvroute.router.http_server` (serving) and :mod:`kvroute.router.http_upstream` (proxying); aiohttp's
client runs the health checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvroute.router.core import Router
from kvroute.router.health import HealthChecker, normalize_worker_url
from kvroute.router.http_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvroute.router.http_metrics import RouterMetrics
from kvroute.router.http_proxy import ProxyService
from kvroute.router.http_server import HttpRequest, Responder, start_server
from kvroute.router.http_upstream import UpstreamPool
from kvroute.router.http_validate import RequestError

log = logging.getLogger("kvroute.router")

_MAX_CLIENT_ID_LEN = 128
# generated ids: a random per-process prefix + a counter (unique, and far cheaper than uuid4 per request)
_ID_PREFIX = f"kvr-{os.urandom(6).hex()}-"
_ID_COUNTER = itertools.count(1)


@dataclass
class RouterConfig:
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    policy_options: dict[str, Any] = field(default_factory=dict)
    admin_token: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    health_fail_threshold: int = 2
    health_recover_threshold: int = 1
    max_connections: int = 1024
    connect_timeout_s: float = 2.0
    max_attempts: int = 3
    max_index_chars: int | None = None  # None: 2.5M characters per worker, following membership
    seed: int | None = None
    scrape_metrics: bool = True

    def validate(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be > 0, got {self.max_body_bytes}")
        if self.max_index_chars is not None and self.max_index_chars <= 0:
            raise ValueError(f"--max-index-chars must be > 0, got {self.max_index_chars}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.health_interval_s <= 0:
            raise ValueError(f"--health-interval must be > 0 seconds, got {self.health_interval_s}")
        if self.max_connections < 1 or self.max_attempts < 1:
            raise ValueError("--max-connections and max attempts must be >= 1")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("--admin-token must not be empty")
        for url in self.worker_urls:
            normalize_worker_url(url)


def request_id_of(req: HttpRequest) -> str:
    """The request's id: the client's X-Request-Id when it is sane (<=128 visible ASCII), else a new one."""
    given = req.headers.get("x-request-id")
    if (
        given
        and len(given) <= _MAX_CLIENT_ID_LEN
        and given.isascii()
        and given.isprintable()
        and " " not in given
    ):
        return given
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


def _error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return RequestError(status, message, err_type=kind).json_bytes()


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


Route = Callable[[HttpRequest, Responder], Awaitable[None]]


class RouterService:
    """One router: the routing core, the worker registry + health checks, the proxy, metrics, admin API."""

    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.router = Router(
            config.policy,
            (),
            max_index_chars=config.max_index_chars,
            seed=config.seed,
            **config.policy_options,
        )
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.proxy: ProxyService | None = None
        self.pool: UpstreamPool | None = None
        self.server: asyncio.base_events.Server | None = None
        self.metrics = RouterMetrics(self._snapshot, self._health_map)
        self.routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/completions"): self._generation("completions", "/v1/completions"),
            ("POST", "/v1/chat/completions"): self._generation("chat", "/v1/chat/completions"),
            ("POST", "/generate"): self._generation("generate", "/generate"),
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health_endpoint,
            ("GET", "/metrics"): self._metrics_endpoint,
            ("GET", "/workers"): self._workers_list,
            ("POST", "/workers"): self._workers_add,
            ("DELETE", "/workers"): self._workers_remove,
        }
        self._paths = {path for _, path in self.routes}

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Open the pools, register the configured workers, start health checks and listen; returns the port."""
        connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=30.0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
        self.pool = UpstreamPool(
            connect_timeout_s=self.config.connect_timeout_s, max_idle_per_host=self.config.max_connections
        )
        self.health = HealthChecker(
            self.router,
            self.session,
            interval_s=self.config.health_interval_s,
            fail_threshold=self.config.health_fail_threshold,
            recover_threshold=self.config.health_recover_threshold,
            scrape_metrics=self.config.scrape_metrics,
        )
        self.proxy = ProxyService(
            self.router,
            self.pool,
            self.health,
            self.metrics,
            request_timeout_s=self.config.request_timeout_s,
            max_body_bytes=self.config.max_body_bytes,
            max_attempts=self.config.max_attempts,
        )
        urls = dict.fromkeys(map(normalize_worker_url, self.config.worker_urls))
        await asyncio.gather(*(self.health.add(u) for u in urls))
        self.health.start()
        self.server = await start_server(
            self._dispatch,
            host,
            port,
            max_body_bytes=self.config.max_body_bytes,
            new_request_id=request_id_of,
            error_body=_error_body,
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.health is not None:
            await self.health.stop()
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    # ---- membership API (used by the admin endpoints and by the Ray watcher) --------------------------
    async def add_worker(self, url: str) -> dict[str, Any]:
        """Register a worker; raises ValueError on a bad URL, KeyError when already registered."""
        assert self.health is not None, "the router is not running"
        return (await self.health.add(url)).as_dict()

    def remove_worker(self, url: str) -> dict[str, Any]:
        """Unregister a worker (in-flight requests on it finish normally); KeyError when unknown."""
        assert self.health is not None, "the router is not running"
        return self.health.remove(url).as_dict()

    def list_workers(self) -> list[dict[str, Any]]:
        assert self.health is not None, "the router is not running"
        snap = self._snapshot()
        out = []
        for w in self.health.workers.values():
            entry = w.as_dict()
            entry.update(snap.get(w.url, {}))
            out.append(entry)
        return out

    async def sync_workers(self, members: dict[str, str]) -> None:
        """Make the registered set equal to ``members`` ({worker_id: url}); the Ray watcher's callback."""
        assert self.health is not None, "the router is not running"
        wanted = {normalize_worker_url(u) for u in members.values()}
        for url in list(self.health.workers):
            if url not in wanted:
                self.health.remove(url)
        await asyncio.gather(*(self.health.add(u) for u in wanted if u not in self.health.workers))

    def _snapshot(self) -> dict[str, Any]:
        return self.router.snapshot(time.monotonic())

    def _health_map(self) -> dict[str, bool]:
        return self.health.health_map() if self.health is not None else {}

    # ---- dispatch ------------------------------------------------------------------------------------
    async def _dispatch(self, req: HttpRequest, out: Responder) -> None:
        """Find the route; every failure leaves as a JSON error with the right status."""
        route = self.routes.get((req.method, req.path))
        try:
            if route is None:
                if req.path in self._paths:
                    raise RequestError(405, f"method {req.method} is not allowed on {req.path}")
                raise RequestError(404, f"no such endpoint: {req.path}", code="not_found")
            await route(req, out)
        except RequestError as err:
            if not out.started:
                out.send(err.status, err.json_bytes())
            else:
                out.end_stream()

    def _generation(self, endpoint: Any, path: str) -> Route:
        async def handler(req: HttpRequest, out: Responder) -> None:
            assert self.proxy is not None
            await self.proxy.handle(req, out, endpoint, path)

        return handler

    async def _models(self, req: HttpRequest, out: Responder) -> None:
        assert self.session is not None and self.health is not None
        for url in self.health.healthy_urls():
            try:
                async with self.session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.read()
                    if r.status == 200:
                        out.send(200, body)
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        raise RequestError(503, "no healthy worker answered /v1/models", err_type="server_error")

    async def _health_endpoint(self, req: HttpRequest, out: Responder) -> None:
        assert self.health is not None
        healthy = len(self.health.healthy_urls())
        body = {
            "status": "ok" if healthy else "no healthy worker",
            "healthy_workers": healthy,
            "workers": len(self.health.workers),
            "policy": self.router.policy.name,
        }
        out.send(200 if healthy else 503, _json(body))

    async def _metrics_endpoint(self, req: HttpRequest, out: Responder) -> None:
        out.send(200, self.metrics.render(), METRICS_CONTENT_TYPE)

    def _authorize(self, req: HttpRequest, *, mutating: bool) -> None:
        token = self.config.admin_token
        if token is None:
            if mutating:
                raise RequestError(
                    403,
                    "the admin API is disabled: start the router with --admin-token",
                    code="admin_disabled",
                )
            return
        scheme, _, value = req.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise RequestError(
                401,
                "missing or wrong admin token (send 'Authorization: Bearer <token>')",
                err_type="authentication_error",
                code="unauthorized",
            )

    async def _workers_list(self, req: HttpRequest, out: Responder) -> None:
        self._authorize(req, mutating=False)
        out.send(200, _json({"workers": self.list_workers()}))

    def _url_from(self, req: HttpRequest) -> str:
        if req.body_too_large:
            raise RequestError(413, f"request body exceeds the limit of {self.config.max_body_bytes} bytes")
        url = req.query.get("url")
        if url is None and req.body:
            try:
                body = json.loads(req.body)
            except ValueError:
                raise RequestError(400, "request body is not valid JSON") from None
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            raise RequestError(
                400, 'give the worker as JSON {"url": "http://host:port"} or ?url=', param="url"
            )
        try:
            return normalize_worker_url(url)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="url") from None

    async def _workers_add(self, req: HttpRequest, out: Responder) -> None:
        self._authorize(req, mutating=True)
        url = self._url_from(req)
        try:
            info = await self.add_worker(url)
        except KeyError:
            raise RequestError(409, f"worker {url} is already registered", code="conflict") from None
        out.send(201, _json(info))

    async def _workers_remove(self, req: HttpRequest, out: Responder) -> None:
        self._authorize(req, mutating=True)
        url = self._url_from(req)
        try:
            info = self.remove_worker(url)
        except KeyError:
            raise RequestError(404, f"worker {url} is not registered", code="not_found") from None
        out.send(200, _json(info))


# ---- CLI ---------------------------------------------------------------------------------------------
def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--policy-option wants key=value, got {text!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, lists; anything else stays a string
    except ValueError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute router", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker-urls", nargs="*", default=[], metavar="URL", help="workers to route to")
    p.add_argument("--policy", default="cache_aware", help="routing policy (lbgr, cache_aware, ...)")
    p.add_argument(
        "--policy-option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="K=V",
        help="policy option, repeatable (value parsed as JSON when it is JSON)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--admin-token", default=None, help="token for /workers (Authorization: Bearer TOKEN)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health probes")
    p.add_argument("--health-fail-threshold", type=int, default=2)
    p.add_argument(
        "--max-connections", type=int, default=1024, help="idle keep-alive connections kept per worker"
    )
    p.add_argument(
        "--max-index-chars",
        type=int,
        default=None,
        help="prefix-index capacity in characters, all workers together (default: 2.5M per worker)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-scrape-metrics", action="store_true", help="do not read workers' /metrics")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="follow cluster membership published on Ray (GCS host:port or 'auto')",
    )
    p.add_argument("--ray-cluster", default="default", help="cluster name of the Ray membership actor")
    p.add_argument("--log-level", default="INFO")
    return p


def install_uvloop() -> None:
    """uvloop when available (not on Windows); the stock loop otherwise."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(
    config: RouterConfig,
    host: str,
    port: int,
    *,
    ray_address: str | None = None,
    ray_cluster: str = "default",
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run the router until cancelled. ``ready(port)`` is called once it listens."""
    service = RouterService(config)
    bound = await service.start(host, port)
    # everything allocated so far lives as long as the process: keep it out of the cyclic GC's scans
    gc.collect()
    gc.freeze()
    log.info(
        "router listening on http://%s:%d with policy %s (%d workers)",
        host,
        bound,
        config.policy,
        len(config.worker_urls),
    )
    if ready is not None:
        ready(bound)
    watcher: asyncio.Task[None] | None = None
    if ray_address is not None:
        from kvroute.router import ray_membership  # only with --ray: Ray is heavy and optional

        watcher = asyncio.get_running_loop().create_task(
            ray_membership.watch(ray_address, service.sync_workers, cluster=ray_cluster)
        )
    try:
        if watcher is not None:
            await watcher
        else:
            await asyncio.Event().wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        await service.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = RouterConfig(
        worker_urls=list(args.worker_urls),
        policy=args.policy,
        policy_options=dict(args.policy_option),
        admin_token=args.admin_token,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        health_interval_s=args.health_interval,
        health_fail_threshold=args.health_fail_threshold,
        max_connections=args.max_connections,
        max_index_chars=args.max_index_chars,
        seed=args.seed,
        scrape_metrics=not args.no_scrape_metrics,
    )
    if not config.worker_urls and args.ray is None:
        print(
            "kvroute router: give --worker-urls URL ... or --ray ADDRESS (workers can also be added "
            "later through POST /workers)",
            file=sys.stderr,
        )
    try:
        config.validate()
        Router(config.policy, (), **config.policy_options)  # fail fast on an unknown policy / option
    except (ValueError, TypeError) as exc:
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    install_uvloop()
    try:
        asyncio.run(serve(config, args.host, args.port, ray_address=args.ray, ray_cluster=args.ray_cluster))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"kvroute router: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
