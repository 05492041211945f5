"""Ray membership: a router in another process (a second Ray driver) sees additions, removals and expiry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import ray
from kvroute.router import ray_membership
from ray_support import local_ray_cluster

WATCHER = """
import asyncio, json, sys
from kvroute.router.ray_membership import watch
def show(members):
    print(json.dumps(members), flush=True)
asyncio.run(watch(sys.argv[1], show, cluster=sys.argv[2], interval_s=0.2))
"""


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with local_ray_cluster(num_cpus=2) as address:
        yield address


def next_change(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> tuple[float, dict[str, str]]:
    """(seconds waited, members) of the watcher's next report."""
    t0 = time.monotonic()
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, f"watcher exited: {proc.stderr.read() if proc.stderr else ''}"  # type: ignore[union-attr]
    assert time.monotonic() - t0 < timeout_s
    return time.monotonic() - t0, json.loads(line)


def test_watch_from_another_driver(ray_address: str) -> None:
    members = ray_membership.get_or_create("mtest", ttl_s=3.0)
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER, ray_address, "mtest"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, first = next_change(watcher, 120.0)  # includes the second driver's connect time
        assert first == {}
        ray.get(members.put.remote("w0", "http://10.0.0.1:8001"))
        waited, seen = next_change(watcher)
        assert seen == {"w0": "http://10.0.0.1:8001"} and waited < 3.0
        ray.get(members.put.remote("w1", "http://10.0.0.2:8001"))
        assert next_change(watcher)[1] == {"w0": "http://10.0.0.1:8001", "w1": "http://10.0.0.2:8001"}
        ray.get(members.remove.remote("w0"))
        waited, seen = next_change(watcher)
        assert seen == {"w1": "http://10.0.0.2:8001"} and waited < 3.0
        # w1 is never refreshed: its heartbeat expires after the TTL (3 s)
        waited, seen = next_change(watcher)
        assert seen == {} and 1.0 < waited < 6.0
        # the launcher goes away with its membership actor: routers see an empty cluster
        ray.get(members.put.remote("w2", "http://10.0.0.3:8001"))
        assert next_change(watcher)[1] == {"w2": "http://10.0.0.3:8001"}
        ray.kill(members, no_restart=True)
        assert next_change(watcher)[1] == {}
    finally:
        watcher.kill()
        watcher.wait()


def test_membership_rejects_bad_input(ray_address: str) -> None:
    members = ray_membership.get_or_create("mbad")
    with pytest.raises(ray.exceptions.RayTaskError, match="http"):
        ray.get(members.put.remote("w0", "not-a-url"))
    with pytest.raises(ValueError, match="cluster name"):
        ray_membership.actor_name("a b")
    ray.kill(members, no_restart=True)
