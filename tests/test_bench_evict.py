"""``kvroute bench evict`` and the gsp trace generator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from kvroute.bench import evict
from kvroute.bench.traces import VOCAB, gsp, named_trace
from kvroute.launch.cli import main as cli_main

SMALL = ["--groups", "10", "--queries", "6", "--repeat", "1"]


# ---------------------------------------------------------------------------------------- traces
def test_gsp_round_robin_structure() -> None:
    reqs = gsp(groups=7, queries_per_group=5, prefix_ratio=0.5, output_tokens=4, seed=3)
    assert len(reqs) == 35
    for i, (prompt, output) in enumerate(reqs):
        group = i % 7
        assert len(prompt) == (512, 1024, 2048, 4096, 8192)[group % 5]
        assert len(output) == 4
        assert all(0 <= t < VOCAB for t in prompt + output)
        first = reqs[group][0]  # turn 0 of the same group shares exactly the prefix half
        assert prompt[: len(prompt) // 2] == first[: len(prompt) // 2]
        if i >= 7:
            assert prompt[len(prompt) // 2 :] != first[len(prompt) // 2 :]
    assert gsp(groups=7, queries_per_group=5, seed=3) == reqs
    assert gsp(groups=7, queries_per_group=5, seed=4) != reqs


def test_gsp_random_is_a_permutation_and_ratio_applies() -> None:
    rr = gsp(groups=6, queries_per_group=4, seed=1, lengths=[100], prefix_ratio=0.3)
    rnd = gsp(groups=6, queries_per_group=4, seed=1, lengths=[100], prefix_ratio=0.3, order="random")
    key = lambda r: (tuple(r[0]), tuple(r[1]))  # noqa: E731
    assert Counter(map(key, rr)) == Counter(map(key, rnd))
    assert [key(r) for r in rr] != [key(r) for r in rnd]
    prefixes = Counter(tuple(p[:30]) for p, _ in rr)
    assert len(prefixes) == 6 and set(prefixes.values()) == {4}


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"groups": 0}, ValueError),
        ({"order": "zigzag"}, ValueError),
        ({"prefix_ratio": 1.5}, ValueError),
        ({"lengths": []}, ValueError),
        ({"output_tokens": -1}, ValueError),
        ({"queries_per_group": 2.5}, TypeError),
    ],
)
def test_gsp_rejects_bad_arguments(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        gsp(**kwargs)


def test_named_traces_have_the_issue_sizes() -> None:
    reqs, capacity = named_trace("gsp-rr")
    assert (len(reqs), capacity) == (64 * 32, 190_000)
    first_round = reqs[:64]  # one query per group: 198,400 tokens with the 4 output tokens each
    assert sum(len(p) + len(o) for p, o in first_round) == 198_400
    assert named_trace("gsp-random")[1] == 200_000
    with pytest.raises(ValueError, match="unknown trace"):
        named_trace("gsp-zz")


# ---------------------------------------------------------------------------------------- bench
def test_bench_json_has_every_policy_and_opt_is_best(capsys: pytest.CaptureFixture[str]) -> None:
    assert evict.main([*SMALL, "--trace", "gsp-rr", "--capacity", "6000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["lru", "rlt", "rlt-leaf", "opt", "lru-py"]
    by = {r["policy"]: r for r in rows}
    for r in rows:
        assert {"policy", "hit_rate", "ns_per_evicted_token"} <= set(r)
        assert 0.0 <= r["hit_rate"] <= 0.5 * 5 / 6 + 1e-3  # at most the prefix tokens seen before
        assert r["evicted_tokens"] > 0 and r["ns_per_evicted_token"] > 0
    assert by["lru"]["hit_rate"] == by["lru-py"]["hit_rate"]
    assert by["lru"]["evicted_tokens"] == by["lru-py"]["evicted_tokens"]
    assert by["opt"]["hit_rate"] >= max(by[p]["hit_rate"] for p in ("lru", "rlt", "rlt-leaf"))


def test_bench_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "evict.png"
    argv = [*SMALL, "--repeat", "2", "--policies", "lru", "rlt", "--capacity", "8000", "--plot", str(png)]
    assert evict.main(argv) == 0
    out = capsys.readouterr().out
    assert "gsp-rr" in out and "gsp-random" in out and "rlt" in out
    assert png.stat().st_size > 1000


def test_bench_sweep_plots_hit_rate_against_capacity(tmp_path: Path, capsys) -> None:
    png = tmp_path / "sweep.png"
    argv = [
        *SMALL,
        "--trace",
        "gsp-random",
        "--policies",
        "lru",
        "opt",
        "--sweep",
        "--sweep-range",
        "4000:12000:4000",
        "--json",
        "--plot",
        str(png),
    ]
    assert evict.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted({r["capacity"] for r in rows}) == [4000, 8000, 12000]
    opt = {r["capacity"]: r["hit_rate"] for r in rows if r["policy"] == "opt"}
    assert opt[4000] <= opt[8000] <= opt[12000]  # Belady's hits grow with the cache
    assert png.stat().st_size > 1000


def test_bench_latency_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "latency.png"
    argv = [
        "--plot",
        str(png),
        "--latency",
        "--latency-capacity",
        "20000",
        "--latency-evictions",
        "300",
        "--policies",
        "lru",
        "rlt",
        "rlt-leaf",
        "--json",
    ]
    assert evict.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 1000
    assert [r["policy"] for r in rows] == ["lru", "rlt", "rlt-leaf"]
    for r in rows:
        assert r["evictions"] == 300 and r["nodes_before"] > 1000
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--capacity", "-5"],
        ["--capacity", "abc"],
        ["--policies", "fifo"],
        ["--policies", "rlt_leaf"],
        ["--trace", "nope"],
        ["--sweep", "--capacity", "1000"],
        ["--sweep-range", "10:5:1"],
        ["--plot", "out.jpg"],
        ["--prefix-ratio", "2"],
    ],
)
def test_bench_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        evict.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_dispatches_bench_evict(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "evict", "--help"])
    assert exc.value.code == 0
    assert "--sweep" in capsys.readouterr().out
