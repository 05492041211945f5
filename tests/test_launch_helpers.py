"""Helpers shared by the launch tests (a running `kvroute launch` subprocess, leftovers), plus their own test.

Leftovers are found by the ``KVROUTE_LAUNCH_ID`` tag that the launcher puts into every child's environment
(local workers, the router, the bench, and the engines that Ray actors start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from kvroute.launch.local import LAUNCH_ID_ENV, free_ports


def tagged_processes(launch_id: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment carries ``KVROUTE_LAUNCH_ID=launch_id``."""
    needle = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if needle in env and state != "Z":
            found.append(int(entry))
    return found


def get_json(url: str, timeout_s: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def post_json(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


class Launch:
    """`kvroute launch ...` as a subprocess with its own launch id, router port and log directory."""

    def __init__(self, args: list[str], log_dir: Path, *, engine_args: list[str] | None = None) -> None:
        self.launch_id = uuid.uuid4().hex[:12]
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.out_path = log_dir / "launcher.out"
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "kvroute.launch.cli",
            "launch",
            *args,
            "--port",
            str(self.port),
            "--log-dir",
            str(log_dir),
        ]
        if engine_args:
            argv += ["--", *engine_args]
        self.out = open(self.out_path, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            argv,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env={**os.environ, LAUNCH_ID_ENV: self.launch_id, "COLUMNS": "200"},
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self, workers: int, timeout_s: float = 180.0) -> None:
        """Until the router answers /health with every worker healthy (fails with the launcher's output)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.output()}"
            status, body = get_json(self.url + "/health", 2.0)
            if status == 200 and body.get("healthy_workers") == workers and "router:" in self.output():
                return
            time.sleep(0.25)
        raise AssertionError(f"cluster not ready after {timeout_s} s:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.out.close()
        return rc


def assert_no_leftovers(launch_id: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while tagged_processes(launch_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_processes(launch_id)
    assert not left, f"processes left behind: {[Path(f'/proc/{p}/cmdline').read_bytes() for p in left]}"


def test_tagged_processes_finds_tagged_child() -> None:
    tag = uuid.uuid4().hex[:12]
    child = subprocess.Popen(["sleep", "30"], env={**os.environ, LAUNCH_ID_ENV: tag})
    try:
        assert tagged_processes(tag) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert tagged_processes(tag) == []
