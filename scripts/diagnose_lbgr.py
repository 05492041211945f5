"""Instrumented simulator run of ``lbgr`` (diagnosis for docs/results-sim.md, "Why lbgr loses here").

Records, at every decision, each worker's S_i, W_i, residual r_i (+ uncertainty penalty), in-flight n_i
and the engine's real backlog (prompt tokens not yet prefilled), and at every finish the residual's
target and its a-priori prediction; then prints how often lbgr followed the cache, which term pulled it
away, whether W or r track the real backlog, the fitted coefficients and how far each group's prefix
was spread. ``--oracle engine|index`` instead routes greedily on the *true* latency (real backlog + real
uncached cost on the simulated engine; hits from the engine's cache or from the router's index): what
LBGR's estimate would be if it were perfect. Everything is seeded; runs take seconds.

    .venv/bin/python scripts/diagnose_lbgr.py --groups 128 --rate 12
    .venv/bin/python scripts/diagnose_lbgr.py --groups 128 --option learn_residual=false
    .venv/bin/python scripts/diagnose_lbgr.py --groups 150 --workers 64 --rate 192
    .venv/bin/python scripts/diagnose_lbgr.py --groups 128 --oracle engine
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
from kvroute.bench.workloads import make_workload
from kvroute.router.policies._common import SeededPolicy
from kvroute.router.policies.lbgr import LBGRPolicy
from kvroute.router.types import Request, WorkerView
from kvroute.sim.cluster import ClusterSim
from kvroute.sim.engine import EngineModel


class TracedLBGR(LBGRPolicy):
    """LBGR that records what it saw at every decision and finish (its decisions are unchanged)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.engines: dict[str, EngineModel] = {}
        # per decision: time, request id, chosen, hit workers, {worker: (S, W, r, n, backlog tokens)}
        self.decisions: list[tuple[float, str, str, list[str], dict[str, tuple[float, ...]]]] = []
        self.finishes: list[tuple[str, float, float]] = []  # worker, target y, a-priori prediction
        self.samples: list[tuple[str, tuple[float, ...], float]] = []  # worker, features x, target y

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        chosen = super().choose(request, workers, now)
        rows = {}
        for v in workers:
            s = self.service_time(request, v.match_chars)
            r = self.estimate(request, v, now) - s - v.load if self.learn_residual else 0.0
            backlog = self.engines[v.id].queued_prefill_tokens()
            rows[v.id] = (s, v.load, r, float(v.in_flight), float(backlog))
        best = max(v.match_chars for v in workers)
        hit = [v.id for v in workers if best > 0 and v.match_chars == best]
        self.decisions.append((now, request.id, chosen, hit, rows))
        return chosen

    def observe(self, worker_id: str, x: Sequence[float], y: float, now: float) -> None:
        w = self._workers.get(worker_id)
        pred = w.model.predict(x) if w is not None and w.last_update is not None else 0.0
        self.finishes.append((worker_id, y, pred))
        self.samples.append((worker_id, tuple(x), y))
        super().observe(worker_id, x, y, now)


class OracleGreedy(SeededPolicy):
    """Greedy minimum-latency routing with perfect knowledge of the simulated engines (diagnosis only):
    estimate = (engine's unprefilled prompt tokens + this request's uncached tokens) x real cost per
    token. ``hits``: "engine" (the engine's cache now) or "index" (the router's prefix index)."""

    name = "oracle_greedy"

    def __init__(self, hits: str, tokens: dict[str, Sequence[int]], engines: dict[str, EngineModel]) -> None:
        super().__init__()
        self.hits, self.tokens, self.engines = hits, tokens, engines
        cost = next(iter(engines.values())).cost
        self.s_per_token = cost.step_time([(8192, 0)]) / 8192
        self.chars_per_token: float | None = None

    def service_time(self, request: Request, match_chars: int) -> None:
        return None  # the router's default load bookkeeping; unused here

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        ratio = len(request.text) / max(1, request.est_tokens)
        best: tuple[float, str] | None = None
        for v in workers:
            engine = self.engines[v.id]
            if self.hits == "engine":
                hit = engine.cache._peek(self.tokens[request.id])  # no LRU/mark side effect
            else:
                hit = min(request.est_tokens, v.match_chars / ratio)
            est = (engine.queued_prefill_tokens() + request.est_tokens - hit) * self.s_per_token
            if best is None or est < best[0]:
                best = (est, v.id)
        assert best is not None
        return best[1]


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")


def report_lbgr(pol: TracedLBGR, group_of: dict[str, Any], skip: int = 200) -> None:
    d = pol.decisions
    with_hit = [x for x in d if x[3]]
    followed = sum(1 for x in with_hit if x[2] in x[3])
    by_w = by_r = 0
    for _, _, chosen, hit, rows in with_hit:
        if chosen in hit:
            continue
        c = rows[chosen]
        h = min((rows[w] for w in hit), key=lambda t: t[0] + t[1] + t[2])
        if h[0] + h[1] > c[0] + c[1]:
            by_w += 1  # the hit worker's W exceeded its S saving already
        else:
            by_r += 1  # S + W favoured the hit worker; the residual flipped the choice
    print(
        f"decisions with a cached prefix somewhere: {len(with_hit)}/{len(d)}; followed the cache: {followed}"
    )
    print(f"  not followed because S+W already favoured another worker (W > hit saving): {by_w}; "
          f"because the residual flipped S+W: {by_r}")  # fmt: skip
    # deviations from the mean worker at each decision (after warm-up)
    dev: dict[str, list[np.ndarray]] = defaultdict(list)
    ranks = []
    for _, _, chosen, _, rows in d[skip:]:
        ids = sorted(rows)
        cols = np.array([rows[i] for i in ids])  # S, W, r, n, backlog
        for k, name in enumerate(("S", "W", "r", "n", "backlog")):
            dev[name].append(cols[:, k] - cols[:, k].mean())
        dev["est"].append(
            (cols[:, 0] + cols[:, 1] + cols[:, 2]) - (cols[:, 0] + cols[:, 1] + cols[:, 2]).mean()
        )
        ranks.append(sorted(ids, key=lambda i: rows[i][4]).index(chosen))
    cat = {k: np.concatenate(v) for k, v in dev.items()}
    real = cat["backlog"] * 1.9e-4  # tokens -> s on the simulated L40 (~0.19 ms per uncached token)
    allrows = np.array([row for x in d for row in x[4].values()])
    print(f"W: mean {allrows[:, 1].mean():.2f} s (lbgr units); residual+penalty: mean {allrows[:, 2].mean():.2f} s; "
          f"real backlog: mean {allrows[:, 4].mean():.0f} tokens = {allrows[:, 4].mean() * 1.9e-4:.1f} s on the engine "
          f"= {allrows[:, 4].mean() * pol.c_miss:.0f} s in lbgr units")  # fmt: skip
    print(f"across workers, deviation from the mean worker: corr with real backlog: W {_corr(cat['W'], real):.2f}, "
          f"r {_corr(cat['r'], real):.2f}, in-flight n {_corr(cat['n'], real):.2f}, S+W+r {_corr(cat['est'], real):.2f}; "
          f"sd: W {cat['W'].std():.2f} s, r {cat['r'].std():.2f} s, real backlog {real.std():.2f} s")  # fmt: skip
    n_workers = len(d[0][4])
    ranks_a = np.array(ranks)
    print(f"chosen worker by real backlog: the least backlogged {np.mean(ranks_a == 0):.0%} "
          f"(chance {1 / n_workers:.0%}), in the less backlogged half {np.mean(ranks_a < n_workers / 2):.0%}")  # fmt: skip
    # the hot path (choose) against the reference formula (estimate): same argmin at every decision
    agree = sum(
        1
        for _, _, chosen, _, rows in d
        if rows[chosen][0] + rows[chosen][1] + rows[chosen][2]
        <= min(v[0] + v[1] + v[2] for v in rows.values()) + 1e-9
    )
    print(f"choose() picked an argmin of estimate() in {agree}/{len(d)} decisions")
    hits = [max(r[0] for r in x[4].values()) - min(r[0] for r in x[4].values()) for x in with_hit]
    print(f"S saving of the best hit over the worst: mean {np.mean(hits):.2f} s (lbgr units)")
    if pol.finishes:
        y = np.array([f[1] for f in pol.finishes])
        err = y - np.array([f[2] for f in pol.finishes])
        print(
            f"residual target y = e2e - (S+W): mean {y.mean():.2f} s, sd {y.std():.2f}; a-priori error sd {err.std():.2f}"
        )
        for wid, w in sorted(pol._workers.items())[:8]:
            print(f"  {wid}: theta [S, W, n, 1] = {[round(t, 3) for t in w.model.theta]}")
    counts = Counter(x[2] for x in d)
    top = counts.most_common(1)[0]
    print(f"requests per worker: max {top[1]} ({top[0]}), mean {len(d) / len(d[0][4]):.1f}")
    spread: dict[Any, set[str]] = defaultdict(set)
    for x in d:
        spread[group_of[x[1]]].add(x[2])
    print(
        "workers per group -> number of groups:",
        dict(sorted(Counter(len(v) for v in spread.values()).items())),
    )
    # the busiest worker's view while it took traffic (herding, if any)
    mine = [(t, rows) for t, _, chosen, _, rows in d if chosen == top[0]]
    print(f"{top[0]} when chosen (its value / median of the others):")
    for t, rows in mine[:: max(1, len(mine) // 10)]:
        me, others = rows[top[0]], np.array([v for k, v in rows.items() if k != top[0]])
        med = np.median(others, axis=0)
        print(f"  t={t:6.1f}  W {me[1]:6.2f}/{med[1]:5.2f}  r {me[2]:+7.2f}/{med[2]:+6.2f}  "
              f"n {me[3]:4.0f}/{med[3]:4.0f}  backlog {me[4]:7.0f}/{med[4]:7.0f}")  # fmt: skip


def check_rls(pol: TracedLBGR) -> None:
    """Refits every worker's residual by exact exponentially weighted least squares (weights
    forgetting^age, ridge 1/p0 = the RLS prior) before each observation and compares a-priori errors
    with the RLS's: equal if the recursive implementation is right."""
    lam, ridge = pol.forgetting, 1.0 / pol.rls_p0
    for wid in sorted({s[0] for s in pol.samples})[:8]:
        rows = [(x, y) for w, x, y in pol.samples if w == wid]
        xs, ys = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
        rls_err = ys - np.array([f[2] for f in pol.finishes if f[0] == wid])
        exact = []
        for k in range(len(rows)):
            if k == 0:
                exact.append(ys[0])
                continue
            w = np.sqrt(lam ** np.arange(k - 1, -1, -1))
            a = np.vstack([xs[:k] * w[:, None], np.sqrt(ridge * lam**k) * np.eye(xs.shape[1])])
            b = np.concatenate([ys[:k] * w, np.zeros(xs.shape[1])])
            theta = np.linalg.lstsq(a, b, rcond=None)[0]
            exact.append(ys[k] - xs[k] @ theta)
        print(f"  {wid}: a-priori error sd, RLS {rls_err.std():.3f} / exact weighted LS {np.std(exact):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gsp")
    ap.add_argument("--groups", type=int, default=128, help="gsp groups")
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--eviction", default="rlt")
    ap.add_argument("--option", action="append", default=[], help="lbgr option key=value (repeatable)")
    ap.add_argument("--oracle", choices=("engine", "index"), help="route by the true latency instead")
    ap.add_argument("--check-rls", action="store_true", help="compare the RLS with an exact refit")
    args = ap.parse_args(argv)
    extra = {"groups": args.groups} if args.workload == "gsp" else {}
    wl = make_workload(args.workload, rate=args.rate, **extra)
    # what shares a prefix: a GSP group, a conversation, a document
    group_key = {"gsp": "group", "multiturn": "client", "longdoc": "document"}.get(args.workload, "group")
    group_of = {r.id: (r.meta or {}).get(group_key, r.id) for r in wl}
    if args.oracle:
        placeholder = ClusterSim(policy="round_robin", workers=args.workers, eviction=args.eviction, seed=0)
        pol: Any = OracleGreedy(args.oracle, {r.id: r.tokens for r in wl}, placeholder.engines)
        sim = ClusterSim(policy=pol, workers=args.workers, eviction=args.eviction, seed=0)
        pol.engines = sim.engines
    else:
        pol = TracedLBGR(**_parse_options(args.option))
        sim = ClusterSim(policy=pol, workers=args.workers, eviction=args.eviction, seed=0)
        pol.engines = sim.engines
    res = sim.run(wl)
    ttft = np.array([r.ttft_s for r in res.records])
    hit = sum(r.cached_tokens for r in res.records) / sum(r.prompt_tokens for r in res.records)
    spread: dict[Any, set[str]] = defaultdict(set)
    for r in res.records:
        spread[group_of[r.id]].add(r.worker)
    label = f"oracle greedy ({args.oracle} hits)" if args.oracle else f"lbgr {args.option or ''}"
    print(f"{args.workload} {label}: {len(res.records)} requests, P50 TTFT {np.median(ttft):.2f} s, "
          f"hit {hit:.1%}, mean workers per group {np.mean([len(v) for v in spread.values()]):.2f}")  # fmt: skip
    if not args.oracle:
        report_lbgr(pol, group_of)
        if args.check_rls:
            check_rls(pol)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
