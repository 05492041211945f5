"""A lean HTTP/1.1 client for the proxy path: keep-alive connection pools to the workers, httptools parsing.

Why not aiohttp's ClientSession here: on the proxy's hot path it was the largest cost per request
(request/response objects, header merging, URL handling, timers); this client does only what a proxy
needs: POST a body it already has, get status + Content-Type, stream the body back chunk by chunk.
aiohttp still serves the router's own HTTP and runs the health checks.

Invariants:
- a connection serves one exchange at a time and returns to its pool only after a complete response
  with keep-alive; an exchange that is abandoned (error, timeout, cancellation) closes its connection;
- idle connections older than ``idle_timeout_s`` are never reused (the worker may have closed them:
  uvicorn, which serves SGLang and vLLM, closes keep-alive connections idle for 5 s, hence 4 s here);
- ``UpstreamConnectError`` means the worker never produced a response byte (safe to try elsewhere);
  a failure on a *reused* idle connection before any response byte is retried once on a new connection,
  since the server may have closed it just as we sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import httptools

_MAX_BUFFERED = 1 << 20  # pause reading the worker when this many body bytes wait for the client
_Key = tuple[str, str, int]  # (scheme, host, port)


class UpstreamConnectError(Exception):
    """No response byte came back (connect refused/failed, or the connection dropped before a response)."""


class UpstreamBrokenError(Exception):
    """The response started but did not complete (the worker closed the connection or sent garbage)."""


class UpstreamTimeout(Exception):
    """The request deadline passed."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses responses with httptools and queues body chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b""
        self._header_name = b""
        self.got_bytes = False
        self.headers_done: asyncio.Future[None] = self.loop.create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small request writes must leave at once (no Nagle delay)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBrokenError(f"bad HTTP from worker: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if not self.got_bytes:
                self._fail(UpstreamConnectError(f"connection closed before a response ({exc or 'EOF'})"))
            else:
                self._fail(UpstreamBrokenError(f"connection closed mid-response ({exc or 'EOF'})"))

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _MAX_BUFFERED and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful inside this callback
        self.complete = True
        self._wake()

    # -- helpers --
    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # mark retrieved: the waiter may be gone already
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def next_chunk(self) -> bytes | None:
        """The next body chunk, or None at the end of the response."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < _MAX_BUFFERED // 2 and self.transport is not None:
                    self.transport.resume_reading()
                    self.paused = False
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._wakeup = self.loop.create_future()
            await self._wakeup
            self._wakeup = None


class UpstreamResponse:
    """One response; iterate ``chunks()`` or ``await read()``, then it is released (or closed)."""

    __slots__ = ("_pool", "_conn", "_key", "_timer", "status", "content_type", "_released")

    def __init__(self, pool: UpstreamPool, conn: _Conn, key: _Key, timer: asyncio.TimerHandle) -> None:
        self._pool = pool
        self._conn = conn
        self._key = key
        self._timer = timer
        self.status = conn.status
        self.content_type = conn.content_type.decode("latin-1") or "application/json"
        self._released = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = await self._conn.next_chunk()
                if chunk is None:
                    break
                yield chunk
        finally:
            self.release()

    async def read(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool after a complete keep-alive response; otherwise the connection is closed."""
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        conn = self._conn
        if conn.complete and not conn.closed and conn.error is None and conn.keep_alive:
            self._pool._put_idle(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive pools per (host, port). All methods run on the event loop thread."""

    def __init__(
        self, *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 4.0, max_idle_per_host: int = 256
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[_Key, list[_Conn]] = {}

    def _put_idle(self, key: _Key, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn.reused = True
        conn._reset()
        conn.parser = httptools.HttpResponseParser(conn)
        idle.append(conn)

    async def _acquire(self, key: _Key, fresh: bool) -> _Conn:
        if not fresh:
            idle = self._idle.get(key)
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                alive = not conn.closed and conn.transport is not None and not conn.transport.is_closing()
                if alive and now - conn.idle_since < self.idle_timeout_s:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), key[1], key[2], ssl=key[0] == "https"),
                self.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamConnectError(
                f"cannot connect to {key[1]}:{key[2]}: {type(exc).__name__}: {exc}"
            ) from None
        return proto  # type: ignore[return-value]

    async def post(self, key: _Key, head: bytes, body: bytes, deadline: float) -> UpstreamResponse:
        """Send ``head`` (request line + headers, CRLF-terminated) + ``body``; wait for the response headers.

        Raises UpstreamConnectError (nothing came back), UpstreamBrokenError, UpstreamTimeout.
        """
        for attempt in (0, 1):
            conn = await self._acquire(key, fresh=attempt == 1)
            loop = conn.loop
            timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), _expire, conn)
            assert conn.transport is not None
            try:
                conn.transport.write(head + body)  # one segment: the worker wakes once per request
            except RuntimeError:
                # uvloop raises once the worker's close reached the transport but not yet our protocol
                timer.cancel()
                conn.close()
                if conn.reused and attempt == 0:
                    continue
                raise UpstreamConnectError(
                    f"connection to {key[1]}:{key[2]} closed before the request"
                ) from None
            try:
                await conn.headers_done
            except UpstreamConnectError:
                timer.cancel()
                conn.close()
                if conn.reused and attempt == 0:
                    continue  # the worker closed an idle connection as we used it: once more, fresh
                raise
            except BaseException:
                timer.cancel()
                conn.close()
                raise
            return UpstreamResponse(self, conn, key, timer)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _expire(conn: _Conn) -> None:
    conn._fail(UpstreamTimeout("the worker did not answer within the request timeout"))
    conn.close()
