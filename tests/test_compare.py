"""``kvroute sim`` / ``kvroute compare`` and the shared report + metrics functions."""

from __future__ import annotations

import csv
import json
import math

import pytest
from kvroute.bench import compare, sim_cli
from kvroute.bench.metrics import hit_rate, imbalance, percentile, summarize
from kvroute.bench.report import JSON_KEYS, plot_bars, plot_vs_rate, run_row, to_json, write_csv
from kvroute.launch.cli import main as kvroute

TINY_GSP = ["--option", "groups=6", "--option", "queries_per_group=3", "--option", "lengths=128,256"]
TINY_DOC = ["--option", "documents=3"]
TINY_MT = [
    "--option",
    "clients=3",
    "--option",
    "user_tokens=32",
    "--option",
    "rounds=2",
    "--option",
    "text=synthetic",
]


def test_metrics_known_answers() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)
    records = [
        {"arrival_s": 0.0, "ttft_s": 1.0, "e2e_s": 2.0, "prompt_tokens": 100, "cached_tokens": 50, "worker": "a"},
        {"arrival_s": 1.0, "ttft_s": 3.0, "e2e_s": 3.0, "prompt_tokens": 300, "cached_tokens": 0, "worker": "a"},
        {"arrival_s": 2.0, "ttft_s": 9.0, "e2e_s": 9.0, "prompt_tokens": 100, "cached_tokens": 100, "worker": "b",
         "ok": False},
    ]  # fmt: skip
    assert hit_rate(records) == 50 / 400  # the failed request does not count
    s = summarize(records, workers=["a", "b", "c"])
    assert s["p50_ttft_ms"] == 2000.0 and s["p50_e2e_ms"] == 2500.0
    assert s["throughput_rps"] == 2 / 4.0  # 2 ok requests from t=0 to the last finish at t=4
    assert s["load_imbalance"] == 2 / (2 / 3)  # a: 2, b: 0 (failed), c: 0
    assert s["errors"] == 1 and s["requests"] == 3
    assert imbalance([1, 1, 1]) == 1.0 and math.isnan(imbalance([]))


def test_report_rows_csv_json_and_plots(tmp_path) -> None:
    records = [{"arrival_s": float(i), "ttft_s": 0.1 * (i + 1), "e2e_s": 0.2 * (i + 1), "prompt_tokens": 10,
                "cached_tokens": i, "worker": "w0"} for i in range(5)]  # fmt: skip
    rows = [
        run_row(records, workload="gsp", policy=p, eviction=e, rate=r) for p in ("lbgr", "random") for e in ("lru", "rlt")
        for r in (8.0, 12.0)
    ]  # fmt: skip
    assert set(JSON_KEYS) <= set(rows[0])
    assert rows[0]["hit_rate"] == pytest.approx(10 / 50)
    parsed = json.loads(to_json(rows))
    assert len(parsed) == 8 and parsed[0]["policy"] == "lbgr"
    path = write_csv(rows, tmp_path / "out.csv")
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert list(read[0])[: len(JSON_KEYS)] == list(JSON_KEYS) and len(read) == 8
    pngs = plot_bars(rows, tmp_path / "plots") + plot_vs_rate(rows, tmp_path / "plots")
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    with pytest.raises(ValueError):
        run_row([], workload="gsp", policy="x", eviction="lru")


def test_compare_cli_runs_the_matrix_and_writes_every_output(tmp_path, capsys) -> None:
    out_json, out_csv, plots = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "plots"
    code = compare.main(
        ["--workloads", "gsp,longdoc", "--policies", "round_robin,cache_aware:preset=sglang-0.1.4",
         "--evictions", "lru,rlt", "--rates", "20,40", "--workers", "2", "--kv-capacity", "20000",
         "--json", str(out_json), "--csv", str(out_csv), "--plot-dir", str(plots), *TINY_GSP, *TINY_DOC]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out_json.read_text())
    assert len(rows) == 2 * 2 * 2 * 2
    assert {(r["workload"], r["policy"], r["eviction"], r["rate"]) for r in rows} == {
        (w, p, e, r)
        for w in ("gsp", "longdoc")
        for p in ("round_robin", "cache_aware:preset=sglang-0.1.4")
        for e in ("lru", "rlt")
        for r in (20.0, 40.0)
    }
    for r in rows:
        assert set(JSON_KEYS) <= set(r)
        assert r["p50_ttft_ms"] > 0 and 0 <= r["hit_rate"] < 1 and r["throughput_rps"] > 0
    assert len(list(csv.DictReader(out_csv.open()))) == 16
    names = {p.name for p in plots.glob("*.png")}
    assert "p50_ttft_ms.png" in names and "gsp_p50_ttft_ms_vs_rate.png" in names
    assert "P50 TTFT" in capsys.readouterr().out


def test_compare_json_to_stdout_is_pure_json(capsys) -> None:
    code = kvroute(["compare", "--workloads", "multiturn", "--policies", "lbgr", "--evictions", "rlt",
                    "--workers", "2", "--json", "-", *TINY_MT])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["workload"] == "multiturn" and rows[0]["policy"] == "lbgr"


def test_compare_runs_rlt_leaf(capsys) -> None:
    code = kvroute(["compare", "--workloads", "gsp", "--policies", "cache_aware", "--evictions", "rlt,rlt-leaf",
                    "--workers", "2", "--kv-capacity", "1000", "--json", "-", *TINY_GSP])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["eviction"] for r in rows] == ["rlt", "rlt-leaf"]
    assert all(r["p50_ttft_ms"] > 0 and 0 <= r["hit_rate"] < 1 for r in rows)


def test_sim_cli_one_run_with_records(tmp_path, capsys) -> None:
    records = tmp_path / "records.csv"
    code = kvroute(["sim", "--workload", "gsp", "--policy", "cache_aware", "--eviction", "lru", "--workers", "2",
                    "--records", str(records), "--json", "-", *TINY_GSP])  # fmt: skip
    assert code == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["policy"] == "cache_aware" and row["requests"] == 18
    rows = list(csv.DictReader(records.open()))
    assert len(rows) == 18 and {r["worker"] for r in rows} <= {"w0", "w1"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workloads", "nope"], "unknown workload"),
        (["--policies", "telepathy"], "unknown policy"),
        (["--policies", "cache_aware:preset=sglang-9"], "preset"),
        (["--evictions", "fifo"], "unknown eviction"),
        (["--evictions", "lru,rlt_leaf"], "choose from lru, rlt, rlt-leaf"),
        (["--rates", "8,fast"], "--rates"),
        (["--rates", "0"], "rates must be > 0"),
        (["--workers", "0"], "--workers"),
        (["--preset", "tpu-v9"], "unknown cost-model preset"),
        (["--option", "grups=3"], "unknown workload option"),
        (["--option", "noequals"], "KEY=VALUE"),
        (["--workloads", "gsp", "--option", "prefix_ratio=2"], "prefix_ratio"),
    ],
)
def test_compare_bad_input_exits_2_with_a_message(argv, message, capsys) -> None:
    assert compare.main(argv) == 2
    assert message in capsys.readouterr().err


def test_sim_bad_input_exits_2(capsys) -> None:
    assert sim_cli.main(["--workload", "gsp", "--rate", "-1"]) == 2
    assert "--rate" in capsys.readouterr().err
    assert sim_cli.main(["--policy", "lbgr:nonsense=1"]) == 2
    assert "lbgr" in capsys.readouterr().err
