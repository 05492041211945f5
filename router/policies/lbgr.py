"""``lbgr``: Learning-Based Greedy Routing (seed 004, Algorithm 2), all of it.

For request q (L prompt tokens) and worker i:

- hit h_i = characters matched in the global prefix index, converted to tokens with a chars-per-token
  ratio learned from finished requests' ``prompt_tokens`` (before any observation: the request's own
  len(text) / est_tokens);
- service time S_i = c_hit * h_i + c_miss * (L - h_i), coefficients in ms per 1k tokens (reference
  fzwark/KVRouting: c_hit = 0, c_miss = 1000), floored at 1 ms;
- queue load W_i: += S_i on dispatch, x 31/32 every 20 ms, remainder released on finish — kept by the
  Router's ClusterState (``WorkerView.load``) using this policy's ``service_time``;
- residual r_i = theta_i . [S_i, W_i, n_i, 1], one model per worker, fitted online by recursive least
  squares with forgetting factor 0.992 on y = observed e2e - (S_i + W_i at dispatch);
- route to argmin S_i + W_i + r_i, ties at random.

Features (why these three): S_i corrects the fixed cost coefficients (a slope != 0 means the engine is
faster/slower per uncached token than assumed); W_i corrects the decay model of the queue (a slope means
the queue drains faster/slower than 31/32 per 20 ms); n_i, the in-flight count at dispatch, captures
batching/decode interference that neither token cost sees. The bias is the per-worker offset the
released code learned alone.

Anti-herding. Feedback arrives one e2e late, and only from workers that get traffic, so three guards
keep a residual from steering everything toward or away from one worker:

1. Staleness: a worker that gets no traffic would keep its residual forever (a stale positive residual
   starves it; an independent prototype of the bias-only version sent hundreds of requests in a row to
   one worker). Residuals age toward zero with half-life ``residual_half_life_s`` once
   ``residual_stale_after_s`` have passed since the worker's last observation (a worker that keeps
   reporting is never aged, so aging does not bias a well-fed model); the next observation first
   shrinks the model by the same factor and moves its covariance back toward the prior.
2. Monotonicity (``monotone``): predictions use theta_S >= -1, theta_W >= -1, theta_n >= 0, so the
   estimate never falls as S, W or n grow. A fit on data where the load barely varied can put the
   level in the bias and a ~0 or negative slope on load; it then claims extra load is free.
3. Extrapolation (``uncertainty_penalty``): the estimate adds k standard deviations of the residual's
   prediction, sqrt(noise_var * x'Px) from the RLS covariance, so a worker whose load has just grown
   past anything in its recent data looks as uncertain as it is. In the simulator (GSP, 4 workers,
   12 req/s) the longest run of consecutive requests to one worker went from 339 (no guards) to 134
   (monotone) to 39 (both).

The estimate is floored at S_i, so no residual can make a worker look free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from math import sqrt

from kvroute.router.policies._common import SeededPolicy
from kvroute.router.state import CharsPerTokenEstimator
from kvroute.router.types import Request, WorkerView

N_FEATURES = 4  # S, W, in-flight, bias
# "full": theta . [S, W, n, 1] (the paper's model); "bias": only the intercept is learned (the released
# fzwark/KVRouting code; features are fed as zeros so their coefficients stay exactly 0)
RESIDUAL_FEATURES = ("full", "bias")


class RLS:
    """Recursive least squares with exponential forgetting, 4 parameters, pure Python (tiny, exact).

    Invariant: ``p`` stays symmetric positive definite and bounded by ``p_max`` on the diagonal
    (anti-windup: without excitation, forgetting inflates P by 1/lambda per update).
    """

    __slots__ = ("theta", "p", "forgetting", "p0", "p_max", "updates", "noise_var")

    def __init__(self, forgetting: float = 0.992, p0: float = 10.0, p_max: float = 1e4) -> None:
        self.forgetting = forgetting
        self.p0 = p0
        self.p_max = p_max
        self.theta = [0.0] * N_FEATURES
        self.p = [[p0 if i == j else 0.0 for j in range(N_FEATURES)] for i in range(N_FEATURES)]
        self.updates = 0
        self.noise_var = 0.0  # exponentially weighted mean of squared a-priori errors

    def predict(self, x: Sequence[float]) -> float:
        t = self.theta
        return t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3]

    def update(self, x: Sequence[float], y: float) -> None:
        p = self.p
        n = N_FEATURES
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.forgetting + sum(x[i] * px[i] for i in range(n))
        k = [v / denom for v in px]
        err = y - self.predict(x)
        for i in range(n):
            self.theta[i] += k[i] * err
        # a-priori error variance, normalised by its expected inflation 1 + x'Px/lambda
        e2 = err * err / (1.0 + (denom - self.forgetting) / self.forgetting)
        self.noise_var = (
            e2 if self.updates == 0 else self.forgetting * self.noise_var + (1 - self.forgetting) * e2
        )
        lam = self.forgetting
        new_p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        for i in range(n):  # symmetrize against round-off
            for j in range(i + 1, n):
                avg = 0.5 * (new_p[i][j] + new_p[j][i])
                new_p[i][j] = new_p[j][i] = avg
        biggest = max(new_p[i][i] for i in range(n))
        if biggest > self.p_max:
            scale = self.p_max / biggest
            new_p = [[v * scale for v in row] for row in new_p]
        self.p = new_p
        self.updates += 1

    def variance(self, x: Sequence[float]) -> float:
        """Variance of the prediction at ``x``: noise_var * x'Px (large where the data was thin)."""
        p = self.p
        q = sum(x[i] * p[i][j] * x[j] for i in range(N_FEATURES) for j in range(N_FEATURES))
        return self.noise_var * q

    def shrink(self, factor: float) -> None:
        """Ages the model: theta -> factor * theta, P moved toward the prior by (1 - factor)."""
        self.theta = [t * factor for t in self.theta]
        add = (1.0 - factor) * self.p0
        for i in range(N_FEATURES):
            self.p[i][i] += add


class _Worker:
    __slots__ = ("worker_id", "model", "last_update", "pred_theta", "qform")

    def __init__(self, worker_id: str, model: RLS, now: float | None) -> None:
        self.worker_id = worker_id
        self.model = model
        self.last_update = now  # None until the first observation
        self.pred_theta = list(model.theta)  # the coefficients predictions use (see LBGRPolicy._refresh)
        self.qform = (0.0,) * 10  # noise_var * P, upper triangle, for the uncertainty penalty


class LBGRPolicy(SeededPolicy):
    name = "lbgr"

    def __init__(
        self,
        c_hit_ms_per_1k: float = 0.0,
        c_miss_ms_per_1k: float = 1000.0,
        min_service_ms: float = 1.0,
        forgetting: float = 0.992,
        rls_p0: float = 10.0,
        residual_half_life_s: float = 5.0,
        residual_stale_after_s: float = 2.0,
        learn_residual: bool = True,
        residual_features: str = "full",
        monotone: bool = True,
        uncertainty_penalty: float = 1.0,
        chars_per_token_prior: float = 4.0,
    ) -> None:
        super().__init__()
        if c_hit_ms_per_1k < 0 or c_miss_ms_per_1k < 0 or min_service_ms < 0:
            raise ValueError("lbgr: cost coefficients must be >= 0")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"lbgr: forgetting must be in (0, 1], got {forgetting}")
        if not rls_p0 > 0:
            raise ValueError(f"lbgr: rls_p0 must be > 0, got {rls_p0}")
        if not residual_half_life_s > 0:
            raise ValueError(f"lbgr: residual_half_life_s must be > 0, got {residual_half_life_s}")
        # per-token costs in seconds (the paper states them per 1k tokens in ms)
        self.c_hit = c_hit_ms_per_1k / 1e6
        self.c_miss = c_miss_ms_per_1k / 1e6
        self.min_service = min_service_ms / 1e3
        self.forgetting = forgetting
        self.rls_p0 = rls_p0
        self.residual_half_life_s = residual_half_life_s
        if residual_stale_after_s < 0:
            raise ValueError(f"lbgr: residual_stale_after_s must be >= 0, got {residual_stale_after_s}")
        self.residual_stale_after_s = residual_stale_after_s
        self._age_rate = math.log(2.0) / residual_half_life_s
        if residual_features not in RESIDUAL_FEATURES:
            raise ValueError(
                f"lbgr: residual_features must be one of {list(RESIDUAL_FEATURES)}, got {residual_features!r}"
            )
        self.learn_residual = learn_residual
        self.residual_features = residual_features
        self.monotone = monotone
        if uncertainty_penalty < 0:
            raise ValueError(f"lbgr: uncertainty_penalty must be >= 0, got {uncertainty_penalty}")
        self.uncertainty_penalty = uncertainty_penalty
        self.chars_per_token = CharsPerTokenEstimator(chars_per_token_prior)
        self._workers: dict[str, _Worker] = {}
        self._packed: dict[str, tuple[float, ...]] = {}  # worker -> prediction tuple (see _refresh)
        # request id -> (worker, features at dispatch, S + W at dispatch)
        self._pending: dict[str, tuple[str, tuple[float, float, float, float], float]] = {}

    # -- model pieces ------------------------------------------------------------------------------
    def hit_tokens(self, request: Request, match_chars: int) -> float:
        if match_chars <= 0:
            return 0.0
        if self.chars_per_token.observations == 0 and request.est_tokens > 0 and request.text:
            hit = match_chars * request.est_tokens / len(request.text)
        else:
            hit = match_chars / self.chars_per_token.ratio
        return min(hit, float(request.est_tokens))

    def service_time(self, request: Request, match_chars: int) -> float:
        hit = self.hit_tokens(request, match_chars)
        s = self.c_hit * hit + self.c_miss * (request.est_tokens - hit)
        return s if s > self.min_service else self.min_service

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(worker_id, RLS(self.forgetting, self.rls_p0), None)
        return w

    def age_factor(self, worker_id: str, now: float) -> float:
        w = self._workers.get(worker_id)
        if w is None or w.last_update is None:
            return 1.0
        dt = now - w.last_update - self.residual_stale_after_s
        return math.exp(-self._age_rate * dt) if dt > 0 else 1.0

    def residual(self, worker_id: str, s: float, load: float, in_flight: int, now: float) -> float:
        w = self._workers.get(worker_id)
        if w is None or w.last_update is None:
            return 0.0
        t = w.pred_theta
        r = t[0] * s + t[1] * load + t[2] * in_flight + t[3]
        dt = now - w.last_update - self.residual_stale_after_s
        return r * math.exp(-self._age_rate * dt) if dt > 0 else r

    def penalty(self, worker_id: str, s: float, load: float, in_flight: int, now: float) -> float:
        """``uncertainty_penalty`` standard deviations of the residual's prediction at (S, W, n): large
        where the worker's recent data never went (extrapolation), aged like the residual."""
        w = self._workers.get(worker_id)
        if w is None or w.last_update is None:
            return 0.0
        a, b, c, d, e, f, g, h, i, j = w.qform
        q = s * (a * s + b * load + c * in_flight + d) + load * (e * load + f * in_flight + g)
        q += in_flight * (h * in_flight + i) + j
        pen = math.sqrt(q) if q > 0.0 else 0.0
        dt = now - w.last_update - self.residual_stale_after_s
        return pen * math.exp(-self._age_rate * dt) if dt > 0 else pen

    def estimate(self, request: Request, view: WorkerView, now: float) -> float:
        s = self.service_time(request, view.match_chars)
        base = s + view.load
        if not self.learn_residual:
            return base
        est = base + self.residual(view.id, s, view.load, view.in_flight, now)
        est += self.penalty(view.id, s, view.load, view.in_flight, now)
        return est if est > s else s

    # -- policy protocol ---------------------------------------------------------------------------
    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        # inlined estimate() for speed: this loop is the routing hot path
        L = float(request.est_tokens)
        c_hit, c_miss, floor = self.c_hit, self.c_miss, self.min_service
        learned = self.chars_per_token.observations > 0
        if learned:
            tokens_per_char = 1.0 / self.chars_per_token.ratio
        else:
            tokens_per_char = (L / len(request.text)) if request.text and L > 0 else 0.0
        packed = self._packed if self.learn_residual else {}
        age_rate = self._age_rate
        exp = math.exp
        best = math.inf
        ties: list[str] = []
        for v in workers:
            hit = v.match_chars * tokens_per_char
            if hit > L:
                hit = L
            s = c_hit * hit + c_miss * (L - hit)
            if s < floor:
                s = floor
            load = v.load
            est = s + load
            pk = packed.get(v.id)
            if pk is not None:
                t0, t1, t2, t3, a, b, c, d, e, f, g, h, i, j, fresh_until = pk
                n = v.in_flight
                r = t0 * s + t1 * load + t2 * n + t3
                q = s * (a * s + b * load + c * n + d) + load * (e * load + f * n + g) + n * (h * n + i) + j
                if q > 0.0:
                    r += sqrt(q)
                if now > fresh_until:
                    r *= exp(-age_rate * (now - fresh_until))
                est += r
                if est < s:
                    est = s
            if est < best - 1e-12:
                best = est
                ties = [v.id]
            elif est <= best + 1e-12:
                ties.append(v.id)
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def on_dispatch(self, request: Request, worker: WorkerView, now: float) -> None:
        s = self.service_time(request, worker.match_chars)
        if self.residual_features == "full":
            x = (s, worker.load, float(worker.in_flight), 1.0)
        else:
            x = (0.0, 0.0, 0.0, 1.0)
        self._pending[request.id] = (worker.id, x, s + worker.load)

    def on_finish(
        self,
        request_id: str,
        worker_id: str,
        now: float,
        ok: bool,
        ttft: float | None,
        e2e: float,
        *,
        prompt_chars: int,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        entry = self._pending.pop(request_id, None)
        if ok and prompt_tokens:
            self.chars_per_token.observe(prompt_chars, prompt_tokens)
        if entry is None or not ok or not self.learn_residual:
            return  # a failed request's latency says nothing about the worker's queue
        wid, x, base = entry
        self.observe(wid, x, e2e - base, now)

    def observe(self, worker_id: str, x: Sequence[float], y: float, now: float) -> None:
        """One residual observation for ``worker_id``: features ``x`` (S, W, n, 1), target ``y``."""
        w = self._worker(worker_id)
        if w.last_update is not None:
            factor = self.age_factor(worker_id, now)
            if factor < 1.0:
                w.model.shrink(factor)
        w.model.update(x, y)
        w.last_update = now if w.last_update is None else max(now, w.last_update)
        self._refresh(w)

    def _refresh(self, w: _Worker) -> None:
        """Coefficients for prediction. With ``monotone``, the estimate S + W + r may not fall as S, W or
        n grow: theta_S >= -1, theta_W >= -1, theta_n >= 0. A fitted model can violate that where its
        data is thin (e.g. a worker's load has just grown past anything it was trained on), and then it
        claims extra load is free — which herds traffic onto that worker until, an e2e later, its
        observations catch up. The fitted model itself is left untouched (RLS stays consistent)."""
        t = w.model.theta
        if self.monotone:
            w.pred_theta = [max(t[0], -1.0), max(t[1], -1.0), max(t[2], 0.0), t[3]]
        else:
            w.pred_theta = list(t)
        p, v = w.model.p, w.model.noise_var * self.uncertainty_penalty**2
        w.qform = (
            v * p[0][0], 2 * v * p[0][1], 2 * v * p[0][2], 2 * v * p[0][3],
            v * p[1][1], 2 * v * p[1][2], 2 * v * p[1][3],
            v * p[2][2], 2 * v * p[2][3],
            v * p[3][3],
        )  # fmt: skip
        if w.last_update is not None:
            # everything choose() needs, in one tuple: coefficients, quadratic form, end of freshness
            fresh_until = w.last_update + self.residual_stale_after_s
            self._packed[w.worker_id] = (*w.pred_theta, *w.qform, fresh_until)

    def on_worker_added(self, worker_id: str) -> None:
        self._worker(worker_id)

    def on_worker_removed(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._packed.pop(worker_id, None)
        # its in-flight requests will never teach us anything: forget them now
        for rid in [rid for rid, entry in self._pending.items() if entry[0] == worker_id]:
            del self._pending[rid]

    def theta(self, worker_id: str) -> list[float]:
        w = self._workers.get(worker_id)
        return [0.0] * N_FEATURES if w is None else list(w.model.theta)
