"""The proxy path of the HTTP router: route one generation request, forward it, stream the answer back.

Lifecycle invariant: once ``Router.route`` returned a worker for a request, ``Router.finish`` is called for
that dispatch on every exit path (success, upstream error, client disconnect, timeout, retry), by a
``finally`` — the policy's load state never leaks. A request whose upstream connection fails before any
byte reached the client is retried on another worker (``finish(ok=False)`` then ``route(exclude=...)``).
Upstream traffic goes through :class:`kvroute.router.http_upstream.UpstreamPool` (keep-alive pools).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import urlsplit

from kvroute.router.health import HealthChecker
from kvroute.router.http_metrics import RouterMetrics
from kvroute.router.http_server import HttpRequest, Responder
from kvroute.router.http_upstream import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.router.http_validate import Endpoint, ParsedRequest, RequestError, parse_request
from kvroute.router.types import NoWorkerAvailable, Request

log = logging.getLogger("kvroute.router.proxy")

REQUEST_ID_HEADER = "X-Request-Id"
WORKER_HEADER = "X-Kvroute-Worker"  # which worker served the response (load generators count per worker)
_SSE = "text/event-stream"

# In JSON a quote inside a string is escaped, so '"prompt_tokens":' can only be a key: a regex on the raw
# bytes finds the usage (OpenAI usage or SGLang meta_info) without parsing the whole response.
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def usage_from_bytes(data: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens): the last occurrence of each in a JSON body or SSE stream tail."""
    prompt = cached = None
    for m in _PROMPT_TOKENS.finditer(data):
        prompt = int(m.group(1))
    if prompt is None:
        return None, None
    for m in _CACHED_TOKENS.finditer(data):
        cached = int(m.group(1))
    return prompt, cached


class ProxyService:
    """Holds the shared state of the proxy path (one per router)."""

    def __init__(
        self,
        router: Any,
        pool: UpstreamPool,
        health: HealthChecker,
        metrics: RouterMetrics,
        *,
        request_timeout_s: float,
        max_body_bytes: int = 8 * 1024 * 1024,
        max_attempts: int = 3,
    ) -> None:
        self.router = router
        self.pool = pool
        self.health = health
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self._active: set[str] = set()  # request keys currently dispatched (unique per Router)
        self._seq = itertools.count()
        self._targets: dict[tuple[str, str], tuple[tuple[str, str, int], bytes]] = {}
        self._now: Callable[[], float] = time.monotonic

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def _target(self, worker: str, path: str) -> tuple[tuple[str, str, int], bytes]:
        """(pool key, request line + fixed headers) per worker and path, cached."""
        got = self._targets.get((worker, path))
        if got is None:
            if len(self._targets) > 10_000:  # workers come and go; keep the cache bounded
                self._targets.clear()
            parts = urlsplit(worker)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            head = (
                f"POST {parts.path}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                "Content-Type: application/json\r\n"
            ).encode("latin-1")
            got = self._targets[(worker, path)] = ((parts.scheme, parts.hostname or "", port), head)
        return got

    def _unique_key(self, request_id: str) -> str:
        # A client may reuse an X-Request-Id concurrently; the Router keys its state by id, so make it unique.
        key = request_id
        while key in self._active:
            key = f"{request_id}.{next(self._seq)}"
        return key

    async def handle(self, req: HttpRequest, out: Responder, endpoint: Endpoint, path: str) -> None:
        t_arrival = time.perf_counter()
        if req.body_too_large:
            self.metrics.rejected.labels("body_too_large").inc()
            raise RequestError(
                413, f"request body exceeds the limit of {self.max_body_bytes} bytes", code="body_too_large"
            )
        raw = req.body
        try:
            parsed = parse_request(endpoint, raw)
            self._check_model(parsed)
        except RequestError as exc:
            self.metrics.rejected.labels("bad_request" if exc.status != 404 else "unknown_model").inc()
            raise
        # ids are exact; text is estimated from characters with the ratio the Router learns from usage
        est = (
            len(parsed.prompt_ids)
            if parsed.prompt_ids is not None
            else self.router.estimate_tokens(parsed.index_text)
        )
        key = self._unique_key(req.request_id)
        self._active.add(key)
        try:
            await self._dispatch(
                req,
                out,
                parsed,
                Request(key, parsed.index_text, est, parsed.max_tokens),
                raw,
                path,
                t_arrival,
            )
        except (asyncio.CancelledError, ConnectionResetError):  # the client disconnected
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self._active.discard(key)

    def _check_model(self, parsed: ParsedRequest) -> None:
        if parsed.model is None:
            return
        known = self.health.known_models()
        if known and parsed.model not in known:
            raise RequestError(
                404,
                f"the model '{parsed.model}' does not exist; served: {sorted(known)}",
                param="model",
                code="model_not_found",
            )

    async def _dispatch(
        self,
        hreq: HttpRequest,
        out: Responder,
        parsed: ParsedRequest,
        req: Request,
        raw: bytes,
        path: str,
        t_arrival: float,
    ) -> None:
        # the per-request header lines; values were validated (request id) or parsed by httptools (no CR/LF)
        extra = f"Content-Length: {len(raw)}\r\n{REQUEST_ID_HEADER}: {hreq.request_id}\r\n"
        auth = hreq.headers.get("authorization")
        if auth is not None:
            extra += f"Authorization: {auth}\r\n"
        try:
            extra_bytes = (extra + "\r\n").encode("latin-1")
        except UnicodeEncodeError:
            raise RequestError(400, "the Authorization header must be latin-1 text") from None
        deadline = self._now() + self.request_timeout_s
        excluded: set[str] = set()
        for attempt in range(self.max_attempts):
            t_route = time.perf_counter()
            try:
                worker = self.router.route(req, self._now(), exclude=excluded)
            except NoWorkerAvailable:
                self.metrics.rejected.labels("no_worker").inc()
                if excluded:
                    raise RequestError(
                        502,
                        f"every worker tried failed to connect ({len(excluded)})",
                        err_type="server_error",
                        code="upstream_unavailable",
                    ) from None
                raise RequestError(
                    503, "no healthy worker is available", err_type="server_error", code="no_worker"
                ) from None
            self.metrics.decision.observe(time.perf_counter() - t_route)
            self.metrics.worker(worker).requests[parsed.endpoint].inc()
            outcome = _Outcome()
            try:
                key, head = self._target(worker, path)
                await self._forward(
                    out, req, raw, key, head + extra_bytes, deadline, worker, t_arrival, outcome
                )
                return
            except _RetryableUpstreamError as exc:
                self.metrics.errors.labels(worker, "connect").inc()
                self.health.report_failure(worker, exc.reason)
                excluded.add(worker)
                if attempt + 1 < self.max_attempts:
                    self.metrics.retries.inc()
                    log.info(
                        "request %s: %s failed before any byte was sent (%s); retrying",
                        hreq.request_id,
                        worker,
                        exc.reason,
                    )
                    continue
                raise RequestError(
                    502,
                    f"upstream connection failed: {exc.reason}",
                    err_type="server_error",
                    code="upstream_unavailable",
                ) from None
            finally:
                # exactly one finish per dispatch, whatever happened (idempotent on the Router side)
                self.router.finish(
                    req.id,
                    self._now(),
                    outcome.ok,
                    prompt_tokens=outcome.prompt_tokens,
                    cached_tokens=outcome.cached_tokens,
                )
        raise AssertionError("unreachable")  # the loop either returns or raises

    async def _forward(
        self,
        out: Responder,
        req: Request,
        raw: bytes,
        key: tuple[str, str, int],
        head: bytes,
        deadline: float,
        worker: str,
        t_arrival: float,
        outcome: _Outcome,
    ) -> None:
        try:
            upstream = await self.pool.post(key, head, raw, deadline)
        except UpstreamConnectError as exc:
            raise _RetryableUpstreamError(str(exc)) from None
        except UpstreamTimeout:
            self._timeout(worker)
        except UpstreamBrokenError as exc:
            self.metrics.errors.labels(worker, "upstream_broken").inc()
            raise RequestError(
                502, f"bad response from the worker: {exc}", err_type="server_error", code="upstream_broken"
            ) from None
        try:
            ctype = upstream.content_type
            if upstream.status == 200 and ctype.startswith(_SSE):
                await self._stream(out, upstream, ctype, req, worker, t_arrival, outcome)
                return
            try:
                body = await upstream.read()
            except UpstreamTimeout:
                self._timeout(worker)
            except (UpstreamBrokenError, UpstreamConnectError) as exc:
                raise _RetryableUpstreamError(str(exc)) from None  # nothing reached the client yet
        finally:
            upstream.release()
        now = time.perf_counter()
        self.router.first_token(req.id, self._now())
        if upstream.status >= 500:
            self.metrics.errors.labels(worker, "upstream_5xx").inc()
        else:
            outcome.ok = True
            self.health.report_success(worker)
            series = self.metrics.worker(worker)
            series.ttft.observe(now - t_arrival)
            series.e2e.observe(now - t_arrival)
            if upstream.status == 200:
                outcome.prompt_tokens, outcome.cached_tokens = usage_from_bytes(body)
        out.send(upstream.status, body, ctype, {WORKER_HEADER: worker})

    async def _stream(
        self,
        out: Responder,
        upstream: UpstreamResponse,
        ctype: str,
        req: Request,
        worker: str,
        t_arrival: float,
        outcome: _Outcome,
    ) -> None:
        headers = {"Cache-Control": "no-cache", WORKER_HEADER: worker}
        tail = b""
        try:
            async for chunk in upstream.chunks():
                try:
                    if not out.started:
                        # start lazily: until the first chunk is sent, a failed upstream can be retried
                        self.router.first_token(req.id, self._now())
                        self.metrics.worker(worker).ttft.observe(time.perf_counter() - t_arrival)
                        await out.start_stream(200, ctype, chunk, headers)
                    else:
                        await out.write_chunk(chunk)
                except ConnectionResetError:  # the client went away; leaving closes the upstream too
                    self.metrics.client_disconnects.inc()
                    return
                tail = (tail + chunk)[-8192:]
        except (UpstreamBrokenError, UpstreamConnectError, UpstreamTimeout) as exc:
            timed_out = isinstance(exc, UpstreamTimeout)
            if not out.started:
                if timed_out:
                    self._timeout(worker)
                raise _RetryableUpstreamError(str(exc)) from None
            # mid-stream upstream failure or timeout: tell the client in-band and end the stream
            kind = "timeout" if timed_out else "upstream_broken"
            self.metrics.errors.labels(worker, kind).inc()
            err = RequestError(
                504 if timed_out else 502,
                f"upstream stream ended early: {kind}",
                err_type="server_error",
                code=kind,
            )
            try:
                await out.write_chunk(b"data: " + err.json_bytes() + b"\n\n")
                out.end_stream()
            except ConnectionResetError:
                self.metrics.client_disconnects.inc()
            return
        try:
            if not out.started:  # an empty 200 stream
                await out.start_stream(200, ctype, b"", headers)
            out.end_stream()
        except ConnectionResetError:
            self.metrics.client_disconnects.inc()
            return
        outcome.ok = True
        self.health.report_success(worker)
        self.metrics.worker(worker).e2e.observe(time.perf_counter() - t_arrival)
        outcome.prompt_tokens, outcome.cached_tokens = usage_from_bytes(tail)

    def _timeout(self, worker: str) -> NoReturn:
        self.metrics.errors.labels(worker, "timeout").inc()
        raise RequestError(
            504,
            "the worker did not answer within the request timeout",
            err_type="server_error",
            code="timeout",
        )


class _Outcome:
    """What the finally-block reports to Router.finish."""

    __slots__ = ("ok", "prompt_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.ok = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None


class _RetryableUpstreamError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
