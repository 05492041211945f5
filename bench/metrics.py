"""Summary metrics over per-request records (simulated or measured against live servers).

A record is a mapping or an object with: ``arrival_s``, ``ttft_s``, ``e2e_s``, ``prompt_tokens``,
``cached_tokens``, optionally ``worker`` and ``ok`` (default True). Failed requests (``ok`` false) count
in ``requests`` and ``errors`` but not in latency percentiles, throughput or hit rate.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def _get(record: Any, key: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(key, default)
    return getattr(record, key, default)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation as numpy); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


def hit_rate(records: Iterable[Any]) -> float:
    """Cached prompt tokens / prompt tokens over successful requests (0 when there were none)."""
    prompt = cached = 0
    for r in records:
        if _get(r, "ok", True):
            prompt += int(_get(r, "prompt_tokens", 0) or 0)
            cached += int(_get(r, "cached_tokens", 0) or 0)
    return cached / prompt if prompt else 0.0


def imbalance(counts: Sequence[float]) -> float:
    """max / mean of per-worker amounts (1.0 = perfectly even); NaN for no workers or no load."""
    if len(counts) == 0:
        return math.nan
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else math.nan


def summarize(records: Sequence[Any], workers: Sequence[str] | None = None) -> dict[str, float]:
    """Latency percentiles (ms), throughput, hit rate and load imbalance of one run.

    ``workers`` lists every worker (so idle ones count in the imbalance); default: those seen.
    Throughput = successful requests / (last finish - first arrival).
    """
    ok = [r for r in records if _get(r, "ok", True)]
    ttft = [float(_get(r, "ttft_s")) * 1e3 for r in ok if _finite(_get(r, "ttft_s"))]
    e2e = [float(_get(r, "e2e_s")) * 1e3 for r in ok if _finite(_get(r, "e2e_s"))]
    if ok:
        start = min(float(_get(r, "arrival_s")) for r in records)
        end = max(float(_get(r, "arrival_s")) + float(_get(r, "e2e_s")) for r in ok)
        span = end - start
        throughput = len(ok) / span if span > 0 else math.nan
    else:
        throughput = 0.0
    per_worker = Counter(_get(r, "worker") for r in ok if _get(r, "worker") is not None)
    uncached = Counter()
    for r in ok:
        w = _get(r, "worker")
        if w is not None:
            uncached[w] += int(_get(r, "prompt_tokens", 0) or 0) - int(_get(r, "cached_tokens", 0) or 0)
    ids = list(workers) if workers is not None else sorted(per_worker)
    return {
        "requests": float(len(records)),
        "errors": float(len(records) - len(ok)),
        "p50_ttft_ms": percentile(ttft, 50),
        "p95_ttft_ms": percentile(ttft, 95),
        "mean_ttft_ms": float(np.mean(ttft)) if ttft else math.nan,
        "p50_e2e_ms": percentile(e2e, 50),
        "p95_e2e_ms": percentile(e2e, 95),
        "throughput_rps": throughput,
        "hit_rate": hit_rate(ok),
        "load_imbalance": imbalance([per_worker.get(w, 0) for w in ids]),
        "prefill_imbalance": imbalance([uncached.get(w, 0) for w in ids]),
    }


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
