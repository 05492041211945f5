"""prefix_hash: consistent hashing of the prefix with bounded loads."""

from __future__ import annotations

import math

from kvroute.router import Request, Router, make_policy

PREFIX = "shared system prompt " * 20


def test_a_prefix_stays_on_one_worker_until_its_bound() -> None:
    r = Router("prefix_hash", [f"w{i}" for i in range(4)])
    home = r.route(Request("h", PREFIX + "home", 10), 0.0)
    r.finish("h", 0.0, True)
    for i in range(10):  # unloaded: every request with the prefix goes home
        assert r.route(Request(f"s{i}", PREFIX + f"s{i}", 10), 0.0) == home
        r.finish(f"s{i}", 0.0, True)
    counts = dict.fromkeys(r.workers, 0)
    spilled = 0
    for i in range(40):  # a burst: home takes requests exactly while under ceil(1.25 (m + 1) / n)
        cap = math.ceil(1.25 * (sum(counts.values()) + 1) / 4)
        w = r.route(Request(str(i), PREFIX + f"q{i}", 10), 0.0)
        if counts[home] < cap:
            assert w == home
        else:
            assert w != home and counts[w] < cap
            spilled += 1
        counts[w] += 1
    assert spilled > 0 and counts[home] == max(counts.values())


def test_mapping_is_stable_across_instances_and_spreads_prefixes() -> None:
    homes = []
    for _ in range(2):
        r = Router("prefix_hash", [f"w{i}" for i in range(4)])
        homes.append([r.route(Request(f"{g}", f"group {g} " * 40, 10), 0.0) for g in range(40)])
    assert homes[0] == homes[1]
    assert len(set(homes[0])) == 4


def test_removing_a_worker_only_moves_its_own_prefixes() -> None:
    p = make_policy("prefix_hash")
    r = Router(p, [f"w{i}" for i in range(5)])
    before = {}
    for g in range(60):
        before[g] = r.route(Request(f"{g}", f"group {g} " * 40, 10), 0.0)
        r.finish(f"{g}", 0.0, True)
    r.remove_worker("w3")
    for g in range(60):
        after = r.route(Request(f"b{g}", f"group {g} " * 40, 10), 1.0)
        r.finish(f"b{g}", 1.0, True)
        if before[g] != "w3":
            assert after == before[g]
