"""``kvroute sim``: simulate one routing policy x one eviction policy x one workload.

Example::

    kvroute sim --workload gsp --policy lbgr --eviction rlt --workers 4 --rate 12
    kvroute sim --workload gsp --policy cache_aware:preset=sglang-0.1.4 --option order=round_robin

A policy is written ``name`` or ``name:key=value:key=value`` (options of ``make_policy``). The helpers
here (policy specs, option parsing, ``run_one``) are shared with ``kvroute compare``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.bench.report import print_table, run_row, to_json, write_csv, write_json
from kvroute.bench.workloads import WORKLOADS, WorkloadRequest, make_workload, workload_options
from kvroute.sim.engine import EVICTIONS


class UsageError(ValueError):
    """Bad command-line input: reported as a message and exit code 2."""


def parse_value(text: str) -> Any:
    """'12' -> 12, '0.5' -> 0.5, 'true' -> True, '1,2' -> (1, 2), anything else stays a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if "," in text:
        return tuple(parse_value(part) for part in text.split(",") if part)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(items: Sequence[str], what: str) -> dict[str, Any]:
    """KEY=VALUE strings to a dict (values via ``parse_value``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} must look like KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = parse_value(value.strip())
    return out


@dataclass(frozen=True, slots=True)
class PolicySpec:
    label: str  # as written by the user, used in tables
    name: str
    options: dict[str, Any]


def parse_policy(spec: str) -> PolicySpec:
    """``name[:key=value[:key=value]]`` -> PolicySpec; unknown names raise UsageError."""
    from kvroute.router.policies import POLICY_NAMES, make_policy

    parts = [p for p in spec.strip().split(":") if p]
    if not parts:
        raise UsageError("empty policy name")
    name = parts[0]
    if name not in POLICY_NAMES:
        raise UsageError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}")
    options = parse_options(parts[1:], f"option of policy {name!r}")
    try:
        make_policy(name, **options)  # validate the options now, not in the middle of a run
    except (TypeError, ValueError) as exc:
        raise UsageError(f"policy {spec!r}: {exc}") from None
    return PolicySpec(spec.strip(), name, options)


def split_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"{what} needs at least one name")
    return items


def check_workload_options(names: Sequence[str], options: dict[str, Any]) -> None:
    """Every option must belong to at least one of the workloads (catches typos)."""
    for name in names:
        if name not in WORKLOADS:
            raise UsageError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    known = set().union(*(workload_options(n) for n in names))
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(
            f"unknown workload option(s) {', '.join(unknown)} for {', '.join(names)}; "
            f"known: {', '.join(sorted(known))}"
        )


def build_workload(name: str, options: dict[str, Any]) -> list[WorkloadRequest]:
    """make_workload with only the options this workload knows (shared options may not all apply)."""
    check_workload_options([name], {})
    known = workload_options(name)
    try:
        return make_workload(name, **{k: v for k, v in options.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"workload {name!r}: {exc}") from None


def run_one(
    workload_name: str,
    requests: Sequence[WorkloadRequest],
    policy: PolicySpec,
    eviction: str,
    *,
    workers: int,
    preset: str,
    kv_capacity_tokens: int,
    seed: int,
    max_running: int | None = None,
    chunk_budget: int | None = None,
    max_index_chars: int | None = None,
    progress: Callable[[int], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Simulate one run; returns (result row, SimResult)."""
    from kvroute.sim.cluster import ClusterSim

    sim = ClusterSim(
        policy=policy.name,
        policy_options=policy.options,
        workers=workers,
        eviction=eviction,
        preset=preset,
        kv_capacity_tokens=kv_capacity_tokens,
        max_running=max_running,
        chunk_budget=chunk_budget,
        seed=seed,
        router_options={"max_index_chars": max_index_chars} if max_index_chars else None,
    )
    result = sim.run(requests, progress=progress)
    row = run_row(
        result.records,
        workload=workload_name,
        policy=policy.label,
        eviction=eviction,
        worker_ids=result.workers,
        **(extra or {}),
        preset=sim.cost.name,
        sim_wall_s=round(result.wall_s, 3),
    )
    return row, result


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="number of simulated workers (default 4)")
    parser.add_argument(
        "--preset", default="l40-llama3.1-8b", help="cost-model preset (default l40-llama3.1-8b)"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request (default 4)")
    parser.add_argument("--kv-capacity", type=int, default=200_000, help="KV pool per worker in tokens")
    parser.add_argument("--max-running", type=int, default=None, help="max running requests (preset default)")
    parser.add_argument(
        "--chunk-budget", type=int, default=None, help="prefill tokens per step (preset default)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of workload, router and engines")
    parser.add_argument(
        "--max-index-chars",
        type=int,
        default=None,
        help="router prefix-index capacity in characters (router default: 2.5M per worker)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload option, e.g. groups=64, order=round_robin, prefix_ratio=0.7 (repeatable)",
    )
    parser.add_argument("--json", metavar="PATH", help="write result rows as JSON ('-' for stdout)")
    parser.add_argument("--csv", metavar="PATH", help="write result rows as CSV")


def check_common(args: argparse.Namespace) -> None:
    from kvroute.sim.cost_model import get_preset

    for name in ("workers", "max_tokens", "kv_capacity"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_running", "chunk_budget", "max_index_chars"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    try:
        get_preset(args.preset)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def emit(rows: list[dict[str, Any]], args: argparse.Namespace, title: str) -> None:
    if args.json == "-":
        print(to_json(rows))
    else:
        print_table(rows, title=title)
        if args.json:
            print(f"JSON: {write_json(rows, args.json)}")
    if args.csv:
        print(f"CSV: {write_csv(rows, args.csv)}", file=sys.stderr if args.json == "-" else sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gsp", help=f"one of {', '.join(WORKLOADS)} (default gsp)")
    parser.add_argument(
        "--policy", default="lbgr", help="routing policy, e.g. lbgr or cache_aware:preset=sglang-0.1.4"
    )
    parser.add_argument(
        "--eviction", default="rlt", choices=list(EVICTIONS), help="eviction policy (default rlt)"
    )
    parser.add_argument("--rate", type=float, default=12.0, help="Poisson arrival rate, req/s (default 12)")
    parser.add_argument("--records", metavar="PATH", help="write the per-request records as CSV")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_common(args)
        if not args.rate > 0:
            raise UsageError("--rate must be > 0")
        policy = parse_policy(args.policy)
        options = parse_options(args.option, "--option")
        check_workload_options([args.workload], options)
        options.update(rate=args.rate, max_tokens=args.max_tokens, seed=args.seed)
        t0 = time.perf_counter()
        requests = build_workload(args.workload, options)
        build_s = time.perf_counter() - t0
        from rich.progress import Progress

        with Progress(transient=True, disable=args.json == "-") as bar:
            task = bar.add_task(f"{args.workload} {policy.label}+{args.eviction}", total=len(requests))
            row, result = run_one(
                args.workload,
                requests,
                policy,
                args.eviction,
                workers=args.workers,
                preset=args.preset,
                kv_capacity_tokens=args.kv_capacity,
                seed=args.seed,
                max_running=args.max_running,
                chunk_budget=args.chunk_budget,
                max_index_chars=args.max_index_chars,
                progress=lambda n: bar.update(task, completed=n),
                extra={"rate": args.rate, "workers": args.workers},
            )
    except UsageError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    source = requests[0].meta.get("text_source") if requests else None
    title = f"{args.workload} ({len(requests)} requests{', text: ' + source if source else ''}), simulated"
    emit([row], args, title)
    if args.records:
        write_csv([r.as_dict() for r in result.records], args.records)
    if args.json != "-":
        print(
            f"workload built in {build_s:.2f} s; simulated {len(requests)} requests on {args.workers} workers "
            f"in {result.wall_s:.2f} s wall ({result.events} events)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
