"""``python -m kvroute.bench.engine_evict``: eviction cost and hit rate inside the real engines, rlt vs lru.

Each engine lives in its own venv, as users run it, so this dispatcher (run from the main venv) starts
one subprocess per engine and prints one table:
- SGLang: ``.venv-sglang/bin/python -m kvroute.bench.engine_evict_sglang --json`` (SGLang's own trees);
- vLLM: ``.venv-vllm/bin/python -m kvroute.bench.engine_evict_vllm --json`` (vLLM's block pool).
Both print a JSON list of rows with at least ``engine``, ``policy``, ``hit_rate``, ``evict_calls`` and
``evict_us_mean`` (microseconds per eviction call); ``evict_us_p50``/``evict_us_p99``, the structure
(``kind`` or ``tree``), the trace (``workload`` or ``trace``) and ``us_per_evicted_token`` or
``us_per_evicted_block`` and the CPU-time figures (``evict_cpu_us_mean``/``_p50``) are shown when
present. ``--json`` prints the merged rows; ``--plot PATH``
draws microseconds per call and hit rate per engine and policy.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ENGINES = {
    "sglang": (".venv-sglang", "kvroute.bench.engine_evict_sglang"),
    "vllm": (".venv-vllm", "kvroute.bench.engine_evict_vllm"),
}


def project_root() -> Path:
    """Where the engine venvs live: $KVROUTE_ROOT, else the current directory if it has one, else the
    source checkout this module is installed from (editable install)."""
    env = os.environ.get("KVROUTE_ROOT")
    if env:
        return Path(env)
    cwd = Path.cwd()
    if any((cwd / venv).exists() for venv, _ in ENGINES.values()):
        return cwd
    return Path(__file__).resolve().parents[1]


def run_engine(engine: str, extra_args: list[str], root: Path) -> list[dict[str, Any]]:
    """Run one engine's benchmark in its venv; returns its rows. Raises RuntimeError on failure."""
    venv, module = ENGINES[engine]
    python = root / venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{engine}: {python} not found (run scripts/install_{engine}_env.sh)")
    # stderr (progress bars, engine logs) goes straight to the user; stdout carries the JSON
    proc = subprocess.run(
        [str(python), "-m", module, "--json", *extra_args], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{engine}: {module} exited with {proc.returncode}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(f"{engine}: {module} printed no result")
    rows = json.loads(lines[-1])
    if not isinstance(rows, list):
        raise RuntimeError(f"{engine}: expected a JSON list of rows, got {type(rows).__name__}")
    for row in rows:
        row.setdefault("engine", engine)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Eviction inside the engines: rlt vs the engine's lru")
    columns = (
        "engine",
        "structure",
        "workload",
        "policy",
        "hit rate",
        "evict calls",
        "us/call mean",
        "p50",
        "p99",
    )
    for col in (*columns, "cpu us/call mean", "cpu p50", "us per evicted token|block"):
        table.add_column(col)
    for r in rows:
        per_unit = r.get("us_per_evicted_token", r.get("us_per_evicted_block"))
        table.add_row(
            str(r.get("engine", "-")),
            str(r.get("kind", r.get("tree", "-"))),
            str(r.get("workload", r.get("trace", "-"))),
            str(r.get("policy", "-")),
            _fmt(r.get("hit_rate"), ".2%"),
            _fmt(r.get("evict_calls"), "d"),
            _fmt(r.get("evict_us_mean"), ".0f"),
            _fmt(r.get("evict_us_p50"), ".0f"),
            _fmt(r.get("evict_us_p99"), ".0f"),
            _fmt(r.get("evict_cpu_us_mean"), ".0f"),
            _fmt(r.get("evict_cpu_us_p50"), ".0f"),
            _fmt(per_unit, ".3f"),
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.get('engine')}\n{r.get('kind', r.get('tree', ''))}\n{r.get('policy')}" for r in rows]
    fig, (ax_us, ax_hit) = plt.subplots(1, 2, figsize=(max(6, 1.4 * len(rows)) * 2, 4))
    colors = [
        {"rlt": "tab:red", "rlt-leaf": "tab:orange"}.get(str(r.get("policy")), "tab:gray") for r in rows
    ]
    # CPU time when the engine reports it: wall time on a shared machine includes time preempted
    cpu = all("evict_cpu_us_mean" in r for r in rows)
    key = "evict_cpu_us_mean" if cpu else "evict_us_mean"
    ax_us.bar(labels, [r.get(key) or 0 for r in rows], color=colors)
    ax_us.set_ylabel(f"{'CPU ' if cpu else ''}microseconds per eviction call (mean)")
    ax_us.set_yscale("log")
    ax_hit.bar(labels, [100 * (r.get("hit_rate") or 0) for r in rows], color=colors)
    ax_hit.set_ylabel("prefix-cache hit rate (%)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.bench.engine_evict", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--engines", default="sglang,vllm", help="comma list of: sglang, vllm")
    parser.add_argument("--sglang-args", default="", help="extra arguments for engine_evict_sglang")
    parser.add_argument("--vllm-args", default="", help="extra arguments for engine_evict_vllm")
    parser.add_argument("--json", action="store_true", help="print the merged rows as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of us/call and hit rate")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if not engines or unknown:
        parser.error(f"--engines: choose from {','.join(ENGINES)}, got {args.engines!r}")
    root = project_root()
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for engine in engines:
        extra = shlex.split(args.sglang_args if engine == "sglang" else args.vllm_args)
        try:
            rows.extend(run_engine(engine, extra, root))
        except (RuntimeError, json.JSONDecodeError) as exc:
            print(f"engine_evict: {exc}", file=sys.stderr)
            failed.append(engine)
    if args.json:
        print(json.dumps(rows))
    elif rows:
        print_table(rows)
    if args.plot and rows:
        plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
