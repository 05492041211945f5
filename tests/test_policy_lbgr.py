"""lbgr (seed 004, Algorithm 2): greedy on S + W + r, RLS residual, decay/release, anti-herding."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest
from kvroute.router import Request, Router, WorkerView, make_policy
from kvroute.router.policies.lbgr import RLS, LBGRPolicy

GAMMA = 31 / 32


def policy(**options: object) -> LBGRPolicy:
    p = make_policy("lbgr", **options)
    p.bind(0)
    assert isinstance(p, LBGRPolicy)
    return p


def test_service_time_uses_per_1k_token_costs() -> None:
    p = policy(c_hit_ms_per_1k=100.0, c_miss_ms_per_1k=1000.0)
    req = Request("r", "x" * 4000, 1000)  # 4 chars per token before anything is learned
    assert p.service_time(req, 0) == pytest.approx(1.0)  # 1000 uncached tokens at 1 s per 1k
    assert p.service_time(req, 2000) == pytest.approx(0.5 + 0.05)  # 500 hit + 500 miss
    assert p.service_time(req, 4000) == pytest.approx(0.1)
    assert policy().service_time(req, 4000) == pytest.approx(0.001)  # reference c_hit = 0, floored at 1 ms


def test_prefers_the_hit_worker_until_its_queue_outweighs_the_miss_cost() -> None:
    p = policy()
    req = Request("r", "x" * 4000, 1000)  # hit worker: S = 0.1 s (900 of 1000 tokens cached); miss: S = 1 s
    for load, expected in [(0.0, "hit"), (0.5, "hit"), (0.89, "hit"), (0.91, "miss"), (3.0, "miss")]:
        views = [WorkerView("hit", 3, 0, load, 3600), WorkerView("miss", 0, 0, 0.0, 0)]
        assert p.choose(req, views, 0.0) == expected, load


def test_burst_on_a_cached_prefix_switches_when_the_queue_load_says_so() -> None:
    r = Router("lbgr", ["a", "b"], seed=0, learn_residual=False)  # isolate S + W (residual tested below)
    prefix = "p" * 3640  # 910 of 1000 tokens cached: S = 0.09 s on the holder, 1.0 s elsewhere
    r.route(Request("warm", prefix + "w" * 360, 1000), 0.0)
    r.finish("warm", 0.0, True)
    (holder,) = r.index.match(prefix)
    picks = []
    for i in range(20):  # same instant, so no decay: each request adds S to its worker's queue
        picks.append(r.route(Request(str(i), prefix + chr(ord("A") + i) * 360, 1000), 0.0))
    first_switch = next(i for i, w in enumerate(picks) if w != holder)
    # request i stays while 0.09 + 0.09 * i < 1.0, i.e. for i = 0..10
    assert first_switch == 11
    assert picks[:11] == [holder] * 11


def test_rls_recovers_a_known_linear_residual() -> None:
    rng = random.Random(1)
    true_theta = [0.8, -0.3, 0.05, 0.2]
    rls = RLS(forgetting=0.992, p0=10.0)
    for _ in range(2000):
        x = [rng.uniform(0.0, 2.0), rng.uniform(0.0, 5.0), float(rng.randrange(0, 20)), 1.0]
        y = sum(t * xi for t, xi in zip(true_theta, x, strict=True)) + rng.gauss(0.0, 0.01)
        rls.update(x, y)
    assert rls.theta == pytest.approx(true_theta, abs=0.02)


def test_policy_learns_the_residual_from_finished_requests() -> None:
    """Through the Router: true e2e = 2 S + W + 0.05 n + 0.3, so y = e2e - (S + W) = S + 0.05 n + 0.3."""
    r = Router("lbgr", ["a"], seed=3)
    rng = random.Random(4)
    pending: list[tuple[float, str]] = []
    now = 0.0
    for i in range(2500):
        now += rng.expovariate(20.0)
        while pending and pending[0][0] <= now:
            t, rid = heapq.heappop(pending)
            r.finish(rid, t, True)
        tokens = rng.randrange(100, 1500)
        req = Request(str(i), f"{i}:" + "t" * (tokens * 4), tokens)
        view = r.state.view("a", now)
        s = r.policy.service_time(req, r.index.match(req.text).get("a", 0))
        r.route(req, now)
        e2e = 2.0 * s + view.load + 0.05 * view.in_flight + 0.3
        heapq.heappush(pending, (now + e2e, req.id))
    theta = r.policy.theta("a")
    assert theta[0] == pytest.approx(1.0, abs=0.05)
    assert theta[1] == pytest.approx(0.0, abs=0.05)
    assert theta[2] == pytest.approx(0.05, abs=0.01)
    assert theta[3] == pytest.approx(0.3, abs=0.1)


def test_decay_and_release_bring_the_load_back_to_zero() -> None:
    r = Router("lbgr", ["a"], seed=0)
    r.route(Request("1", "x" * 4000, 1000), 0.0)
    r.route(Request("2", "y" * 4000, 1000), 0.0)
    w0 = r.snapshot(0.0)["a"]["load"]
    assert w0 == pytest.approx(2.0)
    assert r.snapshot(0.2)["a"]["load"] == pytest.approx(2.0 * GAMMA**10)
    assert r.snapshot(20.0)["a"]["load"] < 1e-6 * w0  # decays on its own, from elapsed time only
    r.finish("1", 0.1, True)
    assert r.snapshot(0.1)["a"]["load"] == pytest.approx(1.0 * GAMMA**5)  # the other's remainder
    r.finish("2", 0.3, True)
    assert r.snapshot(0.3)["a"]["load"] == 0.0


def test_chars_to_tokens_ratio_is_learned_from_prompt_tokens() -> None:
    p = policy()
    req = Request("r", "z" * 600, 1000)  # the caller's estimate says 0.6 chars per token
    assert p.hit_tokens(req, 300) == pytest.approx(500)  # before learning: the request's own ratio
    for i in range(20):
        p.on_finish(str(i), "a", 1.0, True, 0.1, 0.2, prompt_chars=600, prompt_tokens=100)
    assert p.chars_per_token.ratio == pytest.approx(6.0)
    assert p.hit_tokens(req, 300) == pytest.approx(50)


def test_ties_are_broken_at_random() -> None:
    p = policy()
    req = Request("r", "x" * 100, 25)
    views = [WorkerView(w, 0, 0, 0.0, 0) for w in ("a", "b", "c")]
    assert set(Counter(p.choose(req, views, 0.0) for _ in range(200))) == {"a", "b", "c"}


def _burst_after_stale_residual(half_life: float) -> list[str]:
    """Worker a learned a large positive residual long ago, then got no traffic; then a burst."""
    r = Router("lbgr", ["a", "b"], seed=5, residual_half_life_s=half_life)
    p = r.policy
    for i in range(50):  # a was 20 s slower than predicted, 50 times, at t ~ 0
        p.observe("a", (0.2, 0.0, 0.0, 1.0), 20.0, now=0.01 * i)
        p.observe("b", (0.2, 0.0, 0.0, 1.0), 0.0, now=0.01 * i)
    picks = []
    now = 120.0  # two minutes with no traffic to a
    for i in range(256):
        now += 0.01
        picks.append(r.route(Request(str(i), f"prompt {i} " + "w" * 790, 200), now))
    return picks


def longest_run(picks: list[str]) -> int:
    best = run = 1
    for prev, cur in zip(picks, picks[1:], strict=False):
        run = run + 1 if cur == prev else 1
        best = max(best, run)
    return best


def test_stale_residual_does_not_herd_everything_to_one_worker() -> None:
    picks = _burst_after_stale_residual(half_life=5.0)
    counts = Counter(picks)
    assert counts["a"] >= 0.3 * len(picks) and counts["b"] >= 0.3 * len(picks)
    assert longest_run(picks) < 20
    # control: without aging the same history sends every one of the 256 requests to b
    assert Counter(_burst_after_stale_residual(half_life=1e9)) == {"b": 256}


def test_aging_does_not_bias_a_worker_that_keeps_reporting() -> None:
    p = policy()
    for i in range(3000):
        p.observe("a", (0.1, 0.0, 0.0, 1.0), 0.5, now=0.01 * i)
    assert p.residual("a", 0.1, 0.0, 0, now=30.0) == pytest.approx(0.5, abs=0.01)
    assert p.residual("a", 0.1, 0.0, 0, now=30.0 + 2.0 + 5.0) == pytest.approx(0.25, abs=0.01)


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="forgetting"):
        make_policy("lbgr", forgetting=0.0)
    with pytest.raises(ValueError, match="cost"):
        make_policy("lbgr", c_miss_ms_per_1k=-1.0)
    with pytest.raises(ValueError, match="valid options: c_hit_ms_per_1k"):
        make_policy("lbgr", gamma=0.9)


def test_bias_only_variant_learns_only_the_intercept() -> None:
    r = Router("lbgr", ["a"], seed=0, residual_features="bias")
    for i in range(200):
        r.route(Request(str(i), f"{i} " + "x" * 400, 100), float(i))
        r.finish(str(i), float(i) + 0.7, True)
    theta = r.policy.theta("a")
    assert theta[:3] == [0.0, 0.0, 0.0]
    assert theta[3] == pytest.approx(0.7 - r.policy.service_time(Request("q", "y" * 400, 100), 0), abs=0.02)
    with pytest.raises(ValueError, match="residual_features"):
        make_policy("lbgr", residual_features="quadratic")


def test_monotone_predictions_never_make_extra_load_cheaper() -> None:
    rng = random.Random(2)
    fitted = {}
    for monotone in (True, False):
        p = policy(monotone=monotone)
        for i in range(400):  # latency that *falls* with in-flight count in the data
            n = rng.randrange(0, 10)
            p.observe("a", (0.1, 0.0, float(n), 1.0), 2.0 - 0.1 * n + rng.gauss(0, 0.01), now=0.01 * i)
        fitted[monotone] = p
    assert fitted[True].theta("a")[2] == pytest.approx(-0.1, abs=0.02)  # the fit itself is untouched
    low = fitted[True].residual("a", 0.1, 0.0, 5, now=4.0)
    high = fitted[True].residual("a", 0.1, 0.0, 50, now=4.0)
    assert high >= low  # prediction: the slope on n is clamped at 0
    assert fitted[False].residual("a", 0.1, 0.0, 50, now=4.0) < fitted[False].residual(
        "a", 0.1, 0.0, 5, now=4.0
    )


def test_uncertainty_penalty_prefers_the_worker_whose_data_covers_the_current_load() -> None:
    rng = random.Random(3)
    p = policy()
    for i in range(600):
        t = 0.01 * i
        # same true model y = 1 + 0.01 n on both; a only ever saw n in [0, 5], b saw n in [0, 100]
        na, nb = rng.randrange(0, 6), rng.randrange(0, 101)
        p.observe("a", (0.1, 0.0, float(na), 1.0), 1.0 + 0.01 * na + rng.gauss(0, 0.2), now=t)
        p.observe("b", (0.1, 0.0, float(nb), 1.0), 1.0 + 0.01 * nb + rng.gauss(0, 0.2), now=t)
    assert p.penalty("a", 0.1, 0.0, 80, now=6.0) > 3 * p.penalty("b", 0.1, 0.0, 80, now=6.0)
    assert p.penalty("a", 0.1, 0.0, 2, now=6.0) < p.penalty("a", 0.1, 0.0, 80, now=6.0)
    for w in p._workers.values():  # give both the same mean model: only the uncertainty differs now
        w.model.theta = [0.0, 0.0, 0.01, 1.0]
        p._refresh(w)
    req = Request("r", "x" * 400, 100)
    views = [WorkerView("a", 80, 0, 0.0, 0), WorkerView("b", 80, 0, 0.0, 0)]
    assert {p.choose(req, views, 6.0) for _ in range(20)} == {"b"}
    unguarded = policy(uncertainty_penalty=0.0)
    unguarded._workers = p._workers  # same fitted models, no penalty: the two look alike again
    for w in unguarded._workers.values():
        unguarded._refresh(w)
    assert {unguarded.choose(req, views, 6.0) for _ in range(60)} == {"a", "b"}


def test_inlined_choose_agrees_with_estimate() -> None:
    rng = random.Random(9)
    p = policy()
    for i in range(300):
        for w in ("a", "b", "c"):
            x = (rng.uniform(0, 2), rng.uniform(0, 3), float(rng.randrange(0, 30)), 1.0)
            p.observe(w, x, rng.uniform(0, 5), now=0.01 * i)
    for k in range(200):
        req = Request(str(k), "t" * rng.randrange(40, 4000), rng.randrange(10, 1000))
        views = [
            WorkerView(w, rng.randrange(0, 40), 0, rng.uniform(0, 5), rng.randrange(0, len(req.text) + 1))
            for w in ("a", "b", "c")
        ]
        now = rng.choice([3.0, 10.0, 60.0])  # fresh, aging, and nearly forgotten residuals
        chosen = p.choose(req, views, now)
        best = min(p.estimate(req, v, now) for v in views)
        assert p.estimate(req, next(v for v in views if v.id == chosen), now) == pytest.approx(best, abs=1e-9)


def test_penalty_is_k_standard_deviations_of_the_rls_prediction() -> None:
    rng = random.Random(4)
    p = policy(uncertainty_penalty=2.0)
    for i in range(200):
        x = (rng.uniform(0, 1), rng.uniform(0, 2), float(rng.randrange(0, 8)), 1.0)
        p.observe("a", x, 0.5 * x[0] + rng.gauss(0, 0.3), now=0.01 * i)
    model = p._workers["a"].model
    for x in [(0.5, 1.0, 3.0, 1.0), (2.0, 9.0, 60.0, 1.0)]:
        expected = 2.0 * math.sqrt(model.variance(x))
        assert p.penalty("a", x[0], x[1], int(x[2]), now=2.0) == pytest.approx(expected, rel=1e-9)
