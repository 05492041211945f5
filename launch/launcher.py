"""``kvroute launch``: start N engine workers and the router, locally or on Ray, with one command.

    kvroute launch --workers 4 --engine sim --eviction rlt --policy lbgr --port 8000
    kvroute launch --workers 2 --engine vllm --model models/tiny-llama -- --max-model-len 512
    kvroute launch --workers 4 --bench gsp --bench-rate 8 --bench-num 200
    kvroute launch --ray auto --workers 4
    kvroute launch --config cluster.yaml

Order: workers start (free ports, one log file each), every ``/health`` is awaited with a live display,
then the router starts and is awaited, then the endpoint and a table of the workers are printed. With
``--bench`` the load generator runs against the router and the cluster is shut down after its report;
otherwise the launcher supervises until Ctrl-C or SIGTERM. Shutdown stops the router first, then every
worker (SIGTERM, then SIGKILL after a grace period), and leaves no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from kvroute.launch.config import ClusterConfig, ConfigFileError, build_config, describe_errors, load_yaml
from kvroute.launch.local import LAUNCH_ID_ENV, LocalWorkers, ManagedProcess, free_ports, stop_processes
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

Probe = Callable[[aiohttp.ClientSession, int], Awaitable[str]]


class LaunchError(RuntimeError):
    """The cluster could not be brought up (a worker failed, a timeout passed); message says why."""


class Workers(Protocol):
    """What the launcher needs from a set of workers, local or on Ray."""

    urls: list[str]

    async def status(self, session: aiohttp.ClientSession, i: int) -> str: ...
    def rows(self) -> list[dict[str, str]]: ...
    async def stop(self, grace_s: float = 15.0) -> None: ...


# ---- command line --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute launch",
        description="Start N engine workers plus the router, locally or on Ray. Engine flags go after --.",
        epilog="Every flag can also be set in --config cluster.yaml (same names); flags override the file.",
    )
    # every default is None, so that only the flags actually given override the config file
    p.add_argument("--config", metavar="YAML", help="cluster file with the same settings as the flags")
    p.add_argument("--workers", type=int, help="number of engine workers (default 4)")
    p.add_argument("--engine", help="sim (default), sglang or vllm")
    p.add_argument("--model", help="model path or name (sglang, vllm)")
    p.add_argument(
        "--eviction",
        help="lru (default), rlt, or rlt-leaf (sglang and sim: a whole leaf per RLT draw): KV-cache eviction inside each engine",
    )
    p.add_argument("--policy", help="router policy (default lbgr)")
    p.add_argument("--host", help="router bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="router port (default 8000; 0: any free port)")
    p.add_argument("--worker-host", help="workers' bind address (default 127.0.0.1)")
    p.add_argument("--device", help="auto (default), cpu (one core per worker) or gpu (one GPU per worker)")
    p.add_argument("--engine-python", help="python of the engine (default .venv-<engine>/bin/python)")
    p.add_argument("--preset", help="sim cost-model preset")
    p.add_argument("--admin-token", help="token protecting the router's /workers admin API")
    p.add_argument(
        "--router-arg",
        dest="router_args",
        action="append",
        metavar="ARG",
        help="extra `kvroute router` argument (repeatable), e.g. --router-arg=--seed=1",
    )
    p.add_argument("--log-dir", help="one log file per process here (default logs/launch-<time>)")
    p.add_argument(
        "--health-timeout",
        dest="health_timeout_s",
        type=float,
        help="seconds the workers may take to become healthy (default 600)",
    )
    p.add_argument("--ray", metavar="ADDRESS", help="run on Ray: 'auto' or the GCS address host:port")
    p.add_argument("--cluster-name", help="name of this cluster's membership on Ray (default 'default')")
    p.add_argument("--cpus-per-worker", type=float, help="CPU bundle per worker on Ray (default 1)")
    p.add_argument("--bench", metavar="WORKLOAD", help="once up, run `kvroute bench serve` and shut down")
    p.add_argument("--rate", "--bench-rate", dest="bench_rate", type=float, help="--bench request rate")
    p.add_argument("--num", "--bench-num", dest="bench_num", type=int, help="--bench number of requests")
    p.add_argument(
        "--bench-arg",
        dest="bench_args",
        action="append",
        metavar="ARG",
        help="extra `kvroute bench serve` argument (repeatable), e.g. --bench-arg=--order=round_robin",
    )
    return p


def parse_config(argv: list[str]) -> ClusterConfig:
    """argv -> validated config. Raises ConfigFileError / ValidationError; argparse exits 2 on syntax."""
    engine_args: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    ns = build_parser().parse_args(argv)
    flags: dict[str, Any] = {k: v for k, v in vars(ns).items() if k != "config"}
    flags["engine_args"] = engine_args
    file_values = load_yaml(ns.config) if ns.config else {}
    return build_config(file_values, flags)


def check_policy(name: str) -> None:
    """Fail early (exit 2) on a policy name the router does not know."""
    from kvroute.router.policies import POLICY_NAMES  # noqa: PLC0415  (keeps `--help` fast)

    if name not in POLICY_NAMES:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


# ---- bring-up --------------------------------------------------------------------------------------------
async def wait_healthy(
    names: list[str], probe: Probe, timeout_s: float, stop: asyncio.Event, console: Console, what: str
) -> None:
    """Poll every probe until all say 'healthy', with a live progress display.

    Raises LaunchError when a probe says 'failed: ...', when ``timeout_s`` passes, or when ``stop`` is set.
    """
    deadline = time.monotonic() + timeout_s
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<12}"),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks = [progress.add_task(name, total=1, state="starting") for name in names]
    overall = None
    if len(names) > 1:
        overall = progress.add_task(f"[bold]{what}", total=len(names), state=f"0/{len(names)} healthy")
    healthy = [False] * len(names)
    async with aiohttp.ClientSession() as session:
        with progress:
            while not all(healthy):
                if stop.is_set():
                    raise LaunchError("interrupted while waiting for health")
                pending = [i for i, ok in enumerate(healthy) if not ok]
                states = await asyncio.gather(*(probe(session, i) for i in pending))
                for i, state in zip(pending, states, strict=True):
                    if state == "healthy":
                        healthy[i] = True
                        progress.update(tasks[i], completed=1, state="[green]healthy")
                    elif state.startswith("failed"):
                        progress.update(tasks[i], state="[red]failed")
                        raise LaunchError(f"{names[i]} {state}")
                    else:
                        progress.update(tasks[i], state=state)
                if overall is not None:
                    progress.update(
                        overall, completed=sum(healthy), state=f"{sum(healthy)}/{len(names)} healthy"
                    )
                if all(healthy):
                    break
                if time.monotonic() > deadline:
                    late = ", ".join(n for n, ok in zip(names, healthy, strict=True) if not ok)
                    raise LaunchError(f"not healthy after {timeout_s:.0f} s: {late} (see their logs)")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.25)


def router_command(
    cfg: ClusterConfig, port: int, worker_urls: list[str], ray_address: str | None
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "kvroute.launch.cli",
        "router",
        "--policy",
        cfg.policy,
        "--host",
        cfg.host,
        "--port",
        str(port),
    ]
    if ray_address is not None:
        argv += ["--ray", ray_address, "--ray-cluster", cfg.cluster_name]
    else:
        argv += ["--worker-urls", *worker_urls]
    if cfg.admin_token:
        argv += ["--admin-token", cfg.admin_token]
    return argv + list(cfg.router_args)


def bench_command(cfg: ClusterConfig, url: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "kvroute.launch.cli",
        "bench",
        "serve",
        "--url",
        url,
        "--workload",
        str(cfg.bench),
    ]
    if cfg.bench_rate is not None:
        argv += ["--rate", str(cfg.bench_rate)]
    if cfg.bench_num is not None:
        argv += ["--num", str(cfg.bench_num)]
    if cfg.admin_token:
        argv += ["--admin-token", cfg.admin_token]  # so the report can read the router's /workers
    if cfg.model is not None:
        argv += ["--model", cfg.model]  # real engines check the model name
    argv += ["--eviction-label", cfg.eviction]  # a real engine's metrics do not say which eviction runs
    return argv + list(cfg.bench_args)


def url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


async def router_status(session: aiohttp.ClientSession, proc: ManagedProcess, url: str, workers: int) -> str:
    """'healthy' once the router answers /health and sees every worker healthy."""
    if not proc.alive():
        return f"failed: exited with code {proc.returncode}; log {proc.log_path}:\n{proc.log_tail()}"
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            body = await resp.read()
            if resp.status != 200:
                return "starting"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return "starting"
    try:
        seen = int(json.loads(body).get("healthy_workers", workers))
    except (ValueError, AttributeError, TypeError):
        return "healthy"
    return "healthy" if seen >= workers else f"sees {seen}/{workers} workers"


def print_cluster(
    console: Console,
    cfg: ClusterConfig,
    endpoint: str,
    rows: list[dict[str, str]],
    log_dir: Path,
    ray_address: str | None,
) -> None:
    table = Table(title=f"{cfg.workers} x {cfg.engine} workers, eviction {cfg.eviction}, policy {cfg.policy}")
    for column in rows[0] if rows else []:
        table.add_column(column)
    for row in rows:
        table.add_row(*row.values())
    console.print(table)
    console.print(
        f"router:   [bold]{endpoint}[/bold]  (OpenAI /v1/completions, /v1/chat/completions; /generate)"
    )
    if ray_address:
        console.print(
            f"ray:      {ray_address}  (other routers: kvroute router --ray {ray_address} "
            f"--ray-cluster {cfg.cluster_name})"
        )
    console.print(f"logs:     {log_dir}")


# ---- the run -------------------------------------------------------------------------------------------------
async def run(cfg: ClusterConfig, *, console: Console | None = None) -> int:
    """Bring the cluster up, then bench or supervise until a signal; always tear everything down."""
    # not a terminal (a log, a test): wide enough that URLs and log paths are never cut
    out = console or (Console() if sys.stdout.isatty() else Console(width=240))
    err = Console(stderr=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(sig: int) -> None:
        signals_seen.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    # every child carries this tag, so leftovers can be found; a caller may choose it (tests do)
    launch_id = os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex[:12]
    log_dir = Path(cfg.log_dir or Path("logs") / time.strftime("launch-%Y%m%d-%H%M%S")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    workers: Workers | None = None
    ray_cluster: Any = None
    router: ManagedProcess | None = None
    bench: ManagedProcess | None = None
    rc = 0
    try:
        ray_address: str | None = None
        if cfg.ray is not None:
            from kvroute.launch.ray_cluster import RayWorkers  # noqa: PLC0415  (Ray is optional and heavy)

            err.print(f"connecting to Ray ({cfg.ray}) ...")
            ray_cluster = await asyncio.to_thread(RayWorkers.connect_and_place, cfg, log_dir, launch_id)
            workers = ray_cluster
            ray_address = ray_cluster.gcs_address
        else:
            workers = local = LocalWorkers(cfg, log_dir, launch_id)
            local.start()
        names = [f"worker-{i}" for i in range(cfg.workers)]
        await wait_healthy(names, workers.status, cfg.health_timeout_s, stop, err, "workers")

        port = cfg.port or free_ports(1, cfg.host)[0]
        endpoint = f"http://{url_host(cfg.host)}:{port}"
        router = ManagedProcess(
            "router",
            router_command(cfg, port, workers.urls, ray_address),
            env={LAUNCH_ID_ENV: launch_id},
            log_path=log_dir / "router.log",
        )
        router.start()
        router_probe: Probe = lambda session, _i: router_status(session, router, endpoint, cfg.workers)  # noqa: E731
        await wait_healthy(["router"], router_probe, 120.0, stop, err, "router")
        print_cluster(out, cfg, endpoint, workers.rows(), log_dir, ray_address)

        if cfg.bench is not None:
            bench = ManagedProcess("bench", bench_command(cfg, endpoint), env={LAUNCH_ID_ENV: launch_id})
            out.print(f"running: {' '.join(bench.argv[1:])}")
            bench.start()  # inherits stdout: its progress and report go straight to the terminal
            while bench.alive() and not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.2)
            rc = bench.returncode if bench.returncode is not None else 130
            if rc != 0 and not stop.is_set():
                err.print(f"[red]bench exited with code {rc}")
        else:
            out.print("[dim]Ctrl-C stops the cluster.[/dim]")
            while not stop.is_set():
                if isinstance(workers, LocalWorkers):
                    for event in workers.restart_dead():
                        err.print(Text(event, style="yellow"))
                elif ray_cluster is not None:
                    for event in await ray_cluster.events():
                        err.print(Text(event, style="yellow"))
                if not router.alive():
                    err.print(
                        Text(
                            f"router exited with code {router.returncode}; log {router.log_path}:\n"
                            f"{router.log_tail()}",
                            style="red",
                        )
                    )
                    rc = 1
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
    except LaunchError as exc:
        # plain Text: log tails hold brackets that rich would read as markup
        err.print(Text("launch failed: ", style="red") + Text(str(exc)))
        rc = 1
    finally:
        err.print("stopping the cluster ...")
        await stop_processes([p for p in (bench, router) if p is not None], grace_s=10.0)
        if workers is not None:
            await workers.stop()
        if ray_cluster is not None:
            await asyncio.to_thread(ray_cluster.disconnect)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        err.print("stopped.")
    if signals_seen and rc == 0:
        rc = 128 + signals_seen[0] if cfg.bench is not None else 0
    return rc


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(args)
        check_policy(cfg.policy)
    except ValidationError as exc:
        print(f"kvroute launch: invalid configuration:\n{describe_errors(exc)}", file=sys.stderr)
        return 2
    except (ConfigFileError, ValueError) as exc:
        print(f"kvroute launch: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(cfg))
    except ValueError as exc:  # e.g. more GPU workers than GPUs, found while placing workers
        print(f"kvroute launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
