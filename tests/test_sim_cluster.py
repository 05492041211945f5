"""kvroute.sim.cluster.ClusterSim: the event loop around the live router's Router and EngineModels."""

from __future__ import annotations

import math

import pytest
from kvroute.bench.workloads import make_workload
from kvroute.router.policies import POLICY_NAMES
from kvroute.sim.cluster import ClusterSim
from kvroute.sim.engine import EngineModel

SMALL_GSP = {"groups": 12, "queries_per_group": 6, "lengths": (256, 512, 1024), "rate": 40.0, "seed": 2}


def _engine_alone(workload, **engine_options) -> dict[str, tuple[float, float, int]]:
    """The same arrivals fed to one EngineModel by a loop written independently of ClusterSim.

    At equal times a step ending is handled before an arrival (the cluster's documented order).
    """
    engine = EngineModel(**engine_options)
    arrival = {r.id: r.arrival_s for r in workload}
    out: dict[str, list] = {}
    step = None
    i = 0
    while i < len(workload) or step is not None:
        next_arrival = workload[i].arrival_s if i < len(workload) else math.inf
        if step is not None and step.end <= next_arrival:
            t = step.end
            for rid in step.first_tokens:
                out[rid] = [t - arrival[rid], math.nan, 0]
            for fin in step.finished:
                out[fin.req_id][1] = t - arrival[fin.req_id]
                out[fin.req_id][2] = fin.cached_tokens
            step = engine.step(t) if engine.has_work() else None
        else:
            req = workload[i]
            i += 1
            engine.submit(req.id, req.tokens, req.max_tokens, req.arrival_s, output=req.meta.get("output"))
            if step is None:
                step = engine.step(req.arrival_s)
        if step is not None and step.duration == 0:
            step = None
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("eviction", ["lru", "rlt", "rlt-leaf"])
def test_one_worker_cluster_equals_that_worker_alone(policy: str, eviction: str) -> None:
    workload = make_workload("gsp", **SMALL_GSP)
    options = {"kv_capacity_tokens": 8000, "eviction": eviction, "max_running": 16, "chunk_budget": 2048}
    result = ClusterSim(policy=policy, workers=1, seed=9, **options).run(workload)
    alone = _engine_alone(workload, seed=9 * 1000, **options)
    got = {r.id: (r.ttft_s, r.e2e_s, r.cached_tokens) for r in result.records}
    assert got == alone
    assert all(r.worker == "w0" for r in result.records)


@pytest.mark.parametrize("policy", ["random", "round_robin", "cache_aware", "lbgr"])
def test_every_request_gets_one_record_and_the_router_ends_empty(policy: str) -> None:
    workload = make_workload("gsp", **SMALL_GSP)
    sim = ClusterSim(policy=policy, workers=3, kv_capacity_tokens=6000, seed=1)
    result = sim.run(workload)
    assert [r.id for r in result.records] == [w.id for w in workload]
    for rec, req in zip(result.records, workload, strict=True):
        assert rec.worker in ("w0", "w1", "w2")
        assert rec.prompt_tokens == len(req.tokens)
        assert rec.output_tokens == req.max_tokens
        assert 0 <= rec.cached_tokens < rec.prompt_tokens
        assert 0 < rec.ttft_s <= rec.e2e_s
    assert sim.router.in_flight() == []
    snap = sim.router.snapshot(result.makespan_s + 100)
    assert all(snap[w]["in_flight"] == 0 and snap[w]["queued_prefill_tokens"] == 0 for w in result.workers)
    stats = result.worker_stats
    assert sum(s["requests"] for s in stats.values()) == len(workload)
    assert sum(s["cached_tokens"] for s in stats.values()) == sum(r.cached_tokens for r in result.records)
    for engine in sim.engines.values():
        assert not engine.has_work() and engine.cache.protected_size == 0
        assert engine.peak_kv_used_tokens <= engine.kv_capacity_tokens


def test_same_seed_same_result() -> None:
    workload = make_workload("gsp", **SMALL_GSP)

    def run(seed: int):
        result = ClusterSim(
            policy="random", workers=3, eviction="rlt", kv_capacity_tokens=5000, seed=seed
        ).run(workload)
        return [(r.worker, r.ttft_s, r.e2e_s, r.cached_tokens) for r in result.records]

    assert run(4) == run(4)
    assert run(4) != run(5)


def test_cache_affinity_raises_the_hit_rate_over_random_routing() -> None:
    # a behavioural check of the wiring: the prefix index is fed, so routing by cache pays off
    workload = make_workload("gsp", **{**SMALL_GSP, "rate": 5.0})

    def hit(policy: str) -> float:
        res = ClusterSim(policy=policy, workers=4, kv_capacity_tokens=4000, seed=3).run(workload)
        return sum(r.cached_tokens for r in res.records) / sum(r.prompt_tokens for r in res.records)

    assert hit("cache_aware") > hit("random") + 0.05


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError):
        ClusterSim(workers=0)
    with pytest.raises(ValueError):
        ClusterSim(workers=["a", "a"])
    with pytest.raises(ValueError):
        ClusterSim(policy="no-such-policy")
    with pytest.raises(ValueError):
        ClusterSim(preset="no-such-preset")
    with pytest.raises(ValueError):
        ClusterSim(eviction="fifo")
    workload = make_workload("gsp", **SMALL_GSP)
    with pytest.raises(ValueError, match="duplicate"):
        ClusterSim(workers=2).run(workload + workload[:1])
