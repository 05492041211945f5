"""Eviction inside SGLang's own trees, rlt (kvroute plugin) against SGLang's lru, on one token trace.

Runs inside the SGLang venv (``.venv-sglang``; ``python -m kvroute.bench.engine_evict`` dispatches here).
Builds SGLang's ``UnifiedRadixCache`` (the server's tree) and legacy ``RadixCache`` on CPU with a real
``ReqToTokenPool`` / ``MHATokenToKVPool`` / token allocator, loads the plugin through SGLang's own entry
point mechanism (``load_plugins``), and replays a trace the way SGLang serves one request at a time:
``match_prefix`` -> lock -> evict the allocator's shortfall -> allocate -> ``insert`` (prompt + output)
-> unlock. The time of each eviction call (``evict_for_alloc`` on the unified tree, ``evict`` on the
legacy one) is measured around SGLang's method.

Trace: ``kvroute.bench.traces.gsp`` (default ``gsp-rr``, seed 004's worst case: 64 groups x 32
queries, lengths cycling 512..8192 over groups, prefix ratio 0.5, round-robin order, 4 output tokens
cached with each request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from kvroute.bench.forked import run_in_fork
from kvroute.bench.traces import add_gsp_arguments, gsp_from_args

KINDS = ("unified", "radix")
# rlt-leaf: rlt with --radix-eviction-policy-config unit=leaf; lru-python: SGLang's lru on its Python tree
# core (the core rlt runs on; SGLang's server default for lru is its Rust core), unified tree only
POLICIES = ("lru", "lru-python", "rlt", "rlt-leaf")
VOCAB = 32000


def load_plugin() -> None:
    """Load kvroute's SGLang plugin the way SGLang does: its entry points, then the hooks."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES

    if "rlt" not in RADIX_EVICTION_POLICY_CHOICES:
        raise RuntimeError("the kvroute SGLang plugin did not load (is kvroute installed in this venv?)")


def build_cache(
    kind: str,
    policy: str,
    pool_tokens: int,
    page_size: int = 1,
    *,
    seed: int = 0,
    capacity_tokens: int | None = None,
    kv_events: bool = False,
    max_context_len: int = 16384,
) -> tuple[Any, Any]:
    """SGLang's ``kind`` tree (``unified`` or ``radix``) with ``policy`` over a CPU KV pool of
    ``pool_tokens`` tokens. Returns ``(cache, allocator)``. ``seed`` and ``capacity_tokens`` (RLT's phase
    size, default the pool) go to rlt as ``--radix-eviction-policy-config`` would; policy ``rlt-leaf`` is
    rlt with ``unit="leaf"`` (one whole leaf per draw)."""
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if pool_tokens <= 0 or pool_tokens % page_size:
        raise ValueError(f"pool_tokens must be a positive multiple of page_size, got {pool_tokens}")
    kv_pool = MHATokenToKVPool(
        size=pool_tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=1,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            size=pool_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=pool_tokens,
            page_size=page_size,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
    req_pool = ReqToTokenPool(
        size=2, max_context_len=max_context_len, device="cpu", enable_memory_saver=False
    )
    config: dict[str, int | str] | None = None
    if policy in ("rlt", "rlt-leaf"):  # --radix-eviction-policy-config of the server
        config = {"seed": seed, "unit": "leaf" if policy == "rlt-leaf" else "page"}
        if capacity_tokens is not None:
            config["capacity_tokens"] = capacity_tokens
        policy = "rlt"
    tree_core_backend = None
    if policy == "lru-python":
        if kind != "unified":
            raise ValueError(
                "lru-python is SGLang's lru on UnifiedRadixCache's Python core: kind 'unified' only"
            )
        policy, tree_core_backend = "lru", "python"
    common = dict(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=policy,
        eviction_policy_config=config,
        enable_kv_cache_events=kv_events,
    )
    if kind == "unified":
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params = CacheInitParams(
            **common, tree_components=(ComponentType.FULL,), tree_core_backend=tree_core_backend
        )
        return UnifiedRadixCache(params), allocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(CacheInitParams(**common)), allocator


class TreeDriver:
    """Serves requests one at a time against an SGLang tree, as the scheduler does for a batch of one.

    Invariant after each ``serve``: no lock held; the allocator's free tokens plus the tree's tokens
    equal the pool size (nothing leaks).
    """

    def __init__(self, cache: Any, allocator: Any, kind: str) -> None:
        self.cache = cache
        self.allocator = allocator
        self.kind = kind
        self.page_size = int(allocator.page_size)
        self.evict_seconds: list[float] = []
        self.evict_cpu_seconds: list[float] = []
        self.evicted_tokens = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.rejected = 0
        self.held: list[tuple[list[int], Any]] = []

    def _key(self, tokens: Sequence[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def _evict(self, shortfall: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        params = EvictParams(num_tokens=shortfall)
        cpu_start = time.thread_time()
        start = time.perf_counter()
        if self.kind == "unified":
            result = self.cache.evict_for_alloc(params)
        else:
            result = self.cache.evict(params)
        self.evict_seconds.append(time.perf_counter() - start)
        # CPU time of this thread too: on a shared machine, wall time also counts time spent preempted
        self.evict_cpu_seconds.append(time.thread_time() - cpu_start)
        self.evicted_tokens += result.num_tokens_evicted
        return result.num_tokens_evicted

    def serve(self, prompt: Sequence[int], output: Sequence[int] = (), *, hold: bool = False) -> int:
        """One request: returns its prompt tokens found in the tree (device prefix hit).

        ``hold=True`` keeps a lock on the request's cached path (a running request) until
        ``release``. A request whose new tokens do not fit even after eviction is not cached
        (``rejected`` counts it), as a scheduler would keep it waiting.
        """
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

        page = self.page_size
        seq = list(prompt) + list(output)
        seq = seq[: len(seq) // page * page]  # the tree holds whole pages only
        match = self.cache.match_prefix(MatchPrefixParams(key=self._key(prompt)))
        hit = int(match.device_prefix_len)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += hit
        lock = self.cache.lock(match.last_device_node)
        try:
            need = len(seq) - hit
            if need <= 0:
                return hit
            shortfall = need - self.allocator.available_size()
            if shortfall > 0:
                self._evict(shortfall)
            if self.allocator.available_size() < need:
                self.rejected += 1
                return hit
            new = self.allocator.alloc(need)
            if new is None:
                raise RuntimeError(
                    f"allocator refused {need} tokens with {self.allocator.available_size()} free"
                )
            prefix = self.cache.path_device_indices(match.last_device_node)[:hit]
            value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
            if self.kind == "unified":
                # prev_prefix_len: slots below it are the tree's own; the tree frees our duplicates past it
                result = self.cache.insert(InsertParams(key=self._key(seq), value=value, prev_prefix_len=hit))
            else:
                result = self.cache.insert(InsertParams(key=self._key(seq), value=value))
                if (
                    result.prefix_len > hit
                ):  # cached beyond the match: free our duplicate slots, as SGLang does
                    self.allocator.free(value[hit : result.prefix_len])
            if hold:
                self.held.append((seq, self.cache.lock(result.last_device_node)))
        finally:
            self.cache.unlock(lock)
        return hit

    def release(self, index: int = 0) -> list[int]:
        """Unlock the ``index``-th held request; returns its cached tokens."""
        seq, lock = self.held.pop(index)
        self.cache.unlock(lock)
        return seq

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ReplayResult:
    kind: str
    policy: str
    page_size: int
    pool_tokens: int
    requests: int
    hit_rate: float
    evict_calls: int
    evict_us_mean: float
    evict_us_p50: float
    evict_us_p95: float
    evict_us_p99: float
    us_per_evicted_token: float
    evict_cpu_us_mean: float
    evict_cpu_us_p50: float
    evict_cpu_us_p99: float
    evicted_tokens: int
    seconds: float


def replay(
    trace: Sequence[tuple[Sequence[int], Sequence[int]]],
    kind: str,
    policy: str,
    pool_tokens: int,
    page_size: int = 1,
    *,
    seed: int = 0,
    progress: Any = None,
) -> ReplayResult:
    """Replay ``trace`` ((prompt, output) pairs) through SGLang's ``kind`` tree with ``policy``;
    ``progress(i)`` after each request."""
    cache, allocator = build_cache(kind, policy, pool_tokens, page_size, seed=seed)
    driver = TreeDriver(cache, allocator, kind)
    start = time.perf_counter()
    for i, (prompt, output) in enumerate(trace):
        driver.serve(prompt, output)
        if progress is not None:
            progress(i)
    seconds = time.perf_counter() - start
    us = np.asarray(driver.evict_seconds) * 1e6
    cpu_us = np.asarray(driver.evict_cpu_seconds) * 1e6
    return ReplayResult(
        kind=kind,
        policy=policy,
        page_size=page_size,
        pool_tokens=pool_tokens,
        requests=len(trace),
        hit_rate=driver.hit_rate,
        evict_calls=int(us.size),
        evict_us_mean=float(us.mean()) if us.size else 0.0,
        evict_us_p50=float(np.percentile(us, 50)) if us.size else 0.0,
        evict_us_p95=float(np.percentile(us, 95)) if us.size else 0.0,
        evict_us_p99=float(np.percentile(us, 99)) if us.size else 0.0,
        us_per_evicted_token=float(us.sum()) / driver.evicted_tokens if driver.evicted_tokens else 0.0,
        evict_cpu_us_mean=float(cpu_us.mean()) if cpu_us.size else 0.0,
        evict_cpu_us_p50=float(np.percentile(cpu_us, 50)) if cpu_us.size else 0.0,
        evict_cpu_us_p99=float(np.percentile(cpu_us, 99)) if cpu_us.size else 0.0,
        evicted_tokens=driver.evicted_tokens,
        seconds=seconds,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvroute.bench.engine_evict_sglang", description=__doc__.split("\n")[0]
    )
    p.add_argument("--kinds", default="unified,radix", help="SGLang trees: unified,radix")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="lru (SGLang's server default: the Rust core for unified), lru-python (unified only), rlt, "
        "rlt-leaf (rlt with unit=leaf)",
    )
    p.add_argument("--pool-tokens", type=int, default=190_000)
    p.add_argument("--page-size", type=int, default=1)
    add_gsp_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p


def _split(value: str, allowed: Sequence[str], name: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise ValueError(f"--{name}: choose from {','.join(allowed)}, got {value!r}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        kinds = _split(args.kinds, KINDS, "kinds")
        policies = _split(args.policies, POLICIES, "policies")
        if args.page_size <= 0 or args.pool_tokens <= 0 or args.output_tokens < 0:
            raise ValueError("--page-size and --pool-tokens must be > 0, --output-tokens >= 0")
        trace = gsp_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with code 2
    load_plugin()
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    results: list[ReplayResult] = []
    with Progress(console=console, transient=True) as bar:
        for kind in kinds:
            for policy in policies:
                if policy == "lru-python" and kind != "unified":
                    continue  # the legacy RadixCache has one (Python) implementation: its lru row
                task = bar.add_task(f"sglang {kind} {policy}", total=1)
                # each replay in its own forked process: every policy starts from the same heap
                result = run_in_fork(
                    lambda kind=kind, policy=policy: asdict(
                        replay(trace, kind, policy, args.pool_tokens, args.page_size, seed=args.seed)
                    )
                )
                results.append(ReplayResult(**result))
                bar.advance(task)
    rows = [
        {
            "engine": "sglang",
            "workload": f"gsp-{'rr' if args.order == 'round_robin' else 'random'}",
            **asdict(r),
        }
        for r in results
    ]
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.table import Table

        table = Table(
            title=f"SGLang tree eviction, gsp {args.order}, pool {args.pool_tokens}, page {args.page_size}"
        )
        cols = (
            "tree",
            "policy",
            "hit rate",
            "evict calls",
            "tokens/call",
            "us/call mean",
            "p50",
            "p99",
            "cpu us/call mean",
            "cpu p50",
        )
        for col in (*cols, "replay s"):
            table.add_column(col)
        for r in results:
            table.add_row(
                r.kind,
                r.policy,
                f"{r.hit_rate:.2%}",
                str(r.evict_calls),
                f"{r.evicted_tokens / r.evict_calls:.0f}" if r.evict_calls else "-",
                f"{r.evict_us_mean:.0f}",
                f"{r.evict_us_p50:.0f}",
                f"{r.evict_us_p99:.0f}",
                f"{r.evict_cpu_us_mean:.0f}",
                f"{r.evict_cpu_us_p50:.0f}",
                f"{r.seconds:.1f}",
            )
        Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
