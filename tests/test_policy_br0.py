"""br0: BalanceRoute's F-score — fill the largest safe margin, penalise overflow (seed 001)."""

from __future__ import annotations

from collections import Counter

from kvroute.router import Request, Router, WorkerView, make_policy
from kvroute.router.policies.br0 import BR0Policy


def views(n: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", 0, 0, 0.0, 0) for i in range(n)]


def loaded(loads: list[int]) -> BR0Policy:
    p = make_policy("br0")
    p.bind(0)
    for i, load in enumerate(loads):
        if load:
            p.on_dispatch(Request(f"seed{i}", "", load), WorkerView(f"w{i}", 0, 0, 0.0, 0), 0.0)
    return p


def test_f_score_is_piecewise_linear() -> None:
    assert BR0Policy.f_score(30, margin=100, n=3) == 30  # safe: fills margin one for one
    assert BR0Policy.f_score(70, margin=60, n=3) == 3 * 60 - 2 * 70  # overflow: penalised N-1 fold


def test_large_request_fills_the_largest_margin() -> None:
    p = loaded([100, 40, 0])  # margins 0, 60, 100
    assert p.choose(Request("r", "", 70), views(3), 0.0) == "w2"


def test_safe_placements_tie_and_overflow_is_never_preferred() -> None:
    p = loaded([100, 40, 0])
    picks = Counter(p.choose(Request("r", "", 30), views(3), 0.0) for _ in range(200))
    assert set(picks) == {"w1", "w2"}  # both absorb 30 safely; the heaviest worker never


def test_footprint_follows_dispatch_and_finish_in_a_router() -> None:
    r = Router("br0", ["a", "b"], seed=1)
    first = r.route(Request("1", "p", 500), 0.0)
    second = r.route(Request("2", "p", 10), 0.0)
    assert first != second  # the second request fills the idle worker's margin
    r.finish("1", 1.0, True)
    r.finish("2", 1.0, True)
    assert r.policy.footprint("a") == 0 and r.policy.footprint("b") == 0
