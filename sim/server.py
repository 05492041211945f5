"""``kvroute worker --engine sim``: the simulator's engine model behind a real HTTP server, on the wall clock.

Same endpoints and response shapes as SGLang and vLLM servers: ``/v1/completions`` and
``/v1/chat/completions`` (SSE streaming and not), SGLang's ``/generate`` (``meta_info.cached_tokens``),
``/v1/models``, ``/health``, ``/metrics`` with SGLang-style counters (``sglang:prompt_tokens_total``,
``sglang:cached_tokens_total``, ...) and vLLM-style prefix cache counters
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, ...). ``usage`` carries
``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``.

Text is tokenized with :mod:`kvroute.sim.tokenizer` (one token per word). One asyncio task drives
``EngineModel.step``: step at wall time t, sleep until t + duration, then deliver that step's events
to the waiting requests. A request whose client went away is aborted in the engine (its KV slots freed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from kvroute.router.http_validate import ParsedRequest, RequestError, parse_request
from kvroute.sim import tokenizer
from kvroute.sim.cost_model import PRESETS
from kvroute.sim.engine import EVICTIONS, EngineModel, StepResult
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("kvroute.sim.server")

_REQUEST_ID_HEADER = "X-Request-Id"
_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_CATCH_UP_S = 0.005  # how late a step may start and still keep the engine's own schedule


@dataclass
class _Pending:
    """One request waiting on the engine; the engine loop fills it, the handler drains it."""

    rid: str
    prompt_len: int
    submitted_at: float
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    done: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class EngineMetrics:
    """SGLang- and vLLM-named Prometheus metrics of one simulated worker (own registry)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = {"model_name": model_name}
        vl = {"model_name": model_name, "engine": "0"}

        def counter(name: str, doc: str, lab: dict[str, str]) -> Any:
            return Counter(name, doc, list(lab), registry=r).labels(**lab)

        def gauge(name: str, doc: str, lab: dict[str, str]) -> Any:
            return Gauge(name, doc, list(lab), registry=r).labels(**lab)

        self.sg_prompt = counter("sglang:prompt_tokens", "Number of prefill tokens processed.", labels)
        self.sg_generation = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", labels
        )
        self.sg_cached = counter("sglang:cached_tokens", "Number of cached prompt tokens.", labels)
        self.sg_requests = counter("sglang:num_requests", "Number of requests processed.", labels)
        self.sg_running = gauge("sglang:num_running_reqs", "The number of running requests.", labels)
        self.sg_queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels)
        self.sg_token_usage = gauge("sglang:token_usage", "The token usage of the KV pool.", labels)
        self.sg_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate (cumulative).", labels)
        self.sg_ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token.",
            list(labels),
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(**labels)
        self.sg_e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of end-to-end latency.",
            list(labels),
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        ).labels(**labels)
        self.v_prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.", vl)
        self.v_generation = counter("vllm:generation_tokens", "Number of generation tokens processed.", vl)
        self.v_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", vl)
        self.v_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", vl)
        self.v_running = gauge("vllm:num_requests_running", "Number of requests in model execution.", vl)
        self.v_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", vl)
        self.v_kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", vl)
        self._prompt_total = 0
        self._cached_total = 0

    def finished(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft: float | None,
        e2e: float | None,
    ) -> None:
        """One finished request; ttft/e2e are None when its client had gone (only the tokens count)."""
        self.sg_prompt.inc(prompt_tokens)
        self.sg_cached.inc(cached_tokens)
        self.sg_generation.inc(output_tokens)
        self.sg_requests.inc()
        self.v_prompt.inc(prompt_tokens)
        self.v_generation.inc(output_tokens)
        self.v_queries.inc(prompt_tokens)
        self.v_hits.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.sg_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)
        if ttft is not None:
            self.sg_ttft.observe(ttft)
        if e2e is not None:
            self.sg_e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SimWorker:
    """The HTTP face of one EngineModel. All engine calls happen on the event loop thread."""

    def __init__(
        self,
        engine: EngineModel,
        *,
        model_name: str,
        context_length: int,
        max_body_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.context_length = context_length
        self.max_body_bytes = max_body_bytes
        self.metrics = EngineMetrics(model_name)
        self.pending: dict[str, _Pending] = {}
        self._t0 = time.monotonic()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._seq = 0
        self.app = self._build_app()

    def clock(self) -> float:
        """Engine time: wall seconds since this worker started (monotonic)."""
        return time.monotonic() - self._t0

    # ---- engine loop ------------------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        """Step, sleep the step's duration, deliver its events; forever. A bug in one step fails the
        requests in flight (HTTP 500) instead of silently stopping the engine."""
        assert self._wake is not None
        next_start = self.clock()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                next_start = self.clock()
            try:
                next_start = await self._one_step(next_start)
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                for p in list(self.pending.values()):
                    p.error = f"engine failure: {type(exc).__name__}"
                    p.done = True
                    p.changed.set()
                    self.abandon(p)

    async def _one_step(self, next_start: float) -> float:
        # A step starts when the previous one ended. Timers wake us up to ~1 ms late; a step that starts a
        # little late keeps its scheduled start (engine time does not drift), one far behind starts now.
        now = self.clock()
        start = next_start if now - next_start <= _CATCH_UP_S else now
        result = self.engine.step(start)
        end = start + result.duration
        delay = end - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        elif result.duration == 0 and not (result.tokens or result.finished):
            await asyncio.sleep(0.001)  # nothing could run (pool full): do not spin
        else:
            await asyncio.sleep(0)  # let the HTTP handlers run between steps
        self._deliver(result, end)
        self._update_gauges()
        return end

    def _deliver(self, result: StepResult, at: float) -> None:
        for rid in result.first_tokens:
            p = self.pending.get(rid)
            if p is not None and p.first_token_at is None:
                p.first_token_at = at
                p.changed.set()
        for rid, token in result.tokens:
            p = self.pending.get(rid)
            if p is not None:
                p.tokens.append(token)
                p.changed.set()
        for fin in result.finished:
            p = self.pending.get(fin.req_id)
            ttft = e2e = None
            if p is not None:
                e2e = at - p.submitted_at
                ttft = None if p.first_token_at is None else p.first_token_at - p.submitted_at
                p.prompt_tokens = fin.prompt_tokens
                p.cached_tokens = fin.cached_tokens
                p.tokens = list(fin.output)
                p.done = True
                p.changed.set()
            self.metrics.finished(fin.prompt_tokens, fin.cached_tokens, fin.output_tokens, ttft, e2e)

    def _update_gauges(self) -> None:
        e = self.engine
        m = self.metrics
        m.sg_running.set(e.num_running)
        m.sg_queue.set(e.num_waiting)
        m.v_running.set(e.num_running)
        m.v_waiting.set(e.num_waiting)
        usage = e.kv_used_tokens / e.kv_capacity_tokens
        m.sg_token_usage.set(usage)
        m.v_kv_usage.set(usage)

    def submit(self, tokens: list[int], max_tokens: int, client_id: str | None = None) -> _Pending:
        """Queue a request. The client's X-Request-Id becomes the engine's request id when it is free, so
        the simulated output (a function of the id) is the one a workload put into its next turn."""
        now = self.clock()
        rid = client_id if client_id and client_id not in self.pending else None
        if rid is not None:
            try:
                self.engine.submit(rid, tokens, max_tokens, now)
            except ValueError:  # id still live in the engine: fall back to a fresh one
                rid = None
        if rid is None:
            self._seq += 1
            rid = f"sim-{self._seq}-{uuid.uuid4().hex[:8]}"
            self.engine.submit(rid, tokens, max_tokens, now)  # sizes validated by the handler
        p = _Pending(rid, len(tokens), now)
        self.pending[rid] = p
        assert self._wake is not None
        self._wake.set()
        return p

    def abandon(self, p: _Pending) -> None:
        """The client went away: stop delivering; abort in the engine if it can."""
        if self.pending.pop(p.rid, None) is not None and not p.done:
            self.engine.abort(p.rid)

    async def _lifespan(self, app: web.Application):  # type: ignore[no-untyped-def]
        self._wake = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())
        try:
            yield
        finally:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    # ---- HTTP ----------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_middleware], client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self._generation_handler("completions"))
        app.router.add_post("/v1/chat/completions", self._generation_handler("chat"))
        app.router.add_post("/generate", self._generation_handler("generate"))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(_echo_request_id)
        app.cleanup_ctx.append(self._lifespan)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_name,
                "tokenizer_path": None,
                "is_generation": True,
                "eviction": self.engine.eviction,
                "preset": self.engine.cost.name,
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(self._t0_wall()),
                        "owned_by": "kvroute-sim",
                        "root": self.model_name,
                        "max_model_len": self.context_length,
                    }
                ],
            }
        )

    def _t0_wall(self) -> float:
        return time.time() - self.clock()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": _METRICS_CONTENT_TYPE})

    def _generation_handler(self, endpoint: Any) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(413, f"request body exceeds {self.max_body_bytes} bytes") from None
            parsed = parse_request(endpoint, raw)
            body = json.loads(raw)  # valid: parse_request accepted it
            tokens = self._prompt_tokens(parsed, body)
            p = self.submit(tokens, parsed.max_tokens, request.headers.get(_REQUEST_ID_HEADER))
            try:
                if parsed.stream:
                    return await self._stream(request, parsed, body, p)
                await self._wait_done(p)
                if p.error is not None:
                    raise RequestError(500, p.error, err_type="server_error")
                return web.json_response(self._final_body(parsed, p))
            finally:
                self.abandon(p)  # no-op when it finished; drops (and aborts) it when the client left

        return handler

    def _prompt_tokens(self, parsed: ParsedRequest, body: dict[str, Any]) -> list[int]:
        if parsed.model is not None and parsed.model != self.model_name:
            raise RequestError(
                404,
                f"The model `{parsed.model}` does not exist.",
                err_type="NotFoundError",
                param="model",
                code="model_not_found",
            )
        batch = body.get("prompt") if parsed.endpoint == "completions" else body.get("text")
        if isinstance(batch, list) and batch and isinstance(batch[0], (str, list)) and len(batch) > 1:
            raise RequestError(
                400, "batched prompts are not supported by the simulated worker", param="prompt"
            )
        tokens = (
            list(parsed.prompt_ids)
            if parsed.prompt_ids is not None
            else tokenizer.encode(parsed.prompt_text or "")
        )
        if not tokens:
            raise RequestError(400, "the prompt is empty", param="prompt")
        if parsed.max_tokens < 1:
            raise RequestError(400, "max_tokens must be at least 1", param="max_tokens")
        if len(tokens) + parsed.max_tokens > self.context_length:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {len(tokens) + parsed.max_tokens} tokens "
                f"({len(tokens)} in the prompt, {parsed.max_tokens} for the completion).",
                param="max_tokens",
            )
        return tokens

    async def _wait_done(self, p: _Pending) -> None:
        while not p.done:
            p.changed.clear()
            await p.changed.wait()

    # ---- response shapes ------------------------------------------------------------------------------
    def _usage(self, p: _Pending) -> dict[str, Any]:
        return {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": len(p.tokens),
            "total_tokens": p.prompt_tokens + len(p.tokens),
            "prompt_tokens_details": {"cached_tokens": p.cached_tokens},
        }

    def _meta(self, p: _Pending, finished: bool) -> dict[str, Any]:
        return {
            "id": p.rid,
            "prompt_tokens": p.prompt_tokens if finished else p.prompt_len,
            "completion_tokens": len(p.tokens),
            "cached_tokens": p.cached_tokens,
            "finish_reason": {"type": "length", "length": len(p.tokens)} if finished else None,
            "e2e_latency": self.clock() - p.submitted_at,
        }

    def _final_body(self, parsed: ParsedRequest, p: _Pending) -> dict[str, Any]:
        text = _text(p.tokens)
        created = int(time.time())
        if parsed.endpoint == "generate":
            return {"text": text, "meta_info": self._meta(p, True)}
        if parsed.endpoint == "chat":
            return {
                "id": f"chatcmpl-{p.rid}",
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": self._usage(p),
            }
        return {
            "id": f"cmpl-{p.rid}",
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": self._usage(p),
        }

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, body: dict[str, Any], p: _Pending
    ) -> web.StreamResponse:
        try:
            return await self._stream_body(request, parsed, body, p)
        except ConnectionResetError:  # the client hung up mid-stream; the handler's finally aborts it
            return web.Response(status=499)

    async def _stream_body(
        self, request: web.Request, parsed: ParsedRequest, body: dict[str, Any], p: _Pending
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        created = int(time.time())
        sent = 0
        if parsed.endpoint == "chat":  # OpenAI servers open a chat stream with the role
            await out.write(_sse(self._chat_chunk(p, created, {"role": "assistant", "content": ""}, None)))
        while True:
            if sent == len(p.tokens) and not p.done:
                p.changed.clear()
                await p.changed.wait()
                continue
            if p.error is not None:
                await out.write(_sse(RequestError(500, p.error, err_type="server_error").body()))
                await out.write_eof()
                return out
            new, sent = p.tokens[sent:], len(p.tokens)
            last = p.done
            if new or last:
                await out.write(self._stream_event(parsed, p, new, last, created))
            if last:
                break
        if include_usage and parsed.endpoint != "generate":
            obj = "chat.completion.chunk" if parsed.endpoint == "chat" else "text_completion"
            prefix = "chatcmpl" if parsed.endpoint == "chat" else "cmpl"
            await out.write(
                _sse(
                    {
                        "id": f"{prefix}-{p.rid}",
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": self._usage(p),
                    }
                )
            )
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def _stream_event(
        self, parsed: ParsedRequest, p: _Pending, new: list[int], last: bool, created: int
    ) -> bytes:
        piece = "".join(" " + w for w in tokenizer.decode(new).split()) if new else ""
        if parsed.endpoint == "generate":  # SGLang streams the text so far, with meta_info
            return _sse({"text": _text(p.tokens), "meta_info": self._meta(p, last)})
        reason = "length" if last else None
        if parsed.endpoint == "chat":
            return _sse(self._chat_chunk(p, created, {"content": piece}, reason))
        return _sse(
            {
                "id": f"cmpl-{p.rid}",
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}],
            }
        )

    def _chat_chunk(
        self, p: _Pending, created: int, delta: dict[str, Any], reason: str | None
    ) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{p.rid}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }


def _text(tokens: Sequence[int]) -> str:
    return "".join(" " + w for w in tokenizer.decode(tokens).split())


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.headers.get(_REQUEST_ID_HEADER)
    if rid and _REQUEST_ID_HEADER not in response.headers:
        response.headers[_REQUEST_ID_HEADER] = rid


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as err:
        return web.Response(body=err.json_bytes(), status=err.status, content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = RequestError(exc.status, exc.reason or "error")
        return web.Response(body=err.json_bytes(), status=exc.status, content_type="application/json")


# ---- CLI --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="sim", choices=["sim"], help="only the simulated engine runs here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--preset", default="l40-llama3.1-8b", help=f"cost model preset: {', '.join(PRESETS)}")
    p.add_argument("--eviction", default="lru", choices=list(EVICTIONS))
    p.add_argument("--kv-tokens", type=int, default=200_000, help="KV pool size in tokens")
    p.add_argument(
        "--context-length", type=int, default=None, help="max prompt + output tokens (default: pool)"
    )
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: the preset)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log-level", default="INFO")
    return p


def make_worker(
    preset: str,
    eviction: str,
    kv_tokens: int,
    *,
    model_name: str | None = None,
    context_length: int | None = None,
    seed: int | None = None,
) -> SimWorker:
    """Build a SimWorker; raises ValueError on a bad preset / size."""
    if kv_tokens < 1:
        raise ValueError(f"--kv-tokens must be >= 1, got {kv_tokens}")
    if context_length is not None and not 1 <= context_length <= kv_tokens:
        raise ValueError(f"--context-length must be in [1, --kv-tokens], got {context_length}")
    engine = EngineModel(preset=preset, kv_capacity_tokens=kv_tokens, eviction=eviction, seed=seed)
    return SimWorker(engine, model_name=model_name or preset, context_length=context_length or kv_tokens)


async def serve(worker: SimWorker, host: str, port: int, ready: Callable[[int], None] | None = None) -> None:
    runner = web.AppRunner(worker.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("sim worker %s listening on http://%s:%d", worker.model_name, host, bound)
    if ready is not None:
        ready(bound)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        worker = make_worker(
            args.preset,
            args.eviction,
            args.kv_tokens,
            model_name=args.served_model_name,
            context_length=args.context_length,
            seed=args.seed,
        )
    except (ValueError, TypeError) as exc:
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 2
    from kvroute.router.server import install_uvloop

    install_uvloop()
    try:
        asyncio.run(serve(worker, args.host, args.port))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"kvroute worker: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
