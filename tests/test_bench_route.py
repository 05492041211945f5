"""kvroute bench route: the command runs, reports the documented keys, rejects bad input with exit 2."""

from __future__ import annotations

import json

import pytest
from kvroute.bench import route
from kvroute.cython_ext.prefix_index import PrefixIndex


def test_quick_json_run_reports_every_requested_policy(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "route.json"
    png = tmp_path / "route.png"
    rc = route.main(
        [
            "--quick",
            "--json",
            "--no-memory",
            "--policies",
            "lbgr,cache_aware,random",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    payload = json.loads(capsys.readouterr().out)
    rows = payload["results"]
    assert {(r["policy"], r["workers"]) for r in rows} == {
        (p, w) for p in ("lbgr", "cache_aware", "random") for w in (4, 16)
    }
    for r in rows:
        assert {"policy", "workers", "prompt_chars", "p50_us", "p99_us"} <= set(r)
        assert 0 < r["p50_us"] <= r["p99_us"]
        assert r["prompt_chars"] == 1000 and r["index_prompts"] == 3000
        assert r["index_chars"] >= 3000 * 500  # every prompt's unique half is still there: nothing trimmed
        assert r["index_chars"] / 2**20 <= r["index_mb"] < 64 * r["index_chars"] / 2**20
    assert json.loads(out.read_text()) == payload
    assert png.stat().st_size > 1000


def test_memory_measurement_counts_what_the_index_holds() -> None:
    m = route.measure_memory(
        max_chars=200_000, prompt_chars=1000, n_prompts=600, groups=20, n_workers=4, seed=1
    )
    assert 150_000 < m.stored_chars <= 200_000
    # at least the characters themselves (1 byte each for ASCII text), and not absurdly more
    assert 1.0 <= m.tracemalloc_bytes_per_char < 64.0


def test_prompt_source_shares_prefixes_within_groups() -> None:
    src = route.PromptSource(1000, groups=1, seed=3)
    a, b = src.prompt(), src.prompt()
    assert len(a) == len(b) == 1000
    assert a[:500] == b[:500] and a[500:] != b[500:]
    ix = PrefixIndex(10_000)
    ix.insert(a, "w", 0.0)
    assert ix.match(b)["w"] >= 500


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "nope"],
        ["--workers", "x"],
        ["--workers", "0"],
        ["--prompt-chars", ""],
        ["--decisions", "0"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert route.main(argv) == 2
    assert "kvroute bench route" in capsys.readouterr().err
