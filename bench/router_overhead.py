"""Router overhead, measured side by side in one run: our router vs direct vs sglang-router 0.3.2.

    python -m kvroute.bench.router_overhead [--workers 2] [--ttft-requests 1500 --ttft-rate 60]
                                            [--rps-concurrency 64 --rps-seconds 8 --rounds 2]

Targets (issue 5): (1) the router adds <= 1 ms to P50 TTFT compared with sending the same requests
straight to a worker; (2) requests/s through our router with trivial workers >= half of sglang-router
0.3.2's (``python -m sglang_router.launch_router --policy cache_aware``) on the same workers and load.

Trivial workers: ``python -m kvroute.bench.router_overhead echo-worker --port P`` (below) answers at once,
OpenAI/SGLang-shaped, without parsing the body, so a request costs the worker as little CPU as aiohttp
allows. sglang-router is installed by this script into its own venv (``.venv-sglang-router``,
``pip install sglang-router==0.3.2``) as users run it. Both routers run with policy ``cache_aware``.

TTFT phase: an open-loop Poisson stream of streaming completions; each arrival goes to the next target in
turn (direct to a worker, our router, sglang-router), so all three see the same load at the same time.
TTFT = time from sending to the first body byte, at the client. RPS phase: a closed loop of
``--rps-concurrency`` clients per target for ``--rps-seconds``, targets alternating over ``--rounds``.
Everything (client, routers, workers) shares this machine's cores; the JSON records the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

MODEL = "echo"


def _completion_events(n_tokens: int) -> bytes:
    events = []
    for i in range(n_tokens):
        reason = "length" if i == n_tokens - 1 else None
        chunk = {
            "id": "cmpl-echo",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": reason}],
        }
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage = {
        "id": "cmpl-echo",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": n_tokens,
            "total_tokens": n_tokens + 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def _completion_body(n_tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-echo",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(f" t{i}" for i in range(n_tokens)),
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": n_tokens,
                "total_tokens": n_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    ).encode()


def build_app(n_tokens: int = 4) -> web.Application:
    stream_body = _completion_events(n_tokens)
    plain_body = _completion_body(n_tokens)

    async def generate(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b'"stream": true' in raw or b'"stream":true' in raw:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(stream_body)
            await out.write_eof()
            return out
        return web.Response(body=plain_body, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "echo"}]}
        )

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "tokenizer_path": None, "is_generation": True})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, generate)
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/get_server_info", info)
    return app


async def serve(
    port: int, n_tokens: int, host: str = "127.0.0.1", ready: Callable[[int], None] | None = None
) -> None:
    runner = web.AppRunner(build_app(n_tokens), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    if ready is not None:
        ready(runner.addresses[0][1])
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


# ---- the benchmark ---------------------------------------------------------------------------------------
SGLANG_ROUTER_VERSION = "0.3.2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_sglang_router(venv: Path) -> Path:
    """The python of a venv holding sglang-router==0.3.2, created (pip install) when missing."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('sglang-router'))"]
    if python.exists():
        got = subprocess.run(probe, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == SGLANG_ROUTER_VERSION:
            return python
    print(f"installing sglang-router=={SGLANG_ROUTER_VERSION} into {venv} ...", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"], check=True
    )
    return python


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]


def start(name: str, cmd: list[str], port: int, log_dir: Path) -> Proc:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, f"http://127.0.0.1:{port}", popen)


async def wait_healthy(
    session: aiohttp.ClientSession, proc: Proc, timeout_s: float = 120.0, path: str = "/health"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode} (see its log)")
        try:
            async with session.get(proc.url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not become healthy within {timeout_s:.0f}s")


def stop(procs: Sequence[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def prompts(n: int, seed: int = 0, groups: int = 32, words: int = 200) -> list[str]:
    """Shared-prefix prompts (half of each prompt is its group's prefix), so cache_aware has work to do."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    prefixes = [" ".join(rng.choices(vocab, k=words // 2)) for _ in range(groups)]
    return [f"{prefixes[i % groups]} {' '.join(rng.choices(vocab, k=words // 2))}" for i in range(n)]


async def one_ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, float] | None:
    """(ttft, e2e) in seconds of one streaming completion, or None on failure."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}).encode()
    t0 = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            ttft = None
            async for _ in resp.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
            return (ttft if ttft is not None else float("nan"), time.perf_counter() - t0)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def ttft_phase(
    session: aiohttp.ClientSession,
    targets: dict[str, list[str]],
    n: int,
    rate: float,
    seed: int,
    progress: Progress,
) -> dict[str, dict[str, Any]]:
    """Open-loop Poisson arrivals; arrival i goes to target i mod len(targets) (URLs rotate per target)."""
    rng = random.Random(seed)
    texts = prompts(n, seed)
    names = list(targets)
    samples: dict[str, list[float]] = {k: [] for k in names}
    failures = dict.fromkeys(names, 0)
    task = progress.add_task("TTFT phase", total=n)
    pending: list[asyncio.Task[None]] = []
    t = time.perf_counter()

    async def run(name: str, url: str, text: str) -> None:
        got = await one_ttft(session, url, text)
        if got is None:
            failures[name] += 1
        else:
            samples[name].append(got[0])
        progress.advance(task)

    for i in range(n):
        t += rng.expovariate(rate)
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        name = names[i % len(names)]
        urls = targets[name]
        pending.append(asyncio.create_task(run(name, urls[(i // len(names)) % len(urls)], texts[i])))
    await asyncio.gather(*pending)
    out = {}
    for name in names:
        arr = np.array(samples[name]) * 1e3
        out[name] = {
            "n": int(arr.size),
            "failures": failures[name],
            "p50_ttft_ms": float(np.percentile(arr, 50)) if arr.size else None,
            "p95_ttft_ms": float(np.percentile(arr, 95)) if arr.size else None,
            "mean_ttft_ms": float(arr.mean()) if arr.size else None,
        }
    return out


async def rps_run(
    session: aiohttp.ClientSession, urls: list[str], concurrency: int, seconds: float, seed: int
) -> dict[str, float]:
    """Closed loop: ``concurrency`` clients each send non-streaming completions back to back."""
    texts = prompts(512, seed)
    done = 0
    failed = 0
    stop_at = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done, failed
        i = k
        url = urls[k % len(urls)] + "/v1/completions"
        while time.perf_counter() < stop_at:
            body = json.dumps({"model": MODEL, "prompt": texts[i % len(texts)], "max_tokens": 4}).encode()
            i += concurrency
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        failed += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                failed += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {"rps": done / elapsed, "completed": done, "failed": failed, "seconds": elapsed}


def cpu_seconds(*procs: Proc | None) -> float:
    """User + system CPU seconds of processes (all their threads), from /proc (Linux)."""
    total = 0.0
    for p in procs:
        if p is None:
            continue
        try:
            fields = Path(f"/proc/{p.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ttft = results["ttft"]
    names = list(ttft)
    a.bar(names, [ttft[n]["p50_ttft_ms"] or 0 for n in names], color="tab:blue")
    a.set_ylabel("P50 TTFT (ms)")
    a.set_title(f"TTFT at {results['config']['ttft_rate']} req/s (open loop)")
    rps = results["rps"]
    names = list(rps)
    b.bar(names, [rps[n]["rps_mean"] for n in names], color="tab:orange")
    b.set_ylabel("requests / s")
    b.set_title(f"closed loop, {results['config']['rps_concurrency']} clients")
    fig.suptitle("router overhead with trivial workers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    load_before = list(os.getloadavg())  # other work on the machine shows in latencies: record it
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        worker_ports = [free_port() for _ in range(args.workers)]
        for i, port in enumerate(worker_ports):
            procs.append(
                start(
                    f"echo-worker-{i}",
                    [
                        sys.executable,
                        "-m",
                        "kvroute.bench.router_overhead",
                        "echo-worker",
                        "--port",
                        str(port),
                    ],
                    port,
                    log_dir,
                )
            )
        worker_urls = [p.url for p in procs]
        ours_port = free_port()
        ours = start(
            "kvroute-router",
            [
                sys.executable,
                "-m",
                "kvroute.launch.cli",
                "router",
                "--worker-urls",
                *worker_urls,
                "--policy",
                "cache_aware",
                "--port",
                str(ours_port),
                "--log-level",
                "WARNING",
            ],
            ours_port,
            log_dir,
        )
        procs.append(ours)
        targets: dict[str, list[str]] = {"direct": worker_urls, "kvroute": [ours.url]}
        sglang: Proc | None = None
        if not args.skip_sglang:
            py = ensure_sglang_router(Path(args.sglang_venv))
            sg_port, prom_port = free_port(), free_port()
            sglang = start(
                "sglang-router",
                [
                    str(py),
                    "-m",
                    "sglang_router.launch_router",
                    "--worker-urls",
                    *worker_urls,
                    "--policy",
                    "cache_aware",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(sg_port),
                    "--prometheus-port",
                    str(prom_port),
                    "--log-level",
                    "warn",
                ],
                sg_port,
                log_dir,
            )
            procs.append(sglang)
            targets["sglang-router"] = [sglang.url]
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            for p in procs:
                await wait_healthy(session, p)
            if sglang is not None:  # sglang-router admits workers in the background: wait until it routes
                deadline = time.monotonic() + 60
                while await one_ttft(session, sglang.url, "warm up") is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("sglang-router never routed a request (see its log)")
                    await asyncio.sleep(0.5)
            with Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
            ) as progress:
                # warm-up: connections, caches
                warm = progress.add_task("warm-up", total=len(targets) * 50)
                for urls in targets.values():
                    for i in range(50):
                        await one_ttft(session, urls[i % len(urls)], f"warm {i}")
                        progress.advance(warm)
                ttft = await ttft_phase(
                    session, targets, args.ttft_requests * len(targets), args.ttft_rate, args.seed, progress
                )
                rps: dict[str, dict[str, Any]] = {name: {"runs": []} for name in targets}
                task = progress.add_task("RPS phase", total=args.rounds * len(targets))
                router_of = {"kvroute": ours, "sglang-router": sglang}
                worker_procs = procs[: args.workers]
                for r in range(args.rounds):
                    for name, urls in targets.items():
                        proc = router_of.get(name)
                        cpu0 = (cpu_seconds(proc), cpu_seconds(*worker_procs), time.process_time())
                        run = await rps_run(
                            session, urls, args.rps_concurrency, args.rps_seconds, args.seed + r
                        )
                        cpu1 = (cpu_seconds(proc), cpu_seconds(*worker_procs), time.process_time())
                        per_req = 1e3 / max(1, run["completed"])
                        run["router_cpu_ms_per_request"] = (cpu1[0] - cpu0[0]) * per_req if proc else 0.0
                        run["workers_cpu_ms_per_request"] = (cpu1[1] - cpu0[1]) * per_req
                        run["client_cpu_ms_per_request"] = (cpu1[2] - cpu0[2]) * per_req
                        rps[name]["runs"].append(run)
                        progress.advance(task)
    finally:
        stop(procs)
    for entry in rps.values():
        entry["rps_mean"] = float(np.mean([run["rps"] for run in entry["runs"]]))
        for key in ("router_cpu_ms_per_request", "workers_cpu_ms_per_request", "client_cpu_ms_per_request"):
            entry[key] = float(np.mean([run[key] for run in entry["runs"]]))
    results: dict[str, Any] = {
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())},
        "config": {k: v for k, v in vars(args).items() if k not in ("command",)},
        "ttft": ttft,
        "rps": rps,
    }
    targets_out: dict[str, Any] = {}
    if ttft["direct"]["p50_ttft_ms"] is not None and ttft["kvroute"]["p50_ttft_ms"] is not None:
        added = ttft["kvroute"]["p50_ttft_ms"] - ttft["direct"]["p50_ttft_ms"]
        targets_out["added_p50_ttft_ms"] = added
        targets_out["added_p50_ttft_target_ms"] = 1.0
        targets_out["added_p50_ttft_met"] = added <= 1.0
    if "sglang-router" in rps:
        ratio = rps["kvroute"]["rps_mean"] / rps["sglang-router"]["rps_mean"]
        targets_out["rps_ratio_vs_sglang_router"] = ratio
        targets_out["rps_ratio_target"] = 0.5
        targets_out["rps_ratio_met"] = ratio >= 0.5
    results["targets"] = targets_out
    return results


def print_results(results: dict[str, Any]) -> None:
    console = Console()
    if not console.is_terminal:  # pipes and files: do not squeeze the table into 80 columns
        console = Console(width=200)
    table = Table(title="router overhead (trivial workers; client, routers, workers on this machine)")
    for col in (
        "target",
        "P50 TTFT ms",
        "P95 TTFT ms",
        "TTFT n",
        "fail",
        "RPS (mean)",
        "RPS runs",
        "router CPU ms/req",
        "workers CPU ms/req",
        "client CPU ms/req",
    ):
        table.add_column(col, justify="right" if col != "target" else "left")
    for name, t in results["ttft"].items():
        r = results["rps"][name]
        table.add_row(
            name,
            f"{t['p50_ttft_ms']:.3f}",
            f"{t['p95_ttft_ms']:.3f}",
            str(t["n"]),
            str(t["failures"]),
            f"{r['rps_mean']:.0f}",
            " ".join(f"{x['rps']:.0f}" for x in r["runs"]),
            f"{r['router_cpu_ms_per_request']:.3f}",
            f"{r['workers_cpu_ms_per_request']:.3f}",
            f"{r['client_cpu_ms_per_request']:.3f}",
        )
    console.print(table)
    m = results["machine"]
    console.print(
        f"machine: {m['cpus']} CPUs, {m['platform']}; load average before {m['loadavg_before'][0]:.2f}, "
        f"after {m['loadavg_after'][0]:.2f}"
    )
    tg = results["targets"]
    if "added_p50_ttft_ms" in tg:
        console.print(
            f"router adds {tg['added_p50_ttft_ms']:+.3f} ms to P50 TTFT (target <= 1 ms): "
            f"{'MET' if tg['added_p50_ttft_met'] else 'MISSED'}"
        )
    if "rps_ratio_vs_sglang_router" in tg:
        console.print(
            f"RPS ours / sglang-router {SGLANG_ROUTER_VERSION}: {tg['rps_ratio_vs_sglang_router']:.2f} "
            f"(target >= 0.5): {'MET' if tg['rps_ratio_met'] else 'MISSED'}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvroute.bench.router_overhead",
        description="router overhead vs direct and vs sglang-router 0.3.2",
    )
    p.add_argument("--workers", type=int, default=2, help="trivial echo workers")
    p.add_argument("--ttft-requests", type=int, default=1500, help="streaming requests per target")
    p.add_argument(
        "--ttft-rate", type=float, default=60.0, help="total arrival rate of the TTFT phase, req/s"
    )
    p.add_argument("--rps-concurrency", type=int, default=64)
    p.add_argument("--rps-seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2, help="RPS rounds (targets alternate within a round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-sglang", action="store_true", help="no sglang-router (no RPS ratio)")
    p.add_argument("--sglang-venv", default=".venv-sglang-router")
    p.add_argument("--log-dir", default="results/router_overhead_logs")
    p.add_argument("--output", default="results/router_overhead.json")
    p.add_argument("--plot", default="results/router_overhead.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from kvroute.router.server import install_uvloop

    if argv[:1] == ["echo-worker"]:
        p = argparse.ArgumentParser(prog="python -m kvroute.bench.router_overhead echo-worker")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--tokens", type=int, default=4, help="SSE token events per streamed answer")
        wargs = p.parse_args(argv[1:])
        if wargs.tokens < 1:
            print("--tokens must be >= 1", file=sys.stderr)
            return 2
        install_uvloop()
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(wargs.port, wargs.tokens, wargs.host))
        return 0
    args = build_parser().parse_args(argv)
    for name in ("workers", "ttft_requests", "rps_concurrency", "rounds"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.ttft_rate <= 0 or args.rps_seconds <= 0:
        print("--ttft-rate and --rps-seconds must be > 0", file=sys.stderr)
        return 2
    install_uvloop()
    results = asyncio.run(run_benchmark(args))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, Path(args.plot))
    print_results(results)
    print(f"wrote {out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
