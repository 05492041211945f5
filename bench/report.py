"""Shared reporting for ``kvroute compare`` (simulated) and ``kvroute bench serve`` (live): one row per run.

A row is a flat dict. ``run_row`` builds it from per-request records (see ``kvroute.bench.metrics``);
``print_table`` shows rows with rich; ``write_csv`` / ``to_json`` save them; ``plot_bars`` draws one bar
chart per metric and ``plot_vs_rate`` TTFT against request rate (matplotlib, Agg backend).
Every JSON object carries at least ``JSON_KEYS``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute.bench.metrics import summarize

JSON_KEYS: tuple[str, ...] = (
    "workload",
    "policy",
    "eviction",
    "p50_ttft_ms",
    "p95_ttft_ms",
    "p50_e2e_ms",
    "p95_e2e_ms",
    "throughput_rps",
    "hit_rate",
)

# metric -> (column title, format); what the table and bar plots show
METRICS: dict[str, tuple[str, str]] = {
    "p50_ttft_ms": ("P50 TTFT ms", "{:,.0f}"),
    "p95_ttft_ms": ("P95 TTFT ms", "{:,.0f}"),
    "p50_e2e_ms": ("P50 e2e ms", "{:,.0f}"),
    "p95_e2e_ms": ("P95 e2e ms", "{:,.0f}"),
    "throughput_rps": ("req/s", "{:.2f}"),
    "hit_rate": ("hit rate", "{:.1%}"),
    "load_imbalance": ("imbalance", "{:.2f}"),
}


def run_row(
    records: Sequence[Any],
    *,
    workload: str,
    policy: str,
    eviction: str,
    worker_ids: Sequence[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One result row: identity, the summary metrics of ``records``, then ``extra`` (rate, preset...).

    ``worker_ids`` lists every worker so that idle ones count in the load imbalance."""
    if not records:
        raise ValueError("run_row needs at least one request record")
    row: dict[str, Any] = {"workload": workload, "policy": policy, "eviction": eviction}
    row.update(summarize(records, worker_ids))
    row.update(extra)
    return row


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


def _varying(rows: Sequence[Mapping[str, Any]], key: str) -> bool:
    return len({repr(r.get(key)) for r in rows}) > 1


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None, console: Any = None) -> None:
    """A rich table of rows; a ``rate`` or ``workers`` column appears when it varies."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # pipes and files: do not squeeze the table into 80 columns
            console = Console(width=200)
    table = Table(title=title, show_lines=False)
    ident = ["workload", "policy", "eviction"] + [
        k for k in ("rate", "workers", "preset") if _varying(rows, k)
    ]
    for key in ident:
        table.add_column(key)
    for header, _ in METRICS.values():
        table.add_column(header, justify="right")
    for r in rows:
        cells = [str(r.get(k, "")) for k in ident]
        cells += [_fmt(r.get(k, math.nan), spec) for k, (_, spec) in METRICS.items()]
        table.add_row(*cells)
    console.print(table)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(rows: Iterable[Mapping[str, Any]]) -> str:
    """A JSON array, one object per run (NaN/inf become null)."""
    return json.dumps([{k: _json_safe(v) for k, v in r.items()} for r in rows], indent=2)


def write_json(rows: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(rows) + "\n")
    return path


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """CSV with the union of the rows' keys (JSON_KEYS first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(JSON_KEYS)
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _json_safe(r.get(k)) for k in keys})
    return path


def _label(row: Mapping[str, Any]) -> str:
    return f"{row['policy']}+{row['eviction']}"


def plot_bars(
    rows: Sequence[Mapping[str, Any]], out_dir: str | Path, metrics: Sequence[str] = tuple(METRICS)
) -> list[Path]:
    """One PNG per metric: groups = workloads, one bar per policy+eviction. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_rate = _varying(rows, "rate")

    def group(r: Mapping[str, Any]) -> str:  # one group of bars per workload (and rate, when it varies)
        return f"{r['workload']}@{r['rate']:g}" if by_rate else str(r["workload"])

    workloads = list(dict.fromkeys(group(r) for r in rows))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    written: list[Path] = []
    width = 0.8 / max(1, len(labels))
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) * max(1, len(labels)) / 3), 4.0))
        for j, label in enumerate(labels):
            values = []
            for w in workloads:
                match = [r.get(metric, math.nan) for r in rows if group(r) == w and _label(r) == label]
                values.append(float(match[0]) if match and match[0] is not None else math.nan)
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(workloads))]
            ax.bar(xs, values, width=width, label=label)
        ax.set_xticks(range(len(workloads)), workloads, rotation=30 if by_rate else 0)
        ax.set_ylabel(METRICS.get(metric, (metric, ""))[0])
        ax.set_title(metric)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never hides a bar
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_vs_rate(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    metrics: Sequence[str] = ("p50_ttft_ms", "p95_ttft_ms"),
) -> list[Path]:
    """Per workload and metric, one PNG: the metric against ``rate``, a line per policy+eviction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any("rate" not in r for r in rows):
        raise ValueError("plot_vs_rate needs a 'rate' in every row")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        subset = [r for r in rows if r["workload"] == workload]
        for metric in metrics:
            fig, ax = plt.subplots(figsize=(6.5, 4.0))
            for label in dict.fromkeys(_label(r) for r in subset):
                points = sorted(
                    (float(r["rate"]), float(r.get(metric) if r.get(metric) is not None else math.nan))
                    for r in subset
                    if _label(r) == label
                )
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(METRICS.get(metric, (metric, ""))[0])
            ax.set_yscale("log")
            ax.set_title(f"{workload}: {metric} vs rate")
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = out / f"{workload}_{metric}_vs_rate.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written
