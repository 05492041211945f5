"""`kvroute launch --ray` on a local Ray cluster: placement, actors, membership, and a SIGKILL under load.

The test process is the Ray cluster's first driver (its own ray.init / ray.shutdown, never `ray stop`);
the launcher joins it through the explicit GCS address, as a launcher on another machine would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from kvroute.launch.local import free_ports
from kvroute.launch.ray_cluster import worker_actor_name
from kvroute.router import ray_membership
from ray_support import local_ray_cluster
from test_launch_helpers import Launch, assert_no_leftovers, get_json, post_json


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with local_ray_cluster(num_cpus=4) as address:
        yield address


class Load:
    """Closed-loop load through the router from a few threads; records (start, end, status) per request."""

    def __init__(self, url: str, model: str, threads: int = 4) -> None:
        self.url, self.model = url, model
        self.records: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            status, _ = post_json(
                self.url + "/v1/completions",
                {"model": self.model, "prompt": f"client {i} request {n} " + "w " * 50, "max_tokens": 4},
                timeout_s=30,
            )
            self.records.append((t0, time.monotonic(), status))
            n += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def router_workers(url: str) -> dict[str, dict]:
    status, body = get_json(url + "/workers")
    return {w["url"]: w for w in body["workers"]} if status == 200 else {}


def wait_until(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_ray_launch_survives_engine_sigkill_under_load(ray_address: str, tmp_path: Path) -> None:
    cluster = f"t{uuid.uuid4().hex[:8]}"
    launch = Launch(
        [
            "--ray",
            ray_address,
            "--workers",
            "2",
            "--cluster-name",
            cluster,
            "--policy",
            "round_robin",
            "--eviction",
            "rlt",
            "--cpus-per-worker",
            "1",
        ],
        tmp_path / "logs",
    )
    load: Load | None = None
    second: subprocess.Popen[bytes] | None = None
    second_port = free_ports(1)[0]
    second_url = f"http://127.0.0.1:{second_port}"
    try:
        launch.wait_ready(2, timeout_s=240)
        actors = [
            ray.get_actor(worker_actor_name(cluster, i), namespace=ray_membership.NAMESPACE) for i in (0, 1)
        ]
        infos = ray.get([a.info.remote() for a in actors])
        assert all(info["healthy"] and info["restarts"] == 0 for info in infos)
        membership = ray.get_actor(ray_membership.actor_name(cluster), namespace=ray_membership.NAMESPACE)
        assert ray.get(membership.snapshot.remote())[1] == {
            "worker-0": infos[0]["url"],
            "worker-1": infos[1]["url"],
        }
        # the placement group spread one CPU bundle per worker
        assert sorted(router_workers(launch.url)) == sorted(info["url"] for info in infos)
        victim_url = infos[0]["url"]
        # a second router, started on its own as on another node, follows the same membership
        second = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute.launch.cli",
                "router",
                "--ray",
                ray_address,
                "--ray-cluster",
                cluster,
                "--port",
                str(second_port),
                "--policy",
                "least_load",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "second-router.log", "wb"),
        )  # noqa: SIM115
        wait_until(
            lambda: (get_json(second_url + "/health")[1] or {}).get("healthy_workers") == 2,
            120,
            "second router",
        )
        assert sorted(router_workers(second_url)) == sorted(info["url"] for info in infos)

        _, models = get_json(launch.url + "/v1/models")
        load = Load(launch.url, models["data"][0]["id"])
        wait_until(lambda: router_workers(launch.url)[victim_url]["requests"] >= 5, 60, "load on worker-0")

        t_kill = time.monotonic()
        os.kill(infos[0]["pid"], signal.SIGKILL)
        # the actor takes the worker out of the membership, and the router follows within seconds
        wait_until(
            lambda: "worker-0" not in ray.get(membership.snapshot.remote())[1], 5, "membership removal"
        )
        wait_until(
            lambda: (
                victim_url not in router_workers(launch.url)
                or not router_workers(launch.url)[victim_url]["healthy"]
            ),
            5,
            "router removal",
        )
        t_out = time.monotonic()
        wait_until(lambda: victim_url not in router_workers(second_url), 5, "second router removal")
        assert t_out - t_kill < 5
        # the actor restarts the engine, which is readmitted
        info = wait_until(
            lambda: (lambda d: d if d["healthy"] and d["restarts"] == 1 else None)(
                ray.get(actors[0].info.remote())
            ),
            60,
            "engine restart",
        )
        assert info["pid"] != infos[0]["pid"]
        back_url = info["url"]
        wait_until(lambda: router_workers(launch.url).get(back_url, {}).get("healthy"), 10, "readmission")
        t_back = time.monotonic()
        wait_until(
            lambda: router_workers(second_url).get(back_url, {}).get("healthy"), 10, "second router readd"
        )
        served_at_back = router_workers(launch.url)[back_url]["requests"]
        wait_until(
            lambda: router_workers(launch.url)[back_url]["requests"] >= served_at_back + 5,
            30,
            "requests on the restarted worker",
        )
        load.stop()

        # the actor process itself dies: its engine goes with it (PDEATHSIG), Ray restarts the actor,
        # whose __init__ starts a fresh engine that joins the membership again
        before = ray.get(actors[0].info.remote())
        os.kill(before["actor_pid"], signal.SIGKILL)
        wait_until(lambda: not _pid_alive(before["pid"]), 5, "engine to die with its actor")
        after = wait_until(
            lambda: (lambda d: d if d["healthy"] else None)(ray.get(actors[0].info.remote())),
            60,
            "restarted actor's engine",
        )
        assert after["actor_pid"] != before["actor_pid"] and after["pid"] != before["pid"]
        wait_until(
            lambda: ray.get(membership.snapshot.remote())[1].get("worker-0") == after["url"],
            10,
            "membership after actor restart",
        )
        wait_until(
            lambda: router_workers(launch.url).get(after["url"], {}).get("healthy"),
            10,
            "router after actor restart",
        )

        failed = [(t0, status) for t0, _, status in load.records if status != 200]
        # at most the requests in flight on the victim when it died can fail (4 clients)...
        assert len(failed) <= 4, failed
        # ...and none sent while it was out of the cluster: the router stopped sending to it
        assert all(status == 200 for t0, _, status in load.records if t_out + 0.5 < t0 < t_back)
        assert sum(1 for t0, _, _ in load.records if t_out + 0.5 < t0 < t_back) >= 1
        assert "readmitted" in launch.output()
    finally:
        if load is not None:
            load.stop()
        if second is not None:
            second.terminate()
            second.wait(timeout=30)
        rc = launch.stop(signal.SIGTERM)
    assert rc == 0, launch.output()
    assert_no_leftovers(launch.launch_id)
    # the launcher took its actors and membership along
    for name in (
        worker_actor_name(cluster, 0),
        worker_actor_name(cluster, 1),
        ray_membership.actor_name(cluster),
    ):
        wait_until(lambda n=name: _gone(n), 20, f"{name} to go away")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=ray_membership.NAMESPACE)
    except ValueError:
        return True
    return False
