"""Shared helpers of the HTTP tests: sim workers and the router served in-process on free ports.

Everything runs on one event loop (``run``); servers bind port 0. The L40 preset's steps take ~25 ms, so
tests keep max_tokens small.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from kvroute.router.server import RouterConfig, RouterService
from kvroute.sim.server import SimWorker, make_worker

T = TypeVar("T")
PRESET = "l40-llama3.1-8b"


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


@dataclass
class Served:
    url: str
    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_app(app: web.Application, port: int = 0) -> Served:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1]
    return Served(f"http://127.0.0.1:{bound}", runner, bound)


def new_worker(kv_tokens: int = 50_000, eviction: str = "lru") -> SimWorker:
    return make_worker(PRESET, eviction, kv_tokens)


@dataclass
class Cluster:
    router_url: str
    service: RouterService
    workers: list[SimWorker]
    worker_urls: list[str]
    served: list[Served]
    session: aiohttp.ClientSession

    @property
    def router(self) -> Any:
        return self.service.router


@contextlib.asynccontextmanager
async def cluster(
    n_workers: int = 2, *, policy: str = "round_robin", kv_tokens: int = 50_000, **config: Any
) -> AsyncIterator[Cluster]:
    """n sim workers + a router in front of them, plus a client session."""
    workers = [new_worker(kv_tokens) for _ in range(n_workers)]
    served = [await serve_app(w.app) for w in workers]
    config.setdefault("health_interval_s", 30.0)
    service = RouterService(
        RouterConfig(worker_urls=[s.url for s in served], policy=policy, seed=0, **config)
    )
    port = await service.start("127.0.0.1", 0)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    try:
        yield Cluster(f"http://127.0.0.1:{port}", service, workers, [s.url for s in served], served, session)
    finally:
        await session.close()
        await service.stop()
        for s in served:
            with contextlib.suppress(RuntimeError):
                await s.stop()


async def wait_until(
    pred: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def assert_no_load(c: Cluster) -> None:
    """Every per-request piece of router state is released."""
    assert c.router.in_flight() == []
    assert c.service.proxy is not None and c.service.proxy.active_requests == 0
    snap = c.router.snapshot(time.monotonic())
    for wid in c.router.workers:
        entry = snap[wid]
        assert entry["in_flight"] == 0, (wid, entry)
        assert entry["queued_prefill_tokens"] == 0, (wid, entry)
        assert entry["load"] == 0, (wid, entry)


async def sse_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    body = await resp.read()
    return [e.strip()[5:].strip() for e in body.split(b"\n\n") if e.strip().startswith(b"data:")]
