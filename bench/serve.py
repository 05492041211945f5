"""``kvroute bench serve``: an open-loop Poisson load generator against a live router or worker.

    kvroute bench serve --url http://127.0.0.1:8000 --workload gsp --rate 12 --num 4096

Requests come from ``kvroute.bench.workloads`` and are sent at their arrival times whatever the server
does (open loop), streaming, each with ``X-Request-Id`` = the workload's request id. TTFT (first generated
text) and e2e are measured at the client. The cache hit rate is scraped from the workers' Prometheus
counters (``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``, or vLLM's prefix-cache counters)
before and after the run; the workers are the router's ``/workers`` list, or ``--worker-urls``, or the URL
itself when it is a worker. The report (table, JSON with the same keys as ``kvroute compare``, optional
CSV and plots) comes from ``kvroute.bench.report``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from kvroute.bench import report
from kvroute.bench.workloads import WORKLOADS, WorkloadRequest, make_workload
from kvroute.router.health import normalize_worker_url, parse_engine_metrics

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
WORKER_HEADER = "X-Kvroute-Worker"  # set by kvroute's router: which worker served the request


@dataclass
class RequestRecord:
    """One request as the client saw it (the fields ``kvroute.bench.metrics`` reads)."""

    id: str
    arrival_s: float  # when it was sent, relative to the start of the run
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    ok: bool
    worker: str | None = None
    status: int = 0
    error: str | None = None


def build_payload(endpoint: str, req: WorkloadRequest, model: str | None) -> dict[str, Any]:
    """The request body for ``endpoint``: streaming, fixed output length (ignore_eos), usage requested."""
    if endpoint == "generate":
        body: dict[str, Any] = {
            "text": req.text,
            "stream": True,
            "sampling_params": {"max_new_tokens": req.max_tokens, "ignore_eos": True},
        }
    else:
        body = {
            "max_tokens": req.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.text}]
        else:
            body["prompt"] = req.text
    if model is not None:
        body["model"] = model
    return body


def _event_has_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    if isinstance(choices, list) and choices:
        c = choices[0]
        if isinstance(c, dict):
            delta = c.get("delta")
            if isinstance(delta, dict):
                return bool(delta.get("content"))
            return bool(c.get("text"))
    return bool(event.get("text"))  # SGLang /generate: text so far


def _usage(event: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        return usage["prompt_tokens"], int(details.get("cached_tokens") or 0) if isinstance(
            details, dict
        ) else 0
    meta = event.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
        return meta["prompt_tokens"], int(meta.get("cached_tokens") or 0)
    return None, None


async def send_streaming(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str, t_run: float
) -> RequestRecord:
    """Send one streaming request and time it; never raises for server or network errors."""
    t0 = time.perf_counter()
    arrival = t0 - t_run
    ttft = math.nan
    prompt_tokens = cached_tokens = 0
    try:
        async with session.post(url, json=body, headers={"X-Request-Id": request_id}) as resp:
            worker = resp.headers.get(WORKER_HEADER)
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                return RequestRecord(
                    request_id,
                    arrival,
                    math.nan,
                    time.perf_counter() - t0,
                    0,
                    0,
                    False,
                    worker,
                    resp.status,
                    text,
                )
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for raw in events:
                    raw = raw.strip()
                    if not raw.startswith(b"data:") or raw[5:].strip() == b"[DONE]":
                        continue
                    try:
                        event = json.loads(raw[5:])
                    except ValueError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    if "error" in event:
                        return RequestRecord(
                            request_id,
                            arrival,
                            ttft,
                            time.perf_counter() - t0,
                            0,
                            0,
                            False,
                            worker,
                            resp.status,
                            str(event["error"])[:300],
                        )
                    if math.isnan(ttft) and _event_has_text(event):
                        ttft = time.perf_counter() - t0
                    p, c = _usage(event)
                    if p is not None:
                        prompt_tokens, cached_tokens = p, c or 0
            e2e = time.perf_counter() - t0
            return RequestRecord(
                request_id, arrival, ttft, e2e, prompt_tokens, cached_tokens, True, worker, 200
            )
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return RequestRecord(
            request_id,
            arrival,
            math.nan,
            time.perf_counter() - t0,
            0,
            0,
            False,
            None,
            0,
            f"{type(exc).__name__}: {exc}",
        )


async def discover_workers(session: aiohttp.ClientSession, url: str, admin_token: str | None) -> list[str]:
    """The router's /workers list (with the admin token), or [url] when url is itself a worker."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        async with session.get(
            f"{url}/workers", headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            if r.status == 200:
                data = await r.json(content_type=None)
                return [w["url"] for w in data.get("workers", []) if isinstance(w, dict) and "url" in w]
            if r.status in (401, 403):
                raise SystemExit(
                    f"kvroute bench serve: {url}/workers needs the router's --admin-token "
                    "(or give --worker-urls)"
                )
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        pass
    return [url]


async def scrape_cache_counters(
    session: aiohttp.ClientSession, workers: Sequence[str]
) -> tuple[float, float] | None:
    """(cached prompt tokens, prompt tokens) summed over the workers' /metrics; None if any is unreadable."""
    cached = prompt = 0.0
    for w in workers:
        try:
            async with session.get(f"{w}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return None
                metrics = parse_engine_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        if "sglang:prompt_tokens_total" in metrics:
            prompt += metrics["sglang:prompt_tokens_total"]
            cached += metrics.get("sglang:cached_tokens_total", 0.0)
        elif "vllm:prefix_cache_queries_total" in metrics:
            prompt += metrics["vllm:prefix_cache_queries_total"]
            cached += metrics.get("vllm:prefix_cache_hits_total", 0.0)
        else:
            return None
    return cached, prompt


async def server_labels(session: aiohttp.ClientSession, url: str, workers: Sequence[str]) -> tuple[str, str]:
    """(policy, eviction) as the servers report them ('unknown' when they do not)."""
    policy = eviction = "unknown"
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            data = await r.json(content_type=None)
            policy = str(data.get("policy", policy)) if isinstance(data, dict) else policy
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        pass
    if workers:
        try:
            async with session.get(
                f"{workers[0]}/get_model_info", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                data = await r.json(content_type=None)
                eviction = str(data.get("eviction", eviction)) if isinstance(data, dict) else eviction
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
    if policy == "unknown" and list(workers) == [url]:
        policy = "direct"
    return policy, eviction


@dataclass
class ServeConfig:
    url: str
    workload: str = "gsp"
    rate: float = 12.0
    num: int | None = None
    workload_options: dict[str, Any] | None = None
    endpoint: str = "completions"
    model: str | None = None
    worker_urls: list[str] | None = None
    admin_token: str | None = None
    policy_label: str | None = None
    eviction_label: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    max_connections: int = 4096
    show_progress: bool = True


async def run_serve(cfg: ServeConfig) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run the load; returns (report row, per-request records)."""
    if cfg.endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {cfg.endpoint!r}; choose one of {', '.join(ENDPOINTS)}")
    if cfg.num is not None and cfg.num < 1:
        raise ValueError(f"--num must be >= 1, got {cfg.num}")
    base = normalize_worker_url(cfg.url)  # check the cheap things before generating the workload
    options = dict(cfg.workload_options or {})
    options.setdefault("rate", cfg.rate)
    options.setdefault("seed", cfg.seed)
    requests = make_workload(cfg.workload, **options)
    if cfg.num is not None:
        requests = requests[: cfg.num]
    target = base + ENDPOINTS[cfg.endpoint]
    connector = aiohttp.TCPConnector(limit=cfg.max_connections)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        workers = (
            [normalize_worker_url(u) for u in cfg.worker_urls]
            if cfg.worker_urls
            else await discover_workers(session, base, cfg.admin_token)
        )
        policy, eviction = await server_labels(session, base, workers)
        before = await scrape_cache_counters(session, workers)
        records = await _drive(session, target, requests, cfg)
        after = await scrape_cache_counters(session, workers)
    row = report.run_row(
        records,
        workload=cfg.workload,
        policy=cfg.policy_label or policy,
        eviction=cfg.eviction_label or eviction,
        worker_ids=None,
        rate=cfg.rate,
        num=len(requests),
        endpoint=cfg.endpoint,
        url=base,
        workers=len(workers),
    )
    row["client_hit_rate"] = row["hit_rate"]  # from the usage the server reported per request
    if before is not None and after is not None and after[1] > before[1]:
        row["hit_rate"] = (after[0] - before[0]) / (after[1] - before[1])
        row["hit_rate_source"] = "worker_metrics"
    else:
        row["hit_rate_source"] = "usage"
    return row, records


async def _drive(
    session: aiohttp.ClientSession, target: str, requests: Sequence[WorkloadRequest], cfg: ServeConfig
) -> list[RequestRecord]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    records: list[RequestRecord] = []
    in_flight = 0
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("in flight {task.fields[in_flight]}  errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        disable=not cfg.show_progress,
    )
    errors = 0

    async def one(req: WorkloadRequest, t_run: float) -> None:
        nonlocal in_flight, errors
        in_flight += 1
        rec = await send_streaming(
            session, target, build_payload(cfg.endpoint, req, cfg.model), req.id, t_run
        )
        in_flight -= 1
        errors += 0 if rec.ok else 1
        records.append(rec)
        progress.update(task, advance=1, in_flight=in_flight, errors=errors)

    with progress:
        task = progress.add_task(
            f"{cfg.workload} @ {cfg.rate:g} req/s", total=len(requests), in_flight=0, errors=0
        )
        t_run = time.perf_counter()
        first = requests[0].arrival_s if requests else 0.0
        tasks = []
        for req in requests:  # open loop: send at the arrival time whatever happened before
            delay = (req.arrival_s - first) - (time.perf_counter() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, t_run)))
        await asyncio.gather(*tasks)
    return records


# ---- CLI ---------------------------------------------------------------------------------------------
def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--workload-option wants key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="router (or worker) base URL")
    p.add_argument("--workload", default="gsp", choices=list(WORKLOADS))
    p.add_argument(
        "--workload-option",
        action="append",
        type=_option,
        default=[],
        metavar="K=V",
        help="workload option, repeatable (e.g. prefix_ratio=0.7, order=round_robin)",
    )
    p.add_argument(
        "--rate", type=float, default=12.0, help="Poisson arrival rate, requests/s (inf: all at once)"
    )
    p.add_argument("--num", type=int, default=None, help="send only the first N requests of the workload")
    p.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS))
    p.add_argument("--model", default=None, help="model name to put into requests (default: none)")
    p.add_argument(
        "--worker-urls", nargs="*", default=None, help="workers to scrape (default: router /workers)"
    )
    p.add_argument("--admin-token", default=None, help="the router's admin token, to read /workers")
    p.add_argument(
        "--policy-label", default=None, help="policy name for the report (default: from the router)"
    )
    p.add_argument(
        "--eviction-label", default=None, help="eviction name for the report (default: from a worker)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/serve.json", help="JSON file (a list with one row)")
    p.add_argument("--csv", default=None, help="also write a CSV")
    p.add_argument("--records", default=None, help="also write per-request records (JSON lines)")
    p.add_argument("--plot-dir", default=None, help="also draw the report's bar plots here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if not (args.rate > 0):
        print("kvroute bench serve: --rate must be > 0", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("kvroute bench serve: --timeout must be > 0", file=sys.stderr)
        return 2
    cfg = ServeConfig(
        url=args.url,
        workload=args.workload,
        rate=args.rate,
        num=args.num,
        workload_options=dict(args.workload_option),
        endpoint=args.endpoint,
        model=args.model,
        worker_urls=args.worker_urls,
        admin_token=args.admin_token,
        policy_label=args.policy_label,
        eviction_label=args.eviction_label,
        timeout_s=args.timeout,
        seed=args.seed,
        show_progress=not args.no_progress,
    )
    from kvroute.router.server import install_uvloop

    install_uvloop()
    try:
        row, records = asyncio.run(run_serve(cfg))
    except ValueError as exc:
        print(f"kvroute bench serve: {exc}", file=sys.stderr)
        return 2
    report.print_table([row], title=f"bench serve: {args.url}")
    extra = (
        f"hit rate from {row['hit_rate_source']}; client-side (usage) hit rate {row['client_hit_rate']:.1%}"
    )
    print(f"{extra}; errors {int(row['errors'])} of {int(row['requests'])}")
    print(f"wrote {report.write_json([row], args.output)}")
    if args.csv:
        print(f"wrote {report.write_csv([row], args.csv)}")
    if args.records:
        with open(args.records, "w") as f:
            for r in records:
                f.write(
                    json.dumps(
                        {
                            k: (None if isinstance(v, float) and math.isnan(v) else v)
                            for k, v in asdict(r).items()
                        }
                    )
                    + "\n"
                )
        print(f"wrote {args.records}")
    if args.plot_dir:
        files = report.plot_bars([row], args.plot_dir)
        print(f"plots: {len(files)} PNG files in {args.plot_dir}")
    return 0 if row["errors"] < row["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
