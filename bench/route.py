"""``kvroute bench route``: routing decision latency per policy, and the prefix index's memory.

For every policy x worker count x prompt size: a ``Router`` whose prefix index already holds
``--index-prompts`` prompts (by default the index is sized to keep all of them; ``--index-max-chars``
bounds it instead, so inserts go through its LRU trimming), warmed up with routed-and-finished
requests so learning policies have fitted models, then timed on ``--decisions`` fresh requests while
about two requests per worker stay in flight.

Latencies per request (wall clock, ``time.perf_counter_ns``; and the decision's CPU time,
``time.thread_time_ns``, which leaves out time the process spends descheduled on a busy machine):
- ``decision``: ``Router.decide`` — prefix-index match + worker views + ``policy.choose`` (what the
  seed 004 paper reports as its 1.45 ms routing decision);
- ``route``: the full ``Router.route`` (decision + dispatch bookkeeping + index insert, including any
  LRU trimming the insert triggers).

The timed index's memory after the fill (``tracemalloc``, off while timing) is reported as
``index_mb``. Index memory at the 10M bound: a fresh ``PrefixIndex(--memory-max-chars)`` (10M by
default) filled with the same prompts until full and trimming, measured with ``tracemalloc`` (every
allocation the index holds, including its PyMem per-node arrays and the heap of trim candidates) and,
as a cross-check, the process RSS growth, in a fresh child process. Reported per stored character.

Prompts: ``--groups`` prefix groups; each prompt is half group-shared prefix, half unique suffix, cut
from a random word corpus (seeded), so the index holds a realistic mix of shared and private paths.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from kvroute.cython_ext.prefix_index import PrefixIndex
from kvroute.router import POLICY_NAMES, Request, Router

CHARS_PER_TOKEN = 5.0  # corpus words average ~4 letters + a space


@dataclass
class RouteResult:
    policy: str
    workers: int
    prompt_chars: int
    p50_us: float
    p99_us: float
    route_p50_us: float
    route_p99_us: float
    cpu_p50_us: float
    cpu_p99_us: float
    index_chars: int
    index_prompts: int
    index_mb: float
    decisions: int


@dataclass
class MemoryResult:
    max_chars: int
    prompt_chars: int
    stored_chars: int
    nodes: int
    tracemalloc_bytes: int
    tracemalloc_bytes_per_char: float
    rss_bytes: int
    rss_bytes_per_char: float
    fill_s: float


class PromptSource:
    """Deterministic prompts: a group-shared first half and a unique second half."""

    def __init__(self, prompt_chars: int, groups: int, seed: int) -> None:
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(5000)]
        corpus_len = max(2_000_000, 4 * prompt_chars)
        parts: list[str] = []
        size = 0
        while size < corpus_len:
            word = vocab[rng.randrange(len(vocab))]
            parts.append(word)
            size += len(word) + 1
        self.corpus = " ".join(parts)
        self.prompt_chars = prompt_chars
        self.half = prompt_chars // 2
        self.rng = rng
        span = len(self.corpus) - prompt_chars
        self.group_offsets = [rng.randrange(span) for _ in range(groups)]

    def prompt(self) -> str:
        rng = self.rng
        g = self.group_offsets[rng.randrange(len(self.group_offsets))]
        tail = rng.randrange(len(self.corpus) - self.prompt_chars)
        rest = self.prompt_chars - self.half
        return f"{self.corpus[g : g + self.half]}{self.corpus[tail : tail + rest]}"


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not enabled,
        transient=False,
        redirect_stdout=False,
        console=None if enabled else None,
    )


def fill_index(
    index: PrefixIndex,
    source: PromptSource,
    workers: Sequence[str],
    n: int,
    seed: int,
    tick: Callable[[int], None] | None = None,
) -> None:
    rng = random.Random(seed)
    now = 0.0
    for i in range(n):
        now += 0.001
        index.insert(source.prompt(), workers[rng.randrange(len(workers))], now)
        if tick is not None and i % 1000 == 999:
            tick(1000)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


def _requests(source: PromptSource, prefix: str) -> Iterator[Request]:
    i = 0
    while True:
        text = source.prompt()
        yield Request(f"{prefix}{i}", text, max(1, int(len(text) / CHARS_PER_TOKEN)), 16)
        i += 1


def bench_policy(
    policy: str,
    index: PrefixIndex,
    source: PromptSource,
    workers: Sequence[str],
    decisions: int,
    warmup: int,
    seed: int,
    index_prompts: int,
    index_bytes: int,
) -> RouteResult:
    router = Router(policy, workers, max_index_chars=index.max_chars, seed=seed)
    router.index = index  # the prefilled index (shared across policies of one configuration)
    reqs = _requests(source, f"{policy}-")
    window: deque[tuple[str, float, int]] = deque()
    keep = 2 * len(workers)
    now = 1000.0
    latency_s = 0.05

    def retire(force: bool = False) -> None:
        while window and (force or len(window) > keep):
            rid, started, tokens = window.popleft()
            router.first_token(rid, now - latency_s / 2)
            router.finish(rid, now, True, prompt_tokens=tokens)

    for _ in range(warmup):  # learning policies fit their models here
        now += 0.005
        req = next(reqs)
        router.route(req, now)
        window.append((req.id, now, req.est_tokens))
        retire()
    train = getattr(router.policy, "train_until_ready", None)
    if train is not None:
        train()
    decide_ns: list[int] = []
    decide_cpu_ns: list[int] = []
    route_ns: list[int] = []
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns  # excludes time the thread is descheduled (a shared, busy machine)
    gc.collect()
    for _ in range(decisions):
        now += 0.005
        req = next(reqs)
        c0 = cpu_clock()
        t0 = clock()
        router.decide(req, now)
        t1 = clock()
        c1 = cpu_clock()
        router.route(req, now)
        t2 = clock()
        decide_ns.append(t1 - t0)
        decide_cpu_ns.append(c1 - c0)
        route_ns.append(t2 - t1)
        window.append((req.id, now, req.est_tokens))
        retire()
    retire(force=True)
    decide_ns.sort()
    decide_cpu_ns.sort()
    route_ns.sort()
    return RouteResult(
        policy=policy,
        workers=len(workers),
        prompt_chars=source.prompt_chars,
        p50_us=round(_percentile(decide_ns, 0.50) / 1000.0, 2),
        p99_us=round(_percentile(decide_ns, 0.99) / 1000.0, 2),
        route_p50_us=round(_percentile(route_ns, 0.50) / 1000.0, 2),
        route_p99_us=round(_percentile(route_ns, 0.99) / 1000.0, 2),
        cpu_p50_us=round(_percentile(decide_cpu_ns, 0.50) / 1000.0, 2),
        cpu_p99_us=round(_percentile(decide_cpu_ns, 0.99) / 1000.0, 2),
        index_chars=index.stored_chars,
        index_prompts=index_prompts,
        index_mb=round(index_bytes / 2**20, 1),
        decisions=decisions,
    )


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_memory(
    max_chars: int,
    prompt_chars: int,
    n_prompts: int,
    groups: int,
    n_workers: int,
    seed: int,
    tick: Callable[[int], None] | None = None,
) -> MemoryResult:
    source = PromptSource(prompt_chars, groups, seed)
    workers = [f"w{i}" for i in range(n_workers)]
    gc.collect()
    rss0 = _rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    index = PrefixIndex(max_chars)
    fill_index(index, source, workers, n_prompts, seed, tick)
    fill_s = time.perf_counter() - t0
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_bytes()
    traced = current - base
    stored = max(1, index.stored_chars)
    result = MemoryResult(
        max_chars=max_chars,
        prompt_chars=prompt_chars,
        stored_chars=index.stored_chars,
        nodes=index.node_count,
        tracemalloc_bytes=traced,
        tracemalloc_bytes_per_char=round(traced / stored, 2),
        rss_bytes=rss1 - rss0,
        rss_bytes_per_char=round((rss1 - rss0) / stored, 2),
        fill_s=round(fill_s, 2),
    )
    del index
    gc.collect()
    return result


def _parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{name} values must be positive, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute bench route", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated (default: all)")
    p.add_argument("--workers", default="4,16,64", help="worker counts (default 4,16,64)")
    p.add_argument(
        "--prompt-chars", default="1000,8000", help="prompt sizes in characters (default 1000,8000)"
    )
    p.add_argument("--index-prompts", type=int, default=100_000, help="prompts inserted before timing")
    p.add_argument(
        "--index-max-chars",
        type=int,
        default=None,
        help="bound of the timed index (default: large enough to keep every --index-prompts prompt)",
    )
    p.add_argument(
        "--memory-max-chars", type=int, default=10_000_000, help="max_chars of the memory measurement (10M)"
    )
    p.add_argument("--groups", type=int, default=1000, help="prefix groups in the prompt mix")
    p.add_argument("--decisions", type=int, default=2000, help="timed requests per configuration")
    p.add_argument("--warmup", type=int, default=1500, help="routed+finished requests before timing")
    p.add_argument(
        "--memory-prompts",
        type=int,
        default=None,
        help="prompts for the memory fill (default: --index-prompts)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the index memory measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 4,16 workers, 1k chars, 3000 index prompts, 200 decisions, 1M-char memory index",
    )
    p.add_argument("--json", action="store_true", help="print results as JSON instead of tables")
    p.add_argument("--out", default=None, help="also write the JSON results to this file")
    p.add_argument("--plot", default=None, help="write a PNG bar chart of p50/p99 per policy here")
    return p


def plot(results: Sequence[RouteResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r.workers, r.prompt_chars) for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 4), squeeze=False)
    for ax, (w, c) in zip(axes[0], configs, strict=True):
        rows = {r.policy: r for r in results if (r.workers, r.prompt_chars) == (w, c)}
        xs = range(len(policies))
        ax.bar(
            [x - 0.2 for x in xs], [rows[p].p50_us if p in rows else 0 for p in policies], 0.4, label="p50"
        )
        ax.bar(
            [x + 0.2 for x in xs], [rows[p].p99_us if p in rows else 0 for p in policies], 0.4, label="p99"
        )
        ax.set_xticks(list(xs), policies, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{w} workers, {c}-char prompts", fontsize=9)
        ax.set_ylabel("decision latency (us)")
        ax.set_yscale("log")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        print(
            f"kvroute bench route: unknown policies {unknown}; valid: {', '.join(POLICY_NAMES)}",
            file=sys.stderr,
        )
        return 2
    try:
        workers_list = _parse_ints(args.workers, "workers")
        sizes = _parse_ints(args.prompt_chars, "prompt-chars")
    except ValueError as exc:
        print(f"kvroute bench route: {exc}", file=sys.stderr)
        return 2
    index_prompts, decisions, warmup = args.index_prompts, args.decisions, args.warmup
    index_max_chars, memory_max_chars = args.index_max_chars, args.memory_max_chars
    if args.quick:
        workers_list, sizes = [4, 16], [1000]
        index_prompts, decisions, warmup, memory_max_chars = 3000, 200, 300, 1_000_000
    for name, value in (
        ("index-prompts", index_prompts),
        ("decisions", decisions),
        ("index-max-chars", 1 if index_max_chars is None else index_max_chars),
        ("memory-max-chars", memory_max_chars),
        ("groups", args.groups),
    ):
        if value <= 0:
            print(f"kvroute bench route: --{name} must be positive, got {value}", file=sys.stderr)
            return 2
    if warmup < 0 or max(workers_list) > 256:
        print("kvroute bench route: --warmup must be >= 0 and at most 256 workers", file=sys.stderr)
        return 2
    memory_prompts = args.memory_prompts or index_prompts
    show = not args.json and sys.stderr.isatty()
    results: list[RouteResult] = []
    memory: list[MemoryResult] = []
    with _progress(show) as progress:
        for size in sizes:
            for n_workers in workers_list:
                workers = [f"w{i}" for i in range(n_workers)]
                source = PromptSource(size, args.groups, args.seed)
                # default: room for every prompt (+ the timed ones), so the index really holds them all
                bound = index_max_chars or (index_prompts + warmup + 2 * decisions + 1) * size
                task = progress.add_task(f"fill index {n_workers}w x {size}c", total=index_prompts)
                gc.collect()
                tracemalloc.start()  # the index's memory: everything allocated by the fill that it keeps
                base, _ = tracemalloc.get_traced_memory()
                index = PrefixIndex(bound)
                fill_index(
                    index, source, workers, index_prompts, args.seed, lambda k, t=task: progress.advance(t, k)
                )
                gc.collect()
                index_bytes = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()  # not while timing
                progress.update(task, completed=index_prompts)
                task = progress.add_task(f"time {n_workers}w x {size}c", total=len(policies))
                for policy in policies:
                    results.append(
                        bench_policy(
                            policy,
                            index,
                            source,
                            workers,
                            decisions,
                            warmup,
                            args.seed,
                            index_prompts,
                            index_bytes,
                        )
                    )
                    progress.advance(task)
                del index
                gc.collect()
        if not args.no_memory:
            # a fresh process per measurement, so RSS growth is the index's and not reused free memory
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as pool:
                for size in sizes:
                    task = progress.add_task(f"memory {size}c (child process)", total=None)
                    memory.append(
                        pool.submit(
                            measure_memory, memory_max_chars, size, memory_prompts, args.groups, 16, args.seed
                        ).result()
                    )
                    progress.update(task, total=1, completed=1)
    payload = {
        "results": [asdict(r) for r in results],
        "memory": [asdict(m) for m in memory],
        "machine": _machine(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot and results:
        plot(results, args.plot)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        _print_tables(results, memory)
    return 0


def _machine() -> dict[str, object]:
    import os
    import platform

    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}


def _print_tables(results: Sequence[RouteResult], memory: Sequence[MemoryResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    table = Table(
        title="routing latency (us): decision = match + views + choose; route = decision + dispatch"
    )
    for col in (
        "policy",
        "workers",
        "prompt chars",
        "p50",
        "p99",
        "cpu p50",
        "cpu p99",
        "route p50",
        "route p99",
        "index MB",
    ):
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for r in results:
        table.add_row(
            r.policy,
            str(r.workers),
            str(r.prompt_chars),
            f"{r.p50_us:.1f}",
            f"{r.p99_us:.1f}",
            f"{r.cpu_p50_us:.1f}",
            f"{r.cpu_p99_us:.1f}",
            f"{r.route_p50_us:.1f}",
            f"{r.route_p99_us:.1f}",
            f"{r.index_mb:.0f}",
        )
    console.print(table)
    if memory:
        mt = Table(title="prefix index memory")
        for col in (
            "max chars",
            "prompt chars",
            "stored chars",
            "nodes",
            "tracemalloc B/char",
            "RSS B/char",
            "fill s",
        ):
            mt.add_column(col, justify="right", no_wrap=True)
        for m in memory:
            mt.add_row(
                str(m.max_chars),
                str(m.prompt_chars),
                str(m.stored_chars),
                str(m.nodes),
                f"{m.tracemalloc_bytes_per_char:.2f}",
                f"{m.rss_bytes_per_char:.2f}",
                f"{m.fill_s:.1f}",
            )
        console.print(mt)
    summary = statistics.median([r.p50_us for r in results]) if results else float("nan")
    console.print(f"median decision p50 over all rows: {summary:.1f} us")


if __name__ == "__main__":
    raise SystemExit(main())
