"""ClusterState and DecayedLoad: seed 004's queue load (decay by 31/32 per 20 ms, release on finish)."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
from kvroute.router import Request
from kvroute.router.state import CharsPerTokenEstimator, ClusterState, DecayedLoad, make_view
from kvroute.router.types import WorkerView

GAMMA = 31 / 32


def test_load_decays_by_31_32_per_20ms_tick_from_elapsed_time() -> None:
    load = DecayedLoad()
    load.add(1.0, now=0.0)
    assert load.value(0.0199) == 1.0  # no tick boundary crossed yet
    assert load.value(0.02) == pytest.approx(GAMMA)
    assert load.value(0.2) == pytest.approx(GAMMA**10)
    assert load.value(2.0) == pytest.approx(GAMMA**100)
    load.add(0.5, now=0.1)  # state advances to tick 5
    assert load.value(0.1) == pytest.approx(GAMMA**5 + 0.5)


def test_release_removes_exactly_the_decayed_remainder() -> None:
    load = DecayedLoad()
    t1 = load.add(2.0, now=0.0)
    t2 = load.add(1.0, now=0.05)
    released = load.release(2.0, t1, now=0.1)
    assert released == pytest.approx(2.0 * GAMMA**5)
    assert load.value(0.1) == pytest.approx(1.0 * GAMMA**3)  # only the second contribution is left
    load.release(1.0, t2, now=0.3)
    assert load.value(0.3) == pytest.approx(0.0, abs=1e-12)


def test_decay_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="decay factor"):
        DecayedLoad(factor=1.5)
    with pytest.raises(ValueError, match="interval"):
        DecayedLoad(interval_s=0.0)


def _view(state: ClusterState, wid: str, now: float = 0.0) -> WorkerView:
    return state.view(wid, now)


def test_cluster_state_counts_and_releases_everything() -> None:
    state = ClusterState()
    state.add_worker("a")
    state.add_worker("b")
    reqs = [Request(f"r{i}", "x" * 10, 100) for i in range(6)]
    for i, r in enumerate(reqs):
        state.dispatch(
            r, _view(state, "a" if i % 2 else "b"), now=0.01 * i, service_s=0.1 * (i + 1), queued_tokens=50
        )
    snap = state.snapshot(0.06)
    assert snap["a"]["in_flight"] == 3 and snap["b"]["in_flight"] == 3
    assert snap["a"]["queued_prefill_tokens"] == 150
    assert snap["a"]["load"] > 0
    state.first_token("r1", 0.07)
    state.first_token("r1", 0.08)  # second report is a no-op
    assert state.snapshot(0.08)["a"]["queued_prefill_tokens"] == 100
    for i, r in enumerate(reqs):
        assert state.finish(r.id, now=0.5 + 0.013 * i, ok=i != 3) is not None
        assert state.finish(r.id, now=0.6, ok=True) is None  # idempotent
    snap = state.snapshot(1.0)
    for wid in ("a", "b"):
        assert snap[wid]["in_flight"] == 0
        assert snap[wid]["queued_prefill_tokens"] == 0
        assert snap[wid]["load"] == 0.0
        assert snap[wid]["requests"] == 3
    assert snap["a"]["errors"] == 1 and snap["b"]["errors"] == 0
    assert state.in_flight_ids() == []


def test_partial_release_matches_the_sum_of_remaining_contributions() -> None:
    state = ClusterState()
    state.add_worker("a")
    state.dispatch(Request("r1", "", 1), _view(state, "a"), 0.0, 1.0, 0)
    state.dispatch(Request("r2", "", 1), _view(state, "a", 0.04), 0.04, 0.5, 0)
    state.finish("r1", 0.1, True)
    # what is left is r2's contribution, decayed over the 3 ticks since it was added at tick 2
    assert state.view("a", 0.1).load == pytest.approx(0.5 * GAMMA**3)


def test_duplicate_dispatch_and_unknown_workers_are_rejected() -> None:
    state = ClusterState()
    state.add_worker("a")
    with pytest.raises(ValueError, match="already registered"):
        state.add_worker("a")
    state.dispatch(Request("r", "", 1), _view(state, "a"), 0.0, 0.1, 0)
    with pytest.raises(ValueError, match="already in flight"):
        state.dispatch(Request("r", "", 1), _view(state, "a"), 0.0, 0.1, 0)
    with pytest.raises(ValueError, match="unknown worker"):
        state.remove_worker("zz")
    with pytest.raises(TypeError, match="number"):
        state.update_metrics("a", {"kv": "high"})  # type: ignore[dict-item]


def test_worker_removed_and_readded_does_not_absorb_old_releases() -> None:
    state = ClusterState()
    state.add_worker("a")
    state.dispatch(Request("old", "", 10), _view(state, "a"), 0.0, 1.0, 10)
    state.remove_worker("a")
    state.add_worker("a")
    state.dispatch(Request("new", "", 10), _view(state, "a"), 0.0, 1.0, 10)
    state.finish("old", 0.1, True)
    snap = state.snapshot(0.1)["a"]
    assert snap["in_flight"] == 1 and snap["queued_prefill_tokens"] == 10 and snap["load"] > 0


def test_make_view_equals_the_dataclass_constructor_and_is_frozen() -> None:
    metrics = MappingProxyType({"kv_cache_usage": 0.5})
    fast = make_view("w", 1, 2, 0.5, 3, metrics, 4)
    assert fast == WorkerView("w", 1, 2, 0.5, 3, metrics, 4)
    with pytest.raises(AttributeError):
        fast.in_flight = 9  # type: ignore[misc]


def test_chars_per_token_ratio_is_learned() -> None:
    est = CharsPerTokenEstimator(prior=4.0)
    assert est.ratio == 4.0
    for _ in range(50):
        est.observe(600, 100)
    assert est.ratio == pytest.approx(6.0)
    est.observe(0, 10)  # ignored
    assert est.tokens(60) == 10
    assert math.isclose(est.ratio, 6.0)


def test_batched_views_equal_single_views() -> None:
    state = ClusterState()
    for w in ("a", "b", "c"):
        state.add_worker(w)
    state.update_metrics("b", {"token_usage": 0.4})
    for i, w in enumerate(["a", "b", "a", "c", "a"]):
        state.dispatch(Request(f"r{i}", "x", 10), state.view(w, 0.013 * i), 0.013 * i, 0.3 + i, 7 * i)
    state.first_token("r1", 0.2)
    matches = {"a": 12, "c": 3}
    for now in (0.05, 0.2, 1.7):
        batched = state.views(["a", "b", "c"], now, matches, lambda w: len(w) * 5)
        single = [state.view(w, now, matches.get(w, 0), len(w) * 5) for w in ("a", "b", "c")]
        assert batched == single
