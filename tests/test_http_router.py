"""The HTTP router in front of 2-3 in-process sim workers: routing, streaming, errors, admin, health, leaks."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from kvroute.router.http_proxy import WORKER_HEADER
from test_http_support import assert_no_load, cluster, new_worker, run, serve_app, sse_events, wait_until


def test_every_endpoint_routes_and_answers_in_the_engines_shapes() -> None:
    async def body() -> None:
        async with cluster(3, policy="round_robin") as c:
            s = c.session
            served_by: set[str] = set()
            calls = [
                ("/v1/completions", {"prompt": "alpha beta gamma", "max_tokens": 2}),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "alpha beta"}], "max_tokens": 2},
                ),
                ("/generate", {"text": "alpha beta gamma", "sampling_params": {"max_new_tokens": 2}}),
            ]
            for path, payload in calls:
                async with s.post(c.router_url + path, json=payload) as r:
                    assert r.status == 200, await r.text()
                    served_by.add(r.headers[WORKER_HEADER])
                    data = await r.json()
                if path == "/generate":
                    assert data["meta_info"]["completion_tokens"] == 2
                    assert data["meta_info"]["prompt_tokens"] == 3
                    assert "cached_tokens" in data["meta_info"]
                else:
                    assert data["usage"]["completion_tokens"] == 2
                    assert "cached_tokens" in data["usage"]["prompt_tokens_details"]
                    choice = data["choices"][0]
                    text = (
                        choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
                    )
                    assert len(text.split()) == 2
                # streaming variant
                async with s.post(c.router_url + path, json={**payload, "stream": True}) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    served_by.add(r.headers[WORKER_HEADER])
                    events = await sse_events(r)
                assert events[-1] == b"[DONE]"
                assert len(events) >= 3  # at least two token events before [DONE]
            assert served_by == set(c.worker_urls)  # round robin over 6 requests reached all 3 workers
            async with s.get(c.router_url + "/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == "l40-llama3.1-8b"
            async with s.get(c.router_url + "/health") as r:
                assert r.status == 200
                assert (await r.json())["healthy_workers"] == 3
            async with s.get(c.router_url + "/metrics") as r:
                text = await r.text()
            for w in c.worker_urls:
                assert f'kvroute_router_requests_total{{endpoint="completions",worker="{w}"}}' in text
            assert "kvroute_router_decision_seconds_count 6.0" in text
            assert "kvroute_router_prefix_index_stored_chars" in text
            assert "kvroute_router_worker_in_flight" in text
            assert_no_load(c)

    run(body())


def test_streaming_passes_chunks_through_as_they_come() -> None:
    """TTFT measured at the client is far below e2e: the router does not buffer the stream."""

    async def body() -> None:
        async with cluster(2) as c:
            payload = {"prompt": "one two three four", "max_tokens": 12, "stream": True}
            t0 = time.perf_counter()
            async with c.session.post(c.router_url + "/v1/completions", json=payload) as r:
                assert r.status == 200
                first = await r.content.readany()
                ttft = time.perf_counter() - t0
                assert first.startswith(b"data:")
                await r.read()
                e2e = time.perf_counter() - t0
            # 12 decode steps of the L40 preset take ~0.3 s; the first token comes after one step
            assert ttft < e2e / 3, (ttft, e2e)
            async with c.session.get(c.router_url + "/metrics") as r:
                text = await r.text()
            count = sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("kvroute_router_ttft_seconds_count")
            )
            assert count == 1.0
            assert_no_load(c)

    run(body())


def test_request_id_is_honoured_or_generated_on_every_response() -> None:
    async def body() -> None:
        async with cluster(2) as c:
            s = c.session
            async with s.post(
                c.router_url + "/v1/completions",
                json={"prompt": "a b", "max_tokens": 1},
                headers={"X-Request-Id": "client-id-7"},
            ) as r:
                assert r.headers["X-Request-Id"] == "client-id-7"
            ids = set()
            for path in ("/health", "/metrics", "/nope", "/v1/models"):
                async with s.get(c.router_url + path) as r:
                    ids.add(r.headers["X-Request-Id"])
            async with s.post(c.router_url + "/v1/completions", data=b"{bad") as r:
                assert r.status == 400
                ids.add(r.headers["X-Request-Id"])
            async with s.post(
                c.router_url + "/v1/completions",
                json={"prompt": "a", "max_tokens": 1},
                headers={"X-Request-Id": "x" * 500},
            ) as r:  # not sane: replaced
                assert r.headers["X-Request-Id"] != "x" * 500
                ids.add(r.headers["X-Request-Id"])
            assert len(ids) == 6 and all(ids)
            # the same client id twice at once is served (router keys stay unique)
            rs = await asyncio.gather(
                *(
                    s.post(
                        c.router_url + "/v1/completions",
                        json={"prompt": "dup", "max_tokens": 2},
                        headers={"X-Request-Id": "same"},
                    )
                    for _ in range(3)
                )
            )
            for r in rs:
                assert r.status == 200
                assert r.headers["X-Request-Id"] == "same"
                r.release()
            assert_no_load(c)

    run(body())


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b"", 400),
    ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400),  # missing prompt
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "3"}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "stream": "yes"}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": [1, -2]}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(), 404),
    ("/v1/chat/completions", json.dumps({"max_tokens": 3}).encode(), 400),  # missing messages
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), 400),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}).encode(),
        400,
    ),
    ("/generate", json.dumps({"sampling_params": {"max_new_tokens": 3}}).encode(), 400),  # no text
    ("/generate", json.dumps({"text": "x", "sampling_params": {"max_new_tokens": -3}}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "word " * 2000}).encode(), 413),  # over --max-body-bytes
]


def test_bad_input_gets_4xx_json_and_the_router_stays_healthy() -> None:
    async def body() -> None:
        async with cluster(2, max_body_bytes=4096) as c:
            s = c.session
            for path, raw, status in BAD_INPUTS:
                async with s.post(
                    c.router_url + path, data=raw, headers={"Content-Type": "application/json"}
                ) as r:
                    assert r.status == status, (path, raw[:60], r.status, await r.text())
                    err = await r.json()
                    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
                    assert "type" in err["error"]
                    assert r.headers["X-Request-Id"]
            async with s.get(c.router_url + "/health") as r:
                assert r.status == 200
            async with s.post(
                c.router_url + "/v1/completions", json={"prompt": "fine", "max_tokens": 1}
            ) as r:
                assert r.status == 200
            async with s.get(c.router_url + "/metrics") as r:
                text = await r.text()
            assert 'kvroute_router_rejected_total{reason="bad_request"} 14.0' in text
            assert 'kvroute_router_rejected_total{reason="unknown_model"} 1.0' in text
            assert 'kvroute_router_rejected_total{reason="body_too_large"} 1.0' in text
            # rejected requests never reached the routing core
            assert sum(c.router.snapshot()[w]["requests"] for w in c.router.workers) == 1
            assert_no_load(c)

    run(body())


def test_upstream_4xx_is_passed_through_and_releases_load() -> None:
    async def body() -> None:
        async with cluster(2, kv_tokens=1000) as c:
            payload = {"prompt": "w " * 990, "max_tokens": 20}  # 1010 tokens > the worker's context of 1000
            async with c.session.post(c.router_url + "/v1/completions", json=payload) as r:
                assert r.status == 400
                assert "maximum context length" in (await r.json())["error"]["message"]
            assert_no_load(c)

    run(body())


def test_admin_api_needs_the_token_and_removes_and_readds_workers() -> None:
    async def body() -> None:
        async with cluster(2, policy="round_robin", admin_token="s3cret") as c:
            s = c.session
            a, b = c.worker_urls
            good = {"Authorization": "Bearer s3cret"}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with s.get(c.router_url + "/workers", headers=headers) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["type"] == "authentication_error"
                async with s.post(
                    c.router_url + "/workers", json={"url": "http://127.0.0.1:1"}, headers=headers
                ) as r:
                    assert r.status == 401
                async with s.delete(c.router_url + "/workers", params={"url": b}, headers=headers) as r:
                    assert r.status == 401
            assert sorted(c.router.workers) == sorted([a, b])
            async with s.get(c.router_url + "/workers", headers=good) as r:
                listed = (await r.json())["workers"]
            assert {w["url"] for w in listed} == {a, b} and all(w["healthy"] for w in listed)

            async with s.delete(c.router_url + "/workers", params={"url": b}, headers=good) as r:
                assert r.status == 200
            assert c.router.workers == [a]
            for i in range(4):
                async with s.post(
                    c.router_url + "/v1/completions", json={"prompt": f"p {i}", "max_tokens": 1}
                ) as r:
                    assert r.headers[WORKER_HEADER] == a
            async with s.delete(c.router_url + "/workers", params={"url": b}, headers=good) as r:
                assert r.status == 404
            async with s.post(c.router_url + "/workers", json={"url": b + "/"}, headers=good) as r:
                assert r.status == 201
                assert (await r.json())["healthy"] is True
            async with s.post(c.router_url + "/workers", json={"url": b}, headers=good) as r:
                assert r.status == 409
            async with s.post(c.router_url + "/workers", json={"url": "ftp://x"}, headers=good) as r:
                assert r.status == 400
            seen = set()
            for i in range(4):
                async with s.post(
                    c.router_url + "/v1/completions", json={"prompt": f"q {i}", "max_tokens": 1}
                ) as r:
                    seen.add(r.headers[WORKER_HEADER])
            assert seen == {a, b}
            assert_no_load(c)

    run(body())


def test_admin_mutations_are_disabled_without_a_configured_token() -> None:
    async def body() -> None:
        async with cluster(1) as c:
            async with c.session.post(c.router_url + "/workers", json={"url": "http://127.0.0.1:9"}) as r:
                assert r.status == 403
            assert len(c.router.workers) == 1

    run(body())


def test_health_checks_eject_a_dead_worker_and_readmit_it() -> None:
    async def body() -> None:
        async with cluster(2, health_interval_s=0.1, health_fail_threshold=2) as c:
            a, b = c.worker_urls
            port_b = c.served[1].port
            await c.served[1].stop()
            await wait_until(lambda: c.router.workers == [a], what="ejection of the stopped worker")
            for i in range(5):
                async with c.session.post(
                    c.router_url + "/v1/completions", json={"prompt": f"x {i}", "max_tokens": 1}
                ) as r:
                    assert r.status == 200
                    assert r.headers[WORKER_HEADER] == a
            revived = await serve_app(new_worker().app, port=port_b)
            c.served[1] = revived
            await wait_until(lambda: sorted(c.router.workers) == sorted([a, b]), what="readmission")
            assert_no_load(c)

    run(body())


def test_connect_failure_before_any_byte_is_retried_on_another_worker() -> None:
    async def body() -> None:
        async with cluster(1, policy="round_robin", health_fail_threshold=1000) as c:
            live = c.worker_urls[0]
            dead_port = await serve_app(new_worker().app)
            dead = dead_port.url
            await dead_port.stop()  # nothing listens there any more
            await c.service.health.add(dead, probe=False)  # admitted without a probe, as if it just died
            assert dead in c.router.workers
            for i in range(6):
                stream = i % 2 == 1
                async with c.session.post(
                    c.router_url + "/v1/completions",
                    json={"prompt": f"r {i}", "max_tokens": 2, "stream": stream},
                ) as r:
                    assert r.status == 200
                    assert r.headers[WORKER_HEADER] == live
                    await r.read()
            async with c.session.get(c.router_url + "/metrics") as r:
                text = await r.text()
            retries = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("kvroute_router_retries_total")
            )
            assert retries >= 3  # round robin sent every other request to the dead worker first
            assert f'kvroute_router_errors_total{{kind="connect",worker="{dead}"}}' in text
            assert_no_load(c)

    run(body())


def test_all_workers_failing_gives_502_json() -> None:
    async def body() -> None:
        async with cluster(1, health_fail_threshold=1000) as c:
            await c.served[0].stop()
            async with c.session.post(
                c.router_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ) as r:
                assert r.status == 502
                assert (await r.json())["error"]["code"] == "upstream_unavailable"
            assert_no_load(c)

    run(body())


def test_timeouts_release_load_streaming_or_not() -> None:
    async def body() -> None:
        async with cluster(2, request_timeout_s=0.3) as c:
            async with c.session.post(
                c.router_url + "/v1/completions", json={"prompt": "slow", "max_tokens": 60}
            ) as r:
                assert r.status == 504
                assert (await r.json())["error"]["code"] == "timeout"
            async with c.session.post(
                c.router_url + "/v1/completions", json={"prompt": "slow", "max_tokens": 60, "stream": True}
            ) as r:
                assert r.status == 200  # the stream had started; the timeout is reported in-band
                events = await sse_events(r)
            assert b"timeout" in events[-1]
            assert_no_load(c)
            # the workers drop the abandoned requests too
            await wait_until(
                lambda: all(not w.pending and not w.engine.has_work() for w in c.workers), what="workers idle"
            )

    run(body())


@pytest.mark.parametrize("policy", ["lbgr", "cache_aware"])
def test_1000_requests_with_random_client_disconnects_leave_no_load(policy: str) -> None:
    async def body() -> None:
        async with cluster(3, policy=policy) as c:
            rng = random.Random(7)
            limit = asyncio.Semaphore(64)
            outcomes = {"complete": 0, "stream": 0, "drop_mid_stream": 0, "drop_early": 0}
            url = c.router_url + "/v1/completions"

            async def one(i: int) -> None:
                mode = rng.choice(list(outcomes))
                payload = {
                    "prompt": f"group {i % 17} shared words here then {i} own words",
                    "max_tokens": rng.randint(1, 4),
                    "stream": mode in ("stream", "drop_mid_stream"),
                }
                async with limit:
                    if mode == "drop_early":  # client gives up before (or while) the answer comes
                        with_timeout = asyncio.wait_for(
                            _post_read(c.session, url, payload), rng.uniform(0, 0.06)
                        )
                        try:
                            await with_timeout
                        except asyncio.TimeoutError:
                            pass
                    elif mode == "drop_mid_stream":  # read the first chunk, then hang up
                        async with c.session.post(url, json=payload) as r:
                            assert r.status == 200
                            await r.content.readany()
                            r.close()
                    else:
                        async with c.session.post(url, json=payload) as r:
                            assert r.status == 200
                            await r.read()
                outcomes[mode] += 1

            await asyncio.gather(*(one(i) for i in range(1000)))
            assert sum(outcomes.values()) == 1000 and min(outcomes.values()) > 150
            await wait_until(
                lambda: c.service.proxy.active_requests == 0 and not c.router.in_flight(),
                what="router to see every disconnect",
            )
            assert_no_load(c)
            snap = c.router.snapshot()
            reached = sum(snap[w]["requests"] for w in c.router.workers)
            # every request that was not dropped early reached the routing core (drop_early ones may have)
            assert reached >= 1000 - outcomes["drop_early"]
            await wait_until(
                lambda: all(not w.pending and not w.engine.has_work() for w in c.workers), what="workers idle"
            )

    run(body(), timeout_s=180)


async def _post_read(session: aiohttp.ClientSession, url: str, payload: dict) -> None:
    async with session.post(url, json=payload) as r:
        await r.read()


def test_membership_sync_adds_and_removes_workers_as_the_ray_watcher_reports() -> None:
    async def body() -> None:
        async with cluster(2) as c:
            a, b = c.worker_urls
            await c.service.sync_workers({"w-a": a})
            assert c.router.workers == [a]
            await c.service.sync_workers({"w-a": a + "/", "w-b": b})
            assert sorted(c.router.workers) == sorted([a, b])
            await c.service.sync_workers({})
            assert c.router.workers == []
            async with c.session.post(c.router_url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "no_worker"
            async with c.session.get(c.router_url + "/health") as r:
                assert r.status == 503
            async with c.session.get(c.router_url + "/v1/models") as r:
                assert r.status == 503
            assert_no_load(c)

    run(body())


@pytest.mark.parametrize(
    "argv",
    [
        ["--policy", "no_such_policy"],
        ["--worker-urls", "localhost:1"],
        ["--policy", "cache_aware", "--policy-option", "no_such_option=1"],
        ["--policy-option", "novalue"],
        ["--max-body-bytes", "0"],
        ["--max-index-chars", "0"],
        ["--request-timeout", "-1"],
        ["--health-interval", "0"],
    ],
)
def test_router_cli_rejects_bad_arguments_with_exit_code_2(argv: list[str]) -> None:
    from kvroute.router.server import main

    with pytest.raises(SystemExit) as info:  # argparse errors exit 2 too
        raise SystemExit(main(argv))
    assert info.value.code == 2
