"""``python -m kvroute.bench.engine_evict_vllm``: its JSON contract (read by kvroute.bench.engine_evict) and
its argument errors."""

from __future__ import annotations

import json

import pytest


def test_json_rows_for_both_policies(vllm_available: None, capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.bench.engine_evict_vllm import main

    args = ["--groups", "6", "--queries", "4", "--pool-tokens", "20000", "--repeats", "2", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["policy"] for r in rows] == ["lru", "rlt"]
    for r in rows:
        assert r["engine"] == "vllm" and r["requests"] == 24 and r["failed"] == 0 and r["repeats"] == 2
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["queries"] > 0
        assert r["evict_calls"] > 0 and r["evicted_blocks"] >= r["evict_calls"]
        assert r["evict_us_mean"] > 0 and r["evict_cpu_us_mean"] > 0


def test_requests_longer_than_the_pool_fail_like_vllm_rejects_them(
    vllm_available: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvroute.bench.engine_evict_vllm import main

    # 5 groups of 512..8192 tokens through a 3000-token pool: the 4096 and 8192 ones cannot be served
    assert main(["--groups", "5", "--queries", "2", "--pool-tokens", "3000", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["failed"] for r in rows] == [4, 4]


@pytest.mark.parametrize(
    "bad",
    [["--policies", "fifo"], ["--repeats", "0"], ["--block-size", "0"], ["--groups", "0"]],
)
def test_bad_arguments_exit_2(
    vllm_available: None, bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvroute.bench.engine_evict_vllm import main

    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
