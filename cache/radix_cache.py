"""``RadixCache``: token radix tree with capacity, locks and eviction (``lru``, ``rlt``, ``rlt-leaf``,
``opt``).

The tree and the policies are Cython (``kvroute.cython_ext.radix_cache``); this module checks the
arguments and builds the future index ``opt`` needs. Semantics: DESIGN.md §2, docs/interfaces.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kvroute.cache._checks import check_int, check_policy, check_seed
from kvroute.cython_ext.radix_cache import POLICY_CODES, FutureIndex, Node, RadixTree

__all__ = ["Node", "RadixCache"]


class RadixCache(RadixTree):
    """Token-id prefix tree holding at most ``capacity_tokens`` tokens.

    ``match_prefix(tokens) -> (hit_len, node)`` (page aligned; touches the path: LRU clock, RLT marks),
    ``insert(tokens) -> new tokens stored`` (evicts through the policy when full, stores only what
    fits when the rest is locked), ``lock(node)`` / ``unlock(node)`` (reference counts up the path),
    ``evict(n_tokens) -> freed`` (unlocked leaves only). ``evictable_size + protected_size ==
    total_size <= capacity_tokens`` at all times.

    Policies: ``lru`` evicts whole least-recently-touched leaves (SGLang); ``rlt`` evicts one page of a
    uniformly drawn unmarked unlocked leaf per draw (seed 004, Algorithm 1), seedable with ``seed``;
    ``rlt-leaf`` is the same marking with whole-leaf draws (a draw evicts the drawn leaf node; SGLang's
    ``unit="leaf"``), so like ``lru`` its ``evict`` may free more than asked; ``opt`` (Belady) needs
    the future and is built with :meth:`with_future`.
    """

    def __init__(
        self, capacity_tokens: int, page_size: int = 1, policy: str = "lru", seed: int | None = None
    ) -> None:
        capacity = check_int("capacity_tokens", capacity_tokens, 0)
        page = check_int("page_size", page_size, 1)
        name = check_policy(policy)
        if name == "opt":
            raise ValueError("policy 'opt' needs the future trace: build it with RadixCache.with_future()")
        super().__init__(capacity, page, POLICY_CODES[name], check_seed(seed))

    @classmethod
    def with_future(
        cls, capacity_tokens: int, trace: Sequence[Sequence[int]], page_size: int = 1
    ) -> RadixCache:
        """A Belady (``opt``) cache for evaluation: ``trace`` lists every future ``insert`` in order.

        ``match_prefix`` may be called at any time; the i-th ``insert`` must equal ``trace[i]`` (after
        page alignment), otherwise ValueError.
        """
        capacity = check_int("capacity_tokens", capacity_tokens, 0)
        page = check_int("page_size", page_size, 1)
        if isinstance(trace, (str, bytes)) or not isinstance(trace, Sequence):
            raise TypeError(f"trace must be a sequence of token sequences, got {type(trace).__name__}")
        paths = [_as_path(tokens, i, page) for i, tokens in enumerate(trace)]
        self = cls.__new__(cls)
        RadixTree.__init__(self, capacity, page, POLICY_CODES["opt"], None, FutureIndex(paths, page))
        return self

    def __repr__(self) -> str:
        return (
            f"RadixCache(capacity_tokens={self.capacity_tokens}, page_size={self.page_size}, "
            f"policy={self.policy!r}, total_size={self.total_size})"
        )


def _as_path(tokens: Sequence[int], index: int, page: int) -> np.ndarray:
    """One trace entry as a page-aligned int64 array; clear errors for bad entries."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"trace[{index}] must hold ints, got dtype {tokens.dtype}")
        arr = tokens.astype(np.int64).ravel()
    else:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise TypeError(f"trace[{index}] must be a sequence of ints, got {type(tokens).__name__}")
        for pos, tok in enumerate(tokens):
            if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool):
                raise TypeError(f"trace[{index}][{pos}] must be an int, got {type(tok).__name__}")
        arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"trace[{index}] holds a negative token id")
    return np.ascontiguousarray(arr[: len(arr) // page * page])
