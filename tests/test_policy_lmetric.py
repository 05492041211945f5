"""lmetric: the smallest P-tokens x batch-size product wins (seed 002)."""

from __future__ import annotations

from kvroute.router import Request, WorkerView, make_policy

REQ = Request("r", "x" * 400, 100)  # 4 chars per token


def policy():
    p = make_policy("lmetric")
    p.bind(0)
    return p


def test_takes_the_smallest_product() -> None:
    p = policy()
    workers = [
        WorkerView("hit-but-busy", 9, 0, 0.0, 360),  # P = 10, BS+1 = 10 -> 100
        WorkerView("miss-idle", 0, 0, 0.0, 0),  # P = 100, BS+1 = 1 -> 100 ... tie with the first
        WorkerView("hit-light", 2, 0, 0.0, 360),  # P = 10, BS+1 = 3 -> 30
    ]
    assert p.choose(REQ, workers, 0.0) == "hit-light"
    assert p.score(REQ, workers[0]) == 100 and p.score(REQ, workers[2]) == 30


def test_queued_prefill_counts_in_p_tokens() -> None:
    p = policy()
    workers = [WorkerView("cached-but-queued", 1, 5000, 0.0, 400), WorkerView("cold", 1, 0, 0.0, 0)]
    assert p.choose(REQ, workers, 0.0) == "cold"


def test_zero_factors_still_discriminate() -> None:
    p = policy()
    # both idle: a raw product would be 0 for both; with BS + 1 the cache still decides
    idle = [WorkerView("idle-miss", 0, 0, 0.0, 0), WorkerView("idle-hit", 0, 0, 0.0, 200)]
    assert p.choose(REQ, idle, 0.0) == "idle-hit"
    # a full hit (P = 0 raw) still pays for its batch: floored at one token
    full = [WorkerView("full-hit-busy", 50, 0, 0.0, 400), WorkerView("half-hit-idle", 0, 0, 0.0, 200)]
    assert p.score(REQ, full[0]) == 51
    assert p.choose(REQ, full, 0.0) == "half-hit-idle"
