"""kvroute bench serve against live sim workers (in-process, and the real CLIs as subprocesses)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvroute.bench.report import JSON_KEYS
from kvroute.bench.serve import ServeConfig, main, run_serve
from test_http_support import cluster, run

SMALL_GSP = {"groups": 4, "queries_per_group": 4, "lengths": [64, 128], "prefix_ratio": 0.5}


def test_serve_through_the_router_reports_the_compare_keys_and_scraped_hit_rate() -> None:
    async def body() -> None:
        async with cluster(2, policy="cache_aware", admin_token="t") as c:
            cfg = ServeConfig(
                url=c.router_url,
                workload="gsp",
                rate=40.0,
                workload_options=dict(SMALL_GSP),
                admin_token="t",
                show_progress=False,
            )
            row, records = await run_serve(cfg)
            assert set(JSON_KEYS) <= set(row)
            assert (row["workload"], row["policy"], row["eviction"]) == ("gsp", "cache_aware", "lru")
            assert row["requests"] == 16 and row["errors"] == 0 and len(records) == 16
            assert row["hit_rate_source"] == "worker_metrics"
            # the workers' counters and the per-request usage describe the same 16 requests
            assert row["hit_rate"] == pytest.approx(row["client_hit_rate"])
            # shared prefixes (half of each prompt, 4 queries per group) hit; how often depends on timing, as
            # the engine inserts a prompt into its cache when the request finishes
            assert 0 < row["hit_rate"] <= 0.375
            assert all(r.ok and 0 < r.ttft_s <= r.e2e_s for r in records)
            assert row["p50_ttft_ms"] <= row["p50_e2e_ms"]
            assert {r.worker for r in records} <= set(c.worker_urls)
            assert row["workers"] == 2
            # every request was served by the engine: prompt tokens add up
            prompt_tokens = sum(r.prompt_tokens for r in records)
            assert prompt_tokens == sum(w.metrics._prompt_total for w in c.workers)

    run(body())


def test_serve_straight_to_a_worker_and_other_endpoints() -> None:
    async def body() -> None:
        async with cluster(1) as c:
            worker = c.worker_urls[0]
            for endpoint in ("chat", "generate"):
                cfg = ServeConfig(
                    url=worker,
                    workload="gsp",
                    rate=50.0,
                    num=6,
                    endpoint=endpoint,
                    workload_options=dict(SMALL_GSP),
                    show_progress=False,
                )
                row, records = await run_serve(cfg)
                assert row["policy"] == "direct" and row["requests"] == 6 and row["errors"] == 0
                assert all(math.isfinite(r.ttft_s) for r in records)
                assert row["hit_rate_source"] == "worker_metrics"

    run(body())


def test_serve_counts_server_errors_instead_of_crashing() -> None:
    async def body() -> None:
        async with cluster(1, kv_tokens=100) as c:  # 128-token prompts do not fit a 100-token context
            cfg = ServeConfig(
                url=c.router_url,
                workload="gsp",
                rate=50.0,
                num=4,
                workload_options={**SMALL_GSP, "lengths": [128]},
                show_progress=False,
            )
            row, records = await run_serve(cfg)
            assert row["errors"] == 4
            assert all(r.status == 400 and "context length" in (r.error or "") for r in records)

    run(body())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server process died"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_cli_end_to_end_with_kvroute_worker_and_kvroute_router(tmp_path: Path) -> None:
    w_port, r_port = _free_port(), _free_port()
    kv = [sys.executable, "-m", "kvroute.launch.cli"]
    procs = [
        subprocess.Popen(
            [
                *kv,
                "worker",
                "--engine",
                "sim",
                "--port",
                str(w_port),
                "--eviction",
                "rlt",
                "--kv-tokens",
                "20000",
                "--log-level",
                "WARNING",
            ]
        )
    ]
    try:
        procs.append(
            subprocess.Popen(
                [
                    *kv,
                    "router",
                    "--worker-urls",
                    f"http://127.0.0.1:{w_port}",
                    "--policy",
                    "lbgr",
                    "--port",
                    str(r_port),
                    "--admin-token",
                    "tok",
                    "--log-level",
                    "WARNING",
                ]
            )
        )
        _wait_http(f"http://127.0.0.1:{w_port}/health", procs[0])
        _wait_http(f"http://127.0.0.1:{r_port}/health", procs[1])
        out = tmp_path / "serve.json"
        argv = [
            "--url",
            f"http://127.0.0.1:{r_port}",
            "--admin-token",
            "tok",
            "--workload",
            "gsp",
            "--rate",
            "40",
            "--num",
            "8",
            "--no-progress",
            "--output",
            str(out),
            "--csv",
            str(tmp_path / "serve.csv"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
        for k, v in SMALL_GSP.items():
            argv += ["--workload-option", f"{k}={json.dumps(v)}"]
        assert main(argv) == 0
        rows = json.loads(out.read_text())
        assert len(rows) == 1 and set(JSON_KEYS) <= set(rows[0])
        assert (rows[0]["policy"], rows[0]["eviction"], rows[0]["requests"]) == ("lbgr", "rlt", 8)
        assert (tmp_path / "serve.csv").exists() and any((tmp_path / "plots").glob("*.png"))
        # without the admin token the router's worker list is refused: a clear message, not a traceback
        with pytest.raises(SystemExit, match="admin-token"):
            main(
                [
                    "--url",
                    f"http://127.0.0.1:{r_port}",
                    "--num",
                    "1",
                    "--no-progress",
                    "--output",
                    str(tmp_path / "x.json"),
                ]
            )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "http://x:1", "--rate", "0"],
        ["--url", "http://x:1", "--timeout", "-1"],
        ["--url", "http://x:1", "--num", "0"],
        ["--url", "not a url"],
    ],
)
def test_cli_rejects_bad_arguments_with_exit_code_2(argv: list[str]) -> None:
    assert main([*argv, "--no-progress"]) == 2
