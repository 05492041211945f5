"""The proxy's upstream HTTP/1.1 client against tiny raw servers: framing, keep-alive, failures."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kvroute.router.http_proxy import usage_from_bytes
from kvroute.router.http_upstream import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)
from test_http_support import run

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[tuple[str, str, int], list[int]]]:
    """A TCP server running ``handler`` per connection; yields (pool key, connection counter)."""
    connections = [0]

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield ("http", "127.0.0.1", port), connections
    finally:
        server.close()
        await server.wait_closed()


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await r.readexactly(length)


def deadline(s: float = 5.0) -> float:
    return time.monotonic() + s


def test_keep_alive_reuses_one_connection_and_reads_content_length_bodies() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(r)
            w.write(
                b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body) + 2, b"[" + body + b"]")
            )
            await w.drain()

    async def body() -> None:
        async with raw_server(handler) as (key, conns):
            pool = UpstreamPool()
            for _ in range(5):
                resp = await pool.post(key, HEAD, b"{}", deadline())
                assert resp.status == 201 and resp.content_type == "application/json"
                assert await resp.read() == b"[{}]"
            assert conns[0] == 1
            pool.close()

    run(body())


def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
            await w.drain()
            await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    async def body() -> None:
        async with raw_server(handler) as (key, _):
            pool = UpstreamPool()
            resp = await pool.post(key, HEAD, b"{}", deadline())
            t0 = time.perf_counter()
            got = []
            async for chunk in resp.chunks():
                got.append((chunk, time.perf_counter() - t0))
            assert b"".join(c for c, _ in got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert got[0][1] < 0.04 and got[-1][1] > 0.08  # delivered as they came, not at the end
            assert sum(len(v) for v in pool._idle.values()) == 1  # complete + keep-alive: pooled
            pool.close()

    run(body())


def test_refused_connection_is_a_connect_error() -> None:
    async def body() -> None:
        async with raw_server(read_request) as (key, _):  # type: ignore[arg-type]
            pass
        with pytest.raises(UpstreamConnectError):
            await UpstreamPool().post(key, HEAD, b"{}", deadline())

    run(body())


def test_close_before_any_response_byte_is_a_connect_error_and_mid_body_is_broken() -> None:
    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    async def half_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some")
        await w.drain()

    async def body() -> None:
        async with raw_server(hang_up) as (key, _):
            with pytest.raises(UpstreamConnectError):
                await UpstreamPool().post(key, HEAD, b"{}", deadline())
        async with raw_server(half_body) as (key, _):
            resp = await UpstreamPool().post(key, HEAD, b"{}", deadline())
            with pytest.raises(UpstreamBrokenError):
                await resp.read()

    run(body())


def test_garbage_is_broken_and_slow_workers_time_out() -> None:
    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(5)

    async def body() -> None:
        async with raw_server(garbage) as (key, _):
            with pytest.raises(UpstreamBrokenError):
                await UpstreamPool().post(key, HEAD, b"{}", deadline())
        async with raw_server(slow) as (key, _):
            t0 = time.monotonic()
            with pytest.raises(UpstreamTimeout):
                await UpstreamPool().post(key, HEAD, b"{}", deadline(0.2))
            assert time.monotonic() - t0 < 1.0

    run(body())


def test_a_pooled_connection_the_worker_closed_is_retried_on_a_fresh_one() -> None:
    async def one_shot(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # answers one request, claims keep-alive, then closes: the pooled connection is stale
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()

    async def body() -> None:
        async with raw_server(one_shot) as (key, conns):
            pool = UpstreamPool()
            assert await (await pool.post(key, HEAD, b"{}", deadline())).read() == b"ok"
            await asyncio.sleep(0.05)
            idle = pool._idle[key]
            if idle:  # we may already have seen the close; force the race: pretend it is still open
                idle[0].closed = False
            assert await (await pool.post(key, HEAD, b"{}", deadline())).read() == b"ok"
            assert conns[0] == 2
            pool.close()

    run(body())


def test_usage_is_read_from_json_and_sse_bytes() -> None:
    assert usage_from_bytes(
        b'{"usage": {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}}'
    ) == (12, 8)
    assert usage_from_bytes(b'{"meta_info": {"prompt_tokens": 5, "cached_tokens": 0}}') == (5, 0)
    tail = b'data: {"meta_info": {"prompt_tokens": 5, "cached_tokens": 1}}\n\ndata: {"meta_info": {"prompt_tokens": 5, "cached_tokens": 4}}\n\n'
    assert usage_from_bytes(tail) == (5, 4)
    # a generated text that mentions the key is escaped in JSON and never mistaken for usage
    assert usage_from_bytes(b'{"text": "say \\"prompt_tokens\\": 99"}') == (None, None)
    assert usage_from_bytes(b'{"usage": {"prompt_tokens": 3}}') == (3, None)
