"""lodestar (seed 000): heuristic while cold or out of range, learns a TTFT function, trains in steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvroute.router import Request, WorkerView, make_policy
from kvroute.router.policies.lodestar import LodestarPolicy


def policy(**options: object) -> LodestarPolicy:
    p = make_policy("lodestar", **options)
    p.bind(0)
    assert isinstance(p, LodestarPolicy)
    return p


def true_ttft(tokens: int, hit_ratio: float, in_flight: int, queued: int) -> float:
    """A synthetic engine: uncached prefill at 0.2 ms/token, queued prefill ahead, batch interference."""
    return 0.0002 * tokens * (1.0 - hit_ratio) + 0.0002 * queued + 0.02 * in_flight + 0.01


def random_case(rng: random.Random, wid: str, tokens: int, text: str) -> tuple[WorkerView, float]:
    hit = rng.choice([0.0, 0.0, 0.25, 0.5, 0.9])
    in_flight = rng.randrange(0, 12)
    queued = rng.randrange(0, 3000)
    view = WorkerView(wid, in_flight, queued, 0.0, int(hit * len(text)))
    return view, true_ttft(tokens, hit, in_flight, queued)


def teach(p: LodestarPolicy, n: int, rng: random.Random) -> None:
    for i in range(n):
        tokens = rng.randrange(200, 4000)
        req = Request(f"t{i}", "c" * (tokens * 4), tokens)
        view, ttft = random_case(rng, f"w{i % 4}", tokens, req.text)
        p.on_dispatch(req, view, float(i))
        p.on_first_token(req.id, view.id, float(i) + ttft, ttft)
        p.on_finish(
            req.id, view.id, float(i) + 1.0, True, ttft, 1.0, prompt_chars=len(req.text), prompt_tokens=tokens
        )


def test_falls_back_to_the_heuristic_while_cold() -> None:
    p = policy()
    req = Request("r", "x" * 400, 100)
    views = [WorkerView("a", 2, 0, 0.0, 0), WorkerView("b", 2, 0, 0.0, 300), WorkerView("c", 0, 0, 0.0, 0)]
    assert p.choose(req, views, 0.0) == "b"  # best prefix match that is not overloaded
    assert p.last_decision == "cold"
    views = [WorkerView("a", 20, 0, 0.0, 400), WorkerView("b", 1, 0, 0.0, 0)]
    assert p.choose(req, views, 0.0) == "b"  # imbalance (20 - 1 > 8): least loaded
    views = [WorkerView("a", 6, 0, 0.0, 400), WorkerView("b", 0, 0, 0.0, 0), WorkerView("c", 0, 0, 0.0, 0)]
    assert p.choose(req, views, 0.0) in {"b", "c"}  # the match is overloaded (6 > mean + std)


def test_training_runs_in_bounded_increments_never_inside_choose() -> None:
    p = policy(
        min_samples=200, retrain_every=200, fifo_size=400, replay_size=100, steps_per_call=2, epochs=10
    )
    rng = random.Random(0)
    teach(p, 200, rng)
    assert p.training and p.model is None
    steps_before = p.training_steps_left
    req = Request("r", "x" * 400, 100)
    p.choose(req, [WorkerView("a", 0, 0, 0.0, 0)], 0.0)
    assert p.training_steps_left == steps_before  # choose does no training work
    p.on_finish("unknown", "a", 0.0, True, None, 0.1, prompt_chars=1)
    assert p.training_steps_left == steps_before - 2  # one lifecycle call: at most steps_per_call steps
    p.train_until_ready()
    assert p.model is not None and p.rounds_completed == 1


def test_learns_a_synthetic_ttft_function_and_routes_by_it() -> None:
    p = policy(min_samples=1000, epsilon=0.0, epochs=10, lr=3e-3, tie_margin=0.0)
    rng = random.Random(1)
    teach(p, 1000, rng)
    p.train_until_ready()
    assert p.model is not None
    # prediction quality on fresh samples
    feats, truth = [], []
    for _ in range(400):
        tokens = rng.randrange(200, 4000)
        req = Request("q", "c" * (tokens * 4), tokens)
        view, ttft = random_case(rng, "w", tokens, req.text)
        feats.append(p.features(req, view))
        truth.append(ttft)
    pred = p.predict(np.stack(feats))
    truth_arr = np.array(truth)
    r2 = 1.0 - float(np.sum((pred - truth_arr) ** 2) / np.sum((truth_arr - truth_arr.mean()) ** 2))
    assert r2 > 0.9
    # routing: picks the truly fastest of four candidates (or one within 10% of it) most of the time
    good = 0
    for k in range(100):
        tokens = rng.randrange(200, 4000)
        req = Request(f"d{k}", "c" * (tokens * 4), tokens)
        cases = [random_case(rng, f"w{i}", tokens, req.text) for i in range(4)]
        chosen = p.choose(req, [v for v, _ in cases], 0.0)
        assert p.last_decision in {"model", "ood"}
        best = min(t for _, t in cases)
        chosen_t = next(t for v, t in cases if v.id == chosen)
        good += chosen_t <= 1.1 * best + 1e-9
    assert good >= 85


def test_out_of_range_features_fall_back() -> None:
    p = policy(min_samples=300, epsilon=0.0)
    teach(p, 300, random.Random(2))
    p.train_until_ready()
    req = Request("r", "x" * 4000, 1000)
    views = [WorkerView("a", 500, 0, 0.0, 0), WorkerView("b", 3, 0, 0.0, 0)]  # 500 in flight: never seen
    assert p.choose(req, views, 0.0) == "b"
    assert p.last_decision == "ood"


def test_epsilon_greedy_explores() -> None:
    p = policy(min_samples=300, epsilon=1.0)
    teach(p, 300, random.Random(3))
    p.train_until_ready()
    req = Request("r", "c" * 4000, 1000)
    views = [WorkerView(f"w{i}", 3, 100, 0.0, 0) for i in range(3)]
    picks = {p.choose(req, views, 0.0) for _ in range(60)}
    assert p.last_decision == "explore" and picks == {"w0", "w1", "w2"}


def test_buffers_are_bounded_fifo_plus_replay() -> None:
    p = policy(min_samples=10_000, fifo_size=50, replay_size=20)
    teach(p, 500, random.Random(4))
    assert len(p.fifo) == 50 and len(p.replay) == 20 and p.samples_seen == 500


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="retrain_every"):
        make_policy("lodestar", retrain_every=0)
    with pytest.raises(ValueError, match="epsilon"):
        make_policy("lodestar", epsilon=2.0)
