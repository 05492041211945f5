"""One worker as a continuous-batching engine (SGLang's scheduler, simplified), on a virtual clock.

Per iteration (``step``):
1. prefill budget ``chunk_budget`` tokens: requests already being prefilled continue first (FCFS), then
   waiting requests are admitted in FCFS order while budget is left and fewer than ``max_running`` run;
2. admission: match the prompt (all but its last token, as SGLang does: at least one token is computed)
   in the ``RadixCache``, lock the matched prefix, allocate the uncached prompt plus ``max_tokens`` output
   slots from the KV pool; when the pool is short, ``cache.evict(shortfall)`` frees through the eviction
   policy; if it still does not fit, the head of the queue waits (head-of-line, as SGLang's PrefillAdder);
3. every request whose prefill is complete decodes one token; a request whose last prefill chunk runs in
   this step gets its first token at the end of the step;
4. a request with all ``max_tokens`` output tokens finishes: ``cache.insert(prompt + output)`` (those
   tokens already sit in the pool, so the insert never needs to evict), unlock its prefix, free the pool
   slots of duplicate tokens.

The step's duration comes from the cost model; its events happen at ``now + duration``.

Invariants (tested): ``kv_used_tokens = cache.total_size + private tokens <= kv_capacity_tokens`` after
every call; every admitted request finishes with exactly ``max_tokens`` output tokens; computed prefill
tokens = prompt tokens - cached tokens; nothing stays locked or allocated once the engine is idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.cache import RadixCache
from kvroute.sim.cost_model import CostModel, get_preset
from kvroute.sim.tokenizer import simulated_output

EVICTIONS = ("lru", "rlt", "rlt-leaf")  # RadixCache policies an engine can run (opt needs the future)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    req_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    output: tuple[int, ...]  # the generated token ids


@dataclass(slots=True)
class StepResult:
    """One iteration: it starts at ``start`` and its events happen at ``end = start + duration``."""

    start: float
    duration: float
    first_tokens: list[str] = field(default_factory=list)  # request ids whose first token is out
    tokens: list[tuple[str, int]] = field(default_factory=list)  # every output token produced (id, token)
    finished: list[FinishedRequest] = field(default_factory=list)
    prefill_tokens: int = 0  # prompt tokens computed in this step
    decode_tokens: int = 0  # decode tokens computed in this step (first tokens come from prefill)

    @property
    def end(self) -> float:
        return self.start + self.duration


class _Req:
    __slots__ = (
        "req_id",
        "tokens",
        "max_tokens",
        "submitted",
        "node",
        "cached",
        "computed",
        "allocated",
        "output",
        "planned_output",
    )

    def __init__(self, req_id: str, tokens: Sequence[int], max_tokens: int, submitted: float) -> None:
        self.req_id = req_id
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.submitted = submitted
        self.node = None  # locked cache node once admitted
        self.cached = 0  # prompt tokens served from the cache
        self.computed = 0  # prompt tokens whose KV exists (cached + prefilled so far)
        self.allocated = 0  # pool slots held privately (uncached prompt + output reservation)
        self.output: list[int] = []
        self.planned_output: list[int] = []


class EngineModel:
    """A simulated worker. Not thread-safe; the caller owns the (virtual or wall) clock."""

    def __init__(
        self,
        *,
        preset: str | CostModel = "l40-llama3.1-8b",
        kv_capacity_tokens: int = 200_000,
        eviction: str = "lru",
        max_running: int | None = None,
        chunk_budget: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.cost: CostModel = get_preset(preset)
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose one of {', '.join(EVICTIONS)}")
        if (
            isinstance(kv_capacity_tokens, bool)
            or not isinstance(kv_capacity_tokens, int)
            or kv_capacity_tokens < 2
        ):
            raise ValueError(f"kv_capacity_tokens must be an int >= 2, got {kv_capacity_tokens!r}")
        max_running = self.cost.default_max_running if max_running is None else max_running
        chunk_budget = self.cost.default_chunk_budget if chunk_budget is None else chunk_budget
        for name, value in (("max_running", max_running), ("chunk_budget", chunk_budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.eviction = eviction
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_running = max_running
        self.chunk_budget = chunk_budget
        self.cache = RadixCache(kv_capacity_tokens, page_size=1, policy=eviction, seed=seed)
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._live: dict[str, _Req] = {}
        self._private = 0  # pool slots held by running requests outside the tree
        self._clock = float("-inf")
        # counters
        self.steps = 0
        self.busy_s = 0.0
        self.prompt_tokens = 0  # of finished requests
        self.cached_tokens = 0  # of finished requests
        self.prefill_tokens_computed = 0
        self.decode_tokens_computed = 0
        self.finished_requests = 0
        self.evicted_tokens = 0
        self.peak_kv_used_tokens = 0

    # -- inspection ----------------------------------------------------------------------------------
    @property
    def kv_used_tokens(self) -> int:
        """Pool slots in use: the cache tree plus running requests' private slots."""
        return self.cache.total_size + self._private

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, over waiting and running requests (upper bound for waiting)."""
        waiting = sum(len(r.tokens) for r in self._waiting)
        return waiting + sum(len(r.tokens) - r.computed for r in self._running)

    def metrics(self) -> dict[str, float]:
        """Engine gauges under SGLang's metric names (what a live router scrapes)."""
        prompt = self.prompt_tokens
        return {
            "num_running_reqs": float(len(self._running)),
            "num_queue_reqs": float(len(self._waiting)),
            "token_usage": self.kv_used_tokens / self.kv_capacity_tokens,
            "cache_hit_rate": (self.cached_tokens / prompt) if prompt else 0.0,
            "prompt_tokens_total": float(prompt),
            "cached_tokens_total": float(self.cached_tokens),
        }

    # -- requests ------------------------------------------------------------------------------------
    def submit(
        self,
        req_id: str,
        tokens: Sequence[int],
        max_tokens: int,
        now: float,
        output: Sequence[int] | None = None,
    ) -> None:
        """Queue a request (FCFS). Raises ValueError for a duplicate id or a request that can never fit.

        ``output``: the tokens to generate (a replayed trace's outputs), at least ``max_tokens`` of them;
        default: ``simulated_output(req_id, max_tokens)``.
        """
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty str, got {req_id!r}")
        if req_id in self._live:
            raise ValueError(f"request {req_id!r} is already in this engine")
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise TypeError(
                f"request {req_id!r}: tokens must be a sequence of ints, got {type(tokens).__name__}"
            )
        if len(tokens) == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt")
        try:
            lowest = min(tokens)  # C loop: catches negative ids and mixed types before they reach the cache
        except TypeError:
            raise TypeError(f"request {req_id!r}: tokens must be ints") from None
        if lowest < 0:
            raise ValueError(f"request {req_id!r}: token ids must be >= 0, got {lowest}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if len(tokens) + max_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"request {req_id!r} needs {len(tokens) + max_tokens} KV slots, more than the pool's "
                f"{self.kv_capacity_tokens}"
            )
        if output is not None:
            if len(output) < max_tokens:
                raise ValueError(
                    f"request {req_id!r}: output has {len(output)} tokens, max_tokens is {max_tokens}"
                )
            planned = [int(t) for t in output[:max_tokens]]
            if any(t < 0 for t in planned):
                raise ValueError(f"request {req_id!r}: output token ids must be >= 0")
        else:
            planned = simulated_output(req_id, max_tokens)
        req = _Req(req_id, tokens, max_tokens, now)
        req.planned_output = planned
        self._live[req_id] = req
        self._waiting.append(req)

    def abort(self, req_id: str) -> bool:
        """Drop a waiting or running request, releasing its lock and slots. False if unknown."""
        req = self._live.pop(req_id, None)
        if req is None:
            return False
        if req.node is None:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._release(req)
        return True

    def _release(self, req: _Req) -> None:
        self._private -= req.allocated
        req.allocated = 0
        self.cache.unlock(req.node)
        req.node = None

    # -- one iteration -------------------------------------------------------------------------------
    def _try_admit(self, req: _Req) -> bool:
        cache = self.cache
        hit, node = cache.match_prefix(req.tokens[:-1])
        cache.lock(node)
        need = len(req.tokens) - hit + req.max_tokens
        free = self.kv_capacity_tokens - cache.total_size - self._private
        if free < need:
            self.evicted_tokens += cache.evict(need - free)
            free = self.kv_capacity_tokens - cache.total_size - self._private
            if free < need:
                cache.unlock(node)
                return False
        req.node = node
        req.cached = req.computed = hit
        req.allocated = need
        self._private += need
        return True

    def step(self, now: float) -> StepResult:
        """Run one iteration starting at ``now`` (see the module doc). An idle engine returns duration 0."""
        if now < self._clock:
            raise ValueError(f"time went backwards: step at {now} after a step at {self._clock}")
        self._clock = now
        result = StepResult(start=now, duration=0.0)
        budget = self.chunk_budget
        prefill: list[tuple[_Req, int]] = []
        decoding: list[_Req] = []
        for req in self._running:
            remaining = len(req.tokens) - req.computed
            if remaining > 0:
                if budget > 0:
                    n = min(remaining, budget)
                    budget -= n
                    prefill.append((req, n))
            else:
                decoding.append(req)
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < self.max_running:
            req = waiting[0]
            if not self._try_admit(req):
                break
            waiting.popleft()
            self._running.append(req)
            n = min(len(req.tokens) - req.computed, budget)
            budget -= n
            prefill.append((req, n))
        if not prefill and not decoding:
            return result

        duration = self.cost.step_time(
            [(n, req.computed) for req, n in prefill], [len(req.tokens) + len(req.output) for req in decoding]
        )
        result.duration = duration
        self.steps += 1
        self.busy_s += duration

        done: list[_Req] = []
        for req, n in prefill:
            req.computed += n
            result.prefill_tokens += n
            if req.computed == len(req.tokens):
                token = req.planned_output[0]
                req.output.append(token)
                result.first_tokens.append(req.req_id)
                result.tokens.append((req.req_id, token))
                if len(req.output) == req.max_tokens:
                    done.append(req)
        for req in decoding:
            token = req.planned_output[len(req.output)]
            req.output.append(token)
            result.tokens.append((req.req_id, token))
            result.decode_tokens += 1
            if len(req.output) == req.max_tokens:
                done.append(req)
        self.prefill_tokens_computed += result.prefill_tokens
        self.decode_tokens_computed += result.decode_tokens
        # the peak is reached before finishing requests hand their slots to the tree
        used = self.cache.total_size + self._private
        if used > self.peak_kv_used_tokens:
            self.peak_kv_used_tokens = used

        if done:
            finished_ids = set()
            for req in done:
                self.cache.insert(list(req.tokens) + req.output)
                self._release(req)
                finished_ids.add(req.req_id)
                del self._live[req.req_id]
                self.prompt_tokens += len(req.tokens)
                self.cached_tokens += req.cached
                self.finished_requests += 1
                result.finished.append(
                    FinishedRequest(
                        req.req_id, len(req.tokens), req.cached, len(req.output), tuple(req.output)
                    )
                )
            self._running = [r for r in self._running if r.req_id not in finished_ids]
        return result
