"""`kvroute launch` with simulated workers, end to end through the router, on this machine."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from test_launch_helpers import Launch, assert_no_leftovers, get_json, post_json, tagged_processes


def worker_pids(launch_id: str) -> dict[int, int]:
    """port -> pid of the launch's sim workers."""
    out = {}
    for pid in tagged_processes(launch_id):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except FileNotFoundError:
            continue
        if "worker" in argv and "--port" in argv:
            out[int(argv[argv.index("--port") + 1])] = pid
    return out


def test_local_launch_four_sim_workers(tmp_path: Path) -> None:
    launch = Launch(["--workers", "4", "--policy", "lbgr", "--eviction", "rlt"], tmp_path / "logs")
    try:
        launch.wait_ready(4)
        out = launch.output()
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)", out)
        assert f"router:   {launch.url}" in out
        status, models = get_json(launch.url + "/v1/models")
        assert status == 200
        model = models["data"][0]["id"]

        # 4 groups sharing long prefixes, 6 requests each, 8 at a time, all through the router
        prompts = [
            f"group {g} " + "shared context words " * 60 + f"question {q}" for g in range(4) for q in range(6)
        ]
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(
                    lambda p: post_json(
                        launch.url + "/v1/completions", {"model": model, "prompt": p, "max_tokens": 4}
                    ),
                    prompts,
                )
            )
        assert [s for s, _ in results] == [200] * len(prompts)
        assert all(
            body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 4 for _, body in results
        )

        status, listing = get_json(launch.url + "/workers")
        assert status == 200
        workers = listing["workers"]
        assert len(workers) == 4 and all(w["healthy"] for w in workers)
        assert sum(w["requests"] for w in workers) == len(prompts)
        # the printed table lists every worker the router knows, and each has its own log file
        ports = {int(w["url"].rsplit(":", 1)[1]) for w in workers}
        assert ports <= {int(p) for p in urls}
        for i in range(4):
            assert "listening" in (tmp_path / "logs" / f"worker-{i}.log").read_text().lower()
        assert (tmp_path / "logs" / "router.log").stat().st_size > 0

        # a worker process that dies is restarted on its port and readmitted by the router
        pids = worker_pids(launch.launch_id)
        assert set(pids) == ports
        port, victim = sorted(pids.items())[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = worker_pids(launch.launch_id).get(port)
            _, listing = get_json(launch.url + "/workers")
            healthy = {w["url"] for w in (listing or {}).get("workers", []) if w["healthy"]}
            if new not in (None, victim) and f"http://127.0.0.1:{port}" in healthy and len(healthy) == 4:
                break
            time.sleep(0.25)
        else:
            raise AssertionError(f"worker on port {port} not restarted and readmitted:\n{launch.output()}")
        assert "restarted" in launch.output()
        status, _ = post_json(
            launch.url + "/v1/completions", {"model": model, "prompt": "after", "max_tokens": 2}
        )
        assert status == 200
    finally:
        rc = launch.stop(signal.SIGINT)  # Ctrl-C
    assert rc == 0, launch.output()
    assert "stopped." in launch.output()
    assert_no_leftovers(launch.launch_id)


def test_sigterm_while_starting_leaves_nothing(tmp_path: Path) -> None:
    # SIGTERM arrives while the workers are still coming up: everything started so far is stopped
    launch = Launch(["--workers", "3"], tmp_path / "logs")
    deadline = time.monotonic() + 60
    while len(worker_pids(launch.launch_id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    rc = launch.stop(signal.SIGTERM)
    assert rc != 0 or "stopped." in launch.output()
    assert "stopped." in launch.output(), launch.output()
    assert_no_leftovers(launch.launch_id)


def test_launch_with_bench_reports_and_shuts_down(tmp_path: Path) -> None:
    report = tmp_path / "serve.json"
    launch = Launch(
        [
            "--workers",
            "2",
            "--policy",
            "cache_aware",
            "--eviction",
            "rlt",
            "--bench",
            "gsp",
            "--num",
            "12",
            "--rate",
            "40",
            f"--bench-arg=--output={report}",
            "--bench-arg=--no-progress",
        ],
        tmp_path / "logs",
    )
    rc = launch.proc.wait(timeout=240)
    launch.stop()
    assert rc == 0, launch.output()
    rows = json.loads(report.read_text())
    assert len(rows) == 1
    row = rows[0]
    assert (row["workload"], row["policy"], row["eviction"]) == ("gsp", "cache_aware", "rlt")
    assert row["p50_ttft_ms"] > 0 and row["throughput_rps"] > 0
    assert "P50 TTFT" in launch.output() and "stopped." in launch.output()  # the report is printed
    assert_no_leftovers(launch.launch_id)


def test_worker_that_cannot_start_fails_the_launch_fast(tmp_path: Path) -> None:
    # an engine that exits at once: the launch fails naming the worker and its log, and stops the rest
    launch = Launch(["--workers", "2", "--engine-python", "/bin/false"], tmp_path / "logs")
    rc = launch.proc.wait(timeout=60)
    launch.stop()
    assert rc == 1
    out = launch.output()
    assert "launch failed" in out and "exited with code 1" in out and "worker-0.log" in out.replace("\n", "")
    assert_no_leftovers(launch.launch_id)
