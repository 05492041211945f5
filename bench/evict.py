"""``kvroute bench evict``: replay token traces through one cache per eviction policy.

One request at a time: ``match_prefix(prompt)`` (its hit tokens count), then ``evict(shortfall)``
(timed: this is where eviction cost is measured, exactly as the simulator calls it), then
``insert(prompt + output)``, which then needs no eviction. Prints a table (policy, token hit rate,
evicted tokens, ns per evicted token, requests/s), or ``--json``; ``--plot`` draws the figures.

``--sweep`` replays the trace at capacities 150k..210k and plots hit rate against capacity;
``--latency`` measures single-page evictions on a 1M-token cache holding ~100k nodes (p50/p99).

Reading the costs: ``lru`` frees a whole leaf (hundreds to thousands of tokens on GSP) per heap pop,
``rlt`` makes one uniform draw per evicted token (Algorithm 1), so per evicted token lru is cheaper
by construction; ``rlt-leaf`` keeps RLT's marks and phases but a draw takes a whole random unmarked
leaf, so like lru it removes whole leaves per call. ``us/evict call`` shows the cost per call as the
paper reported it. ``lru-py``
follows SGLang 0.4.6's Python ``evict`` (collect every leaf, heapify, pop) minus the KV-pool free, so
it is if anything faster than SGLang's own. The Cython caches get int64 arrays, ``lru-py`` lists.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from kvroute.bench.traces import GSP_LENGTHS, VOCAB, Request, gsp
from kvroute.cache import LruPyCache, RadixCache
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

POLICIES = ("lru", "rlt", "rlt-leaf", "opt", "lru-py")
TRACES = {"gsp-rr": ("round_robin", 190_000), "gsp-random": ("random", 200_000)}
SWEEP_DEFAULT = (150_000, 210_000, 5_000)


@dataclass
class ReplayResult:
    trace: str
    capacity: int
    policy: str
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    evicted_tokens: int
    ns_per_evicted_token: float
    us_per_evict_call: float
    evict_calls: int
    requests_per_s: float
    requests: int
    seconds: float
    # per evict call, ns (not serialised): identical replays make identical calls, so the
    # element-wise minimum over repeats removes time other processes took from this one
    call_ns: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "call_ns"}


def make_cache(policy: str, capacity: int, paths: Sequence[np.ndarray], seed: int, page_size: int = 1):
    if policy == "opt":
        return RadixCache.with_future(capacity, paths, page_size=page_size)
    if policy == "lru-py":
        return LruPyCache(capacity, page_size=page_size)
    return RadixCache(capacity, page_size=page_size, policy=policy, seed=seed)


def replay(
    trace_name: str,
    requests: Sequence[Request],
    policy: str,
    capacity: int,
    seed: int,
    on_progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through a fresh cache; eviction time is measured around ``evict`` only."""
    paths = [np.asarray(p + o, dtype=np.int64) for p, o in requests]
    prompts = [np.asarray(p, dtype=np.int64) for p, _ in requests]
    if policy == "lru-py":  # the pure-Python tree works on lists, as SGLang's does
        prompts = [p for p, _ in requests]
        paths_in: Sequence = [p + o for p, o in requests]
    else:
        paths_in = paths
    cache = make_cache(policy, capacity, paths, seed)
    hits = prompt_tokens = evicted = calls = 0
    evict_ns = 0
    call_ns: list[int] = []
    clock = time.perf_counter_ns
    start = clock()
    for i, (prompt, path) in enumerate(zip(prompts, paths_in, strict=True)):
        hit, _ = cache.match_prefix(prompt)
        hits += hit
        prompt_tokens += len(prompt)
        # outputs are new tokens and the prompt's tail past the hit is not cached (the walk stopped
        # there), so the insert stores len(path) - hit tokens
        shortfall = len(path) - hit - (cache.capacity_tokens - cache.total_size)
        if shortfall > 0:
            t0 = clock()
            evicted += cache.evict(shortfall)
            call_ns.append(clock() - t0)
            calls += 1
        cache.insert(path)
        if on_progress is not None and (i + 1) % 64 == 0:
            on_progress(64)
    seconds = (clock() - start) / 1e9
    evict_ns = sum(call_ns)
    if on_progress is not None:
        on_progress(len(requests) % 64)
    return ReplayResult(
        trace=trace_name,
        capacity=capacity,
        policy=policy,
        hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
        hit_tokens=hits,
        prompt_tokens=prompt_tokens,
        evicted_tokens=evicted,
        ns_per_evicted_token=evict_ns / evicted if evicted else 0.0,
        us_per_evict_call=evict_ns / calls / 1000 if calls else 0.0,
        evict_calls=calls,
        requests_per_s=len(requests) / seconds if seconds > 0 else float("inf"),
        requests=len(requests),
        seconds=seconds,
        call_ns=np.asarray(call_ns, dtype=np.int64),
    )


def build_trace(name: str, args: argparse.Namespace) -> list[Request]:
    order, _ = TRACES[name]
    return gsp(
        groups=args.groups,
        queries_per_group=args.queries,
        lengths=GSP_LENGTHS,
        prefix_ratio=args.prefix_ratio,
        order=order,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def run_replays(args: argparse.Namespace, console: Console) -> list[ReplayResult]:
    results: list[ReplayResult] = []
    jobs: list[tuple[str, int, list[Request]]] = []
    for name in args.trace:
        trace = build_trace(name, args)
        if args.sweep:
            lo, hi, step = args.sweep_range
            caps = list(range(lo, hi + 1, step))
        else:
            caps = [args.capacity if args.capacity is not None else TRACES[name][1]]
        jobs.extend((name, cap, trace) for cap in caps)
    repeat = args.repeat if args.repeat is not None else (1 if args.sweep else 3)
    with _progress(console) as progress:
        total = sum(len(trace) for _, _, trace in jobs) * len(args.policies) * repeat
        task = progress.add_task("replaying", total=total)
        for name, cap, trace in jobs:
            for policy in args.policies:
                progress.update(task, description=f"{name} @ {cap:,} {policy}")
                runs = []
                for k in range(repeat):
                    progress.update(task, description=f"{name} @ {cap:,} {policy} ({k + 1}/{repeat})")
                    runs.append(
                        replay(name, trace, policy, cap, args.seed, lambda n: progress.advance(task, n))
                    )
                results.append(best_of(runs))
    return results


def best_of(runs: Sequence[ReplayResult]) -> ReplayResult:
    """Combine repeats of one replay. They make the same decisions (seeded), hence the same evict
    calls; each call's time is its minimum over the repeats (other processes on a shared machine only
    ever add time, as timeit assumes), requests/s comes from the fastest repeat."""
    first = runs[0]
    for r in runs:
        same = r.hit_tokens == first.hit_tokens and r.evicted_tokens == first.evicted_tokens
        if not same or r.evict_calls != first.evict_calls:
            raise RuntimeError(f"{first.policy}: repeats of one replay made different decisions")
    calls = np.min(np.stack([r.call_ns for r in runs]), axis=0) if first.evict_calls else np.zeros(0)
    evict_ns = float(calls.sum())
    fastest = min(runs, key=lambda r: r.seconds)
    return replace(
        first,
        ns_per_evicted_token=evict_ns / first.evicted_tokens if first.evicted_tokens else 0.0,
        us_per_evict_call=evict_ns / first.evict_calls / 1000 if first.evict_calls else 0.0,
        requests_per_s=fastest.requests_per_s,
        seconds=fastest.seconds,
        call_ns=calls,
    )


def print_table(results: Sequence[ReplayResult], console: Console) -> None:
    table = Table(title="kvroute bench evict (one request at a time, evicting only the shortfall)")
    for col in (
        "trace",
        "capacity",
        "policy",
        "hit rate",
        "evicted tokens",
        "ns/evicted token",
        "us/evict call",
        "requests/s",
    ):
        table.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for r in results:
        table.add_row(
            r.trace,
            f"{r.capacity:,}",
            r.policy,
            f"{100 * r.hit_rate:.2f}%",
            f"{r.evicted_tokens:,}",
            f"{r.ns_per_evicted_token:.2f}",
            f"{r.us_per_evict_call:.2f}",
            f"{r.requests_per_s:,.0f}",
        )
    console.print(table)


def plot_replays(results: Sequence[ReplayResult], path: str, sweep: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    if sweep:
        fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
        for ax, name in zip(axes[0], traces, strict=True):
            for policy in policies:
                rows = sorted(
                    (r for r in results if r.trace == name and r.policy == policy), key=lambda r: r.capacity
                )
                ax.plot(
                    [r.capacity / 1000 for r in rows],
                    [100 * r.hit_rate for r in rows],
                    marker="o",
                    label=policy,
                )
            ax.set_title(f"{name}: token hit rate vs cache size")
            ax.set_xlabel("cache capacity (k tokens)")
            ax.set_ylabel("token hit rate (%)")
            ax.grid(alpha=0.3)
            ax.legend()
    else:
        fig, axes = plt.subplots(len(traces), 2, figsize=(11, 4 * len(traces)), squeeze=False)
        for row, name in zip(axes, traces, strict=True):
            rows = [r for r in results if r.trace == name]
            labels = [r.policy for r in rows]
            row[0].bar(labels, [100 * r.hit_rate for r in rows], color="tab:blue")
            row[0].set_title(f"{name} @ {rows[0].capacity:,}: token hit rate")
            row[0].set_ylabel("%")
            row[1].bar(labels, [r.ns_per_evicted_token for r in rows], color="tab:orange")
            row[1].set_yscale("log")
            row[1].set_title(f"{name}: ns per evicted token (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- --latency
@dataclass
class LatencyResult:
    policy: str
    capacity: int
    page_size: int
    nodes_before: int
    nodes_after: int
    evictions: int
    p50_us: float
    p99_us: float
    max_us: float


def _count_nodes(cache) -> int:
    if isinstance(cache, LruPyCache):
        count, stack = 0, list(cache.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
    return len(cache._nodes())


def latency(
    policy: str,
    capacity: int,
    segment: int,
    page_size: int,
    evictions: int,
    seed: int,
    on_progress: Callable[[int], None] | None = None,
) -> LatencyResult:
    """Fill a cache to ``capacity`` with a random tree (new ``segment``-token branches off random
    points of earlier sequences, ~1.7 nodes per branch), then time ``evictions`` single-page
    evictions; every ``segment`` freed tokens are refilled (untimed) with one more such branch, so the
    tree keeps its size and shape. The garbage collector stays on, as in a server.
    """
    rng = random.Random(seed)
    cache = make_cache(policy, capacity, [], seed, page_size)
    # tuples of ints drop out of the cyclic GC, so the bench's own bookkeeping adds no GC pauses
    seqs: list[tuple[int, ...]] = []

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    def branch(n_new: int) -> tuple[int, ...]:
        if not seqs or rng.random() < 0.02:
            return fresh(n_new)
        base = seqs[rng.randrange(len(seqs))]
        cut = rng.randrange(0, min(len(base), 400) // page_size + 1) * page_size
        return base[:cut] + fresh(n_new)

    while cache.total_size + segment <= capacity:
        seq = branch(segment)
        cache.insert(seq)
        seqs.append(seq)
        if len(seqs) > 20_000:
            seqs.pop(rng.randrange(len(seqs)))
    nodes_before = _count_nodes(cache)
    samples = np.empty(evictions, dtype=np.int64)
    clock = time.perf_counter_ns
    pending = 0
    gc.collect()
    for i in range(evictions):
        t0 = clock()
        pending += cache.evict(page_size)
        samples[i] = clock() - t0
        while pending >= segment:  # refill as the tree was built, so its shape and size stay put
            seq = branch(segment)
            pending -= cache.insert(seq)
            seqs[rng.randrange(len(seqs))] = seq
        if on_progress is not None and (i + 1) % 100 == 0:
            on_progress(100)
    us = samples / 1000.0
    return LatencyResult(
        policy=policy,
        capacity=capacity,
        page_size=page_size,
        nodes_before=nodes_before,
        nodes_after=_count_nodes(cache),
        evictions=evictions,
        p50_us=float(np.percentile(us, 50)),
        p99_us=float(np.percentile(us, 99)),
        max_us=float(us.max()),
    )


def run_latency(args: argparse.Namespace, console: Console) -> list[LatencyResult]:
    policies = [p for p in args.policies if p != "opt"]  # opt needs a future trace; not an online policy
    out: list[LatencyResult] = []
    with _progress(console) as progress:
        for policy in policies:
            n = args.latency_evictions if policy != "lru-py" else max(1, args.latency_evictions // 50)
            task = progress.add_task(f"latency {policy}", total=n)
            out.append(
                latency(
                    policy,
                    args.latency_capacity,
                    args.latency_segment,
                    args.page_size,
                    n,
                    args.seed,
                    lambda k, t=task: progress.advance(t, k),
                )
            )
    return out


def print_latency(results: Sequence[LatencyResult], console: Console) -> None:
    table = Table(title="single-page eviction latency on a full cache")
    for col in ("policy", "capacity", "page", "nodes", "evictions", "p50 us", "p99 us", "max us"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy,
            f"{r.capacity:,}",
            str(r.page_size),
            f"{r.nodes_before:,}->{r.nodes_after:,}",
            f"{r.evictions:,}",
            f"{r.p50_us:.2f}",
            f"{r.p99_us:.2f}",
            f"{r.max_us:.1f}",
        )
    console.print(table)


def plot_latency(results: Sequence[LatencyResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = np.arange(len(results))
    ax.bar(xs - 0.2, [r.p50_us for r in results], width=0.4, label="p50")
    ax.bar(xs + 0.2, [r.p99_us for r in results], width=0.4, label="p99")
    ax.axhline(20, color="red", linestyle="--", linewidth=1, label="20 us target")
    ax.set_xticks(xs, [r.policy for r in results])
    ax.set_yscale("log")
    ax.set_ylabel("us per single-page evict (log)")
    first = results[0]
    ax.set_title(f"evict one page: {first.capacity:,}-token cache, ~{first.nodes_before:,} nodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _sweep_range(text: str) -> tuple[int, int, int]:
    parts = text.split(":")
    try:
        lo, hi, step = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI:STEP integers, got {text!r}") from None
    if lo <= 0 or hi < lo or step <= 0:
        raise argparse.ArgumentTypeError(f"need 0 < LO <= HI and STEP > 0, got {text!r}")
    return lo, hi, step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench evict",
        description="Replay token traces through the cache core, one cache per eviction policy.",
    )
    parser.add_argument(
        "--trace",
        nargs="+",
        choices=sorted(TRACES),
        default=list(TRACES),
        help="traces to replay (default: both; gsp-rr at 190k, gsp-random at 200k)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=None,
        help="default: all; with --sweep lru rlt rlt-leaf opt (lru-py decides exactly as lru, only slower)",
    )
    parser.add_argument("--capacity", type=_positive, default=None, help="cache size in tokens")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="replay at capacities 150k..210k (see --sweep-range) and plot hit rate "
        "(to --plot, default evict_sweep.png)",
    )
    parser.add_argument("--sweep-range", type=_sweep_range, default=SWEEP_DEFAULT, metavar="LO:HI:STEP")
    parser.add_argument(
        "--repeat",
        type=_positive,
        default=None,
        help="replays per policy; timings from the fastest (default 3, 1 with --sweep)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="single-page eviction latency on a 1M-token cache with ~100k nodes",
    )
    parser.add_argument("--latency-capacity", type=_positive, default=1_000_000)
    parser.add_argument(
        "--latency-segment",
        type=_positive,
        default=16,
        help="tokens per new branch while filling (~1.7 nodes per branch: ~100k nodes at 1M tokens)",
    )
    parser.add_argument("--latency-evictions", type=_positive, default=10_000)
    parser.add_argument("--page-size", type=_positive, default=1, help="page size for --latency")
    parser.add_argument("--groups", type=_positive, default=64, help="GSP groups")
    parser.add_argument("--queries", type=_positive, default=32, help="GSP queries per group")
    parser.add_argument("--prefix-ratio", type=_ratio, default=0.5)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="trace seed and rlt seed")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="write the figure here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output_tokens < 0:
        parser.error(f"--output-tokens must be >= 0, got {args.output_tokens}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.sweep and args.capacity is not None:
        parser.error("--sweep and --capacity are exclusive (use --sweep-range)")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot needs a .png file name, got {args.plot!r}")
    if args.policies is None:
        args.policies = ["lru", "rlt", "rlt-leaf", "opt"] if args.sweep else list(POLICIES)
    console = Console(stderr=True)
    if args.latency:
        lat = run_latency(args, console)
        if args.json:
            print(json.dumps([asdict(r) for r in lat], indent=2))
        else:
            print_latency(lat, Console(width=140))
        if args.plot:
            plot_latency(lat, args.plot)
            console.print(f"plot written to {args.plot}")
        return 0
    results = run_replays(args, console)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print_table(results, Console(width=140))
    plot = args.plot or ("evict_sweep.png" if args.sweep else None)  # a sweep is read as a figure
    if plot:
        plot_replays(results, plot, args.sweep)
        console.print(f"plot written to {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
