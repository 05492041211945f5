"""Local processes of a cluster: start with a log file each, watch, restart, stop without leftovers.

Every child is started in its own session (so a terminal Ctrl-C reaches only the launcher, which then
stops the children in order) with ``PR_SET_PDEATHSIG=SIGKILL`` (so a launcher killed with SIGKILL takes
its children along), and is stopped by process group: SIGTERM to the whole group, then SIGKILL to what
is left after the grace period. That also reaps engines' own helper processes (vLLM's engine core).
Every child's environment carries ``KVROUTE_LAUNCH_ID`` so leftovers can be found by anyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from kvroute.launch.config import ClusterConfig
from kvroute.launch.engines import EngineCommand, engine_command, gpu_ids, resolve_device

PR_SET_PDEATHSIG = 1
LAUNCH_ID_ENV = "KVROUTE_LAUNCH_ID"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free right now (all held open together, so no duplicates)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def child_preexec(cpu_core: int | None) -> Callable[[], None]:
    """preexec_fn: die with the parent thread (SIGKILL), optionally pin to one CPU core."""
    parent = os.getpid()

    def setup() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)
        if cpu_core is not None:
            os.sched_setaffinity(0, {cpu_core})

    return setup


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies of other parents included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ManagedProcess:
    """One child process (and its process group) with its output in a log file.

    Invariant: after :meth:`stop` returns, neither the child nor anything in its process group runs.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        cpu_core: int | None = None,
    ) -> None:
        if not argv:
            raise ValueError(f"{name}: empty command")
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})
        self.log_path = log_path
        self.cpu_core = cpu_core
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        """Start (or restart) the process; its output is appended to ``log_path`` (None: inherit)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        env = {**os.environ, **self.env}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
                log.flush()
                self.popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=child_preexec(self.cpu_core),
                )
        else:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=child_preexec(self.cpu_core),
            )
        self.starts += 1

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the log file ('' without one)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def send_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (the child leads it: start_new_session)."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def _running(self) -> bool:
        if self.popen is None:
            return False
        self.popen.poll()  # reap the leader if it exited, so a zombie does not count as running
        return group_alive(self.popen.pid)


async def stop_processes(procs: list[ManagedProcess], grace_s: float = 15.0) -> None:
    """SIGTERM every group at once, wait up to ``grace_s``, SIGKILL what is left, reap the leaders."""
    started = [p for p in procs if p.popen is not None]
    for p in started:
        p.send_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p._running() for p in started):
        await asyncio.sleep(0.05)
    for p in started:
        if p._running():
            p.send_group(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(p._running() for p in started):
        await asyncio.sleep(0.05)
    for p in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=1.0)  # type: ignore[union-attr]


async def http_ok(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> bool:
    """True when GET ``url`` answers 200 within ``timeout_s``."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


class LocalWorkers:
    """The engine workers of a local cluster: one process per worker, each on its own port.

    A worker that dies is restarted on the same port (so the router's URL stays valid and its health
    check readmits it), with a back-off when it keeps dying.
    """

    def __init__(self, cfg: ClusterConfig, log_dir: Path, launch_id: str) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        ports = free_ports(cfg.workers, cfg.worker_host)
        gpus = gpu_ids() if self.device == "gpu" else []
        if self.device == "gpu" and len(gpus) < cfg.workers:
            raise ValueError(
                f"workers: {cfg.workers} workers need {cfg.workers} GPUs, this host has {len(gpus)}"
            )
        self.urls = [f"http://{_url_host(cfg.worker_host)}:{port}" for port in ports]
        self.commands: list[EngineCommand] = []
        self.procs: list[ManagedProcess] = []
        for i, port in enumerate(ports):
            cmd = engine_command(
                cfg, i, port, device=self.device, gpu=gpus[i] if self.device == "gpu" else None
            )
            self.commands.append(cmd)
            self.procs.append(
                ManagedProcess(
                    f"worker-{i}",
                    cmd.argv,
                    env={**cmd.env, LAUNCH_ID_ENV: launch_id},
                    log_path=log_dir / f"worker-{i}.log",
                    cpu_core=cmd.cpu_core,
                )
            )
        self._started_at = [0.0] * cfg.workers
        self._restart_at: list[float | None] = [None] * cfg.workers
        self._backoff = [0.25] * cfg.workers

    def start(self) -> None:
        for i, p in enumerate(self.procs):
            p.start()
            self._started_at[i] = time.monotonic()

    async def status(self, session: aiohttp.ClientSession, i: int) -> str:
        """'healthy', 'starting' or 'failed: <why>' for worker ``i`` (used while waiting for health)."""
        p = self.procs[i]
        if not p.alive():
            return f"failed: exited with code {p.returncode}; log {p.log_path}:\n{p.log_tail()}"
        ok = await http_ok(session, self.urls[i] + self.commands[i].health_path)
        return "healthy" if ok else "starting"

    def restart_dead(self) -> list[str]:
        """Restart workers whose process exited; returns one message per restart.

        Quick deaths back off (0.5 s, 1 s, ... 30 s); a worker that ran for a minute restarts at once.
        """
        events = []
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p.alive():
                continue
            restart_at = self._restart_at[i]
            if restart_at is None:
                lived = now - self._started_at[i]
                self._backoff[i] = 0.25 if lived > 60 else min(self._backoff[i] * 2, 30.0)
                self._restart_at[i] = now + self._backoff[i]
                events.append(
                    f"{p.name} exited with code {p.returncode}; restarting in {self._backoff[i]:.1f} s"
                )
            elif now >= restart_at:
                p.start()
                self._started_at[i] = now
                self._restart_at[i] = None
                events.append(f"{p.name} restarted (pid {p.pid}, log {p.log_path})")
        return events

    def rows(self) -> list[dict[str, str]]:
        out = []
        for i, (p, url, cmd) in enumerate(zip(self.procs, self.urls, self.commands, strict=True)):
            where = f"core {cmd.cpu_core}" if cmd.cpu_core is not None else self.device
            if self.device == "gpu":
                where = f"gpu {cmd.env.get('CUDA_VISIBLE_DEVICES', i)}"
            out.append(
                {"worker": p.name, "url": url, "pid": str(p.pid), "placement": where, "log": str(p.log_path)}
            )
        return out

    async def stop(self, grace_s: float = 15.0) -> None:
        await stop_processes(self.procs, grace_s)


def _url_host(bind_host: str) -> str:
    """Address to reach a server bound to ``bind_host`` from this machine."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host
