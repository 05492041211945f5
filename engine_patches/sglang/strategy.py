"""``rlt`` as an entry of SGLang's eviction-strategy factory table (``sglang.srt.mem_cache.utils``).

The table maps ``--radix-eviction-policy`` names to ``EvictionStrategy`` classes built with the keyword
arguments of ``--radix-eviction-policy-config``. RLT's victims are not a priority order, so the trees
built with ``rlt`` choose device victims through ``radix.py`` / ``unified.py``; this class carries the
configuration (seed, capacity) and gives the tiers RLT does not replace (the HiCache host tier) SGLang's
LRU order.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

POLICY_NAME = "rlt"
UNITS = ("page", "leaf")  # what one RLT draw evicts


class RLTStrategy(EvictionStrategy):
    """Configuration of RLT: ``seed`` (same on every TP rank, so replicated trees pick the same victims),
    an optional ``capacity_tokens`` (the phase size k; default: the KV pool size) and ``unit``, what
    one draw evicts:

    - ``"page"`` (default): the drawn leaf's last page — seed 004's leaf-token draw exactly (a page is
      one token at page_size 1). A call that frees n pages makes n draws, which spread over nearly every
      unmarked leaf, so each call trims many leaves;
    - ``"leaf"``: the whole drawn leaf (a uniformly random unmarked leaf *node*, evicted by SGLang's own
      code as LRU evicts its victim). A radix node is split wherever accesses diverge, so its tokens
      share their marks; a call touches about as many leaves as LRU's does, at the price of freeing a
      whole leaf where page draws would nibble many.
    """

    def __init__(self, seed: int = 0, capacity_tokens: int | None = None, unit: str = "page") -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"rlt: seed must be a non-negative int, got {seed!r}")
        if capacity_tokens is not None and (
            not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool) or capacity_tokens <= 0
        ):
            raise ValueError(f"rlt: capacity_tokens must be a positive int, got {capacity_tokens!r}")
        if unit not in UNITS:
            raise ValueError(f"rlt: unit must be one of {list(UNITS)}, got {unit!r}")
        self.seed = seed
        self.capacity_tokens = capacity_tokens
        self.unit = unit

    def get_priority(self, node: Any) -> float:
        # Only read by tiers RLT leaves to SGLang (host tier of HiCache): LRU order there.
        return node.last_access_time


def install_factory_entry() -> None:
    """Add ``rlt`` to SGLang's factory table (idempotent)."""
    from sglang.srt.mem_cache import utils

    utils._EVICTION_POLICY_FACTORIES.setdefault(POLICY_NAME, RLTStrategy)


def resolve_capacity(strategy: Any, allocator: Any) -> int:
    """The phase size k in tokens: the configured one, else the allocator's (full-attention) pool size."""
    configured = getattr(strategy, "capacity_tokens", None)
    if configured is not None:
        return int(configured)
    if allocator is None:
        raise ValueError(
            "rlt needs the KV pool size: build the cache with a token_to_kv_pool_allocator or pass "
            "--radix-eviction-policy-config '{\"capacity_tokens\": N}'"
        )
    size = getattr(allocator, "size_full", None)
    if size is None:
        size = allocator.size
    return int(size)
