"""Token-level trace generators for the cache benchmarks and the simulator.

A trace is a list of requests; one request is ``(prompt_tokens, output_tokens)``, both lists of token
ids drawn from ``range(VOCAB)`` so that ``kvroute.sim.tokenizer`` can turn any trace into text.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
from kvroute.cache._checks import check_int

VOCAB = 32000
GSP_LENGTHS = (512, 1024, 2048, 4096, 8192)
ORDERS = ("round_robin", "random")

Request = tuple[list[int], list[int]]


def gsp(
    groups: int = 64,
    queries_per_group: int = 32,
    lengths: Sequence[int] = GSP_LENGTHS,
    prefix_ratio: float = 0.5,
    order: str = "round_robin",
    output_tokens: int = 4,
    seed: int = 0,
) -> list[Request]:
    """Generated Shared Prefix workload (seed 004, Appendix A).

    Group ``g`` has prompt length ``lengths[g % len(lengths)]``; its queries share the first
    ``round(length * prefix_ratio)`` tokens (the group prefix) and differ in the rest (a suffix drawn
    per query). Each query carries ``output_tokens`` output tokens of its own. All ids are uniform in
    ``range(32000)``, seeded by ``seed``.

    ``order="round_robin"`` is the worst case for one worker: turn ``t`` issues query ``t`` of every
    group in group order. ``order="random"`` shuffles all queries (seeded).
    """
    check_int("groups", groups, 1)
    check_int("queries_per_group", queries_per_group, 1)
    check_int("output_tokens", output_tokens, 0)
    check_int("seed", seed, 0)
    lengths = [check_int("lengths[i]", n, 1) for n in lengths]
    if not lengths:
        raise ValueError("lengths must not be empty")
    if not 0.0 <= float(prefix_ratio) <= 1.0:
        raise ValueError(f"prefix_ratio must be in [0, 1], got {prefix_ratio}")
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")
    rng = np.random.default_rng(seed)
    per_group: list[list[Request]] = []
    for g in range(groups):
        length = lengths[g % len(lengths)]
        n_prefix = round(length * float(prefix_ratio))
        prefix = rng.integers(0, VOCAB, n_prefix).tolist()
        suffixes = rng.integers(0, VOCAB, (queries_per_group, length - n_prefix)).tolist()
        outputs = rng.integers(0, VOCAB, (queries_per_group, output_tokens)).tolist()
        per_group.append([(prefix + suffixes[q], outputs[q]) for q in range(queries_per_group)])
    requests = [per_group[g][q] for q in range(queries_per_group) for g in range(groups)]
    if order == "random":
        perm = rng.permutation(len(requests))
        requests = [requests[i] for i in perm]
    return requests


def add_gsp_arguments(parser: argparse.ArgumentParser) -> None:
    """The GSP trace's command-line options, with seed 004's worst case (gsp-rr) as the defaults; the
    engine eviction benches share them so both replay the same trace."""
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--prefix-ratio", type=float, default=0.5)
    parser.add_argument("--order", default="round_robin", choices=("round_robin", "random"))
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


def gsp_from_args(args: argparse.Namespace) -> list[Request]:
    """``gsp(...)`` from the options ``add_gsp_arguments`` defined; ValueError/TypeError on bad ones."""
    return gsp(
        groups=args.groups,
        queries_per_group=args.queries,
        prefix_ratio=args.prefix_ratio,
        order=args.order,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )


def named_trace(name: str, seed: int = 0) -> tuple[list[Request], int]:
    """The benchmark traces: ``gsp-rr`` (worst case, 190k cache) and ``gsp-random`` (200k cache).

    Returns ``(requests, default_capacity_tokens)``.
    """
    if name == "gsp-rr":
        return gsp(order="round_robin", seed=seed), 190_000
    if name == "gsp-random":
        return gsp(order="random", seed=seed), 200_000
    raise ValueError(f"unknown trace {name!r}: choose gsp-rr or gsp-random")
