"""Cluster membership on Ray: which engine workers are up, readable by routers on any node.

One named Ray actor per cluster (``kvroute-membership-<cluster>`` in namespace ``kvroute``) holds
``worker_id -> url`` for the workers that are currently healthy. The launcher's worker actors write it
(``put`` when their engine answers ``/health``, ``remove`` the moment the engine process dies) and
refresh their entry as a heartbeat; an entry that is not refreshed within ``ttl_s`` expires, so a worker
whose actor died without saying goodbye disappears too.

Routers read it with :func:`watch`, an asyncio poller: ``kvroute router --ray ADDRESS`` on any node calls
``await watch(address, on_change)``, and ``on_change`` receives the whole current membership every time
it changes, so a router only has to reconcile its worker list with it.

Invariants: ``snapshot()`` never returns an expired entry; ``version`` increases on every change of the
visible set; ``on_change`` is called once with the first snapshot and then only when the set differs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import ray

NAMESPACE = "kvroute"
DEFAULT_CLUSTER = "default"
DEFAULT_TTL_S = 6.0

log = logging.getLogger(__name__)

MembershipCallback = Callable[[dict[str, str]], Awaitable[None] | None]


def actor_name(cluster: str = DEFAULT_CLUSTER) -> str:
    """Name of the membership actor of ``cluster`` (clusters sharing one Ray cluster stay apart)."""
    if not cluster or not all(ch.isalnum() or ch in "-_." for ch in cluster):
        raise ValueError(
            f"cluster name must be non-empty and use only letters, digits, '-', '_', '.': {cluster!r}"
        )
    return f"kvroute-membership-{cluster}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Membership:
    """Healthy workers of one cluster, with heartbeat expiry.

    The clock here only ages heartbeats; it never decides routing. If this actor restarts, its table
    starts empty and the worker actors' next heartbeats (every ~1 s) fill it again.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._ttl_s = ttl_s
        self._members: dict[str, tuple[str, float]] = {}  # worker_id -> (url, expires_at monotonic)
        self._version = 0

    def _expire(self) -> None:
        now = time.monotonic()
        dead = [wid for wid, (_, expires_at) in self._members.items() if expires_at <= now]
        for wid in dead:
            del self._members[wid]
        if dead:
            self._version += 1

    def put(self, worker_id: str, url: str) -> int:
        """Add or refresh a healthy worker; returns the membership version."""
        if not worker_id or not url.startswith(("http://", "https://")):
            raise ValueError(f"put needs a worker id and an http(s) URL, got {worker_id!r}, {url!r}")
        self._expire()
        previous = self._members.get(worker_id)
        self._members[worker_id] = (url, time.monotonic() + self._ttl_s)
        if previous is None or previous[0] != url:
            self._version += 1
        return self._version

    def remove(self, worker_id: str) -> int:
        """Drop a worker (its engine died or it is shutting down); unknown ids are ignored."""
        self._expire()
        if self._members.pop(worker_id, None) is not None:
            self._version += 1
        return self._version

    def snapshot(self) -> tuple[int, dict[str, str]]:
        """(version, {worker_id: url}) of the workers whose heartbeat has not expired."""
        self._expire()
        return self._version, {wid: url for wid, (url, _) in sorted(self._members.items())}


def get_or_create(cluster: str = DEFAULT_CLUSTER, ttl_s: float = DEFAULT_TTL_S) -> ray.actor.ActorHandle:
    """The membership actor of ``cluster``, created if absent (needs a connected Ray driver)."""
    return Membership.options(name=actor_name(cluster), namespace=NAMESPACE, get_if_exists=True).remote(ttl_s)


def prepare_driver_env() -> None:
    """Environment for a Ray driver that joins an existing cluster; children (routers) inherit it.

    Ray 2.5x clusters use token auth by default (token in ~/.ray/auth_token), but a driver given an
    explicit address only sends the token when RAY_AUTH_MODE=token, and Ray caches that setting at
    import. Ray's own helper sets the variable (when unset and a token exists) and refreshes the cache;
    a token sent to a cluster without auth is accepted, so this is safe. Ray's failure-signal handler
    would print a stack dump on every SIGTERM, which is how the launcher stops routers: turn it off.
    """
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray version: the variable alone works when set before `import ray`
        if (Path.home() / ".ray" / "auth_token").is_file():
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def connect(address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` (a GCS ``host:port`` or ``auto``) once."""
    if ray.is_initialized():
        return
    if not address:
        raise ValueError("a Ray address is needed (GCS host:port, or 'auto')")
    prepare_driver_env()
    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)


def _lookup(cluster: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(actor_name(cluster), namespace=NAMESPACE)
    except ValueError:  # no such actor: the cluster is not (or no longer) launched
        return None


async def watch(
    address: str,
    on_change: MembershipCallback,
    *,
    cluster: str = DEFAULT_CLUSTER,
    interval_s: float = 0.5,
    stop: asyncio.Event | None = None,
) -> None:
    """Poll the membership of ``cluster`` every ``interval_s`` and report changes until cancelled.

    ``on_change(members)`` gets ``{worker_id: url}`` of the healthy workers (a fresh dict; may be a
    coroutine function). It is called with the first snapshot, then whenever the set changes. While no
    membership actor exists (cluster not launched yet, or shut down) the membership is empty. An
    exception raised by ``on_change`` propagates and ends the watch. Returns when ``stop`` is set.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    actor_name(cluster)  # validate before connecting
    await asyncio.to_thread(connect, address)
    handle: ray.actor.ActorHandle | None = None
    last: dict[str, str] | None = None
    while stop is None or not stop.is_set():
        if handle is None:
            handle = await asyncio.to_thread(_lookup, cluster)
        members: dict[str, str] = {}
        if handle is not None:
            try:
                _, members = await handle.snapshot.remote()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                log.warning("membership actor unavailable (%s); looking it up again", type(exc).__name__)
                handle = None
                members = dict(last or {})  # keep what we knew until the actor answers or is gone
        if members != last:
            last = dict(members)
            result = on_change(dict(members))
            if inspect.isawaitable(result):
                await result
        if stop is None:
            await asyncio.sleep(interval_s)
        else:
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
