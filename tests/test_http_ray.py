"""``kvroute router --ray ADDRESS`` follows the cluster membership published on Ray."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import ray  # installed with the [ray] extra, as in CI
from kvroute.router import ray_membership
from ray_support import local_ray_cluster

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait(pred, timeout_s: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_router_follows_ray_membership() -> None:
    with local_ray_cluster(num_cpus=1) as address:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            members = ray_membership.get_or_create("httptest", ttl_s=30.0)
            kv = [sys.executable, "-m", "kvroute.launch.cli"]
            w_port, r_port = _free_port(), _free_port()
            procs.append(subprocess.Popen([*kv, "worker", "--port", str(w_port), "--log-level", "WARNING"]))
            procs.append(
                subprocess.Popen(
                    [
                        *kv,
                        "router",
                        "--ray",
                        address,
                        "--ray-cluster",
                        "httptest",
                        "--port",
                        str(r_port),
                        "--log-level",
                        "WARNING",
                    ],
                )
            )
            router = f"http://127.0.0.1:{r_port}"
            _wait(lambda: _get_json(router + "/health")[1]["workers"] == 0, what="router up with no workers")
            ray.get(members.put.remote("w0", f"http://127.0.0.1:{w_port}"))
            _wait(
                lambda: (
                    _get_json(router + "/health")
                    == (200, {"status": "ok", "healthy_workers": 1, "workers": 1, "policy": "cache_aware"})
                ),
                what="worker admitted from the membership",
            )
            req = urllib.request.Request(
                router + "/v1/completions",
                data=b'{"prompt": "a b", "max_tokens": 1}',
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
            ray.get(members.remove.remote("w0"))
            _wait(lambda: _get_json(router + "/health")[1]["workers"] == 0, what="worker removed")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=15)
