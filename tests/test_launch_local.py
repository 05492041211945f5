"""The local process manager and the engine command lines (no engine needed)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvroute.launch.config import ClusterConfig
from kvroute.launch.engines import engine_command
from kvroute.launch.local import ManagedProcess, free_ports, group_alive, stop_processes


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_free_ports_distinct() -> None:
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(1024 <= p <= 65535 for p in ports)


def test_stop_kills_whole_group_and_logs(tmp_path: Path) -> None:
    # a child that ignores SIGTERM and has a grandchild: both must be gone after stop
    script = "trap '' TERM; sleep 300 & echo grandchild $!; wait"
    proc = ManagedProcess("t", ["sh", "-c", script], log_path=tmp_path / "t.log")
    proc.start()
    assert wait_for(lambda: re.search(r"grandchild (\d+)", proc.log_tail()) is not None)
    grandchild = int(re.search(r"grandchild (\d+)", proc.log_tail()).group(1))  # type: ignore[union-attr]
    assert pid_alive(grandchild)
    t0 = time.monotonic()
    asyncio.run(stop_processes([proc], grace_s=0.5))
    assert time.monotonic() - t0 < 8
    assert not proc.alive() and not pid_alive(grandchild) and not group_alive(proc.pid)
    assert "start: sh -c" in (tmp_path / "t.log").read_text()


def test_child_dies_with_its_launcher(tmp_path: Path) -> None:
    # a parent (like `kvroute launch`) SIGKILLed without cleanup: PDEATHSIG takes its child along
    code = (
        "import sys, time\n"
        "from kvroute.launch.local import ManagedProcess\n"
        "p = ManagedProcess('c', ['sleep', '300'])\n"
        "p.start(); print(p.pid, flush=True); time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    assert pid_alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_for(lambda: not pid_alive(child), 5.0)


def test_pinning_and_restart(tmp_path: Path) -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    proc = ManagedProcess("p", ["sleep", "300"], cpu_core=core, log_path=tmp_path / "p.log")
    proc.start()
    assert os.sched_getaffinity(proc.pid) == {core}
    with pytest.raises(RuntimeError, match="already running"):
        proc.start()
    first = proc.pid
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: not proc.alive())
    proc.start()
    assert proc.pid != first and proc.starts == 2
    asyncio.run(stop_processes([proc], grace_s=2))
    assert not proc.alive()


def test_engine_commands() -> None:
    sim = engine_command(ClusterConfig(eviction="rlt", preset="cpu-smollm2-135m"), 1, 9001, device="cpu")
    assert sim.argv[1:] == [
        "-m",
        "kvroute.launch.cli",
        "worker",
        "--engine",
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--eviction",
        "rlt",
        "--preset",
        "cpu-smollm2-135m",
    ]
    assert sim.cpu_core is None  # the simulator is not pinned

    vcfg = ClusterConfig(
        engine="vllm",
        model="/m",
        eviction="rlt",
        engine_python=sys.executable,
        engine_args=["--max-model-len", "256"],
    )
    v = engine_command(vcfg, 3, 9002, device="cpu", cores=[0, 1])
    assert v.argv == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "9002",
        "--max-model-len",
        "256",
    ]
    assert (
        v.env["KVROUTE_EVICTION"] == "rlt" and v.cpu_core == 1 and v.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    )
    vg = engine_command(vcfg, 3, 9002, device="gpu", gpu="3")
    assert vg.env["CUDA_VISIBLE_DEVICES"] == "3" and vg.cpu_core is None

    s = engine_command(
        ClusterConfig(engine="sglang", model="/m", eviction="lru", engine_python=sys.executable),
        0,
        9003,
        device="gpu",
        gpu="0",
    )
    assert s.argv[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "9003",
        "--radix-eviction-policy",
        "lru",
    ]
    with pytest.raises(ValueError, match="port"):
        engine_command(ClusterConfig(), 0, 0, device="cpu")


def test_rlt_leaf_engine_commands() -> None:
    """sglang: the plugin's rlt with unit=leaf (a policy config given after -- is merged into the one
    flag); sim: the worker runs rlt-leaf itself."""
    sim = engine_command(ClusterConfig(eviction="rlt-leaf"), 0, 9001, device="cpu")
    assert sim.argv[sim.argv.index("--eviction") + 1] == "rlt-leaf"

    def sglang(*engine_args: str) -> list[str]:
        cfg = ClusterConfig(
            engine="sglang",
            model="/m",
            eviction="rlt-leaf",
            engine_python=sys.executable,
            engine_args=list(engine_args),
        )
        return engine_command(cfg, 0, 9003, device="gpu", gpu="0").argv[1:]

    head = ["-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "9003"]
    policy = ["--radix-eviction-policy", "rlt", "--radix-eviction-policy-config"]
    assert sglang() == [*head, *policy, '{"unit": "leaf"}']
    assert sglang("--radix-eviction-policy-config", '{"seed": 3}', "--mem-fraction-static", "0.5") == [
        *head,
        *policy,
        '{"seed": 3, "unit": "leaf"}',
        "--mem-fraction-static",
        "0.5",
    ]
    merged = sglang('--radix-eviction-policy-config={"seed": 1, "unit": "leaf", "capacity_tokens": 64}')
    assert merged == [*head, *policy, '{"seed": 1, "unit": "leaf", "capacity_tokens": 64}']
    assert (
        engine_command(  # rlt stays page draws, the user's flags untouched
            ClusterConfig(engine="sglang", model="/m", eviction="rlt", engine_python=sys.executable),
            0,
            9003,
            device="gpu",
        ).argv[-2:]
        == ["--radix-eviction-policy", "rlt"]
    )


def test_one_gpu_per_worker_from_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.launch.local import LocalWorkers

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    cfg = ClusterConfig(workers=2, engine="vllm", model="/m", engine_python=sys.executable, device="gpu")
    workers = LocalWorkers(cfg, tmp_path, "tag")
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in workers.commands] == ["2", "5"]
    assert [row["placement"] for row in workers.rows()] == ["gpu 2", "gpu 5"]
    with pytest.raises(ValueError, match="workers: 3 workers need 3 GPUs"):
        LocalWorkers(cfg.model_copy(update={"workers": 3}), tmp_path, "tag")
