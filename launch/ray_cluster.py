"""Workers on a Ray cluster: a placement group, one supervising actor per engine, shared membership.

- One bundle per worker (``{"GPU": 1}`` on GPUs, ``{"CPU": cpus_per_worker}`` otherwise), strategy SPREAD,
  so workers land on as many nodes as the cluster has.
- One :class:`EngineWorker` actor per bundle (``max_restarts=-1``). It starts the engine process from its
  event-loop thread (``PR_SET_PDEATHSIG`` is per thread: started from a thread that later exits, the
  engine would be killed with it), in a new session, so the engine dies with the actor and is stopped by
  process group. It restarts the engine when it dies, and keeps the membership actor
  (:mod:`kvroute.router.ray_membership`) current: removed the moment the engine dies, put back once
  ``/health`` answers, refreshed as a heartbeat meanwhile. If the actor itself dies, Ray restarts it and
  its ``__init__`` starts a fresh engine.
- Routers on any node (``kvroute router --ray ADDRESS``) follow that membership.

Actor classes live in this importable module (Ray cannot ship classes defined in ``__main__``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import ray
from kvroute.launch.config import ClusterConfig
from kvroute.launch.engines import engine_command, resolve_device, usable_cores
from kvroute.launch.local import LAUNCH_ID_ENV, ManagedProcess, free_ports, http_ok, stop_processes
from kvroute.router import ray_membership
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

HEARTBEAT_S = 1.0  # membership refresh; well inside ray_membership.DEFAULT_TTL_S
HEALTH_FAILS_TO_REMOVE = 3  # consecutive failed /health probes of a live engine before it leaves membership


def worker_actor_name(cluster: str, index: int) -> str:
    return f"kvroute-worker-{cluster}-{index}"


class EngineWorker:
    """Owns one engine process on its Ray node: starts it, restarts it, reports it in the membership.

    Invariant: the worker is in the membership only while its current engine process is alive and has
    answered ``/health`` (give or take one heartbeat TTL if this actor dies abruptly).
    """

    def __init__(self, cfg: ClusterConfig, index: int, device: str, log_dir: str, launch_id: str) -> None:
        # Ray runs an async actor's __init__ on its event-loop thread: the engine is started from here
        self.index = index
        self.worker_id = f"worker-{index}"
        self.node_ip = ray.util.get_node_ip_address()
        # bind to the node's address so routers on other nodes can reach it
        host = self.node_ip if cfg.worker_host in ("127.0.0.1", "localhost") else cfg.worker_host
        self.cfg = cfg.model_copy(update={"worker_host": host})
        port = free_ports(1, host)[0]
        self.url = f"http://{host}:{port}"
        cmd = engine_command(self.cfg, index, port, device=device, cores=usable_cores())
        self.health_url = self.url + cmd.health_path
        self.proc = ManagedProcess(
            self.worker_id,
            cmd.argv,
            env={**cmd.env, LAUNCH_ID_ENV: launch_id},
            log_path=Path(log_dir) / f"{self.worker_id}.log",
            cpu_core=cmd.cpu_core,
        )
        self.membership = ray_membership.get_or_create(cfg.cluster_name)
        self.healthy = False
        self.ever_healthy = False
        self.restarts = 0
        self.last_exit: int | None = None
        self.events: list[str] = []
        self._stopping = False
        self._backoff = 0.25
        self.proc.start()
        self._started_at = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        restart_at: float | None = None
        next_probe = 0.0
        fails = 0
        async with aiohttp.ClientSession() as session:
            while not self._stopping:
                now = time.monotonic()
                if not self.proc.alive():
                    if restart_at is None:  # just noticed: leave the membership at once
                        self._set_healthy(False)
                        lived = now - self._started_at
                        self._backoff = 0.25 if lived > 60 else min(self._backoff * 2, 30.0)
                        restart_at = now + self._backoff
                        self.last_exit = self.proc.returncode
                        self.events.append(
                            f"{self.worker_id} on {self.node_ip}: engine exited with code "
                            f"{self.last_exit}; restarting"
                        )
                    elif now >= restart_at:
                        self.proc.start()
                        self.restarts += 1
                        self._started_at = now
                        restart_at = None
                        fails = 0
                elif now >= next_probe:
                    ok = await http_ok(session, self.health_url, timeout_s=2.0)
                    next_probe = time.monotonic() + (HEARTBEAT_S if self.healthy else 0.2)
                    if ok:
                        fails = 0
                        if not self.healthy and self.ever_healthy:
                            self.events.append(
                                f"{self.worker_id} on {self.node_ip}: healthy again (pid "
                                f"{self.proc.pid}); readmitted"
                            )
                        self._set_healthy(True)  # also the heartbeat
                    elif self.healthy:
                        fails += 1
                        if fails >= HEALTH_FAILS_TO_REMOVE:
                            self._set_healthy(False)
                await asyncio.sleep(0.05)

    def _set_healthy(self, healthy: bool) -> None:
        if healthy:
            self.ever_healthy = True
            self.membership.put.remote(self.worker_id, self.url)
        elif self.healthy:
            self.membership.remove.remote(self.worker_id)
        self.healthy = healthy

    async def status(self) -> str:
        """'healthy', 'starting' or 'failed: ...' (an engine that died before it was ever healthy)."""
        if self.healthy:
            return "healthy"
        if not self.ever_healthy and (self.restarts > 0 or not self.proc.alive()):
            return (
                f"failed: engine exited with code {self.last_exit} on {self.node_ip}; "
                f"log {self.proc.log_path}:\n{self.proc.log_tail()}"
            )
        return "starting"

    async def info(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "url": self.url,
            "pid": self.proc.pid,
            "actor_pid": os.getpid(),
            "node": self.node_ip,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "log": str(self.proc.log_path),
        }

    async def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    async def shutdown(self, grace_s: float = 15.0) -> None:
        """Leave the membership and stop the engine (whole process group); the actor can then be killed."""
        self._stopping = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.membership.remove.remote(self.worker_id)
        self.healthy = False
        await stop_processes([self.proc], grace_s)


class RayWorkers:
    """Driver side: connect, place, create the worker actors; then status, rows, events and stop."""

    def __init__(
        self,
        cfg: ClusterConfig,
        gcs_address: str,
        pg: Any,
        actors: list[Any],
        membership: Any,
        urls: list[str],
    ) -> None:
        self.cfg = cfg
        self.gcs_address = gcs_address
        self.pg = pg
        self.actors = actors
        self.membership = membership
        self.urls = urls

    @classmethod
    def connect_and_place(
        cls, cfg: ClusterConfig, log_dir: Path, launch_id: str, place_timeout_s: float = 60.0
    ) -> RayWorkers:
        """Blocking; the launcher runs it in a thread. Raises ValueError if the bundles cannot be placed."""
        connect(cfg.ray or "auto")
        gcs_address = ray.get_runtime_context().gcs_address
        device = resolve_device(cfg)
        bundle = {"GPU": 1.0} if device == "gpu" else {"CPU": cfg.cpus_per_worker}
        membership = ray_membership.get_or_create(cfg.cluster_name)
        pg = placement_group(
            [dict(bundle) for _ in range(cfg.workers)], strategy="SPREAD", name=f"kvroute-{cfg.cluster_name}"
        )
        if not pg.wait(place_timeout_s):
            remove_placement_group(pg)
            raise ValueError(
                f"workers: cannot place {cfg.workers} bundles of {bundle} on the Ray cluster "
                f"(resources: {ray.cluster_resources()}); lower --workers or --cpus-per-worker"
            )
        actor_cls = ray.remote(EngineWorker)
        actors = []
        for i in range(cfg.workers):
            resources = {"num_gpus": 1} if device == "gpu" else {"num_cpus": cfg.cpus_per_worker}
            actors.append(
                actor_cls.options(
                    name=worker_actor_name(cfg.cluster_name, i),
                    namespace=ray_membership.NAMESPACE,
                    max_restarts=-1,
                    max_task_retries=-1,
                    lifetime=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    ),
                    **resources,
                ).remote(cfg, i, device, str(log_dir), launch_id)
            )
        infos = ray.get([a.info.remote() for a in actors])
        return cls(cfg, gcs_address, pg, actors, membership, [info["url"] for info in infos])

    async def status(self, session: aiohttp.ClientSession, i: int) -> str:
        return await self.actors[i].status.remote()

    def rows(self) -> list[dict[str, str]]:
        infos = ray.get([a.info.remote() for a in self.actors])
        return [
            {"worker": d["worker"], "url": d["url"], "pid": str(d["pid"]), "node": d["node"], "log": d["log"]}
            for d in infos
        ]

    async def events(self) -> list[str]:
        batches = await asyncio.gather(*(a.take_events.remote() for a in self.actors), return_exceptions=True)
        return [e for batch in batches if isinstance(batch, list) for e in batch]

    async def stop(self, grace_s: float = 15.0) -> None:
        await asyncio.gather(
            *(asyncio.wait_for(_ref_future(a.shutdown.remote(grace_s)), grace_s + 10) for a in self.actors),
            return_exceptions=True,
        )
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        with contextlib.suppress(Exception):
            ray.kill(self.membership, no_restart=True)

    def disconnect(self) -> None:
        ray.shutdown()


async def _ref_future(ref: Any) -> Any:
    return await ref


def connect(address: str) -> None:
    """Connect as a driver: 'auto' joins a running cluster or else starts a local one; else host:port."""
    if ray.is_initialized():
        return
    ray_membership.prepare_driver_env()
    common = {"namespace": ray_membership.NAMESPACE, "logging_level": logging.WARNING, "log_to_driver": False}
    if address == "auto":
        try:
            ray.init(address="auto", **common)
            return
        except ConnectionError:
            pass  # no running cluster: start one for the lifetime of this launcher
        ray.init(include_dashboard=False, **common)
        ray_membership.prepare_driver_env()  # the new cluster's token now exists: routers need it
        return
    ray.init(address=address, **common)
