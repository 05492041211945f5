"""cache_aware: sglang-router semantics — longest match when balanced, least loaded when imbalanced."""

from __future__ import annotations

import pytest
from kvroute.router import Request, Router, WorkerView, make_policy

TEXT = "x" * 100
REQ = Request("r", TEXT, 25)


def policy(**options: object):
    p = make_policy("cache_aware", **options)
    p.bind(0)
    return p


def v(wid: str, in_flight: int, match: int, index_chars: int = 0) -> WorkerView:
    return WorkerView(wid, in_flight, 0, 0.0, match, index_chars=index_chars)


def test_defaults_are_sglang_router_0_3_2() -> None:
    p = policy()
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)
    old = policy(preset="sglang-0.1.4")
    assert (old.cache_threshold, old.balance_abs_threshold, old.balance_rel_threshold) == (0.5, 32, 1.0001)
    assert policy(preset="sglang-0.1.4", cache_threshold=0.2).cache_threshold == 0.2
    with pytest.raises(ValueError, match="valid presets"):
        policy(preset="sglang-9")
    with pytest.raises(ValueError, match="cache_threshold"):
        policy(cache_threshold=1.5)


def test_balanced_takes_the_longest_match() -> None:
    p = policy()
    workers = [v("a", 10, 20), v("b", 12, 80), v("c", 0, 0)]
    assert p.choose(REQ, workers, 0.0) == "b"


def test_imbalanced_takes_the_least_loaded_despite_a_match() -> None:
    p = policy()
    workers = [v("a", 100, 95), v("b", 10, 0)]  # 90 > 64 and 100 > 1.5 * 10
    assert p.choose(REQ, workers, 0.0) == "b"
    # a large absolute gap that is small relative to the loads is not an imbalance
    workers = [v("a", 200, 95), v("b", 150, 0)]
    assert p.choose(REQ, workers, 0.0) == "a"


def test_low_match_goes_to_the_smallest_tree() -> None:
    p = policy()
    workers = [v("a", 0, 30, index_chars=5000), v("b", 5, 0, index_chars=100), v("c", 1, 0, index_chars=900)]
    assert p.choose(REQ, workers, 0.0) == "b"  # 30 / 100 is not > 0.3
    assert policy(fallback="least_load").choose(REQ, workers, 0.0) == "a"


def test_match_rate_exactly_at_the_old_threshold_does_not_route_by_cache() -> None:
    workers = [v("a", 0, 50, index_chars=9000), v("b", 0, 0, index_chars=10)]
    assert policy().choose(REQ, workers, 0.0) == "a"  # 0.5 > 0.3
    assert policy(preset="sglang-0.1.4").choose(REQ, workers, 0.0) == "b"  # 0.5 is not > 0.5


def test_in_a_router_a_shared_prefix_sticks_to_one_worker() -> None:
    r = Router("cache_aware", ["a", "b", "c"], seed=2)
    prefix = "You are a helpful assistant. " * 10
    first = r.route(Request("0", prefix + "question zero", 80), 0.0)
    for i in range(1, 20):
        assert r.route(Request(str(i), prefix + f"question {i}", 80), 0.01 * i) == first
