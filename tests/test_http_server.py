"""The router's minimal HTTP/1.1 server, spoken to over raw sockets: framing, keep-alive, limits, errors."""

from __future__ import annotations

import asyncio
import json

from kvroute.router.http_server import HttpRequest, Responder, start_server
from test_http_support import run


async def _handler(req: HttpRequest, out: Responder) -> None:
    if req.path == "/stream":
        await out.start_stream(200, "text/event-stream", b"data: 1\n\n")
        await asyncio.sleep(0.02)
        await out.write_chunk(b"data: 2\n\n")
        out.end_stream()
    elif req.path == "/boom":
        raise RuntimeError("handler bug")
    elif req.path == "/silent":
        return
    elif req.path == "/slow":
        try:
            await asyncio.sleep(10)
        finally:
            SLOW_CANCELLED.append(req.request_id)
    else:
        body = json.dumps(
            {
                "method": req.method,
                "path": req.path,
                "query": req.query,
                "len": len(req.body),
                "too_large": req.body_too_large,
            }
        ).encode()
        out.send(200, body, headers={"X-Extra": "1"})


SLOW_CANCELLED: list[str] = []


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": status}}).encode()


async def _server(max_body: int = 1000, idle: float = 75.0):  # type: ignore[no-untyped-def]
    ids = iter(range(1, 10_000))
    server = await start_server(
        _handler,
        "127.0.0.1",
        0,
        idle_timeout_s=idle,
        max_body_bytes=max_body,
        new_request_id=lambda req: req.headers.get("x-request-id") or f"id{next(ids)}",
        error_body=_error,
    )
    return server, server.sockets[0].getsockname()[1]


async def _exchange(port: int, data: bytes, read_until_close: bool = True, wait: float = 0.3) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    if read_until_close:
        try:
            return await asyncio.wait_for(r.read(), wait * 10)
        finally:
            w.close()
    await asyncio.sleep(wait)
    out = b""
    while True:
        try:
            chunk = await asyncio.wait_for(r.read(65536), 0.05)
        except asyncio.TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    w.close()
    return out


def _post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_keep_alive_pipelining_and_request_ids() -> None:
    async def body() -> None:
        server, port = await _server()
        try:
            data = _post("/a?url=http%3A%2F%2Fh%3A1&x=2", b"{}", "X-Request-Id: mine\r\n") + _post(
                "/b", b"xyz"
            )
            raw = await _exchange(port, data, read_until_close=False)
            responses = raw.split(b"HTTP/1.1 200 OK\r\n")[1:]
            assert len(responses) == 2  # both answered on one connection, in order
            assert b"X-Request-Id: mine\r\n" in responses[0] and b"X-Request-Id: id" in responses[1]
            first = json.loads(responses[0].split(b"\r\n\r\n", 1)[1])
            assert first["query"] == {"url": "http://h:1", "x": "2"} and first["path"] == "/a"
            assert json.loads(responses[1].split(b"\r\n\r\n", 1)[1])["len"] == 3
            assert b"X-Extra: 1\r\n" in responses[0] and b"Content-Length: " in responses[0]
        finally:
            server.close()

    run(body())


def test_chunked_request_bodies_and_http10_close() -> None:
    async def body() -> None:
        server, port = await _server()
        try:
            chunked = (
                b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
            )
            raw = await _exchange(port, chunked, read_until_close=False)
            assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["len"] == 5
            raw = await _exchange(port, _post("/d", b"{}", version="1.0"))  # server closes after the answer
            assert b"Connection: close" in raw and raw.endswith(b"}")
        finally:
            server.close()

    run(body())


def test_streams_have_headers_with_the_first_chunk_and_chunked_framing() -> None:
    async def body() -> None:
        server, port = await _server()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(_post("/stream", b""))
            first = await r.read(65536)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in first
            assert first.endswith(b"9\r\ndata: 1\n\n\r\n")  # headers and the first chunk in one segment
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):
                rest += await r.read(65536)
            assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            w.close()
        finally:
            server.close()

    run(body())


def test_limits_and_errors_become_json_and_the_server_stays_up() -> None:
    async def body() -> None:
        server, port = await _server(max_body=10)
        try:
            raw = await _exchange(port, _post("/big", b"x" * 50))
            assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["too_large"] is True  # handler decides (413)
            raw = await _exchange(port, b"GARBAGE / NONSENSE\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 400 ") and b'"error"' in raw and b"X-Request-Id: id" in raw
            raw = await _exchange(port, _post("/boom", b""), read_until_close=False)
            assert raw.startswith(b"HTTP/1.1 500 ") and b"internal router error" in raw
            raw = await _exchange(port, _post("/silent", b""), read_until_close=False)
            assert raw.startswith(b"HTTP/1.1 500 ")
            # Expect: 100-continue is answered so curl-like clients send their body at once
            raw = await _exchange(
                port, _post("/e", b"{}", "Expect: 100-continue\r\n"), read_until_close=False
            )
            assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
            raw = await _exchange(port, _post("/ok", b"{}"), read_until_close=False)
            assert raw.startswith(b"HTTP/1.1 200 OK")
        finally:
            server.close()

    run(body())


def test_client_disconnect_cancels_the_handler() -> None:
    async def body() -> None:
        server, port = await _server()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(_post("/slow", b"", "X-Request-Id: slow-1\r\n"))
            await w.drain()
            await asyncio.sleep(0.1)
            w.close()
            for _ in range(100):
                if "slow-1" in SLOW_CANCELLED:
                    break
                await asyncio.sleep(0.02)
            assert "slow-1" in SLOW_CANCELLED
        finally:
            server.close()

    run(body())


def test_oversized_heads_are_refused_and_idle_connections_closed() -> None:
    async def body() -> None:
        server, port = await _server(idle=0.3)
        try:
            raw = await _exchange(port, _post("/h", b"{}", "X-Big: " + "a" * 70_000 + "\r\n"))
            assert raw.startswith(b"HTTP/1.1 431 ")
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(_post("/k", b"{}"))
            assert (await r.readuntil(b'"too_large": false}')).startswith(b"HTTP/1.1 200 OK")
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(r.read(), 5) == b""  # the server closed the idle connection
            assert 0.2 < asyncio.get_running_loop().time() - t0 < 3
            w.close()
        finally:
            server.close()

    run(body())
