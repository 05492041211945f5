"""``lodestar`` (seed 000, Lodestar): an online-learned TTFT predictor routes to the lowest prediction.

One MLP (3 hidden layers x 128, ReLU, dropout 0.1 while training; numpy only) is shared by all workers
and scores each (request, worker) feature vector; instance identity is never an input. Per feature
vector (the paper's request / expected-hit / instance-state groups, as far as a router sees them):

    log1p(prompt tokens), expected hit ratio, in-flight requests, in-flight prefill tokens / 1k,
    in-flight decode tokens / 1k (max_tokens of requests past their first token), KV-cache usage
    (engine metric ``kv_cache_usage``, ``gpu_cache_usage_perc`` or ``token_usage``; 0 if none).

Learning: each dispatched request becomes a sample (features of the chosen worker, observed TTFT — or
e2e if the caller never reports a first token). Samples go to a FIFO buffer of 5000; samples leaving it
enter a replay buffer of 5000 (reservoir sampling over everything that left the FIFO: a simplification
of the paper's gradient-coreset admission that keeps the buffer diverse rather than merely old). Every
1000 new samples a retrain on FIFO u replay starts (warm start, Adam, z-scored inputs and target).
Training never runs inside ``choose``: it advances by ``steps_per_call`` mini-batch steps in each
``on_first_token`` / ``on_finish`` call (bounded work per call), and the new weights replace the old
ones only when the round completes.

Routing (Algorithm 4): cold start (no trained model yet) or any candidate feature outside the range
seen in training (+/- ``ood_margin`` of that range) -> fallback heuristic; else with probability
``epsilon`` a uniform random worker; else the lowest predicted TTFT, uniformly among predictions within
``tie_margin`` (relative) of the best. The heuristic is Lodestar's baseline, AIBrix's
prefix-cache-and-load (Appendix A, Algorithm 1): least in-flight if max - min > 8, else the best prefix
match whose in-flight count is <= mean + 1 std, else least in-flight. The consistent-hashing K-filter
(cluster-saturation mode) is not implemented.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np
from kvroute.router.policies._common import SeededPolicy, argmin_random
from kvroute.router.state import CharsPerTokenEstimator
from kvroute.router.types import Request, WorkerView
from threadpoolctl import ThreadpoolController

N_FEATURES = 6

# The network is tiny: multi-threaded BLAS only adds synchronisation (on a busy 2-core machine a training
# step took 70 ms with 2 BLAS threads and 5 ms with 1), so the policy's numpy work runs single-threaded.
_BLAS = ThreadpoolController()


def _single_threaded():  # noqa: ANN202 - a threadpoolctl context manager
    return _BLAS.limit(limits=1, user_api="blas")


_KV_METRICS = ("kv_cache_usage", "gpu_cache_usage_perc", "token_usage")


class MLP:
    """Fully connected ReLU network with a scalar output, trained by Adam on squared error."""

    def __init__(self, n_in: int, hidden: int, depth: int, rng: np.random.Generator) -> None:
        sizes = [n_in] + [hidden] * depth + [1]
        self.weights = [
            rng.normal(0.0, math.sqrt(2.0 / a), size=(a, b)) for a, b in zip(sizes, sizes[1:], strict=False)
        ]
        self.biases = [np.zeros(b) for b in sizes[1:]]
        self._m = [np.zeros_like(p) for p in self.params]
        self._v = [np.zeros_like(p) for p in self.params]
        self._t = 0

    @property
    def params(self) -> list[np.ndarray]:
        return self.weights + self.biases

    def copy(self) -> MLP:
        twin = MLP.__new__(MLP)
        twin.weights = [w.copy() for w in self.weights]
        twin.biases = [b.copy() for b in self.biases]
        twin._m = [m.copy() for m in self._m]
        twin._v = [v.copy() for v in self._v]
        twin._t = self._t
        return twin

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = x
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=False)):
            h = h @ w + b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return h[:, 0]

    def train_step(
        self, x: np.ndarray, y: np.ndarray, lr: float, dropout: float, rng: np.random.Generator
    ) -> float:
        acts = [x]
        masks: list[np.ndarray | None] = []
        h = x
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=False)):
            h = h @ w + b
            if i < last:
                h = np.maximum(h, 0.0)
                if dropout > 0.0:
                    mask = (rng.random(h.shape) >= dropout) / (1.0 - dropout)
                    h = h * mask
                    masks.append(mask)
                else:
                    masks.append(None)
            acts.append(h)
        pred = h[:, 0]
        err = pred - y
        loss = float(np.mean(err * err))
        grad = (2.0 / len(y)) * err[:, None]
        gw: list[np.ndarray] = [np.empty(0)] * len(self.weights)
        gb: list[np.ndarray] = [np.empty(0)] * len(self.weights)
        for i in range(last, -1, -1):
            gw[i] = acts[i].T @ grad
            gb[i] = grad.sum(axis=0)
            if i > 0:
                grad = grad @ self.weights[i].T
                mask = masks[i - 1]
                if mask is not None:
                    grad = grad * mask
                grad = grad * (acts[i] > 0.0)
        self._t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for k, (p, g) in enumerate(zip(self.params, gw + gb, strict=False)):
            self._m[k] = b1 * self._m[k] + (1 - b1) * g
            self._v[k] = b2 * self._v[k] + (1 - b2) * g * g
            m_hat = self._m[k] / (1 - b1**self._t)
            v_hat = self._v[k] / (1 - b2**self._t)
            p -= lr * m_hat / (np.sqrt(v_hat) + eps)
        return loss


class _TrainingRound:
    """One retrain in progress: a frozen data set and a model copy advanced a few steps at a time."""

    def __init__(
        self, model: MLP, x: np.ndarray, y: np.ndarray, epochs: int, batch: int, rng: np.random.Generator
    ):
        self.model = model
        self.x_mean = x.mean(axis=0)
        self.x_std = x.std(axis=0) + 1e-6
        self.y_mean = float(y.mean())
        self.y_std = float(y.std()) + 1e-6
        self.lo = x.min(axis=0)
        self.hi = x.max(axis=0)
        self.x = (x - self.x_mean) / self.x_std
        self.y = (y - self.y_mean) / self.y_std
        self.batch = min(batch, len(y))
        self.steps_left = epochs * math.ceil(len(y) / self.batch)
        self.rng = rng
        self.loss = math.nan

    def step(self, n_steps: int, lr: float, dropout: float) -> bool:
        """Runs up to ``n_steps`` mini-batches; True when the round is complete."""
        for _ in range(min(n_steps, self.steps_left)):
            idx = self.rng.integers(0, len(self.y), size=self.batch)
            self.loss = self.model.train_step(self.x[idx], self.y[idx], lr, dropout, self.rng)
            self.steps_left -= 1
        return self.steps_left <= 0


class LodestarPolicy(SeededPolicy):
    name = "lodestar"

    def __init__(
        self,
        retrain_every: int = 1000,
        fifo_size: int = 5000,
        replay_size: int = 5000,
        min_samples: int = 1000,
        epsilon: float = 0.05,
        tie_margin: float = 0.02,
        ood_margin: float = 0.1,
        hidden: int = 128,
        depth: int = 3,
        epochs: int = 3,
        batch_size: int = 64,
        lr: float = 1e-3,
        dropout: float = 0.1,
        steps_per_call: int = 1,
        imbalance_threshold: int = 8,
        overload_std_factor: float = 1.0,
        chars_per_token_prior: float = 4.0,
    ) -> None:
        super().__init__()
        for label, value in (
            ("retrain_every", retrain_every),
            ("fifo_size", fifo_size),
            ("min_samples", min_samples),
            ("hidden", hidden),
            ("depth", depth),
            ("epochs", epochs),
            ("batch_size", batch_size),
            ("steps_per_call", steps_per_call),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lodestar: {label} must be a positive int, got {value!r}")
        if replay_size < 0:
            raise ValueError(f"lodestar: replay_size must be >= 0, got {replay_size}")
        if not 0.0 <= epsilon <= 1.0 or not 0.0 <= dropout < 1.0:
            raise ValueError("lodestar: epsilon must be in [0, 1] and dropout in [0, 1)")
        if tie_margin < 0 or ood_margin < 0 or lr <= 0:
            raise ValueError("lodestar: tie_margin and ood_margin must be >= 0, lr > 0")
        self.retrain_every = retrain_every
        self.min_samples = min_samples
        self.epsilon = epsilon
        self.tie_margin = tie_margin
        self.ood_margin = ood_margin
        self.hidden, self.depth = hidden, depth
        self.epochs, self.batch_size, self.lr, self.dropout = epochs, batch_size, lr, dropout
        self.steps_per_call = steps_per_call
        self.imbalance_threshold = imbalance_threshold
        self.overload_std_factor = overload_std_factor
        self.chars_per_token = CharsPerTokenEstimator(chars_per_token_prior)
        self.fifo: deque[tuple[np.ndarray, float]] = deque()
        self.fifo_size = fifo_size
        self.replay: list[tuple[np.ndarray, float]] = []
        self.replay_size = replay_size
        self._left_fifo = 0
        self.samples_seen = 0
        self._since_retrain = 0
        self.np_rng = np.random.default_rng()
        self.model: MLP | None = None  # the serving model (None while cold)
        self._norm: tuple[np.ndarray, np.ndarray, float, float, np.ndarray, np.ndarray] | None = None
        self._round: _TrainingRound | None = None
        self.rounds_completed = 0
        self.last_decision = "cold"  # cold | ood | explore | model (for tests and metrics)
        self._pending: dict[str, tuple[str, np.ndarray, int]] = {}  # id -> (worker, features, max_tokens)
        self._decode_tokens: dict[str, float] = {}
        self._decoding: set[str] = set()

    def bind(self, seed: int | None) -> None:
        super().bind(seed)
        self.np_rng = np.random.default_rng(None if seed is None else [seed, 0x10DE57A2])

    # -- features ----------------------------------------------------------------------------------
    def _hit_tokens(self, request: Request, match_chars: int) -> float:
        if match_chars <= 0:
            return 0.0
        if self.chars_per_token.observations == 0 and request.est_tokens > 0 and request.text:
            hit = match_chars * request.est_tokens / len(request.text)
        else:
            hit = match_chars / self.chars_per_token.ratio
        return min(hit, float(request.est_tokens))

    def _row(self, request: Request, view: WorkerView, log_tokens: float) -> list[float]:
        tokens = float(request.est_tokens)
        hit_ratio = self._hit_tokens(request, view.match_chars) / tokens if tokens > 0 else 0.0
        kv = 0.0
        metrics = view.metrics
        if metrics:
            for key in _KV_METRICS:
                if key in metrics:
                    kv = float(metrics[key])
                    break
        return [
            log_tokens,
            hit_ratio,
            float(view.in_flight),
            view.queued_prefill_tokens / 1000.0,
            self._decode_tokens.get(view.id, 0.0) / 1000.0,
            kv,
        ]

    def features(self, request: Request, view: WorkerView) -> np.ndarray:
        """The feature vector of routing ``request`` to ``view`` (see the module docstring)."""
        return np.array(self._row(request, view, math.log1p(request.est_tokens)))

    def feature_matrix(self, request: Request, views: Sequence[WorkerView]) -> np.ndarray:
        log_tokens = math.log1p(request.est_tokens)
        return np.array([self._row(request, v, log_tokens) for v in views])

    # -- decisions ---------------------------------------------------------------------------------
    def heuristic(self, request: Request, workers: Sequence[WorkerView]) -> str:
        loads = [v.in_flight for v in workers]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return argmin_random(workers, lambda v: v.in_flight, self.rng).id
        mean = sum(loads) / len(loads)
        std = math.sqrt(sum((c - mean) ** 2 for c in loads) / len(loads))
        limit = mean + self.overload_std_factor * std
        ranked = sorted(workers, key=lambda v: (-v.match_chars, v.in_flight))
        for v in ranked:
            if v.match_chars > 0 and v.in_flight <= limit:
                return v.id
        return argmin_random(workers, lambda v: v.in_flight, self.rng).id

    def predict(self, feats: np.ndarray) -> np.ndarray:
        """Predicted TTFT (seconds) per feature row; requires a trained model."""
        if self.model is None or self._norm is None:
            raise RuntimeError("lodestar: no trained model yet")
        x_mean, x_std, y_mean, y_std, _, _ = self._norm
        with _single_threaded():
            return self.model.forward((feats - x_mean) / x_std) * y_std + y_mean

    def _in_range(self, feats: np.ndarray) -> bool:
        assert self._norm is not None
        lo, hi = self._norm[4], self._norm[5]
        slack = self.ood_margin * (hi - lo)
        return bool(np.all(feats >= lo - slack) and np.all(feats <= hi + slack))

    def choose(self, request: Request, workers: Sequence[WorkerView], now: float) -> str:
        if self.model is None:
            self.last_decision = "cold"
            return self.heuristic(request, workers)
        feats = self.feature_matrix(request, workers)
        if not self._in_range(feats):
            self.last_decision = "ood"
            return self.heuristic(request, workers)
        if self.rng.random() < self.epsilon:
            self.last_decision = "explore"
            return workers[self.rng.randrange(len(workers))].id
        self.last_decision = "model"
        pred = self.predict(feats)
        best = float(pred.min())
        near = [i for i, p in enumerate(pred) if p <= best + self.tie_margin * abs(best)]
        return workers[near[0] if len(near) == 1 else near[self.rng.randrange(len(near))]].id

    # -- lifecycle ---------------------------------------------------------------------------------
    def on_dispatch(self, request: Request, worker: WorkerView, now: float) -> None:
        self._pending[request.id] = (worker.id, self.features(request, worker), request.max_tokens)

    def on_first_token(self, request_id: str, worker_id: str, now: float, ttft: float) -> None:
        entry = self._pending.get(request_id)
        if entry is not None and request_id not in self._decoding:
            wid, feats, max_tokens = entry
            self._decoding.add(request_id)
            self._decode_tokens[wid] = self._decode_tokens.get(wid, 0.0) + max_tokens
            self.add_sample(feats, ttft)
        self.train_increment()

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
        if ok and prompt_tokens:
            self.chars_per_token.observe(prompt_chars, prompt_tokens)
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            wid, feats, max_tokens = entry
            if request_id in self._decoding:
                self._decoding.discard(request_id)
                left = self._decode_tokens.get(wid, 0.0) - max_tokens
                self._decode_tokens[wid] = left if left > 1e-9 else 0.0
            elif ok:
                self.add_sample(feats, e2e if ttft is None else ttft)  # no first-token report
        self.train_increment()

    def on_worker_removed(self, worker_id: str) -> None:
        self._decode_tokens.pop(worker_id, None)

    # -- learning ----------------------------------------------------------------------------------
    def add_sample(self, feats: np.ndarray, ttft: float) -> None:
        if not math.isfinite(ttft) or ttft < 0:
            return
        self.fifo.append((feats, float(ttft)))
        if len(self.fifo) > self.fifo_size:
            old = self.fifo.popleft()
            self._left_fifo += 1
            if len(self.replay) < self.replay_size:
                self.replay.append(old)
            elif self.replay_size > 0:
                j = self.rng.randrange(self._left_fifo)  # reservoir: uniform over all that left
                if j < self.replay_size:
                    self.replay[j] = old
        self.samples_seen += 1
        self._since_retrain += 1
        if (
            self._round is None
            and self.samples_seen >= self.min_samples
            and (self.model is None or self._since_retrain >= self.retrain_every)
        ):
            self._start_round()

    def _start_round(self) -> None:
        data = list(self.fifo) + self.replay
        x = np.stack([f for f, _ in data])
        y = np.array([t for _, t in data])
        if self.model is None:
            base = MLP(N_FEATURES, self.hidden, self.depth, self.np_rng)
        else:
            base = self.model.copy()
        self._round = _TrainingRound(base, x, y, self.epochs, self.batch_size, self.np_rng)
        self._since_retrain = 0

    def train_increment(self) -> None:
        """Advances the running retrain by at most ``steps_per_call`` mini-batches (bounded work)."""
        r = self._round
        if r is None:
            return
        with _single_threaded():
            done = r.step(self.steps_per_call, self.lr, self.dropout)
        if done:
            self.model = r.model
            self._norm = (r.x_mean, r.x_std, r.y_mean, r.y_std, r.lo, r.hi)
            self._round = None
            self.rounds_completed += 1

    def train_until_ready(self, max_steps: int = 1_000_000) -> None:
        """Finishes the running round at once (offline use: tests, warm-up before serving)."""
        steps = 0
        while self._round is not None and steps < max_steps:
            self.train_increment()
            steps += self.steps_per_call

    @property
    def training(self) -> bool:
        return self._round is not None

    @property
    def training_steps_left(self) -> int:
        """Mini-batch steps left in the running retrain (0 when none is running)."""
        return 0 if self._round is None else self._round.steps_left
