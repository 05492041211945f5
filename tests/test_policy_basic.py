"""random, round_robin, least_load, power_of_two, and the make_policy registry."""

from __future__ import annotations

from collections import Counter

import pytest
from kvroute.router import POLICY_NAMES, Request, WorkerView, make_policy
from kvroute.router.policies import policy_options

REQ = Request("r", "text", 10)


def views(*in_flight: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", n, 0, 0.0, 0) for i, n in enumerate(in_flight)]


def bound(name: str, seed: int = 0, **options: object):
    policy = make_policy(name, **options)
    policy.bind(seed)
    return policy


def test_registry_lists_every_policy_and_rejects_unknowns() -> None:
    assert POLICY_NAMES == [
        "random",
        "round_robin",
        "least_load",
        "power_of_two",
        "prefix_hash",
        "cache_aware",
        "lbgr",
        "lmetric",
        "lodestar",
        "br0",
    ]
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="valid policies"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="valid options: by='in_flight'"):
        make_policy("least_load", by_what="x")
    with pytest.raises(TypeError):
        make_policy(3)  # type: ignore[arg-type]
    assert policy_options("cache_aware")["preset"] == "sglang-0.3.2"


def test_random_is_seeded_and_covers_all_workers() -> None:
    a, b = bound("random", 5), bound("random", 5)
    picks = [a.choose(REQ, views(0, 0, 0), 0.0) for _ in range(300)]
    assert picks == [b.choose(REQ, views(0, 0, 0), 0.0) for _ in range(300)]
    counts = Counter(picks)
    assert set(counts) == {"w0", "w1", "w2"} and min(counts.values()) > 60


def test_round_robin_cycles_in_order() -> None:
    p = bound("round_robin")
    assert [p.choose(REQ, views(5, 0, 9), 0.0) for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_load_takes_the_minimum_and_breaks_ties_at_random() -> None:
    p = bound("least_load")
    assert p.choose(REQ, views(3, 1, 2), 0.0) == "w1"
    assert {p.choose(REQ, views(1, 5, 1), 0.0) for _ in range(50)} == {"w0", "w2"}
    by_tokens = bound("least_load", by="queued_prefill_tokens")
    vs = [WorkerView("a", 0, 500, 0.0, 0), WorkerView("b", 9, 10, 0.0, 0)]
    assert by_tokens.choose(REQ, vs, 0.0) == "b"
    with pytest.raises(ValueError, match="by must be one of"):
        make_policy("least_load", by="cpu")


def test_power_of_two_never_takes_the_worse_of_its_two_samples() -> None:
    p = bound("power_of_two", 1)
    assert all(p.choose(REQ, views(7, 2), 0.0) == "w1" for _ in range(50))
    picks = Counter(p.choose(REQ, views(0, 0, 0, 100), 0.0) for _ in range(400))
    assert "w3" not in picks  # the overloaded one loses every comparison it is drawn into
    assert p.choose(REQ, views(4), 0.0) == "w0"
