"""``kvroute compare``: simulate a routing-policy x eviction-policy matrix over workloads.

Defaults follow seed 004 (Appendix A): policies random, round_robin, cache_aware, lbgr; evictions lru,
rlt (``rlt-leaf`` on request: RLT's marking, a draw evicts a whole leaf); workloads gsp, multiturn,
longdoc; 4 workers, 12 req/s, 4 output tokens, a 200k-token KV pool per worker, the
``l40-llama3.1-8b`` cost model. ``--rates 8,12,16`` sweeps the request rate (and plots TTFT
against it). Example::

    kvroute compare --workloads gsp --policies cache_aware,cache_aware:preset=sglang-0.1.4,lbgr \\
        --evictions lru,rlt --rates 8,12,16 --json out.json --csv out.csv --plot-dir plots/
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvroute.bench.report import plot_bars, plot_vs_rate
from kvroute.bench.sim_cli import (
    UsageError,
    add_common_arguments,
    build_workload,
    check_common,
    check_workload_options,
    emit,
    parse_options,
    parse_policy,
    run_one,
    split_list,
)
from kvroute.sim.engine import EVICTIONS

DEFAULT_POLICIES = "random,round_robin,cache_aware,lbgr"
DEFAULT_EVICTIONS = "lru,rlt"
DEFAULT_WORKLOADS = "gsp,multiturn,longdoc"


def _rates(args: argparse.Namespace) -> list[float]:
    if args.rates:
        try:
            rates = [float(r) for r in split_list(args.rates, "--rates")]
        except ValueError:
            raise UsageError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    else:
        rates = [args.rate]
    if any(not r > 0 for r in rates):
        raise UsageError("request rates must be > 0")
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=DEFAULT_WORKLOADS, help=f"comma-separated (default {DEFAULT_WORKLOADS})"
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated; options as name:key=value, e.g. cache_aware:preset=sglang-0.1.4 (default {DEFAULT_POLICIES})",
    )
    parser.add_argument(
        "--evictions", default=DEFAULT_EVICTIONS, help=f"comma-separated (default {DEFAULT_EVICTIONS})"
    )
    parser.add_argument("--rate", type=float, default=12.0, help="request rate, req/s (default 12)")
    parser.add_argument("--rates", help="comma-separated request rates to sweep (overrides --rate)")
    parser.add_argument("--plot-dir", metavar="DIR", help="write PNG plots here")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_common(args)
        workloads = split_list(args.workloads, "--workloads")
        policies = [parse_policy(p) for p in split_list(args.policies, "--policies")]
        evictions = split_list(args.evictions, "--evictions")
        bad = [e for e in evictions if e not in EVICTIONS]
        if bad:
            raise UsageError(f"unknown eviction policy {bad[0]!r}; choose from {', '.join(EVICTIONS)}")
        rates = _rates(args)
        options = parse_options(args.option, "--option")
        check_workload_options(workloads, options)
    except UsageError as exc:
        print(f"kvroute compare: {exc}", file=sys.stderr)
        return 2

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rows: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    runs = len(workloads) * len(rates) * len(policies) * len(evictions)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False, disable=args.json == "-") as bar:
        overall = bar.add_task("runs", total=runs)
        for workload in workloads:
            for rate in rates:
                try:
                    requests = build_workload(
                        workload, {**options, "rate": rate, "max_tokens": args.max_tokens, "seed": args.seed}
                    )
                except UsageError as exc:
                    print(f"kvroute compare: {exc}", file=sys.stderr)
                    return 2
                sources[workload] = str(requests[0].meta.get("text_source", "synthetic")) if requests else "-"
                for policy in policies:
                    for eviction in evictions:
                        label = f"{workload} @{rate:g}/s {policy.label}+{eviction}"
                        task = bar.add_task(label, total=len(requests))
                        row, _ = run_one(
                            workload,
                            requests,
                            policy,
                            eviction,
                            workers=args.workers,
                            preset=args.preset,
                            kv_capacity_tokens=args.kv_capacity,
                            seed=args.seed,
                            max_running=args.max_running,
                            chunk_budget=args.chunk_budget,
                            max_index_chars=args.max_index_chars,
                            progress=lambda n, task=task: bar.update(task, completed=n),
                            extra={"rate": rate, "workers": args.workers, "requests_total": len(requests)},
                        )
                        bar.remove_task(task)
                        rows.append(row)
                        bar.advance(overall)
    text_note = ", ".join(f"{w}: {s}" for w, s in sources.items() if w == "multiturn")
    title = (
        f"simulated, {args.workers} workers, {args.preset}, {args.kv_capacity:,}-token KV pool, "
        f"{args.max_tokens} output tokens"
        + (f" (multiturn text: {text_note.split(': ')[1]})" if text_note else "")
    )
    emit(rows, args, title)
    if args.plot_dir:
        files = plot_bars(rows, args.plot_dir)
        if len(rates) > 1:
            files += plot_vs_rate(rows, args.plot_dir)
        print(
            f"plots: {len(files)} PNG files in {args.plot_dir}",
            file=sys.stderr if args.json == "-" else sys.stdout,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
