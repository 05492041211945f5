"""kvroute.sim.engine.EngineModel: continuous batching over the real RadixCache."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.bench import traces
from kvroute.cache import RadixCache
from kvroute.sim.cost_model import get_preset
from kvroute.sim.engine import EngineModel


def _shared_prefix_prompts(rng: random.Random, n: int, groups: int, length: int) -> list[list[int]]:
    prefixes = [[rng.randrange(32000) for _ in range(length // 2)] for _ in range(groups)]
    return [
        prefixes[rng.randrange(groups)] + [rng.randrange(32000) for _ in range(length // 2)] for _ in range(n)
    ]


def _drain(engine: EngineModel, t: float = 0.0, check=None) -> tuple[float, dict[str, dict]]:
    """Step until idle; returns the end time and per-request events."""
    events: dict[str, dict] = {}
    while engine.has_work():
        res = engine.step(t)
        assert res.duration > 0
        t = res.end
        for rid in res.first_tokens:
            events.setdefault(rid, {})["first"] = t
        for fin in res.finished:
            events.setdefault(fin.req_id, {})["finish"] = t
            events[fin.req_id]["fin"] = fin
        if check is not None:
            check(engine)
    return t, events


@pytest.mark.parametrize("eviction", ["lru", "rlt", "rlt-leaf"])
def test_every_request_finishes_and_every_token_is_accounted_for(eviction: str) -> None:
    rng = random.Random(1)
    prompts = _shared_prefix_prompts(rng, 60, groups=5, length=400)
    engine = EngineModel(kv_capacity_tokens=3000, eviction=eviction, max_running=8, chunk_budget=512, seed=4)
    max_tokens = {f"r{i}": rng.randint(1, 6) for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, max_tokens[f"r{i}"], 0.0)

    def within_capacity(e: EngineModel) -> None:
        assert e.kv_used_tokens <= e.kv_capacity_tokens
        assert e.cache.total_size <= e.kv_capacity_tokens

    _, events = _drain(engine, check=within_capacity)
    assert set(events) == set(max_tokens)
    fins = [ev["fin"] for ev in events.values()]
    assert all(f.output_tokens == max_tokens[f.req_id] == len(f.output) for f in fins)
    assert all(ev["first"] <= ev["finish"] for ev in events.values())
    prompt = sum(len(p) for p in prompts)
    cached = sum(f.cached_tokens for f in fins)
    assert engine.prompt_tokens == prompt and engine.cached_tokens == cached
    assert 0 < cached < prompt  # shared prefixes were reused, and the pool was too small for everything
    assert engine.prefill_tokens_computed == prompt - cached
    assert engine.decode_tokens_computed == sum(m - 1 for m in max_tokens.values())
    assert engine.evicted_tokens > 0
    assert engine.peak_kv_used_tokens <= 3000
    # idle: nothing locked, no private slots left
    assert engine.cache.protected_size == 0
    assert engine.kv_used_tokens == engine.cache.total_size


def test_admission_waits_when_nothing_can_be_freed() -> None:
    # two 600-token prompts cannot share a 1000-slot pool: the second waits for the first to finish
    engine = EngineModel(kv_capacity_tokens=1000, eviction="lru", chunk_budget=4096)
    engine.submit("a", list(range(600)), 4, 0.0)
    engine.submit("b", list(range(1000, 1600)), 4, 0.0)
    res = engine.step(0.0)
    assert res.first_tokens == ["a"] and engine.num_waiting == 1 and engine.num_running == 1
    _, events = _drain(engine, res.end)
    assert events["b"]["first"] > events["a"]["finish"]
    assert events["b"]["fin"].cached_tokens == 0


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    cost = get_preset("l40-llama3.1-8b")
    engine = EngineModel(kv_capacity_tokens=10_000, chunk_budget=1000)
    engine.submit("long", list(range(2500)), 1, 0.0)
    durations = []
    while engine.has_work():
        res = engine.step(sum(durations))
        durations.append(res.duration)
    assert len(durations) == 3  # 1000 + 1000 + 500 prompt tokens
    expect = cost.step_time([(1000, 0)]) + cost.step_time([(1000, 1000)]) + cost.step_time([(500, 2000)])
    assert sum(durations) == pytest.approx(expect)


def test_cached_prefix_is_not_recomputed_and_whole_prompt_keeps_one_token() -> None:
    engine = EngineModel(kv_capacity_tokens=10_000)
    prompt = list(range(300))
    engine.submit("first", prompt, 2, 0.0)
    t, _ = _drain(engine)
    engine.submit("again", prompt, 2, t)
    _, events = _drain(engine, t)
    # the identical prompt is served from cache except its last token (SGLang computes at least one)
    assert events["again"]["fin"].cached_tokens == 299
    assert engine.prefill_tokens_computed == 300 + 1


def test_abort_releases_locks_and_slots() -> None:
    engine = EngineModel(kv_capacity_tokens=5000, chunk_budget=100)
    engine.submit("a", list(range(400)), 3, 0.0)
    engine.submit("b", list(range(400, 800)), 3, 0.0)
    engine.step(0.0)  # "a" admitted and partly prefilled: its 400 + 3 slots are allocated
    assert engine.num_running == 1 and engine.kv_used_tokens == 403
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    assert not engine.has_work()
    assert engine.kv_used_tokens == engine.cache.total_size and engine.cache.protected_size == 0


def test_bad_submissions_are_rejected() -> None:
    engine = EngineModel(kv_capacity_tokens=100)
    with pytest.raises(ValueError, match="more than the pool"):
        engine.submit("big", list(range(98)), 4, 0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit("empty", [], 4, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        engine.submit("neg", [3, -1], 1, 0.0)
    with pytest.raises(TypeError):
        engine.submit("text", "hello", 1, 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        engine.submit("mixed", [1, "a"], 1, 0.0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit("zero", [1, 2], 0, 0.0)
    engine.submit("ok", [1, 2], 1, 0.0)
    with pytest.raises(ValueError, match="already"):
        engine.submit("ok", [1, 2], 1, 0.0)
    with pytest.raises(ValueError, match="output has"):
        engine.submit("short", [1, 2], 3, 0.0, output=[5])
    engine.step(1.0)
    with pytest.raises(ValueError, match="backwards"):
        engine.step(0.5)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'.*rlt-leaf"):
        EngineModel(eviction="fifo")
    with pytest.raises(ValueError, match="unknown eviction policy 'opt'"):  # needs the future: not online
        EngineModel(eviction="opt")
    assert EngineModel(eviction="rlt-leaf").cache.policy == "rlt-leaf"
    with pytest.raises(ValueError):
        EngineModel(max_running=0)
    with pytest.raises(ValueError):
        EngineModel(kv_capacity_tokens=1)


def _replay_engine(trace, eviction: str, capacity: int, seed: int) -> EngineModel:
    engine = EngineModel(kv_capacity_tokens=capacity, eviction=eviction, max_running=1, seed=seed)
    for i, (prompt, output) in enumerate(trace):
        engine.submit(f"r{i}", prompt, len(output), 0.0, output=output)
    _drain(engine)
    return engine


@pytest.mark.parametrize("order", ["round_robin", "random"])
@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_single_worker_reproduces_the_cache_cores_hit_rate(eviction: str, order: str) -> None:
    # requests are small next to the pool (<= 7%), as in the paper's setup (8k prompts, 200k pool)
    trace = traces.gsp(groups=24, queries_per_group=8, lengths=(64, 128, 256), order=order, seed=3)
    capacity = 4000
    cache = RadixCache(capacity, policy=eviction, seed=7)
    hit = total = 0
    for prompt, output in trace:
        hit += cache.match_prefix(prompt)[0]
        total += len(prompt)
        cache.insert(prompt + output)
    engine = _replay_engine(trace, eviction, capacity, seed=7)
    assert engine.prompt_tokens == total
    assert engine.evicted_tokens > 2 * capacity  # the pool really was too small
    if eviction == "lru":  # deterministic policy: the very same hits
        assert engine.cached_tokens == hit
    else:
        # rlt draws its victims at random, and the engine evicts when it allocates (before the new tokens
        # are marked, as SGLang does) where the bare replay evicts inside insert (Algorithm 1 marks each
        # new token first), so a phase can turn over at a slightly different point: same rate within
        # 1 point. (The gap grows with the request's share of the pool: 2.6 points at 17%.)
        assert abs(engine.cached_tokens / total - hit / total) < 0.01


@pytest.mark.parametrize("order", ["round_robin", "random"])
def test_single_worker_reproduces_the_cache_cores_rlt_leaf_hit_rate(order: str) -> None:
    """rlt-leaf as above, but one draw takes a whole leaf, so one seed's hit rate varies by ~1 point
    (sd over seeds on this trace: 0.8-1.1 points, against rlt's 0.1): the mean over 8 seeds agrees
    within 1 point (standard error of the difference ~0.4 points)."""
    trace = traces.gsp(groups=24, queries_per_group=8, lengths=(64, 128, 256), order=order, seed=3)
    capacity, seeds = 4000, range(8)
    total = sum(len(prompt) for prompt, _ in trace)
    bare = engine = 0
    for seed in seeds:
        cache = RadixCache(capacity, policy="rlt-leaf", seed=seed)
        for prompt, output in trace:
            bare += cache.match_prefix(prompt)[0]
            cache.insert(prompt + output)
        replayed = _replay_engine(trace, "rlt-leaf", capacity, seed=seed)
        assert replayed.prompt_tokens == total and replayed.evicted_tokens > 2 * capacity
        engine += replayed.cached_tokens
    assert abs(engine - bare) / (total * len(seeds)) < 0.01


def test_same_seed_same_result_and_rlt_seed_matters() -> None:
    trace = traces.gsp(groups=16, queries_per_group=8, lengths=(256, 512, 1024), order="random", seed=5)

    def run(seed: int) -> list[tuple[int, int]]:
        engine = EngineModel(kv_capacity_tokens=5000, eviction="rlt", max_running=4, seed=seed)
        for i, (prompt, output) in enumerate(trace):
            engine.submit(f"r{i}", prompt, len(output), 0.0, output=output)
        _, events = _drain(engine)
        return [
            (events[f"r{i}"]["fin"].cached_tokens, round(events[f"r{i}"]["finish"], 12))
            for i in range(len(trace))
        ]

    assert run(11) == run(11)
    assert run(11) != run(12)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 120), st.integers(1, 5), st.floats(0, 0.3)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["lru", "rlt", "rlt-leaf"]),
    st.integers(300, 1500),
    st.integers(1, 6),
    st.integers(16, 400),
)
def test_invariants_hold_for_any_arrivals(specs, eviction, capacity, max_running, budget) -> None:
    prefixes = [list(range(g * 1000, g * 1000 + 80)) for g in range(4)]
    engine = EngineModel(
        kv_capacity_tokens=capacity, eviction=eviction, max_running=max_running, chunk_budget=budget, seed=1
    )
    arrivals = []
    t = 0.0
    for i, (group, suffix, max_tokens, gap) in enumerate(specs):
        t += gap
        arrivals.append(
            (
                t,
                f"q{i}",
                prefixes[group] + list(range(50_000 + i * 200, 50_000 + i * 200 + suffix)),
                max_tokens,
            )
        )
    now, k, finished = 0.0, 0, {}
    while k < len(arrivals) or engine.has_work():
        if engine.has_work():
            res = engine.step(now)
            assert engine.kv_used_tokens <= capacity
            now = res.end
            for fin in res.finished:
                finished[fin.req_id] = fin
        else:
            now = max(now, arrivals[k][0])
        while k < len(arrivals) and arrivals[k][0] <= now:
            _, rid, prompt, mt = arrivals[k]
            engine.submit(rid, prompt, mt, now)
            k += 1
    assert set(finished) == {a[1] for a in arrivals}
    assert all(finished[a[1]].output_tokens == a[3] for a in arrivals)
    assert engine.prefill_tokens_computed == sum(len(a[2]) - finished[a[1]].cached_tokens for a in arrivals)
    assert engine.cache.protected_size == 0 and engine.kv_used_tokens == engine.cache.total_size
