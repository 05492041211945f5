"""The simulated engine behind HTTP: SGLang/vLLM response shapes, usage, Prometheus counters, aborts."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from kvroute.router.health import parse_engine_metrics
from kvroute.sim import tokenizer
from kvroute.sim.server import make_worker
from test_http_support import new_worker, run, serve_app, sse_events, wait_until


async def _worker_session(kv_tokens: int = 50_000):  # type: ignore[no-untyped-def]
    worker = new_worker(kv_tokens)
    served = await serve_app(worker.app)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    return worker, served, session


def test_usage_and_prometheus_counters_agree_and_repeats_hit_the_cache() -> None:
    prompt = " ".join(tokenizer.decode(range(100, 160)).split())  # 60 vocabulary words = 60 tokens

    async def body() -> None:
        worker, served, s = await _worker_session()
        try:
            usages = []
            for _ in range(2):
                async with s.post(
                    served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}
                ) as r:
                    assert r.status == 200
                    data = await r.json()
                assert data["object"] == "text_completion"
                usages.append(data["usage"])
            assert usages[0]["prompt_tokens"] == 60 and usages[0]["completion_tokens"] == 3
            assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
            # the second time the prompt (all but its last token, as SGLang matches) is cached
            assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 59
            async with s.post(
                served.url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2}}
            ) as r:
                meta = (await r.json())["meta_info"]
            assert (
                meta["prompt_tokens"] == 60 and meta["cached_tokens"] == 59 and meta["completion_tokens"] == 2
            )
            async with s.get(served.url + "/metrics") as r:
                m = parse_engine_metrics(await r.text())
            assert m["sglang:prompt_tokens_total"] == 180
            assert m["sglang:cached_tokens_total"] == 118
            assert m["sglang:generation_tokens_total"] == 8
            assert m["sglang:num_requests_total"] == 3
            assert m["vllm:prefix_cache_queries_total"] == 180
            assert m["vllm:prefix_cache_hits_total"] == 118
            assert m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0
        finally:
            await s.close()
            await served.stop()

    run(body())


def test_streaming_shapes_for_completions_chat_and_generate() -> None:
    async def body() -> None:
        worker, served, s = await _worker_session()
        try:
            payload = {
                "prompt": "a b c",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with s.post(served.url + "/v1/completions", json=payload) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = await sse_events(r)
            assert events[-1] == b"[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
            assert len("".join(texts).split()) == 3
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

            chat = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2, "stream": True}
            async with s.post(served.url + "/v1/chat/completions", json=chat) as r:
                events = await sse_events(r)
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks).split()) == 2
            assert not any("usage" in c for c in chunks)  # only when stream_options.include_usage

            gen = {"text": "a b c", "sampling_params": {"max_new_tokens": 2}, "stream": True}
            async with s.post(served.url + "/generate", json=gen) as r:
                events = await sse_events(r)
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
            assert len(chunks[-1]["text"].split()) == 2  # SGLang streams the text so far
        finally:
            await s.close()
            await served.stop()

    run(body())


def test_tokens_stream_on_the_engine_clock() -> None:
    async def body() -> None:
        worker, served, s = await _worker_session()
        try:
            t0 = time.perf_counter()
            times = []
            async with s.post(
                served.url + "/v1/completions", json={"prompt": "x y", "max_tokens": 10, "stream": True}
            ) as r:
                async for _ in r.content.iter_any():
                    times.append(time.perf_counter() - t0)
            # the L40 preset's decode step of an 8B model is ~25 ms: 10 tokens take >= ~0.2 s, spread out
            assert times[-1] > 0.15
            assert times[0] < times[-1] / 3
        finally:
            await s.close()
            await served.stop()

    run(body())


def test_request_id_selects_the_simulated_output() -> None:
    async def body() -> None:
        worker, served, s = await _worker_session()
        try:
            async with s.post(
                served.url + "/v1/completions",
                json={"prompt": "p q", "max_tokens": 5},
                headers={"X-Request-Id": "mt-3-1"},
            ) as r:
                assert r.headers["X-Request-Id"] == "mt-3-1"
                text = (await r.json())["choices"][0]["text"]
            assert tokenizer.encode(text) == tokenizer.simulated_output("mt-3-1", 5)
        finally:
            await s.close()
            await served.stop()

    run(body())


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        ("/v1/completions", {"prompt": "w " * 1000, "max_tokens": 10}, 400),  # over the context length
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
        ("/v1/completions", {"prompt": "hi", "model": "other"}, 404),
        ("/v1/completions", {"prompt": ["one", "two"]}, 400),  # batches are not simulated
        ("/v1/completions", {"prompt": "   "}, 400),  # empty after tokenization
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "2"}}, 400),
    ],
)
def test_bad_requests_are_rejected_like_the_engines_do(path: str, payload: dict, status: int) -> None:
    async def body() -> None:
        worker, served, s = await _worker_session(kv_tokens=1000)
        try:
            async with s.post(served.url + path, json=payload) as r:
                assert r.status == status
                assert (await r.json())["error"]["message"]
            assert not worker.engine.has_work() and not worker.pending
            async with s.get(served.url + "/health") as r:
                assert r.status == 200
        finally:
            await s.close()
            await served.stop()

    run(body())


def test_a_client_that_hangs_up_is_aborted_in_the_engine() -> None:
    async def body() -> None:
        worker, served, s = await _worker_session()
        try:

            async def long_request() -> None:
                async with s.post(
                    served.url + "/v1/completions", json={"prompt": "z", "max_tokens": 400}
                ) as r:
                    await r.read()

            task = asyncio.create_task(long_request())
            await wait_until(lambda: worker.engine.has_work(), what="request admitted")
            await asyncio.sleep(0.1)
            task.cancel()
            await wait_until(
                lambda: not worker.pending and not worker.engine.has_work(), timeout_s=5, what="abort"
            )
            assert worker.engine.kv_used_tokens == worker.engine.cache.total_size  # no private slots left
        finally:
            await s.close()
            await served.stop()

    run(body())


def test_models_and_model_info_and_cli_errors() -> None:
    async def body() -> None:
        worker, served, s = await _worker_session()
        try:
            async with s.get(served.url + "/v1/models") as r:
                data = await r.json()
            assert data["object"] == "list" and data["data"][0]["id"] == "l40-llama3.1-8b"
            async with s.get(served.url + "/get_model_info") as r:
                info = await r.json()
            assert info["eviction"] == "lru"
        finally:
            await s.close()
            await served.stop()

    run(body())
    with pytest.raises(ValueError, match="preset"):
        make_worker("no-such-preset", "lru", 1000)
    with pytest.raises(ValueError):
        make_worker("l40-llama3.1-8b", "fifo", 1000)
    from kvroute.sim.server import build_parser, main

    args = build_parser().parse_args(["--eviction", "rlt-leaf"])  # as `kvroute launch --engine sim` passes
    worker = make_worker(args.preset, args.eviction, 1000)
    assert worker.engine.eviction == worker.engine.cache.policy == "rlt-leaf"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--eviction", "rlt_leaf"])
    assert info.value.code == 2
    assert main(["--preset", "nope"]) == 2
    assert main(["--kv-tokens", "0"]) == 2
