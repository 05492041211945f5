"""The Router facade: bookkeeping, idempotent finish, retries with exclude, errors, reproducibility."""

from __future__ import annotations

import random

import pytest
from kvroute.router import POLICY_NAMES, NoWorkerAvailable, Policy, Request, Router, WorkerView, make_policy


def req(i: int | str, text: str = "some prompt text", tokens: int = 10) -> Request:
    return Request(str(i), text, tokens)


def test_route_records_dispatch_and_finish_releases_it() -> None:
    r = Router("round_robin", ["a", "b"], seed=0)
    assert r.route(req(1), 0.0) == "a"
    assert r.route(req(2), 0.0) == "b"
    snap = r.snapshot(0.0)
    assert snap["a"]["in_flight"] == 1 and snap["a"]["queued_prefill_tokens"] == 10
    assert snap["a"]["load"] > 0 and snap["a"]["index_chars"] == len("some prompt text")
    assert snap["__index__"]["stored_chars"] == len("some prompt text")
    r.first_token("1", 0.1)
    assert r.snapshot(0.1)["a"]["queued_prefill_tokens"] == 0
    r.finish("1", 0.2, True, prompt_tokens=10)
    r.finish("1", 0.3, True, prompt_tokens=10)  # idempotent
    r.finish("never-routed", 0.3, False)  # unknown ids are a no-op
    r.finish("2", 0.2, False)
    snap = r.snapshot(1.0)
    for w in ("a", "b"):
        assert snap[w]["in_flight"] == 0 and snap[w]["queued_prefill_tokens"] == 0 and snap[w]["load"] == 0
    assert snap["b"]["errors"] == 1
    assert r.in_flight() == []


def test_retry_on_another_worker_after_failure() -> None:
    r = Router("least_load", ["a", "b", "c"], seed=1)
    request = req("x")
    first = r.route(request, 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        r.route(request, 0.0)
    r.finish("x", 0.1, ok=False)
    second = r.route(request, 0.1, exclude={first})
    assert second != first
    assert r.worker_of("x") == second
    r.finish("x", 0.2, ok=False)
    third = r.route(request, 0.2, exclude={first, second})
    assert third not in {first, second}
    r.finish("x", 0.3, ok=False)
    with pytest.raises(NoWorkerAvailable):
        r.route(request, 0.3, exclude={"a", "b", "c"})
    assert issubclass(NoWorkerAvailable, ValueError)
    with pytest.raises(TypeError, match="single str"):
        r.route(request, 0.3, exclude="a")  # type: ignore[arg-type]


def test_no_workers_raises() -> None:
    r = Router("random")
    with pytest.raises(NoWorkerAvailable, match="none registered"):
        r.route(req(1), 0.0)


def test_membership_errors_and_index_share_freed_on_removal() -> None:
    r = Router("round_robin", ["a", "b"])
    with pytest.raises(ValueError, match="already registered"):
        r.add_worker("a")
    with pytest.raises(ValueError):
        r.add_worker("")
    with pytest.raises(ValueError, match="unknown worker"):
        r.remove_worker("zzz")
    r.route(req(1, "alpha prompt"), 0.0)
    r.route(req(2, "beta prompt"), 0.0)
    assert r.index.worker_chars("a") > 0
    r.remove_worker("a")
    assert r.workers == ["b"]
    assert r.index.worker_chars("a") == 0
    assert "a" not in r.index.match("alpha prompt")
    r.finish("1", 1.0, True)  # its worker is gone: still a clean no-op
    assert r.route(req(3), 1.0) == "b"
    assert "a" not in r.snapshot(1.0)


def test_unknown_policy_and_options_list_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid policies: .*lbgr"):
        Router("nope")
    with pytest.raises(ValueError, match="valid options: .*cache_threshold"):
        Router("cache_aware", bogus=1)
    with pytest.raises(ValueError, match="ready-made"):
        Router(make_policy("random"), cache_threshold=0.3)
    with pytest.raises(ValueError, match="max_index_chars"):
        Router("random", max_index_chars=0)
    with pytest.raises(TypeError):
        Router(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Router("random", ["a"]).route("not a request", 0.0)  # type: ignore[arg-type]


def test_default_index_bound_is_per_worker_and_follows_membership() -> None:
    from kvroute.router.core import INDEX_CHARS_PER_WORKER

    r = Router("cache_aware", [f"w{i}" for i in range(4)])
    assert r.index.max_chars == 4 * INDEX_CHARS_PER_WORKER
    for i in range(4, 64):
        r.add_worker(f"w{i}")
    assert r.index.max_chars == 64 * INDEX_CHARS_PER_WORKER
    for i in range(64):
        r.remove_worker(f"w{i}")
    assert r.index.max_chars == INDEX_CHARS_PER_WORKER  # never zero, even with no worker
    fixed = Router("cache_aware", ["a", "b"], max_index_chars=1_000)
    fixed.add_worker("c")
    assert fixed.index.max_chars == 1_000  # a given bound is the total, whatever the membership


def test_bad_request_fields_and_finish_arguments() -> None:
    with pytest.raises(ValueError, match="est_tokens"):
        Request("a", "t", -1)
    with pytest.raises(ValueError, match="id"):
        Request("", "t", 1)
    with pytest.raises(TypeError, match="text"):
        Request("a", None, 1)  # type: ignore[arg-type]
    r = Router("random", ["a"])
    r.route(req(1), 0.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        r.finish("1", 0.1, True, prompt_tokens=-3)
    with pytest.raises(TypeError):
        r.update_metrics("a", {"x": "y"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="unknown worker"):
        r.update_metrics("zz", {"x": 1.0})


def test_policy_returning_a_non_eligible_worker_is_an_error() -> None:
    class Broken(Policy):
        name = "broken"

        def choose(self, request: Request, workers: list[WorkerView], now: float) -> str:
            return "elsewhere"

    r = Router(Broken(), ["a"])
    with pytest.raises(RuntimeError, match="not an eligible worker"):
        r.route(req(1), 0.0)
    assert r.in_flight() == [] and r.snapshot(0.0)["a"]["in_flight"] == 0


def test_metrics_reach_policies_through_views() -> None:
    seen: list[WorkerView] = []

    class Spy(Policy):
        name = "spy"

        def choose(self, request: Request, workers: list[WorkerView], now: float) -> str:
            seen.extend(workers)
            return workers[0].id

    r = Router(Spy(), ["a", "b"])
    r.update_metrics("b", {"kv_cache_usage": 0.75})
    r.route(req(1, "hello"), 0.0)
    r.route(req(2, "hello world"), 0.0)
    views = {v.id: v for v in seen[-2:]}
    assert views["b"].metrics["kv_cache_usage"] == 0.75
    assert views["a"].match_chars == 5 and views["b"].match_chars == 0
    assert views["a"].in_flight == 1 and views["a"].index_chars == 5


def test_learned_chars_per_token_feeds_estimates() -> None:
    r = Router("random", ["a"], seed=0)
    text = "x" * 600
    for i in range(30):
        r.route(Request(str(i), text, 100), float(i))
        r.finish(str(i), float(i) + 0.5, True, prompt_tokens=100)
    assert r.estimate_tokens("y" * 60) == 10
    assert r.estimate_tokens("") == 0
    assert r.snapshot()["__index__"]["chars_per_token"] == pytest.approx(6.0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_same_seed_same_decisions_and_state_drains(policy: str) -> None:
    def run(seed: int) -> list[str]:
        r = Router(policy, [f"w{i}" for i in range(5)], seed=seed)
        rng = random.Random(7)
        out, live = [], []
        now = 0.0
        for i in range(300):
            now += 0.01
            text = f"group {rng.randrange(6)} " * 20 + str(i)
            out.append(r.route(Request(str(i), text, len(text) // 5, 8), now))
            live.append((str(i), len(text) // 5))
            if len(live) > 6:
                rid, toks = live.pop(0)
                r.first_token(rid, now)
                r.finish(rid, now + 0.01, True, prompt_tokens=toks)
        for rid, toks in live:
            r.finish(rid, now + 1, True, prompt_tokens=toks)
        snap = r.snapshot(now + 2)
        for w in r.workers:
            assert (
                snap[w]["in_flight"] == 0 and snap[w]["queued_prefill_tokens"] == 0 and snap[w]["load"] == 0
            )
        return out

    assert run(123) == run(123)


def test_worker_count_is_capped_at_the_index_slots() -> None:
    r = Router("random", [f"w{i}" for i in range(256)])
    with pytest.raises(ValueError, match="at most 256"):
        r.add_worker("w256")
    r.remove_worker("w0")
    r.add_worker("w256")
    assert len(r.workers) == 256
